"""The code-execution sandbox with real processes: each hostile program is contained, reported as an
observation, and the call returns within its wall limit (jaxgrpo.rollout.environments.sandbox)."""

from __future__ import annotations

import dataclasses
import os
import time
import uuid

import pytest

from jaxgrpo.rollout.environments.sandbox import SandboxLimits, SandboxResult, namespaces_available, run_code

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_bytes=512 << 20, max_processes=16, max_output_bytes=4096)
NS = namespaces_available()


def run(code: str, limits: SandboxLimits = LIMITS) -> tuple[SandboxResult, float]:
  t0 = time.monotonic()
  result = run_code(code, limits)
  return result, time.monotonic() - t0


def test_ordinary_program_output_and_exit_status():
  r, _ = run("print(6 * 7, flush=True)\nimport sys; sys.stderr.write('err\\n')")
  assert (r.output, r.returncode, r.timed_out, r.truncated) == ("42\nerr\n", 0, False, False)
  assert r.observation() == "42\nerr"
  r, _ = run("raise SystemExit(3)")
  assert r.returncode == 3 and r.observation() == "[exit status 3]"
  r, _ = run("1/0")
  assert "ZeroDivisionError" in r.observation() and "[exit status 1]" in r.observation()


def test_infinite_loop_is_killed_at_the_cpu_or_wall_limit():
  r, took = run("while True:\n  pass")
  assert took < LIMITS.wall_s + 2.0
  assert r.returncode != 0
  assert "killed" in r.observation()


def test_sleeping_program_is_killed_at_the_wall_limit():
  r, took = run("import time\nprint('start', flush=True)\ntime.sleep(60)")
  assert r.timed_out and r.returncode is None and LIMITS.wall_s <= took < LIMITS.wall_s + 2.0
  assert r.observation().startswith("start\n[killed: wall-clock limit")


def _survivors(marker: str) -> list[int]:
  """Pids of processes whose command line holds ``marker``."""
  out = []
  for p in os.listdir("/proc"):
    try:
      if p.isdigit() and marker.encode() in open(f"/proc/{p}/cmdline", "rb").read():
        out.append(int(p))
    except OSError:
      pass
  return out


def _sleeper(marker: str) -> str:
  """Code that replaces the current process by a 30 s sleeper whose command line holds ``marker``."""
  return f"os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', {marker!r}])"


def test_fork_bomb_is_contained():
  marker = uuid.uuid4().hex
  # bounded so that it also ends where nothing limits it; with namespaces RLIMIT_NPROC stops it early
  code = (
    "import os, sys, time\nn = 0\nfor _ in range(200):\n  try:\n    pid = os.fork()\n  except OSError:\n"
    f"    break\n  if pid == 0:\n    {_sleeper(marker)}\n  n += 1\nprint('forked', n, flush=True)\n"
    "time.sleep(30)"
  )
  r, took = run(code)
  assert r.timed_out and took < LIMITS.wall_s + 2.0
  forked = int(r.output.split()[1])
  if NS:  # the sandbox user may run max_processes processes, the program itself included
    assert forked < LIMITS.max_processes
  time.sleep(0.2)
  assert _survivors(marker) == []  # nothing outlives the call


def test_ten_gigabyte_allocation_fails_inside():
  r, took = run("x = bytearray(10 * 1024**3)\nprint('allocated')")
  assert "MemoryError" in r.output and "allocated" not in r.output and r.returncode == 1 and took < 3.0


def test_hundred_megabytes_of_output_are_truncated_and_stop_the_program():
  r, took = run("import sys\nfor _ in range(100):\n  sys.stdout.write('x' * (1 << 20))\nprint('done')")
  assert r.truncated and len(r.output.encode()) == LIMITS.max_output_bytes and took < 3.0
  assert "done" not in r.output and "output truncated" in r.observation()


def test_trainer_environment_is_not_visible(monkeypatch):
  secret = uuid.uuid4().hex
  monkeypatch.setenv("JAXGRPO_TEST_SECRET", secret)
  code = (
    "import os\nprint(sorted(os.environ))\nfor p in os.listdir('/proc'):\n  if p.isdigit():\n    try:\n"
    "      print(open(f'/proc/{p}/environ').read())\n    except OSError:\n      pass"
  )
  r, _ = run(code)
  assert r.returncode == 0
  assert r.output.splitlines()[0] == "['HOME', 'LANG', 'PATH']"
  assert secret not in r.output and "JAXGRPO_TEST_SECRET" not in r.output


def test_working_directory_is_writable_and_removed():
  r, _ = run("import os\nopen('a.txt', 'w').write('kept')\nprint(open('a.txt').read(), os.getcwd())")
  assert r.returncode == 0 and r.output.startswith("kept ")
  assert not os.path.exists(r.output.split()[1])


def test_write_outside_its_directory():
  target = f"/tmp/jaxgrpo-sandbox-escape-{uuid.uuid4().hex}"
  try:
    r, _ = run(f"open({target!r}, 'w').write('x')\nprint('wrote')")
    if NS:
      assert "Read-only file system" in r.output and not os.path.exists(target)
    else:  # documented: without namespaces only the user's own permissions apply
      assert "filesystem" not in r.isolation
  finally:
    if os.path.exists(target):
      os.remove(target)


def test_namespaces_isolate_network_and_processes():
  if not NS:  # documented: no network or process isolation without namespaces
    assert run("print(1)")[0].isolation == ("rlimits", "session")
    return
  r, _ = run(
    "import socket\ntry:\n  socket.create_connection(('10.0.0.1', 80), timeout=1)\nexcept OSError as e:\n  print(e)"
  )
  assert "unreachable" in r.output.lower()
  r, _ = run("import os\nprint(os.getuid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
  uid, pids = r.output.split(" ", 1)
  assert int(uid) != 0 and pids.strip() == "[1, 2]"  # the namespace's launcher (PID 1) and the program
  assert {"network", "pid", "filesystem", "user"} <= set(r.isolation)


def test_setsid_child_does_not_outlive_the_call():
  marker = uuid.uuid4().hex
  code = f"import os, sys, time\nif os.fork() == 0:\n  os.setsid()\n  {_sleeper(marker)}\nprint('parent done')"
  r, took = run(code)
  time.sleep(0.2)
  if NS:  # the PID namespace dies with its init: the child is killed, the pipe closes at once
    assert r.output == "parent done\n" and took < 2.0 and _survivors(marker) == []
  else:  # documented: a child in its own session escapes the group kill; it holds the pipe open
    assert r.timed_out
    for pid in _survivors(marker):
      os.kill(pid, 9)


def test_without_namespaces_limits_still_apply():
  limits = SandboxLimits(wall_s=2.0, cpu_s=1, memory_bytes=512 << 20, max_output_bytes=1000, isolation="none")
  r, took = run("x = bytearray(10 * 1024**3)", limits)
  assert "MemoryError" in r.output and r.isolation == ("rlimits", "session")
  r, took = run("while True:\n  pass", dataclasses.replace(limits, wall_s=20.0))  # a loaded machine: 1 CPU s
  assert r.returncode is not None and r.returncode < 0 and took < 20.0  # SIGXCPU/SIGKILL from RLIMIT_CPU
  assert "killed by signal" in r.observation()
  r, _ = run("print('y' * 2000)", limits)
  assert r.truncated and len(r.output) == 1000


def test_bad_arguments():
  with pytest.raises(ValueError, match="wall_s"):
    SandboxLimits(wall_s=0)
  with pytest.raises(ValueError, match="isolation"):
    SandboxLimits(isolation="docker")
  with pytest.raises(TypeError, match="code"):
    run_code(b"print(1)")
