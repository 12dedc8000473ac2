"""The one carrier of the algorithm's numbers: :class:`GRPOHyper`.

A frozen, validated pytree of the numbers a GRPO-family objective reads — β, ε_low, ε_high, the dual
clip's c, SAPO's τ±, the IS cap and the entropy coefficient — and the loss's structure (surrogate,
aggregation, ``max_tokens``). Each number is *static* when it is a Python float (a compile-time constant;
a static 0 leaves its term out of the program) and *traced* when it is an array (one compiled program
for every value: a schedule, a ``vmap`` over a grid, an outer ``jit``); structure is always static
(``jaxgrpo.kernels._hyper``).

The same object is what :meth:`GRPOConfig.hyper() <jaxgrpo.kernels.config.GRPOConfig.hyper>` returns for the
train step (every number an ``f32[]`` array), what the objective hands the loss, and what a direct call
of :func:`~jaxgrpo.kernels.losses.policy_loss` takes::

    policy_loss(logp, old, adv, mask, GRPOHyper(loss="cispo", clip_eps_high=5.0))      # static: constants
    policy_loss(logp, old, adv, mask, GRPOHyper(beta=jnp.float32(0.04)), kl=kl)         # traced: one program
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxgrpo import _checks
from jaxgrpo.kernels import _hyper
from jaxgrpo.kernels import surrogates as _surrogates

__all__ = ["AGGREGATIONS", "GRPOHyper", "NUMBERS"]

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
#: the numeric fields, in the order of the pytree's leaves
NUMBERS = ("beta", "clip_eps_low", "clip_eps_high", "dual_clip", "tau_pos", "tau_neg", "importance_cap", "entropy_coef")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOHyper:
  """The numbers of an objective (see the module docstring), validated on construction (concrete values
  are range-checked; a tracer is checked for being a scalar where it is used).

  Attributes:
    beta: finite β >= 0, the KL coefficient; a β that may be > 0 needs the ``kl`` input of the loss.
    clip_eps_low, clip_eps_high: finite ε_low, ε_high >= 0 of the clip (DAPO: 0.2, 0.28; GSPO: 3e-4,
      4e-4; CISPO: the weight's range; GMPO: the log-ratio range, 0.4).
    dual_clip: finite c > 1 for the dual clip on negative advantages (``"ppo"`` only), or None (structural).
    tau_pos, tau_neg: SAPO's gate temperatures (1.0, 1.05); read only by ``"sapo"``.
    importance_cap: C > 0, the cap of the IS ratio (TIS/MIS; read by the objective, not by the loss).
    entropy_coef: finite c: ``−c·H(i,t)`` is added to every token term; a c that may be non-zero needs the
      ``entropy`` input of the loss.
    loss: the surrogate, one of ``"ppo"`` (default), ``"gspo"``, ``"gspo_token"``, ``"cispo"``, ``"sapo"``,
      ``"gmpo"`` (:mod:`jaxgrpo.kernels.surrogates`); static.
    aggregation: ``"token-mean"``, ``"seq-mean-token-mean"`` or ``"seq-mean-token-sum-norm"``; static.
    max_tokens: int >= 1, the constant of ``seq-mean-token-sum-norm`` (None: ``T``); static.
  """

  beta: Any = 0.0
  clip_eps_low: Any = 0.2
  clip_eps_high: Any = 0.2
  dual_clip: Any = None
  tau_pos: Any = 1.0
  tau_neg: Any = 1.05
  importance_cap: Any = 2.0
  entropy_coef: Any = 0.0
  loss: str = "ppo"
  aggregation: str = "token-mean"
  max_tokens: int | None = None

  #: the numeric fields (NamedTuple-style name, for code that iterates over them)
  _fields = NUMBERS

  def __post_init__(self):
    checked = dict(
      **_surrogates.check_hyper(
        self.loss, self.clip_eps_low, self.clip_eps_high, self.dual_clip, self.tau_pos, self.tau_neg
      ),
      aggregation=_checks.check_choice(self.aggregation, AGGREGATIONS, "aggregation"),
      max_tokens=None
      if self.max_tokens is None
      else _checks.check_python_int(self.max_tokens, "max_tokens", minimum=1, hint="or None for T"),
      beta=_checks.check_scalar(self.beta, "beta", at_least=0.0, hint="the KL coefficient β"),
      entropy_coef=_checks.check_scalar(self.entropy_coef, "entropy_coef", hint="the entropy bonus coefficient"),
      importance_cap=_checks.check_scalar(self.importance_cap, "importance_cap", above=0.0, hint="the IS ratio cap C"),
    )
    for name, value in checked.items():
      object.__setattr__(self, name, value)

  def replace(self, **changes) -> GRPOHyper:
    """A copy with some fields changed (validated again)."""
    return dataclasses.replace(self, **changes)

  def _replace(self, **changes) -> GRPOHyper:
    """A copy with some fields changed, not validated again (for values built inside a traced function)."""
    unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
    if unknown:
      raise TypeError(f"unknown GRPOHyper field(s) {sorted(unknown)}")
    obj = object.__new__(type(self))
    for f in dataclasses.fields(self):
      object.__setattr__(obj, f.name, changes.get(f.name, getattr(self, f.name)))
    return obj

  def numbers(self) -> dict[str, Any]:
    """``{name: value}`` of the numeric fields."""
    return {n: getattr(self, n) for n in NUMBERS}


_hyper.register(GRPOHyper, numbers=NUMBERS)
