"""LoRA and QLoRA on the model ports: adding adapters, quantising base weights, the reference
(adapters disabled), merging, the parameter/optimizer budget, and export to Hugging Face and PEFT.

The adapter itself (``layers.LoRA``) and the quantised weight (``layers.QuantizedWeight``) live in
``layers``; every projection calls them through ``layers.project``. This module matches the
projections of a model (its adapter sites, ``jaxgrpo.models._lora_sites``: the modules listing
``PROJECTIONS``: attention q/k/v/o, the SwiGLU gate/up/down, GPT-2's fc/proj) against target
patterns, and edits the model. The PEFT directories (:func:`save_peft`, :func:`load_peft`) are
``jaxgrpo.models.lora_peft``, re-exported here.

Typical use::

    model = models.load_hf(path)
    lora.apply_lora(model, lora.LoRAConfig(rank=16, alpha=32, quantize="nf4"), key=jax.random.key(0))
    graphdef, adapters, base = nnx.split(model, nnx.LoRAParam, ...)   # train ``adapters`` only
    ref_graphdef = nnx.graphdef(lora.reference_model(model))           # base forward, same arrays
    base_graphdef = nnx.graphdef(lora.base_model(model))               # runs on ``base`` alone
    models.save_hf(lora.merge_lora(model), out)                        # merged HF checkpoint
    lora.save_peft(model, out_adapter)                                 # PEFT adapter directory
    lora.load_peft(models.load_hf(path), out_adapter)                  # ... and back (any PEFT LoRA dir)

A scanned model (``scan_layers=True``, layers stacked) is edited through its loop layout: the
functions that add, quantise, merge, export or import weights unstack the layers
(``base.to_loop_layers``), work per layer, and stack the result again, so projection paths, the
adapters' initial values and dropout streams are those of the loop model (the layer stack is held
twice meanwhile). Every layer must then carry the same adapters (``targets`` naming some layers
only are refused).

Paper: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (``W + (α/r)·A·B``,
B = 0 at init); Kalajdzievski 2023, "A Rank Stabilization Scaling Factor for Fine-Tuning with
LoRA" (rsLoRA, ``α/√r``); Dettmers et al. 2023, "QLoRA" (NF4 base weights, block-wise absmax).

One job: editing a model's projections for low-rank adaptation — every function here adds,
quantises, disables, merges, counts or fingerprints the same adapter sites.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from jaxgrpo.models import quant
from jaxgrpo.models._lora_sites import Site, adapter_sites, check_model, edit_layers, place_like, weight_info
from jaxgrpo.models.base import to_loop_layers, to_scan_layers
from jaxgrpo.models.layers import LoRA, QuantizedWeight, QuantParam
from jaxgrpo.models.lora_peft import load_peft, save_peft

__all__ = [
  "LoRAConfig",
  "ParamCount",
  "AdamBytes",
  "projection_paths",
  "apply_lora",
  "quantize_model",
  "reference_model",
  "base_model",
  "has_adapters",
  "adapter_dropout",
  "merge_lora",
  "rollout_weights",
  "count_params",
  "adam_state_bytes",
  "base_fingerprint",
  "save_peft",
  "load_peft",
]

_INITS = ("kaiming", "gaussian")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
  """Adapters (and optionally quantised base weights) for ``apply_lora``; the YAML ``lora:`` section.

  Attributes:
    rank: r, the adapter rank (``A [*C, r]``, ``B [r, *O]``).
    alpha: α; the adapter output is scaled by ``α / r`` (``α / √r`` with ``rslora``).
    dropout: dropout rate on the adapter input, training only (see ``layers.LoRA``), in [0, 1).
    targets: regular expressions selecting the adapted projections; a projection matches when a
      pattern ``re.fullmatch``-es its dotted path (``"layers.3.attn.q"``, ``"layers.0.mlp.down"``)
      or its own name (``"q"``, ``"gate"``). None: every attention and MLP projection (q, k, v, o
      and gate, up, down; GPT-2: q, k, v, o, fc, proj). A pattern matching nothing is an error.
    rslora: scale by ``α / √r`` instead of ``α / r``.
    init: A's initialisation: ``"kaiming"`` — U(-1/√fan_in, 1/√fan_in), PEFT's default
      (``kaiming_uniform_(a=√5)``), fan_in the product of the contracted dims; ``"gaussian"`` —
      N(0, 1/r²), PEFT's ``init_lora_weights="gaussian"``. B is always 0, so the adapted model
      starts equal to the base model.
    param_dtype: storage dtype of A and B (``"float32"`` or ``"bfloat16"``, or a dtype).
    quantize: None, or quantise every projection's base weight first (QLoRA): ``"int8"`` (per
      output channel), ``"int4"`` or ``"nf4"`` (per group of ``group_size``); see ``models.quant``.
    group_size: 4-bit group (block) size along each weight's last contracted dim.
  """

  rank: int = 16
  alpha: float = 32.0
  dropout: float = 0.0
  targets: tuple[str, ...] | None = None
  rslora: bool = False
  init: str = "kaiming"
  param_dtype: Any = "float32"
  quantize: str | None = None
  group_size: int = 64

  def __post_init__(self):
    if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
      raise ValueError(f"rank must be a positive int, got {self.rank!r}")
    if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
      raise ValueError(f"alpha must be a positive number, got {self.alpha!r}")
    if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
    if self.targets is not None:
      targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
      if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"targets must be None or a non-empty list of patterns, got {self.targets!r}")
      for t in targets:
        try:
          re.compile(t)
        except re.error as e:
          raise ValueError(f"targets: {t!r} is not a valid regular expression ({e})") from e
      object.__setattr__(self, "targets", targets)
    if self.init not in _INITS:
      raise ValueError(f"init must be one of {_INITS}, got {self.init!r}")
    try:
      dtype = jnp.dtype(self.param_dtype)
    except TypeError as e:
      raise TypeError(f"param_dtype must be a float dtype, got {self.param_dtype!r}") from e
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"param_dtype must be a float dtype, got {dtype}")
    object.__setattr__(self, "param_dtype", dtype.name)
    if self.quantize is not None and self.quantize not in quant.QUANT_KINDS:
      raise ValueError(f"quantize must be None or one of {quant.QUANT_KINDS}, got {self.quantize!r}")
    if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 2:
      raise ValueError(f"group_size must be an int >= 2, got {self.group_size!r}")

  @property
  def scale(self) -> float:
    """``α / r``, or ``α / √r`` with ``rslora``."""
    return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def projection_paths(model) -> list[str]:
  """The dotted paths of every projection that can carry an adapter, in model order (a scanned
  model's are its loop layout's, ``"layers.3.attn.q"``)."""
  check_model(model)
  if model.scan_layers:
    model = nnx.eval_shape(lambda: to_loop_layers(model))
  return [s.dotted for s in adapter_sites(model)]


def _select(sites: list[Site], targets: tuple[str, ...] | None, what: str) -> list[Site]:
  if targets is None:
    return sites
  hits = {t: [s for s in sites if re.fullmatch(t, s.dotted) or re.fullmatch(t, s.name)] for t in targets}
  empty = [t for t, h in hits.items() if not h]
  if empty:
    names = sorted({s.name for s in sites})
    raise ValueError(
      f"{what}: targets {empty} match no projection of this model; projections are named {names} "
      f"with paths like {sites[0].dotted!r}"
    )
  chosen = {s.path for h in hits.values() for s in h}
  return [s for s in sites if s.path in chosen]


_quantize_jit = jax.jit(quant.quantize, static_argnames=("kind", "contract", "group_size"))


def quantize_model(
  model,
  kind: str,
  *,
  group_size: int = 64,
  targets: tuple[str, ...] | None = None,
  rules: Mapping[str, Any] | None = None,
) -> None:
  """Replace projection weights by ``QuantizedWeight`` (``models.quant`` formats), in place.

  Embeddings, the LM head and norms stay as they are (as in QLoRA). Each replaced full-precision
  weight is released once nothing else references it. A mesh-sharded weight's codes and scales are
  placed on the same mesh by their logical axes (``rules``, default ``DEFAULT_RULES``).

  Args:
    model: a ``jaxgrpo.models`` model (modified in place).
    kind: ``"int8"``, ``"int4"`` or ``"nf4"`` (``quant.QUANT_KINDS``), or ``"fp8"`` (a rollout format).
    group_size: 4-bit group size (must divide every weight's last contracted dim).
    targets: patterns as in ``LoRAConfig.targets``; None = every projection.
  """
  check_model(model)
  kinds = quant.QUANT_KINDS + tuple(k for k in quant.ROLLOUT_KINDS if k not in quant.QUANT_KINDS)
  if kind not in kinds:
    raise ValueError(f"kind must be one of {kinds}, got {kind!r}")
  if model.scan_layers:
    edit_layers(model, lambda m: quantize_model(m, kind, group_size=group_size, targets=targets, rules=rules))
    return
  sites = _select(adapter_sites(model), None if targets is None else tuple(targets), "quantize_model")
  for s in sites:
    w = s.weight()
    if isinstance(w, QuantizedWeight):
      raise ValueError(f"{s.dotted} is already quantised ({w.kind})")
    if s.adapter() is not None:
      raise ValueError(f"{s.dotted} already has an adapter; quantise before apply_lora")
    quant.quantized_shapes(tuple(w.shape), kind=kind, contract=s.contract, group_size=group_size)  # checks
  for s in sites:
    shape, axes, like = weight_info(s.weight())
    codes, scales = _quantize_jit(s.weight().get_value(), kind=kind, contract=s.contract, group_size=group_size)
    qw = QuantizedWeight(codes, scales, kind=kind, contract=s.contract, group_size=group_size, shape=shape, axes=axes)
    qw.codes.set_value(place_like(codes, axes, like, rules, s.dotted + ".codes"))
    qw.scales.set_value(place_like(scales, qw.scales.get_metadata()["out_sharding"], like, rules, s.dotted + ".scales"))
    s.set(weight=qw)


def apply_lora(model, cfg: LoRAConfig, *, key: jax.Array, rules: Mapping[str, Any] | None = None) -> None:
  """Add LoRA adapters to ``model`` in place (after quantising its base weights if ``cfg.quantize``).

  Each targeted projection ``w [*C, *O]`` gets ``A [*C, r]`` (``cfg.init``, from
  ``fold_in(key, i)`` for the i-th adapter) and ``B = 0 [r, *O]`` as ``nnx.LoRAParam`` with the
  weight's logical axes (rank dim None), in ``cfg.param_dtype``, placed on the weight's mesh when
  it is mesh-sharded. Since B = 0 the model's outputs are those of its (possibly just quantised)
  base weights, bit for bit. The i-th adapter's dropout stream is i (``layers.LoRA``).

  Raises:
    TypeError: ``model`` is not a ``jaxgrpo.models`` model.
    ValueError: the model already has adapters, or a target matches no projection.
  """
  check_model(model)
  if not isinstance(cfg, LoRAConfig):
    raise TypeError(f"cfg must be a LoRAConfig, got {type(cfg).__name__}")
  if model.scan_layers:
    edit_layers(model, lambda m: apply_lora(m, cfg, key=key, rules=rules))
    return
  all_sites = adapter_sites(model)
  present = [s.dotted for s in all_sites if s.adapter() is not None]
  if present:
    raise ValueError(f"model already has adapters on {present[:4]}...; merge_lora first or start from the base")
  sites = _select(all_sites, cfg.targets, "apply_lora")
  if cfg.quantize is not None:
    quantize_model(model, cfg.quantize, group_size=cfg.group_size, rules=rules)
  dtype = jnp.dtype(cfg.param_dtype)
  for i, s in enumerate(sites):
    shape, axes, like = weight_info(s.weight())
    c_shape, o_shape = shape[: s.contract], shape[s.contract :]
    k = jax.random.fold_in(key, i)
    if cfg.init == "kaiming":
      bound = 1.0 / math.sqrt(math.prod(c_shape))
      a = jax.random.uniform(k, c_shape + (cfg.rank,), jnp.float32, -bound, bound)
    else:
      a = jax.random.normal(k, c_shape + (cfg.rank,), jnp.float32) / cfg.rank
    b = jnp.zeros((cfg.rank,) + o_shape, jnp.float32)
    a_axes = tuple(axes[: s.contract]) + (None,)
    b_axes = (None,) + tuple(axes[s.contract :])
    a = place_like(a.astype(dtype), a_axes, like, rules, s.dotted + "_lora.a")
    b = place_like(b.astype(dtype), b_axes, like, rules, s.dotted + "_lora.b")
    s.set(adapter=LoRA(a, b, a_axes=a_axes, b_axes=b_axes, scale=cfg.scale, dropout=cfg.dropout, stream=i))


def _copy(model):
  """A new model object holding the same arrays (no device memory is copied)."""
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, state)


def reference_model(model):
  """``model`` with every adapter disabled: the base (or quantised-base) model, sharing its arrays.

  No weight is copied: the returned model holds the same ``jax.Array`` objects, and its adapters
  are only switched off (``LoRA.enabled = False``, a static flag of the graph definition). For a
  jitted reference pass take ``ref_graphdef = nnx.graphdef(reference_model(model))`` once and call
  ``nnx.merge(ref_graphdef, state)`` with the *policy's* state (adapters included, then unused):
  the reference costs no second copy of the base weights (2 bytes × parameter count in bf16).
  """
  check_model(model)
  ref = _copy(model)
  adapters = [s.adapter() for s in adapter_sites(ref) if s.adapter() is not None]
  if not adapters:
    raise ValueError("model has no adapters; its reference is the model itself")
  for a in adapters:
    a.enabled = False
  return ref


def base_model(model):
  """``model`` without its adapters: the base (or quantised-base) model, sharing its arrays.

  Unlike :func:`reference_model` (adapters present but switched off), the adapters are removed, so
  the result's state is exactly the non-adapter part of ``model``'s —
  ``nnx.split(model, nnx.LoRAParam, ...)[2]`` — and ``nnx.merge(nnx.graphdef(base_model(model)),
  base)`` runs the base model on those arrays alone (no adapter array needed, none copied). This is
  the LoRA reference pass of ``jaxgrpo.step.feed.make_reference``: it costs no second copy of the
  base weights. ``model`` is not modified.

  Raises:
    ValueError: ``model`` has no adapters.
  """
  check_model(model)
  base = _copy(model)
  sites = [s for s in adapter_sites(base) if s.adapter() is not None]
  if not sites:
    raise ValueError("model has no adapters; its base model is the model itself")
  for s in sites:
    s.set(clear_adapter=True)
  return base


def has_adapters(model) -> bool:
  """Whether any projection of ``model`` carries a ``LoRA`` adapter (enabled or not)."""
  check_model(model)
  return any(s.adapter() is not None for s in adapter_sites(model))


def adapter_dropout(model) -> float:
  """The largest dropout rate of ``model``'s enabled adapters (0.0 without adapters): when it is
  positive, training needs a ``dropout_key`` (``jaxgrpo.step.train.make_train_step``)."""
  check_model(model)
  rates = [a.dropout for s in adapter_sites(model) if (a := s.adapter()) is not None and a.enabled]
  return max(rates, default=0.0)


def merge_lora(model, *, param_dtype=None, rules: Mapping[str, Any] | None = None):
  """A plain model (no adapter, no quantised weight) computing what ``model`` computes.

  Every adapted projection becomes ``w + scale · A·B`` (float32, ``Precision.HIGHEST``), every
  quantised weight its dequantised value, then cast to ``param_dtype`` (default: the weight's own
  dtype; for a quantised weight, the embedding's dtype). Disabled adapters are left out. ``model``
  is not modified; unaffected parameters are shared, not copied. A merged weight keeps its
  weight's sharding (a dequantised one: its logical axes under ``rules``). The result is what
  ``models.save_hf`` writes and what ``sampling.generate`` can decode without adapter matmuls;
  it matches ``model`` up to float rounding (``x·(W + sAB)`` vs ``x·W + s(x·A)·B``).
  """
  check_model(model)
  if model.scan_layers:
    return to_scan_layers(merge_lora(to_loop_layers(model), param_dtype=param_dtype, rules=rules))
  merged = _copy(model)
  default_dtype = merged.embed_tokens.get_value().dtype
  for s in adapter_sites(merged):
    w, ad = s.weight(), s.adapter()
    active, quantised = ad is not None and ad.enabled, isinstance(w, QuantizedWeight)
    if ad is not None:
      s.set(clear_adapter=True)
    if not active and not quantised:
      continue
    shape, axes, like = weight_info(w)
    value = w.dequantize(jnp.float32) if quantised else w.get_value().astype(jnp.float32)
    if active:
      a = ad.a.get_value().astype(jnp.float32)
      b = ad.b.get_value().astype(jnp.float32)
      value = value + ad.scale * jnp.tensordot(a, b, axes=1, precision=jax.lax.Precision.HIGHEST)
    dtype = param_dtype if param_dtype is not None else default_dtype if quantised else w.get_value().dtype
    value = value.astype(dtype)
    if isinstance(getattr(like, "sharding", None), NamedSharding):  # keep the weight on its mesh
      value = place_like(value, axes, like, rules, s.dotted) if quantised else jax.device_put(value, like.sharding)
    s.set(weight=nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False))
  return merged


class ParamCount(NamedTuple):
  """Parameter counts and bytes. ``base``: base-model parameters (a quantised weight counts its
  logical elements); ``adapter``: ``nnx.LoRAParam`` elements; ``*_bytes``: their storage."""

  base: int
  adapter: int
  base_bytes: int
  adapter_bytes: int


def count_params(model) -> ParamCount:
  """Count base and adapter parameters of ``model`` (see ``ParamCount``)."""
  check_model(model)
  base = adapter = base_bytes = adapter_bytes = 0
  for _, v in nnx.to_flat_state(nnx.state(model)):
    x = v.get_value()
    if isinstance(v, nnx.LoRAParam):
      adapter += x.size
      adapter_bytes += x.nbytes
    elif isinstance(v, QuantParam):
      base_bytes += x.nbytes
    else:
      base += x.size
      base_bytes += x.nbytes
  per_site = model.config.num_layers if model.scan_layers else 1  # a stacked weight's shape is one layer's
  base += per_site * sum(
    math.prod(s.weight().shape) for s in adapter_sites(model) if isinstance(s.weight(), QuantizedWeight)
  )
  return ParamCount(base, adapter, base_bytes, adapter_bytes)


class AdamBytes(NamedTuple):
  """Adam(W) moment bytes (μ and ν) when training every base parameter (``full``) vs the adapters
  only (``lora``); ``ratio = lora / full``."""

  full: int
  lora: int
  ratio: float


def adam_state_bytes(model, *, moment_dtype=jnp.float32) -> AdamBytes:
  """Bytes of Adam's two moments, ``2 · n · itemsize(moment_dtype)``, for full fine-tuning
  (n = base parameters) vs LoRA (n = adapter parameters); the measured ratios are in BENCHMARKS.md
  ("LoRA and QLoRA")."""
  counts = count_params(model)
  item = jnp.dtype(moment_dtype).itemsize
  full, lora = 2 * counts.base * item, 2 * counts.adapter * item
  return AdamBytes(full, lora, lora / full if full else 0.0)


def _checksum(x: jax.Array) -> jax.Array:
  """uint32 ``Σ_i bits(x_i) · ((i · 2654435761) | 1)`` mod 2³² over the flattened bits: any single
  changed element changes it (odd weights are invertible mod 2³²); computed where ``x`` lives."""
  width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  bits = jax.lax.bitcast_convert_type(x, width).reshape(-1).astype(jnp.uint32)
  weights = (jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761)) | jnp.uint32(1)
  return jnp.sum(bits * weights, dtype=jnp.uint32)


_checksum_jit = jax.jit(_checksum)


def base_fingerprint(model) -> str:
  """A hex digest identifying the base weights (everything but ``nnx.LoRAParam``): SHA-256 of each
  variable's path, shape, dtype and ``_checksum`` (computed on device, 4 bytes per array come to
  the host). Checkpoints of adapters record it to refuse resuming onto other base weights."""
  check_model(model)
  h = hashlib.sha256()
  for path, v in sorted(nnx.to_flat_state(nnx.state(model)), key=lambda pv: str(pv[0])):
    if isinstance(v, nnx.LoRAParam):
      continue
    x = v.get_value()
    if x.dtype.itemsize not in (1, 2, 4):
      x = x.astype(jnp.float32)
    h.update(f"{'.'.join(map(str, path))}|{tuple(x.shape)}|{x.dtype}|{int(_checksum_jit(x))};".encode())
  return h.hexdigest()


def rollout_weights(model, kind: str, *, rules: Mapping[str, Any] | None = None):
  """The sampler's copy of ``model`` with weight-only quantised projections (``SamplingConfig.quantize``).

  Adapters are merged first (``w + scale·A·B``; a QLoRA base is dequantised: :func:`merge_lora`), then every
  projection — attention, MLP and every expert of a mixture of experts — becomes a ``QuantizedWeight`` of
  ``kind`` (``"int8"`` or ``"fp8"``: one scale per output channel, ``models.quant``), computed from the arrays
  ``model`` holds now. Embeddings, the LM head and norms keep their dtype. Codes and scales keep each weight's
  sharding (its logical axes under ``rules``). ``model`` is not modified; its unquantised arrays are shared.
  The copy computes ``ŵ = q·s`` per call (``layers.project``): the policy it samples is the dequantised model μ.

  Raises:
    ValueError: ``kind`` is not one of ``quant.ROLLOUT_KINDS``.
  """
  check_model(model)
  if kind not in quant.ROLLOUT_KINDS:
    raise ValueError(f"rollout_weights: kind must be one of {quant.ROLLOUT_KINDS}; got {kind!r}")
  sampled = merge_lora(model, rules=rules)  # a copy: adapters merged, quantised (QLoRA) bases dequantised
  quantize_model(sampled, kind, rules=rules)
  edit_layers(sampled, lambda m: _quantize_experts(m, kind, rules))
  return sampled


_EXPERT_STACKS = ("gate", "up", "down")  # a mixture of experts' routed weights [E, D, F] / [E, F, D]
_quantize_experts_jit = jax.jit(
  jax.vmap(lambda w, kind: quant.quantize(w, kind=kind, contract=1), in_axes=(0, None)), static_argnums=1
)


def _quantize_experts(model, kind: str, rules) -> None:
  """Every routed-expert stack ``[E, D_in, D_out]`` of ``model`` (loop layout) as a ``QuantizedWeight`` (``batch=1``:
  one scale per expert and output channel), in place, on its weight's mesh."""
  for path, module in nnx.iter_modules(model):
    if not hasattr(module, "num_experts"):
      continue
    for name in _EXPERT_STACKS:
      w = getattr(module, name)
      shape, axes, like = weight_info(w)
      codes, scales = _quantize_experts_jit(w.get_value(), kind)
      dotted = ".".join(map(str, tuple(path) + (name,)))
      qw = QuantizedWeight(codes, scales, kind=kind, contract=1, group_size=0, shape=shape, axes=axes, batch=1)
      qw.codes.set_value(place_like(codes, axes, like, rules, dotted + ".codes"))
      qw.scales.set_value(place_like(scales, qw.scales.get_metadata()["out_sharding"], like, rules, dotted + ".scales"))
      setattr(module, name, qw)
