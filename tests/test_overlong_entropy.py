"""DAPO's soft overlong penalty against its formula, and the entropy the log-prob kernel returns with
its gradient (for the entropy bonus) against autodiff of the entropy of the full logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import make_batch, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxgrpo.models.log_probs import completion_log_probs
from jaxgrpo.rewards.reward_set import overlong_penalty


def _dapo_eq13(length, l_max, l_cache):
  """DAPO (arXiv:2503.14476) eq. 13, one completion at a time."""
  if length <= l_max - l_cache:
    return 0.0
  if length <= l_max:
    return ((l_max - l_cache) - length) / l_cache
  return -1.0


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 64), st.data())
def test_overlong_penalty_is_dapos_formula(l_max, data):
  l_cache = data.draw(st.integers(0, l_max))
  lengths = data.draw(st.lists(st.integers(0, 2 * l_max), min_size=0, max_size=20))
  factor = data.draw(st.sampled_from([1.0, 0.5]))
  got = overlong_penalty(np.asarray(lengths, np.int64), l_max, l_cache, penalty_factor=factor)
  want = [factor * _dapo_eq13(n, l_max, l_cache) for n in lengths]
  assert got.dtype == np.float32 and got.shape == (len(lengths),)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert np.all(got <= 0) and np.all(got >= -factor)


def test_overlong_penalty_hand_computed_and_bad_inputs():
  np.testing.assert_allclose(overlong_penalty([80, 90, 100, 101], 100, 20), [0.0, -0.5, -1.0, -1.0])
  with pytest.raises(ValueError, match="cache_length"):
    overlong_penalty([1], 10, 11)
  with pytest.raises(TypeError, match="integer"):
    overlong_penalty([1.5], 10, 2)
  with pytest.raises(ValueError, match="lengths"):
    overlong_penalty([[1]], 10, 2)
  with pytest.raises(TypeError, match="max_length"):
    overlong_penalty([1], 10.0, 2)


def test_entropy_with_gradient_equals_autodiff_of_the_full_logits():
  """Unchunked and in chunks of 5 (12 positions: a padded last chunk), against autodiff of the entropy
  of the full logits; without ``entropy_grad`` the entropy has no gradient. One jitted program for all
  of it (eager, the two backward passes dispatched ~10^4 ops one by one: 105 s on a loaded CPU)."""
  model = tiny_model()
  batch = make_batch()
  graphdef, params = nnx.split(model)
  pt, pm, comp, mask = (jnp.asarray(x) for x in batch[:4])
  p = pt.shape[1]
  w = jnp.asarray(np.random.default_rng(0).normal(size=mask.shape), jnp.float32)  # a random cotangent

  def ours(params, chunk_size):
    _, ent = completion_log_probs(
      nnx.merge(graphdef, params), pt, pm, comp, mask, chunk_size=chunk_size, with_entropy=True, entropy_grad=True
    )
    return jnp.sum(ent * w), ent

  def direct(params):
    m = nnx.merge(graphdef, params)
    tokens, attn = jnp.concatenate([pt, comp], 1), jnp.concatenate([pm, mask], 1)
    hidden, _ = m(tokens, jnp.maximum(jnp.cumsum(attn, 1) - 1, 0), attention_mask=attn)
    logq = jax.nn.log_softmax(m.logits(hidden[:, p - 1 : -1], out_dtype=jnp.float32), -1)
    ent = jnp.where(mask, -jnp.sum(jnp.exp(logq) * logq, -1), 0.0)
    return jnp.sum(ent * w), ent

  def metric_only(params):  # without entropy_grad the entropy is a metric: no gradient
    return jnp.sum(completion_log_probs(nnx.merge(graphdef, params), pt, pm, comp, mask, with_entropy=True)[1] * w)

  @jax.jit
  def run(params):
    got = [(c, jax.value_and_grad(ours, has_aux=True)(params, c)) for c in (None, 5)]
    return got, jax.value_and_grad(direct, has_aux=True)(params), jax.grad(metric_only)(params)

  got, ((_, e2), g2), g0 = run(params)
  flat2 = jax.tree.leaves(g2)
  scale = max(float(jnp.max(jnp.abs(x))) for x in flat2)
  assert scale > 0
  for chunk_size, ((_, e1), g1) in got:
    np.testing.assert_allclose(e1, e2, rtol=1e-5, atol=1e-6, err_msg=f"chunk_size={chunk_size}")
    for a, b in zip(jax.tree.leaves(g1), flat2):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale, err_msg=f"chunk_size={chunk_size}")
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(g0))
