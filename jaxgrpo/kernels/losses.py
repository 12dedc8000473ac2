"""The GRPO-family policy loss with named aggregation modes, in (numerator, denominator) form.

Per token, with the per-token policy term ``p(i,t)`` of the chosen surrogate (``loss``: PPO's clip,
GSPO, GSPO-token, CISPO, SAPO or GMPO — :mod:`jaxgrpo.kernels.surrogates`; for ``"ppo"``
``p = −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A)``, ``−max(·, cA)`` for A < 0 with the dual clip), the
off-policy weight ``v`` (:mod:`jaxgrpo.kernels.importance`; 1 without a correction), the token weight ``w``
(λ-GRPO: ``1/|λ(i,t)|``), the per-token KL ``D`` and the policy entropy ``H``::

    l(i,t) = w(i,t) · ( v(i,t)·p(i,t) + β·D(i,t) − c·H(i,t) )          c = entropy_coef

``v`` weights the policy term only (TRL, verl); the KL and entropy terms are not importance-weighted.
``w`` weights the whole token term, the entropy bonus included: on a shared prefix every member of
λ(i,t) sees the same distribution, so λ-GRPO counts its entropy once, as it counts the policy and KL
terms once (a choice: no peer has λ weights).

Aggregation (``m`` the mask; the loss is ``numerator / denominator``):

- ``"token-mean"``: ``Σ l·m / Σ m`` over the whole batch (DAPO; the λ-GRPO paper's analysis form).
- ``"seq-mean-token-mean"``: mean over non-empty sequences of ``Σ_t l·m / Σ_t m`` (original GRPO).
- ``"seq-mean-token-sum-norm"``: ``Σ l·m / (rows · max_tokens)`` (Dr.GRPO; ``max_tokens`` defaults to
  ``T``; every row counts, padding rows included).

The token weights are *not* renormalised: λ-GRPO keeps the token-count denominator. The entropy
bonus is aggregated like the loss (verl's actor; TRL always takes its token mean).

Masks meet values by selection, never by multiplication: every per-token input (log-probs,
advantages, token weights, KL terms, entropies, importance weights) is replaced by 0 on padding
*before* any arithmetic, so an inf/NaN there changes neither the loss nor its gradient. An empty
batch (B = 0 or T = 0) and an all-padding batch give loss 0 with finite (zero) gradients; the
extrema metrics are then ``∓float32 max`` (no real token to take them over).

Numerators and denominators add over micro-batches and shards: accumulate :class:`LossTerms` with
:func:`combine_terms` and call :func:`finalize_terms` once — the result equals the full-batch loss for
every mode (as long as the micro-batches split rows, and ``max_tokens`` is fixed).

The hyper-parameters are one :class:`~jaxgrpo.kernels.hyper.GRPOHyper` (a pytree, the same carrier the
config and the train step use): the surrogate, the aggregation mode and ``max_tokens`` static, every
number static as a Python float or traced as an array (a β or ε schedule, a ``vmap`` over a grid: one
compiled program). Every public function here is jitted: a
direct call costs what it costs inside ``jit`` after the first call; calling it inside an outer
``jit`` works.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgrpo import _checks
from jaxgrpo.kernels import _hyper
from jaxgrpo.kernels import surrogates as _surrogates
from jaxgrpo.kernels._numerics import safe_div, safe_sqrt, select
from jaxgrpo.kernels.hyper import AGGREGATIONS, GRPOHyper
from jaxgrpo.kernels.importance import ImportanceWeights
from jaxgrpo.kernels.numbers import names
from jaxgrpo.kernels.surrogates import MAX_LOG_RATIO, SURROGATES

__all__ = [
  "AGGREGATIONS",
  "MAX_LOG_RATIO",
  "SURROGATES",
  "GRPOHyper",
  "LossTerms",
  "aggregate",
  "combine_terms",
  "finalize_terms",
  "policy_loss_terms",
  "policy_loss",
]

#: the numbers the loss reads (the surrogates', β and the entropy coefficient; the IS cap is the objective's)
_NUMBERS = names(carrier="traced", read_by=("surrogate", "loss"))

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


# optional token-mean metrics: (sum key, metric name), present when the loss had the input
_OPTIONAL_MEANS = (
  ("is_weight", "is_weight_mean"),
  ("is_policy", "is_policy_loss"),
  ("is_ratio", "is_ratio_mean"),
  ("is_capped", "is_capped_frac"),
  ("mismatch_kl", "mismatch_kl"),
  ("entropy", "entropy"),
  ("topk_divergence", "distill/topk_divergence"),
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
    **{name: safe_div(s[key], n) for key, name in _OPTIONAL_MEANS if key in s},
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


def _check_arrays(loss, logp, old_logp, advantages, mask, token_weights, kl, importance, entropy) -> None:
  shape = _checks.check_logp_pair(logp, old_logp, mask, ("logp", "old_logp"))
  _surrogates.check_advantages(loss, advantages, shape)
  if token_weights is not None:
    _checks.check_logp(token_weights, "token_weights", shape)
    if _surrogates.surrogate_spec(loss).sequence_level:
      raise ValueError(
        f"loss={loss!r} is a sequence-level loss and takes no per-token `token_weights` (λ-GRPO's 1/|λ| is "
        "undefined for it); use loss='gspo_token' for GSPO's sequence ratio with token weights"
      )
  if kl is not None:
    _checks.check_logp(kl, "kl", shape)
  if entropy is not None:
    _checks.check_logp(entropy, "entropy", shape)
  if importance is not None:
    if not isinstance(importance, ImportanceWeights):
      raise TypeError(
        "`importance` must be a jaxgrpo.kernels.importance.ImportanceWeights (from importance_weights(...)) or None; "
        f"got {type(importance).__name__}"
      )
    for name in ("weights", "ratio", "mismatch_kl"):
      _checks.check_logp(getattr(importance, name), f"importance.{name}", shape)
    _checks.check_bool(importance.capped, "importance.capped", "bool[B, T]")
    _checks.check_same_shape(importance.capped, "importance.capped", logp, "logp")


def _check_inputs(hyper: GRPOHyper, kl, entropy) -> None:
  """A coefficient that may be non-zero needs its input (a static 0, or a concrete array of zeros, not)."""
  if kl is None and _may_be_nonzero(hyper.beta):
    raise ValueError(
      f"`beta` = {hyper.beta} may be > 0 but no `kl` was given: pass the per-token KL term, e.g. "
      "`kl=kl_penalty(logp, ref_logp, 'k3', mask=mask)`, or beta=0"
    )
  if entropy is None and _may_be_nonzero(hyper.entropy_coef):
    raise ValueError(
      f"`entropy_coef` = {hyper.entropy_coef} but no `entropy` was given: pass the per-token policy entropy "
      "f32[B, T] with its gradient (completion_log_probs(..., with_entropy=True, entropy_grad=True)), or 0"
    )


def _may_be_nonzero(x) -> bool:
  if _hyper.is_static(x):
    return x != 0
  values = _checks.concrete_or_none(x)
  return values is None or bool((values != 0).any())


# ----------------------------------------------------------------------------- the loss


def aggregate(per_token, m, aggregation: str, max_tokens: int | None):
  """``(numerator f32[], denominator f32[])`` of a per-token term under ``aggregation`` (module docstring).

  ``per_token`` ``f32[B, T]`` (0 on padding), ``m`` ``f32[B, T]`` the mask (1 on counted tokens), ``n_i = Σ_t m``:

  - ``"token-mean"``: ``(Σ l, Σ m)``;
  - ``"seq-mean-token-mean"``: ``(Σ_{i: n_i>0} Σ_t l / n_i, #{i: n_i > 0})``;
  - ``"seq-mean-token-sum-norm"``: ``(Σ l, B · max_tokens)`` (``max_tokens`` None: T).

  Sums over rows, so micro-batches that split whole rows add up to the batch's terms. The train step
  aggregates a top-k distillation divergence with it too (``jaxgrpo.step.terms``)."""
  b, t = per_token.shape
  row_tokens = jnp.sum(m, axis=1)
  if aggregation == "token-mean":
    return jnp.sum(per_token), jnp.sum(m)
  if aggregation == "seq-mean-token-mean":
    return jnp.sum(safe_div(jnp.sum(per_token, axis=1), row_tokens)), jnp.sum((row_tokens > 0).astype(jnp.float32))
  return jnp.sum(per_token), jnp.float32(b * (t if max_tokens is None else max_tokens))


def _terms(logp, old_logp, advantages, mask, token_weights, kl, importance, entropy, hyper: GRPOHyper) -> LossTerms:
  traced = {n: getattr(hyper, n) for n in _NUMBERS if not _hyper.is_static(getattr(hyper, n))}
  h = hyper._replace(**{n: _hyper.scalar(v, n) for n, v in traced.items()})  # traced numbers as f32[]
  sg = jax.lax.stop_gradient
  real = mask
  m = mask.astype(jnp.float32)
  numbers = {n: getattr(h, n) for n in _surrogates.NUMBERS_READ}
  sur = _surrogates.surrogate_terms(logp, old_logp, advantages, mask, loss=h.loss, **numbers)
  per_token = sur.loss  # 0 on padding
  if importance is not None:
    per_token = per_token * select(real, sg(importance.weights.astype(jnp.float32)))
  kl_term = jnp.zeros_like(per_token) if kl is None else select(real, kl.astype(jnp.float32))
  if kl is not None and not _hyper.is_static_zero(h.beta):
    per_token = per_token + h.beta * kl_term
  if entropy is not None and not _hyper.is_static_zero(h.entropy_coef):
    per_token = per_token - h.entropy_coef * select(real, entropy.astype(jnp.float32))
  if token_weights is not None:
    per_token = per_token * select(real, sg(token_weights.astype(jnp.float32)))
  per_token = select(real, per_token)
  numerator, denominator = aggregate(per_token, m, hyper.aggregation, hyper.max_tokens)

  # metrics: the token ratio ρ and the (unweighted) advantages whatever the surrogate
  b, t = m.shape
  adv = sg(advantages.astype(jnp.float32))
  adv = select(real, jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, (b, t)))
  log_ratio = jnp.clip(
    select(real, sg(logp.astype(jnp.float32)) - sg(old_logp.astype(jnp.float32))), -MAX_LOG_RATIO, MAX_LOG_RATIO
  )
  ratio = jnp.exp(log_ratio)
  count = lambda x: jnp.sum(x.astype(jnp.float32))
  tsum = lambda x: sg(jnp.sum(select(real, x.astype(jnp.float32))))
  sums = {
    "tokens": jnp.sum(m),
    "sequences": jnp.sum((jnp.sum(m, axis=1) > 0).astype(jnp.float32)),
    "policy": sg(jnp.sum(sur.loss)),
    "kl": sg(jnp.sum(kl_term)),
    "clip_low": count(sur.clip_low),
    "clip_high": count(sur.clip_high),
    "clip_dual": count(sur.clip_dual),
    "approx_kl": tsum((ratio - 1.0) - log_ratio),
    "ratio": tsum(ratio),
    "advantage": jnp.sum(adv),
    "advantage_sq": jnp.sum(adv**2),
  }
  extrema = {
    "ratio_max": jnp.max(select(real, ratio, -_BIG), initial=-_BIG),
    "advantage_max": jnp.max(select(real, adv, -_BIG), initial=-_BIG),
    "ratio_min": jnp.min(select(real, ratio, _BIG), initial=_BIG),
    "advantage_min": jnp.min(select(real, adv, _BIG), initial=_BIG),
  }
  if importance is not None:
    sums.update(
      is_weight=tsum(importance.weights),
      is_policy=sg(jnp.sum(sur.loss * select(real, importance.weights.astype(jnp.float32)))),
      is_ratio=tsum(importance.ratio),
      is_capped=count(real & importance.capped),
      mismatch_kl=tsum(importance.mismatch_kl),
    )
    extrema["is_ratio_max"] = sg(jnp.max(select(real, importance.ratio.astype(jnp.float32), -_BIG), initial=-_BIG))
  if entropy is not None:
    sums["entropy"] = tsum(entropy)
  return LossTerms(numerator, denominator, sums, extrema)


_policy_loss_terms = jax.jit(_terms)


@jax.jit
def _policy_loss(logp, old_logp, advantages, mask, token_weights, kl, importance, entropy, hyper):
  return _finalize(_terms(logp, old_logp, advantages, mask, token_weights, kl, importance, entropy, hyper))


def _checked(logp, old_logp, advantages, mask, hyper, token_weights, kl, importance, entropy):
  hyper = GRPOHyper() if hyper is None else hyper
  if not isinstance(hyper, GRPOHyper):
    raise TypeError(f"`hyper` must be a jaxgrpo.GRPOHyper or None; got {type(hyper).__name__}")
  _check_arrays(hyper.loss, logp, old_logp, advantages, mask, token_weights, kl, importance, entropy)
  _check_inputs(hyper, kl, entropy)
  if _hyper.is_static_zero(hyper.entropy_coef):
    entropy = None  # unused: one compiled program whether or not it is passed
  return (logp, old_logp, advantages, mask, token_weights, kl, importance, entropy, hyper)


def policy_loss_terms(
  logp,
  old_logp,
  advantages,
  mask,
  hyper: GRPOHyper | None = None,
  *,
  token_weights=None,
  kl=None,
  importance=None,
  entropy=None,
) -> LossTerms:
  """The loss of one (micro-)batch as additive :class:`LossTerms`; see the module docstring.

  Clipped surrogate: Schulman et al., PPO (arXiv:1707.06347); GRPO (arXiv:2402.03300); clip-higher
  DAPO (arXiv:2503.14476); dual clip (Ye et al., arXiv:1912.09729); λ-GRPO token weights
  (arXiv:2509.21154); the other surrogates in :mod:`jaxgrpo.kernels.surrogates`.

  Args:
    logp: ``f32[B, T]`` current-policy log-probs of the sampled tokens (differentiable).
    old_logp: ``f32[B, T]`` rollout-policy log-probs (no gradient).
    advantages: ``f32[B]`` (one per sequence) or ``f32[B, T]`` (per token, e.g. FRPO; not for the
      sequence losses ``"gspo"`` and ``"gmpo"``).
    mask: ``bool[B, T]`` real completion tokens; every other input is ignored (selected away) on
      padding, whatever it holds there.
    hyper: :class:`~jaxgrpo.kernels.hyper.GRPOHyper` — the surrogate, the aggregation, ε, the dual clip,
      SAPO's τ, β and the entropy coefficient (None: ``GRPOHyper()``, PPO's clip with ε = 0.2 and
      token-mean; ``importance_cap`` is not read here).
    token_weights: optional ``f32[B, T]`` multiplying the whole token term (λ-GRPO: ``1/|λ|``); not
      with ``"gspo"``/``"gmpo"`` (ValueError).
    kl: optional ``f32[B, T]`` per-token KL penalty ``D``, e.g.
      ``kl_penalty(logp, ref_logp, 'k3', mask=mask)`` (the mask keeps its gradient finite when the
      log-probs on padding are not); required when ``hyper.beta`` may be > 0.
    importance: optional :class:`~jaxgrpo.kernels.importance.ImportanceWeights` (``importance_weights(old_logp,
      behavior_logp, mask, ...)``): the off-policy weight ``v`` of the policy term, and its metrics.
    entropy: ``f32[B, T]`` the policy entropy per position, differentiable (required when
      ``hyper.entropy_coef`` may be non-zero, ignored when it is a static 0).

  Returns:
    :class:`LossTerms`. B = 0 or T = 0 gives zero numerator and denominator (loss 0).
  """
  return _policy_loss_terms(*_checked(logp, old_logp, advantages, mask, hyper, token_weights, kl, importance, entropy))


def policy_loss(
  logp,
  old_logp,
  advantages,
  mask,
  hyper: GRPOHyper | None = None,
  *,
  token_weights=None,
  kl=None,
  importance=None,
  entropy=None,
):
  """The GRPO-family policy loss (PPO's clipped surrogate by default) with a named aggregation mode.

  Same arguments as :func:`policy_loss_terms` (shapes: ``f32[B, T]`` log-probs, ``f32[B]`` or
  ``f32[B, T]`` advantages, ``bool[B, T]`` mask; ``hyper`` a :class:`~jaxgrpo.kernels.hyper.GRPOHyper`).

  Returns:
    ``(loss f32[], metrics)`` where metrics holds ``loss``, ``policy_loss`` (token mean of the
    surrogate term ``p`` *before* the importance weight ``v`` and the token weight ``w``: the surrogate alone)
    and ``kl`` (token means, unweighted), clip fractions ``clip_frac_low``
    (A<0, ratio below its range), ``clip_frac_high`` (A>0, above), ``clip_frac_dual``, ``approx_kl``
    (mean of ρ-1-log ρ, KL to the rollout policy), the token ratio ρ's mean/min/max and advantage
    mean/std/min/max over real tokens; with ``importance``: ``is_policy_loss`` (token mean of ``v·p``, the
    policy term as the loss applies it: ``loss`` itself for a token-mean loss without β, entropy or ``w``),
    ``is_weight_mean``, ``is_ratio_mean``,
    ``is_ratio_max`` (the raw ratio π_old/μ), ``is_capped_frac`` (tokens truncated or masked) and
    ``mismatch_kl`` (mean k3 between π_old and μ); with an entropy bonus: ``entropy``. An all-padding
    or empty (B = 0 or T = 0) batch gives loss 0 and finite gradients.
  """
  return _policy_loss(*_checked(logp, old_logp, advantages, mask, hyper, token_weights, kl, importance, entropy))
