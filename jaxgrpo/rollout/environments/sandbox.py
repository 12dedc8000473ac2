"""Run untrusted Python (a policy's code) in a separate, bounded process: the code-execution tool.

:func:`run_code` writes the code to ``main.py`` in a fresh temporary directory, runs
``python -I -B main.py`` in its own session and returns a :class:`SandboxResult` whose
:meth:`~SandboxResult.observation` is the text the policy sees. Nothing the code does raises in the
caller: a timeout, a crash, a memory or output overflow come back as a result, within ``wall_s``
(plus the time to kill and reap the process).

Always: a wall limit (``wall_s``; the process group gets SIGKILL) and a CPU limit per process
(``RLIMIT_CPU``), ``RLIMIT_AS`` = ``memory_bytes``, ``RLIMIT_FSIZE`` per file, 64 open files, no core
dumps, output read up to ``max_output_bytes`` (then the group is killed), an environment scrubbed to
``PATH``, ``HOME`` and ``LANG``. With namespaces (``isolation="namespaces"``; ``"auto"`` picks it as
root on Linux with ``unshare(1)``, :func:`namespaces_available`) also: no network, a new PID namespace
(the trainer's processes invisible; nothing outlives the call, ``setsid`` included), every mount
read-only but the working directory, an unprivileged uid (``RLIMIT_NPROC`` = ``max_processes`` stops a
fork bomb; root-only files unreadable), new IPC and UTS namespaces.

Not isolated in either mode: *reading* world-readable files, the number of files in the directory,
CPU time summed over processes (the wall limit bounds it), the kernel (no seccomp: containment for a
policy's mistakes, not a boundary against a kernel exploit). Without namespaces also no network or
write isolation, ``RLIMIT_NPROC`` counts every process of the trainer's user, and ``setsid`` escapes
the group kill. :attr:`SandboxResult.isolation` names the layers each run had. docs/multiturn.md,
"What the sandbox isolates".
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

__all__ = ["SandboxLimits", "SandboxResult", "namespaces_available", "run_code"]

_UID_BASE = 200_000  # unprivileged ids for sandboxed code: no such user exists, it owns nothing
_UID_RANGE = 500_000
_counter = itertools.count()


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxLimits:
  """The bounds of one :func:`run_code` call.

  Attributes:
    wall_s: wall-clock seconds before the process group is killed (> 0).
    cpu_s: CPU seconds per process (``RLIMIT_CPU``, >= 1).
    memory_bytes: address space per process (``RLIMIT_AS``; Python itself needs ~30 MB).
    max_processes: processes of the sandbox user (``RLIMIT_NPROC``; enforced with namespaces, where the
      code runs under its own user id).
    max_output_bytes: bytes of stdout+stderr kept; more kills the process (>= 1).
    max_file_bytes: largest file the code may write (``RLIMIT_FSIZE``).
    isolation: ``"auto"`` (namespaces when :func:`namespaces_available`, else none), ``"namespaces"``
      (required: ValueError when unavailable), or ``"none"`` (resource limits only).
    python: the interpreter that runs the code; None: ``sys.executable`` when the sandbox user can
      execute it, else ``/usr/bin/python3``.
  """

  wall_s: float = 10.0
  cpu_s: int = 5
  memory_bytes: int = 1 << 30
  max_processes: int = 32
  max_output_bytes: int = 16 * 1024
  max_file_bytes: int = 16 << 20
  isolation: str = "auto"
  python: str | None = None

  def __post_init__(self):
    if not self.wall_s > 0:
      raise ValueError(f"`wall_s` must be > 0 seconds; got {self.wall_s!r}")
    for name, low in (("cpu_s", 1), ("memory_bytes", 1 << 20), ("max_processes", 1), ("max_output_bytes", 1)):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ValueError(f"`{name}` must be an int >= {low}; got {v!r}")
    if not isinstance(self.max_file_bytes, int) or self.max_file_bytes < 0:
      raise ValueError(f"`max_file_bytes` must be an int >= 0; got {self.max_file_bytes!r}")
    if self.isolation not in ("auto", "namespaces", "none"):
      raise ValueError(f"`isolation` must be 'auto', 'namespaces' or 'none'; got {self.isolation!r}")


class SandboxResult(NamedTuple):
  """What one :func:`run_code` call observed.

  Attributes:
    output: stdout and stderr as they interleaved, decoded as UTF-8 (invalid bytes replaced), at most
      ``max_output_bytes`` bytes of it.
    returncode: the exit status (negative: killed by that signal), or None when the sandbox killed it
      (timeout or output overflow).
    timed_out: the wall limit was reached.
    truncated: the output exceeded ``max_output_bytes`` (the process was killed).
    wall_s: seconds from start to reaping.
    isolation: the layers applied: ``("rlimits", "session")`` always, plus ``("namespaces", "network",
      "pid", "filesystem", "user")`` with namespaces.
  """

  output: str
  returncode: int | None
  timed_out: bool
  truncated: bool
  wall_s: float
  isolation: tuple[str, ...]

  def observation(self) -> str:
    """The text the policy sees: the output, then one status line when it did not exit with 0."""
    notes = []
    if self.timed_out:
      notes.append(f"[killed: wall-clock limit reached after {self.wall_s:.1f} s]")
    if self.truncated:
      notes.append("[killed: output limit exceeded; output truncated]")
    if self.returncode is not None and self.returncode < 0:
      name = signal.Signals(-self.returncode).name if -self.returncode in signal.valid_signals() else "?"
      notes.append(f"[killed by signal {name}" + (" (CPU time limit)]" if name in ("SIGXCPU", "SIGKILL") else "]"))
    elif self.returncode:
      notes.append(f"[exit status {self.returncode}]")
    return "\n".join([self.output.rstrip("\n")] + notes).strip("\n")


def namespaces_available() -> bool:
  """Whether :func:`run_code` can isolate with Linux namespaces here: Linux, root, ``unshare`` on PATH."""
  return sys.platform.startswith("linux") and os.geteuid() == 0 and shutil.which("unshare") is not None


# Runs as root inside the new namespaces, then drops to the sandbox user and execs the interpreter.
# argv: workdir uid python cpu_s memory_bytes max_processes max_file_bytes
_LAUNCHER = r"""
import ctypes, os, resource, sys
workdir, uid, python = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cpu, mem, nproc, fsize = (int(x) for x in sys.argv[4:8])
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384
def mount(src, dst, flags):
  if libc.mount(src, dst.encode(), None, flags, None) != 0:
    raise OSError(ctypes.get_errno(), f"mount {dst}")
mount(workdir.encode(), workdir, MS_BIND)
points = [line.split()[1].replace("\\040", " ") for line in open("/proc/self/mounts")]
for p in points:
  if p == workdir or p == "/proc" or p.startswith("/proc/"):
    continue
  try:
    mount(None, p, MS_REMOUNT | MS_BIND | MS_RDONLY)
  except OSError:
    pass
top = {l.split()[1]: l.split()[3].split(",")[0] for l in open("/proc/self/mounts")}  # last: the visible one
bad = [p for p, o in top.items() if o == "rw" and p not in (workdir, "/proc") and not p.startswith("/proc/")]
if bad:
  sys.stderr.write(f"sandbox: could not make read-only: {bad}\n")
  sys.exit(125)
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
pid = os.fork()  # this launcher stays PID 1 of the namespace and reports how the program ended
if pid == 0:
  os.setgroups([])
  os.setgid(uid)
  os.setuid(uid)
  os.chdir(workdir)
  os.execve(python, [python, "-I", "-B", "main.py"], {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"})
_, status = os.waitpid(pid, 0)
# a signal as 128 + its number: unshare(1) re-raising a child's SIGXCPU fails ("sigprocmask unblock failed")
os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""


def _world_executable(path: str) -> bool:
  """Whether a user with no relation to the file's owner can run ``path`` (every directory ``o+x``)."""
  path = os.path.realpath(path)
  parts = path.split(os.sep)
  for i in range(2, len(parts)):
    if not os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & 0o001:
      return False
  return bool(os.stat(path).st_mode & 0o005 == 0o005)


def _interpreter(limits: SandboxLimits, unprivileged: bool) -> str:
  if limits.python is not None:
    return limits.python
  if not unprivileged or _world_executable(sys.executable):
    return sys.executable
  for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
    if os.path.exists(candidate) and _world_executable(candidate):
      return candidate
  raise RuntimeError(
    f"no Python interpreter the sandbox user can execute: {sys.executable} is in a directory closed to other "
    "users; set SandboxLimits(python=...) to a world-executable interpreter"
  )


def _set_limits(limits: SandboxLimits):
  def apply():  # in the child, before exec (no namespaces: the trainer's own user)
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

  return apply


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def run_code(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
  """Runs ``code`` (Python source) in a bounded, separate process; see the module docstring.

  Args:
    code: the program, written to ``main.py`` in a new temporary directory (its working directory).
    limits: a :class:`SandboxLimits` (None: the defaults).

  Returns:
    A :class:`SandboxResult`; never raises for anything the code does.

  Raises:
    TypeError: ``code`` is not a string. ValueError: ``isolation="namespaces"`` where unavailable.
  """
  if not isinstance(code, str):
    raise TypeError(f"`code` must be a str of Python source; got {type(code).__name__}")
  limits = SandboxLimits() if limits is None else limits
  if not isinstance(limits, SandboxLimits):
    raise TypeError(f"`limits` must be a SandboxLimits; got {type(limits).__name__}")
  use_ns = limits.isolation == "namespaces" or (limits.isolation == "auto" and namespaces_available())
  if use_ns and not namespaces_available():
    raise ValueError("isolation='namespaces' needs Linux, root and unshare(1); use isolation='auto' or 'none'")
  python = _interpreter(limits, use_ns)
  workdir = tempfile.mkdtemp(prefix="jaxgrpo-sandbox-")
  env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"}
  try:
    with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
      f.write(code)
    if use_ns:
      uid = _UID_BASE + (os.getpid() * 1009 + next(_counter)) % _UID_RANGE
      os.chown(workdir, uid, uid)
      os.chmod(workdir, 0o700)
      argv = ["unshare", "--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
      argv += ["--mount-proc", "--propagation", "private", sys.executable, "-I", "-S", "-c", _LAUNCHER]
      argv += [workdir, str(uid), python, str(limits.cpu_s), str(limits.memory_bytes)]
      argv += [str(limits.max_processes), str(limits.max_file_bytes)]
      preexec, isolation = None, ("rlimits", "session", "namespaces", "network", "pid", "filesystem", "user")
    else:
      argv = [python, "-I", "-B", "main.py"]
      preexec, isolation = _set_limits(limits), ("rlimits", "session")
    result = _run(argv, workdir, env, preexec, limits, isolation)
    if use_ns and result.returncode is not None and result.returncode > 128:  # the launcher's 128 + signal
      result = result._replace(returncode=128 - result.returncode)
    return result
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def _run(argv, workdir, env, preexec, limits: SandboxLimits, isolation) -> SandboxResult:
  t0 = time.monotonic()
  deadline = t0 + limits.wall_s
  proc = subprocess.Popen(
    argv,
    cwd=workdir,
    env=env,
    stdin=subprocess.DEVNULL,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    start_new_session=True,
    preexec_fn=preexec,
  )
  chunks, size, timed_out, truncated = [], 0, False, False
  sel = selectors.DefaultSelector()
  sel.register(proc.stdout, selectors.EVENT_READ)
  fd = proc.stdout.fileno()
  try:
    while True:
      left = deadline - time.monotonic()
      if left <= 0:
        timed_out = True
        break
      if not sel.select(timeout=left):
        continue
      data = os.read(fd, 65536)
      if not data:
        break
      room = limits.max_output_bytes - size
      chunks.append(data[:room])
      size += len(data)
      if size > limits.max_output_bytes:
        truncated = True
        break
    if timed_out or truncated:
      _kill_group(proc)
    else:
      try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
      except subprocess.TimeoutExpired:
        timed_out = True
    _kill_group(proc)  # whatever is left of the group (children that outlived their parent)
    returncode = proc.wait()
  finally:
    sel.close()
    proc.stdout.close()
  output = b"".join(chunks).decode("utf-8", errors="replace")
  if timed_out or truncated:
    returncode = None
  return SandboxResult(output, returncode, timed_out, truncated, time.monotonic() - t0, isolation)
