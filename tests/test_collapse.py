"""jaxgrpo.run.collapse on metric sequences: the one a learning rate of 1e6 produced in a real run
(tests/test_failure_modes_runs.py::test_collapse_without_nan_stops_and_keeps_the_good_checkpoints
runs it through scripts/train.py), an untrained model that starts near uniform (never flagged), the
zero-reward rule, warn-once-per-episode, and the settings' checks."""

from __future__ import annotations

import math

import pytest

from jaxgrpo.run.collapse import CollapseGuard, CollapseWatch, PolicyCollapsed

V = 128  # the tiny synthetic model's vocabulary: ln V = 4.852
# entropy and mean reward of steps 1-9 of the tiny run resumed at step 4 with learning rate 1e6
ENTROPY = [1.7469, 1.8528, 1.7389, 1.5954, 4.852, 4.852, 4.852, 4.852, 4.852]
REWARD = [0.375, 0.375, 0.625, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]


def _records(entropy=ENTROPY, reward=REWARD):
  return [{"step": i + 1, "entropy": e, "reward_mean": r} for i, (e, r) in enumerate(zip(entropy, reward))]


def test_the_lr_1e6_collapse_stops_at_its_first_uniform_step():
  watch, log = CollapseWatch(CollapseGuard(), V), []
  with pytest.raises(PolicyCollapsed) as e:
    for rec in _records():
      watch.check(rec, log.append)
  assert e.value.step == 5 and not log
  msg = str(e.value)
  assert msg.startswith("training stopped at step 5: the policy collapsed (entropy 4.8520 nats is 100.0% of ln V")
  assert f"ln V = {math.log(V):.4f}" in msg and "Nothing of step 5 was saved" in msg and "--on-collapse warn" in msg


def test_a_policy_that_starts_near_uniform_is_not_flagged():
  """An untrained random model: entropy ~0.99 ln V from the first step, then learning."""
  lnv = math.log(V)
  entropy = [0.99 * lnv, 0.985 * lnv, 0.97 * lnv, 0.9 * lnv, 0.96 * lnv, 0.6 * lnv]
  watch = CollapseWatch(CollapseGuard(), V)
  assert [watch.update(r) for r in _records(entropy, [0.0] * 6)] == [None] * 6


def test_zero_reward_rule_and_warn_once_per_episode():
  guard = CollapseGuard(action="warn", entropy_frac=None, zero_reward_steps=3)
  reward = [0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0]  # zeros before any reward: not a collapse
  watch, log = CollapseWatch(guard, V), []
  for rec in _records([1.0] * len(reward), reward):
    watch.check(rec, log.append)
  assert [line.split(":")[0] for line in log] == ["warning", "warning"]
  assert log[0].startswith("warning: step 7: the policy collapsed (mean reward 0 for 3 consecutive steps")
  assert log[1].startswith("warning: step 12:")  # a second episode after the reward came back


def test_off_and_bad_settings():
  watch = CollapseWatch(CollapseGuard(action="off"), V)
  assert all(watch.update(r) is None for r in _records())
  with pytest.raises(ValueError, match=r"`action` must be one of \('stop', 'warn', 'off'\); got 'halt'"):
    CollapseGuard(action="halt")
  with pytest.raises(ValueError, match=r"`entropy_frac` must be in \(0, 1\] or None; got 1.5"):
    CollapseGuard(entropy_frac=1.5)
  with pytest.raises(ValueError, match=r"`zero_reward_steps` must be an int >= 0; got -1"):
    CollapseGuard(zero_reward_steps=-1)
