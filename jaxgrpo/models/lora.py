"""LoRA and QLoRA on the model ports: adding adapters, quantising base weights, the reference
(adapters disabled), merging, the parameter/optimizer budget, and export to Hugging Face and PEFT.

The adapter itself (``layers.LoRA``) and the quantised weight (``layers.QuantizedWeight``) live in
``layers``; every projection calls them through ``layers.project``. This module finds the
projections of a model (the modules listing ``PROJECTIONS``: attention q/k/v/o, the SwiGLU
gate/up/down, GPT-2's fc/proj), matches them against target patterns, and edits the model.

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

One job at ~725 lines: editing a model's projections for low-rank adaptation — every function
here finds, adds, quantises, disables, merges, counts or (de)serialises the same adapter sites.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from safetensors.numpy import load_file, save_file

from jaxgrpo.models import quant
from jaxgrpo.models.base import CausalLM, stack_blocks, to_loop_layers, to_scan_layers
from jaxgrpo.models.config import GPT2Config
from jaxgrpo.models.gpt2 import GPT2MLP
from jaxgrpo.models.hf import hf_entries
from jaxgrpo.models.layers import Attention, LoRA, QuantizedWeight, QuantParam
from jaxgrpo.models.llama import SwiGLU
from jaxgrpo.parallel.sharding import DEFAULT_RULES, logical_to_spec

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
  "count_params",
  "adam_state_bytes",
  "base_fingerprint",
  "save_peft",
  "load_peft",
]

_ADAPTABLE = (Attention, SwiGLU, GPT2MLP)  # the modules whose projections can carry adapters
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


class _Site(NamedTuple):
  """One projection: its module, its name there, its contracted dims and its dotted path."""

  module: nnx.Module
  name: str
  contract: int
  path: tuple  # the weight's path in the model state, e.g. ("layers", 0, "attn", "q")

  @property
  def dotted(self) -> str:
    return ".".join(str(p) for p in self.path)

  # The three attribute accessors below are the only name-based access to the model.
  def weight(self):
    return getattr(self.module, self.name)

  def adapter(self) -> LoRA | None:
    return getattr(self.module, self.name + "_lora")

  def set(self, *, weight=None, adapter=None, clear_adapter: bool = False) -> None:
    if weight is not None:
      setattr(self.module, self.name, weight)
    if adapter is not None:
      setattr(self.module, self.name + "_lora", nnx.data(adapter))
    if clear_adapter:
      setattr(self.module, self.name + "_lora", nnx.data(None))


def _check_model(model) -> None:
  if not isinstance(model, CausalLM):
    raise TypeError(f"model must be a jaxgrpo.models CausalLM, got {type(model).__name__}")


def _edit_layers(model, edit):
  """``edit(model)``; for a scanned model, ``edit`` of its loop layout, whose layers are then stacked
  again into ``model`` (in place) — only if ``edit`` and the stacking succeed."""
  if not model.scan_layers:
    return edit(model)
  loop = to_loop_layers(model)
  out = edit(loop)
  model.layers = stack_blocks(list(loop.layers))
  return model if out is loop else out


def _sites(model) -> list[_Site]:
  out = []
  for path, module in nnx.iter_modules(model):
    if isinstance(module, _ADAPTABLE):
      for name, contract in module.PROJECTIONS.items():
        out.append(_Site(module, name, contract, tuple(path) + (name,)))
  return out


def projection_paths(model) -> list[str]:
  """The dotted paths of every projection that can carry an adapter, in model order (a scanned
  model's are its loop layout's, ``"layers.3.attn.q"``)."""
  _check_model(model)
  if model.scan_layers:
    model = nnx.eval_shape(lambda: to_loop_layers(model))
  return [s.dotted for s in _sites(model)]


def _select(sites: list[_Site], targets: tuple[str, ...] | None, what: str) -> list[_Site]:
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


def _weight_info(w) -> tuple[tuple[int, ...], tuple, Any]:
  """(shape, logical axes, the array whose placement new arrays follow) of a weight."""
  if isinstance(w, QuantizedWeight):
    return w.shape, w.axes, w.codes.get_value()
  return tuple(w.shape), tuple(w.get_metadata()["out_sharding"]), w.get_value()


def _place(value: jax.Array, axes: tuple, like, rules: Mapping[str, Any] | None, name: str) -> jax.Array:
  """``value`` on ``like``'s mesh, sharded by its logical ``axes``, when ``like`` is mesh-sharded."""
  sharding = getattr(like, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return value
  rules = DEFAULT_RULES if rules is None else rules
  spec = logical_to_spec(tuple(axes), sharding.mesh, rules, tuple(value.shape), name)
  return jax.device_put(value, NamedSharding(sharding.mesh, spec))


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
    kind: ``"int8"``, ``"int4"`` or ``"nf4"``.
    group_size: 4-bit group size (must divide every weight's last contracted dim).
    targets: patterns as in ``LoRAConfig.targets``; None = every projection.
  """
  _check_model(model)
  if kind not in quant.QUANT_KINDS:
    raise ValueError(f"kind must be one of {quant.QUANT_KINDS}, got {kind!r}")
  if model.scan_layers:
    _edit_layers(model, lambda m: quantize_model(m, kind, group_size=group_size, targets=targets, rules=rules))
    return
  sites = _select(_sites(model), None if targets is None else tuple(targets), "quantize_model")
  for s in sites:
    w = s.weight()
    if isinstance(w, QuantizedWeight):
      raise ValueError(f"{s.dotted} is already quantised ({w.kind})")
    if s.adapter() is not None:
      raise ValueError(f"{s.dotted} already has an adapter; quantise before apply_lora")
    quant.quantized_shapes(tuple(w.shape), kind=kind, contract=s.contract, group_size=group_size)  # checks
  for s in sites:
    shape, axes, like = _weight_info(s.weight())
    codes, scales = _quantize_jit(s.weight().get_value(), kind=kind, contract=s.contract, group_size=group_size)
    qw = QuantizedWeight(codes, scales, kind=kind, contract=s.contract, group_size=group_size, shape=shape, axes=axes)
    qw.codes.set_value(_place(codes, axes, like, rules, s.dotted + ".codes"))
    qw.scales.set_value(_place(scales, qw.scales.get_metadata()["out_sharding"], like, rules, s.dotted + ".scales"))
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
  _check_model(model)
  if not isinstance(cfg, LoRAConfig):
    raise TypeError(f"cfg must be a LoRAConfig, got {type(cfg).__name__}")
  if model.scan_layers:
    _edit_layers(model, lambda m: apply_lora(m, cfg, key=key, rules=rules))
    return
  all_sites = _sites(model)
  present = [s.dotted for s in all_sites if s.adapter() is not None]
  if present:
    raise ValueError(f"model already has adapters on {present[:4]}...; merge_lora first or start from the base")
  sites = _select(all_sites, cfg.targets, "apply_lora")
  if cfg.quantize is not None:
    quantize_model(model, cfg.quantize, group_size=cfg.group_size, rules=rules)
  dtype = jnp.dtype(cfg.param_dtype)
  for i, s in enumerate(sites):
    shape, axes, like = _weight_info(s.weight())
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
    a = _place(a.astype(dtype), a_axes, like, rules, s.dotted + "_lora.a")
    b = _place(b.astype(dtype), b_axes, like, rules, s.dotted + "_lora.b")
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
  _check_model(model)
  ref = _copy(model)
  adapters = [s.adapter() for s in _sites(ref) if s.adapter() is not None]
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
  _check_model(model)
  base = _copy(model)
  sites = [s for s in _sites(base) if s.adapter() is not None]
  if not sites:
    raise ValueError("model has no adapters; its base model is the model itself")
  for s in sites:
    s.set(clear_adapter=True)
  return base


def has_adapters(model) -> bool:
  """Whether any projection of ``model`` carries a ``LoRA`` adapter (enabled or not)."""
  _check_model(model)
  return any(s.adapter() is not None for s in _sites(model))


def adapter_dropout(model) -> float:
  """The largest dropout rate of ``model``'s enabled adapters (0.0 without adapters): when it is
  positive, training needs a ``dropout_key`` (``jaxgrpo.step.train.make_train_step``)."""
  _check_model(model)
  rates = [a.dropout for s in _sites(model) if (a := s.adapter()) is not None and a.enabled]
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
  _check_model(model)
  if model.scan_layers:
    return to_scan_layers(merge_lora(to_loop_layers(model), param_dtype=param_dtype, rules=rules))
  merged = _copy(model)
  default_dtype = merged.embed_tokens.get_value().dtype
  for s in _sites(merged):
    w, ad = s.weight(), s.adapter()
    active, quantised = ad is not None and ad.enabled, isinstance(w, QuantizedWeight)
    if ad is not None:
      s.set(clear_adapter=True)
    if not active and not quantised:
      continue
    shape, axes, like = _weight_info(w)
    value = w.dequantize(jnp.float32) if quantised else w.get_value().astype(jnp.float32)
    if active:
      a = ad.a.get_value().astype(jnp.float32)
      b = ad.b.get_value().astype(jnp.float32)
      value = value + ad.scale * jnp.tensordot(a, b, axes=1, precision=jax.lax.Precision.HIGHEST)
    dtype = param_dtype if param_dtype is not None else default_dtype if quantised else w.get_value().dtype
    value = value.astype(dtype)
    if isinstance(getattr(like, "sharding", None), NamedSharding):  # keep the weight on its mesh
      value = _place(value, axes, like, rules, s.dotted) if quantised else jax.device_put(value, like.sharding)
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
  _check_model(model)
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
  base += per_site * sum(math.prod(s.weight().shape) for s in _sites(model) if isinstance(s.weight(), QuantizedWeight))
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
  _check_model(model)
  h = hashlib.sha256()
  for path, v in sorted(nnx.to_flat_state(nnx.state(model)), key=lambda pv: str(pv[0])):
    if isinstance(v, nnx.LoRAParam):
      continue
    x = v.get_value()
    if x.dtype.itemsize not in (1, 2, 4):
      x = x.astype(jnp.float32)
    h.update(f"{'.'.join(map(str, path))}|{tuple(x.shape)}|{x.dtype}|{int(_checksum_jit(x))};".encode())
  return h.hexdigest()


def _hf_module_parts(cfg, out_sizes: Mapping[tuple, int]) -> dict[tuple, tuple[str, int, int, int]]:
  """weight path → (HF module name, output offset, output size, total output size of that module),
  for the projections in ``out_sizes`` (path → output size); a fused HF tensor (GPT-2's c_attn)
  holds its entries' outputs in name-map order."""
  groups: dict[str, list] = {}
  for e in hf_entries(cfg):
    if e.path in out_sizes and e.hf_name.endswith(".weight"):
      groups.setdefault(e.hf_name[: -len(".weight")], []).append(e.path)
  out = {}
  for module, paths in groups.items():
    total = sum(out_sizes[p] for p in paths)
    offset = 0
    for p in paths:
      out[p] = (module, offset, out_sizes[p], total)
      offset += out_sizes[p]
  return out


def save_peft(model, path: str | os.PathLike, *, base_model_name_or_path: str | None = None) -> None:
  """Write the adapters as a PEFT LoRA directory: ``adapter_config.json`` + ``adapter_model.safetensors``.

  ``peft.PeftModel.from_pretrained(transformers_base, path)`` then computes what ``model`` computes
  (on the unquantised base: a QLoRA model's adapters are exported as they are). Names are PEFT's
  (``base_model.model.<HF module>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]``,
  HF's flattened input/output order); ``lora_alpha = scale · r`` and ``use_rslora = false``, so
  PEFT's ``lora_alpha / r`` equals our scale whatever ``rslora`` was. GPT-2's fused ``c_attn``
  (our separate q, k, v) gets one adapter of rank ``r · #adapted`` with ``A = [A_q; A_k; A_v]``
  and a block-diagonal B (zero blocks for unadapted parts), declared in ``rank_pattern`` /
  ``alpha_pattern``: exact.

  Raises:
    ValueError: no adapters, a disabled adapter (a ``reference_model``), or adapters of one fused
      module with different scales.
  """
  _check_model(model)
  if model.scan_layers:
    return save_peft(to_loop_layers(model), path, base_model_name_or_path=base_model_name_or_path)
  adapted = [(t, t.adapter()) for t in _sites(model) if t.adapter() is not None]
  if not adapted:
    raise ValueError("model has no adapters to export")
  disabled = [s.dotted for s, a in adapted if not a.enabled]
  if disabled:
    raise ValueError(f"adapters {disabled[:4]} are disabled (a reference_model); export the policy model")
  sites = _sites(model)
  parts = _hf_module_parts(model.config, {t.path: math.prod(t.weight().shape[t.contract :]) for t in sites})
  modules: dict[str, list] = {}
  for s, a in adapted:
    module, offset, size, total = parts[s.path]
    modules.setdefault(module, []).append((offset, size, total, a))
  ranks = {m: sum(a.rank for *_, a in items) for m, items in modules.items()}
  scales = {}
  for m, items in modules.items():
    found = {a.scale for *_, a in items}
    if len(found) != 1:
      raise ValueError(f"{m}: its adapters have different scales {sorted(found)}; cannot export one PEFT adapter")
    scales[m] = found.pop()
  r = max(set(ranks.values()), key=list(ranks.values()).count)  # the most common rank
  default_scale = max(set(scales.values()), key=list(scales.values()).count)
  tensors = {}
  for m, items in modules.items():
    a_blocks, b_full = [], None
    row = 0
    for offset, size, total, a in items:
      a2 = np.asarray(jax.device_get(a.a.get_value())).reshape(-1, a.rank)  # [in, r]
      b2 = np.asarray(jax.device_get(a.b.get_value())).reshape(a.rank, -1)  # [r, size]
      if b_full is None:
        b_full = np.zeros((ranks[m], total), b2.dtype)
      a_blocks.append(a2)
      b_full[row : row + a.rank, offset : offset + size] = b2
      row += a.rank
    prefix = f"base_model.model.{m}"
    tensors[prefix + ".lora_A.weight"] = np.ascontiguousarray(np.concatenate(a_blocks, axis=1).T)  # [R, in]
    tensors[prefix + ".lora_B.weight"] = np.ascontiguousarray(b_full.T)  # [out, R]
  rank_pattern = {m: k for m, k in ranks.items() if k != r}
  alpha_pattern = {m: scales[m] * ranks[m] for m in modules if ranks[m] != r or scales[m] != default_scale}
  config = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": base_model_name_or_path,
    "r": r,
    "lora_alpha": default_scale * r,
    "use_rslora": False,
    "lora_dropout": max(a.dropout for _, a in adapted),
    "target_modules": sorted(modules),
    "rank_pattern": rank_pattern,
    "alpha_pattern": alpha_pattern,
    "fan_in_fan_out": isinstance(model.config, GPT2Config),  # GPT-2's Conv1D stores [in, out]
    "bias": "none",
    "inference_mode": True,
    "init_lora_weights": True,
    "modules_to_save": None,
  }
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)


_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# PEFT features with no counterpart here: refused by name rather than silently dropped
_PEFT_UNSUPPORTED = {
  "use_dora": (False, None),
  "modules_to_save": (None, []),
  "layers_to_transform": (None, []),
  "lora_bias": (False, None),
  "bias": ("none", None),
}


def _pattern_value(patterns: Mapping[str, Any], module: str, default):
  """PEFT's ``rank_pattern``/``alpha_pattern`` lookup: the first key that names ``module`` or a
  dotted suffix of it (``(.*\\.)?key$``), else ``default``."""
  for key, value in (patterns or {}).items():
    if re.match(rf"(.*\.)?({key})$", module):
      return value
  return default


def load_peft(model, path: str | os.PathLike, *, param_dtype=jnp.float32, rules: Mapping[str, Any] | None = None):
  """Add the adapters of a PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``,
  as ``peft`` saves them) to ``model`` in place — the inverse of :func:`save_peft`, for any LoRA
  adapter trained with ``peft`` on the same Hugging Face base (``model = models.load_hf(base)``).

  For a module ``m`` with ``lora_A [R, in]`` and ``lora_B [out, R]``, PEFT computes
  ``y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ`` with ``s = α_m / R`` (``α_m / √R`` with ``use_rslora``; ``α_m`` from
  ``alpha_pattern``, else ``lora_alpha``; R from the tensors, so ``rank_pattern`` needs no lookup).
  Each of our projections in ``m`` gets ``A = Aᵀ`` reshaped to ``[*C, R]`` and ``B`` = its output
  columns of ``Bᵀ`` reshaped to ``[R, *O]``, with ``scale = s``: exact (a fused HF module, GPT-2's
  ``c_attn``, gives q, k and v each the full rank-R ``A`` and its own columns of ``B``). Adapter
  dropout is ``lora_dropout`` (training only); A and B are stored in ``param_dtype`` and placed
  like :func:`apply_lora`'s. Returns ``model``.

  Raises:
    TypeError: ``model`` is not a ``jaxgrpo.models`` model.
    ValueError: naming the file or module: not a PEFT LoRA directory, a feature with no
      counterpart here (DoRA, biases, ``modules_to_save``, ``layers_to_transform``), a module that
      is not a projection of ``model`` (e.g. an embedding), tensor shapes that do not fit, or a
      model that already has adapters.
  """
  _check_model(model)
  if model.scan_layers:
    return _edit_layers(model, lambda m: load_peft(m, path, param_dtype=param_dtype, rules=rules))
  path = os.fspath(path)
  config_file = os.path.join(path, "adapter_config.json")
  weights_file = os.path.join(path, "adapter_model.safetensors")
  try:
    with open(config_file) as f:
      config = json.load(f)
  except OSError as e:
    raise ValueError(f"{config_file}: cannot read a PEFT adapter config ({e.strerror or e})") from None
  except ValueError as e:
    raise ValueError(f"{config_file} is not valid JSON: {e}") from None
  if config.get("peft_type") != "LORA":
    raise ValueError(f"{config_file}: peft_type={config.get('peft_type')!r}; only LORA adapters load")
  for key, allowed in _PEFT_UNSUPPORTED.items():
    if config.get(key, allowed[0]) not in allowed:
      raise ValueError(f"{config_file}: {key}={config[key]!r} has no counterpart in jaxgrpo.models.lora")
  if not os.path.exists(weights_file):
    raise ValueError(f"{path} has no adapter_model.safetensors (PEFT's safetensors format is the one read)")
  tensors = load_file(weights_file)
  pairs: dict[str, dict[str, np.ndarray]] = {}
  for key, value in tensors.items():
    m = _PEFT_KEY.match(key)
    if m is None:
      raise ValueError(
        f"{weights_file}: tensor {key!r} is not a LoRA A/B weight (base_model.model.<module>.lora_A/B.weight)"
      )
    pairs.setdefault(m["module"], {})[m["ab"]] = value
  if not pairs:
    raise ValueError(f"{weights_file} holds no LoRA tensors")
  sites = _sites(model)
  present = [s.dotted for s in sites if s.adapter() is not None]
  if present:
    raise ValueError(f"model already has adapters on {present[:4]}...; load_peft onto the base model")
  parts = _hf_module_parts(model.config, {t.path: math.prod(t.weight().shape[t.contract :]) for t in sites})
  by_module: dict[str, list] = {}
  for s in sites:
    module, offset, size, total = parts[s.path]
    by_module.setdefault(module, []).append((s, offset, size, total))
  unknown = sorted(set(pairs) - set(by_module))
  if unknown:
    raise ValueError(
      f"{weights_file}: modules {unknown[:4]} are not projections of this {type(model.config).__name__} model "
      f"(e.g. {sorted(by_module)[:3]}); only attention and MLP projections carry adapters here"
    )
  alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
  dropout = float(config.get("lora_dropout", 0.0) or 0.0)
  dtype = jnp.dtype(param_dtype)
  i = 0
  for module in sorted(pairs):
    ab = pairs[module]
    if set(ab) != {"A", "B"}:
      raise ValueError(f"{weights_file}: {module} has lora_{''.join(ab)} only; both lora_A and lora_B are needed")
    a_t, b_t = ab["A"].astype(np.float32), ab["B"].astype(np.float32)  # [R, in], [out, R]
    rank = a_t.shape[0]
    total = by_module[module][0][3]
    if a_t.ndim != 2 or b_t.shape != (total, rank):
      raise ValueError(
        f"{weights_file}: {module} has lora_A {a_t.shape} and lora_B {b_t.shape}; expected [R, in] and [{total}, R]"
      )
    scale = float(_pattern_value(config.get("alpha_pattern"), module, alpha)) / (math.sqrt(rank) if rslora else rank)
    for s, offset, size, _ in by_module[module]:
      shape, axes, like = _weight_info(s.weight())
      c_shape, o_shape = shape[: s.contract], shape[s.contract :]
      if math.prod(c_shape) != a_t.shape[1]:
        raise ValueError(f"{weights_file}: {module}.lora_A has {a_t.shape[1]} inputs; {s.dotted} takes {c_shape}")
      a = jnp.asarray(a_t.T.reshape(c_shape + (rank,)))
      b = jnp.asarray(b_t[offset : offset + size].T.reshape((rank,) + o_shape))
      a_axes = tuple(axes[: s.contract]) + (None,)
      b_axes = (None,) + tuple(axes[s.contract :])
      a = _place(a.astype(dtype), a_axes, like, rules, s.dotted + "_lora.a")
      b = _place(b.astype(dtype), b_axes, like, rules, s.dotted + "_lora.b")
      s.set(adapter=LoRA(a, b, a_axes=a_axes, b_axes=b_axes, scale=scale, dropout=dropout, stream=i))
      i += 1
  return model
