"""The Orbax noise filters are installed explicitly (scripts/train.py), never by constructing a
Checkpointer; each switch is idempotent. Run in a fresh interpreter so no other test's filters count."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

_CHILD = r"""
import logging, sys, tempfile
from jaxgrpo.services import _orbax_noise, checkpoint
stderr, absl_level = sys.stderr, logging.getLogger("absl").level
with tempfile.TemporaryDirectory() as d:
  ck = checkpoint.Checkpointer(d + "/ckpt", log=None)
  assert logging.getLogger("asyncio").filters == [], logging.getLogger("asyncio").filters
  assert sys.stderr is stderr and logging.getLogger("absl").level == absl_level
  _orbax_noise.hide_unretrieved_writes(ck.directory)
  _orbax_noise.hide_unretrieved_writes(ck.directory)
  _orbax_noise.hide_failed_save_tracebacks()
  _orbax_noise.hide_failed_save_tracebacks()
  assert len(logging.getLogger("asyncio").filters) == 1
  assert _orbax_noise._UNRETRIEVED_WRITES.directories == {ck.directory}
  assert isinstance(sys.stderr, _orbax_noise.ClosedLoopNoiseFilter) and sys.stderr.stream is stderr
  assert logging.getLogger("absl").level == logging.CRITICAL
  ck.close()
print("ok")
"""


def test_checkpointer_installs_nothing_and_the_switches_are_idempotent():
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]
