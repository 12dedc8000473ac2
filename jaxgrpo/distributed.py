"""Multi-host start-up: one call before any JAX computation.

Launch one process per host (or per GPU/CPU slice); every process runs the same program. The mesh of
:func:`jaxgrpo.sharding.make_mesh` then spans every process's devices, and each process feeds its own
rows of the batch (:func:`jaxgrpo.sharding.process_batch_rows` and
``jaxgrpo.sharding.place_batch(..., process_local=True)``).

- TPU pods, Slurm and Open MPI: ``initialize()`` with no arguments (JAX detects the cluster).
- Anything else: ``initialize("host0:1234", num_processes=N, process_id=i)`` on every process, or
  set ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.
- CPU processes communicate through gloo (the default here), which is how the tests run it.

:func:`to_host` brings (possibly sharded, multi-host) arrays to NumPy on every process: the
trainer's rollouts and rewards, which each host decodes or scores in part, go through it.
"""

from __future__ import annotations

import os
import re

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["cluster_detected", "initialize", "to_host"]

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
) -> bool:
  """Start JAX's distributed runtime when this is a multi-process run.

  Args:
    coordinator_address: ``"host:port"`` of process 0 (reachable from every process).
    num_processes: total number of processes.
    process_id: this process's index in ``[0, num_processes)``.
    local_device_ids: optional devices this process owns (default: all it sees).
    cpu_collectives: collectives for the CPU backend (``"gloo"``; ``"mpi"`` where built in).
    initialization_timeout: seconds to wait for every process to connect.

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
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
      address, n, pid, local_device_ids=local_device_ids, initialization_timeout=initialization_timeout
    )
    return True
  if cluster_detected() is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(local_device_ids=local_device_ids, initialization_timeout=initialization_timeout)
    return True
  return False


def to_host(tree):
  """NumPy copies of a tree of arrays, the same global values on every process.

  Single process: ``np.asarray`` of each leaf. Several processes: ``process_allgather(tiled=True)``,
  which returns the global value of a sharded ``jax.Array`` and concatenates host-local arrays
  (``[n, ...]`` per process → ``[P·n, ...]``, in process order) along their first axis.
  """
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)
