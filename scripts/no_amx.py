"""Run a command as on a CPU without AMX: every process it starts is refused Intel AMX.

    python scripts/no_amx.py python scripts/bench_precision.py --rounds 3
    python scripts/no_amx.py python scripts/peers/bench_peers.py --rounds 3 --tasks sample,iter

Why: the CPUs users run on differ (an Intel Xeon with AMX here; an AMD EPYC with avx512_bf16 but no AMX measured
from outside), and bfloat16 matrix products are where they differ most. Linux hands AMX's tile state to a process
only after it asks with ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; without that grant an AMX
instruction faults, so every library that uses AMX (XLA:CPU's oneDNN / XNNPACK kernels, PyTorch's) asks first and
falls back to AVX-512 when refused. This script installs a seccomp filter that answers that request with EPERM
(all other system calls pass), then ``exec``s the command; the filter is inherited by every child and cannot be
lifted. What it emulates is the instruction set only (avx512_bf16 stays): caches, memory bandwidth and clocks are
still this machine's, so a figure measured under it is "this CPU without AMX", not another CPU. Software that looks
at CPUID alone and uses AMX without asking is killed by SIGILL under it: vLLM's CPU build (its own bf16 kernels) is,
so the vLLM tests cannot run through this script (the whole suite otherwise passes under it: the dense layers'
float32-product path, ``jaxgrpo.models.backend.cpu_bf16_dots``). ``jaxgrpo.models.backend.amx_request()`` makes the
request itself: EPERM under this script.

Measured on the Intel Xeon here (a 512×1024 by 1024×1024 ``jnp.dot``, bfloat16 operands, float32 result): 1543
GFLOP/s with AMX, 225 without; float32 371 and 377 (BENCHMARKS.md, "Mixed precision without AMX").

Linux x86-64 only (seccomp with ``PR_SET_NO_NEW_PRIVS``: no privilege is needed).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys

ARCH_REQ_XCOMP_PERM = 0x1023  # arch/x86/include/uapi/asm/prctl.h
_NR_ARCH_PRCTL = 158  # x86-64
_AUDIT_ARCH_X86_64 = 0xC000003E
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_EPERM = 1


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
  return struct.pack("HBBI", code, jt, jf, k)


# seccomp_data: nr at offset 0, arch at 4, args[0] at 16 (its low 32 bits on little-endian x86-64)
_FILTER = b"".join(
  [
    _insn(_LD_W_ABS, 0, 0, 4),
    _insn(_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),
    _insn(_RET_K, 0, 0, _ALLOW),  # another ABI: not ours to judge
    _insn(_LD_W_ABS, 0, 0, 0),
    _insn(_JEQ_K, 0, 3, _NR_ARCH_PRCTL),
    _insn(_LD_W_ABS, 0, 0, 16),
    _insn(_JEQ_K, 0, 1, ARCH_REQ_XCOMP_PERM),
    _insn(_RET_K, 0, 0, _ERRNO | _EPERM),
    _insn(_RET_K, 0, 0, _ALLOW),
  ]
)


class _SockFprog(ctypes.Structure):
  _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def deny_amx() -> None:
  """Install the filter in this process (and so in everything it starts from now on)."""
  if sys.platform != "linux" or platform.machine() != "x86_64":
    raise SystemExit(f"error: no_amx.py needs Linux on x86-64; this is {sys.platform} on {platform.machine()}")
  libc = ctypes.CDLL(None, use_errno=True)
  program = ctypes.create_string_buffer(_FILTER)
  fprog = _SockFprog(len(_FILTER) // 8, ctypes.cast(program, ctypes.c_void_p))
  if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
    raise SystemExit(f"error: prctl(PR_SET_NO_NEW_PRIVS) failed: {os.strerror(ctypes.get_errno())}")
  if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
    raise SystemExit(f"error: installing the seccomp filter failed: {os.strerror(ctypes.get_errno())}")


def main(argv: list[str]) -> None:
  if not argv or argv[0] in ("-h", "--help"):
    print(__doc__)
    raise SystemExit(0 if argv else 2)
  deny_amx()
  try:
    os.execvp(argv[0], argv)
  except OSError as e:
    raise SystemExit(f"error: cannot run {argv[0]!r}: {e.strerror}") from None


if __name__ == "__main__":
  main(sys.argv[1:])
