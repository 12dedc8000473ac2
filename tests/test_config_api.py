import dataclasses
import inspect

import pytest

import jaxgrpo as jg

NEW_PRESETS = ("gspo", "gspo_token", "cispo", "sapo", "gmpo")


def test_presets_name_the_paper_settings():
  assert jg.preset("grpo").process_weights is False and jg.preset("grpo").beta == 0.0
  lam = jg.preset("lambda_grpo")
  assert lam.process_weights and lam.aggregation == "token-mean"
  frpo = jg.preset("frpo")
  assert (frpo.beta, frpo.kl_placement, frpo.kl_estimator) == (0.01, "future", "k1")
  assert frpo.needs_reference and not jg.preset("grpo").needs_reference
  lf = jg.preset("lambda_frpo")
  assert lf.process_weights and lf.kl_placement == "future"
  dr = jg.preset("dr_grpo")
  assert dr.advantage_scale == "none" and dr.aggregation == "seq-mean-token-sum-norm"
  dapo = jg.preset("dapo")
  assert (dapo.clip_eps_low, dapo.clip_eps_high, dapo.dynamic_sampling) == (0.2, 0.28, True)
  assert jg.preset("grpo", beta=0.04).beta == 0.04
  assert set(jg.PRESETS) == {"grpo", "dr_grpo", "dapo", "lambda_grpo", "frpo", "lambda_frpo"} | set(NEW_PRESETS)


def test_config_is_frozen_and_keyword_only():
  cfg = jg.preset("grpo")
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.beta = 1.0
  with pytest.raises(TypeError):
    jg.GRPOConfig("grpo")
  assert cfg.replace(beta=0.1).beta == 0.1


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(beta=-1.0), "beta"),
    (dict(aggregation="sum"), "aggregation"),
    (dict(kl_estimator="k2", kl_placement="future"), "kl_estimator"),
    (dict(kl_placement="reward"), "kl_placement"),
    (dict(advantage_scale="std"), "advantage_scale"),
    (dict(num_iterations=0), "num_iterations"),
    (dict(dual_clip=1.0), "dual_clip"),
  ],
)
def test_config_validation(kw, match):
  with pytest.raises(ValueError, match=match):
    jg.GRPOConfig(**kw)


def test_unknown_preset():
  with pytest.raises(ValueError, match="preset name"):
    jg.preset("ppo")


def test_objective_needs_reference_when_it_should():
  import jax.numpy as jnp

  cfg = jg.preset("frpo")
  z = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match="ref_logp"):
    jg.rollout_advantages(
      cfg, jnp.zeros(2), jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3), bool), jnp.zeros(2, jnp.int32), 1
    )
  with pytest.raises(ValueError, match="ref_logp"):
    jg.objective_terms(jg.preset("grpo", beta=0.04), z, z, jnp.zeros(2), jnp.ones((2, 3), bool))


def test_every_public_name_is_exported_and_documented():
  assert isinstance(jg.__version__, str)
  for name in jg.__all__:
    assert hasattr(jg, name), name
    obj = getattr(jg, name)
    if callable(obj) and not isinstance(obj, dict):
      doc = inspect.getdoc(obj)
      assert doc and len(doc) > 40, f"{name} lacks a docstring"
