"""A worker process that runs a function over items and is killed when one takes too long.

:class:`TimeoutPool` exists because a thread cannot be stopped and a verifier can hang (sympy spends
minutes on ``\\boxed{2^{10^{10}}}``): ``map(fn, items)`` runs ``fn`` (importable by name) in one
worker process, kills it at ``timeout_s`` per item and restarts it; every result is
``(status, value)`` with status ``ok``/``error``/``timeout``. The worker exits when its parent dies,
however the parent dies. Re-exported by ``jaxgrpo.rewards.reward_set``.

The worker is a fresh interpreter (``python -c``, the parent's ``sys.path``) that imports only this module
and ``fn``'s: unlike ``multiprocessing``'s ``spawn`` it does not re-run the parent's ``__main__`` (a training
script's imports: JAX, Flax, Orbax, seconds of start-up and hundreds of MB), except to find an ``fn``
defined there.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import math
import os
import pickle
import runpy
import signal
import subprocess
import sys
import threading
import time
import types
from multiprocessing.connection import Connection, Pipe
from typing import Any, Callable, Sequence

__all__ = ["TimeoutPool"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _exit_code(proc: subprocess.Popen) -> int | None:
  """The worker's exit code once it has ended (waits up to 5 s; negative: killed by that signal)."""
  try:
    return proc.wait(timeout=5)
  except subprocess.TimeoutExpired:
    return None


def _watch_parent(parent_pid: int) -> None:
  while os.getppid() == parent_pid:
    time.sleep(0.5)
  os._exit(1)


def _die_with_parent(parent_pid: int) -> None:
  """Makes this worker exit when the process that started it dies (SIGKILL, SIGTERM, a crash).

  On Linux the kernel sends SIGKILL (``PR_SET_PDEATHSIG``), which works even while a verifier holds
  the GIL inside C code; a thread that polls the parent id covers other platforms. Ctrl-C (SIGINT
  to the whole process group) is left to the parent, which stops the worker itself."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  if os.getppid() != parent_pid:  # the parent died before the line above
    os._exit(1)
  threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="watch-parent").start()


def _call(fn: Callable, args: tuple) -> tuple[str, Any]:
  try:
    return ("ok", fn(*args))
  except TimeoutError as e:  # the verifier's own limit: a timeout, not an error
    return ("timeout", f"{e}")
  except Exception as e:  # reported to the parent, which decides
    return ("error", f"{type(e).__name__}: {e}")


def _load_main(path: str) -> None:
  """Runs the parent's main script as ``__mp_main__`` (its ``if __name__ == "__main__"`` block stays off)
  and makes it ``__main__`` here, so a function pickled as ``__main__.fn`` is found (``spawn`` does this)."""
  module = types.ModuleType("__mp_main__")
  module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
  sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _worker_main(conn, parent_pid: int) -> None:
  """The verifier process: ``("fn", (main_path, pickled (fn, warmup)))`` loads a function (importing its
  module; the parent's main script first when ``fn`` lives there) and answers after the warm-up call;
  ``("items", [args, ...])`` answers one result per item; None or a closed pipe ends it."""
  _die_with_parent(parent_pid)
  fn = None
  try:
    conn.send(("ready", None))
    while (msg := conn.recv()) is not None:
      kind, payload = msg
      if kind == "fn":
        try:
          main_path, blob = payload
          if main_path is not None and sys.modules["__main__"].__dict__.get("__file__") != main_path:
            _load_main(main_path)
          fn, warmup = pickle.loads(blob)
        except Exception as e:
          conn.send(("error", f"cannot load the function here: {type(e).__name__}: {e}"))
          continue
        conn.send(("ok", None) if warmup is None else _call(fn, warmup))
      else:
        for args in payload:
          conn.send(_call(fn, args))
  except (EOFError, OSError):  # the parent closed the pipe (or died): nothing left to do
    return


def _serve() -> None:
  """The worker's entry point (``python -c``; argv: the parent's ``sys.path`` as JSON, the pipe's file
  descriptor, the parent's pid)."""
  _worker_main(Connection(int(sys.argv[2])), int(sys.argv[3]))


# the worker's command: the parent's sys.path first (as spawn does), then this module alone
_BOOT = (
  "import sys, json; sys.path[:] = json.loads(sys.argv[1]); from jaxgrpo.services.timeout_pool import _serve; _serve()"
)


class TimeoutPool:
  """Runs a function over items in one worker process and *kills* it when an item takes longer
  than ``timeout_s`` (a thread cannot be stopped; a process can). The worker is a fresh interpreter
  (safe after JAX has started threads; see the module docstring), restarted after a kill.

  ``map(fn, items)`` → one ``(status, value)`` per item, status ``"ok"``, ``"error"`` (the message
  as value; also when the worker dies on an item, e.g. killed by the OOM killer) or ``"timeout"``
  (killed at the limit, or ``fn`` raised :class:`TimeoutError`). ``fn`` must be importable by name
  (a module-level function, also one of the main script's); anything else is a TypeError.

  Start-up, importing ``fn``'s module and one ``fn(*warmup)`` call (when ``warmup`` is given; e.g.
  math-verify imports sympy on its first call) run under ``startup_timeout_s``, so they do not eat
  into the first item's ``timeout_s``; a failure there is a RuntimeError.

  The worker exits with its parent: SIGKILL/SIGTERM of the trainer leaves no verifier behind (on
  Linux through ``PR_SET_PDEATHSIG``, which fires when the *thread* that started the worker ends:
  use a pool from a long-lived thread). It ignores SIGINT; :meth:`close` (also run at exit) stops it.
  """

  def __init__(self, timeout_s: float, *, startup_timeout_s: float = 120.0, warmup: tuple | None = None):
    for name, value in (("timeout_s", timeout_s), ("startup_timeout_s", startup_timeout_s)):
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a number of seconds; got {type(value).__name__}")
      if not 0 < value < math.inf:
        raise ValueError(f"`{name}` must be > 0 and finite; got {value}")
    self.timeout_s, self.startup_timeout_s = float(timeout_s), float(startup_timeout_s)
    self.warmup = None if warmup is None else tuple(warmup)
    self._proc = self._conn = self._loaded = None

  def _start(self):
    parent, child = Pipe()
    cmd = [sys.executable, "-c", _BOOT, json.dumps(sys.path), str(child.fileno()), str(os.getpid())]
    try:
      proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=(child.fileno(),))
    finally:
      child.close()
    self._proc, self._conn = proc, parent
    atexit.register(self.close)
    self._reply_within(self.startup_timeout_s, "starting")

  def _reply_within(self, seconds: float, doing: str) -> tuple[str, Any]:
    """The worker's next reply while ``doing`` something that must not fail (start-up, loading)."""
    try:
      reply = self._conn.recv() if self._conn.poll(seconds) else ("error", f"no answer within {seconds} s")
    except (EOFError, OSError):
      reply = ("error", f"it exited (code {_exit_code(self._proc)}; see its error above)")
    if reply[0] not in ("ok", "ready"):
      self._kill()
      raise RuntimeError(f"verifier worker failed while {doing}: {reply[1]}")
    return reply

  def _load(self, fn: Callable) -> None:
    try:
      blob = pickle.dumps((fn, self.warmup))
    except Exception as e:
      raise TypeError(f"`fn` must be a module-level function (it is sent to a worker process); {fn!r}: {e}") from None
    main_path = (
      getattr(sys.modules.get("__main__"), "__file__", None) if getattr(fn, "__module__", None) == "__main__" else None
    )
    self._conn.send(("fn", (main_path, blob)))
    self._reply_within(self.startup_timeout_s, f"loading {getattr(fn, '__qualname__', fn)!r} and its warm-up call")
    self._loaded = fn

  def _kill(self):
    if self._proc is not None:
      if self._proc.poll() is None:
        self._proc.kill()
      self._proc.wait()
      self._conn.close()
    self._proc = self._conn = self._loaded = None

  def map(self, fn: Callable, items: Sequence[tuple]) -> list[tuple[str, Any]]:
    """``fn(*item)`` for each item in the worker → ``[(status, value)]`` in order (see the class)."""
    results: list[tuple[str, Any]] = []
    pending = list(items)
    while pending:
      if self._proc is None or self._proc.poll() is not None:
        self._kill()
        self._start()
      try:
        if self._loaded is not fn:
          self._load(fn)
        self._conn.send(("items", pending))
      except (BrokenPipeError, ConnectionError):  # died between calls: start a fresh one
        self._kill()
        continue
      done = 0
      while done < len(pending):
        if not self._conn.poll(self.timeout_s):
          self._kill()
          results.append(("timeout", None))
          done += 1
          break
        try:
          results.append(self._conn.recv())
          done += 1
        except (EOFError, OSError):
          code = _exit_code(self._proc)
          self._kill()
          results.append(("error", f"the verifier worker died on this item (exit code {code})"))
          done += 1
          break
      pending = pending[done:]
    return results

  def close(self):
    """Stops the worker (politely, then by force); a later :meth:`map` starts a new one."""
    atexit.unregister(self.close)
    if self._proc is not None and self._proc.poll() is None:
      try:
        self._conn.send(None)
        self._proc.wait(timeout=2)
      except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
        pass
    self._kill()
