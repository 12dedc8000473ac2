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

**The registry.** :data:`REGISTRY` maps each ``loss`` name to a :class:`SurrogateSpec` ``(fn, numbers,
sequence_level)``: the function of the per-token term, the numbers it reads (by name, from
:data:`jaxgrpo.kernels.numbers.NUMBERS`) and whether its term is one value per sequence. Everything that takes
a ``loss`` — :class:`~jaxgrpo.kernels.config.GRPOConfig`, :class:`~jaxgrpo.kernels.hyper.GRPOHyper`, the loss,
the objective, the train step, a run config's ``objective.loss`` — looks the name up here, so a new loss is
one :func:`register_surrogate` call (docs/train.md, "A new surrogate", has a runnable example).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxgrpo import _checks
from jaxgrpo.kernels import _hyper
from jaxgrpo.kernels._numerics import safe_div, select
from jaxgrpo.kernels.numbers import NUMBERS, names

__all__ = [
  "MAX_LOG_RATIO",
  "NUMBERS_READ",
  "REGISTRY",
  "SEQUENCE_SURROGATES",
  "SURROGATES",
  "Surrogate",
  "SurrogateSpec",
  "policy_surrogate",
  "read_by",
  "readers",
  "register_surrogate",
  "surrogate_spec",
  "surrogate_terms",
]

MAX_LOG_RATIO = 20.0
#: the numbers a surrogate may read (the ``"surrogate"`` numbers of ``jaxgrpo.kernels.numbers``), in their order
NUMBERS_READ = names(carrier="traced", read_by="surrogate")


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


class SurrogateSpec(NamedTuple):
  """One registered loss (:data:`REGISTRY`).

  Attributes:
    fn: ``fn(logp, old_logp, adv, real, **numbers) -> Surrogate``, a pure JAX function of ``logp`` ``f32[B, T]``
      (differentiable), ``old_logp`` ``f32[B, T]`` (no gradient), the advantages ``adv`` (``f32[B, T]`` for a
      token-level loss, ``f32[B]`` for a sequence-level one; no gradient) and ``real`` ``bool[B, T]``, every
      input already 0 on padding; ``numbers``: exactly the keywords named in ``numbers``, each a Python float
      (static) or an ``f32[]`` (traced). It returns :class:`Surrogate`, its ``loss`` 0 on padding.
    numbers: the names of the numbers ``fn`` reads, from :data:`NUMBERS_READ`.
    sequence_level: the term is one value per sequence: ``f32[B]`` advantages only, and the config refuses
      λ-GRPO's token weights and FRPO's per-token advantages with it.
  """

  fn: Callable
  numbers: tuple[str, ...] = ()
  sequence_level: bool = False


def _row_mean(x, real):
  """``f32[B]`` mean of ``x`` over each row's real tokens (0 for an empty row; finite gradient)."""
  return safe_div(jnp.sum(select(real, x), axis=1), jnp.sum(real, axis=1).astype(jnp.float32))


def _on_tokens(per_row, real):
  return select(real, jnp.broadcast_to(per_row[:, None], real.shape))


def _log_ratio(logp, old_logp):
  """The token log-ratio clamped to ``±MAX_LOG_RATIO`` (0 on padding: the inputs are)."""
  return jnp.clip(logp - old_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)


def _ppo(logp, old_logp, adv, real, *, clip_eps_low, clip_eps_high, dual_clip) -> Surrogate:
  ratio = jnp.exp(_log_ratio(logp, old_logp))
  s = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv)
  dual = jnp.zeros_like(real)
  if dual_clip is not None:
    dual = real & (adv < 0) & (s < dual_clip * adv)
    s = jnp.where(dual, dual_clip * adv, s)
  low = real & (adv < 0) & (ratio < 1.0 - clip_eps_low)
  high = real & (adv > 0) & (ratio > 1.0 + clip_eps_high)
  return Surrogate(select(real, -s), low, high, dual)


def _gspo(logp, old_logp, adv, real, *, clip_eps_low, clip_eps_high) -> Surrogate:
  s = jnp.exp(jnp.clip(_row_mean(logp - old_logp, real), -MAX_LOG_RATIO, MAX_LOG_RATIO))  # [B], with gradient
  per_row = -jnp.minimum(s * adv, jnp.clip(s, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv)
  low = _on_tokens((adv < 0) & (s < 1.0 - clip_eps_low), real)
  high = _on_tokens((adv > 0) & (s > 1.0 + clip_eps_high), real)
  return Surrogate(_on_tokens(per_row, real), low, high, jnp.zeros_like(real))


def _gspo_token(logp, old_logp, adv, real, *, clip_eps_low, clip_eps_high) -> Surrogate:
  sg = jax.lax.stop_gradient
  log_s = sg(jnp.clip(_row_mean(logp - old_logp, real), -MAX_LOG_RATIO, MAX_LOG_RATIO))  # [B]
  s = jnp.exp(log_s[:, None] + logp - sg(logp))  # value s_i, gradient s_i ∇logp on its own token
  per = -jnp.minimum(s * adv, jnp.clip(s, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv)
  low = real & (adv < 0) & (s < 1.0 - clip_eps_low)
  high = real & (adv > 0) & (s > 1.0 + clip_eps_high)
  return Surrogate(select(real, per), low, high, jnp.zeros_like(real))


def _cispo(logp, old_logp, adv, real, *, clip_eps_low, clip_eps_high) -> Surrogate:
  ratio = jnp.exp(_log_ratio(logp, old_logp))
  weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high))
  low = real & (ratio < 1.0 - clip_eps_low)
  high = real & (ratio > 1.0 + clip_eps_high)
  return Surrogate(select(real, -weight * adv * logp), low, high, jnp.zeros_like(real))


def _sapo(logp, old_logp, adv, real, *, tau_pos, tau_neg) -> Surrogate:
  ratio = jnp.exp(_log_ratio(logp, old_logp))
  tau = jnp.where(adv > 0, tau_pos, tau_neg)
  gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
  none = jnp.zeros_like(real)
  return Surrogate(select(real, -gate * adv), none, none, none)


def _gmpo(logp, old_logp, adv, real, *, clip_eps_low, clip_eps_high) -> Surrogate:
  log_ratio = logp - old_logp  # 0 on padding (selected inputs)
  a = adv[:, None]
  clipped = jnp.where(
    a > 0, jnp.minimum(log_ratio, clip_eps_high), jnp.where(a < 0, jnp.maximum(log_ratio, -clip_eps_low), 0.0)
  )
  s = jnp.exp(jnp.clip(_row_mean(clipped, real), -MAX_LOG_RATIO, MAX_LOG_RATIO))  # [B] geometric mean
  low = real & (a < 0) & (log_ratio < -clip_eps_low)
  high = real & (a > 0) & (log_ratio > clip_eps_high)
  return Surrogate(_on_tokens(-adv * s, real), low, high, jnp.zeros_like(real))


_EPS = ("clip_eps_low", "clip_eps_high")

#: every loss by name; extend it with :func:`register_surrogate`
REGISTRY: dict[str, SurrogateSpec] = {
  "ppo": SurrogateSpec(_ppo, (*_EPS, "dual_clip")),
  "gspo": SurrogateSpec(_gspo, _EPS, sequence_level=True),
  "gspo_token": SurrogateSpec(_gspo_token, _EPS),
  "cispo": SurrogateSpec(_cispo, _EPS),
  "sapo": SurrogateSpec(_sapo, ("tau_pos", "tau_neg")),
  "gmpo": SurrogateSpec(_gmpo, _EPS, sequence_level=True),
}
#: the built-in losses' names (:data:`REGISTRY` also holds the ones registered later)
SURROGATES = tuple(REGISTRY)
#: the built-in losses whose term is one value per sequence (``f32[B]`` advantages, no token weights)
SEQUENCE_SURROGATES = tuple(n for n, s in REGISTRY.items() if s.sequence_level)


def register_surrogate(name: str, fn: Callable, *, numbers=(), sequence_level: bool = False) -> SurrogateSpec:
  """Register the loss ``name`` (see :class:`SurrogateSpec` for ``fn``'s contract): from then on
  ``GRPOConfig(loss=name)``, ``GRPOHyper(loss=name)``, ``policy_surrogate(..., loss=name)`` and a run config's
  ``objective.loss: name`` use it, with every aggregation, the KL and entropy terms, the off-policy correction and
  the token weights (token-level losses). A name is registered once: the compiled programs are cached by it.

  >>> spec = register_surrogate("reinforce_doc", lambda logp, old_logp, adv, real: Surrogate(
  ...   -adv * logp, jnp.zeros_like(real), jnp.zeros_like(real), jnp.zeros_like(real)))
  >>> REGISTRY.pop("reinforce_doc") is spec
  True
  """
  if not isinstance(name, str) or not name.isidentifier():
    raise ValueError(f"a surrogate's `name` must be an identifier str (e.g. 'my_loss'); got {name!r}")
  if name in REGISTRY:
    raise ValueError(f"surrogate {name!r} is already registered (as {REGISTRY[name].fn!r}): choose another name")
  if not callable(fn):
    raise TypeError(f"surrogate {name!r}: `fn` must be callable (logp, old_logp, adv, real, **numbers); got {fn!r}")
  numbers = tuple(numbers) if isinstance(numbers, (tuple, list)) else numbers
  if not isinstance(numbers, tuple) or any(n not in NUMBERS_READ for n in numbers):
    raise ValueError(
      f"surrogate {name!r}: `numbers` must be a tuple of some of {list(NUMBERS_READ)} (a new number is one "
      f"jaxgrpo.kernels.numbers.Number in NUMBERS); got {numbers!r}"
    )
  spec = SurrogateSpec(fn, numbers, _checks.check_python_bool(sequence_level, "sequence_level"))
  REGISTRY[name] = spec
  return spec


def surrogate_spec(loss) -> SurrogateSpec:
  """The :class:`SurrogateSpec` of ``loss`` (ValueError listing the registered names otherwise)."""
  return REGISTRY[_checks.check_choice(loss, tuple(REGISTRY), "loss")]


def readers(number: str) -> tuple[str, ...]:
  """The registered losses that read ``number``."""
  return tuple(n for n, s in REGISTRY.items() if number in s.numbers)


def read_by(number: str) -> str | None:
  """Who reads ``number``, for docstrings: ``"loss 'ppo'"`` for a surrogate's number, else None."""
  if NUMBERS[number].read_by != "surrogate":
    return None
  return f"loss {', '.join(map(repr, readers(number)))}"


def surrogate_terms(logp, old_logp, advantages, mask, *, loss, **numbers) -> Surrogate:
  """The surrogate ``loss`` inside a traced function, unchecked (the loss kernel's call): the inputs as
  float32 with padding selected away, the advantages broadcast to ``[B, T]`` for a token-level loss, and
  the numbers ``loss`` reads (:attr:`SurrogateSpec.numbers`) taken from ``numbers``."""
  spec = REGISTRY[loss]
  sg = jax.lax.stop_gradient
  real = mask
  b, t = logp.shape
  logp = select(real, logp.astype(jnp.float32))
  old_logp = select(real, sg(old_logp.astype(jnp.float32)))
  adv = sg(advantages.astype(jnp.float32))
  if not spec.sequence_level:  # a sequence-level loss takes f32[B], checked by the wrappers
    adv = select(real, jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, (b, t)))
  return spec.fn(logp, old_logp, adv, real, **{n: numbers[n] for n in spec.numbers})


# ----------------------------------------------------------------------------- checks


def check_loss(loss, numbers: dict) -> str:
  """``loss``, a registered name, checked with its ``numbers``: an optional number (None: off, e.g. the dual
  clip) set to a value is refused when the loss does not read it."""
  spec = surrogate_spec(loss)
  for n, value in numbers.items():
    if value is not None and NUMBERS[n].optional and n not in spec.numbers:
      raise ValueError(
        f"`{n}` ({NUMBERS[n].hint}) is read by loss {' or '.join(map(repr, readers(n)))} only; loss={loss!r} "
        f"has none: pass {n}=None"
      )
  return loss


def check_numbers(loss, numbers: dict) -> dict:
  """``numbers`` (a Python float: static, or an array: traced and range-checked when concrete; each
  :meth:`~jaxgrpo.kernels.numbers.Number.check_value`) with ``loss`` checked by :func:`check_loss`."""
  checked = {n: NUMBERS[n].check_value(v) for n, v in numbers.items()}
  return dict(loss=check_loss(loss, checked), **checked)


def check_advantages(loss: str, advantages, shape) -> None:
  """``f32[B]`` or ``f32[B, T]`` advantages; ``f32[B]`` for the sequence surrogates."""
  _checks.check_float(advantages, "advantages", "f32[B] or f32[B, T]")
  _checks.check_rank(advantages, (1, 2), "advantages", "f32[B] or f32[B, T]")
  got = _checks.shape_of(advantages)
  if got not in (shape[:1], shape):
    raise ValueError(f"`advantages` must have shape {shape[:1]} or {shape}; got {got}")
  if surrogate_spec(loss).sequence_level and got != shape[:1]:
    raise ValueError(
      f"loss={loss!r} takes one advantage per sequence, f32[B] = {shape[:1]}; got per-token advantages {got} "
      "(e.g. FRPO's). Use a token-level loss: 'gspo_token' (GSPO's sequence ratio with per-token advantages), "
      "'cispo', 'sapo' or 'ppo'"
    )


_surrogate_jit = _hyper.jit(surrogate_terms, static_argnames=("loss",), numbers=NUMBERS_READ)


def policy_surrogate(logp, old_logp, advantages, mask, *, loss="ppo", **numbers) -> Surrogate:
  """The per-token policy term ``p(i,t)`` of ``loss`` (see the module table), unaggregated.

  Args:
    logp: ``f32[B, T]`` current-policy log-probs of the sampled tokens (differentiable).
    old_logp: ``f32[B, T]`` rollout-policy log-probs (no gradient).
    advantages: ``f32[B]`` or ``f32[B, T]`` (``f32[B]`` only for the sequence-level losses, ``"gspo"`` and
      ``"gmpo"``).
    mask: ``bool[B, T]`` real tokens; every other input is ignored on padding.
    loss: a name of :data:`REGISTRY`: ``"ppo"``, ``"gspo"``, ``"gspo_token"``, ``"cispo"``, ``"sapo"``,
      ``"gmpo"`` or a registered one.
    numbers: any of :data:`NUMBERS_READ` by keyword (each a Python float, static, or a ``f32[]`` array,
      traced: ``jaxgrpo.kernels._hyper``; the others at their defaults, ``jaxgrpo.kernels.numbers``):
      ``clip_eps_low``, ``clip_eps_high`` — ε_low, ε_high >= 0: the ratio range ``[1−ε_low, 1+ε_high]``
      (``ppo``, ``gspo``, ``gspo_token``; ``cispo``'s weight), the log-ratio range ``[−ε_low, ε_high]`` for
      ``gmpo``; ``dual_clip`` — c > 1 of PPO's dual clip (``"ppo"`` only), or None; ``tau_pos``, ``tau_neg`` —
      SAPO's gate temperatures τ for A > 0 and A <= 0 (paper: 1.0, 1.05).

  Returns:
    :class:`Surrogate` ``(loss f32[B, T], clip_low, clip_high, clip_dual bool[B, T])``.
  """
  unknown = sorted(set(numbers) - set(NUMBERS_READ))
  if unknown:
    raise TypeError(f"policy_surrogate: unknown keyword(s) {unknown}; the numbers are {list(NUMBERS_READ)}")
  shape = _checks.check_logp_pair(logp, old_logp, mask, ("logp", "old_logp"))
  hyper = check_numbers(loss, {n: numbers.get(n, NUMBERS[n].default) for n in NUMBERS_READ})
  loss = hyper.pop("loss")
  check_advantages(loss, advantages, shape)
  return _surrogate_jit(logp, old_logp, advantages, mask, loss=loss, **hyper)
