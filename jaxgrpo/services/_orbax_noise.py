"""Quiet output after a failed Orbax save: the failure is reported once, by ``Checkpointer``, in one
line; what Orbax, TensorStore and asyncio print about it besides is dropped — nothing else.

Three sources, one switch each, all process-wide and installed explicitly by the command-line
scripts (``scripts/train.py``), never as a side effect of the library:

* :func:`hide_failed_save_tracebacks`: the ``absl`` logger at CRITICAL and ``sys.stderr`` wrapped in
  :class:`ClosedLoopNoiseFilter` (TensorStore's ``RuntimeError: Event loop is closed`` tracebacks);
* :func:`hide_unretrieved_writes`: asyncio's ``exception was never retrieved`` records about the
  writes of a failed save under a checkpoint directory.

docs/failure_modes.md, "disk full / I/O error".
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sys
import threading

__all__ = ["ORBAX_TMP_SUFFIX", "ClosedLoopNoiseFilter", "hide_failed_save_tracebacks", "hide_unretrieved_writes"]

#: the suffix of the temporary directory Orbax writes a step into before renaming it
ORBAX_TMP_SUFFIX = ".orbax-checkpoint-tmp"


@dataclasses.dataclass
class _ThreadLines:
  """One writer thread's traceback block being held back and its unfinished line."""

  held: list[str] = dataclasses.field(default_factory=list)
  partial: str = ""


class ClosedLoopNoiseFilter:
  """A text stream wrapper that drops one kind of noise: the ``RuntimeError: Event loop is closed``
  tracebacks that TensorStore prints when writes of a failed Orbax save finish after Orbax closed
  the event loop they were to report to (seen when the disk fills up with several writes in flight).
  The save's failure itself is reported by ``jaxgrpo.services.checkpoint.Checkpointer`` in one line; everything else,
  other tracebacks included, passes through unchanged. A traceback block is held back from its
  ``Traceback (most recent call last):`` line until its first unindented line (the exception).
  Several writer threads print such tracebacks at once, line by line interleaved: each thread's
  lines are assembled separately (per-thread blocks and partial lines, one lock)."""

  _START = "Traceback (most recent call last):"
  _NOISE = "RuntimeError: Event loop is closed"

  def __init__(self, stream):
    self.stream = stream
    self._lock = threading.Lock()
    self._threads: dict[int, _ThreadLines] = {}

  def write(self, text: str) -> int:
    with self._lock:
      t = self._threads.setdefault(threading.get_ident(), _ThreadLines())
      t.partial += text
      *lines, t.partial = t.partial.split("\n")
      for line in lines:
        self._line(t, line + "\n")
      if not t.held and t.partial and not self._START.startswith(t.partial):
        self.stream.write(t.partial)  # progress bars write without a newline: pass them on at once
        t.partial = ""
      if not t.held and not t.partial:
        del self._threads[threading.get_ident()]
    return len(text)

  def _line(self, t: _ThreadLines, line: str) -> None:
    if t.held:
      t.held.append(line)
      if not line.startswith((" ", "\t")):  # the exception line ends the block
        block, t.held = t.held, []
        if not (line.startswith(self._NOISE) and "call_soon_threadsafe" in "".join(block)):
          self.stream.write("".join(block))
    elif line.startswith(self._START):
      t.held = [line]
    else:
      self.stream.write(line)

  def flush(self) -> None:
    with self._lock:
      for t in self._threads.values():
        if len(t.held) > 200:  # not a traceback after all: never hold output for long
          self.stream.write("".join(t.held))
          t.held = []
      self.stream.flush()

  def __getattr__(self, name):  # fileno, isatty, encoding, ... of the wrapped stream
    return getattr(self.stream, name)


class _UnretrievedWriteFilter(logging.Filter):
  """Drops asyncio's ``Task/Future exception was never retrieved`` records about writes into the
  temporary directory of a checkpoint save under one of ``directories``, and those of an ``OSError`` raised in
  Orbax's own write code (a full disk detected when a file is closed: the error names no path). When a save fails (a full
  disk), Orbax raises the first write error — reported by ``Checkpointer`` in one line — and
  the sibling writes (and gathers of them) that failed too are logged by asyncio when they are
  collected, at any later time. Every other record passes."""

  def __init__(self):
    super().__init__()
    self.directories: set[str] = set()

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if not self.directories or not re.match(r"\w+ exception was never retrieved", message):  # Task, Future, ...
      return True
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, OSError) and _raised_in_orbax(record.exc_info[2]):
      return False  # an OS error of Orbax's own file writes (ENOSPC at close names no file)
    text = message + (str(exc) if exc else "")
    return not any(re.search(re.escape(d) + r"/\d+" + re.escape(ORBAX_TMP_SUFFIX), text) for d in self.directories)


def _raised_in_orbax(tb) -> bool:
  """Whether traceback ``tb`` passes through Orbax's checkpoint code (its path writers)."""
  marker = f"{os.sep}orbax{os.sep}checkpoint{os.sep}"
  while tb is not None:
    if marker in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


_UNRETRIEVED_WRITES = _UnretrievedWriteFilter()


def hide_failed_save_tracebacks() -> None:
  """Process-wide, for a command-line run: the ``absl`` logger at CRITICAL (Orbax logs each failed
  write with its traceback) and ``sys.stderr`` wrapped in :class:`ClosedLoopNoiseFilter` (once).
  ``scripts/train.py`` calls it unless ``--traceback``."""
  logging.getLogger("absl").setLevel(logging.CRITICAL)
  if not isinstance(sys.stderr, ClosedLoopNoiseFilter):
    sys.stderr = ClosedLoopNoiseFilter(sys.stderr)


def hide_unretrieved_writes(directory: str) -> None:
  """Process-wide: drops asyncio's ``Task/Future exception was never retrieved`` records about the
  writes of a failed save into a temporary step directory under ``directory`` (a ``Checkpointer``'s,
  ``Checkpointer.directory``); every other record passes. Installs one filter on the ``asyncio``
  logger (idempotent) and adds ``directory`` to it; collected tasks may log late, so it is never removed."""
  _UNRETRIEVED_WRITES.directories.add(os.path.abspath(os.fspath(directory)))
  logging.getLogger("asyncio").addFilter(_UNRETRIEVED_WRITES)  # no-op when already added


class _ReadOnlyNoticeFilter(logging.Filter):
  """Drops Orbax's WARNINGs about ``read_only=True`` (``Given directory is read only=...`` from
  ``CheckpointManager.__init__``, ``...read_only=True, setting save_interval_steps=0`` / ``create=False``
  from its options): reading the parameters for an export or evaluation is read-only by design."""

  def filter(self, record: logging.LogRecord) -> bool:
    msg = str(record.msg)
    return not (msg.startswith("Given directory is read only") or "read_only=True, setting" in msg)


@contextlib.contextmanager
def without_read_only_notice():
  """While open: :class:`_ReadOnlyNoticeFilter` on the ``absl`` logger (Orbax logs through absl)."""
  f = _ReadOnlyNoticeFilter()
  logging.getLogger("absl").addFilter(f)
  try:
    yield
  finally:
    logging.getLogger("absl").removeFilter(f)
