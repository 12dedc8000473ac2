"""jaxgrpo.parallel.distributed.HostWatchdog against an in-memory key-value store (two or three "processes" in
one Python process, a fake clock), and scripts/_launch.py (the --processes launcher) with tiny child
scripts. The real thing — a killed process among two gloo processes — is in test_trainer_multihost.py."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from jaxgrpo.parallel import distributed
from jaxgrpo.parallel.distributed import EXIT_HOST_FAILED, HostWatchdog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import _launch  # noqa: E402  (scripts/_launch.py)


class Store:
  """The three calls of the coordination service's key-value store the watchdog uses."""

  def __init__(self):
    self.data: dict[str, str] = {}
    self.down = False

  def key_value_set(self, key, value, allow_overwrite=False):
    if self.down:
      raise RuntimeError("UNAVAILABLE: Socket closed")
    if key in self.data and not allow_overwrite:
      raise RuntimeError(f"ALREADY_EXISTS: {key}")
    self.data[key] = value

  def key_value_dir_get(self, prefix):
    if self.down:
      raise RuntimeError("UNAVAILABLE: Socket closed")
    return [(k, v) for k, v in sorted(self.data.items()) if k.startswith(prefix)]


class Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t

  def sleep(self, s):
    self.t += s


def _dog(store, clock, i, n=2, **kw):
  seen = []
  dog = HostWatchdog(
    timeout_s=10.0,
    interval_s=kw.pop("interval_s", 1.0),
    client=store,
    process_index=i,
    process_count=n,
    on_failure=seen.append,
    clock=clock,
    sleep=getattr(clock, "sleep", None) or (lambda s: None),
    **kw,
  )
  store.key_value_set(dog._key("host", i), f"host{i}, pid {100 + i}", allow_overwrite=True)
  dog.beat()
  return dog, seen


def test_a_silent_process_is_named_after_the_timeout_and_not_before():
  store, clock = Store(), Clock()
  a, _ = _dog(store, clock, 0)
  b, _ = _dog(store, clock, 1)
  for _ in range(20):  # both beat every second: all is well
    clock.t += 1
    a.beat(), b.beat()
    assert a.check() is None and b.check() is None
  for _ in range(10):  # b stops: not dead before 10 s
    clock.t += 1
    a.beat()
    assert a.check() is None
  clock.t += 1
  verdict = a.check()
  assert verdict.startswith("process 1 (host1, pid 101) sent no heartbeat for 11 s")
  assert "killed, crashed, or its host is down" in verdict


def test_a_reported_failure_is_named_at_once_and_finished_processes_are_not_watched():
  store, clock = Store(), Clock()
  a, _ = _dog(store, clock, 0, n=3)
  b, _ = _dog(store, clock, 1, n=3)
  c, _ = _dog(store, clock, 2, n=3)
  assert a.check() is None
  c.stop()  # finished normally: may stay silent from now on
  clock.t += 60
  a.beat(), b.beat()
  assert a.check() is None  # b beat, c is done
  b.sleep = lambda s: (setattr(clock, "t", clock.t + s), a.beat())  # a keeps beating while b looks around
  assert b.fail(RuntimeError("reward function 'accuracy' failed on sample 3\n  prompt: ...")) is None
  assert store.data["jaxgrpo/watchdog/failed/1"] == "RuntimeError: reward function 'accuracy' failed on sample 3"
  assert a.check() == "process 1 (host1, pid 101) failed: RuntimeError: reward function 'accuracy' failed on sample 3"


def test_fail_attributes_the_error_to_a_peer_that_died_and_stops_with_its_name():
  store, clock = Store(), Clock()
  a, seen = _dog(store, clock, 0, interval_s=0.01)
  _dog(store, clock, 1, interval_s=0.01)  # beats once, then is "killed"

  a.check()  # a notes b's counter; a's fail() then waits (a fake sleep) for it to move
  verdict = a.fail(ValueError("UNKNOWN: Gloo AllGather failed: Connection closed by peer"))
  assert verdict.startswith("process 1 (host1, pid 101) sent no heartbeat")
  assert len(seen) == 1 and seen[0].startswith(verdict)
  assert "then this process failed too: ValueError: UNKNOWN: Gloo AllGather failed" in seen[0]
  assert f"stopping process 0 too (exit status {EXIT_HOST_FAILED})" in seen[0]
  assert "jaxgrpo/watchdog/failed/0" not in store.data  # not blamed on itself


def test_a_keyboard_interrupt_is_reported_at_once_and_an_unreachable_store_after_the_timeout():
  store, clock = Store(), Clock()
  a, _ = _dog(store, clock, 0)
  b, _ = _dog(store, clock, 1)
  t0 = time.monotonic()
  assert b.fail(KeyboardInterrupt()) is None
  assert time.monotonic() - t0 < 0.5
  assert "failed: KeyboardInterrupt" in a.check()
  store2, clock2 = Store(), Clock()
  c, _ = _dog(store2, clock2, 1)
  store2.down = True
  clock2.t += 5
  assert c.check() is None  # a glitch shorter than the timeout
  clock2.t += 6
  assert "the coordination service (run by process 0) has not answered for 11 s" in c.check()


def test_the_thread_beats_and_calls_on_failure_once():
  store = Store()
  seen = []
  a = HostWatchdog(
    timeout_s=0.5, interval_s=0.05, client=store, process_index=0, process_count=2, on_failure=seen.append
  ).start()
  store.key_value_set("jaxgrpo/watchdog/host/1", "host1, pid 101")
  store.key_value_set("jaxgrpo/watchdog/failed/1", "RuntimeError: boom")
  deadline = time.monotonic() + 5
  while not seen and time.monotonic() < deadline:
    time.sleep(0.02)
  a.stop()
  assert int(store.data["jaxgrpo/watchdog/beat/0"]) >= 1
  assert seen == [
    "process 1 (host1, pid 101) failed: RuntimeError: boom; stopping process 0 too (exit status 3): the run cannot "
    "go on without it. Restart every process to resume from the last complete checkpoint"
  ]
  assert "jaxgrpo/watchdog/done/0" not in store.data  # it stopped because of a failure


def test_watch_hosts_is_a_no_op_in_one_process_and_bad_timeouts_are_refused():
  with distributed.watch_hosts(5.0) as dog:
    assert dog is None
  for bad in (0, -1.0, "10"):
    with pytest.raises(ValueError, match="timeout_s must be a number > 0"):
      HostWatchdog(timeout_s=bad, client=Store(), process_index=0, process_count=2)
  with pytest.raises(ValueError, match="heartbeat_timeout must be an int >= 1"):
    distributed.initialize("127.0.0.1:1234", 2, 0, heartbeat_timeout=0)


# ----------------------------------------------------------------------------- the launcher


def test_launcher_arguments():
  n, rest = _launch.split_args(["--config", "x.yaml", "--processes", "2", "--cpu-devices", "4"])
  assert (n, rest) == (2, ["--config", "x.yaml", "--cpu-devices", "4"])
  assert _launch.split_args(["--processes=3"]) == (3, [])
  for bad, msg in (
    (["--processes", "0"], "must be an int >= 1"),
    (["--processes", "two"], "must be an int >= 1"),
    (["--processes"], "needs a value"),
    (["--processes", "2", "--devices.process_id", "1"], "sets .* itself"),
    (["--processes", "2", "--devices.coordinator-address=h:1"], "sets .* itself"),
  ):
    with pytest.raises(SystemExit, match=msg):
      _launch.split_args(bad)
  cmds = _launch.child_commands("train.py", 2, ["--run.steps", "3"], 1234)
  assert cmds[1][1:] == [
    "train.py",
    "--run.steps",
    "3",
    "--devices.distributed",
    "true",
    "--devices.coordinator_address",
    "127.0.0.1:1234",
    "--devices.num_processes",
    "2",
    "--devices.process_id",
    "1",
  ]


def test_launcher_names_a_failed_process_kills_the_rest_and_returns_its_status(tmp_path, capfd):
  script = tmp_path / "child.py"
  script.write_text(
    textwrap.dedent(
      """
      import sys, time
      i = int(sys.argv[sys.argv.index("--devices.process_id") + 1])
      if i == 1:
        sys.exit(5)
      time.sleep(60)
      """
    )
  )
  t0 = time.monotonic()
  assert _launch.launch(str(script), 2, [], grace_s=0.5) == 5
  assert time.monotonic() - t0 < 20
  err = capfd.readouterr().err
  assert "launch: process 1 exited with status 5; the others ([0]) get 0 s to stop, then are killed" in err
  script.write_text("import sys\nsys.exit(0)\n")
  assert _launch.launch(str(script), 3, []) == 0


# ----------------------------------------------------------------------------- two real processes

_FAILING = r"""
import sys, time
import numpy as np
from jax.experimental import multihost_utils
from jaxgrpo.parallel import distributed

n, i, port, failing = 2, int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
distributed.initialize(f"127.0.0.1:{port}", n, i, heartbeat_timeout=60)
multihost_utils.sync_global_devices("started")
with distributed.watch_hosts(5.0, interval_s=0.25):
  if i == failing:
    time.sleep(0.5)
    raise RuntimeError("reward function 'accuracy' failed on sample 3\n  prompt: 2 + 2")
  multihost_utils.sync_global_devices("never")  # waits for the failed process: only the watchdog ends it
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("failing", [1, 0])
def test_an_exception_on_one_process_stops_the_other_naming_it(failing):
  """Process ``failing`` raises while the other waits in a collective: the other exits with status 3
  within a few heartbeat intervals, naming the failed process and its error. Process 0 runs the
  coordination service: when it fails, the other still gets the named message (process 0 stays up
  in JAX's shutdown barrier until the others left)."""
  from helpers import start_child

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = [start_child(_FAILING, devices=1, args=(i, port, failing)) for i in range(2)]
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=120))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise AssertionError(f"a process did not stop: {[q.communicate() for q in procs]}") from None
  other = 1 - failing
  err = outs[other][1]
  assert procs[other].returncode == EXIT_HOST_FAILED, outs
  pid = procs[failing].pid
  assert re.search(
    rf"error: process {failing} \(\S+, pid {pid}\) failed: RuntimeError: reward function 'accuracy' failed on "
    rf"sample 3; stopping process {other} too \(exit status 3\)",
    err,
  ), err
  assert procs[failing].returncode != 0 and "RuntimeError: reward function" in outs[failing][1], outs[failing]
