"""Parity of the model ports with transformers' PyTorch models, KV cache, log_probs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgrpo import models
from jaxgrpo.models import hf as hf_io
from tests.hf_utils import FAMILIES, hf_logits, left_padded_batch, make_tiny_hf

pytest.importorskip("torch")
pytest.importorskip("transformers")

FP32_TOL = 1e-4


def _forward_logits(model, tokens, mask):
  positions = models.positions_from_mask(jnp.asarray(mask))
  hidden, cache = model(jnp.asarray(tokens), positions, attention_mask=jnp.asarray(mask))
  assert cache is None
  return np.asarray(model.logits(hidden), np.float32)


@pytest.fixture(scope="module", params=[(f, t) for f in FAMILIES for t in (False, True)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def tiny(request, tmp_path_factory):
  family, tied = request.param
  directory, hf_model = make_tiny_hf(tmp_path_factory.mktemp(f"{family}{tied}"), family, tied=tied)
  model = hf_io.load_hf(directory)
  return family, tied, directory, hf_model, model


def test_logits_match_transformers(tiny):
  family, tied, _, hf_model, model = tiny
  rng = np.random.default_rng(0)
  tokens, mask = left_padded_batch(rng, 3, 12, model.config.vocab_size, pads=[0, 3, 7])
  ref = hf_logits(hf_model, tokens, mask)
  ours = _forward_logits(model, tokens, mask)
  err = np.abs(ours - ref)[mask].max()
  assert err < FP32_TOL, f"{family} tied={tied}: max |Δlogits| = {err}"
  assert (model.lm_head is None) == tied


def test_kv_cache_decoding_matches_full_forward(tiny):
  _, _, _, _, model = tiny
  rng = np.random.default_rng(1)
  prompt_len, total = 6, 11
  tokens, mask = left_padded_batch(rng, 3, total, model.config.vocab_size, pads=[0, 2, 5])
  full = _forward_logits(model, tokens, mask)

  cache = model.init_cache(3, 16)
  positions = np.asarray(models.positions_from_mask(jnp.asarray(mask)))
  step = jax.jit(lambda gd, st, t, p, m, c: _step(nnx.merge(gd, st), t, p, m, c))
  graphdef, state = nnx.split(model)
  h, cache = step(graphdef, state, tokens[:, :prompt_len], positions[:, :prompt_len], mask[:, :prompt_len], cache)
  got = [np.asarray(h)]
  for t in range(prompt_len, total):
    h, cache = step(graphdef, state, tokens[:, t:t + 1], positions[:, t:t + 1], mask[:, t:t + 1], cache)
    got.append(np.asarray(h))
  assert int(cache.index) == total
  got = np.concatenate(got, axis=1)
  err = np.abs(got - full)[mask].max()
  assert err < FP32_TOL, err


def _step(model, tokens, positions, mask, cache):
  hidden, cache = model(tokens, positions, attention_mask=mask, cache=cache)
  return model.logits(hidden), cache


def test_repeat_cache_matches_per_row_prefill():
  cfg = models.GPT2Config(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=32)
  model = models.build_model(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 5)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  _, cache = model(tokens, pos, cache=model.init_cache(2, 8))
  rep = models.repeat_cache(cache, 3)
  _, cache6 = model(jnp.repeat(tokens, 3, axis=0), jnp.repeat(pos, 3, axis=0), cache=model.init_cache(6, 8))
  for a, b in zip(jax.tree.leaves(rep), jax.tree.leaves(cache6)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def _reference_log_probs(logits: np.ndarray, tokens: np.ndarray, mask: np.ndarray, temperature: float):
  """NumPy log-softmax of float64 logits gathered at the next token."""
  z = logits.astype(np.float64) / temperature
  z = z - z.max(-1, keepdims=True)
  lsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
  out = np.zeros(tokens.shape)
  picked = np.take_along_axis(lsm[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
  out[:, 1:] = np.where(mask[:, 1:] & mask[:, :-1], picked, 0.0)
  return out


@pytest.mark.parametrize("chunk_size", [None, 4, 5])
def test_log_probs_equals_log_softmax_of_hf_logits(tiny, chunk_size):
  family, tied, _, hf_model, model = tiny
  if tied or family not in ("gpt2", "qwen3"):
    pytest.skip("covered by the logits parity test; keep the suite fast")
  rng = np.random.default_rng(2)
  tokens, mask = left_padded_batch(rng, 3, 13, model.config.vocab_size, pads=[0, 4, 9])
  ref = _reference_log_probs(hf_logits(hf_model, tokens, mask), tokens, mask, 0.7)
  got = models.log_probs(model, jnp.asarray(tokens), jnp.asarray(mask), temperature=0.7, chunk_size=chunk_size)
  assert got.dtype == jnp.float32 and got.shape == tokens.shape
  np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4)


def test_log_probs_gradient_is_finite_with_padding():
  cfg = models.Qwen3Config(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                           head_dim=8, intermediate_size=64)
  model = models.build_model(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)), jnp.int32)
  mask = jnp.arange(9)[None, :] >= jnp.asarray([[0], [6]])
  graphdef, state = nnx.split(model)

  def loss(st):
    return models.log_probs(nnx.merge(graphdef, st), tokens, mask, chunk_size=4).sum()

  grads = jax.grad(loss)(state)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_params_carry_logical_axes(tiny):
  _, _, _, _, model = tiny
  _, state = nnx.split(model)
  for path, var in nnx.to_flat_state(state):
    assert isinstance(var, nnx.Param), path
    axes = var.get_metadata("out_sharding")
    assert len(axes) == var.ndim, (path, axes)
    assert all(a is None or a in models.LOGICAL_AXES for a in axes), (path, axes)
