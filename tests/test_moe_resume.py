"""Exact resume of a mixture-of-experts run (issue 27): ``python scripts/train.py`` in child processes
with the arithmetic task's synthetic model as a 4-expert top-2 Qwen3-MoE and routing replay on (the
default ``rollout.routing_replay: rollout``), its sequences packed as prefix trees (``step.packing``,
``step.prefix_sharing: tree``: the replayed experts travel in the packed layout).

4 steps straight == 2 steps, stop, resume to 4 in the same directory: identical metrics records
(``moe/...`` router metrics included) and bit-identical final parameters. The runs share a persistent
XLA compilation cache, so only the first one compiles; the straight run and the stopped one are ``main``
in the test process (no child start-up; the stopped one reads the straight run's stored warm-up), the resumed
run is a child: the resume crosses a process boundary.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import cli_env, train_main_here
from test_checkpoint_resume import ARGS, ROOT, TRAIN, _assert_same_records, _params, _records

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

STEPS = 4


def _moe_args():
  """test_checkpoint_resume's tiny run with the MoE model, a smaller data set and an evaluation at STEPS // 2."""
  over = {
    "--model.synthetic": "{hidden_size: 32, num_layers: 1, num_experts: 4, experts_per_tok: 2}",
    "--data.arithmetic": "{train_size: 32, eval_size: 4, sft_steps: 150, sft_learning_rate: 1e-2, sft_batch_size: 8}",
    "--eval.every": str(STEPS // 2),  # a run also evaluates at its last step
  }
  args = [over.get(ARGS[i - 1], a) if i else a for i, a in enumerate(ARGS)]
  # routing replay (the default for a MoE policy) through packed prefix trees: the packed layout carries the experts
  return args + ["--step.router-aux-loss", "0.001", "--step.packing", "96", "--step.prefix-sharing", "tree"]


MOE_ARGS = _moe_args()


def _train(env, out, steps):
  cmd = [sys.executable, TRAIN, *MOE_ARGS, "--run.out", str(out), "--run.steps", str(steps)]
  r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
  return r.stdout


def _train_here(out, steps):
  """The same command through scripts/train.py's ``main`` in this test process (1 CPU device, the children's
  compile flags and persistent compilation cache: the children below read its programs back)."""
  assert jax.device_count() == 1
  train_main_here([*MOE_ARGS, "--run.out", str(out), "--run.steps", str(steps)])


def test_moe_resume_is_exact(tmp_path):
  env = cli_env(tmp_path / "xla_cache")
  straight, run = tmp_path / "straight", tmp_path / "resumed"
  _train_here(straight, STEPS)  # the straight run: no child's start-up
  want = _records(straight)
  updates = [r for r in want if "loss" in r]
  assert [r["step"] for r in updates] == list(range(1, STEPS + 1))
  assert all(r["grad_norm"] > 0 for r in updates) and any(r["advantage_std"] > 0 for r in updates)  # real updates
  assert all(any(k.startswith("moe/0/") for k in r) and "moe/aux_loss" in r for r in updates), updates[0].keys()
  # the stopped run: here too, from the straight run's stored warm-up (read back bit for bit); the child resumes it
  # in the same directory (main released the run's lock when it returned: a child that found it held would exit 2)
  shutil.copytree(straight / "checkpoints" / "base", run / "checkpoints" / "base")
  _train_here(run, STEPS // 2)
  half = _params(run)
  out = _train(env, run, STEPS)  # resume is on by default when OUT has a checkpoint
  assert re.search(rf"resumed from checkpoint \S+ \(step {STEPS // 2}\)", out), out[-2000:]
  got = _records(run)
  _assert_same_records([r for r in got if r["step"] > STEPS // 2], [r for r in want if r["step"] > STEPS // 2])
  _assert_same_records(got, want)  # the first half kept, nothing duplicated
  pa, pb = _params(straight), _params(run)
  assert pa.keys() == pb.keys() and any("router" in k for k in pa), list(pa)
  for k in pa:
    np.testing.assert_array_equal(pb[k], pa[k], err_msg=k)
  assert any(not np.array_equal(half[k], pa[k]) for k in pa)  # the resumed steps did change the parameters
