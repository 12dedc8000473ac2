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
from jaxgrpo.kernels import numbers as _numbers
from jaxgrpo.kernels import surrogates as _surrogates

__all__ = ["AGGREGATIONS", "GRPOHyper", "NUMBERS"]

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
#: the numeric fields, in the order of the pytree's leaves (the ``"traced"`` numbers of ``jaxgrpo.kernels.numbers``)
NUMBERS = _numbers.names(carrier="traced")
#: the numbers that are always static (structure, as ``loss`` and ``aggregation``)
_STATIC = _numbers.names(carrier="static")


@dataclasses.dataclass(frozen=True, kw_only=True)
@_numbers.add_fields(NUMBERS, annotation=Any, first=True, read_by=_surrogates.read_by)
@_numbers.add_fields(_STATIC)
class GRPOHyper:
  """The numbers of an objective (see the module docstring), validated on construction (concrete values
  are range-checked; a tracer is checked for being a scalar where it is used).

  The numbers, declared in :data:`jaxgrpo.kernels.numbers.NUMBERS` (each a Python float, static, or an array,
  traced), then the structure (static).

  Attributes:
    loss: the surrogate, a name of :data:`jaxgrpo.kernels.surrogates.REGISTRY`: ``"ppo"`` (default),
      ``"gspo"``, ``"gspo_token"``, ``"cispo"``, ``"sapo"``, ``"gmpo"`` or a registered one; static.
    aggregation: ``"token-mean"``, ``"seq-mean-token-mean"`` or ``"seq-mean-token-sum-norm"``; static.
  """

  loss: str = "ppo"
  aggregation: str = "token-mean"

  #: the numeric fields (NamedTuple-style name, for code that iterates over them)
  _fields = NUMBERS

  def __post_init__(self):
    checked = dict(
      **_surrogates.check_numbers(self.loss, {n: getattr(self, n) for n in NUMBERS}),
      aggregation=_checks.check_choice(self.aggregation, AGGREGATIONS, "aggregation"),
      **{n: _numbers.NUMBERS[n].check(getattr(self, n)) for n in _STATIC},
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
