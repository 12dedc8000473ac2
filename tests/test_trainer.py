"""jaxgrpo.trainer and scripts/train.py: config parsing and overrides, the checkpoint hook with the
full state, a failing reward function stopping the run with the sample shown, dynamic sampling,
a short demo run that raises the reward, and 8-virtual-device vs 1-device agreement."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from jaxgrpo import rewards as R  # noqa: E402
from jaxgrpo.trainer import Trainer, TrainerConfig, config_from_dict, load_config  # noqa: E402

# a very small demo run: no warm-up unless a test asks for it
TINY = dict(
  model="demo",
  dataset="demo",
  demo_hidden_size=32,
  demo_layers=1,
  demo_train_size=64,
  demo_eval_size=8,
  demo_sft_steps=0,
  group_size=4,
  prompts_per_step=2,
  max_new_tokens=8,
  max_prompt_tokens=64,
  learning_rate=1e-3,
  chunk_size=None,
  steps=2,
  eval_every=0,
  eval_samples=2,
  reward_timeout_s=None,
  mesh="",
  log_every=1,
)


def test_config_yaml_overrides_and_unknown_keys(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text("preset: lambda_grpo\ngroup_size: 6\nbeta: 0.04\neval_pass_k: [1, 4]\n")
  cfg = load_config(str(path), {"group_size": 3, "epsilon": 0.1})
  assert cfg.group_size == 3 and cfg.eval_pass_k == (1, 4)
  obj = cfg.objective()
  assert obj.process_weights and obj.beta == 0.04 and obj.clip_eps_low == obj.clip_eps_high == 0.1
  with pytest.raises(ValueError, match="unknown config key"):
    config_from_dict({"group_sise": 4})
  with pytest.raises(ValueError, match="preset"):
    TrainerConfig(preset="ppo")
  with pytest.raises(ValueError, match="eval_pass_k"):
    TrainerConfig(eval_samples=2, eval_pass_k=(4,))
  with pytest.raises(ValueError, match="rewards"):
    TrainerConfig(rewards={"length": 1.0})


def test_cli_parses_flags_and_any_field():
  import train as cli

  args, ov = cli.parse_args(
    [
      "--config",
      "x.yaml",
      "--steps",
      "7",
      "--mesh",
      "data=2,fsdp=2,tensor=2",
      "--preset",
      "frpo",
      "--no-resume",
      "--learning-rate",
      "1e-6",
      "--rewards={accuracy: 1.0, format: 0.1}",
      "--beta",
      "null",
      "--out",
      "o",
    ]
  )
  assert args.config == "x.yaml"
  assert ov == {
    "steps": 7,
    "mesh": "data=2,fsdp=2,tensor=2",
    "preset": "frpo",
    "resume": False,
    "learning_rate": 1e-6,
    "rewards": {"accuracy": 1.0, "format": 0.1},
    "beta": None,
    "out": "o",
  }
  with pytest.raises(SystemExit):
    cli.parse_args(["--no-such-field", "1"])


@pytest.mark.slow
def test_checkpoint_hook_failing_reward_and_dynamic_sampling(tmp_path):
  seen = []
  cfg = TrainerConfig(**{**TINY, "out": str(tmp_path / "a"), "checkpoint_every": 1})

  def hook(state, c):  # the arrays are donated to the next step: read what is needed now
    seen.append(
      (
        int(state.train.step),
        dict(state.data_position),
        jax.random.key_data(state.key).tolist(),
        len(jax.tree.leaves(state.train.opt_state)) > 0,
        c,
      )
    )

  tr = Trainer(cfg, checkpoint_fn=hook, log=None)
  recs = tr.run()
  assert [s[0] for s in seen] == [1, 2]
  _, pos, key1, has_opt, c = seen[-1]
  assert c is cfg and has_opt and set(pos) >= {"epoch", "offset", "seed"}
  assert pos["offset"] == 4 and seen[0][1]["offset"] == 2  # 2 prompts per step
  assert seen[0][2] != key1  # the key advances every step
  lines = [json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl")]
  steps = [r for r in lines if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2] and lines == recs
  for r in steps:
    assert {"step", "loss", "reward_mean", "kl", "tokens_per_sec", "reward/accuracy"} <= set(r)
  evals = [r for r in lines if "eval_accuracy" in r]
  assert [r["step"] for r in evals] == [0, 2] and "eval_pass@1" in evals[0]

  def broken(prompts, completions, answer, **_):
    return [float(len(c)) / (len(c) - len(c)) for c in completions]  # ZeroDivisionError

  tr = Trainer(TrainerConfig(**{**TINY, "out": str(tmp_path / "b")}), reward_fns={"broken": (broken, 1.0)}, log=None)
  with pytest.raises(
    R.RewardError,
    match=r"'broken' failed on sample 0: ZeroDivisionError[\s\S]*"
    r"prompt: [\"']<\|user\|>What is \d+ \+ \d+\?[\s\S]*completion: [\s\S]*columns: \{'answer'",
  ):
    tr.train_step()

  # dynamic sampling: an all-equal reward drops every group; refill gives up after max rounds
  tr = Trainer(
    TrainerConfig(**{**TINY, "out": str(tmp_path / "c"), "dynamic_sampling": True, "dynamic_sampling_max_rounds": 2}),
    reward_fns={"const": (lambda p, c, **_: [1.0] * len(c), 1.0)},
    log=None,
  )
  m = tr.train_step()
  assert m["dynamic_sampling/rounds"] == 2 and m["dynamic_sampling/dropped_groups"] == 4
  assert m["reward_mean"] == 1.0


@pytest.mark.slow
def test_short_demo_run_raises_reward(tmp_path):
  cfg = TrainerConfig(
    **{
      **TINY,
      "demo_hidden_size": 64,
      "demo_layers": 2,
      "demo_train_size": 1000,
      "demo_sft_steps": 300,
      "demo_sft_noise": 0.7,
      "demo_max_operand": 9,
      "group_size": 8,
      "prompts_per_step": 16,
      "max_new_tokens": 16,
      "learning_rate": 2e-4,
      "steps": 20,
      "demo_eval_size": 20,
      "eval_samples": 4,
      "out": str(tmp_path),
    }
  )
  recs = Trainer(cfg, log=None).run()
  r = [x["reward_mean"] for x in recs if "reward_mean" in x]
  ev = [x["eval_accuracy"] for x in recs if "eval_accuracy" in x]
  assert np.mean(r[-5:]) > np.mean(r[:5]) + 0.05, r
  assert ev[-1] > ev[0], ev


def _run_cli(out, devices: int, mesh: str):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  cmd = [
    sys.executable,
    os.path.join(ROOT, "scripts", "train.py"),
    "--config",
    os.path.join(ROOT, "scripts", "configs", "demo.yaml"),
    "--steps",
    "2",
    "--mesh",
    mesh,
    "--out",
    str(out),
    "--no-plot",
    "--demo_sft_steps",
    "5",
    "--demo_hidden_size",
    "32",
    "--prompts_per_step",
    "4",
    "--group_size",
    "4",
    "--max_new_tokens",
    "8",
    "--demo_eval_size",
    "8",
    "--eval_every",
    "0",
    "--eval_samples",
    "2",
    "--eval_pass_k",
    "[1, 2]",
    "--demo_train_size",
    "200",
    "--learning_rate",
    "1e-3",
  ]
  res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  assert "resolved config" in res.stdout and f"devices: {devices}" in res.stdout
  return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


@pytest.mark.slow
@pytest.mark.subprocess
def test_cli_two_steps_8_devices_matches_1_device(tmp_path):
  one = _run_cli(tmp_path / "one", 1, "fsdp=1")
  eight = _run_cli(tmp_path / "eight", 8, "data=2,fsdp=2,tensor=2")
  assert len(one) == len(eight) == 4  # eval, step 1, step 2, eval
  for a, b in zip(one, eight):
    assert a["step"] == b["step"]
    for k in ("reward_mean", "eval_accuracy", "eval_pass@2", "completion_length"):
      if k in a:
        assert a[k] == pytest.approx(b[k], abs=1e-6), k
    for k in ("loss", "kl", "policy_loss", "entropy", "grad_norm"):
      if k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-5), k
