"""``iteration.select_groups`` (DAPO's dynamic sampling, the trainer's group selection) against a
reference written from the definition in plain Python: the batch is the first ``num_groups`` groups,
in sampling order, whose rewards are not all equal; after ``max_rounds`` rounds a short batch is
filled with the earliest equal-reward groups."""

from __future__ import annotations

import numpy as np
import pytest

from jaxgrpo.loop import iteration


def _reference(rounds: list[list[float]], n: int, g: int, max_rounds: int):
  """(kept, dropped, done) from the definition: walk every group of every round in order."""
  order = [(r, b) for r in range(len(rounds)) for b in range(n)]
  values = {(r, b): rounds[r][b * g : (b + 1) * g] for r, b in order}
  varied = [k for k in order if len(set(values[k])) > 1]
  equal = [k for k in order if len(set(values[k])) == 1]
  if len(varied) >= n:
    return varied[:n], len(equal), True
  if len(rounds) >= max_rounds:
    return varied + equal[: n - len(varied)], len(equal), True
  return varied, len(equal), False


def _drive(rng, n, g, max_rounds, levels):
  """Sample rounds (rewards drawn from ``levels`` values, so equal groups are common) until done."""
  rounds = []
  while True:
    rounds.append(rng.integers(0, levels, n * g).astype(np.float32).tolist())
    got = iteration.select_groups(
      [np.asarray(r, np.float32) for r in rounds], num_groups=n, group_size=g, max_rounds=max_rounds
    )
    want = _reference(rounds, n, g, max_rounds)
    assert (got.kept, got.dropped, got.done) == want, (rounds, got, want)
    if got.done:
      return rounds, got


@pytest.mark.parametrize("levels", [1, 2, 3])
def test_select_groups_matches_the_definition(levels):
  rng = np.random.default_rng(levels)
  seen_rounds = set()
  for _ in range(300):
    n, g, max_rounds = int(rng.integers(1, 6)), int(rng.integers(1, 5)), int(rng.integers(1, 5))
    rounds, got = _drive(rng, n, g, max_rounds, levels)
    seen_rounds.add(len(rounds))
    assert len(got.kept) == n and len(set(got.kept)) == n
    assert len(rounds) <= max_rounds
  if levels == 2:
    assert len(seen_rounds) > 1  # refills happened


def test_select_groups_by_hand():
  g = 2
  r0 = np.array([1, 1, 0, 1, 0, 0, 1, 0], np.float32)  # groups: equal, varied, equal, varied
  got = iteration.select_groups([r0], num_groups=4, group_size=g, max_rounds=3)
  assert got[:3] == ([(0, 1), (0, 3)], 2, False)
  r1 = np.array([0.5, 0.5, 0.2, 0.3, 1, 0, 0, 0], np.float32)  # equal, varied, varied, equal
  got = iteration.select_groups([r0, r1], num_groups=4, group_size=g, max_rounds=3)
  assert got[:3] == ([(0, 1), (0, 3), (1, 1), (1, 2)], 4, True)
  got = iteration.select_groups([r0, r0], num_groups=4, group_size=g, max_rounds=2)
  # max rounds reached: two varied per round, then no room left, so no equal group is used
  assert got[:3] == ([(0, 1), (0, 3), (1, 1), (1, 3)], 4, True)
  ones = np.ones(8, np.float32)
  got = iteration.select_groups([ones, ones], num_groups=4, group_size=g, max_rounds=2)
  assert got[:3] == ([(0, 0), (0, 1), (0, 2), (0, 3)], 8, True)  # all equal: the first round's groups


def test_select_groups_without_dynamic_sampling_keeps_the_first_round():
  ones = np.ones(6, np.float32)
  got = iteration.select_groups([ones], num_groups=3, group_size=2, max_rounds=4, dynamic=False)
  assert got[:3] == ([(0, 0), (0, 1), (0, 2)], 0, True)


@pytest.mark.parametrize(
  "kwargs, rewards, error, match",
  [
    (dict(num_groups=0, group_size=2, max_rounds=1), [np.zeros(2)], ValueError, "`num_groups` must be >= 1"),
    (dict(num_groups=1, group_size=2.0, max_rounds=1), [np.zeros(2)], TypeError, "`group_size` must be a Python int"),
    (dict(num_groups=1, group_size=2, max_rounds=0), [np.zeros(2)], ValueError, "`max_rounds` must be >= 1"),
    (dict(num_groups=1, group_size=2, max_rounds=1), [], ValueError, "`rewards` must hold"),
    (dict(num_groups=2, group_size=2, max_rounds=1), [np.zeros(3)], ValueError, r"`rewards\[0\]` must have shape"),
  ],
)
def test_select_groups_errors(kwargs, rewards, error, match):
  with pytest.raises(error, match=match):
    iteration.select_groups(rewards, **kwargs)
