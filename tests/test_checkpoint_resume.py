"""Exact resume and crash safety of real training runs (``python scripts/train.py`` in child processes).

* 6 steps straight == 3 steps, stop, resume to 6: identical metrics (steps 4-6 and evaluations) and
  bit-identical final parameters; across a mesh change (1 device <-> 8 virtual devices) within rtol 1e-5.
* SIGKILL at random moments (right after a checkpoint was started, i.e. often during its asynchronous
  write): every resume starts from the latest complete checkpoint and finishes with the uninterrupted
  run's parameters and metrics.

The runs share a persistent XLA compilation cache, so only the first run of each mesh compiles. The two
reference runs are built once per test session and shared with test_failure_modes_runs.py; only
test_resume_is_exact's resumed run writes TensorBoard files (and checks them); the others leave that sink
out (not what they check).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import RUN_XLA_FLAGS, TEST_XLA_FLAGS, cli_env, script_main_here, session_shared_dir

from jaxgrpo.run.builders import load_policy
from jaxgrpo.services import checkpoint as ck
from jaxgrpo.services.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "scripts", "train.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import train as train_cli  # noqa: E402  (scripts/train.py)

# tiny demo run with a short warm-up, so that rewards vary within groups and updates are non-zero
ARGS = [
  "--model.synthetic",
  "{hidden_size: 32, num_layers: 1}",
  "--data.arithmetic",
  "{train_size: 64, eval_size: 8, sft_steps: 150, sft_learning_rate: 1e-2, sft_batch_size: 16}",
  "--data.max-prompt-tokens",
  "64",
  "--rollout.group-size",
  "4",
  "--rollout.prompts-per-step",
  "2",
  "--rollout.max-new-tokens",
  "16",
  "--optim.learning-rate",
  "3e-4",
  "--step.temperature",
  "1.5",
  "--step.chunk-size",
  "null",
  "--objective.beta",
  "0.04",
  "--eval.every",
  "3",
  "--eval.samples",
  "2",
  "--eval.pass-k",
  "[1]",
  "--reward.timeout-s",
  "null",
  "--reward.weights",
  "{format: 1.0, accuracy: 1.0}",
  "--checkpoint.every",
  "1",
  "--no-plot",
  "--no-progress",
]
TIMING = ("tokens_per_sec", "step_time", "rollout_time")

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  return cli_env(tmp_path_factory.mktemp("xla_cache"), xla_flags=RUN_XLA_FLAGS)  # one configuration, ~25 runs


def _train(env, out, steps, *extra, devices=None):
  cmd = [sys.executable, TRAIN, *ARGS, "--run.out", str(out), "--run.steps", str(steps), *extra]
  if devices:
    cmd += ["--cpu-devices", str(devices)]
  r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
  return r.stdout


def _records(out):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in read_jsonl(os.path.join(out, "metrics.jsonl"))]


def _params(out):
  model, _, _ = load_policy(str(out))
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]}


def reference_runs(env, tmp_path_factory):
  """``base``: ``base/straight``, the uninterrupted 6-step run, and ``base/three``, a separate run
  stopped after 3 steps (checkpoints 1-3), without TensorBoard. Built once per test session and shared
  with test_failure_modes_runs.py (the same two runs): read them, copy them before changing anything.
  ``straight`` runs the 150-step warm-up; ``three`` starts from its stored warm-up (:func:`stored_warm_up`)."""

  def build(base):
    _train(env, base / "straight", 6, "--no-tensorboard")
    # straight's stored warm-up, read back bit for bit (as stored_warm_up gives it to the other runs)
    shutil.copytree(base / "straight" / "checkpoints" / "base", base / "three" / "checkpoints" / "base")
    _train(env, base / "three", 3, "--no-tensorboard")

  return session_shared_dir(tmp_path_factory, "resume-reference-runs", build)


def stored_warm_up(runs, out) -> None:
  """Gives the fresh run ``out`` the reference runs' stored warm-up (``checkpoints/base`` of :func:`reference_runs`:
  what a fresh run's 150 warm-up steps write, read back bit for bit when the warm-up's inputs are the same,
  test_trainer.py::test_the_stored_warm_up_is_read_back_only_for_the_same_inputs), so that it does not repeat the
  warm-up (a fifth of a 6-step run's time). For the runs whose subject comes after it and whose verifier runs in
  this process (``reward.timeout_s`` null: a verifier worker started meanwhile would meet step 0's evaluation still
  starting on a loaded machine, and time out); the reference runs do the warm-up."""
  shutil.copytree(runs / "three" / "checkpoints" / "base", out / "checkpoints" / "base")


@pytest.fixture(scope="module")
def straight(env, tmp_path_factory):
  return reference_runs(env, tmp_path_factory)


def _assert_same_records(got, want, rtol=0.0, atol=0.0):
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for g, w in zip(got, want):
    assert g.keys() == w.keys(), (g, w)
    for k in w:
      if rtol == 0.0 or not isinstance(w[k], float):
        assert g[k] == w[k], (k, g, w)
      else:
        np.testing.assert_allclose(g[k], w[k], rtol=rtol, atol=atol, err_msg=f"{k} at step {w['step']}")


def test_resume_is_exact(straight, env, tmp_path):
  want = _records(straight / "straight")
  updates = [r for r in want if "loss" in r]
  assert [r["step"] for r in updates] == [1, 2, 3, 4, 5, 6]
  assert all(r["grad_norm"] > 0 for r in updates) and any(r["kl"] > 0 for r in updates)  # real updates
  run = tmp_path / "resumed"
  shutil.copytree(straight / "three", run)
  out = _train(env, run, 6)  # no --resume: on by default when OUT has a checkpoint
  assert re.search(r"resumed from checkpoint .*/checkpoints/3 \(step 3\)", out)
  assert f"supervised warm-up: read from {run}/checkpoints/base " in out  # the stored base: no second warm-up
  got = _records(run)
  _assert_same_records([r for r in got if r["step"] > 3], [r for r in want if r["step"] > 3])
  _assert_same_records(got, want)  # steps 0-3 were kept, nothing duplicated
  pa, pb = _params(straight / "straight"), _params(run)
  assert pa.keys() == pb.keys()
  for k in pa:
    np.testing.assert_array_equal(pb[k], pa[k], err_msg=k)
  p3 = _params(straight / "three")
  assert any(not np.array_equal(p3[k], pa[k]) for k in pa)  # steps 4-6 did change the parameters
  assert os.listdir(run / "tensorboard")  # event files written
  # --no-resume on a directory with checkpoints refuses instead of mixing two runs
  r = subprocess.run(
    [sys.executable, TRAIN, *ARGS, "--run.out", str(run), "--run.steps", "6", "--no-resume"],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    cwd=ROOT,
  )
  assert r.returncode != 0 and "holds checkpoints of an earlier run" in r.stderr
  # a changed learning rate is refused (before the model is built) unless allowed explicitly: through
  # scripts/train.py's main in this process (the same code path and output as a child's, without its start-up; the
  # refusal above is the child); this process then holds the run's lock, which nothing below needs
  code, stdout, stderr = script_main_here(
    train_cli.main, [*ARGS, "--run.out", str(run), "--run.steps", "7", "--optim.learning_rate", "1e-3"]
  )
  assert code != 0 and "optim.learning_rate: 0.0003 in the checkpoint, 0.001 now" in stderr, stderr
  assert "--allow-changed-config" in stderr and "supervised warm-up" not in stdout
  assert ck.complete_steps(str(run / "checkpoints"), log=None) == [4, 5, 6]


def test_resume_across_mesh_changes(straight, env, tmp_path):
  """Stopped at 3 on 1 device -> steps 4-5 on 8 virtual devices (fsdp=8) -> step 6 on 1 device. The 8-device run
  compiles with the suite's flags (``TEST_XLA_FLAGS``; its programs are compiled by no other run, and at XLA's
  defaults they cost 25 CPU-s of this child instead of 10): like the mesh change itself, they change only the
  rounding, which the tolerances below are for."""
  run = tmp_path / "run"
  shutil.copytree(straight / "three", run)
  out = _train({**env, "XLA_FLAGS": TEST_XLA_FLAGS}, run, 5, "--no-tensorboard", devices=8)
  assert "devices: 8 (cpu)" in out and re.search(r"resumed from checkpoint \S+ \(step 3\)", out)
  out = _train(env, run, 6, "--no-tensorboard")
  assert "devices: 1 (cpu)" in out and re.search(r"resumed from checkpoint \S+ \(step 5\)", out)
  # parameters within rtol 1e-5 (reductions split over 8 devices round differently)
  pa, pb = _params(straight / "straight"), _params(run)
  worst = max(float(np.max(np.abs(pb[k] - pa[k]))) for k in pa)
  print(f"mesh change: largest parameter difference {worst:.2e}")
  for k in pa:
    np.testing.assert_allclose(pb[k], pa[k], rtol=1e-5, atol=1e-6, err_msg=k)
  # the run stopped at 5 also evaluated at 5: compare the updates 4-6 and the final evaluation; the
  # same sampled tokens and rewards, losses and KL (~1e-2, sums of ~100 terms) within 1e-5
  pick = lambda recs: [r for r in recs if r["step"] > 3 and ("loss" in r or r["step"] == 6)]
  _assert_same_records(pick(_records(run)), pick(_records(straight / "straight")), rtol=1e-5, atol=1e-5)


def test_sigkill_at_random_moments_then_resume(straight, env, tmp_path):
  """One run killed with SIGKILL three times (after a random started checkpoint, with a random delay:
  often while it is being written), resumed after each kill, then finished."""
  rng = random.Random(1234)
  want_params, want_records = _params(straight / "straight"), _records(straight / "straight")
  run, ckdir = tmp_path / "run", str(tmp_path / "run" / "checkpoints")
  kills = sorted(rng.sample(range(1, 6), 3))
  stored_warm_up(straight, run)
  during_save, resumed_from = 0, []
  for kill_after in kills:
    done = ck.complete_steps(ckdir, log=None)
    if done and done[-1] >= kill_after:
      continue
    delay = rng.choice([0.0, rng.uniform(0.0, 0.3)])
    cmd = [sys.executable, TRAIN, *ARGS, "--run.out", str(run), "--run.steps", "6", "--no-tensorboard"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    lines = []
    for line in proc.stdout:
      lines.append(line)
      if line.startswith(f"checkpoint: step {kill_after} "):
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        break
    proc.wait(timeout=600)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL, "".join(lines[-30:])
    if done:  # this run resumed from the latest complete checkpoint
      m = re.search(r"resumed from checkpoint \S+ \(step (\d+)\)", "".join(lines))
      assert m and int(m.group(1)) == done[-1], "".join(lines[-30:])
      resumed_from.append(done[-1])
    _, tmps = ck.step_dirs(ckdir)
    complete = ck.complete_steps(ckdir, log=None)
    during_save += bool(tmps) or kill_after not in complete
    # at most the step whose save was interrupted is lost
    assert (complete[-1] if complete else 0) >= kill_after - 1, (complete, kill_after)
    for s in complete:
      ck.verify_step(os.path.join(ckdir, str(s)))
  done = ck.complete_steps(ckdir, log=None)
  out = _train(env, run, 6, "--no-tensorboard")
  m = re.search(r"resumed from checkpoint \S+ \(step (\d+)\)", out)
  assert m and int(m.group(1)) == done[-1], out[-2000:]
  got = _params(run)
  for k in want_params:
    np.testing.assert_array_equal(got[k], want_params[k], err_msg=k)
  _assert_same_records(_records(run), want_records)
  print(
    f"kills after checkpoints {kills}; {during_save} landed before that checkpoint was complete; "
    f"resumed from {resumed_from + [done[-1]]}"
  )
