"""Parity of the model ports with transformers' PyTorch models, KV cache, log_probs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_utils import FAMILIES, hf_logits, left_padded_batch, make_tiny_hf

from jaxgrpo import models
from jaxgrpo.models import hf as hf_io

pytest.importorskip("torch")
pytest.importorskip("transformers")

FP32_TOL = 1e-4


pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")  # tests/conftest.py


def _jitted(fn, model, *args):
  """``fn(model, *args)`` as one jitted program over the model's state: one compile instead of one per
  eager op (each distinct op and shape of an eager forward compiles on its first call)."""
  graphdef, state = nnx.split(model)
  return jax.jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args))(state, *args)


def _logits(model, tokens, mask):
  hidden, cache = model(tokens, models.positions_from_mask(mask), attention_mask=mask)
  assert cache is None
  return model.logits(hidden)


def _forward_logits(model, tokens, mask):
  return np.asarray(_jitted(_logits, model, jnp.asarray(tokens), jnp.asarray(mask)), np.float32)


_TINY = {}


@pytest.fixture(scope="module")
def tiny_factory(tmp_path_factory):
  """(family, tied) → (family, tied, directory, hf_model, our model loaded with load_hf); cached."""

  def get(family, tied):
    if (family, tied) not in _TINY:
      directory, hf_model = make_tiny_hf(tmp_path_factory.mktemp(f"{family}{tied}"), family, tied=tied)
      _TINY[family, tied] = (family, tied, directory, hf_model, hf_io.load_hf(directory))
    return _TINY[family, tied]

  return get


ALL = [pytest.param((f, t), id=f"{f}-{'tied' if t else 'untied'}") for f in FAMILIES for t in (False, True)]


@pytest.fixture(params=ALL)
def tiny(request, tiny_factory):
  return tiny_factory(*request.param)


@pytest.fixture(params=FAMILIES)
def tiny_untied(request, tiny_factory):
  return tiny_factory(request.param, False)


def test_logits_match_transformers(tiny):
  family, tied, _, hf_model, model = tiny
  rng = np.random.default_rng(0)
  tokens, mask = left_padded_batch(rng, 3, 12, model.config.vocab_size, pads=[0, 3, 7])
  ref = hf_logits(hf_model, tokens, mask)
  ours = _forward_logits(model, tokens, mask)
  err = np.abs(ours - ref)[mask].max()
  assert err < FP32_TOL, f"{family} tied={tied}: max |Δlogits| = {err}"
  assert (model.lm_head is None) == tied


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])  # learned positions; RoPE + GQA + qk-norm
def test_kv_cache_decoding_matches_full_forward(tiny_factory, family):
  _, _, _, _, model = tiny_factory(family, False)
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
    h, cache = step(graphdef, state, tokens[:, t : t + 1], positions[:, t : t + 1], mask[:, t : t + 1], cache)
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
  prefill = jax.jit(lambda m, t, p, c: m(t, p, cache=c)[1])
  cache = prefill(model, tokens, pos, model.init_cache(2, 8))
  rep = models.repeat_cache(cache, 3)
  cache6 = prefill(model, jnp.repeat(tokens, 3, axis=0), jnp.repeat(pos, 3, axis=0), model.init_cache(6, 8))
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


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_log_probs_equals_log_softmax_of_hf_logits(tiny_factory, family):
  _, _, _, hf_model, model = tiny_factory(family, False)
  rng = np.random.default_rng(2)
  tokens, mask = left_padded_batch(rng, 3, 13, model.config.vocab_size, pads=[0, 4, 9])
  ref = _reference_log_probs(hf_logits(hf_model, tokens, mask), tokens, mask, 0.7)
  both = _jitted(  # 12 scored positions: one chunk, or 3 chunks with padding
    lambda m, t, k: [(c, models.log_probs(m, t, k, temperature=0.7, chunk_size=c)) for c in (None, 5)],
    model,
    jnp.asarray(tokens),
    jnp.asarray(mask),
  )
  for chunk_size, got in both:
    assert got.dtype == jnp.float32 and got.shape == tokens.shape
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4, err_msg=f"chunk_size={chunk_size}")


# bf16 parameters and compute vs the fp32 HF reference (tiny models, |logits| ~ 1). Measured max
# errors over the four families: |Δlogit| <= 0.012 (about 1.2% of max|logit|), |Δlog-prob| <= 0.006.
BF16_LOGIT_RTOL = 0.03  # |Δlogit| <= BF16_LOGIT_RTOL * max|logit|
BF16_LOGPROB_ATOL = 0.02  # nats


def test_bf16_stays_within_documented_tolerance(tiny_untied):
  family, _, directory, hf_model, _ = tiny_untied
  model = models.load_hf(directory, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  tokens, mask = left_padded_batch(np.random.default_rng(3), 3, 12, model.config.vocab_size, pads=[0, 2, 6])
  ref = hf_logits(hf_model, tokens, mask)

  def forward(model, tokens, mask):
    hidden, _ = model(tokens, models.positions_from_mask(mask), attention_mask=mask)
    return hidden, model.logits(hidden), models.log_probs(model, tokens, mask, chunk_size=4)

  hidden, logits, lp = _jitted(forward, model, jnp.asarray(tokens), jnp.asarray(mask))
  assert hidden.dtype == jnp.bfloat16
  err = np.abs(np.asarray(logits, np.float32) - ref)[mask].max()
  assert err <= BF16_LOGIT_RTOL * np.abs(ref[mask]).max(), (family, err)
  assert lp.dtype == jnp.float32
  lp_err = np.abs(np.asarray(lp) - _reference_log_probs(ref, tokens, mask, 1.0)).max()
  assert lp_err <= BF16_LOGPROB_ATOL, (family, lp_err)


def test_log_probs_gradient_is_finite_with_padding_and_remat_equal():
  cfg = models.Qwen3Config(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64
  )
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)), jnp.int32)
  mask = jnp.arange(9)[None, :] >= jnp.asarray([[0], [6]])
  grads = {}
  for remat in (False, True):
    graphdef, state = nnx.split(models.build_model(cfg, rngs=nnx.Rngs(0), remat=remat))

    def loss(st, graphdef=graphdef):
      return models.log_probs(nnx.merge(graphdef, st), tokens, mask, chunk_size=4).sum()

    grads[remat] = jax.jit(jax.grad(loss))(state)
  leaves = jax.tree.leaves(grads[False])
  assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
  assert any(np.abs(np.asarray(g)).max() > 0 for g in leaves)
  for a, b in zip(leaves, jax.tree.leaves(grads[True])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_params_carry_logical_axes(tiny):
  _, _, _, _, model = tiny
  _, state = nnx.split(model)
  for path, var in nnx.to_flat_state(state):
    assert isinstance(var, nnx.Param), path
    axes = var.get_metadata("out_sharding")
    assert len(axes) == var.ndim, (path, axes)
    assert all(a is None or a in models.LOGICAL_AXES for a in axes), (path, axes)


def test_log_probs_chunking_bounds_compiled_memory():
  """The compiled temporaries shrink with chunking: no fp32 [B, T, V] buffer exists."""
  cfg = models.Qwen3Config(
    vocab_size=8192,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate_size=64,
    tie_word_embeddings=True,
  )
  graphdef, state = nnx.split(nnx.eval_shape(lambda: models.build_model(cfg, rngs=nnx.Rngs(0))))
  tokens = jax.ShapeDtypeStruct((4, 256), jnp.int32)
  mask = jax.ShapeDtypeStruct((4, 256), jnp.bool_)

  def temp_bytes(chunk):
    f = lambda st, t, m: models.log_probs(nnx.merge(graphdef, st), t, m, chunk_size=chunk)
    analysis = jax.jit(f).lower(state, tokens, mask).compile().memory_analysis()
    if analysis is None:
      pytest.skip("memory_analysis unavailable on this backend")
    return analysis.temp_size_in_bytes

  full_logits = 4 * 255 * 8192 * 4  # T-1 scored positions
  unchunked, chunked = temp_bytes(None), temp_bytes(32)
  assert unchunked >= full_logits
  assert chunked < full_logits / 4, (chunked, full_logits)
