"""The clipped policy-gradient loss with named aggregation modes, in (numerator, denominator) form.

Per token, with ``ρ = exp(logp - old_logp)`` (no gradient through ``old_logp``), advantage ``A``,
token weight ``w`` (λ-GRPO: ``1/|λ(i,t)|``) and optional per-token KL ``D``::

    s(i,t) = min(ρ·A, clip(ρ, 1-ε_low, 1+ε_high)·A)           for both signs of A
    s(i,t) = max(s(i,t), c·A)   where A < 0                    (dual clip, c = dual_clip > 1)
    l(i,t) = w(i,t) · ( -s(i,t) + β·D(i,t) )

Aggregation (``m`` the mask; the loss is ``numerator / denominator``):

- ``"token-mean"``: ``Σ l·m / Σ m`` over the whole batch (DAPO; the λ-GRPO paper's analysis form).
- ``"seq-mean-token-mean"``: mean over non-empty sequences of ``Σ_t l·m / Σ_t m`` (original GRPO).
- ``"seq-mean-token-sum-norm"``: ``Σ l·m / (rows · max_tokens)`` (Dr.GRPO; ``max_tokens`` defaults to
  ``T``; every row counts, padding rows included).

The token weights are *not* renormalised: λ-GRPO keeps the token-count denominator.

Numerators and denominators add over micro-batches and shards: accumulate :class:`LossTerms` with
:func:`combine_terms` and call :func:`finalize_terms` once — the result equals the full-batch loss for
every mode (as long as the micro-batches split rows, and ``max_tokens`` is fixed).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgrpo import _checks

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
MAX_LOG_RATIO = 20.0

_EXTREMA = ("ratio_max", "advantage_max", "ratio_min", "advantage_min")


class LossTerms(NamedTuple):
  """Additive pieces of the loss and its metrics; combine with :func:`combine_terms`.

  Attributes:
    numerator: ``f32[]`` the aggregation's numerator.
    denominator: ``f32[]`` the aggregation's denominator.
    sums: dict of ``f32[]`` sums over real tokens (``tokens`` is their count) of the per-token
      metrics, and ``sequences`` (non-empty rows).
    extrema: dict of ``f32[]`` maxima/minima (``*_max`` / ``*_min``).
  """

  numerator: jax.Array
  denominator: jax.Array
  sums: dict
  extrema: dict


def combine_terms(a: LossTerms, b: LossTerms) -> LossTerms:
  """Accumulate two :class:`LossTerms` (sums add, extrema take max/min)."""
  extrema = {k: (jnp.maximum if k.endswith("_max") else jnp.minimum)(a.extrema[k], b.extrema[k]) for k in a.extrema}
  return LossTerms(
    a.numerator + b.numerator, a.denominator + b.denominator, jax.tree.map(jnp.add, a.sums, b.sums), extrema
  )


def _safe_div(num, den):
  ok = den != 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def finalize_terms(terms: LossTerms):
  """``(loss, metrics)`` from accumulated :class:`LossTerms`; every division is guarded."""
  s = terms.sums
  n = s["tokens"]
  adv_mean = _safe_div(s["advantage"], n)
  adv_var = jnp.maximum(_safe_div(s["advantage_sq"], n) - adv_mean**2, 0.0)
  metrics = {
    "loss": _safe_div(terms.numerator, terms.denominator),
    "policy_loss": _safe_div(s["policy"], n),
    "kl": _safe_div(s["kl"], n),
    "clip_frac_low": _safe_div(s["clip_low"], n),
    "clip_frac_high": _safe_div(s["clip_high"], n),
    "clip_frac_dual": _safe_div(s["clip_dual"], n),
    "approx_kl": _safe_div(s["approx_kl"], n),
    "ratio_mean": _safe_div(s["ratio"], n),
    "advantage_mean": adv_mean,
    "advantage_std": jnp.sqrt(adv_var),
    "tokens": n,
    "sequences": s["sequences"],
    **terms.extrema,
  }
  return metrics["loss"], metrics


def _check_inputs(
  logp, old_logp, advantages, mask, token_weights, kl, aggregation, clip_eps_low, clip_eps_high, dual_clip, max_tokens
):
  _checks.check_logp(logp, "logp")
  shape = logp.shape
  _checks.check_logp(old_logp, "old_logp", shape)
  _checks.check_rank(mask, 2, "mask", "bool[B, T]")
  _checks.check_bool(mask, "mask", "bool[B, T]")
  _checks.check_same_shape(mask, "mask", logp, "logp")
  _checks.check_float(advantages, "advantages", "float32[B] or float32[B, T]")
  _checks.check_rank(advantages, (1, 2), "advantages", "float32[B] or float32[B, T]")
  if advantages.shape not in (shape[:1], shape):
    raise ValueError(f"`advantages` must have shape {shape[:1]} or {shape}; got {advantages.shape}")
  if token_weights is not None:
    _checks.check_logp(token_weights, "token_weights", shape)
  if kl is not None:
    _checks.check_logp(kl, "kl", shape)
  _checks.check_choice(aggregation, AGGREGATIONS, "aggregation")
  if clip_eps_low < 0 or clip_eps_high < 0:
    raise ValueError(f"clip ranges must be >= 0; got clip_eps_low={clip_eps_low}, clip_eps_high={clip_eps_high}")
  if dual_clip is not None and dual_clip <= 1.0:
    raise ValueError(f"`dual_clip` must be > 1 (typically 3) or None; got {dual_clip}")
  if max_tokens is not None and max_tokens < 1:
    raise ValueError(f"`max_tokens` must be a positive int or None; got {max_tokens}")


def policy_loss_terms(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  token_weights=None,
  clip_eps_low=0.2,
  clip_eps_high=0.2,
  dual_clip=None,
  aggregation="token-mean",
  max_tokens=None,
  kl=None,
  beta=0.0,
) -> LossTerms:
  """The loss of one (micro-)batch as additive :class:`LossTerms`; see the module docstring.

  Args:
    logp: ``f32[B, T]`` current-policy log-probs of the sampled tokens (differentiable).
    old_logp: ``f32[B, T]`` rollout-policy log-probs (no gradient).
    advantages: ``f32[B]`` (one per sequence) or ``f32[B, T]`` (per token, e.g. FRPO).
    mask: ``bool[B, T]`` real completion tokens.
    token_weights: optional ``f32[B, T]`` multiplying the whole token term (λ-GRPO: ``1/|λ|``).
    clip_eps_low, clip_eps_high: ε_low, ε_high of the ratio clip (DAPO: 0.2, 0.28).
    dual_clip: c > 1 for the dual clip on negative advantages, or None.
    aggregation: one of ``"token-mean"``, ``"seq-mean-token-mean"``, ``"seq-mean-token-sum-norm"``.
    max_tokens: the constant of ``seq-mean-token-sum-norm`` (default ``T``).
    kl: optional ``f32[B, T]`` per-token KL penalty ``D`` (e.g. ``kl_penalty(logp, ref_logp, "k3")``).
    beta: β, the KL coefficient.
  """
  _check_inputs(
    logp, old_logp, advantages, mask, token_weights, kl, aggregation, clip_eps_low, clip_eps_high, dual_clip, max_tokens
  )
  b, t = logp.shape
  m = mask.astype(jnp.float32)
  adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))
  adv = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, (b, t))
  log_ratio = logp.astype(jnp.float32) - jax.lax.stop_gradient(old_logp.astype(jnp.float32))
  log_ratio = jnp.where(mask, jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO), 0.0)
  ratio = jnp.exp(log_ratio)
  clipped = jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
  surrogate = jnp.minimum(ratio * adv, clipped * adv)
  dual_active = jnp.zeros_like(mask)
  if dual_clip is not None:
    dual_active = (adv < 0) & (surrogate < dual_clip * adv)
    surrogate = jnp.where(dual_active, dual_clip * adv, surrogate)
  per_token = -surrogate
  kl_term = jnp.zeros_like(per_token) if kl is None else kl.astype(jnp.float32)
  if kl is not None:
    per_token = per_token + beta * kl_term
  if token_weights is not None:
    per_token = per_token * jax.lax.stop_gradient(token_weights.astype(jnp.float32))
  per_token = per_token * m

  row_tokens = jnp.sum(m, axis=1)
  nonempty = (row_tokens > 0).astype(jnp.float32)
  if aggregation == "token-mean":
    numerator, denominator = jnp.sum(per_token), jnp.sum(m)
  elif aggregation == "seq-mean-token-mean":
    numerator = jnp.sum(_safe_div(jnp.sum(per_token, axis=1), row_tokens))
    denominator = jnp.sum(nonempty)
  else:
    numerator = jnp.sum(per_token)
    denominator = jnp.float32(b * (t if max_tokens is None else max_tokens))

  sg = jax.lax.stop_gradient
  real = mask
  big = jnp.float32(jnp.finfo(jnp.float32).max)
  sums = {
    "tokens": jnp.sum(m),
    "sequences": jnp.sum(nonempty),
    "policy": sg(jnp.sum(-surrogate * m)),
    "kl": sg(jnp.sum(kl_term * m)),
    "clip_low": jnp.sum((real & (adv < 0) & (ratio < 1.0 - clip_eps_low)).astype(jnp.float32)),
    "clip_high": jnp.sum((real & (adv > 0) & (ratio > 1.0 + clip_eps_high)).astype(jnp.float32)),
    "clip_dual": jnp.sum((real & dual_active).astype(jnp.float32)),
    "approx_kl": sg(jnp.sum(((ratio - 1.0) - log_ratio) * m)),
    "ratio": sg(jnp.sum(ratio * m)),
    "advantage": jnp.sum(adv * m),
    "advantage_sq": jnp.sum(adv**2 * m),
  }
  extrema = {
    "ratio_max": sg(jnp.max(jnp.where(real, ratio, -big))),
    "advantage_max": jnp.max(jnp.where(real, adv, -big)),
    "ratio_min": sg(jnp.min(jnp.where(real, ratio, big))),
    "advantage_min": jnp.min(jnp.where(real, adv, big)),
  }
  return LossTerms(numerator, denominator, sums, extrema)


def policy_loss(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  token_weights=None,
  clip_eps_low=0.2,
  clip_eps_high=0.2,
  dual_clip=None,
  aggregation="token-mean",
  max_tokens=None,
  kl=None,
  beta=0.0,
):
  """Clipped PPO/GRPO surrogate loss with a named aggregation mode.

  Same arguments as :func:`policy_loss_terms` (shapes: ``f32[B, T]`` log-probs, ``f32[B]`` or
  ``f32[B, T]`` advantages, ``bool[B, T]`` mask).

  Returns:
    ``(loss f32[], metrics)`` where metrics holds ``loss``, ``policy_loss`` and ``kl`` (token means,
    unweighted), clip fractions ``clip_frac_low`` (A<0, ρ<1-ε_low), ``clip_frac_high`` (A>0,
    ρ>1+ε_high), ``clip_frac_dual``, ``approx_kl`` (mean of ρ-1-log ρ, KL to the rollout policy),
    ratio mean/min/max and advantage mean/std/min/max over real tokens. An all-padding batch gives
    loss 0 and finite gradients.
  """
  return finalize_terms(
    policy_loss_terms(
      logp,
      old_logp,
      advantages,
      mask,
      token_weights=token_weights,
      clip_eps_low=clip_eps_low,
      clip_eps_high=clip_eps_high,
      dual_clip=dual_clip,
      aggregation=aggregation,
      max_tokens=max_tokens,
      kl=kl,
      beta=beta,
    )
  )
