"""The train step on one device: against a hand-written full-batch update, micro-batch invariance for
every aggregation mode, μ updates, no recompilation, the reference pass, bucketing and bad inputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import G, flat_params, make_batch, reference_update, tiny_model

from jaxgrpo.kernels.config import preset
from jaxgrpo.models import log_probs
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import train

LR, CLIP = 0.5, 0.05

# (preset, overrides): one per aggregation mode, covering KL-in-loss, future-KL, λ weights, dual clip
CASES = {
  "token-mean": ("lambda_frpo", {}),
  "seq-mean-token-mean": ("grpo", dict(beta=0.04, aggregation="seq-mean-token-mean", std_ddof=1)),
  "seq-mean-token-sum-norm": ("dr_grpo", dict(dual_clip=3.0)),
}


@functools.lru_cache(maxsize=None)
def _setup(name, overrides, micro, iters=1, mesh_spec="data=1"):
  config = preset(name, num_iterations=iters, **dict(overrides))
  mesh = shd.make_mesh(mesh_spec, devices=jax.devices()[:1])
  model = tiny_model(layers=1)
  opt = optax.sgd(LR)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  step = train.make_train_step(
    graphdef,
    opt,
    config,
    mesh=mesh,
    shardings=shardings,
    train_config=train.TrainConfig(micro_batches=micro, max_grad_norm=CLIP, group_size=G, chunk_size=5),
  )
  return config, mesh, model, opt, step


def _run(name, overrides, micro, iters=1, steps=1, batch=None):
  config, mesh, model, opt, step = _setup(name, tuple(sorted(overrides.items())), micro, iters)
  _, state, _ = train.init_train_state(model, opt, mesh)
  batch = make_batch() if batch is None else batch
  if not config.needs_reference:
    batch = batch._replace(ref_logp=None)
  b = shd.place_batch(batch, mesh)
  for _ in range(steps):
    state, metrics = step(state, b)
  return flat_params(state.params), {k: float(v) for k, v in metrics.items()}, step


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", list(CASES))
def test_step_matches_handwritten_and_micro_batches_change_nothing(aggregation):
  name, overrides = CASES[aggregation]
  config = preset(name, **overrides)
  assert config.aggregation == aggregation
  want, want_metrics, _ = reference_update(tiny_model(layers=1), make_batch(), config, lr=LR, max_grad_norm=CLIP)
  assert want_metrics["grad_norm"] > CLIP  # clipping is exercised
  one, m1, _ = _run(name, overrides, micro=1)
  four, m4, _ = _run(name, overrides, micro=4)
  init = flat_params(nnx.split(tiny_model(layers=1))[1])
  for k in want:  # against the hand-written full-batch update
    np.testing.assert_allclose(one[k], want[k], rtol=1e-5, atol=1e-7, err_msg=str(k))
  # 4 micro-batches: the same update (update = new - init), to 1e-6 of the update's scale (fp32:
  # single entries that nearly cancel differ in their last bits, relative to the whole update)
  u1 = np.concatenate([(one[k] - init[k]).ravel() for k in sorted(one)])
  u4 = np.concatenate([(four[k] - init[k]).ravel() for k in sorted(one)])
  assert np.abs(u4 - u1).max() <= 1e-6 * np.abs(u1).max()
  assert np.linalg.norm(u4 - u1) <= 1e-6 * np.linalg.norm(u1)
  for key in ("loss", "grad_norm", "entropy", "approx_kl"):
    assert m1[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-7), key
    assert m4[key] == pytest.approx(m1[key], rel=1e-6, abs=1e-7), key
  for key in ("tokens", "sequences", "clip_frac_low", "advantage_mean"):
    assert m4[key] == pytest.approx(m1[key], rel=1e-6, abs=1e-7), key
  if config.process_weights:
    assert 0 < m1["tree/nontrivial_group_fraction"] <= 1 and m1["tree/mean_process_set_size"] > 1


@pytest.mark.slow
def test_mu_updates_equal_repeated_steps_and_no_recompile():
  """μ=2 in one call == two calls with μ=1 (ratios stay against the rollout log-probs); the second
  and third calls reuse the compiled program."""
  overrides = dict(beta=0.04)
  config, mesh, model, opt, step = _setup("grpo", tuple(overrides.items()), 2, 1)
  _, state, _ = train.init_train_state(model, opt, mesh)
  batch = shd.place_batch(make_batch(), mesh)
  compiles = []
  listener = lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    state, _ = step(state, batch)
    assert compiles, "the listener sees compilations"
    before = len(compiles)
    for _ in range(2):
      state, _ = step(state, batch)
    jax.block_until_ready(state)
    assert step.traces == 1 and len(compiles) == before, "same shapes must not retrace or recompile"
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  twice, _, _ = _run("grpo", overrides, micro=2, iters=1, steps=2)
  once, m_once, _ = _run("grpo", overrides, micro=2, iters=2, steps=1)
  for k in twice:
    np.testing.assert_allclose(once[k], twice[k], rtol=1e-6, atol=1e-7, err_msg=str(k))
  assert m_once["approx_kl"] > 0  # the second update sees ratios != 1


@pytest.mark.slow
def test_mini_batches_are_sequential_updates_on_strided_rows():
  """M=2: two SGD updates, on rows 0,2,4,… then 1,3,5,… (advantages from the whole batch)."""
  config = preset("lambda_grpo")
  batch = make_batch()._replace(ref_logp=None)
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  model = tiny_model(layers=1)
  opt = optax.sgd(LR)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  step = train.make_train_step(
    graphdef,
    opt,
    config,
    mesh=mesh,
    shardings=shardings,
    train_config=train.TrainConfig(mini_batches=2, max_grad_norm=CLIP, group_size=G, chunk_size=5),
  )
  state, _ = step(state, shd.place_batch(batch, mesh))
  b = batch.completions.shape[0]
  full = make_batch()  # the reference reads (and, for λ-GRPO, ignores) ref_logp
  _, _, first = reference_update(model, full, config, lr=LR, max_grad_norm=CLIP, rows=np.arange(0, b, 2))
  nnx.update(model, first)
  want, _, _ = reference_update(model, full, config, lr=LR, max_grad_norm=CLIP, rows=np.arange(1, b, 2))
  got = flat_params(state.params)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=str(k))


def test_batch_from_rollout():
  from jaxgrpo.rollout.sampling import Rollout

  src = make_batch()
  rollout = Rollout(
    src.prompt_tokens,
    src.prompt_mask,
    src.completions,
    src.mask,
    src.old_logp,
    src.group_ids,
    np.int32(src.completions.shape[1]),
  )
  batch = train.Batch.from_rollout(rollout, src.rewards)
  for name in ("prompt_tokens", "prompt_mask", "completions", "mask", "old_logp", "group_ids", "rewards"):
    np.testing.assert_array_equal(np.asarray(getattr(batch, name)), getattr(src, name), err_msg=name)
  assert batch.ref_logp is None


@pytest.mark.parametrize("micro", [1, 4])
def test_reference_fn_matches_model_log_probs(micro):
  """Also in micro-batches: rows split over K sequential passes come back in their own order."""
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  model = tiny_model(seed=3, layers=1)
  graphdef, state, shardings = train.init_train_state(model, optax.sgd(0.1), mesh)
  tc = train.TrainConfig(chunk_size=5, micro_batches=micro)
  ref_fn = train.make_reference_fn(graphdef, mesh=mesh, param_shardings=shardings.params, train_config=tc)
  batch = make_batch()
  assert batch.completions.shape[0] % micro == 0
  got = ref_fn(state.params, shd.place_batch(batch, mesh))
  tokens = jnp.concatenate([batch.prompt_tokens, batch.completions], 1)
  attn = jnp.concatenate([batch.prompt_mask, batch.mask], 1)
  model_def, model_state = nnx.split(model)
  full = jax.jit(lambda state, t, a: log_probs(nnx.merge(model_def, state), t, a, chunk_size=None))  # one program
  want = np.where(batch.mask, np.asarray(full(model_state, tokens, attn))[:, batch.prompt_tokens.shape[1] :], 0)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_pad_to_bucket():
  batch = make_batch(t=12)
  lens = batch.mask.sum(1)
  mask = np.arange(12)[None] < np.minimum(lens, 7)[:, None]
  batch = batch._replace(mask=mask, completions=np.where(mask, batch.completions, 0))
  out = train.pad_to_bucket(batch, buckets=(4, 8, 16))
  assert out.completions.shape == (16, 8) and out.ref_logp.shape == (16, 8)
  np.testing.assert_array_equal(out.mask, mask[:, :8])
  out = train.pad_to_bucket(
    batch._replace(
      mask=mask[:, :6],
      completions=batch.completions[:, :6],
      old_logp=batch.old_logp[:, :6],
      ref_logp=batch.ref_logp[:, :6],
    ),
    buckets=(4, 8, 16),
  )
  assert out.completions.shape == (16, 8) and not out.mask[:, 6:].any()
  assert train.bucket_length(100, (64, 128)) == 128 and train.bucket_length(300, (64, 128)) == 300


def test_bad_inputs_raise_before_compiling():
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  model = tiny_model(layers=1)
  opt = optax.sgd(0.1)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  step = train.make_train_step(
    graphdef, opt, preset("frpo"), mesh=mesh, shardings=shardings, train_config=train.TrainConfig(micro_batches=3)
  )
  batch = make_batch()
  with pytest.raises(ValueError, match="not divisible.*micro/mini-batches"):
    step(state, batch)  # 16 rows, 3 micro-batches
  step = train.make_train_step(graphdef, opt, preset("frpo"), mesh=mesh, shardings=shardings)
  with pytest.raises(ValueError, match="needs batch.ref_logp"):
    step(state, batch._replace(ref_logp=None))
  with pytest.raises(ValueError, match="old_logp"):
    step(state, batch._replace(old_logp=batch.old_logp[:, :5]))
  with pytest.raises(ValueError, match="rows"):
    step(state, batch._replace(rewards=batch.rewards[:5]))
  assert step.traces == 0
  with pytest.raises(ValueError, match="micro_batches"):
    train.TrainConfig(micro_batches=0)
  with pytest.raises(ValueError, match="max_grad_norm"):
    train.TrainConfig(max_grad_norm=-1.0)
  with pytest.raises(TypeError, match="GRPOConfig"):
    train.make_train_step(graphdef, opt, "grpo", mesh=mesh, shardings=shardings)
