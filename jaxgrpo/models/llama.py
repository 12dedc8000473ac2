"""One decoder for Llama 3.x, Qwen2/2.5 and Qwen3 (flags on the config, one code path).

Per layer: ``x += attn(rms_1(x))``, ``x += down(silu(rms_2(x)·gate) * (rms_2(x)·up))``;
attention is GQA with RoPE (llama3 frequency scaling when configured), optional q/k/v biases
(Qwen2), optional per-head q/k RMSNorm before RoPE (Qwen3); ``hidden = rms_f(x)``.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.models.attention import Attention
from jaxgrpo.models.base import CausalLM, RematPolicy, check_scan_layers, freeze_rules, stack_blocks
from jaxgrpo.models.config import LlamaConfig
from jaxgrpo.models.layers import (
  MLP_AXES,
  TABLE_AXES,
  RMSNorm,
  forward_mode_active,
  param,
  project,
  shard_activation,
)

__all__ = ["LlamaModel"]


@jax.custom_vjp
def swiglu(g: jax.Array, u: jax.Array) -> jax.Array:
  """``silu(g) * u`` (the same forward pass), whose backward pass keeps only ``g`` and ``u``, with
  ``s = sigmoid(g)``::

      ∂/∂g = ct · u · s · (1 + g · (1 − s)),     ∂/∂u = ct · g · s

  (autodiff also keeps ``sigmoid(g)`` / ``silu(g)``, ``[B, S, F]`` each: the compiled train step
  holds ~6% less temporary memory with this rule)."""
  return jax.nn.silu(g) * u


def _swiglu_fwd(g, u):
  return swiglu(g, u), (g, u)


def _swiglu_bwd(residuals, ct):
  g, u = residuals
  s = jax.nn.sigmoid(g)
  return ct * u * s * (1 + g * (1 - s)), ct * g * s


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class SwiGLU(nnx.Module):
  """``(silu(x·gate) * (x·up))·down``; gate, up [D,F] ("embed","mlp"); down [F,D] ("mlp","embed").

  Adapters: ``gate_lora``, ``up_lora``, ``down_lora`` (``LoRA`` or None).
  """

  PROJECTIONS = {"gate": 1, "up": 1, "down": 1}  # name -> contracted dims

  def __init__(self, cfg: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    D, F = cfg.hidden_size, cfg.intermediate_size
    self.dtype = dtype
    self.gate = param(rngs.params(), (D, F), ("embed", "mlp"), param_dtype)
    self.up = param(rngs.params(), (D, F), ("embed", "mlp"), param_dtype)
    self.down = param(rngs.params(), (F, D), ("mlp", "embed"), param_dtype)
    if cfg.mlp_bias:
      self.gate_bias = param(None, (F,), ("mlp",), param_dtype, init="zeros")
      self.up_bias = param(None, (F,), ("mlp",), param_dtype, init="zeros")
      self.down_bias = param(None, (D,), ("embed",), param_dtype, init="zeros")
    else:
      self.gate_bias = self.up_bias = self.down_bias = None
    self.gate_lora = self.up_lora = self.down_lora = nnx.data(None)

  def __call__(self, x, dropout_key=None):
    kw = dict(dtype=self.dtype, dropout_key=dropout_key)
    g = project(x, self.gate, self.gate_bias, self.gate_lora, **kw)
    u = project(x, self.up, self.up_bias, self.up_lora, **kw)
    h = jax.nn.silu(g) * u if forward_mode_active() else swiglu(g, u)  # plain autodiff: jvp-able
    h = shard_activation(h, MLP_AXES, "MLP hidden")  # [B, S, F]
    return project(h, self.down, self.down_bias, self.down_lora, **kw)


class LlamaBlock(nnx.Module):
  """A pre-RMSNorm decoder layer: ``x += attn(rms_1(x))``; ``x += mlp(rms_2(x))``, x: dtype[B, S, D].

  ``__call__(x, positions int32[B, S], segment_ids, kv, valid, index, dropout_key)`` returns
  ``(x [B, S, D], kv)`` (``Attention.__call__`` for the cache arguments).
  """

  def __init__(self, cfg: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    self._init_attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.mlp = SwiGLU(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def _init_attention(self, cfg: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs) -> None:
    """``input_norm``, ``attn``, ``post_attention_norm``: the part every Llama-style layer shares."""
    kw = dict(eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
    self.input_norm = RMSNorm(cfg.hidden_size, **kw)
    self.attn = Attention(
      hidden_size=cfg.hidden_size,
      num_heads=cfg.num_heads,
      num_kv_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
      qkv_bias=cfg.qkv_bias,
      o_bias=cfg.o_bias,
      qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
      inv_freq=cfg.rope_inv_freq(),
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    self.post_attention_norm = RMSNorm(cfg.hidden_size, **kw)

  def _attend(self, x, positions, segment_ids, kv, valid, index, dropout_key):
    """``(x + attn(rms_1(x)), kv)``: the attention half of the layer."""
    y, kv = self.attn(self.input_norm(x), positions, segment_ids, kv, valid, index, dropout_key)
    return x + y, kv

  def __call__(self, x, positions, segment_ids, kv, valid, index, dropout_key=None):
    x, kv = self._attend(x, positions, segment_ids, kv, valid, index, dropout_key)
    return x + self.mlp(self.post_attention_norm(x), dropout_key), kv


class LlamaModel(CausalLM):
  """Llama / Qwen2 / Qwen3 causal LM. See ``CausalLM.__call__`` for the call contract.

  Parameters: embed_tokens [V,D] ("vocab","embed"), per layer the ``LlamaBlock`` weights,
  final_norm, and lm_head [D,V] ("embed","vocab") only when untied.
  """

  def __init__(
    self,
    config: LlamaConfig,
    *,
    rngs: nnx.Rngs,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    remat: RematPolicy | str | bool = False,
    rules: Mapping[str, Any] | None = None,
    scan_layers: bool = False,
  ):
    if not isinstance(config, LlamaConfig):
      raise TypeError(f"config must be a LlamaConfig/Qwen2Config/Qwen3Config, got {type(config).__name__}")
    self.config = config
    self.dtype = dtype
    self.remat, self.sharding_rules = RematPolicy.parse(remat), freeze_rules(rules)
    V, D = config.vocab_size, config.hidden_size
    self.embed_tokens = param(rngs.params(), (V, D), ("vocab", "embed"), param_dtype)
    blocks = [LlamaBlock(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for _ in range(config.num_layers)]
    self.scan_layers = check_scan_layers(scan_layers)
    self.layers = stack_blocks(blocks) if scan_layers else nnx.List(blocks)
    self.final_norm = RMSNorm(D, eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
    self.lm_head = None if config.tie_word_embeddings else param(rngs.params(), (D, V), ("embed", "vocab"), param_dtype)

  def _embed(self, tokens, positions):
    del positions  # RoPE is applied inside attention
    table = shard_activation(self.embed_tokens[...], TABLE_AXES, "embedding table")  # [V, D]
    return jnp.take(table, tokens, axis=0).astype(self.dtype)
