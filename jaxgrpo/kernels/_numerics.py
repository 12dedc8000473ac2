"""Shared numerics helpers of the kernels: guarded divisions, masked selection, masked reversed sums.

Every helper is "double where" safe: a value that is discarded (a zero denominator, a padding slot)
never enters the arithmetic, so it cannot turn into NaN in the result *or* in the gradient
(``where(ok, f(x), 0)`` alone still differentiates ``f`` at the discarded ``x``: ``0 * inf = NaN``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["safe_div", "safe_sqrt", "select", "masked_reverse_cumsum", "pow2_scale", "exp_linear", "exp_excess"]


def safe_div(num, den):
  """``num / den``, and 0 where ``den == 0`` (value and gradient finite there)."""
  ok = den != 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def safe_sqrt(x):
  """``sqrt(x)`` for ``x > 0``, else 0 (no infinite gradient at 0)."""
  ok = x > 0
  return jnp.where(ok, jnp.sqrt(jnp.where(ok, x, 1.0)), 0.0)


def select(mask, x, fill=0.0):
  """``x`` where ``mask``, else ``fill``: how a mask meets a value (never ``mask * x``: ``0 * inf = NaN``).

  Apply it to the *inputs* of a computation, not only to its output, so that a non-finite value in
  a discarded slot gives a zero gradient rather than ``0 * inf``.
  """
  return jnp.where(mask, x, fill)


def masked_reverse_cumsum(x, mask, *, exclusive: bool = False):
  """``out[b, t] = Σ_{j >= t, mask[b, j]} x[b, j]`` for ``x f32[B, T]``, ``mask bool[B, T]``
  (``j > t`` with ``exclusive=True``: the sum of what comes strictly after t).

  Masked-out entries are dropped by selection, so they may hold inf/NaN. The exclusive sum is a
  shifted inclusive one, not ``inclusive - x``, which cancels catastrophically when ``x[t]`` is large.
  """
  x = select(mask, x)
  if exclusive:
    x = jnp.concatenate([x[..., 1:], jnp.zeros_like(x[..., :1])], axis=-1)
  return jnp.flip(jnp.cumsum(jnp.flip(x, axis=-1), axis=-1), axis=-1)


def pow2_scale(max_abs):
  """A power of two ``s >= max_abs`` (1 where ``max_abs`` is 0), without gradient; at most the
  largest finite power of two of the dtype (2**127 in float32), so ``s`` is finite and ``|x / s| < 2``.

  Dividing by ``s`` is exact in floating point, so statistics computed on ``x / s`` and scaled back
  are bit-identical to the direct computation whenever that one does not overflow — and they do
  not overflow when it would (e.g. the square of a reward of 1e30 in float32).
  """
  _, exponent = jnp.frexp(jax.lax.stop_gradient(max_abs))
  exponent = jnp.minimum(exponent, jnp.finfo(jnp.result_type(max_abs)).maxexp - 1)
  return jnp.ldexp(jnp.ones_like(max_abs), exponent)


def exp_linear(x, c):
  """``exp(x)`` for ``x <= c``, continued past ``c`` by its tangent there: ``e^c · (1 + x - c)``.

  The overflow-safe exponential of the KL estimators: finite for every finite ``x`` (no overflow to
  inf however large ``x`` is), continuous with a continuous derivative (``e^x``, then ``e^c``), and
  strictly increasing, so a quantity built from it keeps the direction of the exact one where a
  clamped ``exp(min(x, c))`` would freeze (zero gradient) and let the linear terms around it turn the
  gradient's sign. It is ``<= exp(x)`` everywhere (the exponential is convex). Below ``c`` it is the
  exact ``exp`` (which underflows to 0 harmlessly). ``c`` may be a Python float or a traced scalar.
  """
  return jnp.exp(jnp.minimum(x, c)) * (1.0 + jnp.maximum(x - c, 0.0))


def exp_excess(x, c):
  """``e^x - x - 1 >= 0`` with ``e^x`` replaced by :func:`exp_linear`: for ``x > c`` it is
  ``e^c - c - 1 + (e^c - 1)(x - c)``, the tangent continuation of the whole function (its linear terms
  are exact already).

  The k3-type KL estimators are this function of ``±δ`` (``k3 = exp_excess(-δ)``,
  ``forward_k3 = exp_excess(δ)``). It is decreasing for ``x < 0``, increasing for ``x > 0`` with slope
  ``e^min(x, c) - 1`` — the sign of the exact one everywhere — and written as a sum of two terms that
  are each finite or ``+inf``, so ``x = ±inf`` gives ``+inf``, never ``inf - inf = NaN``. For
  ``x <= c`` the arithmetic is ``(exp(x) - x) - 1``, bit for bit. Needs ``c > 0``.
  """
  xc = jnp.minimum(x, c)
  e = jnp.exp(xc)
  return (e - xc - 1.0) + (e - 1.0) * jnp.maximum(x - c, 0.0)
