"""Model configs: one frozen, keyword-only dataclass per family, built from a HF ``config.json``.
One job: describing an architecture (fields, HF defaults, checks); every built-in family's config is here so the
ports, the loader and the builders read them from one module (``config_from_hf`` finds a family's class through
``jaxgrpo.models.registry``, so a family registered from its own module is read the same way).

Common fields (all families): ``vocab_size`` (V), ``hidden_size`` (D), ``num_layers`` (L),
``num_heads`` (H), ``num_kv_heads`` (N, = H without GQA), ``head_dim`` (K),
``max_position_embeddings``, ``tie_word_embeddings``.

``LlamaConfig``, ``Qwen2Config`` and ``Qwen3Config`` drive one decoder implementation
(``jaxgrpo.models.llama``); they differ only in HF defaults and in two flags:
``qkv_bias``/``o_bias`` (Qwen2 has q/k/v biases) and ``qk_norm`` (Qwen3 per-head RMSNorm).

``Qwen3MoeConfig`` and ``Qwen2MoeConfig`` (mixtures of experts, ``jaxgrpo.models.moe``) extend the
Qwen3 / Qwen2 configs with the expert fields of :class:`_MoEFields`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, ClassVar

import numpy as np

from jaxgrpo.models.registry import config_class

__all__ = [
  "RopeScaling",
  "GPT2Config",
  "LlamaConfig",
  "Qwen2Config",
  "Qwen3Config",
  "Qwen2MoeConfig",
  "Qwen3MoeConfig",
  "ModelConfig",
  "config_from_hf",
]


def _check_positive(name: str, value: Any) -> None:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


def _tokens(value):
  """HF token ids may be int, list or None; store hashable (int | tuple | None)."""
  if isinstance(value, list):
    return tuple(value)
  return value


def _jsonable_tokens(value):
  return list(value) if isinstance(value, tuple) else value


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Llama-3 RoPE frequency scaling (HF ``rope_type="llama3"``).

  For each inverse frequency ``f`` with wavelength ``w = 2π/f``:
  ``w > original_max/low_freq_factor`` → ``f/factor``; ``w < original_max/high_freq_factor`` → ``f``;
  otherwise the smooth interpolation ``(1-s) f/factor + s f`` with
  ``s = (original_max/w - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
  """

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int

  def to_hf(self) -> dict:
    return {"rope_type": "llama3", **dataclasses.asdict(self)}


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
  """Inverse frequencies ``theta ** (-2i/K)`` for ``i < K/2`` (float32 [K/2]), llama3-scaled if given."""
  inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
  if scaling is None:
    return inv.astype(np.float32)
  low_wl = scaling.original_max_position_embeddings / scaling.low_freq_factor
  high_wl = scaling.original_max_position_embeddings / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wl, inv / scaling.factor, inv)
  smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
    scaling.high_freq_factor - scaling.low_freq_factor
  )
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  is_medium = (wavelen >= high_wl) & (wavelen <= low_wl)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config:
  """GPT-2 (learned positions, pre-LayerNorm, GELU-tanh MLP, MHA with biases).

  HF names: ``n_embd`` → hidden_size, ``n_layer`` → num_layers, ``n_head`` → num_heads,
  ``n_positions`` → max_position_embeddings, ``n_inner`` → intermediate_size (default 4D).
  """

  model_type: ClassVar[str] = "gpt2"
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  max_position_embeddings: int = 1024
  intermediate_size: int | None = None
  layer_norm_epsilon: float = 1e-5
  tie_word_embeddings: bool = True
  bos_token_id: int | tuple | None = None
  eos_token_id: int | tuple | None = None

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings"):
      _check_positive(name, getattr(self, name))
    if self.hidden_size % self.num_heads:
      raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
    if self.intermediate_size is None:
      object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
    _check_positive("intermediate_size", self.intermediate_size)

  @property
  def num_kv_heads(self) -> int:
    return self.num_heads

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @classmethod
  def from_hf(cls, d: dict) -> "GPT2Config":
    """Build from a HF GPT-2 ``config.json`` dict; rejects options this port does not implement."""
    act = d.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
      raise ValueError(f"GPT-2 activation_function={act!r} is not supported (only gelu_new)")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
      if d.get(flag, False):
        raise ValueError(f"GPT-2 {flag}=True is not supported")
    if not d.get("scale_attn_weights", True):
      raise ValueError("GPT-2 scale_attn_weights=False is not supported")
    return cls(
      vocab_size=d["vocab_size"],
      hidden_size=d["n_embd"],
      num_layers=d["n_layer"],
      num_heads=d["n_head"],
      max_position_embeddings=d.get("n_positions", 1024),
      intermediate_size=d.get("n_inner"),
      layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-5),
      tie_word_embeddings=d.get("tie_word_embeddings", True),
      bos_token_id=_tokens(d.get("bos_token_id")),
      eos_token_id=_tokens(d.get("eos_token_id")),
    )

  def to_hf(self) -> dict:
    """The HF ``config.json`` dict (``GPT2LMHeadModel``)."""
    return {
      "architectures": ["GPT2LMHeadModel"],
      "model_type": "gpt2",
      "vocab_size": self.vocab_size,
      "n_embd": self.hidden_size,
      "n_layer": self.num_layers,
      "n_head": self.num_heads,
      "n_positions": self.max_position_embeddings,
      "n_inner": self.intermediate_size,
      "activation_function": "gelu_new",
      "layer_norm_epsilon": self.layer_norm_epsilon,
      "tie_word_embeddings": self.tie_word_embeddings,
      "resid_pdrop": 0.0,
      "embd_pdrop": 0.0,
      "attn_pdrop": 0.0,
      "bos_token_id": _jsonable_tokens(self.bos_token_id),
      "eos_token_id": _jsonable_tokens(self.eos_token_id),
    }


def _rope_from_hf(d: dict) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) from either transformers>=5 ``rope_parameters`` or v4 ``rope_scaling``."""
  params = d.get("rope_parameters") or {}
  scaling = d.get("rope_scaling") or {}
  theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
  merged = {**scaling, **params}
  rope_type = merged.get("rope_type", merged.get("type", "default"))
  if rope_type == "default":
    return float(theta), None
  if rope_type == "llama3":
    return float(theta), RopeScaling(
      factor=float(merged["factor"]),
      low_freq_factor=float(merged["low_freq_factor"]),
      high_freq_factor=float(merged["high_freq_factor"]),
      original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
    )
  raise ValueError(f"rope_type={rope_type!r} is not supported (only 'default' and 'llama3')")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
  """Llama 3.x: pre-RMSNorm decoder with GQA, SwiGLU MLP and (llama3-scaled) RoPE.

  Flags shared with the Qwen subclasses: ``qkv_bias`` (biases on q/k/v projections),
  ``o_bias`` (bias on the output projection), ``mlp_bias``, ``qk_norm`` (RMSNorm over K of each
  q and k head before RoPE, Qwen3).
  """

  model_type: ClassVar[str] = "llama"
  architecture: ClassVar[str] = "LlamaForCausalLM"
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int | None = None
  head_dim: int | None = None
  intermediate_size: int
  max_position_embeddings: int = 2048
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  bos_token_id: int | tuple | None = None
  eos_token_id: int | tuple | None = None

  def __post_init__(self):
    if self.num_kv_heads is None:
      object.__setattr__(self, "num_kv_heads", self.num_heads)
    if self.head_dim is None:
      if self.hidden_size % self.num_heads:
        raise ValueError(
          f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; give head_dim"
        )
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    for name in (
      "vocab_size",
      "hidden_size",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "intermediate_size",
      "max_position_embeddings",
    ):
      _check_positive(name, getattr(self, name))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

  @classmethod
  def _flags_from_hf(cls, d: dict) -> dict:
    bias = bool(d.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(d.get("mlp_bias", False)), "qk_norm": False}

  @classmethod
  def from_hf(cls, d: dict):
    """Build from a HF ``config.json`` dict (transformers 4.x or 5.x rope keys)."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"hidden_act={act!r} is not supported (only silu)")
    if d.get("use_sliding_window", False):
      raise ValueError("use_sliding_window=True is not supported")
    theta, scaling = _rope_from_hf(d)
    return cls(
      vocab_size=d["vocab_size"],
      hidden_size=d["hidden_size"],
      num_layers=d["num_hidden_layers"],
      num_heads=d["num_attention_heads"],
      num_kv_heads=d.get("num_key_value_heads"),
      head_dim=d.get("head_dim"),
      intermediate_size=d["intermediate_size"],
      max_position_embeddings=d.get("max_position_embeddings", 2048),
      rms_norm_eps=d.get("rms_norm_eps", 1e-6),
      rope_theta=theta,
      rope_scaling=scaling,
      tie_word_embeddings=d.get("tie_word_embeddings", False),
      bos_token_id=_tokens(d.get("bos_token_id")),
      eos_token_id=_tokens(d.get("eos_token_id")),
      **cls._flags_from_hf(d),
    )

  def _flags_to_hf(self) -> dict:
    if self.qkv_bias != self.o_bias or self.qk_norm:
      raise ValueError(
        f"{type(self).__name__} cannot express qkv_bias={self.qkv_bias}, "
        f"o_bias={self.o_bias}, qk_norm={self.qk_norm} in a HF config"
      )
    return {"attention_bias": self.qkv_bias, "mlp_bias": self.mlp_bias}

  def to_hf(self) -> dict:
    """The HF ``config.json`` dict (transformers 5 ``rope_parameters`` plus v4 ``rope_theta``)."""
    rope = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.rope_scaling is not None:
      rope = {**self.rope_scaling.to_hf(), "rope_theta": self.rope_theta}
    return {
      "architectures": [self.architecture],
      "model_type": self.model_type,
      "vocab_size": self.vocab_size,
      "hidden_size": self.hidden_size,
      "num_hidden_layers": self.num_layers,
      "num_attention_heads": self.num_heads,
      "num_key_value_heads": self.num_kv_heads,
      "head_dim": self.head_dim,
      "intermediate_size": self.intermediate_size,
      "max_position_embeddings": self.max_position_embeddings,
      "rms_norm_eps": self.rms_norm_eps,
      "hidden_act": "silu",
      "rope_theta": self.rope_theta,
      "rope_parameters": rope,
      "tie_word_embeddings": self.tie_word_embeddings,
      "attention_dropout": 0.0,
      "bos_token_id": _jsonable_tokens(self.bos_token_id),
      "eos_token_id": _jsonable_tokens(self.eos_token_id),
      **self._flags_to_hf(),
    }

  def rope_inv_freq(self) -> np.ndarray:
    """float32 [K/2] inverse RoPE frequencies (llama3-scaled when ``rope_scaling`` is set)."""
    return rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen2Config(LlamaConfig):
  """Qwen2 / Qwen2.5: the Llama decoder with biases on q/k/v (not on o)."""

  model_type: ClassVar[str] = "qwen2"
  architecture: ClassVar[str] = "Qwen2ForCausalLM"
  qkv_bias: bool = True

  @classmethod
  def _flags_from_hf(cls, d: dict) -> dict:
    return {"qkv_bias": True, "o_bias": False, "mlp_bias": False, "qk_norm": False}

  def _flags_to_hf(self) -> dict:
    if not self.qkv_bias or self.o_bias or self.mlp_bias or self.qk_norm:
      raise ValueError("Qwen2Config must have qkv_bias=True, o_bias=mlp_bias=qk_norm=False for HF export")
    return {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3Config(LlamaConfig):
  """Qwen3: the Llama decoder with per-head q/k RMSNorm and an explicit ``head_dim``."""

  model_type: ClassVar[str] = "qwen3"
  architecture: ClassVar[str] = "Qwen3ForCausalLM"
  qk_norm: bool = True

  @classmethod
  def _flags_from_hf(cls, d: dict) -> dict:
    bias = bool(d.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True}

  def _flags_to_hf(self) -> dict:
    if self.qkv_bias != self.o_bias or not self.qk_norm or self.mlp_bias:
      raise ValueError("Qwen3Config must have qk_norm=True, qkv_bias == o_bias, mlp_bias=False for HF export")
    return {"attention_bias": self.qkv_bias}


@dataclasses.dataclass(frozen=True, kw_only=True)
class _MoEFields:
  """The mixture-of-experts fields shared by ``Qwen3MoeConfig`` and ``Qwen2MoeConfig`` (HF names).

  A layer i is sparse (a ``jaxgrpo.models.moe.MoEBlock``) iff ``i not in mlp_only_layers`` and
  ``(i + 1) % decoder_sparse_step == 0``; otherwise it has the dense SwiGLU of width
  ``intermediate_size``. A sparse layer routes each token to ``num_experts_per_tok`` (k) of
  ``num_experts`` (E) SwiGLU experts of width ``moe_intermediate_size`` (Fe):
  ``p = softmax(x·W_router)`` (float32), the k largest ``p_e`` weight the experts' outputs,
  renormalised to sum 1 when ``norm_topk_prob``. ``shared_expert_intermediate_size`` > 0 (Qwen2-MoE)
  adds an always-on SwiGLU expert gated by ``sigmoid(x·w_shared_gate)``. ``router_aux_loss_coef`` is
  the HF default coefficient of the load-balancing loss (informational: the train step's
  ``TrainConfig.router_aux_loss`` decides).
  """

  num_experts: int = 8
  num_experts_per_tok: int = 2
  moe_intermediate_size: int = 64
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  shared_expert_intermediate_size: int = 0
  router_aux_loss_coef: float = 0.001

  def _check_moe(self) -> None:
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
      _check_positive(name, getattr(self, name))
    if self.num_experts_per_tok > self.num_experts:
      raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
    if not isinstance(self.shared_expert_intermediate_size, int) or self.shared_expert_intermediate_size < 0:
      raise ValueError(
        f"shared_expert_intermediate_size must be an int >= 0, got {self.shared_expert_intermediate_size!r}"
      )
    layers = tuple(int(i) for i in self.mlp_only_layers)
    if any(not 0 <= i < self.num_layers for i in layers):
      raise ValueError(f"mlp_only_layers={list(layers)} must index layers in [0, {self.num_layers})")
    object.__setattr__(self, "mlp_only_layers", tuple(sorted(set(layers))))

  def is_moe_layer(self, i: int) -> bool:
    """Whether layer ``i`` is sparse (HF's rule, see the class docstring)."""
    return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """The indices of the sparse layers, in order (M = len of it)."""
    return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

  @staticmethod
  def _moe_from_hf(d: dict) -> dict:
    experts = d.get("num_experts", d.get("num_local_experts"))
    if experts is None:
      raise ValueError("a MoE config.json needs num_experts (or num_local_experts)")
    if d.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act={d.get('hidden_act')!r} is not supported (only silu)")
    return dict(
      num_experts=experts,
      num_experts_per_tok=d["num_experts_per_tok"],
      moe_intermediate_size=d["moe_intermediate_size"],
      norm_topk_prob=bool(d.get("norm_topk_prob", False)),
      decoder_sparse_step=d.get("decoder_sparse_step", 1),
      mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
      router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
    )

  def _moe_to_hf(self) -> dict:
    return {
      "num_experts": self.num_experts,
      "num_experts_per_tok": self.num_experts_per_tok,
      "moe_intermediate_size": self.moe_intermediate_size,
      "norm_topk_prob": self.norm_topk_prob,
      "decoder_sparse_step": self.decoder_sparse_step,
      "mlp_only_layers": list(self.mlp_only_layers),
      "router_aux_loss_coef": self.router_aux_loss_coef,
      "output_router_logits": False,
      "use_sliding_window": False,
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig(_MoEFields, Qwen3Config):
  """Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B): the Qwen3 decoder whose sparse layers
  are routed experts (:class:`_MoEFields`); no shared expert."""

  model_type: ClassVar[str] = "qwen3_moe"
  architecture: ClassVar[str] = "Qwen3MoeForCausalLM"

  def __post_init__(self):
    super().__post_init__()
    self._check_moe()
    if self.shared_expert_intermediate_size:
      raise ValueError("Qwen3MoeConfig has no shared expert: shared_expert_intermediate_size must be 0")

  @classmethod
  def from_hf(cls, d: dict):
    base = super().from_hf(d)
    return dataclasses.replace(base, **cls._moe_from_hf(d))

  def to_hf(self) -> dict:
    return {**super().to_hf(), **self._moe_to_hf()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen2MoeConfig(_MoEFields, Qwen2Config):
  """Qwen2-MoE (``Qwen2MoeForCausalLM``, Qwen1.5-MoE): the Qwen2 decoder (q/k/v biases, HF's
  ``qkv_bias``) whose sparse layers are routed experts plus a shared expert of width
  ``shared_expert_intermediate_size`` gated by a sigmoid (:class:`_MoEFields`)."""

  model_type: ClassVar[str] = "qwen2_moe"
  architecture: ClassVar[str] = "Qwen2MoeForCausalLM"

  def __post_init__(self):
    super().__post_init__()
    self._check_moe()

  @classmethod
  def _flags_from_hf(cls, d: dict) -> dict:
    return {"qkv_bias": bool(d.get("qkv_bias", True)), "o_bias": False, "mlp_bias": False, "qk_norm": False}

  def _flags_to_hf(self) -> dict:
    if self.o_bias or self.mlp_bias or self.qk_norm:
      raise ValueError("Qwen2MoeConfig must have o_bias=mlp_bias=qk_norm=False for HF export")
    return {"qkv_bias": self.qkv_bias}

  @classmethod
  def from_hf(cls, d: dict):
    base = super().from_hf(d)
    shared = d.get("shared_expert_intermediate_size", 0) or 0
    return dataclasses.replace(base, **cls._moe_from_hf(d), shared_expert_intermediate_size=shared)

  def to_hf(self) -> dict:
    return {
      **super().to_hf(),
      **self._moe_to_hf(),
      "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
    }


ModelConfig = GPT2Config | LlamaConfig


def config_from_hf(config: dict | str | os.PathLike) -> ModelConfig:
  """Config of the right family from a HF config dict, a ``config.json`` path or a model directory: the config
  class registered for its ``model_type`` (``jaxgrpo.models.registry.config_class``).

  Raises ValueError on a missing or unsupported ``model_type``.
  """
  where = "the config"
  if not isinstance(config, dict):
    path = where = os.fspath(config)
    if os.path.isdir(path):
      path = where = os.path.join(path, "config.json")
    with open(path) as f:
      try:
        config = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
  model_type = config.get("model_type")
  cls = config_class(model_type)  # the registered families' (jaxgrpo.models.registry)
  try:
    return cls.from_hf(config)
  except KeyError as e:  # a required field: name it and the file, not a bare 'hidden_size'
    raise ValueError(
      f"{where}: missing the key {e.args[0]!r}, which a model_type={model_type!r} config needs "
      f"(re-save it with transformers' save_pretrained, or add the key)"
    ) from None
