"""jaxgrpo.services.runlock with real processes: a second holder is refused naming the first one's pid and
host; the lock goes with its holder however it ends (SIGKILL included); re-entrant in one process.
The same through ``scripts/train.py`` (two real runs into one ``--out``) is in
test_failure_modes_runs.py::test_second_run_into_the_same_out_is_refused."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from jaxgrpo.services import runlock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the children load jaxgrpo/services/runlock.py alone (no JAX import: a second, not ten)
_LOAD = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("runlock", {os.path.join(ROOT, "jaxgrpo", "services", "runlock.py")!r})
runlock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runlock)
"""
_HOLD = (
  _LOAD
  + """
import time
lock = runlock.RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""
)


def _holder(out):
  proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "locked"
  return proc


@pytest.mark.parametrize("kill", [signal.SIGKILL, signal.SIGTERM])
def test_second_holder_refused_until_the_first_dies(tmp_path, kill):
  out = tmp_path / "run"
  proc = _holder(out)
  try:
    with pytest.raises(runlock.RunDirLocked) as e:
      runlock.RunLock(out).acquire()
    msg = str(e.value)
    assert f"{out} is in use by another run: pid {proc.pid} on host {socket.gethostname()}" in msg
    assert "use another --run.out" in msg and "\n" not in msg  # the CLI's flag (--out is refused)
    assert e.value.holder["pid"] == proc.pid
  finally:
    proc.send_signal(kill)
    proc.wait(timeout=30)
  with runlock.RunLock(out) as lock:  # the OS released it with the process: no stale lock
    assert lock.held
    assert json.loads((out / runlock.LOCK_FILE).read_text())["pid"] == os.getpid()
  assert (out / runlock.LOCK_FILE).read_text() == ""  # released: nothing stale to quote


def test_reentrant_in_one_process_and_released_by_the_outermost(tmp_path):
  out = tmp_path / "run"
  outer = runlock.RunLock(out).acquire()
  inner = runlock.RunLock(out).acquire()  # e.g. scripts/train.py, then Trainer.run
  inner.release()
  probe = (
    _LOAD + "try:\n runlock.RunLock(sys.argv[1]).acquire(); print('free')\nexcept runlock.RunDirLocked: print('held')"
  )
  check = lambda: subprocess.run([sys.executable, "-c", probe, str(out)], capture_output=True, text=True)
  assert check().stdout.strip() == "held"  # still held by the outer holder
  outer.release()
  outer.release()  # a second release does nothing
  assert check().stdout.strip() == "free"
