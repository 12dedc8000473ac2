"""scripts/no_amx.py: a command run through it is refused AMX (the real system call in a real child), still
computes bfloat16 matrix products (XLA:CPU falls back, no SIGILL) with the same values, and the dense layers then
take float32 products (``jaxgrpo.models.backend.cpu_bf16_dots`` "auto"); bad use is one line."""

from __future__ import annotations

import errno
import os
import platform
import subprocess
import sys

import pytest
from helpers import ROOT, child_env

from jaxgrpo.models import backend

SCRIPT = os.path.join(ROOT, "scripts", "no_amx.py")
pytestmark = [
  pytest.mark.subprocess,
  pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="seccomp on Linux x86-64"),
]

_PROBE = r"""
import jax, jax.numpy as jnp, numpy as np
from jaxgrpo.models import backend
print("request", backend.amx_request())
rng = np.random.default_rng(0)
a = rng.integers(-8, 8, (64, 256)).astype(np.float32)  # small integers: exact in bfloat16, exact sums in float32
b = rng.integers(-8, 8, (256, 128)).astype(np.float32)
y = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))(
  jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)
)
print("exact", bool(np.array_equal(np.asarray(y), a @ b)))
print("native", backend.native_bf16_dots())  # cpu_bf16_dots "auto": bf16 products only where AMX is granted
"""


def _probe(*launcher):
  cmd = [*launcher, sys.executable, "-c", _PROBE]
  r = subprocess.run(cmd, env=child_env(1), capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  return dict(line.split() for line in r.stdout.splitlines() if line.startswith(("request", "exact", "native")))


def test_a_command_through_no_amx_is_refused_amx_and_still_computes_bf16_dots():
  plain = _probe()
  denied = _probe(sys.executable, SCRIPT)
  assert denied == {"request": str(errno.EPERM), "exact": "True", "native": "False"}, denied
  # without the filter the kernel decides: granted (0) on a CPU with AMX, another errno without it; the dense
  # layers' bf16 products follow (jaxgrpo.models.backend.cpu_bf16_dots "auto")
  assert plain["exact"] == "True" and plain["native"] == str(plain["request"] == "0"), plain
  if backend.amx_request() != errno.EPERM:  # unless this suite itself runs through no_amx.py (refused too)
    assert plain["request"] != str(errno.EPERM), plain


def test_bad_use_is_one_line():
  r = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=60)
  assert r.returncode == 2 and "Run a command as on a CPU without AMX" in r.stdout
  r = subprocess.run([sys.executable, SCRIPT, "no-such-command-jaxgrpo"], capture_output=True, text=True, timeout=60)
  assert (
    r.returncode == 1 and r.stderr.strip() == "error: cannot run 'no-such-command-jaxgrpo': No such file or directory"
  )
