"""The new presets through the train step: GSPO, GSPO-token, CISPO, SAPO and GMPO (with TIS/MIS and the
entropy bonus on some) equal a plain-SGD update on a loss written here from the papers' formulas
(jnp, no jaxgrpo loss code), 1 and 4 micro-batches give the same update, 1 and 8 devices the same
parameters (one child process), and TIS against a deliberately perturbed behaviour policy reports the
mismatch it sees and still equals the reference update."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import G, flat_params, make_batch, numpy_group_advantages, ref_logits, run_child, sgd_update, tiny_model

from jaxgrpo import models
from jaxgrpo.kernels.config import preset
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import train

LR, CLIP = 0.5, 0.05

# (preset, overrides): clip ranges widened/narrowed so that both clipped and unclipped tokens occur on
# this batch (old log-probs = the model's + noise 0.3); TIS/MIS and the entropy bonus ride along.
CASES = {
  "gspo": dict(clip_eps_low=0.05, clip_eps_high=0.05),
  "gspo_token": dict(clip_eps_low=0.05, clip_eps_high=0.05, importance_correction="tis", entropy_coef=0.01),
  "cispo": dict(clip_eps_high=0.2, importance_correction="mis", importance_level="sequence", importance_cap=1.5),
  "sapo": dict(entropy_coef=0.02),
  "gmpo": dict(),
}


def _logits_logp(model, batch):
  """f64 log-softmax of the full logits at the completion positions, and the sampled tokens' log-probs."""
  tokens = jnp.concatenate([batch.prompt_tokens, batch.completions], axis=1)
  attn = jnp.concatenate([batch.prompt_mask, batch.mask], axis=1)
  p = batch.prompt_tokens.shape[1]
  logits = ref_logits(model, tokens, models.positions_from_mask(attn), attn)  # one jitted forward (helpers)
  return np.asarray(logits[:, p - 1 : -1], np.float64)


def _log_softmax_pick(logits, tokens, mask):
  z = logits - logits.max(-1, keepdims=True)
  logq = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return np.where(mask, np.take_along_axis(logq, np.asarray(tokens)[..., None], -1)[..., 0], 0.0)


@functools.lru_cache(maxsize=None)
def _batch():
  """make_batch's rollout with old log-probs near the tiny model's own (ratios around 1) and a
  behaviour policy from perturbed logits (for the importance-corrected cases)."""
  batch = make_batch()._replace(ref_logp=None)
  logits = _logits_logp(tiny_model(layers=1), batch)
  rng = np.random.default_rng(3)
  mask = np.asarray(batch.mask)
  own = _log_softmax_pick(logits, batch.completions, mask)
  old = np.where(mask, own + 0.3 * rng.standard_normal(own.shape), 0.0).astype(np.float32)
  behavior = _log_softmax_pick(logits + 0.7 * rng.standard_normal(logits.shape), batch.completions, mask)
  return batch._replace(old_logp=old, behavior_logp=behavior.astype(np.float32))


def reference_loss(config, lp, ent, old, behavior, adv, mask):
  """The objective of ``config`` written out from the papers (jnp, differentiable in lp and ent)."""
  m = mask.astype(jnp.float32)
  n = m.sum(1)
  lr = jnp.where(mask, lp - old, 0.0)
  a = adv[:, None]
  lo, hi = config.clip_eps_low, config.clip_eps_high
  if config.loss == "gspo":  # GSPO eq. 5-7: s_i = exp(mean_t log-ratio), differentiated through the mean
    s = jnp.exp(lr.sum(1) / jnp.maximum(n, 1))[:, None]
    per = -jnp.minimum(s * a, jnp.clip(s, 1 - lo, 1 + hi) * a) * m
  elif config.loss == "gspo_token":  # GSPO eq. 13: s_it = sg(s_i)·π(y_t)/sg(π(y_t))
    sg = jax.lax.stop_gradient
    s = sg(jnp.exp(lr.sum(1) / jnp.maximum(n, 1)))[:, None] * jnp.exp(lp - sg(lp))
    per = -jnp.minimum(s * a, jnp.clip(s, 1 - lo, 1 + hi) * a)
  elif config.loss == "cispo":  # MiniMax-M1 eq. 4
    r = jnp.exp(lr)
    per = -jax.lax.stop_gradient(jnp.clip(r, 1 - lo, 1 + hi)) * a * lp
  elif config.loss == "sapo":  # SAPO: σ(τ(r−1))·4/τ
    tau = jnp.where(a > 0, config.tau_pos, config.tau_neg)
    per = -jax.nn.sigmoid(tau * (jnp.exp(lr) - 1)) * 4 / tau * a
  else:  # GMPO: geometric mean of sign-clipped token ratios
    c = jnp.where(a > 0, jnp.minimum(lr, hi), jnp.maximum(lr, -lo))
    per = -a * jnp.exp(jnp.where(mask, c, 0.0).sum(1) / jnp.maximum(n, 1))[:, None] * m
  if config.importance_correction is not None:
    d = jnp.where(mask, old - behavior, 0.0)
    d = d.sum(1, keepdims=True) * m if config.importance_level == "sequence" else d
    r = jnp.exp(d)
    cap = config.importance_cap
    per = per * (jnp.minimum(r, cap) if config.importance_correction == "tis" else jnp.where(r > cap, 0.0, r))
  per = per - config.entropy_coef * ent
  per = jnp.where(mask, per, 0.0)
  if config.aggregation == "token-mean":
    return per.sum() / m.sum()
  rows = n > 0
  return jnp.sum(jnp.where(rows, per.sum(1) / jnp.maximum(n, 1), 0.0)) / rows.sum()


def reference_update(model, batch, config):
  """Parameters after one plain SGD step (clipped by global norm) on :func:`reference_loss`, with
  log-probs and entropies from the full, unchunked logits; and the loss."""
  graphdef, params = nnx.split(model)
  tokens = jnp.concatenate([batch.prompt_tokens, batch.completions], axis=1)
  attn = jnp.concatenate([batch.prompt_mask, batch.mask], axis=1)
  p = batch.prompt_tokens.shape[1]
  mask = jnp.asarray(batch.mask)
  adv = jnp.asarray(numpy_group_advantages(batch.rewards, batch.group_ids))
  old, behavior = jnp.asarray(batch.old_logp), jnp.asarray(batch.behavior_logp)

  def loss_fn(params):
    m = nnx.merge(graphdef, params)
    hidden, _ = m(tokens, jnp.maximum(jnp.cumsum(attn, 1) - 1, 0), attention_mask=attn)
    logq = jax.nn.log_softmax(m.logits(hidden[:, p - 1 : -1], out_dtype=jnp.float32), -1)
    lp = jnp.where(mask, jnp.take_along_axis(logq, batch.completions[..., None], -1)[..., 0], 0.0)
    ent = jnp.where(mask, -jnp.sum(jnp.exp(logq) * logq, -1), 0.0)
    return reference_loss(config, lp, ent, old, behavior, adv, mask)

  def update(params):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    gnorm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, CLIP / gnorm)
    return jax.tree.map(lambda p_, g_: p_ - LR * scale * g_, params, grads), loss, gnorm

  new, loss, gnorm = jax.jit(update)(params)
  assert float(gnorm) > CLIP  # the clipping is exercised
  return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(new)}, float(loss)


@functools.lru_cache(maxsize=None)
def _step(name, micro, head_logits="recompute"):
  config = preset(name, **CASES[name])
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(LR)
  graphdef, state, shardings = train.init_train_state(tiny_model(layers=1), opt, mesh)
  tc = train.TrainConfig(micro_batches=micro, max_grad_norm=CLIP, group_size=G, chunk_size=5, head_logits=head_logits)
  return (
    config,
    mesh,
    opt,
    train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc),
  )


def _run(name, micro, batch, head_logits="recompute"):
  config, mesh, opt, step = _step(name, micro, head_logits)
  _, state, _ = train.init_train_state(tiny_model(layers=1), opt, mesh)
  state, metrics = step(state, batch)
  return flat_params(state.params), {k: float(v) for k, v in metrics.items()}


def _update(params, init):
  return np.concatenate([(params[k] - init[k]).ravel() for k in sorted(params)])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_preset_equals_the_formula_and_micro_batches_change_nothing(name):
  batch = _batch()
  config = preset(name, **CASES[name])
  want, want_loss = reference_update(tiny_model(layers=1), batch, config)
  one, m1 = _run(name, 1, batch)
  four, m4 = _run(name, 4, batch)
  assert m1["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
  assert m4["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
  if config.loss != "sapo":  # SAPO has no hard clip
    clipped = m1["clip_frac_low"] + m1["clip_frac_high"]
    assert 0 < clipped < 1, clipped  # both branches are exercised
  if config.importance_correction is not None:
    assert m1["mismatch_kl"] > 0 and m1["is_capped_frac"] > 0
  init = flat_params(nnx.split(tiny_model(layers=1))[1])
  for k in want:
    np.testing.assert_allclose(one[k], want[k], rtol=1e-5, atol=1e-7, err_msg=f"{name} {k}")
  # updates (new − init, each rounded to the parameters' float32 ulps) agree to 1e-5 of their scale
  u1, u4 = _update(one, init), _update(four, init)
  assert np.abs(u4 - u1).max() <= 1e-5 * np.abs(u1).max()
  assert np.linalg.norm(u4 - u1) <= 1e-5 * np.linalg.norm(u1)


def test_kept_head_logits_give_the_formulas_update():
  """``TrainConfig(head_logits="keep")``: the chunks' logits kept for the backward pass instead of recomputed give
  the update of the loss written from the formula on full logits (an entropy bonus too: ``gspo_token``), as the
  recompute does, with 1 and 2 micro-batches."""
  name, batch = "gspo_token", _batch()
  want, want_loss = reference_update(tiny_model(layers=1), batch, preset(name, **CASES[name]))
  for micro in (1, 2):
    got, metrics = _run(name, micro, batch, head_logits="keep")
    assert metrics["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    for k in want:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=f"{name} {k} K={micro}")
  # and the step's program does skip the recompute: one chunk's head matmul less (XLA counts a loop body once)
  _, mesh, opt, _ = _step(name, 1)
  _, state, _ = train.init_train_state(tiny_model(layers=1), opt, mesh)
  flops = {h: _step(name, 1, h)[3].lower(state, batch).compile().cost_analysis() for h in ("recompute", "keep")}
  flops = {h: (a[0] if isinstance(a, list) else a)["flops"] for h, a in flops.items()}
  assert flops["keep"] < flops["recompute"], flops


@pytest.mark.slow
def test_tis_against_a_perturbed_behaviour_policy():
  """old_logp = the model's own log-probs; behaviour = the same policy with logits noise σ. The
  mismatch KL and the truncated fraction grow with σ (both 0 at σ = 0, where TIS changes nothing),
  and every update equals the reference with the TIS weights written out."""
  base = make_batch()._replace(ref_logp=None)
  logits = _logits_logp(tiny_model(layers=1), base)
  mask = np.asarray(base.mask)
  own = _log_softmax_pick(logits, base.completions, mask).astype(np.float32)
  rng = np.random.default_rng(11)
  noise = rng.standard_normal(logits.shape)
  config = preset("grpo", importance_correction="tis", importance_cap=1.5)
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(LR)
  graphdef, _, shardings = train.init_train_state(tiny_model(layers=1), opt, mesh)
  tc = train.TrainConfig(max_grad_norm=CLIP, group_size=G, chunk_size=5)
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
  seen = []
  for sigma in (0.0, 0.3, 1.0, 3.0):
    behavior = _log_softmax_pick(logits + sigma * noise, base.completions, mask).astype(np.float32)
    batch = base._replace(old_logp=own, behavior_logp=behavior)
    _, state, _ = train.init_train_state(tiny_model(layers=1), opt, mesh)
    state, m = step(state, batch)
    seen.append((m["mismatch_kl"], m["is_capped_frac"]))
    if sigma == 0.0:
      assert m["mismatch_kl"] == pytest.approx(0.0, abs=1e-6) and m["is_capped_frac"] == 0.0
      assert m["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    if sigma in (0.0, 3.0):
      # ppo surrogate with ratio 1 (old = own): the TIS-weighted policy gradient, written out
      adv = jnp.asarray(numpy_group_advantages(batch.rewards, batch.group_ids))[:, None]
      w = jnp.asarray(np.minimum(np.exp(np.where(mask, own - behavior, 0.0)), 1.5))
      jmask, old = jnp.asarray(mask), jnp.asarray(own)

      def tis_loss(lp, jmask=jmask, old=old, w=w, adv=adv):
        r = jnp.exp(lp - old)
        per = -jnp.minimum(r * adv, jnp.clip(r, 0.8, 1.2) * adv) * w
        return jnp.sum(jnp.where(jmask, per, 0.0)) / jmask.sum()

      want, want_loss = sgd_update(tiny_model(layers=1), batch, tis_loss, lr=LR, max_grad_norm=CLIP)
      assert m["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
      got = flat_params(state.params)
      for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=f"σ={sigma} {k}")
  kls, fracs = zip(*seen)
  assert all(a < b for a, b in zip(kls, kls[1:])), kls
  assert all(a <= b for a, b in zip(fracs, fracs[1:])) and fracs[-1] > 0.1, fracs
  assert step.traces == 1


_MESHES = r"""
import jax, numpy as np, optax
from helpers import G, flat_params, make_batch, tiny_model
from jaxgrpo.parallel import sharding as shd; from jaxgrpo.step import train
from jaxgrpo.kernels.config import preset

assert jax.device_count() == 8
CASES = {
  "gspo": dict(clip_eps_low=0.05, clip_eps_high=0.05),
  "gspo_token": dict(clip_eps_low=0.05, clip_eps_high=0.05, importance_correction="tis", entropy_coef=0.01),
  "cispo": dict(clip_eps_high=0.2, importance_correction="mis", importance_level="sequence", importance_cap=1.5),
  "sapo": dict(entropy_coef=0.02),
  "gmpo": dict(),
}
rng = np.random.default_rng(0)
batch = make_batch()._replace(ref_logp=None)
mask = np.asarray(batch.mask)
old = np.where(mask, np.log(1 / 128) + 0.05 * rng.standard_normal(mask.shape), 0).astype(np.float32)
behavior = np.where(mask, old + 0.3 * rng.standard_normal(mask.shape), 0).astype(np.float32)
batch = batch._replace(old_logp=old, behavior_logp=behavior)
model = tiny_model(layers=1)
opt = optax.sgd(0.5, momentum=0.9)
for name, overrides in CASES.items():
  config = preset(name, **overrides)
  params = {}
  for spec in ("data=1", "data=2,fsdp=2,tensor=2"):
    mesh = shd.make_mesh(spec, devices=jax.devices()[:1] if spec == "data=1" else None)
    graphdef, state, shardings = train.init_train_state(model, opt, mesh)
    step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings,
                                 train_config=train.TrainConfig(micro_batches=2, group_size=G, chunk_size=8))
    for _ in range(2):
      state, metrics = step(state, batch)
    params[spec] = flat_params(state.params)
  for k in params["data=1"]:
    np.testing.assert_allclose(params["data=2,fsdp=2,tensor=2"][k], params["data=1"][k], rtol=1e-5, atol=1e-7,
                               err_msg=f"{name} {k}")
  print(name, round(float(metrics["loss"]), 5), "OK")
print("OK")
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_new_presets_give_the_same_parameters_on_1_and_8_devices():
  out = run_child(_MESHES, devices=8, timeout=1500)
  assert out.strip().endswith("OK"), out
