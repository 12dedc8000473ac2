"""Multi-host start-up and this process's share of a global batch (the watchdog that ends the run when a
host fails is ``jaxgrpo.parallel.watchdog``, re-exported here).

Launch one process per host (or per GPU/CPU slice); every process runs the same program. The mesh of
:func:`jaxgrpo.parallel.sharding.make_mesh` then spans every process's devices, and each process feeds its own
rows of the batch (:func:`jaxgrpo.parallel.sharding.process_batch_rows` and
``jaxgrpo.parallel.sharding.place_batch(..., process_local=True)``).

- TPU pods, Slurm and Open MPI: ``initialize()`` with no arguments (JAX detects the cluster).
- Anything else: ``initialize("host0:1234", num_processes=N, process_id=i)`` on every process, or
  set ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.
- CPU processes communicate through gloo (the default here), which is how the tests run it.

Moving rows between the global batch and the hosts:

- :func:`process_rows`: this process's rows of global arrays (a rollout sampled on the global mesh),
  as NumPy: what this host decodes and scores;
- :func:`all_rows`: every process's rows (this process passes its own), in row order, on every
  process: small per-row results (rewards, lengths, correct flags) that every host needs;
- :func:`to_host`: whole arrays on every process; :func:`gather_objects`: one JSON-able object per
  process (counters).

**Failures.** A process that dies or raises leaves the others inside a collective that can never
complete: :class:`HostWatchdog` (started by :func:`watch_hosts`, exit status :data:`EXIT_HOST_FAILED`) makes that a
bounded, named stop. It is ``jaxgrpo.parallel.watchdog``, re-exported here.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxgrpo.parallel import sharding as shd
from jaxgrpo.parallel.watchdog import EXIT_HOST_FAILED, HostWatchdog, watch_hosts

__all__ = [
  "EXIT_HOST_FAILED",
  "HostWatchdog",
  "all_rows",
  "cluster_detected",
  "gather_objects",
  "initialize",
  "process_rows",
  "to_host",
  "watch_hosts",
]

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _int_env(name: str) -> int | None:
  v = os.environ.get(name)
  try:
    return int(v) if v not in (None, "") else None
  except ValueError:
    raise ValueError(f"environment variable {name}={v!r} must be an integer") from None


def cluster_detected() -> str | None:
  """The multi-process cluster JAX can configure itself from (``"tpu"``, ``"slurm"``, ``"mpi"``), or
  None on a single host / single process."""
  if "," in os.environ.get("TPU_WORKER_HOSTNAMES", "") or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
    return "tpu"
  if os.environ.get("SLURM_JOB_ID") and (_int_env("SLURM_NTASKS") or 1) > 1:
    return "slurm"
  if (_int_env("OMPI_COMM_WORLD_SIZE") or 1) > 1:
    return "mpi"
  return None


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  local_device_ids=None,
  cpu_collectives: str = "gloo",
  initialization_timeout: int = 300,
  heartbeat_timeout: int = 100,
) -> bool:
  """Start JAX's distributed runtime when this is a multi-process run.

  Args:
    coordinator_address: ``"host:port"`` of process 0 (reachable from every process).
    num_processes: total number of processes.
    process_id: this process's index in ``[0, num_processes)``.
    local_device_ids: optional devices this process owns (default: all it sees).
    cpu_collectives: collectives for the CPU backend (``"gloo"``; ``"mpi"`` where built in).
    initialization_timeout: seconds to wait for every process to connect.
    heartbeat_timeout: seconds after which JAX's coordination service declares a silent process
      dead and terminates every other process (a C++ fatal error, exit status 134). Keep it above
      :class:`HostWatchdog`'s ``timeout_s`` so that the watchdog's named stop comes first
      (``scripts/train.py`` passes twice ``devices.host_timeout_s``).

  Explicit arguments win, then the ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
  ``JAX_PROCESS_ID`` environment variables, then automatic detection (TPU pod, Slurm, Open MPI).
  With none of these it does nothing (a single process).

  Returns:
    True if the distributed runtime was started, False for a single process.

  Raises:
    ValueError: an incomplete or inconsistent set of flags (named), before anything is started.
  """
  address = coordinator_address or os.environ.get(_ENV[0]) or None
  n = num_processes if num_processes is not None else _int_env(_ENV[1])
  pid = process_id if process_id is not None else _int_env(_ENV[2])
  if not isinstance(heartbeat_timeout, int) or isinstance(heartbeat_timeout, bool) or heartbeat_timeout < 1:
    raise ValueError(f"heartbeat_timeout must be an int >= 1 (seconds); got {heartbeat_timeout!r}")
  start = lambda *args: jax.distributed.initialize(
    *args,
    local_device_ids=local_device_ids,
    initialization_timeout=initialization_timeout,
    heartbeat_timeout_seconds=heartbeat_timeout,
  )
  explicit = {"coordinator_address": address, "num_processes": n, "process_id": pid}
  if any(v is not None for v in explicit.values()):
    missing = [k for k, v in explicit.items() if v is None]
    if missing and cluster_detected() is None:
      raise ValueError(
        f"distributed.initialize: {', '.join(missing)} missing; give coordinator_address "
        f"('host:port'), num_processes and process_id together (flags or {', '.join(_ENV)})"
      )
    if address is not None and not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", address):
      raise ValueError(f"coordinator_address must be 'host:port'; got {address!r}")
    if n is not None and (not isinstance(n, int) or n < 1):
      raise ValueError(f"num_processes must be an int >= 1; got {n!r}")
    if pid is not None and n is not None and not 0 <= pid < n:
      raise ValueError(f"process_id must be in [0, num_processes={n}); got {pid!r}")
    if n == 1:
      return False
    _cpu_settings(cpu_collectives)
    start(address, n, pid)
    return True
  if cluster_detected() is not None:
    _cpu_settings(cpu_collectives)
    start()
    return True
  return False


def _cpu_settings(cpu_collectives: str) -> None:
  """Before the CPU backend starts: its cross-process collectives, and synchronous dispatch — with
  gloo, two programs in flight at once (e.g. on the two disjoint meshes of asynchronous rollouts,
  ``jaxgrpo.loop.async_rollout``) could exchange their collectives' messages in another order on each
  process; each CPU program now ends before the next starts (the results are the same; on a CPU
  the devices share the cores anyway). GPU and TPU backends are not affected."""
  jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.config.update("jax_cpu_enable_async_dispatch", False)


# ----------------------------------------------------------------------------- rows and hosts


def to_host(tree):
  """NumPy copies of a tree of arrays, the same global values on every process.

  Single process: ``np.asarray`` of each leaf. Several processes: ``process_allgather(tiled=True)``,
  which returns the global value of a sharded ``jax.Array`` and concatenates host-local arrays
  (``[n, ...]`` per process → ``[P·n, ...]``, in process order) along their first axis.
  """
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)


_RESHARD: dict = {}


def _rows_layout(x: jax.Array, sharding) -> jax.Array:
  """``x`` with its rows over the batch axes (one cached jitted identity per sharding; a no-op copy
  when ``x`` is laid out so already)."""
  if x.sharding == sharding:
    return x
  fn = _RESHARD.get(sharding)
  if fn is None:
    fn = _RESHARD[sharding] = jax.jit(lambda a: a, out_shardings=sharding)
  return fn(x)


def process_rows(tree, mesh: Mesh, rules=None):
  """This process's rows of a tree of global arrays with a leading batch axis, as NumPy.

  The rows are those :func:`jaxgrpo.parallel.sharding.process_batch_rows` names (the devices of this process
  hold them when the rows are laid out over ``data × fsdp``): a rollout sampled on the global mesh
  comes back as the rows this host decodes, scores and feeds to
  ``jaxgrpo.step.feed.place(..., process_local=True)``. Arrays laid out otherwise are first moved to
  that layout (one jitted reshard); NumPy leaves and fully addressable arrays (a single process) are
  sliced. None leaves stay None.

  Args:
    tree: arrays ``[N, ...]`` with N divisible by the batch axes (``data × fsdp`` under ``rules``).
    mesh: the global mesh; rules: as for :func:`jaxgrpo.parallel.sharding.batch_sharding`.

  Returns:
    The same tree of NumPy arrays ``[N / process_count, ...]`` (all N rows in a single process).
  """
  sharding = shd.batch_sharding(mesh, rules)

  def one(x):
    n = np.shape(x)[0] if np.ndim(x) else None
    if n is None:
      raise ValueError(f"process_rows: every leaf needs a leading batch axis; got a scalar of shape {np.shape(x)}")
    rows = shd.process_batch_rows(mesh, n, rules)
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(x)[rows]
    shards = {s.index[0].start or 0: s.data for s in _rows_layout(x, sharding).addressable_shards}
    return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)])

  return jax.tree.map(one, tree)


def all_rows(tree, mesh: Mesh, rules=None):
  """Every process's rows, on every process: the inverse of :func:`process_rows`.

  Each process passes its own rows (NumPy ``[N / process_count, ...]``, the rows
  :func:`jaxgrpo.parallel.sharding.process_batch_rows` names); every process gets the ``[N, ...]`` arrays in
  row order. For small per-row results every host needs (rewards, lengths, correct flags); a single
  process gets its arrays back.
  """
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  placed = shd.place_batch(jax.tree.map(np.asarray, tree), mesh, rules, process_local=True)
  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), placed)


def gather_objects(obj: Any) -> list:
  """``[object of process 0, object of process 1, ...]`` on every process, for one JSON-able object
  per process (e.g. counters whose keys differ between hosts); ``[obj]`` in a single process."""
  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.int32(data.size)))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[: data.size] = data
  every = np.asarray(multihost_utils.process_allgather(padded))
  return [json.loads(bytes(row[:size]).decode()) for row, size in zip(every, sizes)]
