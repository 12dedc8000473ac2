"""The train step's research hooks: a custom objective (GSPO through ``objective_fn``), a custom
advantage estimator, precomputed advantages and token weights, non-finite rewards as missing samples,
host-side validation, no retrace for placed vs unplaced batches, and the donated-state error.

Every expected value is written out independently: NumPy GSPO from the paper's formula, NumPy RLOO and
group advantages, and plain-SGD reference updates (``helpers.reference_update`` / ``sgd_update``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
  G,
  flat_params,
  load_example,
  make_batch,
  numpy_group_advantages,
  numpy_gspo_loss,
  numpy_log_probs,
  reference_update,
  run_child,
  sgd_update,
  tiny_model,
)

from jaxgrpo import rloo_advantages
from jaxgrpo.kernels.config import preset
from jaxgrpo.kernels.losses import LossTerms
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import hooks as step_hooks
from jaxgrpo.step import train

LR, CLIP = 0.5, 0.05
GSPO_CLIP = 0.1  # wide enough to leave some sequences inside, narrow enough to clip others


def _make(config, *, micro=1, mesh=None, model=None, **fns):
  # one layer by default: each update is compared with a reference on the same model, at half the compile
  mesh = mesh or shd.make_mesh("data=1", devices=jax.devices()[:1])
  model = model or tiny_model(layers=1)
  opt = optax.sgd(LR)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  tc = train.TrainConfig(micro_batches=micro, max_grad_norm=CLIP, group_size=G, chunk_size=5)
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc, **fns)
  return step, state


def _update(one, init):
  return np.concatenate([(one[k] - init[k]).ravel() for k in sorted(one)])


def _assert_same_update(got, want, init, rel=1e-6):
  """Two updates agree to ``rel`` of the update's scale (fp32: single entries that nearly cancel differ
  in their last bits, relative to the whole update)."""
  u, v = _update(got, init), _update(want, init)
  assert np.abs(u - v).max() <= rel * np.abs(v).max()
  assert np.linalg.norm(u - v) <= rel * np.linalg.norm(v)


# ----------------------------------------------------------------------------- GSPO through the public hook


@functools.lru_cache(maxsize=None)
def _gspo_run(micro):
  gspo = load_example("gspo").gspo_objective
  config = preset("grpo", clip_eps_low=GSPO_CLIP, clip_eps_high=GSPO_CLIP)
  step, state = _make(config, micro=micro, model=tiny_model(), objective_fn=gspo)  # 2 layers: both clips occur
  state, metrics = step(state, make_batch()._replace(ref_logp=None))
  return flat_params(state.params), {k: float(v) for k, v in metrics.items()}


@pytest.mark.slow
def test_gspo_loss_and_update_match_the_formula_and_micro_batches_change_nothing():
  batch = make_batch()._replace(ref_logp=None)
  model = tiny_model()
  adv = numpy_group_advantages(batch.rewards, batch.group_ids)
  want_loss, s = numpy_gspo_loss(numpy_log_probs(model, batch), batch.old_logp, batch.mask, adv, GSPO_CLIP, GSPO_CLIP)
  real = batch.mask.sum(1) > 0
  assert ((s < 1 - GSPO_CLIP) & real).any() and ((s > 1 + GSPO_CLIP) & real).any()  # both clips are exercised
  assert (np.abs(s - 1) < GSPO_CLIP)[real].any()

  one, m1 = _gspo_run(1)
  four, m4 = _gspo_run(4)
  assert m1["loss"] == pytest.approx(want_loss, rel=1e-5)
  assert m4["loss"] == pytest.approx(want_loss, rel=1e-5)

  # the update: the gradient of the sequence-level loss written directly (no GSPO-token trick)
  mask, old, a = jnp.asarray(batch.mask), jnp.asarray(batch.old_logp), jnp.asarray(adv)

  def gspo_loss(lp):
    n = mask.sum(1)
    s = jnp.exp(jnp.where(mask, lp - old, 0.0).sum(1) / jnp.maximum(n, 1))
    per = -jnp.minimum(s * a, jnp.clip(s, 1 - GSPO_CLIP, 1 + GSPO_CLIP) * a)
    return jnp.sum(jnp.where(n > 0, per, 0.0)) / jnp.sum(n > 0)

  want, ref_loss = sgd_update(model, batch, gspo_loss, lr=LR, max_grad_norm=CLIP)
  assert ref_loss == pytest.approx(want_loss, rel=1e-5)
  init = flat_params(nnx.split(tiny_model())[1])
  for k in want:
    np.testing.assert_allclose(one[k], want[k], rtol=1e-5, atol=1e-7, err_msg=str(k))
  _assert_same_update(four, one, init, rel=2e-6)  # ~16 ulps of the update's scale: 1.1e-6 at XLA opt level 0


_GSPO_FSDP = r"""
import jax, numpy as np, optax
from helpers import G, flat_params, load_example, make_batch, numpy_gspo_loss, numpy_group_advantages, numpy_log_probs, tiny_model
from jaxgrpo.parallel import sharding as shd; from jaxgrpo.step import train
from jaxgrpo.kernels.config import preset

assert jax.device_count() == 2
gspo = load_example("gspo").gspo_objective
config = preset("grpo", clip_eps_low=0.1, clip_eps_high=0.1)
batch = make_batch()._replace(ref_logp=None)
model = tiny_model(layers=1)
adv = numpy_group_advantages(batch.rewards, batch.group_ids)
want, _ = numpy_gspo_loss(numpy_log_probs(model, batch), batch.old_logp, batch.mask, adv, 0.1, 0.1)
params = {}
for spec in ("data=1", "fsdp=2"):
  mesh = shd.make_mesh(spec, devices=jax.devices()[:1] if spec == "data=1" else None)
  opt = optax.sgd(0.5)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, objective_fn=gspo,
                               train_config=train.TrainConfig(micro_batches=2, group_size=G, chunk_size=8))
  state, metrics = step(state, batch)
  if spec == "fsdp=2":
    emb = state.params["embed_tokens"][...]
    assert emb.addressable_shards[0].data.shape == (128, 16), emb.sharding  # D split over fsdp
  np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)
  params[spec] = flat_params(state.params)
for k in params["data=1"]:
  np.testing.assert_allclose(params["fsdp=2"][k], params["data=1"][k], rtol=1e-5, atol=1e-7, err_msg=str(k))
print("OK")
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_gspo_loss_on_an_fsdp2_mesh():
  assert run_child(_GSPO_FSDP, devices=2).strip().endswith("OK")


# ----------------------------------------------------------------------------- custom advantages, precomputed ones


def _rloo(config, rewards, tokens, mask, group_ids, num_groups, *, old_logp=None, ref_logp=None, max_group_size=None):
  return rloo_advantages(rewards, group_ids, num_groups), None


def _numpy_rloo(rewards, group_ids):
  r, g = np.asarray(rewards, np.float64), np.asarray(group_ids)
  out = np.zeros_like(r)
  for i in range(len(r)):
    others = (g == g[i]) & (np.arange(len(r)) != i)
    out[i] = r[i] - r[others].mean() if others.any() else 0.0
  return out.astype(np.float32)


@pytest.mark.slow
def test_custom_advantage_estimator_changes_the_update_as_written():
  """RLOO through ``advantages_fn`` == the hand-written update with NumPy RLOO advantages."""
  config = preset("grpo")
  batch = make_batch()._replace(ref_logp=None)
  step, state = _make(config, micro=2, advantages_fn=_rloo)
  state, metrics = step(state, batch)
  adv = _numpy_rloo(batch.rewards, batch.group_ids)
  assert not np.allclose(adv, numpy_group_advantages(batch.rewards, batch.group_ids))  # a different estimator
  want, want_m, _ = reference_update(tiny_model(layers=1), batch, config, lr=LR, max_grad_norm=CLIP, advantages=adv)
  got = flat_params(state.params)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=str(k))
  assert float(metrics["loss"]) == pytest.approx(want_m["loss"], rel=1e-5, abs=1e-7)


def _never(*args, **kwargs):
  raise AssertionError("advantages_fn must not run when the batch carries its advantages")


@pytest.mark.slow
def test_precomputed_advantages_and_token_weights_are_used_as_given():
  config = preset("grpo")
  batch = make_batch()._replace(ref_logp=None)
  b, t = batch.completions.shape
  rng = np.random.default_rng(7)
  step, state0 = _make(config, advantages_fn=_never)
  init = flat_params(state0.params)
  cases = {
    "f32[B]": dict(advantages=rng.standard_normal(b).astype(np.float32)),
    "f32[B, T] + token weights": dict(
      advantages=rng.standard_normal((b, t)).astype(np.float32),
      token_weights=rng.uniform(0.2, 1.0, (b, t)).astype(np.float32),
    ),
  }
  for name, fields in cases.items():
    _, state, _ = train.init_train_state(tiny_model(layers=1), optax.sgd(LR), step.mesh)
    state, metrics = step(state, batch._replace(**fields))
    want, want_m, _ = reference_update(tiny_model(layers=1), batch, config, lr=LR, max_grad_norm=CLIP, **fields)
    got = flat_params(state.params)
    for k in want:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=f"{name} {k}")
    assert float(metrics["loss"]) == pytest.approx(want_m["loss"], rel=1e-5, abs=1e-7), name
    assert np.abs(_update(got, init)).max() > 0
  assert step.traces == 2  # one program per batch structure


# ----------------------------------------------------------------------------- custom config, denominator contract


def _weighted_pg(config, logp, old_logp, advantages, mask, *, token_weights=None, ref_logp=None):
  """REINFORCE with a data-dependent denominator: ``Σ -A_i·logp·m / Σ_i |A_i|·[row non-empty]``."""
  assert config is None
  numerator = jnp.sum(jnp.where(mask, -advantages[:, None] * logp, 0.0))
  denominator = jnp.sum(jnp.where(mask.any(axis=1), jnp.abs(advantages), 0.0))
  return LossTerms(numerator, denominator, {"tokens": jnp.sum(mask).astype(jnp.float32)}, {})


@pytest.mark.slow
def test_custom_objective_with_config_none_and_a_data_dependent_denominator():
  batch = make_batch()._replace(ref_logp=None)
  step, state = _make(None, micro=4, objective_fn=_weighted_pg, advantages_fn=_rloo)
  state, metrics = step(state, batch)
  adv = jnp.asarray(_numpy_rloo(batch.rewards, batch.group_ids))
  mask = jnp.asarray(batch.mask)

  def loss(lp):
    num = jnp.sum(jnp.where(mask, -adv[:, None] * lp, 0.0))
    return num / jnp.sum(jnp.where(mask.any(1), jnp.abs(adv), 0.0))

  want, want_loss = sgd_update(tiny_model(layers=1), batch, loss, lr=LR, max_grad_norm=CLIP)
  got = flat_params(state.params)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=str(k))
  assert float(metrics["loss"]) == pytest.approx(want_loss, rel=1e-5)
  assert float(metrics["objective/tokens"]) == batch.mask.sum()  # the objective's own sums are reported


def test_a_denominator_with_a_gradient_is_refused_at_trace_time():
  def leaky(config, logp, old_logp, advantages, mask, *, token_weights=None, ref_logp=None):
    terms = _weighted_pg(None, logp, old_logp, advantages, mask)
    return terms._replace(denominator=jnp.sum(jnp.where(mask, jnp.exp(logp), 0.0)))

  def detached(config, logp, old_logp, advantages, mask, *, token_weights=None, ref_logp=None):
    terms = _weighted_pg(None, logp, old_logp, advantages, mask)
    return terms._replace(denominator=jnp.sum(jnp.where(mask, jnp.exp(jax.lax.stop_gradient(logp)), 0.0)))

  batch = make_batch()._replace(ref_logp=None)
  step, state = _make(None, objective_fn=leaky, advantages_fn=_rloo)
  with pytest.raises(ValueError, match="denominator that depends on `logp`"):
    step(state, batch)
  step, _ = _make(None, objective_fn=detached, advantages_fn=_rloo)
  step_hooks.check_denominator(
    detached,
    None,
    {
      "old_logp": jnp.zeros((4, 3)),
      "adv": jnp.zeros(4),
      "loss_mask": jnp.ones((4, 3), bool),
      "weights": None,
      "ref_logp": None,
    },
  )  # stop_gradient(logp) in the denominator is fine


# ----------------------------------------------------------------------------- missing samples


@pytest.mark.slow
def test_nonfinite_reward_is_a_missing_sample_even_with_nan_log_probs():
  """KL in the loss (β > 0), precomputed advantages: a NaN reward row with NaN log-probs on its real
  tokens leaves the update equal to the hand-written one over the other rows."""
  config = preset("grpo", beta=0.04)
  batch = make_batch()
  b = batch.completions.shape[0]
  bad = 5
  assert batch.mask[bad].any()
  rewards = batch.rewards.copy()
  rewards[bad] = np.nan
  old, ref = batch.old_logp.copy(), batch.ref_logp.copy()
  old[bad] = np.where(batch.mask[bad], np.nan, 0)
  ref[bad] = np.where(batch.mask[bad], np.inf, 0)
  adv = np.random.default_rng(3).standard_normal(b).astype(np.float32)
  poisoned = batch._replace(rewards=rewards, old_logp=old, ref_logp=ref, advantages=adv)
  step, state = _make(config)
  state, metrics = step(state, poisoned)
  rows = np.array([i for i in range(b) if i != bad])
  want, want_m, _ = reference_update(
    tiny_model(layers=1), batch, config, lr=LR, max_grad_norm=CLIP, rows=rows, advantages=adv
  )
  got = flat_params(state.params)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=str(k))
  assert float(metrics["rewards_nonfinite"]) == 1
  assert float(metrics["loss"]) == pytest.approx(want_m["loss"], rel=1e-5, abs=1e-7)
  assert float(metrics["tokens"]) == batch.mask[rows].sum()


def test_precomputed_advantages_need_no_rewards():
  """Issue 22.2: with ``batch.advantages`` given the rewards are not needed: ``rewards=None`` trains
  every row on its given advantage (no row skipped, ``rewards_nonfinite`` 0), equal to the hand-written
  update over all rows; without advantages, None is refused in one line naming the field."""
  config = preset("grpo")
  batch = make_batch()._replace(ref_logp=None)
  b = batch.completions.shape[0]
  adv = np.random.default_rng(4).standard_normal(b).astype(np.float32)
  step, state = _make(config, advantages_fn=_never)
  state, metrics = step(state, batch._replace(rewards=None, advantages=adv))
  want, want_m, _ = reference_update(tiny_model(layers=1), batch, config, lr=LR, max_grad_norm=CLIP, advantages=adv)
  got = flat_params(state.params)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=str(k))
  assert float(metrics["rewards_nonfinite"]) == 0
  assert float(metrics["tokens"]) == batch.mask.sum()
  assert float(metrics["loss"]) == pytest.approx(want_m["loss"], rel=1e-5, abs=1e-7)
  with pytest.raises(ValueError, match=r"batch.rewards is required \(f32\[B\]\) unless batch.advantages is given"):
    step.check_batch(batch._replace(rewards=None))


def _kernel_has_missing_sample_policy() -> bool:
  from jaxgrpo import group_advantages

  adv = np.asarray(group_advantages(jnp.array([np.nan, 1.0, 0.0, 1.0]), jnp.array([0, 0, 1, 1]), 2))
  return bool(np.isfinite(adv).all())


@pytest.mark.slow
@pytest.mark.skipif(
  not _kernel_has_missing_sample_policy(), reason="group_advantages does not yet leave non-finite rewards out"
)
def test_nonfinite_reward_with_the_default_advantages():
  config = preset("grpo")
  batch = make_batch()._replace(ref_logp=None)
  rewards = batch.rewards.copy()
  rewards[[2, 9]] = [np.nan, np.inf]
  step, state = _make(config)
  state, metrics = step(state, batch._replace(rewards=rewards))
  adv = numpy_group_advantages(rewards, batch.group_ids)
  rows = np.array([i for i in range(len(rewards)) if i not in (2, 9)])
  want, _, _ = reference_update(
    tiny_model(layers=1), batch, config, lr=LR, max_grad_norm=CLIP, rows=rows, advantages=adv
  )
  got = flat_params(state.params)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=str(k))
  assert float(metrics["rewards_nonfinite"]) == 2


# ----------------------------------------------------------------------------- one program, donated state


def test_placed_and_unplaced_batches_run_one_program_and_a_donated_state_is_refused():
  step, state = _make(preset("grpo"))
  batch = make_batch()._replace(ref_logp=None)
  compiles = []
  listener = lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    state, _ = step(state, batch)  # NumPy
    n = len(compiles)
    state, _ = step(state, shd.place_batch(batch, step.mesh))  # placed
    wide = batch._replace(
      completions=batch.completions.astype(np.int64), rewards=batch.rewards.astype(np.float64).tolist()
    )
    state, _ = step(state, wide._replace(rewards=np.asarray(wide.rewards)))  # other host dtypes
    state, _ = step(state, step.place_batch(batch))
    jax.block_until_ready(state)
    assert step.traces == 1 and len(compiles) == n, (step.traces, compiles[n:])
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  consumed = state
  state, _ = step(state, batch)
  with pytest.raises(ValueError, match="consumed by an earlier call.*Use the state the previous call returned"):
    step(consumed, batch)
  ref_fn = train.make_reference_fn(step.graphdef, mesh=step.mesh, param_shardings=step.shardings.params)
  with pytest.raises(ValueError, match="ref_params was consumed"):
    ref_fn(consumed.params, batch)
  state, _ = step(state, batch)  # the returned state still works
  assert step.traces == 1


# ----------------------------------------------------------------------------- host-side validation


def test_batches_are_validated_on_the_host_before_jit():
  step, state = _make(preset("grpo"))
  batch = make_batch()._replace(ref_logp=None)
  bad = {
    "group_ids must be in \\[0, 4\\)": batch._replace(group_ids=np.arange(16, dtype=np.int32) // 2),
    "group of 5 rows but TrainConfig.group_size=4": batch._replace(
      group_ids=np.array([0] * 5 + [1] * 3 + [2] * 4 + [3] * 4, np.int32)
    ),
    r"batch.advantages must be f32\[B\] or f32\[B, T\] .*, i.e. shape \(16,\) or \(16, 12\); got \(16, 3\)": batch._replace(
      advantages=np.zeros((16, 3), np.float32)
    ),
    r"batch.token_weights must be f32\[B, T\] with B = 16 rows and T = 12, i.e. shape \(16, 12\)": batch._replace(
      token_weights=np.ones((16, 5), np.float32)
    ),
    "batch.rewards is required": batch._replace(rewards=None),
  }
  for match, b in bad.items():
    with pytest.raises(ValueError, match=match):
      step(state, b)
  with pytest.raises(TypeError, match="batch.mask. must be a boolean array"):
    step(state, batch._replace(mask=batch.mask.astype(np.int32)))
  with pytest.raises(TypeError, match="batch.old_logp. must be a floating array"):
    step(state, batch._replace(old_logp=batch.old_logp.astype(np.int32)))
  with pytest.raises(TypeError, match="TrainState"):
    step(tuple(state), batch)
  lam, lam_state = _make(preset("lambda_grpo"))
  with pytest.raises(ValueError, match="without batch.token_weights"):
    lam(lam_state, batch._replace(advantages=np.zeros(16, np.float32)))
  frpo, frpo_state = _make(preset("frpo"))
  with pytest.raises(ValueError, match="needs batch.ref_logp"):
    frpo(frpo_state, batch)
  assert step.traces == lam.traces == frpo.traces == 0
  custom, custom_state = _make(None, objective_fn=_weighted_pg)
  with pytest.raises(ValueError, match="not a GRPOConfig.*pass advantages_fn"):
    custom(custom_state, batch)
  with pytest.raises(TypeError, match="config must be a GRPOConfig .* for the default objective"):
    train.make_train_step(step.graphdef, optax.sgd(0.1), None, mesh=step.mesh, shardings=step.shardings)
  with pytest.raises(TypeError, match="objective_fn. must be callable"):
    train.make_train_step(
      step.graphdef, optax.sgd(0.1), preset("grpo"), mesh=step.mesh, shardings=step.shardings, objective_fn="gspo"
    )


def test_batch_from_rollout_takes_precomputed_fields_and_pad_to_bucket_fits_them():
  src = make_batch()
  b, t = src.completions.shape
  adv, w = np.ones((b, t), np.float32), np.full((b, t), 0.5, np.float32)
  from jaxgrpo.rollout.sampling import Rollout

  rollout = Rollout(src.prompt_tokens, src.prompt_mask, src.completions, src.mask, src.old_logp, src.group_ids, t)
  batch = train.Batch.from_rollout(rollout, list(src.rewards), advantages=adv, token_weights=w)
  assert batch.rewards.dtype == np.float32 and batch.advantages is adv and batch.token_weights is w
  out = train.pad_to_bucket(batch, buckets=(16,))
  assert out.advantages.shape == out.token_weights.shape == (b, 16) and not out.token_weights[:, t:].any()
  flat = train.pad_to_bucket(batch._replace(advantages=np.ones(b, np.float32)), buckets=(16,))
  assert flat.advantages.shape == (b,)
  with pytest.raises(ValueError, match="shorter than the longest real completion"):
    train.pad_to_bucket(batch, buckets=(16,), length=3)
  assert train.Batch.from_rollout(rollout, None, advantages=adv).rewards is None  # advantages need no rewards
