"""GSPO, GSPO-token, CISPO, SAPO, GMPO (and PPO's clip) under the one aggregating loss, TIS/MIS weights
and the entropy bonus: value and gradient against NumPy references written from the papers' formulas
(``core_refs``: per-row loops, hand-derived gradients), under hypothesis cases with ragged masks, empty
rows and extreme ratios; micro-batch invariance; hand-computed single tokens; the compositions the
config allows and those it refuses."""

from __future__ import annotations

import chex
import core_refs as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_example
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxgrpo as jg
from jaxgrpo.kernels.surrogates import SEQUENCE_SURROGATES, SURROGATES

SETTINGS = settings(max_examples=25, deadline=None)
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
B, T = 6, 7
HYPER = {  # per surrogate: (ε_low, ε_high) wide enough that both clipped and unclipped tokens occur
  "ppo": (0.2, 0.28),
  "gspo": (0.1, 0.15),
  "gspo_token": (0.1, 0.15),
  "cispo": (0.3, 0.2),
  "sapo": (0.2, 0.2),
  "gmpo": (0.3, 0.3),
}


@st.composite
def batches(draw, per_token_adv=True):
  """A fixed-shape batch: ragged right-padded masks (empty rows included), log-ratios mostly within ±1
  with a few extreme ones (±8, ±25: beyond the ±20 clamp), advantages of both signs and zeros."""
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, T + 1, B)
  lengths[rng.integers(0, B)] = 0  # at least one empty row
  lengths[rng.integers(0, B)] = T
  mask = np.arange(T)[None] < lengths[:, None]
  old = -np.abs(rng.normal(1.5, 1.0, (B, T)))
  scale = draw(st.sampled_from([0.05, 0.3, 1.0]))
  logp = old + rng.normal(0, scale, (B, T))
  if draw(st.booleans()):  # extreme ratios on a few tokens
    idx = rng.integers(0, B * T, 3)
    logp.flat[idx] = old.flat[idx] + rng.choice([-25.0, -8.0, 8.0, 25.0], 3)
  adv = rng.normal(0, 1, (B, T) if per_token_adv and draw(st.booleans()) else B)
  adv.flat[rng.integers(0, adv.size)] = 0.0
  # garbage on padding: must change nothing
  logp = np.where(mask, logp, np.nan)
  old = np.where(mask, old, np.inf)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return f32(logp), f32(old), f32(adv), jnp.asarray(mask)


def _jax_loss_and_grads(loss, logp, old, adv, mask, entropy=None, **kw):
  hyper = jg.GRPOHyper(loss=loss, **kw)
  h = jnp.zeros_like(logp) if entropy is None else entropy
  value, (g, gh) = _value_and_grads(jnp.where(mask, logp, 0.0), h, old, adv, mask, hyper)
  return float(value), np.asarray(g), np.asarray(gh)


@jax.jit
def _value_and_grads(lp, h, old, adv, mask, hyper):
  """Value and gradients (wrt the log-probs and the entropy) of policy_loss, one compiled program per
  surrogate, aggregation and advantage shape (eager, the library's jitted loss is differentiated in parts)."""
  f = lambda lp, h: jg.policy_loss(lp, old, adv, mask, hyper, entropy=h)[0]
  return jax.value_and_grad(f, argnums=(0, 1))(lp, h)


def _clean(x, mask):
  return np.where(np.asarray(mask), np.asarray(x, np.float64), 0.0)


def _assert_close(got, want, what):
  scale = max(1.0, float(np.max(np.abs(want))) if np.size(want) else 1.0)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6 * scale, err_msg=what)


@SETTINGS
@given(batches(), st.sampled_from(SURROGATES), st.sampled_from(AGGS))
def test_value_and_gradient_equal_the_numpy_formula(batch, loss, aggregation):
  logp, old, adv, mask = batch
  if loss in SEQUENCE_SURROGATES and adv.ndim == 2:
    adv = adv[:, 0]
  lo, hi = HYPER[loss]
  got = _jax_loss_and_grads(loss, logp, old, adv, mask, clip_eps_low=lo, clip_eps_high=hi, aggregation=aggregation)
  want = ref.loss_and_grads(
    loss, _clean(logp, mask), _clean(old, mask), adv, mask, aggregation=aggregation, eps_low=lo, eps_high=hi
  )
  assert np.isfinite(got[0]) and np.all(np.isfinite(got[1]))
  _assert_close(got[0], want[0], f"{loss} {aggregation} value")
  _assert_close(got[1], want[1], f"{loss} {aggregation} gradient")


@SETTINGS
@given(batches(), st.sampled_from(["ppo", "gspo_token", "cispo", "sapo"]), st.sampled_from(AGGS), st.data())
def test_everything_composed_equals_the_numpy_formula(batch, loss, aggregation, data):
  """Token losses with λ-style token weights, per-token advantages, a k3 KL term, TIS/MIS/IcePop weights at
  either level or sequence masking, and an entropy bonus: l = w·(v·p + β·D − c·H)."""
  logp, old, adv, mask = batch
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
  correction = data.draw(st.sampled_from(["tis", "mis", "icepop", "seq_mask"]))
  level = "token" if correction == "seq_mask" else data.draw(st.sampled_from(["token", "sequence"]))
  cap = data.draw(st.sampled_from([0.5, 1.2, 2.0]))
  low = data.draw(st.sampled_from([0.3, 0.9])) * min(cap, 1.0) if correction in ("icepop", "seq_mask") else None
  behavior = jnp.where(mask, old + rng.normal(0, 0.3, old.shape).astype(np.float32), -jnp.inf)
  refl = jnp.where(mask, old + rng.normal(0, 0.3, old.shape).astype(np.float32), jnp.nan)
  w = jnp.asarray(rng.uniform(0.1, 1.0, old.shape).astype(np.float32))
  h = jnp.asarray(rng.uniform(0.0, 3.0, old.shape).astype(np.float32))
  lo, hi = HYPER[loss]
  imp = jg.importance_weights(old, behavior, mask, correction=correction, level=level, cap=cap, low=low)
  want_imp = ref.importance(_clean(old, mask), _clean(behavior, mask), mask, correction, level, cap, low)
  for got_x, want_x, name in zip(imp, want_imp, ("weights", "ratio", "capped", "mismatch_kl")):
    _assert_close(np.asarray(got_x, np.float64), want_x.astype(np.float64), name)

  hyper = jg.GRPOHyper(
    loss=loss, clip_eps_low=lo, clip_eps_high=hi, aggregation=aggregation, max_tokens=9, beta=0.04, entropy_coef=0.01
  )

  @jax.jit  # one program per case (eager, the library's jitted loss is differentiated in parts)
  def value_and_grads(lp, hh, old, adv, mask, refl, w, imp):
    def f(lp, hh):
      k = jg.kl_penalty(lp, refl, "k3", mask=mask)
      return jg.policy_loss(lp, old, adv, mask, hyper, token_weights=w, importance=imp, kl=k, entropy=hh)[0]

    return jax.value_and_grad(f, argnums=(0, 1))(lp, hh)

  value, (g, gh) = value_and_grads(jnp.where(mask, logp, 0.0), h, old, adv, mask, refl, w, imp)
  want = ref.loss_and_grads(
    loss,
    _clean(logp, mask),
    _clean(old, mask),
    adv,
    mask,
    aggregation=aggregation,
    eps_low=lo,
    eps_high=hi,
    token_weights=w,
    is_weights=want_imp[0],
    ref=_clean(refl, mask),
    beta=0.04,
    entropy=h,
    entropy_coef=0.01,
    max_tokens=9,
  )
  _assert_close(float(value), want[0], "value")
  _assert_close(np.asarray(g), want[1], "gradient wrt logp")
  _assert_close(np.asarray(gh), want[2], "gradient wrt entropy")


@SETTINGS
@given(batches(per_token_adv=False), st.sampled_from(SURROGATES), st.sampled_from(AGGS), st.integers(1, B - 1))
def test_micro_batches_change_nothing(batch, loss, aggregation, split):
  logp, old, adv, mask = batch
  logp = jnp.where(mask, logp, 0.0)
  behavior = old - 0.2
  lo, hi = HYPER[loss]
  hyper = jg.GRPOHyper(loss=loss, clip_eps_low=lo, clip_eps_high=hi, aggregation=aggregation, max_tokens=T)

  def terms(sl):
    imp = jg.importance_weights(old[sl], behavior[sl], mask[sl], correction="mis", level="sequence", cap=1.5)
    return jg.policy_loss_terms(logp[sl], old[sl], adv[sl], mask[sl], hyper, importance=imp)

  full, fm = jg.finalize_terms(terms(slice(None)))
  parts, pm = jg.finalize_terms(jg.combine_terms(terms(slice(0, split)), terms(slice(split, None))))
  np.testing.assert_allclose(parts, full, rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(pm, fm, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- hand-computed cases


def _one_row(loss, log_ratios, adv, **kw):
  lr = jnp.asarray([log_ratios], jnp.float32)
  old = jnp.full_like(lr, -1.0)
  mask = jnp.ones(lr.shape, bool)
  f = lambda lp: jg.policy_loss(lp, old, jnp.asarray([adv], jnp.float32), mask, jg.GRPOHyper(loss=loss, **kw))
  (value, metrics), g = jax.value_and_grad(f, has_aux=True)(old + lr)
  return float(value), np.asarray(g[0]), metrics


def test_gspo_clips_the_sequence_not_the_tokens():
  # tokens at ratios e^0.3 and e^-0.3: each outside a 0.1 clip, their geometric mean is 1 (inside)
  value, g, m = _one_row("gspo", [0.3, -0.3], 1.0, clip_eps_low=0.1, clip_eps_high=0.1)
  assert value == pytest.approx(-1.0) and np.allclose(g, -0.5)  # −A·s·(1/n) on each token
  assert float(m["clip_frac_high"]) == 0.0
  value, g, m = _one_row("ppo", [0.3, -0.3], 1.0, clip_eps_low=0.1, clip_eps_high=0.1)
  assert g[0] == 0.0 and float(m["clip_frac_high"]) == 0.5  # PPO clips the first token
  # the whole sequence above 1+ε with A > 0: no gradient anywhere
  value, g, m = _one_row("gspo", [0.3, 0.2], 1.0, clip_eps_low=0.1, clip_eps_high=0.1)
  assert value == pytest.approx(-1.1) and np.all(g == 0) and float(m["clip_frac_high"]) == 1.0


def test_gspo_token_equals_gspo_with_sequence_advantages():
  rng = np.random.default_rng(0)
  old = jnp.asarray(-np.abs(rng.normal(1, 1, (5, 6))), jnp.float32)
  lp = old + jnp.asarray(rng.normal(0, 0.1, (5, 6)), jnp.float32)
  mask = jnp.asarray(np.arange(6)[None] < np.array([6, 3, 0, 1, 5])[:, None])
  adv = jnp.asarray(rng.normal(size=5), jnp.float32)
  kw = dict(clip_eps_low=0.05, clip_eps_high=0.06, aggregation="seq-mean-token-mean")
  f = lambda loss: jax.value_and_grad(lambda x: jg.policy_loss(x, old, adv, mask, jg.GRPOHyper(loss=loss, **kw))[0])(lp)
  (v1, g1), (v2, g2) = f("gspo"), f("gspo_token")
  assert float(v1) == pytest.approx(float(v2), rel=1e-6)
  np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-8)
  assert np.abs(np.asarray(g1)).max() > 0


def test_cispo_keeps_the_gradient_of_clipped_tokens():
  value, g, m = _one_row("cispo", [1.0], 1.0, clip_eps_low=0.2, clip_eps_high=0.28)
  assert g[0] == pytest.approx(-1.28, rel=1e-6)  # −sg(clip(ρ))·A: PPO would give 0 here
  assert value == pytest.approx(0.0, abs=1e-6)  # −sg(clip(ρ))·A·logp with logp = −1 + 1 = 0
  assert float(m["clip_frac_high"]) == 1.0
  _, g_ppo, _ = _one_row("ppo", [1.0], 1.0, clip_eps_low=0.2, clip_eps_high=0.28)
  assert g_ppo[0] == 0.0


def test_sapo_gate_matches_ppo_on_policy_and_decays_smoothly():
  for adv in (1.0, -1.0):
    value, g, _ = _one_row("sapo", [0.0], adv)
    tau = 1.0 if adv > 0 else 1.05
    assert value == pytest.approx(-adv * 2.0 / tau, rel=1e-6)  # σ(0)·4/τ = 2/τ
    assert g[0] == pytest.approx(-adv, rel=1e-6)  # 4σ(1−σ)ρ = 1 at ρ = 1: the policy gradient
  _, g_far, _ = _one_row("sapo", [2.0], 1.0)
  assert 0 < -g_far[0] < 0.5  # far off-policy: damped, not cut


def test_gmpo_clips_in_log_space_on_the_harmful_side_only():
  # A > 0: the token at +0.6 is clipped to 0.4 (no gradient), the one at −0.6 is not
  value, g, m = _one_row("gmpo", [0.6, -0.6], 1.0, clip_eps_low=0.4, clip_eps_high=0.4)
  s = np.exp((0.4 - 0.6) / 2)
  assert value == pytest.approx(-s, rel=1e-6)
  assert g[0] == 0.0 and g[1] == pytest.approx(-s / 2, rel=1e-6)
  assert float(m["clip_frac_high"]) == 0.5
  value, g, m = _one_row("gmpo", [0.6, -0.6], -1.0, clip_eps_low=0.4, clip_eps_high=0.4)
  assert value == pytest.approx(np.exp((0.6 - 0.4) / 2), rel=1e-6) and g[1] == 0.0
  assert float(m["clip_frac_low"]) == 0.5


class HandComputed(chex.TestCase):
  """Hand-computed values, called directly and inside an outer ``jax.jit`` (chex variants: the cap and
  the clip range then traced)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_importance_weights_hand_computed(self):
    old = jnp.log(jnp.asarray([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]], jnp.float32))
    behavior = jnp.log(jnp.asarray([[0.1, 0.5, 0.25], [0.5, 0.25, 0.25]], jnp.float32))  # ratios 5, 1, 2 / 1, 2, 2
    mask = jnp.asarray([[True, True, True], [True, True, False]])
    iw = self.variant(
      lambda cap, correction, level: jg.importance_weights(
        old, behavior, mask, correction=correction, level=level, cap=cap
      ),
      static_argnums=(1, 2),
    )
    w = iw(2.0, "tis", "token")
    np.testing.assert_allclose(w.weights, [[2, 1, 2], [1, 2, 0]], rtol=1e-6)
    np.testing.assert_array_equal(w.capped, [[True, False, False], [False, False, False]])
    w = iw(2.0, "mis", "token")
    np.testing.assert_allclose(w.weights, [[0, 1, 2], [1, 2, 0]], rtol=1e-6)
    w = iw(3.0, "tis", "sequence")
    np.testing.assert_allclose(w.ratio, [[10, 10, 10], [2, 2, 0]], rtol=1e-5)  # products 5·1·2, 1·2
    np.testing.assert_allclose(w.weights, [[3, 3, 3], [2, 2, 0]], rtol=1e-6)
    w = iw(3.0, "mis", "sequence")
    np.testing.assert_allclose(w.weights, [[0, 0, 0], [2, 2, 0]], rtol=1e-6)
    k3 = lambda r: r - np.log(r) - 1
    np.testing.assert_allclose(w.mismatch_kl, [[k3(5), 0, k3(2)], [0, k3(2), 0]], rtol=1e-5, atol=1e-7)

  @chex.variants(with_jit=True, without_jit=True)
  def test_gspo_clips_the_sequence_with_a_traced_range(self):
    # token ratios e^0.3 and e^-0.3: the sequence ratio is 1, inside any range; PPO clips the first token
    lr = jnp.asarray([[0.3, -0.3]], jnp.float32)
    old, mask = jnp.full_like(lr, -1.0), jnp.ones(lr.shape, bool)
    sur = self.variant(
      lambda eps, loss: jg.policy_surrogate(
        old + lr, old, jnp.ones(1), mask, loss=loss, clip_eps_low=eps, clip_eps_high=eps
      ),
      static_argnums=1,
    )
    chex.assert_trees_all_close(sur(jnp.float32(0.1), "gspo").loss, jnp.full((1, 2), -1.0))
    ppo = sur(jnp.float32(0.1), "ppo")
    np.testing.assert_allclose(ppo.loss, [[-1.1, -np.exp(-0.3)]], rtol=1e-6)
    np.testing.assert_array_equal(ppo.clip_high, [[True, False]])
    np.testing.assert_array_equal(sur(jnp.float32(0.5), "ppo").clip_high, [[False, False]])


def test_masked_tokens_stay_in_the_denominator_and_metrics_report_the_mismatch():
  old = jnp.zeros((1, 2))
  behavior = jnp.asarray([[-3.0, 0.0]])  # ratio e^3 on the first token: masked at cap 2
  mask = jnp.ones((1, 2), bool)
  imp = jg.importance_weights(old, behavior, mask, correction="mis", cap=2.0)
  loss, m = jg.policy_loss(old, old, jnp.asarray([1.0]), mask, importance=imp)
  assert float(loss) == pytest.approx(-0.5)  # (0 + (−1)) / 2 tokens
  assert float(m["is_capped_frac"]) == 0.5 and float(m["is_ratio_max"]) == pytest.approx(np.exp(3.0), rel=1e-5)
  assert float(m["mismatch_kl"]) == pytest.approx((np.exp(3) - 3 - 1) / 2, rel=1e-5)
  assert float(m["is_weight_mean"]) == pytest.approx(0.5)


def test_with_tis_policy_loss_is_the_unweighted_surrogate_and_is_policy_loss_the_weighted_one():
  """issue 47: with TIS ``loss`` is weighted by v = min(π_old/μ, C) while ``policy_loss`` is the surrogate alone;
  both are logged, the weighted one as ``is_policy_loss`` (before, only the unweighted one, named as if it were
  the loss's policy part). NumPy from the formula: at ρ = 1 the PPO term is p = −A."""
  rng = np.random.default_rng(0)
  old = rng.normal(-1.0, 0.3, (3, 5)).astype(np.float32)
  behavior = (old + rng.normal(0.0, 0.8, old.shape)).astype(np.float32)
  adv = rng.normal(size=3).astype(np.float32)
  mask = np.arange(5)[None, :] < np.array([[5], [3], [1]])
  v = np.minimum(np.exp(old - behavior), 2.0)
  p = -np.broadcast_to(adv[:, None], old.shape)
  imp = jg.importance_weights(old, behavior, mask, correction="tis", cap=2.0)
  loss, m = jg.policy_loss(old, old, adv, mask, importance=imp)
  assert float(m["policy_loss"]) == pytest.approx(p[mask].mean(), rel=1e-5)
  assert float(m["is_policy_loss"]) == pytest.approx((v * p)[mask].mean(), rel=1e-5)
  assert float(loss) == pytest.approx((v * p)[mask].mean(), rel=1e-5)
  assert abs(float(m["is_policy_loss"]) - float(m["policy_loss"])) > 0.05  # the two differ here
  assert "is_policy_loss" not in jg.policy_loss(old, old, adv, mask)[1]  # only with a correction


# ----------------------------------------------------------------------------- config: presets and compositions


def test_presets_follow_the_papers():
  g = jg.preset("gspo")
  assert (g.loss, g.clip_eps_low, g.clip_eps_high, g.aggregation) == ("gspo", 3e-4, 4e-4, "seq-mean-token-mean")
  assert jg.preset("gspo_token").loss == "gspo_token"
  c = jg.preset("cispo")
  assert (c.loss, 1 - c.clip_eps_low, 1 + c.clip_eps_high, c.aggregation) == ("cispo", 0.0, 5.0, "token-mean")
  s = jg.preset("sapo")
  assert (s.tau_pos, s.tau_neg, s.aggregation) == (1.0, 1.05, "seq-mean-token-mean")
  gm = jg.preset("gmpo")
  assert (gm.clip_eps_low, gm.clip_eps_high, gm.aggregation) == (0.4, 0.4, "seq-mean-token-mean")
  base = jg.preset("grpo")
  assert (base.loss, base.importance_correction, base.entropy_coef) == ("ppo", None, 0.0)


@pytest.mark.parametrize("loss", ["gspo", "gmpo"])
def test_sequence_losses_refuse_lambda_weights_and_future_kl(loss):
  with pytest.raises(ValueError, match="process_weights"):
    jg.preset(loss, process_weights=True)
  with pytest.raises(ValueError, match="per-token"):
    jg.preset(loss, beta=0.01, kl_placement="future", kl_estimator="k1")
  # the kernel refuses them too
  z = jnp.zeros((2, 3))
  mask = jnp.ones((2, 3), bool)
  with pytest.raises(ValueError, match="one advantage per sequence"):
    jg.policy_loss(z, z, z, mask, jg.GRPOHyper(loss=loss))
  with pytest.raises(ValueError, match="token_weights"):
    jg.policy_loss(z, z, jnp.zeros(2), mask, jg.GRPOHyper(loss=loss), token_weights=z)


@pytest.mark.parametrize("loss", ["gspo_token", "cispo", "sapo"])
def test_token_losses_compose_with_lambda_and_frpo(loss):
  cfg = jg.preset(loss, process_weights=True, beta=0.01, kl_placement="future", kl_estimator="k1")
  tokens = jnp.asarray([[1, 2, 3], [1, 2, 4], [5, 6, 0]], jnp.int32)
  mask = tokens > 0
  rng = np.random.default_rng(1)
  old = jnp.asarray(-np.abs(rng.normal(1, 0.5, (3, 3))), jnp.float32)
  refl, lp = old + 0.1, old + jnp.asarray(rng.normal(0, 0.05, (3, 3)), jnp.float32)
  rewards = jnp.asarray([1.0, 0.0, 0.5])
  adv, w = jg.rollout_advantages(cfg, rewards, tokens, mask, jnp.zeros(3, jnp.int32), 1, old_logp=old, ref_logp=refl)
  assert adv.shape == (3, 3) and float(w[0, 0]) == 0.5  # |λ| = 2 on the shared prefix
  got = jg.finalize_terms(jg.objective_terms(cfg, lp, old, adv, mask, token_weights=w))[0]
  lo, hi = cfg.clip_eps_low, cfg.clip_eps_high
  want = ref.loss_and_grads(
    loss, lp, old, np.asarray(adv), mask, aggregation=cfg.aggregation, eps_low=lo, eps_high=hi, token_weights=w
  )[0]
  assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-7)  # float32 sum of terms of either sign


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(loss="trpo"), "loss"),
    (dict(loss="cispo", dual_clip=3.0), "dual_clip"),
    (dict(tau_pos=0.0), "tau_pos"),
    (dict(importance_correction="is"), "importance_correction"),
    (dict(importance_level="row"), "importance_level"),
    (dict(importance_cap=0.0), "importance_cap"),
    (dict(entropy_coef=float("nan")), "entropy_coef"),
  ],
)
def test_new_fields_are_validated(kw, match):
  with pytest.raises(ValueError, match=match):
    jg.GRPOConfig(**kw)


def test_objective_needs_entropy_when_the_bonus_is_on():
  cfg = jg.preset("cispo", entropy_coef=0.01)
  z = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match="entropy"):
    jg.objective_terms(cfg, z, z, jnp.zeros(2), jnp.ones((2, 3), bool))
  with pytest.raises(TypeError, match="importance"):
    jg.policy_loss(z, z, jnp.zeros(2), jnp.ones((2, 3), bool), importance=(z, z, z, z))


def test_the_hook_example_equals_the_gspo_preset():
  """examples/gspo.py (GSPO through objective_fn) and preset("gspo"): same value and gradient."""
  gspo = load_example("gspo").gspo_objective
  rng = np.random.default_rng(5)
  old = jnp.asarray(-np.abs(rng.normal(1, 1, (6, 5))), jnp.float32)
  lp = old + jnp.asarray(rng.normal(0, 0.1, (6, 5)), jnp.float32)
  mask = jnp.asarray(np.arange(5)[None] < np.array([5, 2, 0, 4, 1, 3])[:, None])
  adv = jnp.asarray(rng.normal(size=6), jnp.float32)
  cfg = jg.preset("gspo", clip_eps_low=0.03, clip_eps_high=0.04)
  f = lambda obj: jax.value_and_grad(lambda x: jg.finalize_terms(obj(cfg, x, old, adv, mask))[0])(lp)
  # one program for both (the example's objective is plain jnp: eager, each of its ops compiles on first use)
  (v1, g1), (v2, g2) = jax.jit(lambda: (f(gspo), f(jg.objective_terms)))()
  assert float(v1) == pytest.approx(float(v2), rel=1e-6)
  np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-8)


def test_mismatch_k3_is_the_mean_k3_and_max_gap_over_sampled_tokens():
  """``importance.mismatch_k3`` (the engine path's and async's one mismatch metric) against NumPy written from
  its definition: mean over masked tokens of r − log r − 1, r = exp(log π_old − log μ), and max |Δ|; masked-out
  tokens (huge gaps there) change neither; no masked token (or B = 0, T = 0) gives 0, 0; a gap past 20 follows
  the linear continuation of kl's exponential; a wrong shape or mask dtype is refused naming the argument."""
  from jaxgrpo.kernels.importance import mismatch_k3

  rng = np.random.default_rng(3)
  old = rng.normal(-2.0, 1.0, (3, 7)).astype(np.float32)
  beh = (old + rng.normal(0.0, 0.7, (3, 7))).astype(np.float32)
  mask = rng.random((3, 7)) < 0.6
  beh_out = np.where(mask, beh, old - 50.0).astype(np.float32)  # outside the mask: a gap that would dominate
  d = (old - beh).astype(np.float64)[mask]
  want_k3, want_max = np.mean(np.exp(d) - d - 1.0), np.max(np.abs(d))
  k3, gap = jax.jit(mismatch_k3)(jnp.asarray(old), jnp.asarray(beh_out), jnp.asarray(mask))
  np.testing.assert_allclose([float(k3), float(gap)], [want_k3, want_max], rtol=1e-5)
  zero = mismatch_k3(jnp.asarray(old), jnp.asarray(beh), jnp.zeros((3, 7), bool))
  assert [float(z) for z in zero] == [0.0, 0.0]
  empty = mismatch_k3(jnp.zeros((2, 0)), jnp.zeros((2, 0)), jnp.zeros((2, 0), bool))
  assert [float(z) for z in empty] == [0.0, 0.0]
  # past |Δ| = 20 the exponential continues linearly (kl.MAX_DELTA): e^20·(1 + Δ − 20) − Δ − 1, finite
  far, gap = mismatch_k3(jnp.full((1, 1), 25.0), jnp.zeros((1, 1)), jnp.ones((1, 1), bool))
  np.testing.assert_allclose([float(far), float(gap)], [np.exp(20.0) * 6.0 - 26.0, 25.0], rtol=1e-6)
  with pytest.raises(ValueError, match="`behavior_logp` must have shape"):
    mismatch_k3(jnp.asarray(old), jnp.asarray(beh[:, :5]), jnp.asarray(mask))
  with pytest.raises(TypeError, match="`mask` must be a boolean"):
    mismatch_k3(jnp.asarray(old), jnp.asarray(beh), jnp.asarray(mask, jnp.int32))
