"""jaxgrpo.rewards: the reward table (fractions, LaTeX, nested boxes, no box, wrong answers), the
format reward, a hanging verifier cut by the timeout, failing reward functions stopping the run with
the sample shown (or scoring 0 and being counted), weighted combination, dynamic-sampling groups."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from jaxgrpo import rewards as R


@pytest.mark.parametrize(
  "text, boxed",
  [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{2}", "2"),  # the last one
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),  # nested braces
    ("\\boxed{\\boxed{7}}", "7"),  # box in a box: unwrapped
    ("\\boxed{a \\boxed{1} b} \\boxed{\\frac{2}{3}}", "\\frac{2}{3}"),  # last outermost
    ("$\\boxed {x^{2}}$", "x^{2}"),
    ("\\boxed 5 done", "5"),
    ("no box here 42", None),
    ("\\boxed{unclosed {", None),
    ("\\fbox{3}", "3"),
  ],
)
def test_extract_boxed(text, boxed):
  assert R.extract_boxed(text) == boxed


# (completion, ground truth, expected reward) — computed by hand
TABLE = [
  ("The answer is \\boxed{42}.", "42", 1.0),
  ("\\boxed{42.0}", "42", 1.0),
  ("\\boxed{1,000}", "1000", 1.0),
  ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
  ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
  ("\\boxed{6/8}", "\\frac34", 1.0),
  ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
  ("\\boxed{2\\frac{1}{2}}", "5/2", 1.0),
  ("\\boxed{\\text{5}}", "5", 1.0),
  ("\\boxed{x = 3}", "3", 1.0),
  ("\\boxed{90^\\circ}", "90", 1.0),
  ("\\boxed{\\left(1, 2\\right)}", "(1,2)", 1.0),
  ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
  ("\\boxed{\\boxed{7}}", "7", 1.0),  # nested boxes
  ("\\boxed{1} ... final \\boxed{2}", "2", 1.0),
  ("\\boxed{2} ... final \\boxed{1}", "2", 0.0),
  ("The answer is 42.", "42", 0.0),  # no box
  ("\\boxed{41}", "42", 0.0),
  ("\\boxed{\\frac{1}{3}}", "0.33", 0.0),
  ("\\boxed{}", "0", 0.0),
  ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", 0.0),
]


def test_reward_table_builtin_in_process():
  acc = R.MathAccuracy(backend="builtin", timeout_s=None)
  comps = [c for c, _, _ in TABLE]
  got = acc(["p"] * len(TABLE), comps, answer=[g for _, g, _ in TABLE])
  assert got == [e for _, _, e in TABLE]
  assert R.format_reward(None, comps) == [0.0 if R.extract_boxed(c) in (None, "") else 1.0 for c in comps]
  assert R.format_reward(None, ["\\boxed{}", "\\boxed{3}", "3"]) == [0.0, 1.0, 0.0]


def test_reward_table_through_the_worker_process():
  acc = R.MathAccuracy(backend="builtin", timeout_s=30.0)
  try:
    got = acc(["p"] * len(TABLE), [c for c, _, _ in TABLE], answer=[g for _, g, _ in TABLE])
  finally:
    acc.close()
  assert got == [e for _, _, e in TABLE]
  assert acc.pop_counters() == {}


def hanging_verifier(pred, gold):  # module level: the worker imports it by name
  if pred == "hang":
    while True:
      pass
  if pred == "boom":
    raise ZeroDivisionError("verifier bug")
  return pred == gold


@pytest.mark.subprocess
def test_hanging_verifier_is_killed_and_counted():
  acc = R.MathAccuracy(backend=hanging_verifier, timeout_s=1.0)
  try:
    acc(["p"], ["\\boxed{1}"], answer=["1"])  # start the worker (not timed)
    t0 = time.perf_counter()
    got = acc(["p"] * 4, ["\\boxed{1}", "\\boxed{hang}", "\\boxed{3}", "\\boxed{boom}"], answer=["1", "1", "3", "3"])
    elapsed = time.perf_counter() - t0
    # the items after the hang are still verified (by a fresh worker)
    assert got == [1.0, 0.0, 1.0, 0.0]
    assert acc.pop_counters() == {"timeouts": 1, "verifier_errors": 1}
    assert elapsed < 60
    assert acc(["p"], ["\\boxed{2}"], answer=["2"]) == [1.0]
  finally:
    acc.close()


def test_timeout_pool_kills_the_process():
  pool = R.TimeoutPool(0.5)
  try:
    out = pool.map(hanging_verifier, [("a", "a"), ("hang", "x")])
    assert out == [("ok", True), ("timeout", None)]
    assert pool._proc is None  # killed, restarted on demand
  finally:
    pool.close()


def test_failing_reward_function_stops_the_run_with_the_sample():
  def picky(prompts, completions, answer, **_):
    return [1.0 / (len(c) - 3) for c in completions]  # ZeroDivisionError on a 3-char completion

  rs = R.RewardSet([picky])
  with pytest.raises(R.RewardError) as e:
    rs(["q0", "q1", "q2"], ["long one", "abc", "xy z1"], {"answer": ["a0", "a1", "a2"]})
  msg = str(e.value)
  assert "'picky'" in msg and "sample 1" in msg and "'q1'" in msg and "'abc'" in msg and "a1" in msg
  assert "ZeroDivisionError" in msg

  zero = R.RewardSet([picky], on_error="zero")
  res = zero(["q0", "q1", "q2"], ["long one", "abc", "xy z1"], {"answer": ["a0", "a1", "a2"]})
  np.testing.assert_allclose(res.per_fn["picky"], [0.2, 0.0, 0.5])
  assert res.counters == {"picky/errors": 1}


def test_non_finite_or_wrong_length_rewards_are_errors():
  nan = R.RewardSet([lambda p, c, **_: [1.0, math.nan]])
  with pytest.raises(R.RewardError, match="sample 1"):
    nan(["a", "b"], ["x", "y"])
  short = R.RewardSet([lambda p, c, **_: [1.0]])
  with pytest.raises(R.RewardError, match="1 values for 2"):
    short(["a", "b"], ["x", "y"])
  with pytest.raises(ValueError, match="on_error"):
    R.RewardSet([R.format_reward], on_error="ignore")


def test_weighted_combination_logs_each_function():
  acc = R.MathAccuracy(backend="builtin", timeout_s=None)
  rs = R.RewardSet({"accuracy": (acc, 1.0), "format": (R.format_reward, 0.5)})
  res = rs(["p"] * 3, ["\\boxed{4}", "\\boxed{5}", "4"], {"answer": ["4", "4", "4"]})
  np.testing.assert_allclose(res.per_fn["accuracy"], [1, 0, 0])
  np.testing.assert_allclose(res.per_fn["format"], [1, 1, 0])
  np.testing.assert_allclose(res.total, [1.5, 0.5, 0.0])
  with pytest.raises(ValueError, match="rows"):
    rs(["p"], ["a", "b"], {"answer": ["4", "4"]})


def test_group_is_informative():
  r = [1, 1, 0, 1, 0.5, 0.5, 2]
  g = [0, 0, 1, 1, 2, 2, 3]
  np.testing.assert_array_equal(R.group_is_informative(r, g, 5), [False, True, False, False, False])
