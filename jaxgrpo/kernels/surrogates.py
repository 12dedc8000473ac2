"""The per-token policy term of every GRPO-family loss: PPO's clip, GSPO, GSPO-token, CISPO, SAPO, GMPO.

Each surrogate maps the current and rollout log-probs of the sampled tokens and their advantages to
a per-token loss ``p(i,t)`` (``f32[B, T]``, 0 on padding) plus which tokens were clipped. The loss
(:func:`jaxgrpo.kernels.losses.policy_loss_terms`) then adds the KL and entropy terms, applies the
off-policy correction and the token weights, and aggregates — the same for every surrogate, so
every surrogate inherits the aggregation modes and the micro-batch / shard invariance of the
``(numerator, denominator)`` form. With ``ρ = exp(logp − old_logp)`` (no gradient through
``old_logp``), advantage ``A``, ``sg`` = stop-gradient, ``n_i`` the real tokens of row i:

=================  =======================================================================================
loss               per-token term ``p(i,t)``
=================  =======================================================================================
``"ppo"``          ``−min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A)``, dual clip ``−max(·, cA)`` for A < 0
                   (PPO arXiv:1707.06347, GRPO arXiv:2402.03300, DAPO arXiv:2503.14476)
``"gspo"``         ``−min(s_i A_i, clip(s_i, 1−ε_low, 1+ε_high) A_i)`` on every real token of row i, with
                   the sequence ratio ``s_i = exp(1/n_i Σ_t (logp − old_logp))`` differentiated through
                   all of row i's tokens (GSPO, Zheng et al., arXiv:2507.18071, eq. 5-7). Needs one
                   advantage per sequence.
``"gspo_token"``   ``−min(s_it A_it, clip(s_it, ·) A_it)`` with ``s_it = sg(s_i)·π(y_t)/sg(π(y_t))``: the
                   value of ``s_i`` and the gradient ``s_i ∇log π(y_t)`` routed to token t alone
                   (GSPO-token, ibid. eq. 13-14). Per-token advantages allowed; with one advantage per
                   sequence and ``seq-mean-token-mean`` it equals ``"gspo"`` in value and gradient.
``"cispo"``        ``−sg(clip(ρ, 1−ε_low, 1+ε_high))·A·logp``: the clipped importance weight is a
                   constant, so clipped tokens keep their REINFORCE gradient (CISPO, MiniMax-M1,
                   arXiv:2506.13585, eq. 4). The value is the peers' (TRL, verl): it contains ``logp``.
``"sapo"``         ``−f(ρ)·A`` with the soft gate ``f(ρ) = σ(τ(ρ−1))·4/τ``, ``τ = τ_pos`` if A > 0 else
                   ``τ_neg``; ``∇f = 4σ(1−σ)·ρ∇logp`` equals PPO's at ρ = 1 and decays smoothly instead
                   of being cut (SAPO, Gao et al., arXiv:2511.20347).
``"gmpo"``         ``−A_i·exp(1/n_i Σ_t clip_A(logp − old_logp))`` on every real token of row i: the
                   geometric mean of the token ratios, each clipped in log space on the side the sign of
                   A_i makes harmful (``min(·, ε_high)`` for A > 0, ``max(·, −ε_low)`` for A < 0; 0 for
                   A = 0), i.e. ratios in ``(e^−ε_low, e^ε_high)`` (GMPO, Zhao et al., arXiv:2507.20673,
                   ε = 0.4). Needs one advantage per sequence.
=================  =======================================================================================

Sequence surrogates (``gspo``, ``gmpo``) put the sequence's loss on each of its real tokens, so the
aggregation decides the sequence weighting: ``seq-mean-token-mean`` (their papers' mean over
sequences) gives every sequence weight 1, ``token-mean`` weights it by its length. A row is never
split across micro-batches or devices, so the sequence quantities are exact under any split.

Log-ratios are clamped to ``±MAX_LOG_RATIO`` (20) before ``exp``: the token log-ratio for
``ppo``/``cispo``/``sapo``, the sequence mean for ``gspo``/``gspo_token``/``gmpo`` (no gradient beyond the
clamp). Padding is selected away from every input before any arithmetic.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxgrpo import _checks
from jaxgrpo.kernels import _hyper
from jaxgrpo.kernels._numerics import safe_div, select

__all__ = ["MAX_LOG_RATIO", "SEQUENCE_SURROGATES", "SURROGATES", "Surrogate", "policy_surrogate"]

SURROGATES = ("ppo", "gspo", "gspo_token", "cispo", "sapo", "gmpo")
#: Surrogates whose term is one value per sequence: they need ``f32[B]`` advantages and refuse token weights.
SEQUENCE_SURROGATES = ("gspo", "gmpo")
MAX_LOG_RATIO = 20.0


class Surrogate(NamedTuple):
  """The per-token policy term of one loss.

  Attributes:
    loss: ``f32[B, T]`` the per-token term ``p(i,t)`` (0 on padding).
    clip_low: ``bool[B, T]`` tokens clipped on the low side (A < 0 and the ratio below its range; for
      CISPO: the weight clipped from below, either sign of A).
    clip_high: ``bool[B, T]`` tokens clipped on the high side (A > 0 and the ratio above its range;
      CISPO: the weight clipped from above).
    clip_dual: ``bool[B, T]`` tokens held by the dual clip (``"ppo"`` only).
  """

  loss: jax.Array
  clip_low: jax.Array
  clip_high: jax.Array
  clip_dual: jax.Array


def _row_mean(x, real):
  """``f32[B]`` mean of ``x`` over each row's real tokens (0 for an empty row; finite gradient)."""
  return safe_div(jnp.sum(select(real, x), axis=1), jnp.sum(real, axis=1).astype(jnp.float32))


def _on_tokens(per_row, real):
  return select(real, jnp.broadcast_to(per_row[:, None], real.shape))


def _ppo(log_ratio, adv, real, eps_low, eps_high, dual_clip) -> Surrogate:
  ratio = jnp.exp(log_ratio)
  s = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)
  dual = jnp.zeros_like(real)
  if dual_clip is not None:
    dual = real & (adv < 0) & (s < dual_clip * adv)
    s = jnp.where(dual, dual_clip * adv, s)
  low = real & (adv < 0) & (ratio < 1.0 - eps_low)
  high = real & (adv > 0) & (ratio > 1.0 + eps_high)
  return Surrogate(select(real, -s), low, high, dual)


def _gspo(logp, old_logp, adv, real, eps_low, eps_high) -> Surrogate:
  s = jnp.exp(jnp.clip(_row_mean(logp - old_logp, real), -MAX_LOG_RATIO, MAX_LOG_RATIO))  # [B], with gradient
  per_row = -jnp.minimum(s * adv, jnp.clip(s, 1.0 - eps_low, 1.0 + eps_high) * adv)
  low = _on_tokens((adv < 0) & (s < 1.0 - eps_low), real)
  high = _on_tokens((adv > 0) & (s > 1.0 + eps_high), real)
  return Surrogate(_on_tokens(per_row, real), low, high, jnp.zeros_like(real))


def _gspo_token(logp, old_logp, adv, real, eps_low, eps_high) -> Surrogate:
  sg = jax.lax.stop_gradient
  log_s = sg(jnp.clip(_row_mean(logp - old_logp, real), -MAX_LOG_RATIO, MAX_LOG_RATIO))  # [B]
  s = jnp.exp(log_s[:, None] + logp - sg(logp))  # value s_i, gradient s_i ∇logp on its own token
  per = -jnp.minimum(s * adv, jnp.clip(s, 1.0 - eps_low, 1.0 + eps_high) * adv)
  low = real & (adv < 0) & (s < 1.0 - eps_low)
  high = real & (adv > 0) & (s > 1.0 + eps_high)
  return Surrogate(select(real, per), low, high, jnp.zeros_like(real))


def _cispo(logp, log_ratio, adv, real, eps_low, eps_high) -> Surrogate:
  ratio = jnp.exp(log_ratio)
  weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
  low = real & (ratio < 1.0 - eps_low)
  high = real & (ratio > 1.0 + eps_high)
  return Surrogate(select(real, -weight * adv * logp), low, high, jnp.zeros_like(real))


def _sapo(log_ratio, adv, real, tau_pos, tau_neg) -> Surrogate:
  ratio = jnp.exp(log_ratio)
  tau = jnp.where(adv > 0, tau_pos, tau_neg)
  gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
  none = jnp.zeros_like(real)
  return Surrogate(select(real, -gate * adv), none, none, none)


def _gmpo(logp, old_logp, adv, real, eps_low, eps_high) -> Surrogate:
  log_ratio = logp - old_logp  # 0 on padding (selected inputs)
  a = adv[:, None]
  clipped = jnp.where(a > 0, jnp.minimum(log_ratio, eps_high), jnp.where(a < 0, jnp.maximum(log_ratio, -eps_low), 0.0))
  s = jnp.exp(jnp.clip(_row_mean(clipped, real), -MAX_LOG_RATIO, MAX_LOG_RATIO))  # [B] geometric mean
  low = real & (a < 0) & (log_ratio < -eps_low)
  high = real & (a > 0) & (log_ratio > eps_high)
  return Surrogate(_on_tokens(-adv * s, real), low, high, jnp.zeros_like(real))


def _surrogate(logp, old_logp, advantages, mask, *, loss, clip_eps_low, clip_eps_high, dual_clip, tau_pos, tau_neg):
  """The surrogate on float32 inputs with padding selected away (called by the loss kernel)."""
  sg = jax.lax.stop_gradient
  real = mask
  b, t = logp.shape
  logp = select(real, logp.astype(jnp.float32))
  old_logp = select(real, sg(old_logp.astype(jnp.float32)))
  adv = sg(advantages.astype(jnp.float32))
  if loss in SEQUENCE_SURROGATES:  # f32[B], checked by the wrappers
    return (_gspo if loss == "gspo" else _gmpo)(logp, old_logp, adv, real, clip_eps_low, clip_eps_high)
  adv = select(real, jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, (b, t)))
  if loss == "gspo_token":
    return _gspo_token(logp, old_logp, adv, real, clip_eps_low, clip_eps_high)
  log_ratio = jnp.clip(logp - old_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)  # 0 on padding
  if loss == "ppo":
    return _ppo(log_ratio, adv, real, clip_eps_low, clip_eps_high, dual_clip)
  if loss == "cispo":
    return _cispo(logp, log_ratio, adv, real, clip_eps_low, clip_eps_high)
  return _sapo(log_ratio, adv, real, tau_pos, tau_neg)


# ----------------------------------------------------------------------------- checks


def check_hyper(loss, clip_eps_low, clip_eps_high, dual_clip, tau_pos, tau_neg) -> dict:
  """The surrogate's hyper-parameters, checked: ``loss`` static; each number a Python float (static) or
  an array (traced, range-checked when concrete; :func:`jaxgrpo._checks.check_scalar`)."""
  loss = _checks.check_choice(loss, SURROGATES, "loss")
  dual_clip = (
    None
    if dual_clip is None
    else _checks.check_scalar(dual_clip, "dual_clip", above=1.0, hint="c of the dual clip, typically 3, or None")
  )
  if dual_clip is not None and loss != "ppo":
    raise ValueError(f"`dual_clip` is PPO's clip for negative advantages; loss={loss!r} has none: pass dual_clip=None")
  return dict(
    loss=loss,
    clip_eps_low=_checks.check_scalar(clip_eps_low, "clip_eps_low", at_least=0.0, hint="ε_low of the clip"),
    clip_eps_high=_checks.check_scalar(clip_eps_high, "clip_eps_high", at_least=0.0, hint="ε_high of the clip"),
    dual_clip=dual_clip,
    tau_pos=_checks.check_scalar(tau_pos, "tau_pos", above=0.0, hint="SAPO's τ for A > 0"),
    tau_neg=_checks.check_scalar(tau_neg, "tau_neg", above=0.0, hint="SAPO's τ for A <= 0"),
  )


def check_advantages(loss: str, advantages, shape) -> None:
  """``f32[B]`` or ``f32[B, T]`` advantages; ``f32[B]`` for the sequence surrogates."""
  _checks.check_float(advantages, "advantages", "f32[B] or f32[B, T]")
  _checks.check_rank(advantages, (1, 2), "advantages", "f32[B] or f32[B, T]")
  got = _checks.shape_of(advantages)
  if got not in (shape[:1], shape):
    raise ValueError(f"`advantages` must have shape {shape[:1]} or {shape}; got {got}")
  if loss in SEQUENCE_SURROGATES and got != shape[:1]:
    raise ValueError(
      f"loss={loss!r} takes one advantage per sequence, f32[B] = {shape[:1]}; got per-token advantages {got} "
      "(e.g. FRPO's). Use a token-level loss: 'gspo_token' (GSPO's sequence ratio with per-token advantages), "
      "'cispo', 'sapo' or 'ppo'"
    )


_NUMBERS = ("clip_eps_low", "clip_eps_high", "dual_clip", "tau_pos", "tau_neg")
_surrogate_jit = _hyper.jit(_surrogate, static_argnames=("loss",), numbers=_NUMBERS)


def policy_surrogate(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  loss="ppo",
  clip_eps_low=0.2,
  clip_eps_high=0.2,
  dual_clip=None,
  tau_pos=1.0,
  tau_neg=1.05,
) -> Surrogate:
  """The per-token policy term ``p(i,t)`` of ``loss`` (see the module table), unaggregated.

  Args:
    logp: ``f32[B, T]`` current-policy log-probs of the sampled tokens (differentiable).
    old_logp: ``f32[B, T]`` rollout-policy log-probs (no gradient).
    advantages: ``f32[B]`` or ``f32[B, T]`` (``f32[B]`` only for ``"gspo"`` and ``"gmpo"``).
    mask: ``bool[B, T]`` real tokens; every other input is ignored on padding.
    loss: one of ``"ppo"``, ``"gspo"``, ``"gspo_token"``, ``"cispo"``, ``"sapo"``, ``"gmpo"``.
    clip_eps_low, clip_eps_high: ε_low, ε_high >= 0 (each number here a Python float, static, or a
      ``f32[]`` array, traced: ``jaxgrpo.kernels._hyper``): the ratio range ``[1−ε_low, 1+ε_high]``
      (``ppo``, ``gspo``, ``gspo_token``; ``cispo``'s weight), the log-ratio range
      ``[−ε_low, ε_high]`` for ``gmpo``.
    dual_clip: c > 1 of PPO's dual clip (``"ppo"`` only), or None.
    tau_pos, tau_neg: SAPO's gate temperatures τ for A > 0 and A <= 0 (paper: 1.0, 1.05).

  Returns:
    :class:`Surrogate` ``(loss f32[B, T], clip_low, clip_high, clip_dual bool[B, T])``.
  """
  shape = _checks.check_logp_pair(logp, old_logp, mask, ("logp", "old_logp"))
  hyper = check_hyper(loss, clip_eps_low, clip_eps_high, dual_clip, tau_pos, tau_neg)
  loss = hyper.pop("loss")
  check_advantages(loss, advantages, shape)
  return _surrogate_jit(logp, old_logp, advantages, mask, loss=loss, **hyper)
