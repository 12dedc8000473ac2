"""The causal-LM skeleton every family shares: argument checks, packed rows (segment ids), cache
bookkeeping, remat policies, activation sharding of the residual stream, the head, and the layer
stack as a Python loop or as one ``jax.lax.scan`` over stacked layers (``scan_layers``)."""

from __future__ import annotations

import enum
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.models.attention import KVCache, TreeSegments, init_kv_cache
from jaxgrpo.models.backend import kv_cache_dtype
from jaxgrpo.models.layers import LoRA, activation_rules, dense, layer_index, shard_activation
from jaxgrpo.parallel import sharding
from jaxgrpo.parallel.sharding import DEFAULT_RULES

__all__ = [
  "CausalLM",
  "LAYER_AXIS",
  "RematPolicy",
  "check_scan_layers",
  "freeze_rules",
  "head_logits",
  "positions_from_mask",
  "positions_from_segments",
  "stack_blocks",
  "to_loop_layers",
  "to_scan_layers",
  "unstack_block",
]

RESIDUAL_AXES = ("batch", "activation_length", "activation_embed")  # [B, S, D]
LAYER_AXIS = sharding.LAYER_AXIS  # the logical name of a scanned stack's leading axis (never on a mesh axis)


class RematPolicy(enum.Enum):
  """What each layer keeps for the backward pass (activation checkpointing, ``jax.checkpoint`` per layer).

  - ``NONE`` ("none"): no remat; every intermediate is stored (fastest, most memory).
  - ``FULL`` ("full"): only each layer's input is stored; the backward pass reruns the whole layer
    (one extra forward; activation memory O(layers · B · S · D)). ``remat=True`` is an alias.
  - ``DOTS`` ("dots"): ``jax.checkpoint_policies.dots_saveable``: every matmul output is stored
    (projections and the attention scores/values), norms, activations and the softmax are recomputed.
  - ``DOTS_NO_BATCH`` ("dots_no_batch"): ``dots_with_no_batch_dims_saveable``: the projection outputs
    (2-D ``dense`` matmuls, weights have no batch dim) are stored; the attention's batched
    ``[B, N, G, S, T]`` score and value products, the softmax and the elementwise ops are recomputed.
    The middle ground for long rows: the O(S²) attention tensors are never kept.

  Every policy gives the same values and gradients (tested); only memory and time differ.
  """

  NONE = "none"
  FULL = "full"
  DOTS = "dots"
  DOTS_NO_BATCH = "dots_no_batch"

  @classmethod
  def parse(cls, value: RematPolicy | str | bool) -> RematPolicy:
    """A policy from itself, its name (``"none"``, ``"full"``, ``"dots"``, ``"dots_no_batch"``) or a
    bool (``True`` = ``FULL``, ``False`` = ``NONE``)."""
    if isinstance(value, cls):
      return value
    if isinstance(value, bool):
      return cls.FULL if value else cls.NONE
    if isinstance(value, str):
      try:
        return cls(value)
      except ValueError:
        raise ValueError(f"remat must be one of {[p.value for p in cls]} or a bool; got {value!r}") from None
    raise TypeError(f"remat must be a RematPolicy, one of {[p.value for p in cls]} or a bool; got {value!r}")

  def checkpoint_policy(self):
    """The ``jax.checkpoint`` policy (None for ``FULL``: save nothing); not meaningful for ``NONE``."""
    if self is RematPolicy.DOTS:
      return jax.checkpoint_policies.dots_saveable
    if self is RematPolicy.DOTS_NO_BATCH:
      return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return None


def freeze_rules(rules: Mapping[str, Any] | None) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
  """A rules table (logical name → mesh axis, tuple of mesh axes, or None; None: ``DEFAULT_RULES``) as
  a sorted tuple of pairs: hashable, so a model can hold it as a static attribute of its graphdef."""
  rules = DEFAULT_RULES if rules is None else rules
  if not isinstance(rules, Mapping):
    raise TypeError(f"rules must be a mapping from logical axis names to mesh axes, got {type(rules).__name__}")
  frozen = []
  for name, rule in rules.items():
    if not (rule is None or isinstance(rule, str) or all(isinstance(m, str) for m in rule)):
      raise TypeError(f"rules[{name!r}] must be a mesh axis name, a tuple of them or None; got {rule!r}")
    frozen.append((str(name), rule if rule is None or isinstance(rule, str) else tuple(rule)))
  return tuple(sorted(frozen))


def head_logits(w: jax.Array, hidden: jax.Array, *, tied: bool, dtype, out_dtype=None) -> jax.Array:
  """``hidden [..., D] → logits [..., V]`` with the head weight ``w``: the tied embedding ``[V, D]``
  (``tied``) or an untied head ``[D, V]``; operands in ``dtype``, accumulated in float32, returned in
  ``out_dtype`` (default ``dtype``). ``CausalLM.logits`` is this function of the model's own weight;
  ``jaxgrpo.models.log_probs`` calls it with the weight as an explicit argument (its custom gradient).
  """
  h = hidden.astype(dtype)
  w = w.astype(dtype)
  out = dense(h, w, transpose_w=tied, preferred_element_type=jnp.float32)
  return out.astype(dtype if out_dtype is None else out_dtype)


def _apply_layer(layer, x, positions, segment_ids, kv, valid, index, dropout_key):
  return layer(x, positions, segment_ids, kv, valid, index, dropout_key)


def _remat_layer(policy):
  """``_apply_layer`` under ``jax.checkpoint(policy=policy)`` as a pure function of the layer's state
  (the backward pass recomputes what the policy does not save). Not ``nnx.remat``: it fails ("Cannot
  mutate Param from a different trace level") when the layer's variables come from different traces,
  as when gradients are taken w.r.t. the LoRA adapters only and the base weights are a plain argument
  of the jitted step."""

  def apply(layer, *args):
    graphdef, state = nnx.split(layer)

    def pure(state, *args):
      return _apply_layer(nnx.merge(graphdef, state), *args)

    return jax.checkpoint(pure, policy=policy)(state, *args)

  return apply


def _lora_modules(block) -> list[LoRA]:
  return [m for _, m in nnx.iter_modules(block) if isinstance(m, LoRA)]


def stack_blocks(blocks: Sequence[nnx.Module]) -> nnx.Module:
  """L layers of one structure → one layer whose every variable is the L layers' values stacked on a
  new leading axis (``[L, *shape]``, logical axis ``LAYER_AXIS`` prepended to its ``out_sharding``).

  The inputs are not modified (the stacked arrays are new). Adapters: layer l's ``LoRA.stream`` must
  be ``stream₀ + l · stride`` (as ``lora.apply_lora`` numbers them); the stacked ``LoRA`` keeps
  ``stream₀`` and ``layer_stride = stride``.

  Raises:
    ValueError: no layer, or a layer whose structure (modules, static attributes, adapters,
      quantisation) differs from layer 0's, named by its index.
  """
  blocks = list(blocks)
  if not blocks:
    raise ValueError("stack_blocks: no layer to stack")
  splits = []
  for b in blocks:
    graphdef, state = nnx.split(b)
    splits.append(nnx.merge(graphdef, state))  # a copy whose static attributes may be edited
  loras = [_lora_modules(b) for b in splits]
  for i, mods in enumerate(loras):
    if len(mods) != len(loras[0]):
      raise ValueError(
        f"scan_layers: layer {i} has {len(mods)} adapters, layer 0 has {len(loras[0])}; a scanned stack "
        "needs the same LoRA targets in every layer"
      )
  stride = loras[1][0].stream - loras[0][0].stream if len(blocks) > 1 and loras[0] else 0
  for i, mods in enumerate(loras):
    for a, a0 in zip(mods, loras[0]):
      if a.layer_stride:
        raise ValueError(f"stack_blocks: layer {i} is already a stacked layer")
      if a.stream != a0.stream + i * stride:
        raise ValueError(
          f"scan_layers: layer {i}'s adapter streams {[m.stream for m in mods]} are not layer 0's "
          f"{[m.stream for m in loras[0]]} + {i}·{stride}; apply the adapters with lora.apply_lora"
        )
      a.stream, a.layer_stride = a0.stream, stride
  parts = [nnx.split(b) for b in splits]
  graphdef = parts[0][0]
  for i, (g, _) in enumerate(parts):
    if g != graphdef:
      raise ValueError(
        f"scan_layers: layer {i} differs in structure from layer 0 (different modules, static attributes, "
        "adapters or quantisation); a scanned stack needs identical layers"
      )
  flats = [dict(nnx.to_flat_state(st)) for _, st in parts]
  stacked = []
  for path, v0 in flats[0].items():
    value = jnp.stack([f[path].get_value() for f in flats])
    axes = v0.get_metadata().get("out_sharding")
    meta = {} if axes is None else {"out_sharding": (LAYER_AXIS,) + tuple(axes)}
    stacked.append((path, v0.replace(value, **meta)))
  return nnx.merge(graphdef, nnx.from_flat_state(stacked))


def unstack_block(block: nnx.Module, num_layers: int) -> list[nnx.Module]:
  """The inverse of :func:`stack_blocks`: ``num_layers`` layers, layer l holding slice ``[l]`` of
  every variable (new arrays), its adapters' streams ``stream + l · layer_stride``."""
  graphdef, state = nnx.split(block)
  flat = list(nnx.to_flat_state(state))
  for path, v in flat:
    if v.get_value().shape[:1] != (num_layers,):
      raise ValueError(f"unstack_block: {path} has shape {v.get_value().shape}, expected a leading [{num_layers}]")
  out = []
  for i in range(num_layers):
    layer = []
    for path, v in flat:
      axes = v.get_metadata().get("out_sharding")
      meta = {} if axes is None else {"out_sharding": tuple(axes)[1:]}
      layer.append((path, v.replace(v.get_value()[i], **meta)))
    b = nnx.merge(graphdef, nnx.from_flat_state(layer))
    for a in _lora_modules(b):
      a.stream, a.layer_stride = a.stream + i * a.layer_stride, 0
    out.append(b)
  return out


def to_scan_layers(model: "CausalLM") -> "CausalLM":
  """``model`` with its layers stacked (``scan_layers=True``): the same function of the same values.

  A new model: the stacked arrays are new, the others (embedding, final norm, head) shared. The
  layer stack is held twice until ``model`` is dropped.
  """
  if model.scan_layers:
    return model
  graphdef, state = nnx.split(model)
  out = nnx.merge(graphdef, state)
  out.layers = stack_blocks(list(out.layers))
  out.scan_layers = True
  return out


def to_loop_layers(model: "CausalLM") -> "CausalLM":
  """The inverse of :func:`to_scan_layers`: ``model`` with one module per layer (``scan_layers=False``),
  e.g. to read or edit a layer (``model.layers[3]``) or to restore a checkpoint of the loop layout."""
  if not model.scan_layers:
    return model
  graphdef, state = nnx.split(model)
  out = nnx.merge(graphdef, state)
  out.layers = nnx.List(unstack_block(out.layers, model.config.num_layers))
  out.scan_layers = False
  return out


def check_scan_layers(value) -> bool:
  """``value`` if it is a bool (the ``scan_layers`` argument), else TypeError naming it."""
  if not isinstance(value, bool):
    raise TypeError(f"scan_layers must be a bool, got {value!r}")
  return value


def _check_dropout_key(key, tokens_shape: tuple) -> jax.Array:
  """A typed key of shape (), [B] or [B, S] (``tokens_shape``; raw uint32 [2] / [B, 2] keys are wrapped)."""
  if not isinstance(key, jax.Array):
    raise TypeError(f"dropout_key must be a jax PRNG key array, got {type(key).__name__}")
  if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.dtype != jnp.uint32 or key.ndim not in (1, 2) or key.shape[-1] != 2:
      raise TypeError(f"dropout_key must be a typed PRNG key or raw uint32 [2] / [B, 2]; got {key.dtype}{key.shape}")
    key = jax.random.wrap_key_data(key)
  batch = tokens_shape[0]
  if key.shape not in ((), (batch,), tuple(tokens_shape)):
    raise ValueError(
      f"dropout_key must be one key, one per row (shape ({batch},)) or one per token (shape {tuple(tokens_shape)}); "
      f"got shape {key.shape}"
    )
  return key


def _tree_segments(segment_ids: jax.Array, kv_end) -> TreeSegments:
  kv_end = jnp.asarray(kv_end)
  if kv_end.shape != segment_ids.shape or not jnp.issubdtype(kv_end.dtype, jnp.integer):
    raise ValueError(
      f"kv_end must be an int array of segment_ids' shape {segment_ids.shape}; got {kv_end.dtype}{list(kv_end.shape)}"
    )
  return TreeSegments(segment_ids, kv_end.astype(jnp.int32))


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
  """Position ids for (left-)padded rows: ``clip(cumsum(mask, -1) - 1, 0)``; int32 [B,S] from bool [B,S]."""
  return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
  """Position ids of packed rows: 0, 1, 2, ... restarting at the first token of each segment.

  ``int32[B, S]`` from ``int[B, S]`` segment ids (0 = padding, k >= 1 = segment k); a segment is a
  run of equal ids (each segment must be one contiguous run, as ``jaxgrpo.step.packing.pack`` lays them
  out). ``out[b, s] = s - first(b, s)`` where ``first(b, s)`` is the start of the run holding s;
  0 on padding (so GPT-2's learned position table is never indexed out of range).
  """
  if segment_ids.ndim != 2:
    raise ValueError(f"segment_ids must be [B, S], got shape {segment_ids.shape}")
  seg = segment_ids.astype(jnp.int32)
  idx = jnp.arange(seg.shape[1], dtype=jnp.int32)
  starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  first = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
  return jnp.where(seg > 0, idx - first, 0)


class CausalLM(nnx.Module):
  """Base class. Subclasses set ``config``, ``dtype``, ``layers`` (an ``nnx.List``), ``final_norm``,
  ``embed_tokens`` (the [V, D] "vocab","embed" table), ``lm_head`` ([D, V] or None when tied), and
  implement ``_embed(tokens, positions) -> [B,S,D]``. Each layer is called as
  ``layer(x, positions, segment_ids, kv, valid, index, dropout_key) -> (x, kv)`` (or
  ``(x, kv, side)``: ``side`` goes to ``self._side_output(i, side)``, e.g. a MoE layer's routing; a scanned
  stack's, stacked ``[L, ...]``, to ``self._stacked_side_output(side)``), under
  ``jax.checkpoint`` with the policy of ``self.remat`` (a ``RematPolicy``) unless it is ``NONE``. When a
  mesh is active (``with jax.set_mesh(mesh):``) the activations are constrained by logical axes under
  ``self.sharding_rules`` (``freeze_rules(rules)`` of the constructor's ``rules``, default
  ``DEFAULT_RULES``): the residual stream to ``RESIDUAL_AXES`` here, attention and MLP activations in
  the layers (``layers.shard_activation``).

  ``scan_layers`` (static) True: ``layers`` is one layer module whose variables are the L layers'
  stacked on a leading axis (:func:`stack_blocks`, logical axis ``LAYER_AXIS``), applied by one
  ``jax.lax.scan`` (the layer, with its remat, is traced once instead of L times; the KV cache is
  stacked too, ``k [L, B, N, K, T]``). Same values as the loop; convert with :func:`to_scan_layers`
  / :func:`to_loop_layers`.
  """

  remat: RematPolicy = RematPolicy.NONE
  scan_layers: bool = False
  sharding_rules: tuple = freeze_rules(None)

  @property
  def rules(self) -> dict[str, Any]:
    """The logical-axis rules of the activation constraints, as a dict (``DEFAULT_RULES`` by default)."""
    return dict(self.sharding_rules)

  def _embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    raise NotImplementedError

  def __call__(
    self,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    attention_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    cache: KVCache | None = None,
    dropout_key: jax.Array | None = None,
    kv_end: jax.Array | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    """Run the decoder.

    Args:
      tokens: int [B, S] token ids.
      positions: int [B, S] position ids (left-padded rows: ``positions_from_mask(mask)``; packed
        rows: ``positions_from_segments(segment_ids)``).
      attention_mask: bool [B, S], True on real tokens; None means all real. Padding keys are never
        attended to.
      segment_ids: int [B, S] for packed rows (several sequences back to back): 0 = padding, k >= 1 =
        the row's k-th sequence. Query i attends key j iff ``segment_ids[i] == segment_ids[j] > 0``
        and j <= i, so each sequence sees only itself. Exclusive with ``attention_mask`` (its mask is
        ``segment_ids > 0``) and with ``cache``. None: one segment per row (``attention_mask``).
      cache: None for a full causal forward over the S tokens, or a ``KVCache`` whose slots
        ``[cache.index, cache.index + S)`` receive the new tokens (the caller keeps
        ``cache.index + S <= cache.max_len``; the write is not bounds-checked under jit). A per-row cache
        (``init_cache(..., per_row=True)``, ``index int32[B]``) writes row b at ``[index[b], index[b] + S)``
        and advances ``index[b]`` by the row's real tokens: ``attention_mask`` must then be right-padded.
      dropout_key: PRNG key for LoRA adapter dropout (``layers.LoRA``), training only: one key,
        one key per row (``key[B]``, typed, or raw ``uint32[B, 2]``) for masks independent of the
        batch split, or one typed key per token (``key[B, S]``: masks independent of where the token
        sits, the packed rows' form); None (the default: sampling, reference and evaluation passes)
        applies no dropout. Ignored by a model without adapters or with dropout 0.
      kv_end: int [B, S] with ``segment_ids``: packed prefix trees (``jaxgrpo.step.prefix_tree``, each segment a
        forest in pre-order, positions = depths); query i also needs ``i < kv_end[j]`` (key j's subtree ends
        there), so a token attends exactly to its ancestors and itself. None: plain segments.

    Returns:
      (hidden [B, S, D] after the final norm in compute dtype, new cache with ``index += S`` (per row: += the
      row's real tokens) or None).
    """
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [B, S], got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise TypeError(f"tokens must be an integer array, got {tokens.dtype}")
    if positions.shape != tokens.shape:
      raise ValueError(f"positions shape {positions.shape} != tokens shape {tokens.shape}")
    if segment_ids is not None:
      if attention_mask is not None:
        raise ValueError("pass attention_mask or segment_ids, not both (a packed row's mask is segment_ids > 0)")
      if cache is not None:
        raise ValueError("segment_ids (packed rows) are supported without a cache only; got a KVCache")
      if segment_ids.shape != tokens.shape:
        raise ValueError(f"segment_ids shape {segment_ids.shape} != tokens shape {tokens.shape}")
      if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"segment_ids must be an integer array (0 = padding), got {segment_ids.dtype}")
      segment_ids = segment_ids.astype(jnp.int32)
      if kv_end is not None:
        segment_ids = _tree_segments(segment_ids, kv_end)
    elif kv_end is not None:
      raise ValueError("kv_end (a prefix tree's mask) needs segment_ids (packed rows); got segment_ids=None")
    else:
      if attention_mask is None:
        attention_mask = jnp.ones(tokens.shape, bool)
      elif attention_mask.shape != tokens.shape:
        raise ValueError(f"attention_mask shape {attention_mask.shape} != tokens shape {tokens.shape}")
      attention_mask = attention_mask.astype(bool)
      segment_ids = attention_mask.astype(jnp.int32)  # one segment per row: real tokens are segment 1
    if dropout_key is not None:
      dropout_key = _check_dropout_key(dropout_key, tokens.shape)
    if cache is not None:
      if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache or None, got {type(cache).__name__}")
      if cache.valid.shape[0] != tokens.shape[0]:
        raise ValueError(f"cache batch {cache.valid.shape[0]} != tokens batch {tokens.shape[0]}")
      if isinstance(cache.k, tuple) == self.scan_layers:
        want = "one stacked [L, ...] array" if self.scan_layers else "a tuple of per-layer arrays"
        raise ValueError(
          f"cache.k must be {want} for a model with scan_layers={self.scan_layers}; use model.init_cache"
        )
      if tokens.shape[1] > cache.max_len:
        raise ValueError(f"{tokens.shape[1]} new tokens do not fit a cache of {cache.max_len} slots")
      index = cache.index.astype(jnp.int32)
      if index.ndim == 0:
        valid = jax.lax.dynamic_update_slice(cache.valid, attention_mask, (jnp.zeros((), jnp.int32), index))
        next_index = index + tokens.shape[1]
      elif index.shape != (tokens.shape[0],):
        raise ValueError(f"cache.index must be a scalar or int32[B] with B = {tokens.shape[0]}; got {index.shape}")
      else:  # per-row (KVCache): row b's tokens at slots index[b] + s, right-padded, advance by its real tokens
        slots = index[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        rows = jnp.arange(tokens.shape[0])[:, None]
        valid = cache.valid.at[rows, slots].set(attention_mask, mode="drop")
        next_index = index + jnp.sum(attention_mask, axis=1, dtype=jnp.int32)
    else:
      index = valid = None
    if self.remat is RematPolicy.NONE:
      apply = _apply_layer
    else:
      apply = _remat_layer(self.remat.checkpoint_policy())
    new_k, new_v = [], []
    with activation_rules(self.rules):
      x = shard_activation(self._embed(tokens, positions), RESIDUAL_AXES, "embeddings")
      if self.scan_layers:
        x, kv, side = self._scan(apply, x, positions, segment_ids, cache, valid, index, dropout_key)
        if side is not None:  # the layers' side outputs stacked [L, ...] (models.moe: the routing)
          self._stacked_side_output(side)
        hidden = shard_activation(self.final_norm(x), RESIDUAL_AXES, "final hidden")
        if cache is None:
          return hidden, None
        return hidden, KVCache(k=kv[0], v=kv[1], valid=valid, index=next_index)
      for i, layer in enumerate(self.layers):
        kv = None if cache is None else (cache.k[i], cache.v[i])
        with layer_index(i):
          out = apply(layer, x, positions, segment_ids, kv, valid, index, dropout_key)
        x, kv = out[0], out[1]
        if len(out) > 2:  # a layer's side output (models.moe: its routing), returned through remat
          self._side_output(i, out[2])
        x = shard_activation(x, RESIDUAL_AXES, f"output of layer {i}")
        if kv is not None:
          new_k.append(kv[0])
          new_v.append(kv[1])
      hidden = shard_activation(self.final_norm(x), RESIDUAL_AXES, "final hidden")
    if cache is None:
      return hidden, None
    return hidden, KVCache(k=tuple(new_k), v=tuple(new_v), valid=valid, index=next_index)

  def _scan(self, apply, x, positions, segment_ids, cache, valid, index, dropout_key):
    """The stacked layers as one ``jax.lax.scan`` over (each layer's slice of the stacked state, its
    index l); the carry is the residual stream ``x [B, S, D]`` and, with a cache, the stacked cache
    ``k [L, B, N, K, T]`` / ``v [L, B, N, T, K]``, whose layer l is read and written back in place (as
    a scanned input/output it was copied whole at every decode step: 1.2x slower decoding, measured). A
    layer's side output (its third output, a MoE layer's routing) is a scanned output, stacked ``[L, ...]``.
    Returns ``(x, (k, v) or None, side outputs [L, ...] or None)``."""
    graphdef, state = nnx.split(self.layers)
    num_layers = self.config.num_layers

    def body(x, xs):
      layer_state, kv, i = xs
      with layer_index(i):
        out = apply(nnx.merge(graphdef, layer_state), x, positions, segment_ids, kv, valid, index, dropout_key)
      side = out[2] if len(out) > 2 else None
      return shard_activation(out[0], RESIDUAL_AXES, "output of a scanned layer"), (out[1], side)

    layers = jnp.arange(num_layers, dtype=jnp.int32)
    if cache is None:
      x, (_, side) = jax.lax.scan(body, x, (state, None, layers))
      return x, None, side

    def body_cached(carry, xs):
      x, ck, cv = carry
      layer_state, i = xs
      kv = (jax.lax.dynamic_index_in_dim(ck, i, keepdims=False), jax.lax.dynamic_index_in_dim(cv, i, keepdims=False))
      x, ((k, v), side) = body(x, (layer_state, kv, i))
      ck = jax.lax.dynamic_update_index_in_dim(ck, k, i, 0)
      cv = jax.lax.dynamic_update_index_in_dim(cv, v, i, 0)
      return (x, ck, cv), side

    (x, ck, cv), side = jax.lax.scan(body_cached, (x, cache.k, cache.v), (state, layers))
    return x, (ck, cv), side

  def _side_output(self, layer: int, value) -> None:
    """Receives the third output of a layer that returns ``(x, kv, value)`` (``models.moe``'s
    sparse layers return their routing); the base class drops it."""

  def _stacked_side_output(self, value) -> None:
    """A scanned stack's side outputs: the L layers' third outputs stacked, every leaf ``[L, ...]``; the base
    class drops them."""

  @property
  def head_weight(self) -> jax.Array:
    """The LM head's weight as stored: the tied embedding ``[V, D]`` (``lm_head`` None) or ``lm_head [D, V]``."""
    return self.embed_tokens[...] if self.lm_head is None else self.lm_head[...]

  def logits(self, hidden: jax.Array, *, out_dtype=None) -> jax.Array:
    """``hidden [..., D] → logits [..., V]`` through the tied embedding or the untied head
    (:func:`head_logits` of :attr:`head_weight`).

    Accumulates in float32 and returns ``out_dtype`` (default: the compute dtype).
    """
    return head_logits(self.head_weight, hidden, tied=self.lm_head is None, dtype=self.dtype, out_dtype=out_dtype)

  def init_cache(self, batch_size: int, max_len: int, *, per_row: bool = False) -> KVCache:
    """Empty ``KVCache`` for ``batch_size`` rows and ``max_len`` slots, in ``kv_cache_dtype`` of the compute dtype
    (the compute dtype; float32 for bf16 on the CPU); ``per_row``:
    each row appends at its own slot (``index int32[batch_size]``, see ``KVCache``)."""
    cfg = self.config
    return init_kv_cache(
      cfg.num_layers,
      batch_size,
      max_len,
      cfg.num_kv_heads,
      cfg.head_dim,
      kv_cache_dtype(self.dtype),
      stacked=self.scan_layers,
      per_row=per_row,
    )
