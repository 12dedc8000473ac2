"""A reward model trained here (jaxgrpo.tasks.arithmetic_rm), saved as a Hugging Face folder
(jaxgrpo.rewards.reward_model.save_reward_model) and trained against by the trainer as its only reward
(``reward.sources``, scripts/configs/demo_rm.yaml).

- The saved folder is what transformers reads: ``AutoModelForSequenceClassification`` scores as our model does
  (≤ 1e-4, f32), and its parameter count is the bytes ``parameter_bytes`` states.
- A short fit ranks a correct answer above a wrong one on held-out problems (the kinds a short fit learns; the
  full fit's accuracy on every kind is scripts/train_reward_model.py's, BENCHMARKS.md), the trainer places the
  reward model on its mesh, logs its mean beside the verifier's, and a run resumed from its step-2 checkpoint
  equals the straight run bit for bit (parameters, logged rewards).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import train_main_here
from jax.sharding import AbstractMesh
from test_trainer import ROOT, tiny
from test_trainer_env import _memory_checkpoints, _params

from jaxgrpo.rewards.reward_model import (
  RewardModel,
  RewardModelReward,
  load_reward_model,
  parameter_bytes,
  save_reward_model,
)
from jaxgrpo.run import assemble
from jaxgrpo.run.spec_schema import RewardSourceSpec
from jaxgrpo.run.trainer import Trainer
from jaxgrpo.tasks import arithmetic, arithmetic_rm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_saved_reward_model_is_what_transformers_reads(tmp_path):
  tok = arithmetic.build_tokenizer()
  cfg = arithmetic.tiny_model_config(len(tok), hidden_size=32, num_layers=2)
  rm = RewardModel(cfg, 2, pad_token_id=tok.pad_token_id, rngs=nnx.Rngs(3))
  rm.score_head[...] = rm.score_head[...] * 50.0  # scores of order 1, so that 1e-4 is a tight bound
  save_reward_model(rm, tmp_path, tok)
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
  assert type(hf).__name__ == "Qwen3ForSequenceClassification" and hf.config.pad_token_id == tok.pad_token_id
  rows = [tok("What is 3 + 4?" + " 7" * n)["input_ids"] for n in (1, 4, 9)]
  width = max(map(len, rows))
  tokens = np.full((3, width), tok.pad_token_id, np.int64)
  for i, r in enumerate(rows):
    tokens[i, : len(r)] = r
  mask = tokens != tok.pad_token_id
  with torch.no_grad():
    want = hf(input_ids=torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask).long()).logits.numpy()
  assert np.abs(want).max() > 0.1
  np.testing.assert_allclose(rm.score(tokens, mask), want, atol=1e-4, rtol=0)
  np.testing.assert_allclose(load_reward_model(tmp_path).score(tokens, mask), want, atol=1e-4, rtol=0)
  total, per_device = parameter_bytes(rm)
  assert total == per_device == 4 * sum(p.numel() for p in hf.parameters())  # one device: all of it


def test_a_reward_model_batch_must_split_over_the_mesh():
  spec = RewardSourceSpec(name="rm", kind="reward_model", path="/nowhere", batch_size=3)
  mesh = AbstractMesh((1, 2, 1), ("data", "fsdp", "tensor"))
  with pytest.raises(ValueError, match=r"reward.sources\['rm'\].batch_size` must be a multiple .* = 2\).*got 3"):
    assemble.reward_source(spec, mesh=mesh)  # refused before the folder is read


def test_the_demo_config_without_its_reward_model_is_one_error_line(tmp_path, capfd):
  missing = str(tmp_path / "no_rm")
  argv = ["--config", os.path.join(ROOT, "scripts", "configs", "demo_rm.yaml"), "--run.out", str(tmp_path / "run")]
  argv += ["--reward.sources", f"[{{name: rm, kind: reward_model, path: {missing}}}]"]
  with pytest.raises(BaseException) as e:
    train_main_here(argv)
  assert getattr(e.value, "code", None) == 2, e.value
  r = capfd.readouterr()
  assert "resolved config" not in r.out  # before anything is built (the warm-up)
  assert f"`reward.sources['rm'].path`: no such file or directory: {missing}" in r.err, r.err[-2000:]


@pytest.mark.slow
def test_trained_reward_model_ranks_and_a_run_against_it_resumes_exactly(tmp_path):
  tok = arithmetic.build_tokenizer()
  train_rows, held_rows = arithmetic.arithmetic_split(400, 64, seed=0, max_operand=19)
  # no instruction: rows half as long (the run below renders its prompts the same way)
  fit = arithmetic_rm.train_reward_model(
    tok, train_rows, steps=150, batch_size=32, learning_rate=1e-2, instruction=None
  )
  held = arithmetic_rm.preference_pairs(held_rows, seed=1)
  before = RewardModel(fit.model.config, 1, pad_token_id=tok.pad_token_id, rngs=nnx.Rngs(0))
  acc = arithmetic_rm.pair_accuracy(fit.model, tok, held, instruction=None)
  untrained = arithmetic_rm.pair_accuracy(before, tok, held, instruction=None)
  # what 150 steps learn on problems never trained on: a box and a well-formed answer (the full fit,
  # scripts/train_reward_model.py, also learns the boxed value's agreement with the worked result)
  assert acc["no_box"] >= 0.9 and acc["random"] >= 0.8, (acc, untrained)
  assert acc["no_box"] > untrained["no_box"] + 0.2, (acc, untrained)
  path = str(tmp_path / "rm")
  save_reward_model(fit.model, path, tok)

  cfg = tiny(
    **{
      "data.instruction": None,
      "run.steps": 3,
      "run.out": str(tmp_path / "a"),
      "checkpoint.every": 2,
      "reward.weights": {"accuracy": 0.0},
      "reward.sources": [{"name": "rm", "kind": "reward_model", "path": path, "batch_size": 8}],
    }
  )
  saved, save, restore_from = _memory_checkpoints()
  straight = Trainer(cfg, checkpoint_fn=save, log=None)
  rm = dict((n, f) for n, f, _ in straight.reward_set.fns)["rm"]
  assert isinstance(rm, RewardModelReward) and rm.model.mesh is straight.mesh  # beside the policy
  leaf = jax.tree.leaves(nnx.state(rm.model, nnx.Param))[0]
  assert leaf.sharding.mesh.devices.tolist() == straight.mesh.devices.tolist()
  records = straight.run(handle_signals=False)
  steps = [r for r in records if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2, 3] and sorted(saved) == [2, 3]
  for r in steps:
    # the reward is the reward model's alone (accuracy has weight 0 and is logged beside it); no failures
    assert r["reward_mean"] == pytest.approx(r["reward/rm"], rel=1e-5, abs=1e-6)
    assert "reward/accuracy" in r and not any(k.startswith("reward_counters/rm/") for k in r)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), saved[2].params, saved[3].params))
  assert any(moved)
  resumed = Trainer(
    dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out=str(tmp_path / "b"))),
    restore_fn=restore_from(2),
    log=None,
  )
  assert resumed.resumed
  got = [r for r in resumed.run(handle_signals=False) if "loss" in r]
  want, have = _params(straight), _params(resumed)
  for k in want:
    np.testing.assert_array_equal(have[k], want[k], err_msg=k)
  assert [r["step"] for r in got] == [3]
  for key in ("loss", "reward_mean", "reward/rm", "reward_std"):
    assert got[0][key] == steps[2][key], key
