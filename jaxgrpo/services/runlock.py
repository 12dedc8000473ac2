"""An exclusive lock on a run directory, so that two runs never write into the same ``OUT``.

Two runs started with the same ``--run.out`` would both write ``metrics.jsonl`` (interleaved, with
corrupt lines) and checkpoints (the newest holding the other run's tensors), and both exit 0. The
first run takes the lock; a second one is refused with one line naming the holder.

Mechanism: ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``OUT/.jaxgrpo.lock``. The kernel releases an
flock when the last descriptor of the open file is closed, so the lock goes with the process however
it ends (exit, exception, SIGKILL, OOM killer): no stale lock is ever left to clean up. The holder
writes ``{"pid", "host", "started"}`` into the file, which the refusal quotes. The descriptor is
close-on-exec (children started by ``exec``/``spawn`` do not inherit it). The lock file itself is
never deleted (deleting it would let a new run lock a fresh file while an old one still holds the
unlinked one).

Within one process the lock is re-entrant (``scripts/train.py`` takes it before anything is read,
``jaxgrpo.run.trainer.Trainer.run`` takes it again): the directory is released when the outermost
holder releases it.

Limits: flock is advisory (only jaxgrpo runs respect it) and, on some network file systems (old NFS
clients), local to one machine; a run on another host sharing the directory over such a file
system is not seen.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket

__all__ = ["LOCK_FILE", "RunDirLocked", "RunLock"]

LOCK_FILE = ".jaxgrpo.lock"

# {lock file's real path: [fd, count]} of the locks this process holds
_HELD: dict[str, list[int]] = {}


class RunDirLocked(RuntimeError):
  """Another process holds the run directory's lock.

  Attributes:
    directory: the run directory.
    holder: what the holder wrote (``{"pid", "host", "started"}``; empty when unreadable).
  """

  def __init__(self, message: str, *, directory: str, holder: dict):
    super().__init__(message)
    self.directory, self.holder = directory, holder


def _holder(fd: int) -> dict:
  try:
    os.lseek(fd, 0, os.SEEK_SET)
    return json.loads(os.read(fd, 1 << 16).decode() or "{}")
  except (OSError, ValueError):
    return {}


class RunLock:
  """The exclusive lock of run directory ``directory`` (created if missing).

  Use as a context manager, or :meth:`acquire` / :meth:`release`.

  Raises (from :meth:`acquire`):
    RunDirLocked: another process holds it; the message names its pid, host and start time.
  """

  def __init__(self, directory: str):
    self.directory = os.path.abspath(os.fspath(directory))
    self.path = os.path.join(self.directory, LOCK_FILE)
    self._key: str | None = None

  def acquire(self) -> RunLock:
    if self._key is not None:
      return self
    os.makedirs(self.directory, exist_ok=True)
    key = os.path.realpath(self.path)
    if key in _HELD:  # this process holds it already
      _HELD[key][1] += 1
      self._key = key
      return self
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = _holder(fd)
      os.close(fd)
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise
      who = (
        f"pid {holder.get('pid')} on host {holder.get('host')} (started {holder.get('started')})"
        if holder.get("pid")
        else "another process (it has not written its pid yet)"
      )
      raise RunDirLocked(
        f"{self.directory} is in use by another run: {who} holds {self.path}. Two runs in one directory "
        "would overwrite each other's checkpoints and metrics: wait for it to end (or stop it), or use "
        "another --run.out",
        directory=self.directory,
        holder=holder,
      ) from None
    info = {
      "pid": os.getpid(),
      "host": socket.gethostname(),
      "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    _HELD[key] = [fd, 1]
    self._key = key
    return self

  def release(self) -> None:
    """Releases this holder's share (the lock itself when it is the outermost). A second call does nothing."""
    key, self._key = self._key, None
    if key is None or key not in _HELD:
      return
    held = _HELD[key]
    held[1] -= 1
    if held[1] == 0:
      del _HELD[key]
      try:
        os.ftruncate(held[0], 0)  # no stale holder to quote
      finally:
        os.close(held[0])  # closing the descriptor releases the flock

  @property
  def held(self) -> bool:
    return self._key is not None

  def __enter__(self) -> RunLock:
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
