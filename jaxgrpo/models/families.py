"""The built-in model families: one registry entry each (``jaxgrpo.models.registry``: what each field means).

Llama, Qwen2 and Qwen3 share one decoder and one name map (their configs differ in defaults and flags);
Qwen2-MoE and Qwen3-MoE share the expert decoder. Imported by ``jaxgrpo.models``, so the entries exist before
any lookup. A new family is registered the same way from its own module (docs/models.md, "Adding a model family").
"""

from __future__ import annotations

from jaxgrpo.models import hf
from jaxgrpo.models.attention import Attention
from jaxgrpo.models.config import GPT2Config, LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig
from jaxgrpo.models.gpt2 import GPT2MLP, GPT2Model
from jaxgrpo.models.llama import LlamaModel, SwiGLU
from jaxgrpo.models.moe import MoEModel
from jaxgrpo.models.registry import Family, register_family

__all__ = ["BUILTIN"]

_DENSE = dict(
  model=LlamaModel, hf_names=hf.llama_entries, lora_modules=(Attention, SwiGLU), vllm=True, reward_model=True
)
_MOE = dict(model=MoEModel, hf_names=hf.moe_entries, lora_modules=(Attention, SwiGLU), vllm=True, experts=True)

#: the built-in families, in registration order
BUILTIN = (
  Family(
    config=GPT2Config,
    model=GPT2Model,
    hf_names=hf.gpt2_entries,
    lora_modules=(Attention, GPT2MLP),
    hf_conv1d=True,
    vllm=True,
  ),
  Family(config=LlamaConfig, **_DENSE),
  Family(config=Qwen2Config, **_DENSE),
  Family(config=Qwen3Config, **_DENSE),
  Family(config=Qwen2MoeConfig, **_MOE),
  Family(config=Qwen3MoeConfig, **_MOE),
)

for _family in BUILTIN:
  register_family(_family)
