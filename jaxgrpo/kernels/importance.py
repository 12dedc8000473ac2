"""Off-policy correction for a rollout/trainer mismatch: truncated and masked importance sampling.

The rollout's tokens were sampled by a *behaviour* policy μ (another inference engine, another dtype,
an older checkpoint) whose log-probs ``behavior_logp`` differ from the trainer's own log-probs of the
rollout policy, ``old_logp`` (π_old, what the PPO ratio is taken against). The per-token policy term
is then reweighted by ``v(i,t) = sg(g(r))`` with ``r = π_old / μ`` on the sampled tokens:

=============  =============  ============================================================================
correction     level          ``v(i,t)``
=============  =============  ============================================================================
``"tis"``      ``"token"``    ``min(r_t, C)``, ``r_t = exp(old_logp − behavior_logp)`` (truncated IS)
``"tis"``      ``"sequence"`` ``min(r_i, C)`` on every token of row i, ``r_i = Π_t r_t = exp(Σ_t (old − behavior))``
``"mis"``      ``"token"``    ``r_t`` if ``r_t <= C`` else 0 (masked IS: the token leaves the numerator)
``"mis"``      ``"sequence"`` ``r_i`` if ``r_i <= C`` else 0 on every token of row i
``"icepop"``   ``"token"``    ``r_t`` if ``L <= r_t <= C`` else 0 (two-sided token masking, IcePop)
``"icepop"``   ``"sequence"`` ``r_i`` if ``L <= r_i <= C`` else 0 on every token of row i
``"seq_mask"`` (sequence)     1 on every token of row i if ``L <= ρ_i <= C`` else 0, with the geometric mean
                              ``ρ_i = exp(Σ_t m·(old − behavior) / Σ_t m)`` (sequence-level masking)
=============  =============  ============================================================================

``L`` is the lower bound of the band ``[L, C]`` (``low``; read by ``icepop`` and ``seq_mask`` only). IcePop
(inclusionAI, Ring-1T, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model",
arXiv:2510.18855, its ``M(k; α, β) = k`` for ``α <= k <= β`` else 0 on ``k = π_train/π_infer`` of the
sampled token) discards the tokens whose training/inference probabilities disagree by more than the band
in *either* direction, keeping the ratio as the weight inside it; MIS is its one-sided form. The
sequence-level masking drops a whole row when the geometric mean of its token ratios leaves the band —
the length-normalised ratio, so a long row is not rejected for its length alone (verl's geometric rejection
sampling, ``rollout_rs="geometric"``; Liu et al. below, part 3) — and keeps the others unweighted (a
rejection, no reweighting). ``ratio`` reports ``ρ_i`` on its tokens there, and ``capped`` marks every
token of a dropped row.

``C`` is the cap. The sequence ratio is the product of the token ratios, as TRL's
``vllm_importance_sampling_mode="sequence_*"`` and verl's ``rollout_is="sequence"``; log-ratios are
clamped to ±20 before ``exp`` (verl's safety bound). Masked tokens keep their place in the
aggregation's denominator (their weight is 0, as in TRL and verl's ``rollout_is`` with a lower/upper
threshold); the weights never carry a gradient. TIS: Yao et al., "Your Efficient RL Framework Secretly
Brings You Off-Policy RL Training" (2025); MIS / IcePop: Liu et al., "When Speed Kills Stability:
Demystifying RL Collapse from the Training-Inference Mismatch" (2025).

The mismatch itself is measured by ``k3 = r − log r − 1`` per sampled token (an estimator of
KL(μ ‖ π_old) under μ's samples, verl's ``rollout_corr/k3_kl``), ``jaxgrpo.kernels.kl.kl_penalty(old_logp,
behavior_logp, "forward_k3")``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgrpo import _checks
from jaxgrpo.kernels import _hyper
from jaxgrpo.kernels._numerics import select
from jaxgrpo.kernels.kl import kl_penalty

__all__ = [
  "BAND_CORRECTIONS",
  "CORRECTIONS",
  "IMPORTANCE_LEVELS",
  "DEFAULT_LOW",
  "MAX_LOG_WEIGHT",
  "ImportanceWeights",
  "importance_weights",
  "mismatch_k3",
]

CORRECTIONS = ("tis", "mis", "icepop", "seq_mask")
#: the corrections that read the band's lower bound ``low``
BAND_CORRECTIONS = ("icepop", "seq_mask")
IMPORTANCE_LEVELS = ("token", "sequence")
MAX_LOG_WEIGHT = 20.0
#: the band's default lower bound L (IcePop's α = 0.5)
DEFAULT_LOW = 0.5


class ImportanceWeights(NamedTuple):
  """Off-policy correction of one batch (every field without gradient, 0/False on padding).

  Attributes:
    weights: ``f32[B, T]`` the weight ``v(i,t)`` multiplying the per-token policy term.
    ratio: ``f32[B, T]`` the raw ratio r before the cap (token level: ``r_t``; sequence level: ``r_i``
      on each of row i's tokens), ``exp`` of a log-ratio clamped to ±20.
    capped: ``bool[B, T]`` tokens whose ratio exceeded the cap (truncated for TIS, masked for MIS) or left the
      band ``[low, cap]`` (masked: ``icepop``, every token of a dropped row for ``seq_mask``).
    mismatch_kl: ``f32[B, T]`` ``k3 = r_t − log r_t − 1`` per token, the behaviour/rollout mismatch.
  """

  weights: jax.Array
  ratio: jax.Array
  capped: jax.Array
  mismatch_kl: jax.Array


def _importance(old_logp, behavior_logp, mask, *, correction, level, cap, low) -> ImportanceWeights:
  sg = jax.lax.stop_gradient
  real = mask
  old = select(real, sg(old_logp.astype(jnp.float32)))
  behavior = select(real, sg(behavior_logp.astype(jnp.float32)))
  log_r = old - behavior  # [B, T], 0 on padding
  if correction == "seq_mask":  # the geometric mean: the row's mean log-ratio (0 for an empty row)
    n = jnp.sum(real, axis=1, keepdims=True).astype(jnp.float32)
    log_r = jnp.broadcast_to(jnp.sum(log_r, axis=1, keepdims=True) / jnp.maximum(n, 1.0), log_r.shape)
  elif level == "sequence":
    log_r = jnp.broadcast_to(jnp.sum(log_r, axis=1, keepdims=True), log_r.shape)
  ratio = select(real, jnp.exp(jnp.clip(log_r, -MAX_LOG_WEIGHT, MAX_LOG_WEIGHT)))
  outside = (ratio > cap) | (ratio < low) if correction in BAND_CORRECTIONS else ratio > cap
  capped = real & outside
  if correction == "tis":
    weights = jnp.minimum(ratio, cap)
  elif correction == "seq_mask":
    weights = jnp.where(capped, 0.0, 1.0)
  else:  # mis, icepop: the ratio inside, 0 outside
    weights = jnp.where(capped, 0.0, ratio)
  mismatch = kl_penalty(old, behavior, "forward_k3", mask=real)
  return ImportanceWeights(select(real, weights), ratio, capped, select(real, mismatch))


_importance_jit = _hyper.jit(_importance, static_argnames=("correction", "level"), numbers=("cap", "low"))


def check_hyper(correction, level, cap, low=None) -> dict:
  """The hyper-parameters, checked: ``correction``/``level`` static, ``cap`` and ``low`` Python floats (static)
  or arrays (traced, range-checked when concrete); ``low`` only with a band correction (``icepop``,
  ``seq_mask``: None there is :data:`DEFAULT_LOW`), below ``cap`` when both are concrete."""
  correction = _checks.check_choice(correction, CORRECTIONS, "correction")
  level = _checks.check_choice(level, IMPORTANCE_LEVELS, "level")
  cap = _checks.check_scalar(cap, "cap", above=0.0, hint="the importance-weight cap C")
  if correction not in BAND_CORRECTIONS:
    if low is not None:
      raise ValueError(
        f"`low`={low!r} is the lower bound of a band, read only by correction 'icepop' or 'seq_mask'; "
        f"correction={correction!r} has none: drop it"
      )
    return dict(correction=correction, level=level, cap=cap, low=0.0)
  if correction == "seq_mask" and level != "token":
    raise ValueError(
      "correction='seq_mask' is sequence-level by definition (the geometric mean of a row's token ratios); "
      f"leave `level` at 'token' (got {level!r}), or use correction='icepop' with level='sequence' for the product"
    )
  low = _checks.check_scalar(DEFAULT_LOW if low is None else low, "low", above=0.0, hint="the band's lower bound L")
  lo, hi = _checks.concrete_or_none(low), _checks.concrete_or_none(cap)
  if lo is not None and hi is not None and not float(lo) < float(hi):
    raise ValueError(f"the band [low, cap] must have low < cap; got low={float(lo)!r}, cap={float(hi)!r}")
  return dict(correction=correction, level=level, cap=cap, low=low)


def importance_weights(old_logp, behavior_logp, mask, *, correction="tis", level="token", cap=2.0, low=None):
  """Truncated (TIS), masked (MIS), two-sided masked (IcePop) or sequence-masked importance weights of
  ``π_old/μ`` at token or sequence level.

  See the module docstring for the formulas and the papers.

  Args:
    old_logp: ``f32[B, T]`` the trainer's log-probs of the rollout policy (π_old).
    behavior_logp: ``f32[B, T]`` the behaviour policy's log-probs (μ: the inference engine's).
    mask: ``bool[B, T]`` real completion tokens; both log-probs are ignored on padding.
    correction: ``"tis"`` (truncate at the cap), ``"mis"`` (weight 0 above the cap), ``"icepop"`` (weight 0
      outside ``[low, cap]``) or ``"seq_mask"`` (a row's weights 0 when its geometric-mean ratio leaves
      ``[low, cap]``, else 1).
    level: ``"token"`` (one ratio per token) or ``"sequence"`` (the product over the row; not with
      ``seq_mask``, which is sequence-level by its geometric mean).
    cap: C > 0, a Python float (static) or a ``f32[]`` array (traced) (TRL's ``vllm_importance_sampling_clip_max`` default 3, verl's ``rollout_is_threshold`` 2).
    low: L in (0, C), the band's lower bound (``icepop``, ``seq_mask`` only; None: :data:`DEFAULT_LOW` = 0.5,
      IcePop's α); a Python float (static) or a ``f32[]`` array (traced).

  Returns:
    :class:`ImportanceWeights` ``(weights, ratio f32[B, T], capped bool[B, T], mismatch_kl f32[B, T])``.
  """
  _checks.check_logp_pair(old_logp, behavior_logp, mask, ("old_logp", "behavior_logp"))
  return _importance_jit(old_logp, behavior_logp, mask, **check_hyper(correction, level, cap, low))


def mismatch_k3(old_logp: jax.Array, behavior_logp: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """How far the behaviour policy μ (a rollout engine, or an older version) is from the policy π_old that
  the objective's ratio uses, over the tokens μ sampled — the one mismatch metric of the engine path
  (``jaxgrpo.loop.collect.engine_old_logp``) and of asynchronous rollouts.

  With ``Δ = old_logp − behavior_logp`` and ``r = exp(Δ) = π_old/μ`` per token::

      mean_k3 = Σ_t m·(r − log r − 1) / max(Σ_t m, 1)          max_abs = max_t m·|Δ|

  ``r − log r − 1 = exp(Δ) − Δ − 1 >= 0`` is ``kl.kl_penalty(old_logp, behavior_logp, "forward_k3")``, an
  estimator of KL(μ ‖ π_old) under μ's samples; for ``Δ > 20`` (``kl.MAX_DELTA``) its exponential continues
  linearly, so a huge gap gives a large finite value, not inf. Tokens outside ``mask`` change
  neither number, inf/NaN log-probs there included.

  Args:
    old_logp: ``f32[B, T]`` log π_old of the sampled tokens.
    behavior_logp: ``f32[B, T]`` log μ of the same tokens.
    mask: ``bool[B, T]`` the tokens μ sampled (real completion tokens; policy tokens of a multi-turn row).

  Returns:
    ``(mean_k3, max_abs)``, both ``f32[]``; ``(0, 0)`` without masked tokens (B = 0 or T = 0 included).
    Works inside ``jit``; a wrong shape or dtype raises naming the argument.
  """
  _checks.check_logp_pair(old_logp, behavior_logp, mask, ("old_logp", "behavior_logp"))
  k3 = kl_penalty(old_logp, behavior_logp, "forward_k3", mask=mask)
  n = jnp.maximum(mask.sum(), 1)
  gap = jnp.max(jnp.where(mask, abs(old_logp - behavior_logp), 0.0), initial=0.0)
  return (k3 * mask).sum() / n, gap.astype(jnp.float32)
