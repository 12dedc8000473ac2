"""Silent or unhelpful paths of the research API (issue 33, items 6, 8, 10), each against NumPy:

- a β / entropy schedule from 0 builds its term (and the reference pass): the loss at step 1 is the
  KL- and entropy-regularised loss; a traced β / entropy coefficient of ``objective_terms`` likewise;
  a scheduled or passed number the config never reads is refused, never logged as applied;
- a custom objective asks for the entropy (``objective.uses_entropy``) with any ``entropy_coef``;
- a hook missing a keyword the step passes is refused when the step is built, naming the keywords;
  ``jax.jvp`` through the default log-probs names ``forward_mode=True``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import make_batch, numpy_group_advantages, sgd_state, sgd_step, tiny_model

import jaxgrpo as jg
from jaxgrpo.kernels.losses import LossTerms
from jaxgrpo.kernels.objective import objective_terms, uses_entropy


def _step(config, **kw):
  step, opt = sgd_step(config, **kw)
  return step, step.graphdef, sgd_state(opt)


def _numpy_logp_entropy(model, batch):
  """``(logp, entropy)`` f64[B, T] of the completions from the model's full logits (log-softmax in NumPy)."""
  tokens = jnp.concatenate([batch.prompt_tokens, batch.completions], axis=1)
  attn = jnp.concatenate([batch.prompt_mask, batch.mask], axis=1)
  p = batch.prompt_tokens.shape[1]
  graphdef, state = nnx.split(model)

  def forward(state, tokens, attn):
    m = nnx.merge(graphdef, state)
    hidden, _ = m(tokens, jnp.maximum(jnp.cumsum(attn, axis=1) - 1, 0), attention_mask=attn)
    return m.logits(hidden[:, p - 1 : -1], out_dtype=jnp.float32)

  logits = np.asarray(jax.jit(forward)(state, tokens, attn), np.float64)
  logq = logits - logits.max(-1, keepdims=True)
  logq = logq - np.log(np.exp(logq).sum(-1, keepdims=True))
  picked = np.take_along_axis(logq, np.asarray(batch.completions)[..., None], -1)[..., 0]
  ent = -(np.exp(logq) * logq).sum(-1)
  return picked, ent


def _numpy_grpo_loss(lp, ent, batch, beta, coef, eps=0.2):
  """GRPO's token-mean loss with the k3 KL term and the entropy bonus, written from the formula:
  ``Σ m·(−min(r·A, clip(r, 1±ε)·A) + β·(e^{−d} + d − 1) − c·H) / Σ m`` with ``d = logp − ref_logp``."""
  m = np.asarray(batch.mask, np.float64)
  adv = numpy_group_advantages(np.asarray(batch.rewards), np.asarray(batch.group_ids)).astype(np.float64)[:, None]
  ratio = np.exp(lp - np.asarray(batch.old_logp, np.float64))
  surrogate = np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv)
  d = lp - np.asarray(batch.ref_logp, np.float64)
  per = -surrogate + beta * (np.exp(-d) + d - 1) - coef * ent
  return float((per * m).sum() / m.sum())


def test_a_beta_and_entropy_schedule_from_zero_builds_both_terms():
  """``preset("grpo")`` (β = 0, c = 0) with ``β = 0.5·s``, ``c = 0.1·s``: step 1 applies β = 0.5 and
  c = 0.1 (KL > 0, the loss of NumPy's KL- and entropy-regularised objective), and the step reads
  ``ref_logp`` (the reference pass runs). Before the fix the program had neither term."""
  config = jg.preset("grpo")
  schedule = lambda s: config.hyper(beta=0.5 * s.astype(jnp.float32), entropy_coef=0.1 * s.astype(jnp.float32))
  step, graphdef, state = _step(config, hyper_schedule=schedule)
  assert step.reads_ref_logp and step.requires_ref_logp()
  batch = make_batch()
  with pytest.raises(ValueError, match="β from hyper_schedule.*needs batch.ref_logp"):
    step.check_batch(batch._replace(ref_logp=None))
  state, m0 = step(state, batch)
  assert float(m0["hyper/beta"]) == 0.0 and float(m0["kl"]) > 0  # β = 0 at step 0: the KL is measured, not applied
  lp, ent = _numpy_logp_entropy(nnx.merge(graphdef, state.params), batch)  # the parameters step 1 starts from
  want = _numpy_grpo_loss(lp, ent, batch, beta=0.5, coef=0.1)
  state, m1 = step(state, batch)
  assert float(m1["hyper/beta"]) == pytest.approx(0.5) and float(m1["hyper/entropy_coef"]) == pytest.approx(0.1)
  assert float(m1["kl"]) > 1e-3
  np.testing.assert_allclose(float(m1["loss"]), want, rtol=2e-5, atol=1e-6)
  assert step.traces == 1


def test_a_traced_beta_and_entropy_coefficient_build_their_terms():
  """``jax.jit`` over the hyper pytree of ``objective_terms`` with a β = 0 config: the traced β and c
  are applied (NumPy's loss); without ``ref_logp`` (or ``entropy``) it refuses, naming it."""
  rng = np.random.default_rng(0)
  batch = make_batch()
  b, t = batch.mask.shape
  lp = np.where(batch.mask, batch.old_logp + 0.1 * rng.standard_normal((b, t)), 0).astype(np.float32)
  ent = np.where(batch.mask, rng.uniform(0.5, 3.0, (b, t)), 0).astype(np.float32)
  adv = numpy_group_advantages(batch.rewards, batch.group_ids)
  config = jg.preset("grpo")
  hyper = config.hyper()._replace(beta=jnp.float32(0.5), entropy_coef=jnp.float32(0.1))  # unchecked: traced below

  @jax.jit
  def loss(h, ref):
    terms = objective_terms(config, lp, batch.old_logp, adv, batch.mask, ref_logp=ref, entropy=ent, hyper=h)
    return terms.numerator / terms.denominator

  want = _numpy_grpo_loss(lp.astype(np.float64), ent.astype(np.float64), batch, beta=0.5, coef=0.1)
  np.testing.assert_allclose(float(loss(hyper, batch.ref_logp)), want, rtol=2e-5, atol=1e-6)
  zero = hyper._replace(beta=jnp.float32(0.0), entropy_coef=jnp.float32(0.0))
  np.testing.assert_allclose(float(loss(zero, batch.ref_logp)), _numpy_grpo_loss(lp, ent, batch, 0.0, 0.0), rtol=2e-5)
  # an ε sweep that builds its hyper inside jit: the config's β = 0 stays a concrete 0, no ref_logp needed
  sweep = lambda e: objective_terms(config, lp, batch.old_logp, adv, batch.mask, hyper=config.hyper(clip_eps_low=e))
  assert np.isfinite(float(jax.jit(lambda e: sweep(e).numerator)(jnp.float32(0.1))))
  with pytest.raises(ValueError, match="hyper.beta is traced.*ref_logp"):
    jax.jit(lambda h: objective_terms(config, lp, batch.old_logp, adv, batch.mask, entropy=ent, hyper=h).numerator)(
      hyper
    )


def test_a_number_the_config_never_reads_is_refused_not_logged():
  """τ± of a PPO config, the IS cap without a correction: a schedule or a call's hyper that sets them is
  refused (one line naming them); a schedule that only varies applied numbers is accepted."""
  config = jg.preset("grpo", beta=0.04)
  with pytest.raises(ValueError, match=r"sets \['tau_pos'\].*never reads"):
    _step(config, hyper_schedule=lambda s: config.hyper(tau_pos=1.0 + s.astype(jnp.float32)))
  with pytest.raises(ValueError, match=r"sets \['importance_cap'\]"):
    _step(config, hyper_schedule=lambda s: config.hyper(importance_cap=3.0))
  step, _, _ = _step(config)
  with pytest.raises(ValueError, match="hyper.importance_cap.*never reads"):
    step.check_hyper(config.hyper(importance_cap=3.0))
  assert step.check_hyper(config.hyper(beta=0.1, clip_eps_high=0.28)) is not None
  assert jg.preset("sapo").applied_hyper == ("tau_pos", "tau_neg")


def test_a_custom_objective_asks_for_the_entropy():
  """An entropy-weighted surrogate ``−Σ m·A·r·sg(H) / Σ m`` marked ``uses_entropy``: the step passes
  ``entropy=`` with ``entropy_coef = 0`` and the loss is NumPy's (before: no entropy without a dummy c)."""

  @uses_entropy
  def weighted(config, logp, old_logp, advantages, mask, *, token_weights=None, ref_logp=None, entropy=None):
    h = jax.lax.stop_gradient(entropy)
    per = -advantages[:, None] * jnp.exp(logp - old_logp) * h
    m = mask.astype(jnp.float32)
    return LossTerms(jnp.sum(per * m), jnp.sum(m), {}, {})

  step, graphdef, state = _step(jg.preset("grpo"), objective_fn=weighted)
  batch = make_batch(seed=1)
  lp, ent = _numpy_logp_entropy(nnx.merge(graphdef, state.params), batch)
  adv = numpy_group_advantages(batch.rewards, batch.group_ids).astype(np.float64)[:, None]
  m = np.asarray(batch.mask, np.float64)
  want = float((-adv * np.exp(lp - batch.old_logp) * ent * m).sum() / m.sum())
  _, metrics = step(state, batch)
  np.testing.assert_allclose(float(metrics["loss"]), want, rtol=2e-5, atol=1e-6)


def test_a_hook_missing_a_keyword_is_refused_when_the_step_is_built():
  def pinned(config, logp, old_logp, advantages, mask, *, token_weights=None, ref_logp=None):
    return objective_terms(config, logp, old_logp, advantages, mask, token_weights=token_weights, ref_logp=ref_logp)

  def open_kw(config, logp, old_logp, advantages, mask, **kw):
    return objective_terms(config, logp, old_logp, advantages, mask, **kw)

  with pytest.raises(TypeError, match=r"'pinned' does not accept.*entropy= \(entropy_coef"):
    _step(jg.preset("grpo", entropy_coef=0.01), objective_fn=pinned)
  config = jg.preset("grpo", beta=0.04)
  with pytest.raises(TypeError, match=r"'pinned' does not accept.*hyper="):
    _step(config, objective_fn=pinned, hyper_schedule=lambda s: config.hyper())
  with pytest.raises(TypeError, match=r"advantages_fn '<lambda>' does not accept.*old_logp=.*ref_logp="):
    _step(config, advantages_fn=lambda c, r, t, m, g, n, *, max_group_size=None: (r, None))
  step, _, _ = _step(config, objective_fn=pinned)  # the pinned signature fits this config
  with pytest.raises(TypeError, match=r"'pinned' does not accept.*hyper="):
    step.check_hyper(config.hyper())
  bonus = jg.preset("grpo", entropy_coef=0.01)
  _step(bonus, objective_fn=open_kw, hyper_schedule=lambda s: bonus.hyper())  # **kwargs takes every keyword


def test_jvp_through_the_default_log_probs_names_forward_mode():
  from jaxgrpo.models import completion_log_probs

  model = tiny_model(layers=1)
  graphdef, params = nnx.split(model)
  batch = make_batch()
  args = (batch.prompt_tokens, batch.prompt_mask, batch.completions, batch.mask)
  f = lambda p: completion_log_probs(nnx.merge(graphdef, p), *args, chunk_size=None)[0]
  with pytest.raises(TypeError, match=r"completion_log_probs: .*forward_mode=True"):
    jax.jvp(f, (params,), (params,))
