"""Multi-host start-up, this process's share of a global batch, and a watchdog that ends the run when
a host fails.

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
complete. :class:`HostWatchdog` (started by :func:`watch_hosts`) makes that a bounded, named stop:
every process publishes a heartbeat counter in the coordination service's key-value store every
``interval_s`` and watches the others'; a process whose counter has not moved for ``timeout_s``, or
that reported an exception (:meth:`HostWatchdog.fail`), ends every other process with a message naming
it (its index, host name and pid) and exit status :data:`EXIT_HOST_FAILED`. See
``docs/train.md`` ("Running on a pod / a cluster") for the bounds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxgrpo.parallel import sharding as shd

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

#: Exit status of a process that the watchdog stopped because another process of the run failed
#: (the failed process itself exits with its own status: 1 for an error, 137 for SIGKILL, ...).
EXIT_HOST_FAILED = 3


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
  ``jaxgrpo.rollout.async_rollout``) could exchange their collectives' messages in another order on each
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


# ----------------------------------------------------------------------------- failures


def _describe() -> str:
  return f"{socket.gethostname()}, pid {os.getpid()}"


def _summary(error: BaseException, limit: int) -> str:
  lines = str(error).strip().splitlines()
  return f"{type(error).__name__}: {lines[0][:limit] if lines else ''}"


def _exit_now(message: str) -> None:
  """Prints ``message`` and ends this process at once with :data:`EXIT_HOST_FAILED` (the main thread
  may be inside a collective that can never complete: nothing else could stop it)."""
  try:
    sys.stdout.flush()
    os.write(2, f"\nerror: {message}\n".encode())
  finally:
    os._exit(EXIT_HOST_FAILED)


class HostWatchdog:
  """Heartbeats and failure reports through the coordination service, so that one process's death or
  error ends every process with a message naming it, instead of a hang in a collective.

  A daemon thread, every ``interval_s``: increments this process's counter
  ``jaxgrpo/watchdog/beat/<i>`` in the key-value store of ``jax.distributed`` and reads the others'.
  It calls ``on_failure(message)`` (default: print ``error: <message>`` and ``os._exit``
  (:data:`EXIT_HOST_FAILED`)) when

  - another process reported an exception (:meth:`fail`): ``process 1 (host-b, pid 4242) failed:
    RewardError: ...``;
  - another process's counter has not moved for ``timeout_s`` (for ``3 · interval_s`` once this process
    itself has failed, see :meth:`fail`): ``process 1 (host-b, pid 4242) sent no heartbeat for 90 s:
    it was killed, crashed, or its host is down or frozen``;
  - the key-value store has not answered for ``timeout_s``: the coordination service, which runs in
    process 0, is gone. (When process 0 dies, JAX usually terminates the other processes itself, at
    once, with ``Terminating process because the JAX distributed service detected fatal errors``.)

  Processes that finished (:meth:`stop`) are no longer watched. Bounds: a dead process is noticed
  within ``timeout_s + interval_s``; a reported failure within ``interval_s`` of the report, which
  :meth:`fail` makes at most ``4 · interval_s`` after the exception.

  Args:
    timeout_s: seconds without a heartbeat after which a process counts as dead (default 90).
    interval_s: seconds between heartbeats (default ``timeout_s / 10``, clipped to [0.2, 5]).
    client: the key-value store (default: ``jax.distributed``'s client, through
      ``orbax.checkpoint.multihost.get_jax_distributed_client``); tests pass a fake.
    process_index, process_count: default ``jax.process_index()`` / ``jax.process_count()``.
    on_failure: called once with the message (default: print it and exit).
    clock, sleep: a monotonic clock and the matching sleep (tests pass fakes).
  """

  PREFIX = "jaxgrpo/watchdog/"

  def __init__(
    self,
    *,
    timeout_s: float = 90.0,
    interval_s: float | None = None,
    client=None,
    process_index: int | None = None,
    process_count: int | None = None,
    on_failure: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
  ):
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
      raise ValueError(f"timeout_s must be a number > 0 (seconds); got {timeout_s!r}")
    self.timeout_s = float(timeout_s)
    self.interval_s = float(interval_s) if interval_s is not None else min(5.0, max(0.2, self.timeout_s / 10))
    self.client = client if client is not None else ocp.multihost.get_jax_distributed_client()
    self.index = jax.process_index() if process_index is None else int(process_index)
    self.count = jax.process_count() if process_count is None else int(process_count)
    self.on_failure = on_failure or _exit_now
    self.clock, self.sleep = clock, sleep
    self.verdict: str | None = None
    self.own_failure: str | None = None
    self._beats = 0
    self._seen: dict[int, tuple[str, float]] = {}  # process -> (last counter, when it changed)
    self._hosts: dict[int, str] = {}
    self._kv_ok = clock()
    self._failing = False  # this process raised: shorter staleness while looking for a cause elsewhere
    self._failed_at = 0.0
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  # -------------------------------------------------------------- key-value store
  def _key(self, kind: str, i: int | None = None) -> str:
    return f"{self.PREFIX}{kind}/" + ("" if i is None else str(i))

  def _dir(self, kind: str) -> dict[int, str]:
    return {int(k.rsplit("/", 1)[1]): v for k, v in self.client.key_value_dir_get(self._key(kind))}

  def _name(self, i: int) -> str:
    if i not in self._hosts:
      self._hosts.update(self._dir("host"))
    return f"process {i} ({self._hosts.get(i, 'host unknown')})"

  # -------------------------------------------------------------- the loop
  def start(self) -> HostWatchdog:
    """Publishes this process's host name and first heartbeat, starts the thread; returns self."""
    self.client.key_value_set(self._key("host", self.index), _describe(), allow_overwrite=True)
    self.beat()
    self._thread = threading.Thread(target=self._run, name="jaxgrpo-host-watchdog", daemon=True)
    self._thread.start()
    return self

  def beat(self) -> None:
    """One heartbeat: this process's counter + 1."""
    self._beats += 1
    self.client.key_value_set(self._key("beat", self.index), str(self._beats), allow_overwrite=True)

  def check(self, *, stale_after: float | None = None) -> str | None:
    """One look at the other processes: the failure message, or None while all is well."""
    now = self.clock()
    limit = self.timeout_s if stale_after is None else stale_after
    try:
      failed, beats, done = self._dir("failed"), self._dir("beat"), self._dir("done")
    except Exception as e:  # noqa: BLE001 - the coordination service is unreachable
      if now - self._kv_ok > self.timeout_s:
        return (
          f"the coordination service (run by process 0) has not answered for {now - self._kv_ok:.0f} s "
          f"({type(e).__name__}: {str(e)[:200]}): process 0 has probably died"
        )
      return None
    self._kv_ok = now
    for i, text in sorted(failed.items()):
      if i != self.index:
        return f"{self._name(i)} failed: {text}"
    for i in range(self.count):
      if i == self.index or i in done:
        continue
      value = beats.get(i)
      last = self._seen.get(i)
      if last is None or last[0] != value:
        self._seen[i] = (value, now)
        continue
      if now - last[1] > limit:
        what = "sent no heartbeat" if value is not None else "has not started its watchdog"
        return (
          f"{self._name(i)} {what} for {now - last[1]:.0f} s: it was killed, crashed, or its host is down or frozen"
        )
    return None

  def _run(self) -> None:
    while not self._stop.wait(self.interval_s):
      if self.own_failure is not None:  # reported: the others stop; do not blame them for it
        if self.clock() - self._failed_at > self.timeout_s:
          os.write(
            2, f"process {self.index}: still running {self.timeout_s:.0f} s after its failure; exiting\n".encode()
          )
          os._exit(1)
        continue
      try:
        self.beat()
      except Exception:  # noqa: BLE001 - check() reports an unreachable store
        pass
      verdict = self.check(stale_after=3 * self.interval_s if self._failing else None)
      if verdict is not None and self.verdict is None:
        self._give_up(verdict)

  def _give_up(self, verdict: str, suffix: str = "") -> None:
    self.verdict = verdict
    self.on_failure(
      f"{verdict}{suffix}; stopping process {self.index} too (exit status {EXIT_HOST_FAILED}): the run cannot go "
      "on without it. Restart every process to resume from the last complete checkpoint"
    )

  def fail(self, error: BaseException) -> str | None:
    """This process raised ``error``: find out whether another process's failure caused it.

    For up to ``4 · interval_s`` it looks for a failure report of another process or a process whose
    heartbeat stopped (a collective fails at once on every process when one process is killed; the
    dead one cannot report); not for a ``KeyboardInterrupt`` (a user's abort). Found: ``on_failure`` is called with that message (default: exit).
    Otherwise this process's failure is reported to the others (``process i (host, pid) failed:
    <Type>: <message>``) and None is returned: the caller goes on raising ``error``; if this process
    is still alive ``timeout_s`` later (e.g. blocked in JAX's shutdown barrier), the thread exits it
    with status 1.

    Returns:
      The other process's failure message (when ``on_failure`` returned), or None.
    """
    if self.own_failure is not None or self.verdict is not None:
      return self.verdict
    self._failing = True
    # a user's abort (a second Ctrl-C) is this process's own: report it at once
    end = self.clock() + (0 if isinstance(error, KeyboardInterrupt) else 4 * self.interval_s)
    while self.verdict is None:
      verdict = self.check(stale_after=3 * self.interval_s)
      if verdict is not None and self.verdict is None:
        self._give_up(verdict, f" (then this process failed too: {_summary(error, 300)})")
        return self.verdict
      if self.clock() >= end:
        break
      self.sleep(min(self.interval_s, 0.5))
    if self.verdict is not None:
      return self.verdict
    text = _summary(error, 500)
    self.own_failure = text
    self._failed_at = self.clock()
    try:
      self.client.key_value_set(self._key("failed", self.index), text, allow_overwrite=True)
    except Exception:  # noqa: BLE001 - the others then see a stale heartbeat instead
      pass
    return None

  def stop(self) -> None:
    """This process is done: the others stop watching it; ends the thread. After :meth:`fail`
    reported a failure the thread keeps running (it exits the process ``timeout_s`` after the
    report if nothing else does)."""
    if self.own_failure is not None:
      return
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5 * self.interval_s)
    if self.own_failure is None and self.verdict is None:
      try:
        self.client.key_value_set(self._key("done", self.index), "1", allow_overwrite=True)
      except Exception:  # noqa: BLE001 - the store is gone: nobody is watching any more
        pass


_ACTIVE: HostWatchdog | None = None


@contextlib.contextmanager
def watch_hosts(
  timeout_s: float = 90.0, *, interval_s: float | None = None, collective: tuple[type[BaseException], ...] = ()
) -> Iterator[HostWatchdog | None]:
  """A :class:`HostWatchdog` for the block (nothing in a single process).

  Inside the block a dead or failed process ends this one with a message naming it. An exception
  leaving the block goes through :meth:`HostWatchdog.fail` (attributed to another process and exit,
  or reported to the others) and is raised again, except the ``collective`` types: exceptions that
  every process raises at the same step (e.g. a non-finite state, a stop on SIGTERM), which are not
  one host's failure. Nested blocks share the outer watchdog; the block that started it stops it.

  Args:
    timeout_s, interval_s: as for :class:`HostWatchdog`.
    collective: exception types raised by every process together (not reported).
  """
  global _ACTIVE
  if jax.process_count() == 1:
    yield None
    return
  owner = _ACTIVE is None
  if owner:
    _ACTIVE = HostWatchdog(timeout_s=timeout_s, interval_s=interval_s).start()
  watchdog = _ACTIVE
  try:
    yield watchdog
  except collective:
    raise
  except BaseException as e:
    watchdog.fail(e)
    raise
  finally:
    if owner:
      _ACTIVE = None
      watchdog.stop()
