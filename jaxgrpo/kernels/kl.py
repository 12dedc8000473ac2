"""KL estimators and FRPO's future-KL advantage.

With ``δ = logp - ref_logp = log πθ/πref`` and ``u = exp(-δ) = πref/πθ`` (per token):

- ``k1 = δ``; ``k2 = δ²/2``; ``k3 = u - log u - 1 = exp(-δ) + δ - 1 >= 0`` (Schulman's low-variance
  estimator of KL(πθ‖πref), the GRPO/λ-GRPO/DAPO loss term);
- ``forward_k3 = exp(δ) - δ - 1 >= 0`` (the k3 form of the forward direction πref‖πθ).

Safety clamp: an exponential that would grow past ``e^max_delta`` (default ``max_delta`` 20) is
continued linearly by its tangent instead (``_numerics.exp_linear``: ``exp(x)`` for ``x <= c``,
``e^c·(1 + x - c)`` beyond), inside k3/forward_k3 and the future-KL f-divergence terms, so a token the
policy has driven to probability ~0 cannot overflow to inf. For every δ the penalty is then finite,
monotone in ``|δ|`` on each side of 0, and its gradient has the sign of the exact one:
``kl_penalty(-25, 0, "k3") = e^20·6 - 26 ≈ 2.9e9`` with gradient ``1 - e^20 ≈ -4.9e8`` (exact
``e^25 - 26``, gradient ``1 - e^25``), where a clamp ``exp(-clip(δ, ±20))`` froze the value at
``e^20 - 26 + ...`` and gave gradient +1 — descent then pushed logp further *away* from the reference.
On the decaying side the exponential is exact (``kl_penalty(25, 0, "k3") = e^-25 + 24 ≈ 24``,
gradient ``1 - e^-25 ≈ 1``). Beyond the clamp the value is below the exact one (the exponential is
convex). k1 and k2 have no exponential.

Masks meet values by selection: with ``mask`` given, padding tokens are replaced by 0 *before* any
arithmetic, so inf/NaN log-probs on padding (e.g. ``old_logp = -inf``) give 0 there and cannot
leak into real tokens, values or gradients.

Note: k1 *as a loss term* has zero expected gradient on-policy, so ``kl_penalty`` defaults to k3.
FRPO's default k1 is different: there the estimate enters the *advantage* (a cost-to-go), not the loss.

FRPO: Yao, Wang, Bai, Zhang, "Future-KL Regularized GRPO" (arXiv:2601.10201 v2). k3: J. Schulman,
"Approximating KL divergence" (2020).

Every public function here is jitted (the kinds static; ``max_delta`` and ``beta`` static as Python
floats, traced as ``f32[]`` arrays — one program for every value, ``vmap``-able): a direct call costs
what it costs inside ``jit`` after the first call; calling it inside an outer ``jit`` works.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgrpo import _checks
from jaxgrpo.kernels import _hyper
from jaxgrpo.kernels._numerics import exp_excess, exp_linear, masked_reverse_cumsum, select

__all__ = ["KL_KINDS", "FUTURE_KL_KINDS", "MAX_DELTA", "kl_penalty", "future_kl", "frpo_advantages"]

KL_KINDS = ("k1", "k2", "k3", "forward_k3")
FUTURE_KL_KINDS = ("k1", "k3", "forward_k3")
MAX_DELTA = 20.0


def _check_max_delta(max_delta):
  return _checks.check_scalar(max_delta, "max_delta", above=0.0, hint="clamp of δ inside the exponentials")


def _check_pair(logp, ref_logp, mask, layout: str):
  _checks.check_float(logp, "logp", layout)
  _checks.check_float(ref_logp, "ref_logp", layout)
  _checks.check_same_shape(ref_logp, "ref_logp", logp, "logp")
  if mask is not None:
    _checks.check_bool(mask, "mask", layout.replace("f32", "bool"))
    _checks.check_same_shape(mask, "mask", logp, "logp")


def _delta(logp, ref_logp, mask):
  """δ in float32 (no gradient through ``ref_logp``), 0 on padding by selection of the inputs."""
  logp = logp.astype(jnp.float32)
  ref_logp = jax.lax.stop_gradient(jnp.asarray(ref_logp, jnp.float32))
  if mask is not None:
    logp, ref_logp = select(mask, logp), select(mask, ref_logp)
  return logp - ref_logp


def _kl_penalty(logp, ref_logp, mask, *, kind, max_delta):
  delta = _delta(jnp.asarray(logp), ref_logp, mask)
  if kind == "k1":
    return delta
  if kind == "k2":
    return 0.5 * delta**2
  if kind == "k3":  # exp(-δ) + δ - 1, the exponential continued linearly past max_delta
    return exp_excess(-delta, max_delta)
  return exp_excess(delta, max_delta)  # exp(δ) - δ - 1


_kl_penalty_jit = _hyper.jit(_kl_penalty, static_argnames=("kind",), numbers=("max_delta",))


def kl_penalty(logp, ref_logp, kind: str = "k3", *, mask=None, max_delta: float = MAX_DELTA):
  """Per-token KL(πθ‖πref) estimate (or forward KL for ``"forward_k3"``).

  Args:
    logp: ``f32[B, T]`` log πθ of the sampled tokens (differentiable). Any shape works: the
      estimators are elementwise.
    ref_logp: ``f32[B, T]`` log πref of the same tokens (treated as a constant).
    kind: ``"k1"`` (δ), ``"k2"`` (δ²/2), ``"k3"`` (exp(-δ)+δ-1), ``"forward_k3"`` (exp(δ)-δ-1).
    mask: optional ``bool[B, T]``: where False the result is 0, selected before any arithmetic (so
      inf/NaN log-probs there give 0 with zero gradient). Without it nothing is masked.
    max_delta: finite ``> 0`` (a Python float, static, or a ``f32[]`` array, traced); past ``e^max_delta``
      the exponential is continued linearly (module docstring): the value stays finite and the gradient
      keeps the exact sign.

  Returns:
    ``f32[B, T]``.
  """
  kind = _checks.check_choice(kind, KL_KINDS, "kind")
  _check_pair(logp, ref_logp, mask, "f32[B, T]")
  return _kl_penalty_jit(logp, ref_logp, mask, kind=kind, max_delta=_check_max_delta(max_delta))


def _check_future(logp, ref_logp, mask, kind, max_delta, logp_name="logp"):
  kind = _checks.check_choice(kind, FUTURE_KL_KINDS, "kind")
  _checks.check_logp(logp, logp_name)
  _checks.check_logp(ref_logp, "ref_logp", _checks.shape_of(logp))
  _checks.check_rank(mask, 2, "mask", "bool[B, T]")
  _checks.check_bool(mask, "mask", "bool[B, T]")
  _checks.check_same_shape(mask, "mask", logp, logp_name)
  return kind, _check_max_delta(max_delta)


def _future_kl(logp, ref_logp, mask, *, kind, max_delta):
  delta = _delta(logp, ref_logp, mask)  # 0 on padding
  if kind == "k1":
    now, later = delta, delta
  elif kind == "k3":
    now, later = delta, exp_excess(-delta, max_delta)  # exp(-δ) + δ - 1
  else:  # forward_k3, f(u) = u log u - u + 1 with u = exp(-δ), u log u = -δ u
    u = exp_linear(-delta, max_delta)  # continued linearly past e^max_delta
    now, later = 1.0 - u, -delta * u - u + 1.0
  tail = masked_reverse_cumsum(later, mask, exclusive=True)  # Σ_{j>t} m_j later_j
  return select(mask, now + tail)


_future_kl_jit = _hyper.jit(_future_kl, static_argnames=("kind",), numbers=("max_delta",))


def future_kl(logp, ref_logp, mask, *, kind: str = "k1", max_delta: float = MAX_DELTA):
  """FRPO's regulariser ``reg(i,t)``: the KL cost-to-go from token t (inclusive) to the end.

  General f-divergence form (FRPO Thm 4.1), with ``u = πref/πθ`` and ``m`` the mask::

      reg(t) = f(u_t) - f'(u_t) u_t  +  sum_{j>t} m_j f(u_j)        (where m_t)

  - ``"k1"`` (reverse KL, f = -log u): ``reg(t) = sum_{j>=t} m_j δ_j`` — a masked reversed cumsum;
  - ``"k3"`` (f = -log u + u - 1): ``reg(t) = δ_t + sum_{j>t} m_j (exp(-δ_j) + δ_j - 1)``;
  - ``"forward_k3"`` (f = u log u - u + 1): ``reg(t) = 1 - u_t + sum_{j>t} m_j (u_j log u_j - u_j + 1)``,
    with ``u_j log u_j = -δ_j u_j``.

  ``u = exp(-δ)`` is continued linearly past ``e^max_delta`` (``u = e^c·(1 - δ - c)`` for
  ``δ < -c``, module docstring); δ's linear occurrences are exact (e.g. k3 with δ = 25 on three tokens
  gives ``[73, 49, 25]``). Every term then stays finite and moves in the direction of the exact one.
  With a single real token, ``"k1"`` reduces to the per-token ``kl_penalty(..., "k1")``.

  Args:
    logp: ``f32[B, T]`` log-probs of the policy the KL is taken of (FRPO: the rollout/old policy,
      held fixed across updates).
    ref_logp: ``f32[B, T]`` reference log-probs.
    mask: ``bool[B, T]`` real completion tokens. Padding is selected away before any arithmetic:
      inf/NaN log-probs there do not reach real tokens.
    kind: one of ``"k1"``, ``"k3"``, ``"forward_k3"``.
    max_delta: finite ``> 0``, where the exponentials turn linear.

  Returns:
    ``f32[B, T]``, 0 on padding.
  """
  kind, max_delta = _check_future(logp, ref_logp, mask, kind, max_delta)
  return _future_kl_jit(logp, ref_logp, mask, kind=kind, max_delta=max_delta)


def _frpo_advantages(advantages, old_logp, ref_logp, mask, *, beta, kind, max_delta):
  adv = advantages.astype(jnp.float32)
  adv = adv[:, None] if adv.ndim == 1 else adv
  reg = _future_kl(old_logp, ref_logp, mask, kind=kind, max_delta=max_delta)
  return jax.lax.stop_gradient(select(mask, select(mask, adv) - beta * reg))


_frpo_advantages_jit = _hyper.jit(_frpo_advantages, static_argnames=("kind",), numbers=("beta", "max_delta"))


def frpo_advantages(
  advantages, old_logp, ref_logp, mask, *, beta: float, kind: str = "k1", max_delta: float = MAX_DELTA
):
  """FRPO token advantages ``Â(i,t) = stop_gradient(a_i - β · reg(i,t))``.

  ``reg`` is :func:`future_kl` of the rollout (old) policy against the reference, computed once per
  rollout batch and held fixed across the μ updates (the paper's default). ``Â`` replaces the
  advantage inside the clipped surrogate; there is no separate KL loss term.

  Args:
    advantages: ``f32[B]`` outcome advantages ``a_i`` (or ``f32[B, T]`` token advantages).
    old_logp, ref_logp: ``f32[B, T]``; mask: ``bool[B, T]`` (padding selected away, as in
      :func:`future_kl`).
    beta: finite β >= 0 (0.01 in the paper's runs): a Python float (static) or a ``f32[]`` array
      (traced: a schedule or a ``vmap``-ped grid, one program).
    kind: future-KL estimator (default reverse ``"k1"``).
    max_delta: finite ``> 0``, where the exponentials turn linear.

  Returns:
    ``f32[B, T]``, 0 on padding, with no gradient.
  """
  beta = _checks.check_scalar(beta, "beta", at_least=0.0, hint="the future-KL coefficient β")
  kind, max_delta = _check_future(old_logp, ref_logp, mask, kind, max_delta, "old_logp")
  _checks.check_float(advantages, "advantages", "f32[B] or f32[B, T]")
  _checks.check_rank(advantages, (1, 2), "advantages", "f32[B] or f32[B, T]")
  shape, adv_shape = _checks.shape_of(old_logp), _checks.shape_of(advantages)
  if adv_shape not in (shape[:1], shape):
    raise ValueError(f"`advantages` must have shape {shape[:1]} or {shape} (matching `old_logp`); got {adv_shape}")
  return _frpo_advantages_jit(advantages, old_logp, ref_logp, mask, kind=kind, beta=beta, max_delta=max_delta)
