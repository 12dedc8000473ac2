"""Attention and its KV cache: the static-shape decoding cache (``KVCache``: its rows taken, put and repeated),
rotary position embeddings, and the multi-head / grouped-query ``Attention`` every family shares.

Axis vocabulary as in ``jaxgrpo.models.layers`` (B batch, S new tokens, T cache slots / keys, D model width,
H query heads, N key/value heads, G = H/N, K head dim). Projections go through ``layers.project``; on XLA:CPU the
bf16 score and value products take float32 operands (``jaxgrpo.models.backend.f32_operands_on_cpu``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo._checks import check_choice
from jaxgrpo.kernels.attention import blockwise_attention
from jaxgrpo.models.backend import f32_operands_on_cpu
from jaxgrpo.models.layers import (
  RMSNorm,
  current_activation_rules,
  forward_mode_active,
  param,
  project,
  shard_activation,
)
from jaxgrpo.parallel import attention as kernels
from jaxgrpo.parallel.ring_attention import context_attention
from jaxgrpo.parallel.sharding import context_size
from jaxgrpo.parallel.target import current_platform

__all__ = [
  "QUERY_AXES",
  "KV_AXES",
  "KVCache",
  "init_kv_cache",
  "repeat_cache",
  "take_cache_rows",
  "put_cache_rows",
  "apply_rope",
  "Attention",
  "TreeSegments",
  "IMPLEMENTATIONS",
  "AUTO_MIN_LENGTH",
  "DECODE_BLOCKED_FROM",
  "DECODE_MAX_BLOCKS",
  "decode_attention_blocks",
  "decode_block",
  "check_implementation",
  "context_implementation",
  "resolve_implementation",
  "set_attention",
]

_NEG_INF = -1e30  # finite so that fully masked (padding) query rows give no NaN
_SMALL_QUERY_ROWS = 8  # S·G at most this: attention by multiply-and-reduce instead of a batched dot
QUERY_AXES = ("batch", "activation_length", "heads", "head_dim")  # q and the attention output [B, S, H, K]
KV_AXES = ("batch", "activation_length", "kv_heads", "head_dim")  # k, v of the new tokens [B, S, N, K]
# The model's attention choices: today's dense scores, or a kernel of ``jaxgrpo.parallel.attention``.
IMPLEMENTATIONS = ("auto", "dense") + tuple(i for i in kernels.IMPLEMENTATIONS if i != "auto")
# ``auto``: dense below this many query rows, the platform's kernel from it on. The crossover measured on this CPU
# (BENCHMARKS.md, "Attention in the model": one layer's forward + backward, dense vs blockwise, 256 to 2k tokens).
AUTO_MIN_LENGTH = 512
# Decoding over a cache of at least this many slots reads only its filled part, in at most DECODE_MAX_BLOCKS blocks
# (decode_attention_blocks; not with attention="dense"). BENCHMARKS.md, "Decode attention over the filled slots".
DECODE_BLOCKED_FROM = 1024
DECODE_MAX_BLOCKS = 8
_PLATFORM_ONLY = {kernel: platform for platform, kernel in kernels.FUSED.items()}  # splash: tpu, cudnn: gpu


def check_implementation(value, name: str = "attention") -> str:
  """``value`` if it is one of :data:`IMPLEMENTATIONS`, else one line naming ``name`` and the choices."""
  return check_choice(value, IMPLEMENTATIONS, name)


def resolve_implementation(implementation: str, rows: int, platform: str | None = None) -> str:
  """What a model's ``attention`` choice runs for ``rows`` query rows on ``platform`` (default: the target
  platform, :func:`jaxgrpo.parallel.target.current_platform`): ``"dense"``, ``"blockwise"``, ``"splash"`` or
  ``"cudnn"``. ``auto``: dense when ``rows < AUTO_MIN_LENGTH``, else the platform's kernel (splash on TPU, cuDNN on
  GPU, blockwise elsewhere). ``splash`` / ``cudnn`` on another platform: ValueError (one line)."""
  check_implementation(implementation)
  platform = platform or current_platform()
  if implementation == "auto":
    return "dense" if rows < AUTO_MIN_LENGTH else kernels.choose_implementation("auto", platform)
  need = _PLATFORM_ONLY.get(implementation)
  if need is not None and platform != need:
    raise ValueError(
      f"model attention={implementation!r} is a {need.upper()} kernel but the program targets {platform!r}; "
      "use 'auto' or 'blockwise' (every platform) or 'dense'"
    )
  return implementation


def context_implementation(implementation: str, context: int) -> str | None:
  """``"ring"`` when a model's ``attention`` choice runs as ring attention over a ``context`` mesh axis of size
  ``context`` (> 1; ``auto`` and ``blockwise``: the blockwise kernel inside the ring), None when it does not
  (``context`` 1, or ``dense``: GSPMD over the split sequence, which gathers the keys); ``splash`` / ``cudnn``
  with ``context`` > 1: ValueError (one line; the fused kernels are not inside the ring)."""
  check_implementation(implementation)
  if context < 2 or implementation == "dense":
    return None
  if implementation in _PLATFORM_ONLY:
    raise ValueError(
      f"model attention={implementation!r} with a context mesh axis of size {context}: context parallelism runs "
      "ring attention with the blockwise kernel inside; use 'auto' or 'blockwise' (or drop the context axis)"
    )
  return "ring"


def set_attention(model: nnx.Module, implementation: str) -> nnx.Module:
  """Sets the attention implementation (one of :data:`IMPLEMENTATIONS`) of every :class:`Attention` of ``model``
  (in place; returns ``model``). A static attribute: part of the traced program, not of the weights."""
  check_implementation(implementation)
  for _, module in nnx.iter_graph(model):
    if isinstance(module, Attention):
      module.implementation = implementation
  return model


def decode_block(implementation: str, slots: int) -> int:
  """The block of cache slots a decode step reads at a time over a cache of ``slots`` slots, or 0: read the whole
  cache (``dense``, or a cache shorter than :data:`DECODE_BLOCKED_FROM` slots, where one pass is cheaper than a
  loop). Otherwise ``ceil(slots / DECODE_MAX_BLOCKS)`` rounded up to a multiple of 128: at most
  :data:`DECODE_MAX_BLOCKS` iterations of :func:`decode_attention_blocks` per layer and step."""
  check_implementation(implementation)
  if implementation == "dense" or slots < DECODE_BLOCKED_FROM:
    return 0
  return -(-slots // (DECODE_MAX_BLOCKS * 128)) * 128


def decode_attention_blocks(qt, keys, values, mask, bound, *, block: int, scale: float) -> jax.Array:
  """Decode attention that reads only the cache's filled part: the slots ``[0, bound)``, in blocks of ``block``.

  A static-shape cache of T slots holds ``bound`` ≤ T written slots at a decode step (the prompt and the tokens so
  far); attending over all T (the dense path) reads every empty slot too — half the cache on average over a
  rollout, most of a decode step's memory traffic at long lengths. Here block i covers slots
  ``[i·C, (i+1)·C)`` for ``i < ceil(bound / C)`` (a loop with a data-dependent trip count; the last block's
  window is shifted to end at T and its slots before ``i·C`` masked), with the online softmax in float32:
  ``m ← max(m, max_j s_j)``, ``l ← l·e^{m_old−m} + Σ_j e^{s_j−m}``, ``acc ← acc·e^{m_old−m} + Σ_j e^{s_j−m}·v_j``,
  out = acc / l — the softmax of the dense path, summed in another order (float32: ~1e-7 apart). The online
  normaliser is Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018), as FlashAttention
  (Dao et al., 2022) uses it over key blocks; decoding over key blocks is "Flash-Decoding" (Dao et al., 2023).

  Args:
    qt: ``f32[B, N, G, S, K]`` queries (kv head, group, query row); keys ``[B, N, K, T]``, values
      ``[B, N, T, K]`` (the cache's layouts); mask ``bool[B, S, T]``: query s may attend slot t (every slot
      ``>= bound`` must be False); bound: ``int32[]``; block: C (static, ≤ T); scale: the scores' factor.

  Returns:
    ``f32[B, N, G, S, K]``.

  Raises:
    ValueError (one line, before tracing the loop): shapes that do not fit together, or ``block`` not in ``[1, T]``.
  """
  f32 = lambda x: x.astype(jnp.float32)
  _check_decode_blocks(qt, keys, values, mask, block)
  T = keys.shape[-1]
  head = qt.shape[:-1]  # B, N, G, S

  def body(i, carry):
    m, l, acc = carry
    lo = i * block
    start = jnp.minimum(lo, T - block)
    kc = jax.lax.dynamic_slice_in_dim(keys, start, block, axis=3)  # [B,N,K,C]
    vc = jax.lax.dynamic_slice_in_dim(values, start, block, axis=2)  # [B,N,C,K]
    ok = jax.lax.dynamic_slice_in_dim(mask, start, block, axis=2) & (start + jnp.arange(block) >= lo)
    s = jnp.sum(qt[..., None] * f32(kc)[:, :, None, None], axis=-2) * scale  # [B,N,G,S,C]
    s = jnp.where(ok[:, None, None], s, _NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    acc = acc * corr[..., None] + jnp.sum(p[..., None] * f32(vc)[:, :, None, None], axis=-2)
    return m_new, l * corr + jnp.sum(p, axis=-1), acc

  init = (jnp.full(head, _NEG_INF, jnp.float32), jnp.zeros(head, jnp.float32), jnp.zeros_like(qt))
  _, l, acc = jax.lax.fori_loop(0, (bound + block - 1) // block, body, init)
  return acc / jnp.maximum(l, 1e-30)[..., None]


def _check_decode_blocks(qt, keys, values, mask, block) -> None:
  """:func:`decode_attention_blocks`' arguments fit together (ValueError in one line naming the argument)."""
  for name, x, rank, axes in (("qt", qt, 5, "[B, N, G, S, K]"), ("keys", keys, 4, "[B, N, K, T]")):
    if len(x.shape) != rank:
      raise ValueError(f"decode_attention_blocks: `{name}` must be {axes}; got shape {tuple(x.shape)}")
  (B, N, _, S, K), T = qt.shape, keys.shape[3]
  for name, x, want, axes in (
    ("keys", keys, (B, N, K, T), "[B, N, K, T]"),
    ("values", values, (B, N, T, K), "[B, N, T, K]"),
    ("mask", mask, (B, S, T), "[B, S, T]"),
  ):
    if tuple(x.shape) != want:
      raise ValueError(
        f"decode_attention_blocks: `{name}` must be {axes} = {list(want)} for `qt` {tuple(qt.shape)}; got shape "
        f"{tuple(x.shape)}"
      )
  if not isinstance(block, int) or not 1 <= block <= T:
    raise ValueError(f"decode_attention_blocks: `block` must be an int in [1, T = {T}]; got {block!r}")


class TreeSegments(NamedTuple):
  """Packed rows whose sequences share prefixes (``jaxgrpo.step.prefix_tree``): what ``CausalLM`` passes its layers
  as ``segment_ids`` when it is given ``kv_end``. Query i attends key j iff ``ids[i] == ids[j] > 0``, ``j <= i``
  and ``i < end[j]``: with each segment a forest in pre-order and ``end[j]`` = j + the size of j's subtree, a
  token sees exactly its ancestors and itself.

  Attributes:
    ids: ``int32[B, S]`` segment ids (0 = padding).
    end: ``int32[B, S]`` the end (exclusive) of each key's subtree, in columns of its row.
  """

  ids: jax.Array
  end: jax.Array


class KVCache(NamedTuple):
  """Static-shape decoding cache (a pytree).

  k: tuple over layers of [B, N, K, T] keys, v: tuple over layers of [B, N, T, K] values (compute
  dtype), T = max_len slots; for a scanned layer stack (``scan_layers=True``) one stacked array
  each, k [L, B, N, K, T] and v [L, B, N, T, K]. Keys are stored transposed because that is the operand layout XLA's
  dot wants for ``q·kᵀ`` (and values for ``p·v``): with [B, T, N, K] it copied (transposed) the
  whole cache of every layer at every decode step, ~20% of the sampler's time on CPU.
  valid: bool[B, T], True on slots holding a real (non-padding) token.
  index: int32 scalar, the next slot to write (same for every row; left-padding keeps rows aligned), or
    ``int32[B]``, each row's own next slot (a *per-row* cache, ``init_kv_cache(..., per_row=True)``): the S
    new tokens of row b go to slots ``[index[b], index[b] + S)`` (writes past ``max_len`` are dropped) and
    ``index[b]`` advances by the row's number of real tokens, so a call's ``attention_mask`` must be
    right-padded (real tokens first) and each row's real tokens fill its slots without holes. That lets
    rows of different lengths append tokens to one cache of a fixed size (the multi-turn sampler keeps one
    across turns: ``jaxgrpo.rollout.conversation.ConversationSampler``).
  """

  k: tuple[jax.Array, ...] | jax.Array
  v: tuple[jax.Array, ...] | jax.Array
  valid: jax.Array
  index: jax.Array

  @property
  def max_len(self) -> int:
    return self.valid.shape[1]


def init_kv_cache(
  num_layers: int,
  batch_size: int,
  max_len: int,
  num_kv_heads: int,
  head_dim: int,
  dtype,
  *,
  stacked: bool = False,
  per_row: bool = False,
) -> KVCache:
  """Empty cache: zeros, no valid slot, index 0; ``stacked``: one [L, ...] array for k and for v;
  ``per_row``: ``index`` is ``int32[batch_size]`` (each row appends at its own slot, see ``KVCache``)."""
  for name, value in (("batch_size", batch_size), ("max_len", max_len)):
    if not isinstance(value, int) or value <= 0:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  k_shape = (batch_size, num_kv_heads, head_dim, max_len)
  v_shape = (batch_size, num_kv_heads, max_len, head_dim)
  index = jnp.zeros((batch_size,) if per_row else (), jnp.int32)
  if stacked:
    return KVCache(
      k=jnp.zeros((num_layers,) + k_shape, dtype),
      v=jnp.zeros((num_layers,) + v_shape, dtype),
      valid=jnp.zeros((batch_size, max_len), bool),
      index=index,
    )
  return KVCache(
    k=tuple(jnp.zeros(k_shape, dtype) for _ in range(num_layers)),
    v=tuple(jnp.zeros(v_shape, dtype) for _ in range(num_layers)),
    valid=jnp.zeros((batch_size, max_len), bool),
    index=index,
  )


def _map_rows(fn, cache: KVCache, *others: KVCache) -> KVCache:
  """``fn(x, *others' x, axis)`` on every array of the cache(s), ``axis`` its batch axis (1 for a stacked
  [L, B, ...] k/v, else 0)."""
  kv_axis = 0 if isinstance(cache.k, tuple) else 1
  if kv_axis == 0:
    k = tuple(fn(*xs, 0) for xs in zip(cache.k, *(o.k for o in others)))
    v = tuple(fn(*xs, 0) for xs in zip(cache.v, *(o.v for o in others)))
  else:
    k, v = fn(cache.k, *(o.k for o in others), 1), fn(cache.v, *(o.v for o in others), 1)
  valid = fn(cache.valid, *(o.valid for o in others), 0)
  index = fn(cache.index, *(o.index for o in others), 0) if cache.index.ndim else cache.index
  return KVCache(k=k, v=v, valid=valid, index=index)


def take_cache_rows(cache: KVCache, rows: jax.Array) -> KVCache:
  """The cache of rows ``rows int32[R]`` (``x[rows]`` on the batch axis); an index out of ``[0, B)`` gives an
  empty row (zeros, no valid slot, index 0): a padding row. With :func:`put_cache_rows`, a decode over the R
  rows of a larger cache that are still running."""
  return _map_rows(lambda x, axis: jnp.take(x, rows, axis=axis, mode="fill", fill_value=0), cache)


def put_cache_rows(cache: KVCache, rows: jax.Array, sub: KVCache) -> KVCache:
  """``cache`` with its rows ``rows int32[R]`` replaced by ``sub``'s R rows (indices out of ``[0, B)``, the
  padding rows of :func:`take_cache_rows`, are dropped; ``rows`` must not repeat an index in range)."""

  def put(x, y, axis):
    at = x.at[rows] if axis == 0 else x.at[:, rows]
    return at.set(y, mode="drop")

  return _map_rows(put, cache, sub)


def repeat_cache(cache: KVCache, n: int) -> KVCache:
  """Repeat every batch row ``n`` times consecutively (``jnp.repeat(x, n, axis=0)``): [B,...] → [B·n,...].

  Used to share one prompt prefill across G samples of a group.
  """
  if not isinstance(n, int) or n <= 0:
    raise ValueError(f"n must be a positive int, got {n!r}")
  rep = lambda x: jnp.repeat(x, n, axis=0)
  index = rep(cache.index) if cache.index.ndim else cache.index  # a per-row index is repeated with its rows
  if not isinstance(cache.k, tuple):  # stacked [L, B, ...]
    rep_l = lambda x: jnp.repeat(x, n, axis=1)
    return KVCache(k=rep_l(cache.k), v=rep_l(cache.v), valid=rep(cache.valid), index=index)
  return KVCache(k=tuple(map(rep, cache.k)), v=tuple(map(rep, cache.v)), valid=rep(cache.valid), index=index)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotary embedding, HF "rotate_half" layout: pairs are (x[..., i], x[..., i + K/2]).

  x: [B, S, H, K]; positions: int32 [B, S]; inv_freq: f32 [K/2].
  ``y = x·cos(θ) + rotate_half(x)·sin(θ)``, θ = position · inv_freq, computed in float32.
  """
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, K/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


@jax.custom_vjp
def _attention_softmax(scores: jax.Array) -> jax.Array:
  """``jax.nn.softmax(scores, axis=-1)`` (the same forward pass), whose backward pass keeps only the
  probabilities ``p``: ``∂L/∂scores = p · (g − Σ_k p_k g_k)`` for the cotangent ``g`` (autodiff of
  ``jax.nn.softmax`` keeps more of the ``[B, N, G, S, T]`` intermediates: the compiled train step holds
  ~16% less temporary memory and reads/writes ~5% fewer bytes with this rule)."""
  return jax.nn.softmax(scores, axis=-1)


def _attention_softmax_fwd(scores):
  p = jax.nn.softmax(scores, axis=-1)
  return p, p


def _attention_softmax_bwd(p, g):
  return (p * (g - jnp.sum(p * g, axis=-1, keepdims=True)),)


_attention_softmax.defvjp(_attention_softmax_fwd, _attention_softmax_bwd)


class Attention(nnx.Module):
  """Multi-head / grouped-query self-attention, shared by every family.

  Weights: q [D,H,K] ("embed","heads","head_dim"); k, v [D,N,K] ("embed","kv_heads","head_dim");
  o [H,K,D] ("heads","head_dim","embed"); optional biases [H,K] / [N,K] / [D]; optional per-head
  RMSNorm on q and k over K (Qwen3); optional RoPE (``inv_freq`` given).

  ``softmax(q·kᵀ/√K + mask)`` with scores and softmax in float32; masked entries get -1e30. ``implementation``
  (static, :func:`set_attention`): ``dense`` materialises the ``[B,N,G,S,T]`` scores; ``blockwise`` / ``splash`` /
  ``cudnn`` run the kernels of ``jaxgrpo.parallel.attention`` (memory linear in the length) without a cache and
  blockwise attention for a prefill into one; ``auto`` (default) is dense below ``AUTO_MIN_LENGTH`` query rows
  (:func:`resolve_implementation`). Decoding (a few query rows) and forward-mode autodiff are always dense, except
  that a decode step over a cache of ``DECODE_BLOCKED_FROM`` slots or more reads only the cache's filled slots, in
  blocks (:func:`decode_attention_blocks`; every choice but ``dense``). Under a
  context mesh with a ``context`` axis > 1 (context parallelism), ``auto`` and ``blockwise`` run ring attention
  over it (:func:`context_implementation`, ``jaxgrpo.parallel.ring_attention.context_attention``).
  With a context mesh, q and the attention output are constrained to ``QUERY_AXES``, k and v to
  ``KV_AXES`` (:func:`shard_activation`). Adapters: ``q_lora``, ``k_lora``, ``v_lora``, ``o_lora``
  (``LoRA`` or None).
  """

  PROJECTIONS = {"q": 1, "k": 1, "v": 1, "o": 2}  # name -> contracted dims

  def __init__(
    self,
    *,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qkv_bias: bool,
    o_bias: bool,
    qk_norm_eps: float | None,
    inv_freq,
    dtype,
    param_dtype,
    rngs: nnx.Rngs,
  ):
    D, H, N, K = hidden_size, num_heads, num_kv_heads, head_dim
    self.num_heads, self.num_kv_heads, self.head_dim = H, N, K
    self.dtype = dtype
    self.q = param(rngs.params(), (D, H, K), ("embed", "heads", "head_dim"), param_dtype)
    self.k = param(rngs.params(), (D, N, K), ("embed", "kv_heads", "head_dim"), param_dtype)
    self.v = param(rngs.params(), (D, N, K), ("embed", "kv_heads", "head_dim"), param_dtype)
    self.o = param(rngs.params(), (H, K, D), ("heads", "head_dim", "embed"), param_dtype)
    if qkv_bias:
      self.q_bias = param(None, (H, K), ("heads", "head_dim"), param_dtype, init="zeros")
      self.k_bias = param(None, (N, K), ("kv_heads", "head_dim"), param_dtype, init="zeros")
      self.v_bias = param(None, (N, K), ("kv_heads", "head_dim"), param_dtype, init="zeros")
    else:
      self.q_bias = self.k_bias = self.v_bias = None
    self.o_bias = param(None, (D,), ("embed",), param_dtype, init="zeros") if o_bias else None
    if qk_norm_eps is not None:
      self.q_norm = RMSNorm(K, eps=qk_norm_eps, dtype=dtype, param_dtype=param_dtype)
      self.k_norm = RMSNorm(K, eps=qk_norm_eps, dtype=dtype, param_dtype=param_dtype)
    else:
      self.q_norm = self.k_norm = None
    self.inv_freq = None if inv_freq is None else tuple(float(f) for f in inv_freq)
    self.q_lora = self.k_lora = self.v_lora = self.o_lora = nnx.data(None)
    self.implementation = "auto"  # one of IMPLEMENTATIONS (static), set for a whole model by set_attention

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    cache_kv: tuple[jax.Array, jax.Array] | None,
    cache_valid: jax.Array | None,
    cache_index: jax.Array | None,
    dropout_key: jax.Array | None = None,
  ):
    """x: [B,S,D]; positions int32 [B,S]; segment_ids int32 [B,S] (0 = padding, k >= 1 = segment k;
    a plain padded row is its mask as 0/1); dropout_key: adapter dropout (``LoRA``).

    Without cache (``cache_kv`` None): causal attention within each segment, query i attends key j
    iff ``segment_ids[i] == segment_ids[j] > 0`` and j <= i. ``segment_ids`` is not used with a
    cache (``CausalLM`` rejects packed rows there). With cache: k/v of the new tokens are written at slots
    ``[cache_index, cache_index+S)`` of ``cache_kv`` (keys [B,N,K,T], values [B,N,T,K]) and query i
    attends to the slots j <= cache_index+i with ``cache_valid[:, j]`` (already updated with this step's mask).
    A per-row ``cache_index`` (``int32[B]``, see ``KVCache``): row b's tokens go to its slots
    ``[cache_index[b], cache_index[b]+S)`` (a scatter; slots past the cache are dropped) and attend likewise.
    ``segment_ids`` may be a :class:`TreeSegments` (no cache): query i then also needs ``i < end[j]``.
    Returns (y [B,S,D], new (k, v) or None).
    """
    segment_ids, kv_end = segment_ids if isinstance(segment_ids, TreeSegments) else (segment_ids, None)
    B, S, _ = x.shape
    H, N, K = self.num_heads, self.num_kv_heads, self.head_dim
    kw = dict(dtype=self.dtype, dropout_key=dropout_key)
    q = project(x, self.q, self.q_bias, self.q_lora, **kw)  # [B,S,H,K]
    k = project(x, self.k, self.k_bias, self.k_lora, **kw)  # [B,S,N,K]
    v = project(x, self.v, self.v_bias, self.v_lora, **kw)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    if self.inv_freq is not None:
      inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
      q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    q = shard_activation(q, QUERY_AXES, "attention queries")
    k, v = shard_activation(k, KV_AXES, "attention keys"), shard_activation(v, KV_AXES, "attention values")
    G = H // N
    # Decoding (a few query rows per kv head): the B·N tiny matmuls are slow as a batched dot on
    # CPU (BENCHMARKS.md, scripts/bench_projections.py); a broadcast multiply-and-reduce over the
    # cache's [B,N,K,T] keys / [B,N,T,K] values is one vectorised loop, accumulated in float32.
    small = cache_kv is not None and S * G <= _SMALL_QUERY_ROWS
    if cache_kv is None:
      keys, values = k, v  # [B,S,N,K]
      q_slot = k_slot = jnp.arange(S)
      seg_k = segment_ids[:, None, :]  # [B,1,S]
      key_ok = (seg_k == segment_ids[:, :, None]) & (seg_k > 0)  # [B,S,S]: same non-padding segment
      if kv_end is not None:  # a prefix tree: key j is seen from the rows of its subtree, [j, end[j])
        key_ok = key_ok & (q_slot[None, :, None] < kv_end[:, None, :])
      new_kv = None
    else:
      ck, cv = cache_kv
      if cache_index.ndim == 0:
        zero = jnp.zeros((), jnp.int32)
        keys = jax.lax.dynamic_update_slice(
          ck, jnp.transpose(k, (0, 2, 3, 1)).astype(ck.dtype), (zero, zero, zero, cache_index)
        )  # [B,N,K,T]
        values = jax.lax.dynamic_update_slice(
          cv, jnp.transpose(v, (0, 2, 1, 3)).astype(cv.dtype), (zero, zero, cache_index, zero)
        )  # [B,N,T,K]
        q_slot = (cache_index + jnp.arange(S))[None]  # [1,S]
      else:  # per-row slots [B,S]: advanced indices on the batch and slot axes put [B,S] first
        q_slot = cache_index[:, None] + jnp.arange(S)[None]
        rows = jnp.arange(B)[:, None]
        keys = ck.at[rows, :, :, q_slot].set(k.astype(ck.dtype), mode="drop")  # [B,N,K,T]
        values = cv.at[rows, :, q_slot, :].set(v.astype(cv.dtype), mode="drop")  # [B,N,T,K]
      new_kv = (keys, values)
      k_slot = jnp.arange(values.shape[2])
      key_ok = cache_valid[:, None, :]  # [B,1,T]
      if not small:  # prefill: once per generate call; [B,T,N,K] as in the uncached path
        keys, values = jnp.transpose(keys, (0, 3, 1, 2)), jnp.transpose(values, (0, 2, 1, 3))
    ring = None if cache_kv is not None else context_implementation(self.implementation, context_size())
    impl = "dense" if small or forward_mode_active() else ring or resolve_implementation(self.implementation, S)
    if impl != "dense" and kv_end is not None:  # a data-dependent tree mask: the blockwise kernel takes it
      out = self._tree_kernel(impl, q, keys, values, segment_ids, kv_end)
      return self._output(out, kw), new_kv
    if impl != "dense":  # memory linear in the length; a custom VJP, so never in forward-mode autodiff
      out = self._kernel(impl, q, keys, values, segment_ids, cache_valid if cache_kv is not None else None, cache_index)
      return self._output(out, kw), new_kv
    if cache_kv is None:
      mask = (k_slot[None, :] <= q_slot[:, None])[None] & key_ok  # [B,S,T]
    else:
      mask = (k_slot[None, None, :] <= q_slot[:, :, None]) & key_ok  # [B,S,T]
    q = q.reshape(B, S, N, G, K)
    if small:
      return self._output(self._decode(q, keys, values, mask, q_slot), kw), new_kv
    scores = jnp.einsum(
      "bsngk,btnk->bngst",
      *f32_operands_on_cpu(q, keys.astype(self.dtype), preferred_element_type=jnp.float32),
      preferred_element_type=jnp.float32,
    )
    probs = self._probs(scores, mask)
    out = jnp.einsum("bngst,btnk->bsngk", probs, values.astype(self.dtype)).reshape(B, S, H, K)
    return self._output(out, kw), new_kv

  def _probs(self, scores: jax.Array, mask: jax.Array) -> jax.Array:
    """``softmax(scores / √K)`` over the keys where ``mask [B, S, T]`` (``_NEG_INF`` elsewhere), in the compute
    dtype: ``scores`` float32 ``[B, N, G, S, T]``."""
    scores = jnp.where(mask[:, None, None], scores * (self.head_dim**-0.5), _NEG_INF)
    return (jax.nn.softmax(scores, axis=-1) if forward_mode_active() else _attention_softmax(scores)).astype(self.dtype)

  def _decode(self, q, keys, values, mask, q_slot) -> jax.Array:
    """A decode step's attention (``S·G <= _SMALL_QUERY_ROWS`` query rows per kv head): a broadcast
    multiply-and-reduce over the cache in float32 (the B·N tiny matmuls are slow as a batched dot on CPU). q
    ``[B, S, N, G, K]``; keys ``[B, N, K, T]``, values ``[B, N, T, K]`` (the cache's layouts); mask ``bool[B, S,
    T]``; q_slot: the queries' slots (``[1, S]`` or ``[B, S]``). Over a cache of ``DECODE_BLOCKED_FROM`` slots or
    more (:func:`decode_block`; not in forward-mode autodiff) only its filled blocks are read
    (:func:`decode_attention_blocks`), else every slot. Returns ``[B, S, H, K]`` in the compute dtype."""
    B, S, N, G, K = q.shape
    f32 = lambda x: x.astype(jnp.float32)
    qt = f32(jnp.transpose(q, (0, 2, 3, 1, 4)))  # [B,N,G,S,K]
    block = 0 if forward_mode_active() else decode_block(self.implementation, values.shape[2])
    if block:
      out = decode_attention_blocks(qt, keys, values, mask, jnp.max(q_slot) + 1, block=block, scale=K**-0.5)
    else:
      probs = self._probs(jnp.sum(qt[..., None] * f32(keys)[:, :, None, None], axis=-2), mask)  # [B,N,G,S,T]
      out = jnp.sum(f32(probs)[..., None] * f32(values)[:, :, None, None], axis=-2)
    return jnp.transpose(out.astype(self.dtype), (0, 3, 1, 2, 4)).reshape(B, S, N * G, K)  # -> [B,S,H,K]

  def _output(self, out: jax.Array, kw: dict) -> jax.Array:
    """The output projection of the attention output ``out [B,S,H,K]``: ``[B,S,D]``."""
    out = shard_activation(out, QUERY_AXES, "attention output")
    return project(out, self.o, self.o_bias, self.o_lora, contract=2, **kw)

  def _tree_kernel(self, impl, q, keys, values, segment_ids, kv_end) -> jax.Array:
    """Blockwise attention under a prefix tree's mask (:class:`TreeSegments`); ``[B,S,H,K]``. The fused kernels
    (splash, cuDNN) take masks fixed when the program is built, not a per-batch tree: asked for by name, one line."""
    if impl in _PLATFORM_ONLY:
      raise ValueError(
        f"model attention={impl!r} cannot take a prefix tree's mask (its mask is fixed when the kernel is built; "
        "the tree changes with every batch): use 'auto' or 'blockwise' with step.prefix_sharing, or 'none'"
      )
    if impl == "ring":  # a context axis: the tree's bounds travel the ring with their key chunks
      dot = jnp.float32 if current_platform() == "cpu" else None
      return context_attention(
        q, keys, values, segment_ids, rules=current_activation_rules(), scale=self.head_dim**-0.5, dot_dtype=dot,
        kv_end=kv_end,
      )  # fmt: skip
    block_q, block_kv = kernels.default_blocks()
    return blockwise_attention(
      q, keys.astype(self.dtype), values.astype(self.dtype), q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
      kv_end=kv_end, scale=self.head_dim**-0.5, block_q=block_q, block_kv=block_kv,
      dot_dtype=jnp.float32 if current_platform() == "cpu" else None,
    )  # fmt: skip

  def _kernel(self, impl, q, keys, values, segment_ids, cache_valid, cache_index) -> jax.Array:
    """Attention by ``impl`` (``blockwise``, ``splash``, ``cudnn``): q ``[B,S,H,K]``; keys, values ``[B,T,N,K]``
    (T = S without a cache). Without a cache (``cache_valid`` None): :func:`jaxgrpo.parallel.attention.attention`
    with ``segment_ids``. With one (a prefill): blockwise attention of the S queries at slots
    ``cache_index + i`` over the T slots where ``cache_valid`` (every platform: the fused kernels are
    self-attention only). Padding query rows give zeros (the dense path averages there; real rows agree).
    Returns ``[B,S,H,K]`` in the compute dtype."""
    K = self.head_dim
    if impl == "ring":
      dot = jnp.float32 if current_platform() == "cpu" else None  # XLA:CPU: no bf16 × bf16 → f32 batched dot
      return context_attention(
        q, keys, values, segment_ids, rules=current_activation_rules(), scale=K**-0.5, dot_dtype=dot
      )
    if cache_valid is None:
      return kernels.attention(q, keys, values, segment_ids, implementation=impl, scale=K**-0.5)
    block_q, block_kv = kernels.default_blocks()
    return blockwise_attention(
      q, keys.astype(self.dtype), values.astype(self.dtype),
      q_segment_ids=jnp.ones(q.shape[:2], jnp.int32), kv_segment_ids=cache_valid.astype(jnp.int32),
      q_offset=cache_index, scale=K**-0.5, block_q=block_q, block_kv=block_kv,
      dot_dtype=jnp.float32 if current_platform() == "cpu" else None,
    )  # fmt: skip
