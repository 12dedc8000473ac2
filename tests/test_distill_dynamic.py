"""Dynamic sampling with a distillation teacher (issue 52 item 3): a group is informative when its rewards vary
**or** the teacher still disagrees with the student on its tokens — its mean ``|log π_s(y_t) − log π_t(y_t)|``
over the distilled tokens (``scoring.teacher_signal``) above ``objective.distill.min_signal``. The teacher scores
each round when it is sampled; the step trains on those log-probs (no second teacher pass).

- the statistic and the selection against NumPy written from the definition (loops over groups and tokens);
- a run whose rewards are all equal: with a teacher that disagrees every group is kept (``kept_by_teacher``);
  with a teacher equal to the student every group is dropped and the batch is filled after ``max_rounds``; the
  logged counts equal the ones NumPy computes from the scored rounds; the learner's teacher never runs, and the
  step receives the collection's teacher log-probs — through synchronous rounds and through partial rollouts' row
  pool (each complete group scored once, when it completes);
- every rollout path composes with it (bounded staleness, environments, environments in partial rollouts).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from test_distill_run import TEACHER
from test_trainer import tiny

from jaxgrpo.loop import collect, scoring
from jaxgrpo.step.batch import Batch


def _signal_numpy(old, teacher, mask, policy, g):
  out = []
  for b in range(mask.shape[0] // g):
    diffs = [
      abs(float(old[i, t]) - float(teacher[i, t]))
      for i in range(b * g, (b + 1) * g)
      for t in range(mask.shape[1])
      if mask[i, t] and (policy is None or policy[i, t])
    ]
    out.append(sum(diffs) / len(diffs) if diffs else 0.0)
  return np.array(out)


def test_teacher_signal_and_the_selection_match_numpy():
  rng = np.random.default_rng(0)
  b, t, g = 12, 7, 3
  mask = np.arange(t)[None] < rng.integers(0, t + 1, b)[:, None]  # some rows empty
  mask[3:6] = False  # group 1: no token at all -> signal 0
  policy = rng.random((b, t)) < 0.7
  old = np.where(mask, -3 * rng.random((b, t)), 0).astype(np.float32)
  teacher = np.where(mask, -3 * rng.random((b, t)), 7.0).astype(np.float32)  # 7 off the mask: never read
  z = np.zeros((b, 1), np.int32)
  rows = Batch(z, z.astype(bool), z, mask, old, np.repeat(np.arange(b // g), g), np.zeros(b), teacher_logp=teacher)
  for pm in (None, policy):
    got = scoring.teacher_signal(rows._replace(policy_mask=pm), g)
    np.testing.assert_allclose(got, _signal_numpy(old, teacher, mask, pm, g), rtol=1e-6)
    assert got[1] == 0.0
  # the selection: rewards equal in groups 0, 1, 3 (group 2 varies); signals 0.5, 0, 0, 2e-4 against 1e-3
  rewards = np.array([1, 1, 1, 0, 0, 0, 0, 1, 0, 2, 2, 2], np.float32)
  signal = np.array([0.5, 0.0, 0.0, 2e-4], np.float32)
  sel = collect.select_groups([rewards], num_groups=4, group_size=g, max_rounds=1, signal=[signal], min_signal=1e-3)
  assert sel.kept[:2] == [(0, 0), (0, 2)] and sel.by_teacher == 1 and sel.dropped == 2
  assert sel.kept[2:] == [(0, 1), (0, 3)]  # max_rounds reached: filled with the dropped groups, earliest first
  plain = collect.select_groups([rewards], num_groups=4, group_size=g, max_rounds=1)  # rewards only: unchanged
  assert plain.kept[:1] == [(0, 2)] and plain.dropped == 3 and plain.by_teacher == 0
  with pytest.raises(ValueError, match="`signal` must hold one array per round"):
    collect.select_groups([rewards], num_groups=4, group_size=g, max_rounds=1, signal=[], min_signal=0.0)


#: partial rollouts (the built-in engine's row pool, k = 1): the pool selects groups as they complete, in its own
#: path, which scores each complete group with the teacher once
PARTIAL = {
  "rollout.max_staleness": 1,
  "objective.importance_correction": "tis",
  "rollout.partial": {"enabled": True, "refill_every": 2},
}


def _run(tmp_path, name, *, same_teacher: bool, changes=None):
  """One step, every reward 0 (every group's rewards equal), dynamic sampling with at most 2 rounds; what each
  round's teacher scored, the learner's teacher calls and the step's teacher log-probs, recorded."""
  from jaxgrpo.run.trainer import Trainer
  from jaxgrpo.step import feed

  cfg = tiny(
    **{
      "objective.distill": TEACHER,
      "objective.dynamic_sampling": True,
      "rollout.dynamic_sampling_max_rounds": 2,
      "reward.weights": {"accuracy": 0.0},
      "run.steps": 1,
      "run.out": str(tmp_path / name),
      **(changes or {}),
    }
  )
  tr = Trainer(cfg, log=None)
  scorer = tr.source.teacher
  if same_teacher:  # the student's own weights as the teacher: it agrees with the sampler up to float noise
    own = feed.make_teacher(tr.step_fn, tr.model)
    scorer = partial(feed.teacher_host_scores, own, mesh=tr.mesh, train_config=tr.train_config)
  rounds, learner_calls, stepped = [], [], []
  tr.source.teacher = lambda rows: rounds.append(scorer(rows)) or rounds[-1]
  teacher, step = tr.learner.teacher, tr.learner.step_fn
  tr.learner.teacher = lambda batch: learner_calls.append(1) or teacher(batch)
  tr.learner.step_fn = lambda state, batch: stepped.append(np.asarray(batch.teacher_logp)) or step(state, batch)
  records = [r for r in tr.run(handle_signals=False) if "loss" in r]
  return records[0], rounds, learner_calls, stepped


@pytest.mark.slow
@pytest.mark.parametrize("partial", [False, True], ids=["rounds", "partial_pool"])
@pytest.mark.parametrize("same_teacher", [False, True], ids=["teacher_disagrees", "teacher_equals_student"])
def test_equal_rewards_are_kept_for_a_teacher_that_still_teaches(tmp_path, same_teacher, partial):
  """Synchronous rounds, and partial rollouts' pool (a round: the pool decoding until a batch's groups are
  complete; each complete group scored by the teacher once, as it completes)."""
  rec, rounds, learner_calls, stepped = _run(
    tmp_path, "r", same_teacher=same_teacher, changes=PARTIAL if partial else None
  )
  g, groups, threshold = 4, 2, TEACHER.get("min_signal", 1e-3)
  assert all(np.all(r.rewards == 0) for r in rounds)  # every group's rewards are equal
  signals = [_signal_numpy(r.old_logp, r.teacher_logp, r.mask, r.policy_mask, g) for r in rounds]
  kept_by_teacher = sum(int(x > threshold) for s in signals for x in s[:groups])
  dropped = sum(int(x <= threshold) for s in signals for x in s)
  if same_teacher:
    assert len(rounds) == 2 and all(np.all(s < 1e-4) for s in signals), signals  # float noise only
    assert (dropped, kept_by_teacher) == (4, 0)
  else:
    assert len(rounds) == 1 and all(np.all(s > 0.01) for s in signals), signals
    assert (dropped, kept_by_teacher) == (0, 2)
  assert rec["dynamic_sampling/rounds"] == len(rounds)
  assert rec["dynamic_sampling/dropped_groups"] == dropped
  assert rec["dynamic_sampling/kept_by_teacher"] == kept_by_teacher
  # one teacher pass per round, none on the learner side; the step trains on the collection's log-probs
  assert learner_calls == [] and len(stepped) == 1
  first = rounds[0]  # the batch's groups are round 0's (kept, or the earliest dropped when filled)
  t = first.teacher_logp.shape[1]
  np.testing.assert_array_equal(stepped[0][:, :t], first.teacher_logp)


def test_dynamic_sampling_with_a_teacher_is_refused_with_nothing():
  """Every rollout path composes: synchronous rounds, bounded staleness, partial rollouts' pools (the built-in
  engine's and another engine's), on one process or several (each scores its own rows; the signals are gathered,
  or, in the partial pools, every process takes each turn of the teacher's pass:
  tests/test_trainer_multihost.py and tests/test_compose_multihost.py run them)."""
  from test_compose import CELLS

  from jaxgrpo.run import composition

  for changes in ({}, PARTIAL, CELLS["engine-partial"]):
    cfg = tiny(**{"objective.distill": TEACHER, "objective.dynamic_sampling": True, **changes})
    for processes in (1, 2):
      composition.check_composition(cfg, process_count=processes)


@pytest.mark.slow
@pytest.mark.parametrize("cell", ["async", "env", "env-partial"])
def test_dynamic_sampling_with_a_teacher_composes(tmp_path, cell):
  """Bounded staleness (k = 1: the producer scores its rounds with the teacher), environments (multi-turn rows:
  the signal over the policy's tokens) and environments in partial rollouts' episode pool (each complete group's
  trajectories scored once): two steps train with the counts logged (async, every reward 0: both groups kept for
  the teacher), and the learner's teacher never runs (the batches carry the collection's log-probs)."""
  from test_compose import ASYNC
  from test_trainer_env import ENV

  from jaxgrpo.run.trainer import Trainer

  changes = {"async": {**ASYNC, "reward.weights": {"accuracy": 0.0}}, "env": ENV, "env-partial": {**ENV, **PARTIAL}}
  changes = changes[cell]
  cfg = tiny(
    **{
      "objective.distill": TEACHER,
      "objective.dynamic_sampling": True,
      "rollout.dynamic_sampling_max_rounds": 2,
      **changes,
      "run.steps": 2,
      "run.out": str(tmp_path),
    }
  )
  tr = Trainer(cfg, log=None)
  calls = []
  teacher = tr.learner.teacher
  tr.learner.teacher = lambda batch: calls.append(1) or teacher(batch)
  records = [r for r in tr.run(handle_signals=False) if "loss" in r]
  assert [r["step"] for r in records] == [1, 2] and calls == []
  for r in records:
    # async: every reward 0, so every kept group is the teacher's; env: the environment's rewards vary too
    least = 2 if cell == "async" else 0
    assert least <= r["dynamic_sampling/kept_by_teacher"] <= 2 and r["grad_norm"] > 0, r
    assert np.isfinite(r["distill/reverse_kl"])
