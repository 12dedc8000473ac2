"""``build_model``: a randomly initialised model of a config's family (``jaxgrpo.models.registry``; below ``hf.py``,
which loads into it)."""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
from flax import nnx

from jaxgrpo.models.attention import check_implementation, set_attention
from jaxgrpo.models.base import CausalLM, RematPolicy
from jaxgrpo.models.config import ModelConfig
from jaxgrpo.models.registry import family_of

__all__ = ["build_model"]


def build_model(
  cfg: ModelConfig,
  *,
  rngs: nnx.Rngs,
  dtype=jnp.float32,
  param_dtype=jnp.float32,
  remat: RematPolicy | str | bool = False,
  rules: Mapping[str, Any] | None = None,
  scan_layers: bool = False,
  attention: str = "auto",
) -> CausalLM:
  """A randomly initialised model of ``cfg``'s family.

  Args:
    cfg: a config of a registered family (``jaxgrpo.models.registry``), built by its ``Family.model``:
      ``GPT2Config`` → ``GPT2Model``; ``LlamaConfig``/``Qwen2Config``/``Qwen3Config`` → ``LlamaModel``;
      ``Qwen3MoeConfig``/``Qwen2MoeConfig`` → ``jaxgrpo.models.moe.MoEModel``.
    rngs: ``nnx.Rngs`` with a ``params`` stream (weights ~ N(0, 0.02²), biases 0, norm scales 1).
    dtype: compute dtype (activations, matmul inputs, KV cache). Softmax, norms and log-probs are
      float32 regardless.
    param_dtype: storage dtype of the parameters.
    remat: per-layer activation checkpointing (``nnx.remat``), a ``RematPolicy`` or its name:
      ``"none"`` (store everything), ``"full"`` (store each layer's input, recompute the layer in the
      backward pass: one extra forward for O(L) less activation memory), ``"dots"`` (store matmul
      outputs), ``"dots_no_batch"`` (store the projections, recompute attention scores). ``True`` /
      ``False`` are aliases of ``"full"`` / ``"none"``. Same values and gradients for every policy.
    rules: logical axis → mesh axes for the activation constraints, applied only under a context
      mesh (``with jax.set_mesh(mesh):``); None: ``jaxgrpo.parallel.sharding.DEFAULT_RULES``. Use the same
      table as for the parameters. Stored as ``model.sharding_rules`` (``model.rules`` as a dict).
    scan_layers: store the L layers' parameters stacked on a leading axis (logical axis
      ``"layers"``, never on a mesh axis) and run them as one ``jax.lax.scan`` (remat inside the
      scanned body): the layer is compiled once instead of L times (docs/models.md, "Layers as a
      scan"). Same weights for the same ``rngs`` and the same outputs as the loop. A MoE model
      scans when every layer is sparse (e.g. Qwen3-30B-A3B; ValueError naming the dense layers otherwise).
    attention: the attention implementation of every layer (``jaxgrpo.models.attention.IMPLEMENTATIONS``):
      ``"auto"`` (dense below ``AUTO_MIN_LENGTH`` = 512 query rows, the target platform's kernel from it on),
      ``"dense"``, ``"blockwise"`` (every platform), ``"splash"`` (TPU), ``"cudnn"`` (GPU); docs/models.md,
      "Attention implementations". Same values on real tokens; set later with ``set_attention(model, name)``.

  Raises:
    TypeError: ``cfg`` is not a config of a registered family.
    ValueError: ``scan_layers`` with a MoE config that has dense layers (``mlp_only_layers``, ``decoder_sparse_step``).
  """
  check_implementation(attention, "attention")
  kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, remat=remat, rules=rules, scan_layers=scan_layers)
  return set_attention(family_of(cfg).model(cfg, **kw), attention)
