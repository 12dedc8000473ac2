"""jaxgrpo.run.evaluation: pass@k against hand-computed values and the combinatorial formula."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

from jaxgrpo.run.evaluation import mean_at_k, pass_at_k, summarize_eval


@pytest.mark.parametrize(
  "n, c, k, expected",
  [
    (4, 1, 1, 0.25),  # pass@1 = c/n
    (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
    (5, 0, 3, 0.0),
    (5, 3, 3, 1.0),  # n - c < k: every draw of 3 contains a correct one
    (10, 1, 5, 0.5),  # 1 - C(9,5)/C(10,5) = 1 - 126/252
    (6, 2, 3, 0.8),  # 1 - C(4,3)/C(6,3) = 1 - 4/20
  ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
  assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_binomial_formula_vectorised():
  rng = np.random.default_rng(0)
  n = rng.integers(1, 40, size=50)
  c = rng.integers(0, n + 1)
  for k in (1, 2, 5):
    ok = n >= k
    got = pass_at_k(n[ok], c[ok], k)
    ref = [1 - comb(int(a) - int(b), k) / comb(int(a), k) for a, b in zip(n[ok], c[ok])]
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(pass_at_k(n, c, 1), c / n)


def test_mean_at_k_and_summary():
  correct = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], bool)
  s = summarize_eval(correct, ks=(1, 2, 4, 8))
  assert s["eval_accuracy"] == pytest.approx((0.25 + 0.5 + 0) / 3)
  assert s["eval_pass@1"] == pytest.approx(s["eval_accuracy"])
  assert s["eval_pass@2"] == pytest.approx((0.5 + 5 / 6 + 0) / 3)
  assert s["eval_pass@4"] == pytest.approx(2 / 3)
  assert "eval_pass@8" not in s
  np.testing.assert_allclose(mean_at_k(4, [0, 2, 4]), [0, 0.5, 1])


def test_bad_inputs_name_the_argument():
  with pytest.raises(ValueError, match="num_correct"):
    pass_at_k(3, 4, 1)
  with pytest.raises(ValueError, match="`k`"):
    pass_at_k(3, 1, 4)
  with pytest.raises(ValueError, match="`k`"):
    pass_at_k(3, 1, 0)
  with pytest.raises(ValueError, match="correct"):
    summarize_eval(np.zeros(3, bool))
