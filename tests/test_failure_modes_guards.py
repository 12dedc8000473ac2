"""Failure modes of the stored warm-up model, the collapse guard, training that cannot learn, and a run
whose checkpoints are all corrupt (issue 46, items 9-12): real ``python scripts/train.py`` runs in child
processes, on copies of test_checkpoint_resume.py's shared reference runs, and in-process checks.

* the stored warm-up model (``OUT/checkpoints/base``), the resumed run's base and KL reference: verified
  against its manifest; a damaged one (4 KiB zeroed, cut short) is moved aside and rebuilt, and the resumed
  run equals the uninterrupted one bit for bit (before: the zeroed base was read silently, a wrong KL,
  exit 0; the truncated one exited 2 at every restart). Its files have the usual mode (before: 0600).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import RUN_XLA_FLAGS, cli_env, script_main_here
from test_checkpoint_resume import ROOT
from test_failure_modes_runs import _assert_same_as_straight, _run, runs  # noqa: F401 - the shared fixture

from jaxgrpo.run import builders
from jaxgrpo.run.specs import load_config
from jaxgrpo.services import checkpoint as ck
from jaxgrpo.services.metrics import read_jsonl

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import train as train_cli  # noqa: E402  (scripts/train.py)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  return cli_env(tmp_path_factory.mktemp("xla_cache"), xla_flags=RUN_XLA_FLAGS)


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def _damage(path, how: str) -> None:
  """``zeroed``: 4 KiB in the middle set to 0 (same size); ``truncated``: the second half cut off."""
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    if how == "zeroed":
      f.seek(size // 2)
      f.write(b"\0" * 4096)
    else:
      f.truncate(size // 2)


# ----------------------------------------------------------------------------- the stored warm-up model


def test_a_damaged_stored_warm_up_is_moved_aside_and_rebuilt_bit_for_bit(tmp_path):
  """In-process: build the run's policy (warm-up of 4 steps, stored), zero 4 KiB of the stored weights, build
  again: the damage is named, the directory moved aside, and the rebuilt weights equal the first warm-up's."""
  from flax import nnx

  cfg = load_config(
    None,
    {
      "model.synthetic": {"hidden_size": 32, "num_layers": 1},
      "data.arithmetic": {"train_size": 64, "eval_size": 8, "sft_steps": 4, "sft_batch_size": 4},
      "rollout.max_new_tokens": 8,
      "run.out": str(tmp_path),
    },
  )
  base = builders.run_base_dir(str(tmp_path))
  logs = []

  def build():
    model, _ = builders.build_run_policy(cfg, base_dir=base, log=logs.append)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]

  warmed = build()
  for name in os.listdir(base):  # the usual mode (safetensors writes 0600), and a manifest over every file
    assert stat.S_IMODE(os.stat(os.path.join(base, name)).st_mode) == 0o666 & ~_umask(), name
  listed = json.load(open(os.path.join(base, ck.MANIFEST)))["files"]
  assert set(listed) == set(os.listdir(base)) - {ck.MANIFEST}
  _damage(os.path.join(base, "model.safetensors"), "zeroed")
  rebuilt = build()
  warning = [m for m in logs if m.startswith("WARNING: the stored warm-up model is damaged")]
  assert len(warning) == 1 and "model.safetensors: CRC32 differs" in warning[0], logs
  assert re.match(r"supervised warm-up: 4 steps in", logs[-1]), logs
  (aside,) = [n for n in os.listdir(os.path.dirname(base)) if n.startswith("base.corrupt-")]
  assert aside in warning[0] and os.path.isfile(os.path.join(os.path.dirname(base), aside, "model.safetensors"))
  for a, b in zip(warmed, rebuilt, strict=True):
    np.testing.assert_array_equal(a, b)
  ck.verify_step(base)  # the rebuilt directory is intact and read back next time
  build()
  assert logs[-1].startswith(f"supervised warm-up: read from {base} "), logs


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("how", ["zeroed", "truncated"])
def test_a_resumed_run_rebuilds_a_damaged_warm_up_and_equals_the_straight_run(runs, env, tmp_path, how):  # noqa: F811
  """The resumed run's base and KL reference (β 0.04) come from the stored warm-up: damaged, it is moved aside
  and rebuilt, and the run equals the uninterrupted one (metrics, KL included, and parameters) bit for bit.
  Before: zeroed, exit 0 with a different KL; truncated, exit 2 at every restart."""
  out = tmp_path / "run"
  shutil.copytree(runs / "three", out)
  _damage(out / "checkpoints" / "base" / "model.safetensors", how)
  r = _run(env, out, 6)
  assert re.search(r"WARNING: the stored warm-up model is damaged \(.*model\.safetensors: ", r.stdout), r.stdout[-3000:]
  assert "supervised warm-up: 150 steps" in r.stdout
  assert [n for n in os.listdir(out / "checkpoints") if n.startswith("base.corrupt-")]
  _assert_same_as_straight(runs, out)


# ----------------------------------------------------------------------------- training that cannot learn


class NaNRewards:
  """An environment whose every reward is NaN (a scorer that always fails): every sample is missing."""

  tools = ()

  def reset(self, row):
    return [{"role": "user", "content": row["problem"]}]

  def step(self, text):
    from jaxgrpo.rollout.environments import StepResult

    return StepResult((), float("nan"), True)


def make_nan_env(row):
  """``env.factory: test_failure_modes_guards:make_nan_env``."""
  return NaNRewards()


def test_an_environment_whose_every_reward_is_nan_stops_the_run_and_says_so(tmp_path):
  """Every reward NaN: each step's record has reward_mean NaN (before: 0.0) and a line says no reward was finite;
  after ``run.max_zero_advantage_steps`` (2 here) such steps the run stops naming the cause (before: loss 0 at
  every step, exit 0)."""
  from test_trainer import tiny

  from jaxgrpo.run.collapse import NoLearningSignal
  from jaxgrpo.run.trainer import Trainer

  env = {"env.factory": "test_failure_modes_guards:make_nan_env", "env.max_turns": 1, "env.turn_tokens": 8}
  cfg = tiny(**env, **{"run.steps": 5, "run.out": str(tmp_path), "run.max_zero_advantage_steps": 2})
  logs, records = [], []
  trainer = Trainer(cfg, log=logs.append, on_record=records.append)
  with pytest.raises(NoLearningSignal, match=r"training stopped at step 2: nothing was learned in the last 2 steps: "):
    trainer.run(handle_signals=False)
  steps = [r for r in records if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2]
  for r in steps:
    assert np.isnan(r["reward_mean"]) and np.isnan(r["reward_std"]) and r["rewards_nonfinite"] == 8.0
    assert r["loss"] == 0.0 and r["tokens"] == 0.0  # nothing in the loss: the stop is right
  assert sum("no finite reward in the batch" in m for m in logs) == 2, logs
  assert not any("non-finite metrics" in m for m in logs), logs  # not taken for a numeric blow-up


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_reward_that_never_varies_stops_the_run_in_one_line(env, tmp_path):
  """An untrained policy (no warm-up) on the arithmetic task: every reward 0, so every advantage is 0; with
  `--run.max-zero-advantage-steps 3` the run stops after step 3 (exit 1) with one line naming the cause and the
  field. Before: 6 steps of loss 0, exit 0. A zero weight on every reward and a group of one are refused at load
  (exit 2, one line, before anything is built)."""
  args = [
    "--model.synthetic",
    "{hidden_size: 32, num_layers: 1}",
    "--data.arithmetic",
    "{train_size: 64, eval_size: 8, sft_steps: 0}",
    "--rollout.group-size",
    "4",
    "--rollout.prompts-per-step",
    "2",
    "--rollout.max-new-tokens",
    "8",
    "--eval.every",
    "0",
    "--reward.timeout-s",
    "null",
    "--no-plot",
    "--no-progress",
    "--no-tensorboard",
  ]
  train = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), *args, "--run.out", str(tmp_path / "run")]
  r = subprocess.run(
    [*train, "--run.steps", "6", "--run.max-zero-advantage-steps", "3"],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    cwd=ROOT,
  )
  assert r.returncode == 1, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
  (line,) = [x for x in r.stderr.splitlines() if x.strip()]
  assert line.startswith("error: training stopped at step 3: nothing was learned in the last 3 steps: every advantage")
  assert "`reward.weights`" in line and "`run.max_zero_advantage_steps`" in line
  recs = [x for x in read_jsonl(str(tmp_path / "run" / "metrics.jsonl")) if "loss" in x]
  assert [x["step"] for x in recs] == [1, 2, 3] and all(x["reward_mean"] == 0.0 for x in recs)
  # the config's refusals: the first through scripts/train.py's main in this process (the same code path and
  # output, without a child's start-up), the second in a child (exit status, stderr)
  for here, bad, field in (
    (
      True,
      ["--reward.weights", "{accuracy: 0.0}"],
      "error: `reward.weights`={'accuracy': 0.0}: every reward has weight 0",
    ),
    (
      False,
      ["--rollout.group-size", "1"],
      "error: `rollout.group_size` is 1: every advantage is relative to its group",
    ),
  ):
    if here:
      code, stdout, stderr = script_main_here(train_cli.main, [*train[2:], *bad])
    else:
      r = subprocess.run([*train, *bad], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
      code, stdout, stderr = r.returncode, r.stdout, r.stderr
    assert code == 2, f"exit {code}\n{stderr[-3000:]}"
    (line,) = [x for x in stderr.splitlines() if x.strip()]
    assert line.startswith(field), line
    assert "resolved config" not in stdout  # before anything


# ----------------------------------------------------------------------------- every checkpoint corrupt


@pytest.mark.slow
@pytest.mark.subprocess
def test_every_checkpoint_corrupt_starting_over_is_explicit_and_keeps_the_log(runs, env, tmp_path):  # noqa: F811
  """Steps 1-3 each lose their meta item. The same command is refused in one line naming each step and
  `--no-resume`, nothing moved or truncated; `--no-resume` moves them aside and starts from step 0, the earlier
  records kept beside (before: the run silently started over, metrics.jsonl cut from 7 lines to the new run's)."""
  out = tmp_path / "run"
  shutil.copytree(runs / "three", out)
  for step in (1, 2, 3):
    os.remove(out / "checkpoints" / str(step) / "meta" / "metadata")
  history = (out / "metrics.jsonl").read_bytes()
  r = _run(env, out, 4, expect=2)
  (line,) = [x for x in r.stderr.splitlines() if x.strip()]
  assert line.startswith(f"error: every checkpoint in {out}/checkpoints is corrupt (step 3: "), line
  assert "step 2: " in line and "step 1: " in line and "nothing was moved" in line and "--no-resume" in line
  assert "supervised warm-up" not in r.stdout
  assert sorted(os.listdir(out / "checkpoints")) == ["1", "2", "3", "base"]
  assert (out / "metrics.jsonl").read_bytes() == history
  r = _run(env, out, 2, "--no-resume")
  moved = sorted(n.split(".")[0] for n in os.listdir(out / "checkpoints") if ".corrupt-" in n)
  assert moved == ["1", "2", "3"], os.listdir(out / "checkpoints")
  assert ck.complete_steps(str(out / "checkpoints"), log=None) == [1, 2]
  (earlier,) = [n for n in os.listdir(out) if n.startswith("metrics.jsonl.earlier-")]
  assert (out / earlier).read_bytes() == history and earlier in r.stdout
  assert [x["step"] for x in read_jsonl(str(out / "metrics.jsonl")) if "loss" in x] == [1, 2]
