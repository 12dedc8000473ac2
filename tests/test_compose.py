"""Composition cells of the trainer (issue 35.8, docs/trainer.md "What composes"): each combination of
engine × turns × schedule the single-process machine can run trains two steps and resumes exactly (the
straight run's in-memory checkpoint of step 1, then step 2 again == the straight step 2: parameters bit for
bit, loss and rewards equal; with bounded staleness the same prompts in the same order, ``rollouts.jsonl``),
with the cell's own invariant checked against a hand computation:

- an environment with dynamic sampling (``objective.dynamic_sampling``): groups are kept by their
  environment rewards (every kept group informative unless the rounds ran out);
- an environment with bounded staleness (``rollout.max_staleness: 1``): step 2 trains a batch sampled by
  version 0 (staleness 1), ``old_logp`` recomputed;
- an environment through a user's engine whose log-probs are 0.5 nats off the policy's (``OffsetEngine``):
  ``engine/mismatch_k3`` equals exp(-0.5) + 0.5 - 1, the k3 of that offset — over policy tokens only (the
  observation tokens' zeros would change it) — at every step whose batch is not stale;
- that engine with bounded staleness, single-turn;
- all of them at once (engine × environment × async × dynamic sampling);
- partial rollouts through that engine (``rollout.partial``: rows re-submitted to it at every boundary).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from test_async_rollout import REWARDS
from test_engines import OFFSET
from test_trainer import tiny
from test_trainer_env import ENV, _memory_checkpoints, _params, dataclass_replace

from jaxgrpo.loop import async_rollout
from jaxgrpo.run.trainer import Trainer

ENGINE = {"rollout.engine": "test_engines:make_offset_engine", "objective.importance_correction": "tis"}
ASYNC = {"rollout.max_staleness": 1, "objective.importance_correction": "tis"}
DYNAMIC = {"objective.dynamic_sampling": True, "rollout.dynamic_sampling_max_rounds": 2}
CELLS = {
  "env-dynamic": {**ENV, **DYNAMIC},
  "env-async": {**ENV, **ASYNC},
  "env-engine": {**ENV, **ENGINE},
  "engine-async": {**ENGINE, **ASYNC},
  "env-engine-async-dynamic": {**ENV, **ENGINE, **ASYNC, **DYNAMIC},
  # partial rollouts through the engine (EnginePool), one batch ahead: the resume re-draws the rows in flight
  "engine-partial": {
    **ENGINE,
    **ASYNC,
    "rollout.max_staleness": 2,
    "rollout.partial": {"enabled": True, "refill_every": 2},
  },
}
K3_OF_OFFSET = math.exp(-OFFSET) + OFFSET - 1  # r - log r - 1 at r = π/μ = exp(-0.5)


@pytest.mark.slow
@pytest.mark.parametrize("cell", list(CELLS))
def test_cell_trains_two_steps_and_resumes_exactly(tmp_path, cell):
  changes = CELLS[cell]
  env = "env.factory" in changes
  cfg = tiny(
    **changes,
    **{"run.steps": 2, "run.out": str(tmp_path / "a"), "checkpoint.every": 1, "optim.learning_rate": 3e-2},
  )
  rewards = None if env else REWARDS  # single-turn: a reward that varies (the untrained model never answers)
  saved, save, restore_from = _memory_checkpoints()
  straight = Trainer(cfg, checkpoint_fn=save, reward_fns=rewards, log=None)
  steps = [r for r in straight.run(handle_signals=False) if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2] and sorted(saved) == [1, 2]
  assert all(r["grad_norm"] > 0 for r in steps), [r["grad_norm"] for r in steps]  # the resume below can fail
  for r in steps:
    if env:
      assert 1.0 <= r["env/turns"] <= 2.0 and r["env/observation_tokens"] >= 0
    if "rollout.engine" in changes and r.get("async/staleness_max", 0) == 0:  # stale: the update's drift adds to it
      assert r["engine/mismatch_k3"] == pytest.approx(K3_OF_OFFSET, rel=1e-4), r["engine/mismatch_k3"]
    if "rollout.max_staleness" in changes:
      assert r["async/staleness_max"] == (0 if r["step"] == 1 else 1)
      assert r["async/mismatch_kl"] == r.get("engine/mismatch_k3", 0.0 if r["step"] == 1 else r["async/mismatch_kl"])
    if "objective.dynamic_sampling" in changes:
      assert 1 <= r["dynamic_sampling/rounds"] <= 2
      if r["dynamic_sampling/rounds"] == 1:
        assert r["dynamic_sampling/dropped_groups"] == 0
  resumed = Trainer(
    dataclass_replace(cfg, steps=2, out=tmp_path / "b"), restore_fn=restore_from(1), reward_fns=rewards, log=None
  )
  assert resumed.resumed
  got = [r for r in resumed.run(handle_signals=False) if "loss" in r]
  assert [r["step"] for r in got] == [2]
  if "rollout.max_staleness" in changes:
    # a resume samples the checkpoint's untrained prompts again with the restored version (the straight run
    # sampled them with the one before): exact is every prompt trained once, in order (the ledgers agree)
    ledger = lambda run: [json.loads(x) for x in open(tmp_path / run / async_rollout.LEDGER)]
    assert [r["prompts"] for r in ledger("b")] == [r["prompts"] for r in ledger("a")][1:]
    assert [r["versions"] for r in ledger("b")] == [[1] * len(ledger("b")[0]["versions"])]
    return
  want, have = _params(straight), _params(resumed)
  for k in want:
    np.testing.assert_array_equal(have[k], want[k], err_msg=k)
  assert got[0]["loss"] == steps[1]["loss"] and got[0]["reward_mean"] == steps[1]["reward_mean"]


def test_what_is_refused_and_what_loads():
  """The combinations that once were refused load; the refusals left name their physical reason."""
  from jaxgrpo.run.composition import check_composition
  from jaxgrpo.run.specs import load_config

  for changes in CELLS.values():
    check_composition(load_config(None, changes))
  with pytest.raises(ValueError, match=r"`devices.rollout`=2 gives the built-in sampler devices of its own"):
    load_config(None, {**ENGINE, "devices.rollout": 2})
  with pytest.raises(ValueError, match=r"with `step.temperature`=0.7 != 1 cannot report full-vocabulary"):
    load_config(None, {"rollout.engine": "vllm", "step.temperature": 0.7, "rollout.top_p": 0.9})
