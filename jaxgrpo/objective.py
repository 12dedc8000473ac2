"""The edge where a :class:`~jaxgrpo.config.GRPOConfig` is unpacked into the pure kernels.

Two calls, matching the two time scales of GRPO training:

1. :func:`rollout_advantages` — once per rollout batch: outcome advantages, FRPO's future-KL
   advantage (from the rollout and reference log-probs, fixed across updates) and λ-GRPO's token
   weights ``1/|λ(i,t)|``.
2. :func:`objective_terms` — once per (micro-)batch update: the clipped surrogate with the per-token
   KL term when ``kl_placement="loss"``, returned as additive :class:`~jaxgrpo.losses.LossTerms`.

The train step and the binary-tree task both call these; research code may call the kernels directly.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxgrpo.advantages import group_advantages
from jaxgrpo.config import GRPOConfig
from jaxgrpo.kl import frpo_advantages, kl_penalty
from jaxgrpo.losses import LossTerms, policy_loss_terms
from jaxgrpo.process_sets import process_set_sizes


def rollout_advantages(
  config: GRPOConfig,
  rewards,
  tokens,
  mask,
  group_ids,
  num_groups: int,
  *,
  old_logp=None,
  ref_logp=None,
  max_group_size: int | None = None,
):
  """Advantages and token weights of one rollout batch.

  Args:
    config: the algorithm.
    rewards: ``f32[B]``; tokens: ``int32[B, T]``; mask: ``bool[B, T]``; group_ids: ``int32[B]``;
    num_groups: static int.
    old_logp, ref_logp: ``f32[B, T]`` rollout and reference log-probs; required for FRPO with β>0.
    max_group_size: static bound on group size for ``process_set_sizes`` (None: B).

  Returns:
    ``(advantages, token_weights)``: advantages ``f32[B]`` (GRPO family) or ``f32[B, T]`` (FRPO);
    token_weights ``f32[B, T]`` (``1/|λ|``, 0 on padding) or None.
  """
  adv = group_advantages(
    rewards, group_ids, num_groups, scale=config.advantage_scale, ddof=config.std_ddof, eps=config.std_eps
  )
  if config.kl_placement == "future" and config.beta > 0:
    if old_logp is None or ref_logp is None:
      raise ValueError(f"preset {config.name!r} (future-KL, beta={config.beta}) needs `old_logp` and `ref_logp`")
    adv = frpo_advantages(adv, old_logp, ref_logp, mask, beta=config.beta, kind=config.kl_estimator)
  weights = None
  if config.process_weights:
    sizes = process_set_sizes(tokens, mask, group_ids, max_group_size=max_group_size)
    weights = jnp.where(sizes > 0, 1.0 / jnp.maximum(sizes, 1), 0.0).astype(jnp.float32)
  return adv, weights


def objective_terms(
  config: GRPOConfig, logp, old_logp, advantages, mask, *, token_weights=None, ref_logp=None
) -> LossTerms:
  """The loss of one (micro-)batch under ``config`` as additive ``LossTerms``.

  Args:
    logp: ``f32[B, T]`` current policy (differentiable); old_logp: ``f32[B, T]`` rollout policy;
    advantages, token_weights: from :func:`rollout_advantages` (rows matching this micro-batch);
    mask: ``bool[B, T]``; ref_logp: ``f32[B, T]``, required when β>0 and ``kl_placement="loss"``.
  """
  kl = None
  if config.kl_placement == "loss" and config.beta > 0:
    if ref_logp is None:
      raise ValueError(f"preset {config.name!r} (beta={config.beta}, KL in the loss) needs `ref_logp`")
    kl = kl_penalty(logp, ref_logp, config.kl_estimator)
  return policy_loss_terms(
    logp,
    old_logp,
    advantages,
    mask,
    token_weights=token_weights,
    clip_eps_low=config.clip_eps_low,
    clip_eps_high=config.clip_eps_high,
    dual_clip=config.dual_clip,
    aggregation=config.aggregation,
    max_tokens=config.max_tokens,
    kl=kl,
    beta=config.beta,
  )
