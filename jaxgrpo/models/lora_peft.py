"""PEFT adapter directories: :func:`save_peft` writes a model's LoRA adapters as ``peft`` saves them,
:func:`load_peft` adds the adapters of any PEFT LoRA directory to a model — the Hugging Face side of
``jaxgrpo.models.lora`` (which re-exports both).

One job: mapping our adapter sites (``jaxgrpo.models._lora_sites``) to PEFT's module names and tensor layouts
(``base_model.model.<HF module>.lora_A/B.weight``, HF's flattened input/output order, GPT-2's fused ``c_attn``),
both ways, exactly. The merged export (one plain HF checkpoint) is ``lora.merge_lora`` then ``models.save_hf``.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxgrpo.models._lora_sites import adapter_sites, check_model, edit_layers, place_like, weight_info
from jaxgrpo.models.base import to_loop_layers
from jaxgrpo.models.hf import hf_entries
from jaxgrpo.models.layers import LoRA
from jaxgrpo.models.registry import family_of

__all__ = ["save_peft", "load_peft"]


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
  check_model(model)
  if model.scan_layers:
    return save_peft(to_loop_layers(model), path, base_model_name_or_path=base_model_name_or_path)
  adapted = [(t, t.adapter()) for t in adapter_sites(model) if t.adapter() is not None]
  if not adapted:
    raise ValueError("model has no adapters to export")
  disabled = [s.dotted for s, a in adapted if not a.enabled]
  if disabled:
    raise ValueError(f"adapters {disabled[:4]} are disabled (a reference_model); export the policy model")
  sites = adapter_sites(model)
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
    "fan_in_fan_out": family_of(model.config).hf_conv1d,  # GPT-2's Conv1D stores [in, out]
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
  check_model(model)
  if model.scan_layers:
    return edit_layers(model, lambda m: load_peft(m, path, param_dtype=param_dtype, rules=rules))
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
  sites = adapter_sites(model)
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
      shape, axes, like = weight_info(s.weight())
      c_shape, o_shape = shape[: s.contract], shape[s.contract :]
      if math.prod(c_shape) != a_t.shape[1]:
        raise ValueError(f"{weights_file}: {module}.lora_A has {a_t.shape[1]} inputs; {s.dotted} takes {c_shape}")
      a = jnp.asarray(a_t.T.reshape(c_shape + (rank,)))
      b = jnp.asarray(b_t[offset : offset + size].T.reshape((rank,) + o_shape))
      a_axes = tuple(axes[: s.contract]) + (None,)
      b_axes = (None,) + tuple(axes[s.contract :])
      a = place_like(a.astype(dtype), a_axes, like, rules, s.dotted + "_lora.a")
      b = place_like(b.astype(dtype), b_axes, like, rules, s.dotted + "_lora.b")
      s.set(adapter=LoRA(a, b, a_axes=a_axes, b_axes=b_axes, scale=scale, dropout=dropout, stream=i))
      i += 1
  return model
