"""KL estimators and FRPO's future-KL advantage.

With ``δ = logp - ref_logp = log πθ/πref`` and ``u = exp(-δ) = πref/πθ`` (per token):

- ``k1 = δ``; ``k2 = δ²/2``; ``k3 = u - log u - 1 = exp(-δ) + δ - 1 >= 0`` (Schulman's low-variance
  estimator of KL(πθ‖πref), the GRPO/λ-GRPO/DAPO loss term);
- ``forward_k3 = exp(δ) - δ - 1 >= 0`` (the k3 form of the forward direction πref‖πθ).

Safety clamp: ``δ`` is clipped to ``[-max_delta, max_delta]`` (default 20) *only inside* the
exponentials of k3/forward_k3 (and of the future-KL f-divergence terms), so a token the policy has
driven to probability ~0 cannot overflow to inf. k1 and k2 use the raw ``δ``.

Note: k1 *as a loss term* has zero expected gradient on-policy, so ``kl_penalty`` defaults to k3.
FRPO's default k1 is different: there the estimate enters the *advantage* (a cost-to-go), not the loss.

FRPO: Yao, Wang, Bai, Zhang, "Future-KL Regularized GRPO" (arXiv:2601.10201 v2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgrpo import _checks

KL_KINDS = ("k1", "k2", "k3", "forward_k3")
FUTURE_KL_KINDS = ("k1", "k3", "forward_k3")
MAX_DELTA = 20.0


def _delta(logp, ref_logp):
  _checks.check_logp(logp, "logp")
  _checks.check_logp(ref_logp, "ref_logp", logp.shape)
  return logp.astype(jnp.float32) - jax.lax.stop_gradient(ref_logp.astype(jnp.float32))


def _clamped(delta, max_delta):
  return jnp.clip(delta, -max_delta, max_delta)


def kl_penalty(logp, ref_logp, kind: str = "k3", *, max_delta: float = MAX_DELTA):
  """Per-token KL(πθ‖πref) estimate (or forward KL for ``"forward_k3"``).

  Args:
    logp: ``f32[B, T]`` log πθ of the sampled tokens (differentiable).
    ref_logp: ``f32[B, T]`` log πref of the same tokens (treated as a constant).
    kind: ``"k1"`` (δ), ``"k2"`` (δ²/2), ``"k3"`` (exp(-δ)+δ-1), ``"forward_k3"`` (exp(δ)-δ-1).
    max_delta: clamp of δ inside exponentials.

  Returns:
    ``f32[B, T]`` (not masked: multiply by the mask or let the loss do it).
  """
  _checks.check_choice(kind, KL_KINDS, "kind")
  delta = _delta(logp, ref_logp)
  if kind == "k1":
    return delta
  if kind == "k2":
    return 0.5 * delta**2
  d = _clamped(delta, max_delta)
  if kind == "k3":
    return jnp.exp(-d) + d - 1.0
  return jnp.exp(d) - d - 1.0


def _reverse_cumsum(x):
  return jnp.cumsum(x[:, ::-1], axis=1)[:, ::-1]


def future_kl(logp, ref_logp, mask, *, kind: str = "k1", max_delta: float = MAX_DELTA):
  """FRPO's regulariser ``reg(i,t)``: the KL cost-to-go from token t (inclusive) to the end.

  General f-divergence form (FRPO Thm 4.1), with ``u = πref/πθ`` and ``m`` the mask::

      reg(t) = f(u_t) - f'(u_t) u_t  +  sum_{j>t} m_j f(u_j)        (times m_t)

  - ``"k1"`` (reverse KL, f = -log u): ``reg(t) = sum_{j>=t} m_j δ_j`` — a masked reversed cumsum;
  - ``"k3"`` (f = -log u + u - 1): ``reg(t) = δ_t + sum_{j>t} m_j (exp(-δ_j) + δ_j - 1)``;
  - ``"forward_k3"`` (f = u log u - u + 1): ``reg(t) = 1 - u_t + sum_{j>t} m_j (u_j log u_j - u_j + 1)``.

  With a single real token, ``"k1"`` reduces to the per-token ``kl_penalty(..., "k1")``.

  Args:
    logp: ``f32[B, T]`` log-probs of the policy the KL is taken of (FRPO: the rollout/old policy,
      held fixed across updates).
    ref_logp: ``f32[B, T]`` reference log-probs.
    mask: ``bool[B, T]`` real completion tokens.
    kind: one of ``"k1"``, ``"k3"``, ``"forward_k3"``.

  Returns:
    ``f32[B, T]``, 0 on padding.
  """
  _checks.check_choice(kind, FUTURE_KL_KINDS, "kind")
  delta = _delta(logp, ref_logp)
  _checks.check_bool(mask, "mask", "bool[B, T]")
  _checks.check_same_shape(mask, "mask", logp, "logp")
  m = mask.astype(jnp.float32)
  d = _clamped(delta, max_delta)
  if kind == "k1":
    now, later = delta, delta
  elif kind == "k3":
    now, later = delta, jnp.exp(-d) + d - 1.0
  else:
    u = jnp.exp(-d)
    now, later = 1.0 - u, -d * u - u + 1.0  # u log u = -δ u
  tail = _reverse_cumsum(m * later) - m * later  # sum_{j>t} m_j later_j
  return m * (now + tail)


def frpo_advantages(
  advantages, old_logp, ref_logp, mask, *, beta: float, kind: str = "k1", max_delta: float = MAX_DELTA
):
  """FRPO token advantages ``Â(i,t) = stop_gradient(a_i - β · reg(i,t))``.

  ``reg`` is :func:`future_kl` of the rollout (old) policy against the reference, computed once per
  rollout batch and held fixed across the μ updates (the paper's default). ``Â`` replaces the
  advantage inside the clipped surrogate; there is no separate KL loss term.

  Args:
    advantages: ``f32[B]`` outcome advantages ``a_i`` (or ``f32[B, T]`` token advantages).
    old_logp, ref_logp: ``f32[B, T]``; mask: ``bool[B, T]``.
    beta: β >= 0 (0.01 in the paper's runs).
    kind: future-KL estimator (default reverse ``"k1"``).

  Returns:
    ``f32[B, T]``, 0 on padding, with no gradient.
  """
  if beta < 0:
    raise ValueError(f"`beta` must be >= 0; got {beta}")
  _checks.check_float(advantages, "advantages", "float32[B] or float32[B, T]")
  _checks.check_rank(advantages, (1, 2), "advantages", "float32[B] or float32[B, T]")
  if advantages.shape[0] != old_logp.shape[0] or (advantages.ndim == 2 and advantages.shape != old_logp.shape):
    raise ValueError(
      f"`advantages` must have shape (B,) or (B, T) matching `old_logp` {old_logp.shape}; got {advantages.shape}"
    )
  adv = advantages.astype(jnp.float32)
  adv = adv[:, None] if adv.ndim == 1 else adv
  reg = future_kl(old_logp, ref_logp, mask, kind=kind, max_delta=max_delta)
  return jax.lax.stop_gradient(jnp.where(mask, adv - beta * reg, 0.0))
