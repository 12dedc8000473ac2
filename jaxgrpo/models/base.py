"""The causal-LM skeleton every family shares: argument checks, cache bookkeeping, the head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.models.layers import KVCache, dense, init_kv_cache

__all__ = ["CausalLM", "positions_from_mask"]


def _apply_layer(layer, x, positions, attention_mask, kv, valid, index, dropout_key):
  return layer(x, positions, attention_mask, kv, valid, index, dropout_key)


def _apply_layer_remat(layer, x, positions, attention_mask, kv, valid, index, dropout_key):
  """``_apply_layer`` under ``jax.checkpoint`` as a pure function of the layer's state (the backward
  pass recomputes the layer). Not ``nnx.remat``: it fails ("Cannot mutate Param from a different
  trace level") when the layer's variables come from different traces, as when gradients are taken
  w.r.t. the LoRA adapters only and the base weights are a plain argument of the jitted step."""
  graphdef, state = nnx.split(layer)

  def pure(state, *args):
    return _apply_layer(nnx.merge(graphdef, state), *args)

  return jax.checkpoint(pure)(state, x, positions, attention_mask, kv, valid, index, dropout_key)


def _check_dropout_key(key, batch: int) -> jax.Array:
  """A typed key of shape () or [batch] (raw uint32 [2] / [batch, 2] keys are wrapped)."""
  if not isinstance(key, jax.Array):
    raise TypeError(f"dropout_key must be a jax PRNG key array, got {type(key).__name__}")
  if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.dtype != jnp.uint32 or key.ndim not in (1, 2) or key.shape[-1] != 2:
      raise TypeError(f"dropout_key must be a typed PRNG key or raw uint32 [2] / [B, 2]; got {key.dtype}{key.shape}")
    key = jax.random.wrap_key_data(key)
  if key.shape not in ((), (batch,)):
    raise ValueError(f"dropout_key must be one key or one per row (shape ({batch},)); got shape {key.shape}")
  return key


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
  """Position ids for (left-)padded rows: ``clip(cumsum(mask, -1) - 1, 0)``; int32 [B,S] from bool [B,S]."""
  return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


class CausalLM(nnx.Module):
  """Base class. Subclasses set ``config``, ``dtype``, ``layers`` (an ``nnx.List``), ``final_norm``,
  ``embed_tokens`` (the [V, D] "vocab","embed" table), ``lm_head`` ([D, V] or None when tied), and
  implement ``_embed(tokens, positions) -> [B,S,D]``. Each layer is called as
  ``layer(x, positions, attention_mask, kv, valid, index, dropout_key) -> (x, kv)``, under ``jax.checkpoint``
  (activation checkpointing per layer: the backward pass recomputes the layer) when ``self.remat``.
  """

  remat: bool = False

  def _embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    raise NotImplementedError

  def __call__(
    self,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    attention_mask: jax.Array | None = None,
    cache: KVCache | None = None,
    dropout_key: jax.Array | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    """Run the decoder.

    Args:
      tokens: int [B, S] token ids.
      positions: int [B, S] position ids (left-padded rows: ``positions_from_mask(mask)``).
      attention_mask: bool [B, S], True on real tokens; None means all real. Padding keys are never
        attended to.
      cache: None for a full causal forward over the S tokens, or a ``KVCache`` whose slots
        ``[cache.index, cache.index + S)`` receive the new tokens (the caller keeps
        ``cache.index + S <= cache.max_len``; the write is not bounds-checked under jit).
      dropout_key: PRNG key for LoRA adapter dropout (``layers.LoRA``), training only: one key, or
        one key per row (``key[B]``, typed, or raw ``uint32[B, 2]``) for masks independent of the
        batch split; None (the default: sampling, reference and evaluation passes) applies no
        dropout. Ignored by a model without adapters or with dropout 0.

    Returns:
      (hidden [B, S, D] after the final norm in compute dtype, new cache with ``index += S`` or None).
    """
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [B, S], got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise TypeError(f"tokens must be an integer array, got {tokens.dtype}")
    if positions.shape != tokens.shape:
      raise ValueError(f"positions shape {positions.shape} != tokens shape {tokens.shape}")
    if attention_mask is None:
      attention_mask = jnp.ones(tokens.shape, bool)
    elif attention_mask.shape != tokens.shape:
      raise ValueError(f"attention_mask shape {attention_mask.shape} != tokens shape {tokens.shape}")
    attention_mask = attention_mask.astype(bool)
    if dropout_key is not None:
      dropout_key = _check_dropout_key(dropout_key, tokens.shape[0])
    if cache is not None:
      if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache or None, got {type(cache).__name__}")
      if cache.valid.shape[0] != tokens.shape[0]:
        raise ValueError(f"cache batch {cache.valid.shape[0]} != tokens batch {tokens.shape[0]}")
      if tokens.shape[1] > cache.max_len:
        raise ValueError(f"{tokens.shape[1]} new tokens do not fit a cache of {cache.max_len} slots")
      index = cache.index.astype(jnp.int32)
      valid = jax.lax.dynamic_update_slice(cache.valid, attention_mask, (jnp.zeros((), jnp.int32), index))
    else:
      index = valid = None
    x = self._embed(tokens, positions)
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      kv = None if cache is None else (cache.k[i], cache.v[i])
      apply = _apply_layer_remat if self.remat else _apply_layer
      x, kv = apply(layer, x, positions, attention_mask, kv, valid, index, dropout_key)
      if kv is not None:
        new_k.append(kv[0])
        new_v.append(kv[1])
    hidden = self.final_norm(x)
    if cache is None:
      return hidden, None
    return hidden, KVCache(k=tuple(new_k), v=tuple(new_v), valid=valid, index=index + tokens.shape[1])

  def logits(self, hidden: jax.Array, *, out_dtype=None) -> jax.Array:
    """``hidden [..., D] → logits [..., V]`` through the tied embedding or the untied head.

    Accumulates in float32 and returns ``out_dtype`` (default: the compute dtype).
    """
    h = hidden.astype(self.dtype)
    out_dtype = self.dtype if out_dtype is None else out_dtype
    if self.lm_head is None:
      w = self.embed_tokens[...].astype(self.dtype)
      out = dense(h, w, transpose_w=True, preferred_element_type=jnp.float32)
    else:
      w = self.lm_head[...].astype(self.dtype)
      out = dense(h, w, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)

  def init_cache(self, batch_size: int, max_len: int) -> KVCache:
    """Empty ``KVCache`` for ``batch_size`` rows and ``max_len`` slots, in the compute dtype."""
    cfg = self.config
    return init_kv_cache(cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_dim, self.dtype)
