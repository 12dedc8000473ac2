"""Every script in examples/ runs end to end at a tiny size (each in its own process, side by side)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT, child_env, finish_child

RUNS = {
  "gspo.py": (["--steps", "2", "--prompts", "2", "--samples", "4"], "step   2  reward"),
  "custom_iteration.py": (["--steps", "2", "--samples", "4"], "step   2  reward"),
  "process_sets.py": (["--samples", "6"], "mean_process_set_size"),
}


@pytest.mark.slow
@pytest.mark.subprocess
def test_examples_run():
  assert sorted(RUNS) == sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))
  procs = {
    name: subprocess.Popen(
      [sys.executable, os.path.join("examples", name), *args],
      env=child_env(1),
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for name, (args, _) in RUNS.items()
  }
  for name, proc in procs.items():
    out = finish_child(proc)
    assert RUNS[name][1] in out, (name, out)
