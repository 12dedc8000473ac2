"""Outcome advantages over groups of completions: GRPO, Dr.GRPO, batch-scaled GRPO and RLOO.

Layout: ``rewards f32[B]`` (one outcome reward per trajectory), ``group_ids int32[B]`` (which prompt
each trajectory answers; any order, unequal group sizes allowed), ``num_groups`` a static Python int
with every id in ``[0, num_groups)``.

All functions are pure and jit/vmap/grad compatible. A group whose rewards are all equal, and a group
of one, get advantage 0 — never NaN — and finite gradients (every division is guarded twice).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgrpo import _checks

ADVANTAGE_SCALES = ("group", "batch", "none")


def _segment_sum(x, group_ids, num_groups):
  return jax.ops.segment_sum(x, group_ids, num_segments=num_groups)


def _safe_div(num, den):
  """num / den, and 0 where den == 0 (gradients finite there too)."""
  ok = den != 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def _safe_sqrt(x):
  ok = x > 0
  return jnp.where(ok, jnp.sqrt(jnp.where(ok, x, 1.0)), 0.0)


def _check_rewards(rewards, group_ids, num_groups):
  _checks.check_rank(rewards, 1, "rewards", "float32[B]")
  _checks.check_float(rewards, "rewards", "float32[B]")
  _checks.check_group_ids(group_ids, rewards.shape[0], num_groups)


def group_baseline(rewards, group_ids, num_groups: int, *, scale: str = "group", ddof: int = 0, eps: float = 1e-6):
  """Per-trajectory baseline and scale of GRPO-style normalisation.

  Returns ``(mean, denom)``, both ``f32[B]``, such that the advantage is ``(r - mean) / denom``:

  - ``mean[i] = mean_{j in g(i)} r_j``
  - ``scale="group"``: ``denom[i] = std_{g(i)}(r; ddof) + eps``
  - ``scale="batch"``: ``denom[i] = std_{batch}(r; ddof) + eps`` (std of the raw rewards over the whole
    batch, as TRL's ``scale_rewards="batch"``)
  - ``scale="none"``: ``denom = 1`` (Dr.GRPO)

  ``denom`` is 1 where it would be 0 (``eps=0`` and zero variance), so the advantage is 0 there.
  Used by :func:`group_advantages` and by ``process_advantages`` (which normalises step rewards by
  the same group statistics).
  """
  _check_rewards(rewards, group_ids, num_groups)
  _checks.check_choice(scale, ADVANTAGE_SCALES, "scale")
  if ddof < 0:
    raise ValueError(f"`ddof` must be >= 0; got {ddof}")
  if eps < 0:
    raise ValueError(f"`eps` must be >= 0; got {eps}")
  r = rewards.astype(jnp.float32)
  counts = _segment_sum(jnp.ones_like(r), group_ids, num_groups)  # [num_groups]
  mean_g = _safe_div(_segment_sum(r, group_ids, num_groups), counts)  # [num_groups]
  mean = mean_g[group_ids]  # [B]
  if scale == "none":
    return mean, jnp.ones_like(r)
  if scale == "group":
    sq = _segment_sum((r - mean) ** 2, group_ids, num_groups)
    var = _safe_div(sq, jnp.maximum(counts - ddof, 0.0))[group_ids]
  else:  # batch
    n = r.shape[0]
    var = _safe_div(jnp.sum((r - jnp.mean(r)) ** 2), jnp.float32(max(n - ddof, 0)))
    var = jnp.broadcast_to(var, r.shape)
  denom = _safe_sqrt(var) + eps
  return mean, jnp.where(denom > 0, denom, 1.0)


def group_advantages(rewards, group_ids, num_groups: int, *, scale: str = "group", ddof: int = 0, eps: float = 1e-6):
  """GRPO outcome advantages ``a_i = (r_i - mean_g) / (std_g + eps)``.

  Args:
    rewards: ``f32[B]`` outcome reward per trajectory.
    group_ids: ``int32[B]`` group (prompt) of each trajectory, in ``[0, num_groups)``.
    num_groups: static number of groups (an upper bound is fine: empty groups are ignored).
    scale: ``"group"`` (GRPO, DeepSeekMath), ``"batch"`` (std over the whole batch) or ``"none"``
      (Dr.GRPO: ``a_i = r_i - mean_g``).
    ddof: delta degrees of freedom of the std. Default 0 (population std, as FRPO); the λ-GRPO
      authors' code and TRL use 1.
    eps: added to the std. Default 1e-6 (verl, Tunix); TRL uses 1e-4.

  Returns:
    ``f32[B]``. Zero-variance groups and singleton groups give exactly 0.
  """
  mean, denom = group_baseline(rewards, group_ids, num_groups, scale=scale, ddof=ddof, eps=eps)
  return (rewards.astype(jnp.float32) - mean) / denom


def rloo_advantages(rewards, group_ids, num_groups: int):
  """REINFORCE leave-one-out advantages ``a_i = r_i - mean_{j in g(i), j != i} r_j``.

  Args:
    rewards: ``f32[B]``; group_ids: ``int32[B]`` in ``[0, num_groups)``; num_groups: static int.

  Returns:
    ``f32[B]``; 0 for singleton groups (no other member to form a baseline).
  """
  _check_rewards(rewards, group_ids, num_groups)
  r = rewards.astype(jnp.float32)
  counts = _segment_sum(jnp.ones_like(r), group_ids, num_groups)[group_ids]
  totals = _segment_sum(r, group_ids, num_groups)[group_ids]
  others = _safe_div(totals - r, counts - 1.0)
  return jnp.where(counts > 1, r - others, 0.0)
