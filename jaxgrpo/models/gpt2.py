"""GPT-2: learned positions, pre-LayerNorm blocks, GELU-tanh ("gelu_new") MLP, MHA with biases.

``x = wte[tokens] + wpe[positions]``; per block ``x += attn(ln_1(x))``, ``x += mlp(ln_2(x))`` with
``mlp(h) = gelu_tanh(h·W_fc + b_fc)·W_proj + b_proj``; ``hidden = ln_f(x)``.
HF's fused ``c_attn`` Conv1D weight [D, 3D] is split into q/k/v [D, H, K] by the checkpoint loader.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo.models.attention import Attention
from jaxgrpo.models.base import CausalLM, RematPolicy, check_scan_layers, freeze_rules, stack_blocks
from jaxgrpo.models.config import GPT2Config
from jaxgrpo.models.layers import MLP_AXES, TABLE_AXES, LayerNorm, param, project, shard_activation

__all__ = ["GPT2Model"]


class GPT2MLP(nnx.Module):
  """``gelu_tanh(x·fc + fc_bias)·proj + proj_bias``; fc [D,F] ("embed","mlp"), proj [F,D] ("mlp","embed").

  Adapters: ``fc_lora``, ``proj_lora`` (``LoRA`` or None).
  """

  PROJECTIONS = {"fc": 1, "proj": 1}  # name -> contracted dims

  def __init__(self, cfg: GPT2Config, *, dtype, param_dtype, rngs: nnx.Rngs):
    D, F = cfg.hidden_size, cfg.intermediate_size
    self.dtype = dtype
    self.fc = param(rngs.params(), (D, F), ("embed", "mlp"), param_dtype)
    self.fc_bias = param(None, (F,), ("mlp",), param_dtype, init="zeros")
    self.proj = param(rngs.params(), (F, D), ("mlp", "embed"), param_dtype)
    self.proj_bias = param(None, (D,), ("embed",), param_dtype, init="zeros")
    self.fc_lora = self.proj_lora = nnx.data(None)

  def __call__(self, x, dropout_key=None):
    kw = dict(dtype=self.dtype, dropout_key=dropout_key)
    h = jax.nn.gelu(project(x, self.fc, self.fc_bias, self.fc_lora, **kw), approximate=True)
    h = shard_activation(h, MLP_AXES, "MLP hidden")  # [B, S, F]
    return project(h, self.proj, self.proj_bias, self.proj_lora, **kw)


class GPT2Block(nnx.Module):
  def __init__(self, cfg: GPT2Config, *, dtype, param_dtype, rngs: nnx.Rngs):
    kw = dict(eps=cfg.layer_norm_epsilon, dtype=dtype, param_dtype=param_dtype)
    self.ln_1 = LayerNorm(cfg.hidden_size, **kw)
    self.attn = Attention(
      hidden_size=cfg.hidden_size,
      num_heads=cfg.num_heads,
      num_kv_heads=cfg.num_heads,
      head_dim=cfg.head_dim,
      qkv_bias=True,
      o_bias=True,
      qk_norm_eps=None,
      inv_freq=None,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    self.ln_2 = LayerNorm(cfg.hidden_size, **kw)
    self.mlp = GPT2MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x, positions, segment_ids, kv, valid, index, dropout_key=None):
    y, kv = self.attn(self.ln_1(x), positions, segment_ids, kv, valid, index, dropout_key)
    x = x + y
    return x + self.mlp(self.ln_2(x), dropout_key), kv


class GPT2Model(CausalLM):
  """GPT-2 causal LM. See ``CausalLM.__call__`` for the call contract.

  Parameters: embed_tokens [V,D] ("vocab","embed"), wpe [P,D] (None,"embed"), per layer the
  ``GPT2Block`` weights, final_norm, and lm_head [D,V] ("embed","vocab") only when untied.
  """

  def __init__(
    self,
    config: GPT2Config,
    *,
    rngs: nnx.Rngs,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    remat: RematPolicy | str | bool = False,
    rules: Mapping[str, Any] | None = None,
    scan_layers: bool = False,
  ):
    if not isinstance(config, GPT2Config):
      raise TypeError(f"config must be a GPT2Config, got {type(config).__name__}")
    self.config = config
    self.dtype = dtype
    self.remat, self.sharding_rules = RematPolicy.parse(remat), freeze_rules(rules)
    V, D, P = config.vocab_size, config.hidden_size, config.max_position_embeddings
    self.embed_tokens = param(rngs.params(), (V, D), ("vocab", "embed"), param_dtype)
    self.wpe = param(rngs.params(), (P, D), (None, "embed"), param_dtype, stddev=0.01)
    blocks = [GPT2Block(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for _ in range(config.num_layers)]
    self.scan_layers = check_scan_layers(scan_layers)
    self.layers = stack_blocks(blocks) if scan_layers else nnx.List(blocks)
    self.final_norm = LayerNorm(D, eps=config.layer_norm_epsilon, dtype=dtype, param_dtype=param_dtype)
    self.lm_head = None if config.tie_word_embeddings else param(rngs.params(), (D, V), ("embed", "vocab"), param_dtype)

  def _embed(self, tokens, positions):
    table = shard_activation(self.embed_tokens[...], TABLE_AXES, "embedding table")  # [V, D]
    wpe = shard_activation(self.wpe[...], (None, None), "position table")  # [P, D]
    x = jnp.take(table, tokens, axis=0) + jnp.take(wpe, positions, axis=0)
    return x.astype(self.dtype)
