"""The trainer's ``env:`` section: a multi-turn run of the synthetic model in an environment written
against the documented protocol alone (below), with evaluation, the env metrics, packing, LoRA, and an
exact in-process resume (the straight run's checkpoint of step 2, then 2 more steps == 4 straight)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from envs_for_tests import SecondChance
from test_trainer import tiny

from jaxgrpo.rewards.reward_set import extract_boxed
from jaxgrpo.rollout.environments import StepResult
from jaxgrpo.rollout.environments.spec import EnvSpec, load_factory
from jaxgrpo.run.specs import load_config
from jaxgrpo.run.trainer import Trainer


def make_env(row):
  return SecondChance()  # envs_for_tests.SecondChance (no pytest import: the vLLM venv's child uses it too)


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
    **{"run.steps": 2, "run.out": str(tmp_path), "lora": {"rank": 4, "alpha": 8, "dropout": 0.1}, "step.packing": 128},
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
  assert load_config(None, {**ENV, "objective.preset": "dapo"}).objective.dynamic_sampling  # composes (test_compose.py)


# ----------------------------------------------------------------------------- env.episodes: no dataset
SEEN: list[dict] = []  # every row an EpisodeSum environment was reset with (this run's, in order)


class EpisodeSum:
  """Makes its own episode from the row's seed: "What is a + b?" with a, b drawn by ``random.Random(seed)``;
  reward 1 for the right boxed sum, plus the digit-share shaping of :class:`SecondChance`."""

  tools = ()

  def reset(self, row):
    import random

    SEEN.append(dict(row))
    rng = random.Random(row["seed"])
    self.a, self.b = rng.randint(0, 9), rng.randint(0, 9)
    return [{"role": "user", "content": f"What is {self.a} + {self.b}?"}]

  def step(self, text):
    digits = sum(c.isdigit() for c in text) / max(len(text), 1)
    return StepResult((), float(extract_boxed(text) == str(self.a + self.b)) + 0.1 * digits, True)


def make_episode_env(row):
  return EpisodeSum()


def test_env_episodes_train_and_evaluate_without_a_dataset(tmp_path):
  """``env.episodes: N`` (issue 39.5): the rows are ``{"seed", "episode", "split"}`` built from seeds (the
  arithmetic task's default data section is not read for prompts), ``env.eval_episodes: M`` is the held-out
  set (seeds from EVAL_SEED_OFFSET, disjoint from training's), and a dataset named beside it is refused."""
  import importlib

  from jaxgrpo.rollout.environments.spec import EVAL_SEED_OFFSET

  seen = importlib.import_module("test_trainer_env").SEEN  # the module object the factory was loaded from
  seen.clear()
  episodes = {
    "env.factory": "test_trainer_env:make_episode_env",
    "env.max_turns": 1,
    "env.max_tokens": 12,
    "env.episodes": 5,
    "env.eval_episodes": 3,
  }
  cfg = tiny(**episodes, **{"run.out": str(tmp_path)})  # 2 steps, eval k=2 before and after
  trainer = Trainer(cfg, log=None)
  assert trainer.examples == [{"seed": i, "episode": i, "split": "train"} for i in range(5)]
  records = trainer.run(handle_signals=False)
  g, per_step = cfg.rollout.group_size, cfg.rollout.prompts_per_step
  evals = [r for r in records if "eval_env_reward" in r]
  assert [r["step"] for r in evals] == [0, 2] and all(0.0 <= r["eval_env_reward"] <= 1.1 for r in evals)
  assert [r["step"] for r in records if "loss" in r] == [1, 2]
  want_eval = [{"seed": EVAL_SEED_OFFSET + j, "episode": j, "split": "eval"} for j in range(3)]
  chunks = [seen[:6], seen[6 : 6 + 2 * per_step * g], seen[6 + 2 * per_step * g :]]  # eval, 2 steps, eval
  for chunk in (chunks[0], chunks[2]):
    assert chunk == [row for row in want_eval for _ in range(2)]  # k = 2 trajectories per held-out episode
  train_rows = chunks[1]
  assert len(train_rows) == 2 * per_step * g and all(r["split"] == "train" and 0 <= r["seed"] < 5 for r in train_rows)
  assert all(set(r) == {"seed", "episode", "split"} and r["seed"] == r["episode"] for r in train_rows)
  # a dataset beside env.episodes, and eval_episodes without episodes, are refused naming the fields
  with pytest.raises(ValueError, match=r"env.episodes.*data.dataset='x.jsonl'"):
    load_config(None, {**episodes, "data.dataset": "x.jsonl"})
  with pytest.raises(ValueError, match="env.eval_episodes.*needs `env.episodes`"):
    EnvSpec(factory="a:b", eval_episodes=2)
  with pytest.raises(ValueError, match=r"env.episodes.*\[1, 1000000000\]"):
    EnvSpec(factory="a:b", episodes=0)
