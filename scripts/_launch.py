"""``scripts/train.py --processes N``: N training processes on this machine, one command.

Starts ``scripts/train.py`` N times with the same arguments plus the multi-host flags
(``--devices.distributed true``, the coordinator ``127.0.0.1:<free port>``, ``--devices.num_processes
N``, ``--devices.process_id i``). The processes talk through JAX's coordination service and gloo CPU
collectives; each has its own virtual CPU devices (``--cpu-devices D``: D per process). This is the
code path of a pod, where every host runs the same command and ``jax.distributed.initialize()`` finds
its settings in the environment; here the launcher provides them.

Signals and failures:

- SIGINT (Ctrl-C) / SIGTERM to the launcher is passed on to every process (they run in their own
  session, so a Ctrl-C in the terminal reaches them once, through the launcher): each finishes its
  step, checkpoints it and exits 128 + signal; a second Ctrl-C aborts them.
- When a process exits with a non-zero status while others still run, the launcher names it
  (``launch: process 1 exited with status -9 (SIGKILL)``), gives the others ``GRACE_S`` seconds to
  stop by themselves (their watchdog names the failed process; the launcher reports each exit), then
  kills them (SIGKILL).

The exit status is the first failing process's (128 + n for a signal), 0 when all succeeded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

__all__ = ["child_commands", "launch", "split_args"]

GRACE_S = 30.0


def split_args(argv: list[str]) -> tuple[int, list[str]]:
  """``(N, the other arguments)`` from ``--processes N`` / ``--processes=N`` in ``argv``."""
  rest, n = [], None
  i = 0
  while i < len(argv):
    tok = argv[i]
    if tok == "--processes":
      if i + 1 >= len(argv):
        raise SystemExit("error: --processes needs a value (the number of processes)")
      n, i = argv[i + 1], i + 2
      continue
    if tok.startswith("--processes="):
      n = tok.partition("=")[2]
    else:
      rest.append(tok)
    i += 1
  try:
    n = int(n)
  except (TypeError, ValueError):
    raise SystemExit(f"error: --processes must be an int >= 1; got {n!r}") from None
  if n < 1:
    raise SystemExit(f"error: --processes must be an int >= 1; got {n}")
  taken = [t for t in rest if t.split("=")[0].replace("_", "-") in _DISTRIBUTED_FLAGS]
  if taken:
    raise SystemExit(f"error: --processes sets {', '.join(sorted(_DISTRIBUTED_FLAGS))} itself; remove {taken}")
  return n, rest


_DISTRIBUTED_FLAGS = {
  "--devices.distributed",
  "--devices.coordinator-address",
  "--devices.num-processes",
  "--devices.process-id",
}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_commands(script: str, n: int, args: list[str], port: int) -> list[list[str]]:
  """The command line of each of the ``n`` processes."""
  flags = ["--devices.distributed", "true", "--devices.coordinator_address", f"127.0.0.1:{port}"]
  flags += ["--devices.num_processes", str(n)]
  return [[sys.executable, script, *args, *flags, "--devices.process_id", str(i)] for i in range(n)]


def _status(code: int) -> str:
  if code < 0:
    return f"status {code} ({signal.Signals(-code).name})"
  return f"status {code}"


def launch(script: str, n: int, args: list[str], *, grace_s: float = GRACE_S) -> int:
  """Runs the ``n`` processes to the end; returns the exit status (see the module docstring)."""
  env = dict(os.environ)
  env.setdefault("JAX_PLATFORMS", "cpu")  # gloo CPU collectives; one process per accelerator is a pod's job
  port = _free_port()
  procs = [subprocess.Popen(cmd, env=env, start_new_session=True) for cmd in child_commands(script, n, args, port)]
  print(f"launch: {n} processes, coordinator 127.0.0.1:{port}, pids {[p.pid for p in procs]}", flush=True)

  def forward(signum, frame):
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)

  previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  first_failure: tuple[int, int] | None = None
  deadline = None
  reported: set[int] = set()
  try:
    while any(p.poll() is None for p in procs):
      for i, p in enumerate(procs):
        code = p.poll()
        if code is not None and first_failure is not None and i not in reported:
          print(f"launch: process {i} exited with {_status(code)}", file=sys.stderr, flush=True)
        if code is not None:
          reported.add(i)
        if code not in (None, 0) and first_failure is None:
          first_failure = (i, code)
          running = [j for j, q in enumerate(procs) if q.poll() is None]
          if running:
            print(
              f"launch: process {i} exited with {_status(code)}; the others ({running}) get {grace_s:.0f} s to stop, "
              "then are killed",
              file=sys.stderr,
              flush=True,
            )
            deadline = time.monotonic() + grace_s
      if deadline is not None and time.monotonic() > deadline:
        for p in procs:
          if p.poll() is None:
            p.kill()
        deadline = None
      time.sleep(0.1)
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for i, p in enumerate(procs):
    if first_failure is not None and i not in reported:
      print(f"launch: process {i} exited with {_status(p.returncode)}", file=sys.stderr, flush=True)
  if first_failure is None:
    first = next((p.returncode for p in procs if p.returncode != 0), 0)
  else:
    first = first_failure[1]
  return 128 - first if first < 0 else first
