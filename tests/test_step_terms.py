"""The named pieces of the step (jaxgrpo.step.terms, jaxgrpo.step.update) called alone, against NumPy written from
their docstrings or jax.grad of a hand-written full-batch loss."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxgrpo.kernels.losses import LossTerms
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import terms, update
from jaxgrpo.step.state import TrainConfig


def _spec(max_grad_norm, **kw):
  return types.SimpleNamespace(
    tc=TrainConfig(max_grad_norm=max_grad_norm, **kw), optimizer=optax.sgd(0.5), blocks=1
  )  # one batch shard


def test_token_scale_is_the_power_of_two_just_above_one_over_the_real_tokens():
  for n in (1, 3, 4, 5, 100):
    mask = np.zeros((2, 3, 64), bool)
    mask.reshape(-1)[:n] = True
    s = float(update.token_scale({"loss_mask": jnp.asarray(mask)}))
    assert s == 2.0 ** -np.floor(np.log2(n) + 1), (n, s)  # frexp: n = f·2^e, f in [0.5, 1)


def test_apply_update_divides_once_clips_and_steps():
  """∇L = Σ∇num / (scale·Σden), clipped to max_grad_norm by global norm, then SGD: p − lr·g."""
  params = {"w": jnp.asarray([1.0, -2.0, 0.5]), "b": jnp.asarray([3.0])}
  grads = {"w": jnp.asarray([8.0, 0.0, -4.0]), "b": jnp.asarray([2.0])}  # Σ_k scale·∇num_k
  t = LossTerms(numerator=jnp.float32(0), denominator=jnp.float32(4.0), sums={}, extrema={})
  scale = jnp.float32(0.5)
  g = {k: np.asarray(v) / (0.5 * 4.0) for k, v in grads.items()}
  norm = np.sqrt(sum(np.sum(v**2) for v in g.values()))
  for max_norm in (None, 1.0):
    opt = optax.sgd(0.5)
    new, _, got_norm = update.apply_update(_spec(max_norm), params, opt.init(params), grads, t, scale)
    clip = 1.0 if max_norm is None or norm <= max_norm else max_norm / norm
    for k in params:
      np.testing.assert_allclose(np.asarray(new[k]), np.asarray(params[k]) - 0.5 * clip * g[k], rtol=1e-6)
    np.testing.assert_allclose(float(got_norm), norm, rtol=1e-6)


def _toy_loss(params, mb, scale):
  """A micro-batch loss with the step's contract: log-probs ``x·w + b`` of R rows × T tokens, numerator
  ``-Σ mask·adv·logp``, denominator ``Σ mask`` (no gradient), aux ``(terms, entropy sum, routing sums)``."""
  logp = jnp.einsum("rtd,d->rt", mb["x"], params["w"]) + params["b"]
  m = mb["loss_mask"].astype(jnp.float32)
  num = -jnp.sum(m * mb["adv"][:, None] * logp)
  terms = LossTerms(num, jnp.sum(m), {"tokens": jnp.sum(m)}, {"logp_max": jnp.max(jnp.where(m > 0, logp, -1e9))})
  return num * scale, (terms, jnp.sum(m * logp), {})


def test_accumulated_micro_batch_gradients_are_the_full_batch_gradient():
  """Two micro-batches with different token counts: accumulate_grads then apply_update (SGD lr 1, no clipping)
  step by −∇ of the full-batch loss Σ num / Σ den (jax.grad of the hand-written loss over all rows) — not the
  mean of the micro-batches' own token means; the combined terms are the full batch's."""
  rng = np.random.default_rng(0)
  k, r, t, d = 2, 3, 5, 4
  x = rng.standard_normal((k, r, t, d)).astype(np.float32)
  adv = rng.standard_normal((k, r)).astype(np.float32)
  mask = np.ones((k, r, t), bool)
  mask[0, :, 2:] = False  # micro-batch 0: 6 tokens, micro-batch 1: 15
  mini = {"x": jnp.asarray(x), "adv": jnp.asarray(adv), "loss_mask": jnp.asarray(mask)}
  params = {"w": jnp.asarray(rng.standard_normal(d), jnp.float32), "b": jnp.float32(0.3)}
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  spec = types.SimpleNamespace(
    tc=TrainConfig(max_grad_norm=None),
    optimizer=optax.sgd(1.0),
    param_sh=jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params),
  )
  grad_fn = jax.grad(_toy_loss, has_aux=True)
  shapes = jax.eval_shape(lambda p, mb: _toy_loss(p, mb, 1.0)[1], params, jax.tree.map(lambda a: a[0], mini))

  @jax.jit
  def run(params, mini):
    scale = update.token_scale(mini)
    sums = update.accumulate_grads(spec, grad_fn, shapes, params, mini, scale)
    new, _, _ = update.apply_update(spec, params, spec.optimizer.init(params), sums[0], sums[1], scale)
    return new, sums

  new, (_, got_terms, ent, tokens, routes) = run(params, mini)

  def full_loss(p):  # the whole mini-batch at once, written out
    logp = jnp.einsum("krtd,d->krt", mini["x"], p["w"]) + p["b"]
    m = mini["loss_mask"].astype(jnp.float32)
    return -jnp.sum(m * mini["adv"][..., None] * logp) / jnp.sum(m)

  ref = jax.grad(full_loss)(params)
  for name in params:
    np.testing.assert_allclose(np.asarray(new[name]), np.asarray(params[name] - ref[name]), rtol=1e-5, atol=1e-6)
  logp = np.einsum("krtd,d->krt", x, np.asarray(params["w"])) + 0.3
  np.testing.assert_allclose(float(got_terms.numerator), -np.sum(mask * adv[..., None] * logp), rtol=1e-5)
  assert float(got_terms.denominator) == 21 and float(tokens) == 21 and routes == {}  # the terms: unscaled
  assert float(got_terms.sums["tokens"]) == 21
  np.testing.assert_allclose(float(got_terms.extrema["logp_max"]), logp[mask].max(), rtol=1e-6)
  np.testing.assert_allclose(float(ent), np.sum(mask * logp), rtol=1e-5)


def test_split_rows_puts_row_i_mk_plus_mk_at_m_k_i_and_pass_fields_fold_in_step_pass_row():
  """split_rows: row ``i·(M·K) + m·K + k`` at ``[m, k, i]`` (NumPy indexing); pass_fields: ``{}`` without a key,
  else row r of pass i at step s has ``fold_in(fold_in(fold_in(key, s), i), r)``."""
  mm, kk, b = 2, 3, 12
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  spec = _spec(None, mini_batches=mm, micro_batches=kk)
  spec.rows_sh = NamedSharding(mesh, PartitionSpec(None, None, *shd.batch_sharding(mesh).spec))
  x = np.arange(b * 2, dtype=np.int32).reshape(b, 2)
  got = np.asarray(jax.jit(lambda rows: terms.split_rows(spec, rows, None))({"x": x})["x"])
  assert got.shape == (mm, kk, b // (mm * kk), 2)
  for m in range(mm):
    for k in range(kk):
      for i in range(b // (mm * kk)):
        np.testing.assert_array_equal(got[m, k, i], x[i * mm * kk + m * kk + k])
  assert terms.pass_fields(None, jnp.int32(7), 2, 3) == {}
  key = jax.random.key(5)
  keys = terms.pass_fields(key, jnp.int32(7), 2, 3)["dropout_key"]
  assert keys.shape == (2, 3)
  for i in range(2):
    for r in range(3):
      want = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, 7), i), r)
      np.testing.assert_array_equal(jax.random.key_data(keys[i, r]), jax.random.key_data(want))
