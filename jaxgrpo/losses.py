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

Masks meet values by selection, never by multiplication: every per-token input (log-probs,
advantages, token weights, KL terms) is replaced by 0 on padding *before* any arithmetic, so an
inf/NaN there changes neither the loss nor its gradient. An empty batch (B = 0 or T = 0) and an
all-padding batch give loss 0 with finite (zero) gradients; the extrema metrics are then
``∓float32 max`` (no real token to take them over).

Numerators and denominators add over micro-batches and shards: accumulate :class:`LossTerms` with
:func:`combine_terms` and call :func:`finalize_terms` once — the result equals the full-batch loss for
every mode (as long as the micro-batches split rows, and ``max_tokens`` is fixed).

Every public function here is jitted (the hyper-parameters and the aggregation mode are static): a
direct call costs what it costs inside ``jit`` after the first call; calling it inside an outer
``jit`` works.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgrpo import _checks
from jaxgrpo._numerics import safe_div, safe_sqrt, select

__all__ = [
  "AGGREGATIONS",
  "MAX_LOG_RATIO",
  "LossTerms",
  "combine_terms",
  "finalize_terms",
  "policy_loss_terms",
  "policy_loss",
]

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
MAX_LOG_RATIO = 20.0

_BIG = float(jnp.finfo(jnp.float32).max)


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


@jax.jit
def combine_terms(a: LossTerms, b: LossTerms) -> LossTerms:
  """Accumulate two :class:`LossTerms` (sums add, extrema take max/min)."""
  extrema = {k: (jnp.maximum if k.endswith("_max") else jnp.minimum)(a.extrema[k], b.extrema[k]) for k in a.extrema}
  return LossTerms(
    a.numerator + b.numerator, a.denominator + b.denominator, jax.tree.map(jnp.add, a.sums, b.sums), extrema
  )


def _finalize(terms: LossTerms):
  s = terms.sums
  n = s["tokens"]
  adv_mean = safe_div(s["advantage"], n)
  adv_var = jnp.maximum(safe_div(s["advantage_sq"], n) - adv_mean**2, 0.0)
  metrics = {
    "loss": safe_div(terms.numerator, terms.denominator),
    "policy_loss": safe_div(s["policy"], n),
    "kl": safe_div(s["kl"], n),
    "clip_frac_low": safe_div(s["clip_low"], n),
    "clip_frac_high": safe_div(s["clip_high"], n),
    "clip_frac_dual": safe_div(s["clip_dual"], n),
    "approx_kl": safe_div(s["approx_kl"], n),
    "ratio_mean": safe_div(s["ratio"], n),
    "advantage_mean": adv_mean,
    "advantage_std": safe_sqrt(adv_var),
    "tokens": n,
    "sequences": s["sequences"],
    **terms.extrema,
  }
  return metrics["loss"], metrics


@jax.jit
def finalize_terms(terms: LossTerms):
  """``(loss, metrics)`` from accumulated :class:`LossTerms`; every division is guarded.

  The metrics are listed in :func:`policy_loss`.
  """
  return _finalize(terms)


# ----------------------------------------------------------------------------- checks


def _check_arrays(logp, old_logp, advantages, mask, token_weights, kl) -> None:
  _checks.check_logp(logp, "logp")
  shape = _checks.shape_of(logp)
  _checks.check_logp(old_logp, "old_logp", shape)
  _checks.check_rank(mask, 2, "mask", "bool[B, T]")
  _checks.check_bool(mask, "mask", "bool[B, T]")
  _checks.check_same_shape(mask, "mask", logp, "logp")
  _checks.check_float(advantages, "advantages", "f32[B] or f32[B, T]")
  _checks.check_rank(advantages, (1, 2), "advantages", "f32[B] or f32[B, T]")
  if _checks.shape_of(advantages) not in (shape[:1], shape):
    raise ValueError(f"`advantages` must have shape {shape[:1]} or {shape}; got {_checks.shape_of(advantages)}")
  if token_weights is not None:
    _checks.check_logp(token_weights, "token_weights", shape)
  if kl is not None:
    _checks.check_logp(kl, "kl", shape)


def _check_hyper(clip_eps_low, clip_eps_high, dual_clip, aggregation, max_tokens, beta, kl) -> dict:
  """The static hyper-parameters, checked and normalised (floats as ``float``)."""
  beta = _checks.check_python_float(beta, "beta", at_least=0.0, hint="the KL coefficient β")
  if beta > 0 and kl is None:
    raise ValueError(
      f"`beta` = {beta} > 0 but no `kl` was given: pass the per-token KL term, e.g. "
      "`kl=kl_penalty(logp, ref_logp, 'k3', mask=mask)`, or beta=0"
    )
  return dict(
    clip_eps_low=_checks.check_python_float(clip_eps_low, "clip_eps_low", at_least=0.0, hint="ε_low of the clip"),
    clip_eps_high=_checks.check_python_float(clip_eps_high, "clip_eps_high", at_least=0.0, hint="ε_high of the clip"),
    dual_clip=None
    if dual_clip is None
    else _checks.check_python_float(dual_clip, "dual_clip", above=1.0, hint="c of the dual clip, typically 3, or None"),
    aggregation=_checks.check_choice(aggregation, AGGREGATIONS, "aggregation"),
    max_tokens=None
    if max_tokens is None
    else _checks.check_python_int(max_tokens, "max_tokens", minimum=1, hint="or None for T"),
    beta=beta,
  )


# ----------------------------------------------------------------------------- the loss


def _terms(
  logp,
  old_logp,
  advantages,
  mask,
  token_weights,
  kl,
  *,
  clip_eps_low,
  clip_eps_high,
  dual_clip,
  aggregation,
  max_tokens,
  beta,
) -> LossTerms:
  sg = jax.lax.stop_gradient
  b, t = logp.shape
  real = mask
  m = mask.astype(jnp.float32)
  # Padding is selected away from every input before any arithmetic (inf/NaN there is harmless).
  adv = sg(advantages.astype(jnp.float32))
  adv = select(real, jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, (b, t)))
  logp = select(real, logp.astype(jnp.float32))
  old_logp = select(real, sg(old_logp.astype(jnp.float32)))
  log_ratio = jnp.clip(logp - old_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)  # 0 on padding
  ratio = jnp.exp(log_ratio)
  clipped = jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
  surrogate = jnp.minimum(ratio * adv, clipped * adv)
  dual_active = jnp.zeros_like(real)
  if dual_clip is not None:
    dual_active = real & (adv < 0) & (surrogate < dual_clip * adv)
    surrogate = jnp.where(dual_active, dual_clip * adv, surrogate)
  per_token = -surrogate
  kl_term = jnp.zeros_like(per_token) if kl is None else select(real, kl.astype(jnp.float32))
  if kl is not None and beta != 0:
    per_token = per_token + beta * kl_term
  if token_weights is not None:
    per_token = per_token * select(real, sg(token_weights.astype(jnp.float32)))
  per_token = select(real, per_token)

  row_tokens = jnp.sum(m, axis=1)
  nonempty = (row_tokens > 0).astype(jnp.float32)
  if aggregation == "token-mean":
    numerator, denominator = jnp.sum(per_token), jnp.sum(m)
  elif aggregation == "seq-mean-token-mean":
    numerator = jnp.sum(safe_div(jnp.sum(per_token, axis=1), row_tokens))
    denominator = jnp.sum(nonempty)
  else:
    numerator = jnp.sum(per_token)
    denominator = jnp.float32(b * (t if max_tokens is None else max_tokens))

  count = lambda x: jnp.sum(x.astype(jnp.float32))
  sums = {
    "tokens": jnp.sum(m),
    "sequences": jnp.sum(nonempty),
    "policy": sg(jnp.sum(select(real, -surrogate))),
    "kl": sg(jnp.sum(kl_term)),
    "clip_low": count(real & (adv < 0) & (ratio < 1.0 - clip_eps_low)),
    "clip_high": count(real & (adv > 0) & (ratio > 1.0 + clip_eps_high)),
    "clip_dual": count(dual_active),
    "approx_kl": sg(jnp.sum(select(real, (ratio - 1.0) - log_ratio))),
    "ratio": sg(jnp.sum(select(real, ratio))),
    "advantage": jnp.sum(adv),
    "advantage_sq": jnp.sum(adv**2),
  }
  extrema = {
    "ratio_max": sg(jnp.max(select(real, ratio, -_BIG), initial=-_BIG)),
    "advantage_max": jnp.max(select(real, adv, -_BIG), initial=-_BIG),
    "ratio_min": sg(jnp.min(select(real, ratio, _BIG), initial=_BIG)),
    "advantage_min": jnp.min(select(real, adv, _BIG), initial=_BIG),
  }
  return LossTerms(numerator, denominator, sums, extrema)


_HYPER = ("clip_eps_low", "clip_eps_high", "dual_clip", "aggregation", "max_tokens", "beta")
_policy_loss_terms = jax.jit(_terms, static_argnames=_HYPER)


@functools.partial(jax.jit, static_argnames=_HYPER)
def _policy_loss(logp, old_logp, advantages, mask, token_weights, kl, **hyper):
  return _finalize(_terms(logp, old_logp, advantages, mask, token_weights, kl, **hyper))


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

  Clipped surrogate: Schulman et al., PPO (arXiv:1707.06347); GRPO (arXiv:2402.03300); clip-higher
  DAPO (arXiv:2503.14476); dual clip (Ye et al., arXiv:1912.09729); λ-GRPO token weights
  (arXiv:2509.21154).

  Args:
    logp: ``f32[B, T]`` current-policy log-probs of the sampled tokens (differentiable).
    old_logp: ``f32[B, T]`` rollout-policy log-probs (no gradient).
    advantages: ``f32[B]`` (one per sequence) or ``f32[B, T]`` (per token, e.g. FRPO).
    mask: ``bool[B, T]`` real completion tokens; every other input is ignored (selected away) on
      padding, whatever it holds there.
    token_weights: optional ``f32[B, T]`` multiplying the whole token term (λ-GRPO: ``1/|λ|``).
    clip_eps_low, clip_eps_high: finite ε_low, ε_high >= 0 of the ratio clip (DAPO: 0.2, 0.28).
    dual_clip: finite c > 1 for the dual clip on negative advantages, or None.
    aggregation: one of ``"token-mean"``, ``"seq-mean-token-mean"``, ``"seq-mean-token-sum-norm"``.
    max_tokens: int >= 1, the constant of ``seq-mean-token-sum-norm`` (default ``T``).
    kl: optional ``f32[B, T]`` per-token KL penalty ``D``, e.g.
      ``kl_penalty(logp, ref_logp, "k3", mask=mask)`` (the mask keeps its gradient finite when the
      log-probs on padding are not).
    beta: finite β >= 0, the KL coefficient; ``beta > 0`` requires ``kl``.

  Returns:
    :class:`LossTerms`. B = 0 or T = 0 gives zero numerator and denominator (loss 0).
  """
  _check_arrays(logp, old_logp, advantages, mask, token_weights, kl)
  hyper = _check_hyper(clip_eps_low, clip_eps_high, dual_clip, aggregation, max_tokens, beta, kl)
  return _policy_loss_terms(logp, old_logp, advantages, mask, token_weights, kl, **hyper)


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
    ratio mean/min/max and advantage mean/std/min/max over real tokens. An all-padding or empty
    (B = 0 or T = 0) batch gives loss 0 and finite gradients.
  """
  _check_arrays(logp, old_logp, advantages, mask, token_weights, kl)
  hyper = _check_hyper(clip_eps_low, clip_eps_high, dual_clip, aggregation, max_tokens, beta, kl)
  return _policy_loss(logp, old_logp, advantages, mask, token_weights, kl, **hyper)
