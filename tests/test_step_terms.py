"""The named pieces of the step (jaxgrpo.step.terms) called alone, against NumPy written from their docstrings."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import optax

from jaxgrpo.kernels.losses import LossTerms
from jaxgrpo.step import terms
from jaxgrpo.step.state import TrainConfig


def _spec(max_grad_norm):
  return types.SimpleNamespace(tc=TrainConfig(max_grad_norm=max_grad_norm), optimizer=optax.sgd(0.5))


def test_token_scale_is_the_power_of_two_just_above_one_over_the_real_tokens():
  for n in (1, 3, 4, 5, 100):
    mask = np.zeros((2, 3, 64), bool)
    mask.reshape(-1)[:n] = True
    s = float(terms.token_scale({"loss_mask": jnp.asarray(mask)}))
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
    new, _, got_norm = terms.apply_update(_spec(max_norm), params, opt.init(params), grads, t, scale)
    clip = 1.0 if max_norm is None or norm <= max_norm else max_norm / norm
    for k in params:
      np.testing.assert_allclose(np.asarray(new[k]), np.asarray(params[k]) - 0.5 * clip * g[k], rtol=1e-6)
    np.testing.assert_allclose(float(got_norm), norm, rtol=1e-6)
