"""The trainer's ``env:`` section: a multi-turn run of the synthetic model in an environment written
against the documented protocol alone (below), with evaluation, the env metrics, packing, LoRA, and an
exact in-process resume (the straight run's checkpoint of step 2, then 2 more steps == 4 straight)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_trainer import tiny

from jaxgrpo.environments import StepResult
from jaxgrpo.environments.spec import EnvSpec, load_factory
from jaxgrpo.rewards import extract_boxed
from jaxgrpo.specs import load_config
from jaxgrpo.trainer import Trainer


class SecondChance:
  """Answer "What is a + b?"; a wrong (or missing) boxed answer gets one retry: reward 1 at the first
  turn, 0.5 at the second, plus a small shaping term, 0.1 × the share of digits in the last turn's text (an
  untrained policy is never right: without it every advantage is 0 and no step changes the parameters)."""

  tools = ()

  def reset(self, row):
    self.row, self.turn = row, 0
    return [{"role": "user", "content": row["problem"]}]

  def step(self, text):
    self.turn += 1
    right = extract_boxed(text) == self.row["answer"]
    if right or self.turn == 2:
      digits = sum(c.isdigit() for c in text) / max(len(text), 1)
      return StepResult((), (1.0 if self.turn == 1 else 0.5) * right + 0.1 * digits, True)
    return StepResult([{"role": "user", "content": "Wrong. Try again."}], 0.0, False, {"retries": 1.0})


def make_env(row):
  return SecondChance()


ENV = {"env.factory": "test_trainer_env:make_env", "env.max_turns": 2, "env.max_tokens": 40, "env.turn_tokens": 12}


def _memory_checkpoints():
  saved = {}

  def save(snapshot, meta):
    saved[int(snapshot.step)] = jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, snapshot)

  def restore_from(step):
    return lambda meta, template: saved[step]

  return saved, save, restore_from


def _params(trainer):
  return {
    jax.tree_util.keystr(p): np.asarray(x)
    for p, x in jax.tree_util.tree_flatten_with_path(trainer.state.train.params)[0]
  }


@pytest.mark.slow
def test_env_run_metrics_eval_and_exact_resume(tmp_path):
  cfg = tiny(
    **ENV,
    **{
      "run.steps": 4,
      "run.out": str(tmp_path / "a"),
      "eval.every": 4,
      # no warm-up: 60 warm-up steps (run again by the resumed Trainer, ~10 s of CPU) left every reward at 0 too
      "data.arithmetic.sft_steps": 0,
      "checkpoint.every": 2,
    },
  )
  # the straight run's own snapshot of step 2 is the checkpoint resumed below (a run stopped after 2
  # steps gives the same state: test_checkpoint_resume.py::test_resume_is_exact, real runs)
  saved, save, restore_from = _memory_checkpoints()
  straight = Trainer(cfg, checkpoint_fn=save, log=None)
  records = straight.run(handle_signals=False)
  steps = [r for r in records if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2, 3, 4]
  for r in steps:
    assert 1.0 <= r["env/turns"] <= 2.0 and "env/retries" in r and "env/policy_tokens" in r
    assert r["tokens"] == pytest.approx(r["env/policy_tokens"] * 8)  # the loss counts policy tokens only
  evals = [r for r in records if "eval_env_reward" in r]  # the mean environment reward, not an accuracy
  assert [r["step"] for r in evals] == [0, 4] and "eval_env/turns" in evals[0]
  assert not any("eval_accuracy" in r for r in records) and cfg.checkpoint.best_metric == "eval_env_reward"
  assert sorted(saved) == [2, 4]
  # steps 3 and 4 change the parameters, so the resumed run's equality below can fail
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), saved[2].params, saved[4].params))
  assert any(moved) and all(r["grad_norm"] > 0 for r in steps), [r["grad_norm"] for r in steps]
  resumed = Trainer(dataclass_replace(cfg, steps=4, out=tmp_path / "c"), restore_fn=restore_from(2), log=None)
  assert resumed.resumed
  got = resumed.run(handle_signals=False)
  want = _params(straight)
  have = _params(resumed)
  for k in want:
    np.testing.assert_array_equal(have[k], want[k], err_msg=k)
  for g, w in zip([r for r in got if "loss" in r], steps[2:]):
    assert g["loss"] == w["loss"] and g["reward_mean"] == w["reward_mean"]


def dataclass_replace(cfg, *, steps, out):
  import dataclasses

  return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, steps=steps, out=str(out)))


@pytest.mark.slow
def test_env_run_with_lora_and_packing(tmp_path):
  cfg = tiny(
    **ENV,
    **{"run.steps": 2, "run.out": str(tmp_path), "lora": {"rank": 4, "alpha": 8, "dropout": 0.0}, "step.packing": 128},
  )
  records = Trainer(cfg, log=None).run(handle_signals=False)
  assert [r["step"] for r in records if "loss" in r] == [1, 2]
  assert all(np.isfinite(r["loss"]) and r["env/turns"] >= 1 for r in records if "loss" in r)


def test_env_section_errors():
  with pytest.raises(ValueError, match="env.factory"):
    load_factory("no_colon")
  with pytest.raises(ValueError, match="cannot import"):
    load_factory("no_such_module_xyz:make")
  with pytest.raises(ValueError, match="env.max_turns"):
    EnvSpec(factory="a:b", max_turns=0)
  with pytest.raises(ValueError, match="dynamic_sampling"):
    load_config(None, {**ENV, "objective.preset": "dapo"})
