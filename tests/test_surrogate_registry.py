"""A new loss is one entry in one registry, and every number one declaration (issue 49, item 5).

A toy surrogate registered from this file alone (``jaxgrpo.kernels.surrogates.register_surrogate``: nothing
else in the package touched) is the loss of the kernels, the config, the objective and the train step, and
equals NumPy from its formula; the numbers' checks, defaults and hints are the one declaration of
``jaxgrpo.kernels.numbers`` wherever a number is given (the config, the hyper carrier, the config's check of
a hyper, the surrogate's keyword)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import G, make_batch, numpy_group_advantages, numpy_log_probs, tiny_model

import jaxgrpo as jg
from jaxgrpo.kernels import numbers, surrogates
from jaxgrpo.kernels.config import SWITCHED_TERMS
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import train

TOY = "toy_truncated_pg"


def truncated_pg(logp, old_logp, adv, real, *, clip_eps_high):
  """``p = −min(ρ, 1+ε_high)·A``: a policy gradient with a one-sided cap on the ratio (clip_high where capped)."""
  ratio = jnp.exp(jnp.clip(logp - old_logp, -20.0, 20.0))
  capped = real & (ratio > 1.0 + clip_eps_high)
  none = jnp.zeros_like(real)
  return surrogates.Surrogate(jnp.where(real, -jnp.minimum(ratio, 1.0 + clip_eps_high) * adv, 0.0), none, capped, none)


def numpy_truncated_pg(logp, old, adv, mask, eps_high):
  """Token-mean of ``−min(ρ, 1+ε_high)·A`` in float64, its gradient in ``logp`` and the capped fraction."""
  logp, old, mask = (np.asarray(x, np.float64) for x in (logp, old, mask))
  a = np.broadcast_to(np.asarray(adv, np.float64)[:, None], logp.shape)
  ratio = np.exp(logp - old)
  n = mask.sum()
  value = (np.where(mask > 0, -np.minimum(ratio, 1 + eps_high) * a, 0.0)).sum() / n
  grad = np.where((mask > 0) & (ratio < 1 + eps_high), -ratio * a, 0.0) / n
  return value, grad, ((mask > 0) & (ratio > 1 + eps_high)).sum() / n


@pytest.fixture
def toy():
  spec = surrogates.register_surrogate(TOY, truncated_pg, numbers=("clip_eps_high",))
  yield spec
  del surrogates.REGISTRY[TOY]


def _inputs(seed=0, b=6, t=5):
  rng = np.random.default_rng(seed)
  old = rng.normal(-1.5, 0.5, (b, t)).astype(np.float32)
  logp = (old + rng.normal(0.0, 0.4, (b, t))).astype(np.float32)
  mask = np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None]
  adv = rng.normal(0.0, 1.0, b).astype(np.float32)
  return logp, old, adv, mask


def test_a_toy_surrogate_registered_here_is_the_loss_of_the_kernels_and_the_config(toy):
  logp, old, adv, mask = _inputs()
  want, want_grad, want_capped = numpy_truncated_pg(logp, old, adv, mask, 0.1)
  assert 0 < want_capped < 0.9  # both sides of the cap occur

  hyper = jg.GRPOHyper(loss=TOY, clip_eps_high=0.1)
  (loss, metrics), grad = jax.value_and_grad(lambda lp: jg.policy_loss(lp, old, adv, mask, hyper), has_aux=True)(logp)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(float(metrics["clip_frac_high"]), want_capped, rtol=1e-6)
  # the surrogate's number traced: one program for every value, the same loss
  traced = jax.jit(lambda e: jg.policy_loss(logp, old, adv, mask, jg.GRPOHyper(loss=TOY, clip_eps_high=e))[0])
  np.testing.assert_allclose(float(traced(jnp.float32(0.1))), want, rtol=1e-5)

  config = jg.preset("grpo", loss=TOY, clip_eps_high=0.1)
  assert config.applied_hyper == ("clip_eps_high",)  # it reads ε_high only (no ε_low, no τ±)
  got, _ = jg.finalize_terms(jg.objective_terms(config, logp, old, adv, mask))
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  term = jg.policy_surrogate(logp, old, adv, mask, loss=TOY, clip_eps_high=0.1)
  np.testing.assert_allclose(float(jnp.sum(term.loss) / mask.sum()), want, rtol=1e-5)


@pytest.mark.slow
def test_a_toy_surrogate_trains_through_the_train_step(toy):
  """One update of the tiny model under ``preset("grpo", loss=TOY)``: the step's loss is NumPy's from the
  model's own log-probs and the batch's old ones, its clip fraction the capped tokens'."""
  batch = make_batch()._replace(ref_logp=None)
  own = numpy_log_probs(tiny_model(layers=1), batch)
  rng = np.random.default_rng(3)
  old = np.where(batch.mask, own + 0.3 * rng.standard_normal(own.shape), 0.0).astype(np.float32)
  batch = batch._replace(old_logp=old)
  adv = numpy_group_advantages(batch.rewards, batch.group_ids)
  want, _, want_capped = numpy_truncated_pg(own, old, adv, batch.mask, 0.05)
  assert 0 < want_capped < 0.9

  config = jg.preset("grpo", loss=TOY, clip_eps_high=0.05)
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(0.1)
  graphdef, state, shardings = train.init_train_state(tiny_model(layers=1), opt, mesh)
  tc = train.TrainConfig(group_size=G, chunk_size=5)
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
  state, metrics = step(state, batch)
  np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["clip_frac_high"]), want_capped, rtol=1e-5)
  assert float(metrics["grad_norm"]) > 0


def test_a_sequence_level_toy_surrogate_gets_the_sequence_rules():
  """``sequence_level=True`` is all it takes for the config's and the loss's refusals of per-token weights and
  advantages (they read the registry, not a list of names)."""

  def mean_ratio(logp, old_logp, adv, real, *, clip_eps_low, clip_eps_high):
    s = jnp.clip(jnp.sum(jnp.where(real, jnp.exp(logp - old_logp), 0.0), 1) / jnp.maximum(jnp.sum(real, 1), 1), 0, 9)
    per = -jnp.minimum(s * adv, jnp.clip(s, 1 - clip_eps_low, 1 + clip_eps_high) * adv)
    none = jnp.zeros_like(real)
    return surrogates.Surrogate(jnp.where(real, per[:, None], 0.0), none, none, none)

  surrogates.register_surrogate(
    "toy_sequence", mean_ratio, numbers=("clip_eps_low", "clip_eps_high"), sequence_level=True
  )
  try:
    with pytest.raises(ValueError, match="loss='toy_sequence' is a sequence-level loss"):
      jg.preset("lambda_grpo", loss="toy_sequence")
    with pytest.raises(ValueError, match="loss='toy_sequence' takes one advantage per sequence"):
      jg.preset("frpo", loss="toy_sequence")
    logp, old, adv, mask = _inputs()
    with pytest.raises(ValueError, match="takes one advantage per sequence"):
      jg.policy_loss(logp, old, np.ones(logp.shape, np.float32), mask, jg.GRPOHyper(loss="toy_sequence"))
    loss, _ = jg.policy_loss(logp, old, adv, mask, jg.GRPOHyper(loss="toy_sequence", aggregation="seq-mean-token-mean"))
    ratio = np.where(mask, np.exp(logp.astype(np.float64) - old), 0.0).sum(1) / mask.sum(1)
    want = -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv).mean()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  finally:
    del surrogates.REGISTRY["toy_sequence"]


def test_registering_refuses_a_taken_name_an_unknown_number_and_a_non_function(toy):
  with pytest.raises(ValueError, match=f"surrogate '{TOY}' is already registered"):
    surrogates.register_surrogate(TOY, truncated_pg, numbers=("clip_eps_high",))
  with pytest.raises(ValueError, match=r"`numbers` must be a tuple of some of \['clip_eps_low', 'clip_eps_high'"):
    surrogates.register_surrogate("toy_other", truncated_pg, numbers=("temperature",))
  with pytest.raises(TypeError, match="`fn` must be callable"):
    surrogates.register_surrogate("toy_other", "truncated_pg")
  with pytest.raises(ValueError, match=r"`loss` must be one of .*'toy_truncated_pg'"):
    jg.GRPOConfig(loss="toy_typo")
  assert "toy_other" not in surrogates.REGISTRY
  with pytest.raises(TypeError, match=r"policy_surrogate: unknown keyword\(s\) \['clip_eps'\]"):
    jg.policy_surrogate(*_inputs(), loss=TOY, clip_eps=0.1)


# ----------------------------------------------------------------------------- the numbers, declared once


def test_every_number_is_one_declaration_of_default_type_and_range():
  """The config's fields, the hyper carrier's fields and their defaults are the table's."""
  config_fields = {f.name: f for f in dataclasses.fields(jg.GRPOConfig)}
  hyper_fields = {f.name: f for f in dataclasses.fields(jg.GRPOHyper)}
  for name, number in numbers.NUMBERS.items():
    assert config_fields[name].default == number.default, name
    assert (name in hyper_fields) == (number.carrier != "config"), name
    if name in hyper_fields:
      assert hyper_fields[name].default == number.default, name
  assert jg.GRPOHyper._fields == numbers.names(carrier="traced")
  assert SWITCHED_TERMS == ("beta", "entropy_coef")


@pytest.mark.parametrize(
  "name, bad, bound",
  [
    ("beta", -0.5, ">= 0.0"),
    ("clip_eps_high", -0.1, ">= 0.0"),
    ("dual_clip", 1.0, "> 1.0"),
    ("tau_neg", 0.0, "> 0.0"),
    ("importance_cap", -2.0, "> 0.0"),
    ("max_tokens", 0, ">= 1"),
  ],
)
def test_a_number_out_of_range_reads_the_same_wherever_it_is_given(name, bad, bound):
  """One message per number (its name, range and hint) from the config, the hyper carrier, the config's check
  of a hyper and, for a surrogate's number, the surrogate's keyword."""
  hint = numbers.NUMBERS[name].hint
  msg = f"`{name}` must be {bound} ({hint}); got {bad}"
  with pytest.raises(ValueError) as config_error:
    jg.GRPOConfig(**{name: bad})
  assert str(config_error.value) == msg
  with pytest.raises(ValueError) as hyper_error:
    jg.GRPOHyper(**{name: bad})
  assert str(hyper_error.value) == msg
  if name in jg.GRPOHyper._fields:
    config = jg.GRPOConfig(dual_clip=3.0) if name == "dual_clip" else jg.GRPOConfig()
    hyper = config.hyper()._replace(**{name: np.float32(bad)})
    with pytest.raises(ValueError, match="^" + re.escape(f"`hyper.{name}` must be {bound} ({hint}); got {bad}")):
      config.check_hyper(hyper)
  if name in surrogates.NUMBERS_READ:
    with pytest.raises(ValueError) as keyword_error:
      jg.policy_surrogate(*_inputs(), **{name: bad})
    assert str(keyword_error.value) == msg
