"""A watchdog that ends a multi-process run when one of its processes fails, instead of a hang.

A process that dies or raises leaves the others inside a collective that can never complete.
:class:`HostWatchdog` (started by :func:`watch_hosts`) makes that a bounded, named stop: every process publishes a
heartbeat counter in the coordination service's key-value store every ``interval_s`` and watches the others'; a
process whose counter has not moved for ``timeout_s``, or that reported an exception (:meth:`HostWatchdog.fail`),
ends every other process with a message naming it (its index, host name and pid) and exit status
:data:`EXIT_HOST_FAILED`. See ``docs/train.md`` ("Running on a pod / a cluster") for the bounds.
``jaxgrpo.parallel.distributed`` (the multi-host start-up) re-exports every public name.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from typing import Callable, Iterator

import jax
import orbax.checkpoint as ocp

__all__ = ["EXIT_HOST_FAILED", "HostWatchdog", "watch_hosts"]

#: Exit status of a process that the watchdog stopped because another process of the run failed
#: (the failed process itself exits with its own status: 1 for an error, 137 for SIGKILL, ...).
EXIT_HOST_FAILED = 3


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
