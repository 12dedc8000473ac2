"""Blockwise causal attention with an online softmax: memory linear in the sequence length.

The FlashAttention-2 algorithm (Dao, 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", Algorithms 1 and 2) written in plain JAX, so that it runs on every backend. The scores
``s = q·kᵀ·scale`` of one query block against one key block exist at a time, never the ``[B, N, G, S, T]`` matrix.

Axis vocabulary (as in ``jaxgrpo.models.layers``): B batch, S query rows, T key rows, H query heads, N key/value
heads, G = H/N query heads per key/value head, K head dim.

Forward, for each query block (rows ``i``) and, in order, each key block it can see (columns ``j``), with a running
maximum ``m``, a running sum ``ℓ`` and an accumulator ``acc``, all float32::

    s_ij  = q_i·k_jᵀ·scale, masked entries −∞
    m'    = max(m, rowmax(s_ij));  p_ij = exp(s_ij − m')
    ℓ     = ℓ·exp(m − m') + rowsum(p_ij);  acc = acc·exp(m − m') + p_ij·v_j;  m = m'
    out_i = acc / ℓ,  lse_i = m + log ℓ

Backward (``jax.custom_vjp``): only ``out`` and ``lse`` are kept; each block's probabilities are recomputed,
``p_ij = exp(s_ij − lse_i)``, and with ``Δ_i = rowsum(dout_i ∘ out_i)``::

    dv_j += p_ijᵀ·dout_i;  dp_ij = dout_i·v_jᵀ;  ds_ij = p_ij ∘ (dp_ij − Δ_i)
    dq_i += ds_ij·k_j·scale;  dk_j += ds_ijᵀ·q_i·scale

Mask: query row ``i`` sees key row ``j`` iff ``q_segment_ids[b, i] == kv_segment_ids[b, j] > 0`` and (causal)
``j <= i + q_offset[b]`` and, with ``kv_end`` (a prefix tree in pre-order, ``jaxgrpo.step.prefix_tree``),
``i + q_offset[b] < kv_end[b, j]``: key j is then seen by the query rows ``[j, kv_end[b, j])``, its subtree. Segment
id 0 is padding (a left-padded prompt is its 0/1 mask; packed rows carry
``jaxgrpo.step.packing``'s ids 1, 2, …). A query row that sees no key (padding) gives zeros, and zero gradients.
Grouped key/value heads (GQA, MQA) are contracted per group, never repeated. With ``causal``, key blocks entirely
after a query block's last row are skipped (the loops' bounds depend on ``max(q_offset)``).

The block sizes are arguments (the platform's defaults live in ``jaxgrpo.parallel.attention``); a block larger than
the sequence is clipped to it, and a sequence that is not a multiple of its block is padded (padding rows are
masked). The products take ``dot_dtype`` operands (default: the inputs' dtype) and accumulate in float32; the
probabilities are cast to that dtype for the products with ``v`` and ``dout``, as ``jax.nn.dot_product_attention``
does. JAX and NumPy only. No forward-mode derivative (``jax.jvp``: a ``custom_vjp`` has none).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo._checks import check_python_int, shape_of

__all__ = ["blockwise_attention", "blockwise_attention_with_lse"]

_F32 = jnp.float32


def blockwise_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  q_segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
  kv_end: jax.Array | None = None,
  q_offset: jax.Array | int = 0,
  causal: bool = True,
  scale: float | None = None,
  block_q: int = 128,
  block_kv: int = 128,
  dot_dtype=None,
) -> jax.Array:
  """``softmax(q·kᵀ·scale + mask)·v`` by blocks, differentiable in ``q``, ``k``, ``v`` (hand-written VJP).

  Args:
    q: ``[B, S, H, K]`` queries (any float dtype).
    k, v: ``[B, T, N, K]`` keys and values, ``H % N == 0`` (query head ``h`` reads key/value head ``h // (H/N)``).
    q_segment_ids: ``int[B, S]``, 0 = padding, ``k >= 1`` = the k-th packed sequence (default: all 1).
    kv_segment_ids: ``int[B, T]``, the same for the keys (default: all 1).
    kv_end: ``int[B, T]`` or None: key j is seen only by query rows ``i + q_offset < kv_end[b, j]`` (a tree
      mask: with the rows in pre-order, ``kv_end[j]`` = j + the size of j's subtree). None: no such bound.
    q_offset: int or ``int[B]`` or ``int[]``: the key slot of query row 0 (causal mask ``j <= i + q_offset``);
      0 for self-attention, the cache index for a prefill into a cache of ``T`` slots.
    causal: mask keys after the query (``j > i + q_offset``).
    scale: the score scale (default ``K**-0.5``).
    block_q, block_kv: rows of a query block and of a key block (each clipped to the sequence).
    dot_dtype: the operand dtype of the products (default: ``q``'s dtype); they accumulate in float32.

  Returns: ``[B, S, H, K]`` in ``q``'s dtype; zeros on query rows that see no key.
  """
  return blockwise_attention_with_lse(
    q,
    k,
    v,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    kv_end=kv_end,
    q_offset=q_offset,
    causal=causal,
    scale=scale,
    block_q=block_q,
    block_kv=block_kv,
    dot_dtype=dot_dtype,
  )[0]


def blockwise_attention_with_lse(
  q,
  k,
  v,
  *,
  q_segment_ids=None,
  kv_segment_ids=None,
  kv_end=None,
  q_offset=0,
  causal=True,
  scale=None,
  block_q=128,
  block_kv=128,
  dot_dtype=None,
) -> tuple[jax.Array, jax.Array]:
  """:func:`blockwise_attention` and the row log-sum-exp ``lse = log Σ_j exp(s_ij)`` (float32 ``[B, S, H]``,
  ``-inf`` on rows that see no key): what a merge of partial attentions needs (ring attention). Both outputs
  are differentiable (the cotangent of ``lse`` adds ``p_ij`` to ``ds_ij``)."""
  B, S, H, K, T, N = _check(q, k, v, q_segment_ids, kv_segment_ids)
  bq = min(check_python_int(block_q, "block_q", minimum=1), S)
  bk = min(check_python_int(block_kv, "block_kv", minimum=1), T)
  seg_q = jnp.ones((B, S), jnp.int32) if q_segment_ids is None else jnp.asarray(q_segment_ids, jnp.int32)
  seg_k = jnp.ones((B, T), jnp.int32) if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32)
  offset = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (B,))
  scale = float(K**-0.5 if scale is None else scale)
  dt = jnp.dtype(q.dtype if dot_dtype is None else dot_dtype)
  static = (bool(causal), scale, bq, bk, dt)  # hashable: the custom_vjp's static argument
  if kv_end is None:
    out, lse = _attention(static, q, k, v, seg_q, seg_k, offset)
  else:
    if shape_of(kv_end) != (B, T) or not jnp.issubdtype(jnp.asarray(kv_end).dtype, jnp.integer):
      raise ValueError(f"blockwise_attention: `kv_end` must be an int array of shape {(B, T)}; got {shape_of(kv_end)}")
    out, lse = _attention(static, q, k, v, seg_q, (seg_k, jnp.asarray(kv_end, jnp.int32)), offset)
  return out, lse


def _check(q, k, v, seg_q, seg_k):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if np.ndim(x) != 4:
      want = "[B, S, H, K]" if name == "q" else "[B, T, N, K]"
      raise ValueError(f"blockwise_attention: `{name}` must have rank 4 {want}; got shape {shape_of(x)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"blockwise_attention: `{name}` must be a float array; got dtype {x.dtype}")
  (B, S, H, K), (Bk, T, N, Kk) = q.shape, k.shape
  if v.shape != k.shape:
    raise ValueError(f"blockwise_attention: `v` must have `k`'s shape {k.shape} [B, T, N, K]; got {v.shape}")
  if (Bk, Kk) != (B, K) or H % N:
    raise ValueError(
      f"blockwise_attention: `k` [B, T, N, K] must share B and K with `q` [B, S, H, K] and N must divide H; "
      f"got q {q.shape}, k {k.shape}"
    )
  for name, ids, want in (("q_segment_ids", seg_q, (B, S)), ("kv_segment_ids", seg_k, (B, T))):
    if ids is not None and shape_of(ids) != want:
      raise ValueError(f"blockwise_attention: `{name}` must have shape {want}; got {shape_of(ids)}")
    if ids is not None and not jnp.issubdtype(jnp.asarray(ids).dtype, jnp.integer):
      raise TypeError(f"blockwise_attention: `{name}` must be an integer array (0 = padding); got {ids.dtype}")
  return B, S, H, K, T, N


def _pad_rows(x: jax.Array, rows: int, axis: int = 1) -> jax.Array:
  """``x`` padded with zeros along ``axis`` to ``rows`` (a multiple of the block)."""
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, rows - x.shape[axis])
  return jnp.pad(x, pad)


def _ceil(a: int, b: int) -> int:
  return -(-a // b)


def _block_mask(static, seg_q, seg_k, offset, q0, k0):
  """``bool[B, 1, 1, bq, bk]``: query rows ``q0 + [0, bq)`` see key rows ``k0 + [0, bk)``. ``seg_k`` is the keys'
  segment ids, or ``(segment ids, kv_end)`` for a tree mask (rows ``i + offset < kv_end[j]`` only)."""
  causal, _, bq, bk, _ = static
  seg_k, end = seg_k if isinstance(seg_k, tuple) else (seg_k, None)
  sq = jax.lax.dynamic_slice_in_dim(seg_q, q0, bq, axis=1)[:, :, None]
  sk = jax.lax.dynamic_slice_in_dim(seg_k, k0, bk, axis=1)[:, None, :]
  ok = (sq == sk) & (sk > 0)
  row = lambda: q0 + jnp.arange(bq)[None, :, None] + offset[:, None, None]  # the query rows' key slots
  if causal:
    ok = ok & (k0 + jnp.arange(bk)[None, None, :] <= row())
  if end is not None:
    ok = ok & (row() < jax.lax.dynamic_slice_in_dim(end, k0, bk, axis=1)[:, None, :])
  return ok[:, None, None]


def _scores(static, qb, kb):
  """``[B, N, G, bq, bk]`` float32 scores of a ``[B, bq, N, G, K]`` query block and a ``[B, bk, N, K]`` key block."""
  _, scale, _, _, dt = static
  s = jnp.einsum("bqngk,btnk->bngqt", qb.astype(dt), kb.astype(dt), preferred_element_type=_F32)
  return s * scale


def _kv_bounds(static, nq_rows, nk, offset):
  """The key-block range ``[0, hi(i))`` query block ``i`` can see, and the query-block range ``[lo(j), nq)`` that
  sees key block ``j`` (causal: key row ``j`` is seen from query row ``j - max(offset)`` on)."""
  causal, _, bq, bk, _ = static
  nq = nq_rows // bq
  if not causal:
    return (lambda i: nk), (lambda j: 0)
  top = jnp.max(offset)
  hi = lambda i: jnp.clip(((i + 1) * bq - 1 + top) // bk + 1, 0, nk)
  lo = lambda j: jnp.clip((j * bk - top) // bq, 0, nq)
  return hi, lo


def _padded(static, q, k, v, seg_q, seg_k):
  """The inputs padded to whole blocks: ``q [B, Sp, N, G, K]``, ``k, v [B, Tp, N, K]``, the segment ids (padding
  rows get 0: never seen), and the dims ``(B, S, H, K, T, N, G, Sp, Tp)``."""
  _, _, bq, bk, _ = static
  B, S, H, K = q.shape
  T, N = k.shape[1], k.shape[2]
  G = H // N
  Sp, Tp = _ceil(S, bq) * bq, _ceil(T, bk) * bk
  qp = _pad_rows(q, Sp).reshape(B, Sp, N, G, K)
  seg_k = tuple(_pad_rows(x, Tp) for x in seg_k) if isinstance(seg_k, tuple) else _pad_rows(seg_k, Tp)
  padded = (qp, _pad_rows(k, Tp), _pad_rows(v, Tp), _pad_rows(seg_q, Sp), seg_k)
  return padded, (B, S, H, K, T, N, G, Sp, Tp)


def _forward(static, q, k, v, seg_q, seg_k, offset):
  """Padded forward: ``out [B, S, H, K]`` (q's dtype) and ``lse [B, N, G, Sp]`` float32 (+inf on unseen rows,
  so that ``exp(s − lse) = 0`` there in the backward pass)."""
  _, _, bq, bk, dt = static
  (qp, kp, vp, sq, sk), (B, S, H, K, T, N, G, Sp, Tp) = _padded(static, q, k, v, seg_q, seg_k)
  hi, _ = _kv_bounds(static, Sp, Tp // bk, offset)

  def q_block(i, carry):
    out, lse = carry
    q0 = i * bq
    qb = jax.lax.dynamic_slice_in_dim(qp, q0, bq, axis=1)

    def kv_block(j, state):
      m, l, acc = state
      k0 = j * bk
      kb = jax.lax.dynamic_slice_in_dim(kp, k0, bk, axis=1)
      vb = jax.lax.dynamic_slice_in_dim(vp, k0, bk, axis=1)
      ok = _block_mask(static, sq, sk, offset, q0, k0)
      s = jnp.where(ok, _scores(static, qb, kb), -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row unseen so far: exp(−∞ − 0) = 0, no NaN
      p = jnp.exp(s - m_use[..., None])
      corr = jnp.exp(m - m_use)
      l = l * corr + jnp.sum(p, axis=-1)
      pv = jnp.einsum("bngqt,btnk->bngqk", p.astype(dt), vb.astype(dt), preferred_element_type=_F32)
      return m_new, l, acc * corr[..., None] + pv

    init = (
      jnp.full((B, N, G, bq), -jnp.inf, _F32),
      jnp.zeros((B, N, G, bq), _F32),
      jnp.zeros((B, N, G, bq, K), _F32),
    )
    m, l, acc = jax.lax.fori_loop(0, hi(i), kv_block, init)
    seen = l > 0
    o = acc / jnp.where(seen, l, 1.0)[..., None]  # unseen rows: acc = 0 → 0
    o = jnp.transpose(o, (0, 3, 1, 2, 4)).astype(q.dtype)  # [B, bq, N, G, K]
    row_lse = jnp.where(seen, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    out = jax.lax.dynamic_update_slice_in_dim(out, o, q0, axis=1)
    lse = jax.lax.dynamic_update_slice_in_dim(lse, row_lse, q0, axis=3)
    return out, lse

  init = (jnp.zeros((B, Sp, N, G, K), q.dtype), jnp.zeros((B, N, G, Sp), _F32))
  out, lse = jax.lax.fori_loop(0, Sp // bq, q_block, init)
  return out[:, :S].reshape(B, S, H, K), lse


def _public_lse(lse, S):
  """``[B, N, G, Sp]`` (+inf unseen) → ``[B, S, H]`` (−inf unseen)."""
  B, N, G, _ = lse.shape
  lse = lse[..., :S]
  lse = jnp.where(jnp.isposinf(lse), -jnp.inf, lse)
  return jnp.transpose(lse, (0, 3, 1, 2)).reshape(B, S, N * G)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, seg_q, seg_k, offset):
  out, lse = _forward(static, q, k, v, seg_q, seg_k, offset)
  return out, _public_lse(lse, q.shape[1])


def _attention_fwd(static, q, k, v, seg_q, seg_k, offset):
  out, lse = _forward(static, q, k, v, seg_q, seg_k, offset)
  return (out, _public_lse(lse, q.shape[1])), (q, k, v, seg_q, seg_k, offset, out, lse)


def _attention_bwd(static, res, cotangents):
  q, k, v, seg_q, seg_k, offset, out, lse = res
  d_out, d_lse = cotangents
  _, scale, bq, bk, dt = static
  (qp, kp, vp, sq, sk), (B, S, H, K, T, N, G, Sp, Tp) = _padded(static, q, k, v, seg_q, seg_k)
  dop = _pad_rows(d_out, Sp).reshape(B, Sp, N, G, K)
  # Δ_i = rowsum(dout_i ∘ out_i) − dlse_i: the lse cotangent enters ds = p ∘ (dp − Δ) as + p·dlse
  delta = jnp.sum(d_out.astype(_F32) * out.astype(_F32), axis=-1) - jnp.where(
    jnp.isfinite(d_lse), d_lse.astype(_F32), 0.0
  )  # [B, S, H]
  delta = jnp.transpose(_pad_rows(delta, Sp).reshape(B, Sp, N, G), (0, 2, 3, 1))  # [B, N, G, Sp]
  _, lo = _kv_bounds(static, Sp, Tp // bk, offset)

  def kv_block(j, carry):
    dq, dk, dv = carry
    k0 = j * bk
    kb = jax.lax.dynamic_slice_in_dim(kp, k0, bk, axis=1)
    vb = jax.lax.dynamic_slice_in_dim(vp, k0, bk, axis=1)

    def q_block(i, state):
      dq, dkb, dvb = state
      q0 = i * bq
      qb = jax.lax.dynamic_slice_in_dim(qp, q0, bq, axis=1)
      db = jax.lax.dynamic_slice_in_dim(dop, q0, bq, axis=1)
      lse_b = jax.lax.dynamic_slice_in_dim(lse, q0, bq, axis=3)
      delta_b = jax.lax.dynamic_slice_in_dim(delta, q0, bq, axis=3)
      ok = _block_mask(static, sq, sk, offset, q0, k0)
      p = jnp.where(ok, jnp.exp(_scores(static, qb, kb) - lse_b[..., None]), 0.0)  # [B, N, G, bq, bk]
      dvb = dvb + jnp.einsum("bngqt,bqngk->btnk", p.astype(dt), db.astype(dt), preferred_element_type=_F32)
      dp = jnp.einsum("bqngk,btnk->bngqt", db.astype(dt), vb.astype(dt), preferred_element_type=_F32)
      ds = (p * (dp - delta_b[..., None])).astype(dt)
      dqb = jnp.einsum("bngqt,btnk->bqngk", ds, kb.astype(dt), preferred_element_type=_F32) * scale
      dq = jax.lax.dynamic_update_slice_in_dim(dq, jax.lax.dynamic_slice_in_dim(dq, q0, bq, axis=1) + dqb, q0, 1)
      dkb = dkb + jnp.einsum("bngqt,bqngk->btnk", ds, qb.astype(dt), preferred_element_type=_F32) * scale
      return dq, dkb, dvb

    zeros = jnp.zeros((B, bk, N, K), _F32)
    dq, dkb, dvb = jax.lax.fori_loop(lo(j), Sp // bq, q_block, (dq, zeros, zeros))
    dk = jax.lax.dynamic_update_slice_in_dim(dk, dkb, k0, axis=1)
    dv = jax.lax.dynamic_update_slice_in_dim(dv, dvb, k0, axis=1)
    return dq, dk, dv

  init = (jnp.zeros((B, Sp, N, G, K), _F32), jnp.zeros((B, Tp, N, K), _F32), jnp.zeros((B, Tp, N, K), _F32))
  dq, dk, dv = jax.lax.fori_loop(0, Tp // bk, kv_block, init)
  dq = dq[:, :S].reshape(B, S, H, K).astype(q.dtype)
  seg_k_cotangent = jax.tree.map(lambda _: None, seg_k)  # int inputs (a tree mask's pair too): no cotangent
  return dq, dk[:, :T].astype(k.dtype), dv[:, :T].astype(v.dtype), None, seg_k_cotangent, None


_attention.defvjp(_attention_fwd, _attention_bwd)
