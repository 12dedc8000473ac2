"""Analytic FLOPs and HBM bytes of the programs a GRPO run executes, from the model's shape.

Not ``compiled.cost_analysis()``: XLA counts the body of a loop once (the scanned layers, the micro-batch scan,
the decode ``while_loop``), 3% of the analytic count for a Qwen3-8B step. Model FLOPs, PaLM-style, no
recomputation counted (remat adds one forward; MFU's convention): with ``N`` the matmul parameters a token
passes through (attention projections and MLP of every layer; a mixture of experts: its top-k experts and the
router), ``D`` hidden, ``V`` vocabulary, ``L`` layers, ``H`` heads of ``K``, ``S = P + T``:

- forward of B rows: ``2·N·B·S + 2·D·V·B·T + 2·L·H·K·S²·B`` (causal attention: half the ``4·L·H·K·S²`` of
  ``QKᵀ`` and ``AV``; the head only over the T completion positions);
- train step: 3x the forward (forward + backward), times μ (``num_iterations``) passes;
- reference / π_old pass: 1x the forward;
- sampler: the prefill of ``B/G`` prompts (``2·N·(B/G)·P + 2·L·H·K·P²·(B/G) + 2·D·V·B/G``) and T decode steps of
  B rows (``2·N·B + 2·D·V·B + 4·L·H·K·(P + t)·B`` at step t).
"""

from __future__ import annotations

__all__ = ["active_matmul_params", "decode_hbm_bytes", "forward_flops", "sampler_flops", "step_flops"]


def active_matmul_params(cfg) -> int:
  """``N``: the matmul weights one token passes through (embeddings and the head excluded; a mixture of experts:
  ``num_experts_per_tok`` experts and the router)."""
  d, h, k, kv = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_kv_heads
  attn = 2 * d * h * k + 2 * d * kv * k
  total = 0
  for i in range(cfg.num_layers):
    moe = hasattr(cfg, "num_experts") and cfg.is_moe_layer(i)
    if moe:
      mlp = 3 * d * cfg.moe_intermediate_size * cfg.num_experts_per_tok + d * cfg.num_experts
      mlp += 3 * d * getattr(cfg, "shared_expert_intermediate_size", 0)
    else:
      mlp = 3 * d * cfg.intermediate_size
    total += attn + mlp
  return total


def forward_flops(cfg, rows: int, prompt: int, completion: int) -> float:
  """One forward pass over ``rows`` rows of ``prompt + completion`` positions (log-probs of the completion)."""
  s = prompt + completion
  n, d, v = active_matmul_params(cfg), cfg.hidden_size, cfg.vocab_size
  attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * s * s * rows
  return 2.0 * n * rows * s + 2.0 * d * v * rows * completion + attn


def step_flops(cfg, rows: int, prompt: int, completion: int, passes: int = 1) -> float:
  """The train step: forward + backward (3x the forward) per pass, ``passes`` = μ."""
  return 3.0 * passes * forward_flops(cfg, rows, prompt, completion)


def sampler_flops(cfg, prompts: int, group: int, prompt: int, new_tokens: int) -> float:
  """The sampler: the prefill of ``prompts`` prompts, then ``new_tokens`` decode steps of ``prompts·group`` rows."""
  n, d, v = active_matmul_params(cfg), cfg.hidden_size, cfg.vocab_size
  lhk = cfg.num_layers * cfg.num_heads * cfg.head_dim
  prefill = 2.0 * n * prompts * prompt + 2.0 * lhk * prompt * prompt * prompts + 2.0 * d * v * prompts
  rows = prompts * group
  decode = new_tokens * (2.0 * n * rows + 2.0 * d * v * rows) + 4.0 * lhk * rows * sum(
    prompt + t for t in range(new_tokens)
  )
  return prefill + decode


def decode_hbm_bytes(cfg, weight_bytes: float, rows: int, prompt: int, new_tokens: int, kv_bytes: int = 2) -> float:
  """HBM bytes the T decode steps read at least: ``weight_bytes`` once per step (what one device reads of the
  weights: all of them under FSDP, which gathers each layer) and each row's KV cache so far."""
  kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_bytes
  return new_tokens * weight_bytes + rows * kv_per_token * sum(prompt + t for t in range(new_tokens))
