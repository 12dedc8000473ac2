"""Blockwise attention (``jaxgrpo.kernels.attention``) against a NumPy reference written from the softmax-attention
formula, values and gradients, and against ``jaxgrpo.models.attention.Attention`` (today's dense attention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo.kernels.attention import blockwise_attention, blockwise_attention_with_lse


def _visible(seg_q, seg_k, offset, causal):
  """bool[B, S, T]: query i sees key j iff seg_q[i] == seg_k[j] > 0 and (causal) j <= i + offset."""
  seg_q, seg_k = np.asarray(seg_q), np.asarray(seg_k)
  ok = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_k[:, None, :] > 0)
  if causal:
    S, T = seg_q.shape[1], seg_k.shape[1]
    off = np.broadcast_to(np.asarray(offset), (seg_q.shape[0],))
    ok &= np.arange(T)[None, None, :] <= np.arange(S)[None, :, None] + off[:, None, None]
  return ok


def _reference(q, k, v, d_out, seg_q, seg_k, offset=0, causal=True):
  """Float64 NumPy: out = softmax(q·kᵀ/√K over the visible keys)·v (zeros on rows that see nothing), and the
  gradients of Σ d_out ∘ out: dv = Pᵀ·dO, dP = dO·vᵀ, dS = P ∘ (dP − Σ_j P·dP), dq = dS·k/√K, dk = dSᵀ·q/√K,
  summed over the query heads sharing a key/value head."""
  q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
  B, S, H, K = q.shape
  N = k.shape[2]
  G = H // N
  kh, vh = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # [B, T, H, K]: head h reads kv head h // G
  s = np.einsum("bshk,bthk->bhst", q, kh) / np.sqrt(K)
  ok = _visible(seg_q, seg_k, offset, causal)[:, None]
  s = np.where(ok, s, -np.inf)
  m = np.max(s, axis=-1, keepdims=True)
  e = np.where(ok, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
  z = e.sum(-1, keepdims=True)
  p = e / np.where(z > 0, z, 1.0)
  out = np.einsum("bhst,bthk->bshk", p, vh)
  dv = np.einsum("bhst,bshk->bthk", p, d_out)
  dp = np.einsum("bshk,bthk->bhst", d_out, vh)
  ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
  dq = np.einsum("bhst,bthk->bshk", ds, kh) / np.sqrt(K)
  dk = np.einsum("bhst,bshk->bthk", ds, q) / np.sqrt(K)
  group = lambda x: x.reshape(B, x.shape[1], N, G, K).sum(3)
  return out, dq, group(dk), group(dv)


def _inputs(B, S, T, H, N, K, seed=0, logit_scale=1.0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, S, H, K)).astype(np.float32) * logit_scale
  k = rng.normal(size=(B, T, N, K)).astype(np.float32)
  v = rng.normal(size=(B, T, N, K)).astype(np.float32)
  d_out = rng.normal(size=(B, S, H, K)).astype(np.float32)
  return q, k, v, d_out


def _check(q, k, v, d_out, seg_q, seg_k, *, offset=0, causal=True, tol=1e-5, **blocks):
  def f(q, k, v):
    o = blockwise_attention(
      q, k, v, q_segment_ids=seg_q, kv_segment_ids=seg_k, q_offset=offset, causal=causal, **blocks
    )
    return jnp.sum(o * d_out), o

  (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  want = _reference(q, k, v, d_out, seg_q, seg_k, offset, causal)
  for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
    assert np.all(np.isfinite(np.asarray(got))), name
    np.testing.assert_allclose(np.asarray(got), ref, rtol=tol, atol=tol, err_msg=name)


def _left_padded(lengths, L):
  return np.array([[0] * (L - n) + [1] * n for n in lengths], np.int32)


@pytest.mark.parametrize("block_q,block_kv", [(8, 8), (16, 8), (8, 16), (64, 64), (5, 7)])
def test_ragged_left_padded_rows_equal_the_formula(block_q, block_kv):
  """Rows of different lengths, left-padded (the prompt layout), lengths not multiples of the blocks."""
  q, k, v, d_out = _inputs(3, 37, 37, 4, 4, 8)
  seg = _left_padded([37, 20, 1], 37)
  _check(q, k, v, d_out, seg, seg, block_q=block_q, block_kv=block_kv)


def test_right_padded_ragged_rows_equal_the_formula():
  q, k, v, d_out = _inputs(2, 29, 29, 2, 2, 4, seed=1)
  seg = np.array([[1] * n + [0] * (29 - n) for n in (29, 11)], np.int32)
  _check(q, k, v, d_out, seg, seg, block_q=8, block_kv=8)


def test_packed_segments_equal_the_formula():
  """``step/packing.py``'s layout: segments 1, 2, 3 side by side, then padding 0; no attention across them."""
  q, k, v, d_out = _inputs(2, 24, 24, 4, 2, 8, seed=2)
  seg = np.array([[1] * 7 + [2] * 9 + [3] * 5 + [0] * 3, [1] * 3 + [2] * 21], np.int32)
  _check(q, k, v, d_out, seg, seg, block_q=8, block_kv=8)


@pytest.mark.parametrize("H,N", [(8, 2), (4, 1), (6, 3)])
def test_grouped_kv_heads_equal_the_formula(H, N):
  """GQA and MQA: query head h reads kv head h // (H/N); dk, dv sum over the group."""
  q, k, v, d_out = _inputs(2, 19, 19, H, N, 8, seed=3)
  seg = _left_padded([19, 12], 19)
  _check(q, k, v, d_out, seg, seg, block_q=8, block_kv=4)


def test_long_rows_with_large_logits_need_the_running_max():
  """512 keys in 8 blocks whose logits grow along the row to ~150 (a shared direction ``u`` in q and k), so each
  key block raises the row's maximum: an online softmax that kept a stale maximum overflows exp (float32 ends at
  e^88.7), one that did not rescale by exp(m_old − m_new) is off."""
  B, S, H, K = 1, 512, 2, 16
  q, k, v, d_out = _inputs(B, S, S, H, H, K, seed=4)
  u = np.zeros(K, np.float32)
  u[0] = 1.0
  q = q + 10.0 * u
  k = k + (60.0 * np.arange(S, dtype=np.float32) / S)[None, :, None, None] * u
  s = np.einsum("bshk,bthk->bhst", q, k) / np.sqrt(K)
  assert np.max(s) > 140 and np.max(s[..., :64]) < 40  # the first key block's maximum is far below the row's
  seg = np.ones((B, S), np.int32)
  # float32 rounds a logit of 150 by ~1e-5, and dq, dk carry factors of |k|, |q| ~ 10–60: 1e-4 here
  _check(q, k, v, d_out, seg, seg, block_q=64, block_kv=64, tol=1e-4)


def test_fully_masked_rows_give_zeros_and_no_nan():
  """A padding query row (segment 0) sees no key: output 0, gradients 0 and finite, lse −inf."""
  q, k, v, d_out = _inputs(2, 12, 12, 2, 1, 4, seed=5)
  seg = _left_padded([12, 5], 12)
  seg[0, :] = 0  # a row that is all padding

  def f(q, k, v):
    o, lse = blockwise_attention_with_lse(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, block_q=4, block_kv=4)
    return jnp.sum(o * d_out), (o, lse)

  (_, (out, lse)), (dq, dk, dv) = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  for x in (out, dq, dk, dv):
    assert np.all(np.isfinite(np.asarray(x)))
  pad = seg == 0
  assert np.all(np.asarray(out)[pad] == 0) and np.all(np.asarray(dq)[pad] == 0)
  assert np.all(np.asarray(dk)[pad] == 0) and np.all(np.asarray(dv)[pad] == 0)
  assert np.all(np.isneginf(np.asarray(lse)[pad])) and np.all(np.isfinite(np.asarray(lse)[~pad]))
  _check(q, k, v, d_out, seg, seg, block_q=4, block_kv=4)


def test_prefill_offset_and_non_causal_equal_the_formula():
  """Queries at key slots offset..offset+S (a prefill into a cache of T slots, per-row offsets), and no causal
  mask at all."""
  q, k, v, d_out = _inputs(2, 6, 20, 4, 2, 8, seed=6)
  seg_q = np.ones((2, 6), np.int32)
  seg_k = np.array([[1] * 20, [0] * 4 + [1] * 16], np.int32)
  _check(q, k, v, d_out, seg_q, seg_k, offset=np.array([14, 9], np.int32), block_q=4, block_kv=8)
  _check(q, k, v, d_out, seg_q, seg_k, causal=False, block_q=4, block_kv=8)


def test_lse_and_its_gradient_equal_the_formula():
  """The log-sum-exp output (what ring attention merges with) and the gradient it carries: d lse / d s = p."""
  q, k, v, _ = _inputs(1, 10, 10, 2, 2, 4, seed=7)
  seg = np.ones((1, 10), np.int32)
  w = np.random.default_rng(8).normal(size=(1, 10, 2)).astype(np.float32)

  def f(q, k):
    return jnp.sum(blockwise_attention_with_lse(q, k, v, block_q=4, block_kv=4)[1] * w)

  s = np.einsum("bshk,bthk->bhst", q.astype(np.float64), k) / 2.0
  s = np.where(_visible(seg, seg, 0, True)[:, None], s, -np.inf)
  lse = np.log(np.sum(np.exp(s), -1))  # [B, H, S]
  p = np.exp(s - lse[..., None])
  ds = p * np.transpose(w, (0, 2, 1))[..., None]
  dq, dk = jax.grad(f, argnums=(0, 1))(q, k)
  np.testing.assert_allclose(f(q, k), np.sum(np.transpose(lse, (0, 2, 1)) * w), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(dq), np.einsum("bhst,bthk->bshk", ds, k) / 2.0, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(dk), np.einsum("bhst,bshk->bthk", ds, q) / 2.0, rtol=1e-5, atol=1e-6)


def test_bad_shapes_get_one_clear_line():
  q = jnp.zeros((1, 4, 3, 8))
  with pytest.raises(ValueError, match="N must divide H"):
    blockwise_attention(q, jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)))
  with pytest.raises(ValueError, match="`q_segment_ids` must have shape"):
    blockwise_attention(q, jnp.zeros((1, 4, 1, 8)), jnp.zeros((1, 4, 1, 8)), q_segment_ids=jnp.ones((1, 5), int))
  with pytest.raises(ValueError, match="`block_q` must be >= 1"):
    blockwise_attention(q, jnp.zeros((1, 4, 1, 8)), jnp.zeros((1, 4, 1, 8)), block_q=0)


def _layers_attention(H, N, K, D, seed):
  from flax import nnx

  from jaxgrpo.models.attention import Attention

  return Attention(
    hidden_size=D,
    num_heads=H,
    num_kv_heads=N,
    head_dim=K,
    qkv_bias=False,
    o_bias=False,
    qk_norm_eps=None,
    inv_freq=None,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs=nnx.Rngs(seed),
  )


@pytest.mark.parametrize("H,N", [(4, 4), (4, 2)])
def test_equals_the_layers_attention_on_the_real_rows(H, N):
  """The same projections around blockwise attention equal ``attention.Attention`` (its dense einsum and softmax),
  values and input gradients, on packed and left-padded rows. Padding query rows are excluded: the dense path
  gives them a uniform average (scores all −1e30), blockwise gives zeros; the loss masks them either way."""
  B, S, D, K = 2, 21, 16, 8
  attn = _layers_attention(H, N, K, D, seed=0)
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
  seg = jnp.asarray(np.array([[0] * 4 + [1] * 17, [1] * 6 + [2] * 10 + [0] * 5]), jnp.int32)
  positions = jnp.zeros((B, S), jnp.int32)  # unused without RoPE
  real = (np.asarray(seg) > 0)[..., None]
  w = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32) * real

  def dense(x):
    return attn(x, positions, seg, None, None, None)[0]

  def blockwise(x):
    q = jnp.einsum("bsd,dhk->bshk", x, attn.q[...])
    k = jnp.einsum("bsd,dnk->bsnk", x, attn.k[...])
    v = jnp.einsum("bsd,dnk->bsnk", x, attn.v[...])
    o = blockwise_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, block_q=8, block_kv=4)
    return jnp.einsum("bshk,hkd->bsd", o, attn.o[...])

  y_dense, y_block = dense(x), blockwise(x)
  np.testing.assert_allclose(np.asarray(y_block) * real, np.asarray(y_dense) * real, rtol=1e-5, atol=1e-5)
  g_dense = jax.grad(lambda x: jnp.sum(dense(x) * w))(x)
  g_block = jax.grad(lambda x: jnp.sum(blockwise(x) * w))(x)
  np.testing.assert_allclose(np.asarray(g_block), np.asarray(g_dense), rtol=1e-5, atol=1e-5)
