"""Model ports (GPT-2, Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE, Qwen2-MoE) in Flax NNX, and HF checkpoint I/O.

Each family is one entry of the registry (``jaxgrpo.models.registry``: config class, model class, HF name map, LoRA
sites, what the engine and the reward model support); the built-in entries are ``jaxgrpo.models.families``,
imported here, and ``register_family`` adds one (docs/models.md, "Adding a model family").

See docs/models.md for the call contract (config, call signature, KV cache, log_probs, checkpoints)
and for LoRA / QLoRA (``jaxgrpo.models.lora``: adapters, quantised base weights, merge;
``jaxgrpo.models.lora_peft``: PEFT adapter directories, out and in).
"""

from __future__ import annotations

from jaxgrpo.models import families  # noqa: F401  (registers the built-in families)
from jaxgrpo.models.attention import KVCache, put_cache_rows, repeat_cache, set_attention, take_cache_rows
from jaxgrpo.models.base import (
  CausalLM,
  RematPolicy,
  positions_from_mask,
  positions_from_segments,
  to_loop_layers,
  to_scan_layers,
)
from jaxgrpo.models.build import build_model
from jaxgrpo.models.config import (
  GPT2Config,
  LlamaConfig,
  ModelConfig,
  Qwen2Config,
  Qwen2MoeConfig,
  Qwen3Config,
  Qwen3MoeConfig,
  RopeScaling,
  config_from_hf,
)
from jaxgrpo.models.gpt2 import GPT2Model
from jaxgrpo.models.hf import DEFAULT_RULES, load_hf, load_tokenizer, logical_to_spec, save_hf
from jaxgrpo.models.layers import LOGICAL_AXES
from jaxgrpo.models.llama import LlamaModel
from jaxgrpo.models.log_probs import (
  chunked_log_probs,
  completion_log_probs,
  log_probs,
  packed_log_probs,
  token_log_probs,
)
from jaxgrpo.models.lora import LoRAConfig, apply_lora, merge_lora, reference_model
from jaxgrpo.models.lora_peft import save_peft
from jaxgrpo.models.moe import MoEModel, routing_scope
from jaxgrpo.models.registry import Family, family_of, register_family

__all__ = [
  "CausalLM",
  "DEFAULT_RULES",
  "Family",
  "GPT2Config",
  "GPT2Model",
  "KVCache",
  "LOGICAL_AXES",
  "LlamaConfig",
  "LlamaModel",
  "LoRAConfig",
  "MoEModel",
  "ModelConfig",
  "Qwen2Config",
  "Qwen2MoeConfig",
  "Qwen3Config",
  "Qwen3MoeConfig",
  "RematPolicy",
  "RopeScaling",
  "apply_lora",
  "build_model",
  "chunked_log_probs",
  "completion_log_probs",
  "config_from_hf",
  "family_of",
  "load_hf",
  "load_tokenizer",
  "log_probs",
  "logical_to_spec",
  "merge_lora",
  "packed_log_probs",
  "positions_from_mask",
  "positions_from_segments",
  "put_cache_rows",
  "register_family",
  "reference_model",
  "repeat_cache",
  "routing_scope",
  "save_hf",
  "save_peft",
  "take_cache_rows",
  "to_loop_layers",
  "to_scan_layers",
  "set_attention",
  "token_log_probs",
]
