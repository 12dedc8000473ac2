"""Model ports (GPT-2, Llama 3.x, Qwen2/2.5, Qwen3) in Flax NNX, and HF checkpoint I/O.

See docs/models.md for the call contract (config, call signature, KV cache, log_probs, checkpoints)
and for LoRA / QLoRA (``jaxgrpo.models.lora``: adapters, quantised base weights, merge, export).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxgrpo.models.base import CausalLM, positions_from_mask
from jaxgrpo.models.config import (
  GPT2Config,
  LlamaConfig,
  ModelConfig,
  Qwen2Config,
  Qwen3Config,
  RopeScaling,
  config_from_hf,
)
from jaxgrpo.models.gpt2 import GPT2Model
from jaxgrpo.models.hf import DEFAULT_RULES, load_hf, load_tokenizer, logical_to_spec, save_hf
from jaxgrpo.models.layers import LOGICAL_AXES, KVCache, repeat_cache
from jaxgrpo.models.llama import LlamaModel
from jaxgrpo.models.log_probs import log_probs, token_log_probs
from jaxgrpo.models.lora import LoRAConfig, apply_lora, merge_lora, reference_model, save_peft


def build_model(
  cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32, remat: bool = False
) -> CausalLM:
  """A randomly initialised model of ``cfg``'s family.

  Args:
    cfg: ``GPT2Config`` → ``GPT2Model``; ``LlamaConfig``/``Qwen2Config``/``Qwen3Config`` → ``LlamaModel``.
    rngs: ``nnx.Rngs`` with a ``params`` stream (weights ~ N(0, 0.02²), biases 0, norm scales 1).
    dtype: compute dtype (activations, matmul inputs, KV cache). Softmax, norms and log-probs are
      float32 regardless.
    param_dtype: storage dtype of the parameters.
    remat: checkpoint each layer's activations (``jax.checkpoint`` per layer): the backward pass recomputes them,
      trading one extra forward for O(L) less activation memory. Same values and gradients.
  """
  if isinstance(cfg, GPT2Config):
    return GPT2Model(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype, remat=remat)
  if isinstance(cfg, LlamaConfig):
    return LlamaModel(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype, remat=remat)
  raise TypeError(f"cfg must be one of GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config; got {type(cfg).__name__}")


__all__ = [
  "CausalLM",
  "DEFAULT_RULES",
  "GPT2Config",
  "GPT2Model",
  "KVCache",
  "LOGICAL_AXES",
  "LlamaConfig",
  "LlamaModel",
  "LoRAConfig",
  "ModelConfig",
  "Qwen2Config",
  "Qwen3Config",
  "RopeScaling",
  "apply_lora",
  "build_model",
  "config_from_hf",
  "load_hf",
  "load_tokenizer",
  "log_probs",
  "logical_to_spec",
  "merge_lora",
  "positions_from_mask",
  "reference_model",
  "repeat_cache",
  "save_hf",
  "save_peft",
  "token_log_probs",
]
