"""Outcome advantages over groups of completions: GRPO, Dr.GRPO, batch-scaled GRPO and RLOO.

Layout: ``rewards f32[B]`` (one outcome reward per trajectory), ``group_ids int32[B]`` (which prompt
each trajectory answers; any order, unequal group sizes allowed), ``num_groups`` a static Python int
with every id in ``[0, num_groups)``.

**Missing rewards.** A non-finite reward (NaN, +inf or -inf: a verifier that crashed, a reward
function that divided by zero) is a *missing sample*, everywhere in the library:

- it is excluded from every statistic — the group means, stds and counts, and the batch std of
  ``scale="batch"`` — as if the trajectory had not been sampled;
- its advantage is exactly 0 (so its tokens add nothing to the policy-gradient term), with finite
  gradients;
- :func:`num_missing` counts them, for the metrics (the train step reports it).

Finite rewards of any magnitude are valid values: a reward of 1e30 is an outlier its group is
normalised by, not a missing sample. The statistics are computed on rewards rescaled by a power of
two, so a huge reward cannot overflow the variance and silently zero the advantages of the rest of
its group; the rescaling is exact in floating point, so ordinary rewards give the numbers of the
direct formulas.

A group whose rewards are all equal, a group of one (after removing missing samples) and an empty
group give advantage 0 — never NaN — and finite gradients (every division is guarded twice).

Every public function here is jitted (``num_groups``, ``scale``, ``ddof``, ``eps`` static): a direct
call costs what it costs inside ``jit`` after the first call; calling it inside an outer ``jit`` works.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxgrpo import _checks
from jaxgrpo.kernels._numerics import pow2_scale, safe_div, safe_sqrt, select

__all__ = [
  "ADVANTAGE_SCALES",
  "group_advantages",
  "group_baseline",
  "rloo_advantages",
  "is_missing",
  "num_missing",
]

ADVANTAGE_SCALES = ("group", "batch", "none")


# ----------------------------------------------------------------------------- checks


def _check_rewards(rewards, group_ids, num_groups) -> int:
  _checks.check_rank(rewards, 1, "rewards", "f32[B]")
  _checks.check_float(rewards, "rewards", "f32[B]")
  _checks.check_group_ids(group_ids, _checks.shape_of(rewards)[0], num_groups)
  return _checks.check_python_int(num_groups, "num_groups", minimum=1, hint="static number of groups")


def _check_stats(scale, ddof, eps) -> tuple[str, int, float]:
  scale = _checks.check_choice(scale, ADVANTAGE_SCALES, "scale")
  ddof = _checks.check_python_int(ddof, "ddof", minimum=0, hint="delta degrees of freedom of the std")
  eps = _checks.check_python_float(eps, "eps", at_least=0.0, hint="added to the std")
  return scale, ddof, eps


# ----------------------------------------------------------------------------- missing rewards


@jax.jit
def is_missing(rewards):
  """``bool[B]``: True where a reward is missing (NaN or ±inf); see the module docstring.

  Args:
    rewards: ``f32[B]`` (any shape).
  """
  return ~jnp.isfinite(rewards)


@jax.jit
def num_missing(rewards):
  """``int32[]``: the number of missing (non-finite) rewards — the metric of the missing-sample policy.

  Args:
    rewards: ``f32[B]`` (any shape).
  """
  return jnp.sum(~jnp.isfinite(rewards), dtype=jnp.int32)


# ----------------------------------------------------------------------------- group statistics


def _segment_sum(x, group_ids, num_groups):
  return jax.ops.segment_sum(x, group_ids, num_segments=num_groups)


def _baseline(rewards, group_ids, num_groups, scale, ddof, eps):
  """``(mean f32[B], denom f32[B], valid bool[B])`` over the valid (finite) rewards."""
  r = rewards.astype(jnp.float32)
  valid = jnp.isfinite(r)
  r = select(valid, r, 0.0)  # missing samples never enter the arithmetic
  counts = _segment_sum(valid.astype(jnp.float32), group_ids, num_groups)  # [num_groups]
  # Rescale each group by a power of two >= its largest |r|: exact, and no overflow in the squares.
  s_g = pow2_scale(jax.ops.segment_max(jnp.abs(r), group_ids, num_segments=num_groups))  # [num_groups]
  s_g = jnp.where(counts > 0, s_g, 1.0)  # segment_max of an empty group is -inf
  s = s_g[group_ids]  # [B]
  mean_g = safe_div(_segment_sum(r / s, group_ids, num_groups), counts)  # in units of s_g
  # A group of equal rewards has mean exactly that reward and std 0 (advantage 0): the f32 sum of n
  # equal values, divided by n, may miss it by an ulp (16 x 0.7), which eps = 1e-6 turns into a spurious
  # advantage of ~0.1. Take the value itself there.
  hi_g = jax.ops.segment_max(select(valid, r / s, -jnp.inf), group_ids, num_segments=num_groups)
  lo_g = jax.ops.segment_min(select(valid, r / s, jnp.inf), group_ids, num_segments=num_groups)
  mean_g = jnp.where((counts > 0) & (hi_g == lo_g), hi_g, mean_g)
  mean = (mean_g * s_g)[group_ids]  # [B]
  if scale == "none":
    return mean, jnp.ones_like(r), valid
  if scale == "group":
    dev = select(valid, r / s - mean_g[group_ids], 0.0)
    var = safe_div(_segment_sum(dev**2, group_ids, num_groups), jnp.maximum(counts - ddof, 0.0))
    std = (safe_sqrt(var) * s_g)[group_ids]
  else:  # batch: the std of the valid rewards of the whole batch
    n = jnp.sum(valid.astype(jnp.float32))
    sb = pow2_scale(jnp.max(jnp.abs(r), initial=0.0))
    mean_b = safe_div(jnp.sum(r / sb), n)
    hi_b = jnp.max(select(valid, r / sb, -jnp.inf), initial=-jnp.inf)
    mean_b = jnp.where((n > 0) & (hi_b == jnp.min(select(valid, r / sb, jnp.inf), initial=jnp.inf)), hi_b, mean_b)
    var = safe_div(jnp.sum(select(valid, r / sb - mean_b, 0.0) ** 2), jnp.maximum(n - ddof, 0.0))
    std = jnp.broadcast_to(safe_sqrt(var) * sb, r.shape)
  denom = std + eps
  return mean, jnp.where(denom > 0, denom, 1.0), valid


def standardize(x, mean, denom):
  """``(x - mean) / denom`` elementwise (broadcasting), finite for every finite input.

  Past 2**120 the direct quotient can overflow (``x - mean``) or lose ``1 / denom`` to a flushed
  subnormal; there it is taken in units of a power of two of the operands' size, which is exact
  wherever the direct one is finite, so ordinary values are bit-identical to ``(x - mean) / denom``.
  """
  s = pow2_scale(jnp.maximum(jnp.maximum(jnp.abs(x), jnp.abs(mean)), denom))
  huge = s >= 2.0**120
  direct = (select(~huge, x) - select(~huge, mean)) / denom
  s = select(huge, s, 1.0)
  # The barrier keeps XLA from folding a / (b / s) back into a * s / b, which overflows again.
  xs, ms, ds = jax.lax.optimization_barrier((select(huge, x) / s, select(huge, mean) / s, select(huge, denom, 1.0) / s))
  scaled = (xs - ms) / ds
  return jnp.where(huge, scaled, direct)


@functools.partial(jax.jit, static_argnames=("num_groups", "scale", "ddof", "eps"))
def _group_baseline(rewards, group_ids, *, num_groups, scale, ddof, eps):
  mean, denom, _ = _baseline(rewards, group_ids, num_groups, scale, ddof, eps)
  return mean, denom


@functools.partial(jax.jit, static_argnames=("num_groups", "scale", "ddof", "eps"))
def _group_advantages(rewards, group_ids, *, num_groups, scale, ddof, eps):
  mean, denom, valid = _baseline(rewards, group_ids, num_groups, scale, ddof, eps)
  r = select(valid, rewards.astype(jnp.float32), 0.0)
  return select(valid, standardize(r, mean, denom), 0.0)


def group_baseline(rewards, group_ids, num_groups: int, *, scale: str = "group", ddof: int = 0, eps: float = 1e-6):
  """Per-trajectory baseline and scale of GRPO-style normalisation.

  Returns ``(mean, denom)``, both ``f32[B]``, such that the advantage is ``(r - mean) / denom``,
  computed over the *valid* (finite) rewards only — missing samples are excluded (module docstring):

  - ``mean[i] = mean_{j in g(i), r_j finite} r_j``
  - ``scale="group"``: ``denom[i] = std_{g(i)}(r; ddof) + eps``
  - ``scale="batch"``: ``denom[i] = std_{batch}(r; ddof) + eps`` (std of the raw rewards over the whole
    batch, as TRL's ``scale_rewards="batch"``)
  - ``scale="none"``: ``denom = 1`` (Dr.GRPO)

  ``denom`` is 1 where it would be 0 (``eps=0`` and zero variance), so the advantage is 0 there. A
  row whose own reward is missing still gets its group's statistics (finite); applying them is the
  caller's job (``group_advantages`` and ``process_advantages`` give such rows advantage 0).

  Args:
    rewards, group_ids, num_groups, scale, ddof, eps: as in :func:`group_advantages`.
  """
  num_groups = _check_rewards(rewards, group_ids, num_groups)
  scale, ddof, eps = _check_stats(scale, ddof, eps)
  return _group_baseline(rewards, group_ids, num_groups=num_groups, scale=scale, ddof=ddof, eps=eps)


def group_advantages(rewards, group_ids, num_groups: int, *, scale: str = "group", ddof: int = 0, eps: float = 1e-6):
  """GRPO outcome advantages ``a_i = (r_i - mean_g) / (std_g + eps)`` (DeepSeekMath, arXiv:2402.03300).

  Args:
    rewards: ``f32[B]`` outcome reward per trajectory; NaN/±inf marks a missing sample (excluded
      from the statistics, advantage 0).
    group_ids: ``int32[B]`` group (prompt) of each trajectory, in ``[0, num_groups)``.
    num_groups: static number of groups (an upper bound is fine: empty groups are ignored).
    scale: ``"group"`` (GRPO, DeepSeekMath), ``"batch"`` (std over the whole batch) or ``"none"``
      (Dr.GRPO, arXiv:2503.20783: ``a_i = r_i - mean_g``).
    ddof: delta degrees of freedom of the std. Default 0 (population std, as FRPO); the λ-GRPO
      authors' code and TRL use 1.
    eps: added to the std. Default 1e-6 (verl, Tunix); TRL uses 1e-4.

  Returns:
    ``f32[B]``. Zero-variance groups, singleton groups and missing samples give exactly 0.
  """
  num_groups = _check_rewards(rewards, group_ids, num_groups)
  scale, ddof, eps = _check_stats(scale, ddof, eps)
  return _group_advantages(rewards, group_ids, num_groups=num_groups, scale=scale, ddof=ddof, eps=eps)


@functools.partial(jax.jit, static_argnames=("num_groups",))
def _rloo_advantages(rewards, group_ids, *, num_groups):
  r = rewards.astype(jnp.float32)
  valid = jnp.isfinite(r)
  r = select(valid, r, 0.0)
  counts = _segment_sum(valid.astype(jnp.float32), group_ids, num_groups)[group_ids]
  totals = _segment_sum(r, group_ids, num_groups)[group_ids]
  others = safe_div(totals - r, counts - 1.0)
  return select(valid & (counts > 1), r - others, 0.0)


def rloo_advantages(rewards, group_ids, num_groups: int):
  """REINFORCE leave-one-out advantages ``a_i = r_i - mean_{j in g(i), j != i} r_j`` (Ahmadian et al.,
  arXiv:2402.14740).

  Args:
    rewards: ``f32[B]``, NaN/±inf marking a missing sample (not one of the "others"; advantage 0).
    group_ids: ``int32[B]`` in ``[0, num_groups)``.
    num_groups: static int.

  Returns:
    ``f32[B]``; 0 for missing samples and for groups with a single valid member (no other member to
    form a baseline).
  """
  num_groups = _check_rewards(rewards, group_ids, num_groups)
  return _rloo_advantages(rewards, group_ids, num_groups=num_groups)
