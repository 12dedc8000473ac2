"""On-policy distillation in a run (``objective.distill``, issue 52): a teacher loaded from the config (here the
arithmetic task's model of another size, ``synthetic:<hidden>x<layers>``) scores every batch on the learner
side; each composition cell trains two steps, logs the term (``distill/weight`` = w, ``distill/reverse_kl``
finite) and resumes exactly (the straight run's in-memory checkpoint of step 1, then step 2 again == the
straight step 2: parameters bit for bit, loss equal; with bounded staleness the same prompts in the same order).

- distillation alone: every reward weight 0, so the RL advantage is 0 and only the teacher's signal trains
  (grad_norm > 0 shows it does);
- GRPO + distillation; bounded staleness (async, k = 1); partial rollouts through an engine; an environment
  (observation tokens are not distilled: the step's policy mask, checked number for number in
  tests/test_distill.py::test_train_step_with_a_teacher).

The numbers of the term itself (the advantage, the update, the teacher's pass) are checked against NumPy in
tests/test_distill.py; this file checks that the pieces compose in the trainer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_async_rollout import REWARDS
from test_compose import ASYNC, CELLS
from test_trainer import tiny
from test_trainer_env import ENV, _memory_checkpoints, _params, dataclass_replace

from jaxgrpo.loop import async_rollout
from jaxgrpo.run.trainer import Trainer

TEACHER = {"teacher": "synthetic:48x2", "weight": 0.5, "clip": 5.0}
RUN_CELLS = {
  "alone": ({"reward.weights": {"accuracy": 0.0}}, None),
  "grpo": ({}, REWARDS),
  "async": (ASYNC, REWARDS),
  "partial": (CELLS["engine-partial"], REWARDS),
  "env": (ENV, None),
}


def _run_cell(tmp_path, changes, rewards):
  cfg = tiny(
    **changes,
    **{
      "objective.distill": TEACHER,
      "run.steps": 2,
      "run.out": str(tmp_path / "a"),
      "checkpoint.every": 1,
      "optim.learning_rate": 3e-2,
    },
  )
  saved, save, restore_from = _memory_checkpoints()
  straight = Trainer(cfg, checkpoint_fn=save, reward_fns=rewards, log=None)
  steps = [r for r in straight.run(handle_signals=False) if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2] and sorted(saved) == [1, 2]
  for r in steps:
    assert r["distill/weight"] == TEACHER["weight"] and np.isfinite(r["distill/reverse_kl"]), r
    assert r["grad_norm"] > 0, r
  resumed = Trainer(
    dataclass_replace(cfg, steps=2, out=tmp_path / "b"), restore_fn=restore_from(1), reward_fns=rewards, log=None
  )
  assert resumed.resumed and resumed.teacher is not None
  got = [r for r in resumed.run(handle_signals=False) if "loss" in r]
  assert [r["step"] for r in got] == [2]
  if "rollout.max_staleness" in changes:  # as tests/test_compose.py: the same prompts, once each, in order
    ledger = lambda run: [json.loads(x) for x in open(tmp_path / run / async_rollout.LEDGER)]
    assert [r["prompts"] for r in ledger("b")] == [r["prompts"] for r in ledger("a")][1:]
    return steps
  want, have = _params(straight), _params(resumed)
  for k in want:
    np.testing.assert_array_equal(have[k], want[k], err_msg=k)
  assert got[0]["loss"] == steps[1]["loss"] and got[0]["distill/reverse_kl"] == steps[1]["distill/reverse_kl"]
  return steps


def test_distillation_alone_trains_and_resumes_exactly(tmp_path):
  """Every reward weight 0: GRPO's advantages are 0, the teacher's term alone moves the policy."""
  steps = _run_cell(tmp_path, *RUN_CELLS["alone"])
  assert all(r["reward_mean"] == 0.0 for r in steps)


@pytest.mark.slow
@pytest.mark.parametrize("cell", [c for c in RUN_CELLS if c != "alone"])
def test_cell_with_a_teacher_trains_and_resumes_exactly(tmp_path, cell):
  _run_cell(tmp_path, *RUN_CELLS[cell])


def test_what_a_teacher_refuses_in_one_line(tmp_path):
  """No teacher, a top-k kind (not in the step yet), dynamic sampling, a teacher of another tokenizer, a teacher
  path that does not exist: one line each, before anything heavy."""
  from jaxgrpo.run import teacher as teacher_lib

  for distill, more, match in [
    ({"weight": 1.0}, {}, "needs `teacher`"),
    ({**TEACHER, "kind": "jsd"}, {}, "top-k forms are not in the train step"),
    (TEACHER, {"objective.dynamic_sampling": True}, "dynamic_sampling` with `objective.distill`"),
    ({**TEACHER, "kind": "kl"}, {}, "distill.kind"),
    ({**TEACHER, "beta": 2.0}, {}, "distill.beta"),
  ]:
    with pytest.raises(ValueError, match=match):
      tiny(**{"objective.distill": distill, **more})
  with pytest.raises(ValueError, match="does not exist"):
    Trainer(tiny(**{"objective.distill": {**TEACHER, "teacher": str(tmp_path / "nowhere")}}), log=None)
  with pytest.raises(ValueError, match="synthetic:<hidden_size>x<num_layers>"):
    teacher_lib.teacher_source("synthetic:48")

  class Other:  # a tokenizer with one entry renumbered
    def __init__(self, vocab):
      self.vocab = vocab

    def get_vocab(self):
      return self.vocab

  mine = {"a": 0, "b": 1, "c": 2}
  teacher_lib.check_tokenizers(Other(mine), Other(dict(mine)), "t")
  with pytest.raises(ValueError, match=r"its tokenizer differs from the policy's \(3 vs 3 entries, 2 differing"):
    teacher_lib.check_tokenizers(Other(mine), Other({**mine, "c": 5}), "t")
