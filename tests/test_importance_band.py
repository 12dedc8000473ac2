"""IcePop and sequence-level masking (``GRPOConfig.importance_correction`` ``"icepop"`` / ``"seq_mask"``, issue 46):
the weights, the loss, its gradient and the logged metrics against NumPy written from the formulas
(``tests/core_refs.py``'s ``importance`` and ``loss_and_grads``; IcePop: Ring-1T, arXiv:2510.18855), and the
config's refusals. The random compositions with λ weights, KL and entropy: ``test_surrogates.py``'s
``test_everything_composed_equals_the_numpy_formula``."""

from __future__ import annotations

import core_refs as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgrpo as jg
from jaxgrpo.kernels.objective import objective_terms

# three rows; log π_old − log μ per token: row 0 has a token below the band [0.5, 2] (log 0.5 = −0.69), one above
# (log 2 = 0.69) and one inside; row 1's tokens are all inside; row 2 is inside token by token but its geometric
# mean is e^0.6 = 1.82 (inside) — and row 1's e^-0.3; row 3 (two tokens at +1.0) leaves the band as a sequence
DELTA = np.array(
  [[-1.0, 1.0, 0.2, 0.0], [-0.3, -0.3, -0.3, 0.0], [0.6, 0.6, 0.6, 0.6], [1.0, 1.0, 0.0, 0.0]], np.float32
)
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], bool)
OLD = np.full(DELTA.shape, -1.2, np.float32)
BEHAVIOR = OLD - DELTA
ADV = np.array([1.0, -0.5, 0.8, -1.2], np.float32)


def test_icepop_masks_tokens_outside_the_band_on_both_sides():
  imp = jg.importance_weights(OLD, BEHAVIOR, MASK, correction="icepop", cap=2.0, low=0.5)
  r = np.exp(DELTA)
  want = np.where(MASK & (r >= 0.5) & (r <= 2.0), r, 0.0)
  np.testing.assert_allclose(np.asarray(imp.weights), want, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(imp.capped), MASK & ((r < 0.5) | (r > 2.0)))
  assert np.asarray(imp.capped).sum() == 4  # row 0's first two tokens, row 3's two
  # MIS is the one-sided form: the token below the band keeps its weight e^-1
  mis = jg.importance_weights(OLD, BEHAVIOR, MASK, correction="mis", cap=2.0)
  assert float(mis.weights[0, 0]) == pytest.approx(np.exp(-1.0)) and float(imp.weights[0, 0]) == 0.0


def test_sequence_masking_drops_a_row_by_its_geometric_mean():
  imp = jg.importance_weights(OLD, BEHAVIOR, MASK, correction="seq_mask", cap=2.0, low=0.5)
  geo = np.array([np.exp(DELTA[i, MASK[i]].mean()) for i in range(4)])  # e^0.067, e^-0.3, e^0.6, e^1.0
  kept = (geo >= 0.5) & (geo <= 2.0)
  assert kept.tolist() == [True, True, True, False]
  np.testing.assert_allclose(np.asarray(imp.weights), np.where(MASK, kept[:, None] * 1.0, 0.0))
  np.testing.assert_allclose(np.asarray(imp.ratio), np.where(MASK, geo[:, None], 0.0), rtol=1e-6)
  # the product (level="sequence" of IcePop) would drop row 2 as well: e^2.4 > 2 — the geometric mean does not
  prod = jg.importance_weights(OLD, BEHAVIOR, MASK, correction="icepop", level="sequence", cap=2.0, low=0.5)
  assert float(prod.weights[2, 0]) == 0.0 and float(imp.weights[2, 0]) == 1.0


@pytest.mark.parametrize("correction", ["icepop", "seq_mask"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_the_objective_value_gradient_and_metrics_equal_numpy(correction, aggregation):
  """Through ``GRPOConfig`` and the default objective, as the train step calls it: the loss and its gradient
  with respect to ``logp`` (PPO, ε = 0.2, logp ≠ old_logp so the clip is active on some tokens), and the metrics
  that say what was applied: ``is_capped_frac`` the fraction of real tokens masked, ``is_weight_mean`` the mean
  applied weight, ``is_policy_loss`` the weighted policy term."""
  rng = np.random.default_rng(1)
  logp = (OLD + rng.normal(0, 0.3, OLD.shape)).astype(np.float32)
  config = jg.GRPOConfig(
    importance_correction=correction, importance_cap=2.0, importance_low=0.5, aggregation=aggregation
  )

  def loss(lp):
    terms = objective_terms(config, lp, jnp.asarray(OLD), jnp.asarray(ADV), jnp.asarray(MASK),
                            behavior_logp=jnp.asarray(BEHAVIOR))  # fmt: skip
    return jg.finalize_terms(terms)

  (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp))
  w, _, capped, _ = ref.importance(OLD, BEHAVIOR, MASK, correction, "token", 2.0, 0.5)
  want_value, want_grad, _ = ref.loss_and_grads("ppo", logp, OLD, ADV, MASK, aggregation=aggregation, is_weights=w)
  np.testing.assert_allclose(float(value), want_value, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
  assert np.all(np.asarray(grad)[capped] == 0)  # a masked token gets no gradient
  n = MASK.sum()
  assert float(metrics["is_capped_frac"]) == pytest.approx(capped.sum() / n)
  assert float(metrics["is_weight_mean"]) == pytest.approx(w[MASK].mean(), rel=1e-5)
  p, _ = ref.surrogate("ppo", logp, OLD, ADV, MASK, eps_low=0.2, eps_high=0.2)
  assert float(metrics["is_policy_loss"]) == pytest.approx((w * p)[MASK].mean(), rel=1e-5)


def test_the_band_is_checked_in_one_line():
  with pytest.raises(ValueError, match=r"`importance_low`=0.3 is the lower bound of a band, read only with"):
    jg.GRPOConfig(importance_correction="tis", importance_low=0.3)
  with pytest.raises(ValueError, match=r"importance_low < importance_cap; got importance_low=0.5 \(the default\)"):
    jg.GRPOConfig(importance_correction="icepop", importance_cap=0.4)
  with pytest.raises(ValueError, match="'seq_mask' is sequence-level by definition"):
    jg.GRPOConfig(importance_correction="seq_mask", importance_level="sequence")
  with pytest.raises(ValueError, match="must have low < cap; got low=3.0, cap=2.0"):
    jg.importance_weights(OLD, BEHAVIOR, MASK, correction="icepop", cap=2.0, low=3.0)
  with pytest.raises(ValueError, match="read only by correction 'icepop' or 'seq_mask'"):
    jg.importance_weights(OLD, BEHAVIOR, MASK, correction="mis", cap=2.0, low=0.5)
  c = jg.GRPOConfig(importance_correction="icepop", importance_cap=5.0)  # IcePop's [0.5, 5]
  assert (
    c.importance_low is None and jg.importance_weights(OLD, BEHAVIOR, MASK, correction="icepop", cap=5.0).capped[0, 0]
  )


def test_the_trainer_config_takes_the_new_corrections():
  from jaxgrpo.run.specs import load_config

  cfg = load_config(None, {"objective.importance_correction": "icepop", "objective.importance_low": 0.4,
                           "objective.importance_cap": 5.0, "devices.mesh": ""})  # fmt: skip
  assert (cfg.objective.importance_correction, cfg.objective.importance_low) == ("icepop", 0.4)
  with pytest.raises(ValueError, match="importance_low"):
    load_config(None, {"objective.importance_correction": "tis", "objective.importance_low": 0.4})
