"""``build_model``: a randomly initialised model of a config's family (below ``hf.py``, which loads into it)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxgrpo.models.base import CausalLM
from jaxgrpo.models.config import GPT2Config, LlamaConfig, ModelConfig
from jaxgrpo.models.gpt2 import GPT2Model
from jaxgrpo.models.llama import LlamaModel

__all__ = ["build_model"]


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
    remat: checkpoint each layer's activations (``nnx.remat``): the backward pass recomputes them,
      trading one extra forward for O(L) less activation memory. Same values and gradients.

  Raises:
    TypeError: ``cfg`` is not one of the supported config classes.
  """
  if isinstance(cfg, GPT2Config):
    return GPT2Model(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype, remat=remat)
  if isinstance(cfg, LlamaConfig):
    return LlamaModel(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype, remat=remat)
  raise TypeError(f"cfg must be one of GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config; got {type(cfg).__name__}")
