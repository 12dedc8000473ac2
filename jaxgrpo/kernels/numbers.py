"""The algorithm's numbers, each declared once: :data:`NUMBERS`, one :class:`Number` per name (its default, its
range, a one-line hint, what reads it and whether it may be traced).

Everything else is derived from this table: the numeric fields of
:class:`~jaxgrpo.kernels.config.GRPOConfig` (type, default, check — and so the run config's ``objective:``
keys), the fields of :class:`~jaxgrpo.kernels.hyper.GRPOHyper` and their checks (concrete or traced), the
keywords of :func:`~jaxgrpo.kernels.surrogates.policy_surrogate`, the coefficients whose static 0 leaves their
term out (:data:`SWITCHED`) and the ``hyper/<name>`` metrics
(:attr:`GRPOConfig.applied_hyper <jaxgrpo.kernels.config.GRPOConfig.applied_hyper>`). Which surrogates read a
``"surrogate"`` number is said by the surrogate's registry entry (:data:`jaxgrpo.kernels.surrogates.REGISTRY`).

A ``"traced"`` number is a :class:`GRPOHyper` field that is static as a Python float (a compile-time constant)
or traced as an array (one program for every value: a schedule, a ``vmap``-ped grid); a ``"static"`` one is a
``GRPOHyper`` field that is always static (it shapes the program); a ``"config"`` one is the config's alone.
A new number is one more :class:`Number` in :data:`NUMBERS`; a new surrogate that reads it names it in its
registry entry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxgrpo import _checks

__all__ = ["CARRIERS", "NUMBERS", "READERS", "SWITCHED", "Number", "add_fields", "describe", "names"]

#: where a number lives: a GRPOHyper field static or traced, a GRPOHyper field always static, the config's alone
CARRIERS = ("traced", "static", "config")
#: what reads a number: the surrogates that list it, every loss, the off-policy correction, the advantages, the step
READERS = ("surrogate", "loss", "importance", "advantages", "step")


@dataclasses.dataclass(frozen=True)
class Number:
  """One algorithm number.

  Attributes:
    name: the field name (of :class:`GRPOConfig`, and of :class:`GRPOHyper` unless ``carrier="config"``).
    default: its default value (None only when ``optional``).
    hint: one line saying what it is (and, when optional, what None means), quoted by every error about it.
    at_least, above: the range's lower bound, inclusive or exclusive (None: no bound; always finite).
    integer: a Python int (else a float).
    optional: None is a value (the term left out, or a default derived elsewhere); it is structural.
    carrier: one of :data:`CARRIERS`.
    switch: a static 0 leaves its term out of the program (β, the entropy coefficient).
    read_by: one of :data:`READERS`.
  """

  name: str
  default: Any
  hint: str
  at_least: float | None = None
  above: float | None = None
  integer: bool = False
  optional: bool = False
  carrier: str = "traced"
  switch: bool = False
  read_by: str = "surrogate"

  @property
  def annotation(self):
    """The config field's type: ``float``/``int``, ``| None`` when optional."""
    base = int if self.integer else float
    return base | None if self.optional else base

  def check(self, value, name: str | None = None):
    """``value`` as a static setting (a config field): a Python number in range, or None when optional.
    ``TypeError``/``ValueError`` naming ``name`` (default: the number's) with the hint."""
    name = self.name if name is None else name
    if value is None and self.optional:
      return None
    if self.integer:
      return _checks.check_python_int(value, name, minimum=self.at_least, hint=self.hint)
    return _checks.check_python_float(value, name, at_least=self.at_least, above=self.above, hint=self.hint)

  def check_value(self, value, name: str | None = None):
    """``value`` as a hyper-parameter: a Python float (static, returned as ``float``), an array (traced,
    returned unchanged, range-checked when concrete) or None when optional; the static carriers as
    :meth:`check`."""
    if self.carrier != "traced" or (value is None and self.optional):
      return self.check(value, name)
    name = self.name if name is None else name
    return _checks.check_scalar(value, name, at_least=self.at_least, above=self.above, hint=self.hint)


def _declare(*numbers: Number) -> dict[str, Number]:
  for n in numbers:
    assert n.carrier in CARRIERS and n.read_by in READERS and (n.default is not None or n.optional), n
    assert not n.optional or "None" in n.hint, f"{n.name}: the hint of an optional number says what None means"
  return {n.name: n for n in numbers}


#: every number, in the order of :class:`GRPOHyper`'s pytree leaves (the ``"traced"`` ones first)
NUMBERS: dict[str, Number] = _declare(
  Number("beta", 0.0, "the KL coefficient β", at_least=0.0, switch=True, read_by="loss"),
  Number("clip_eps_low", 0.2, "ε_low of the clip", at_least=0.0),
  Number("clip_eps_high", 0.2, "ε_high of the clip", at_least=0.0),
  Number(
    "dual_clip",
    None,
    "c of the dual clip for negative advantages, typically 3, or None (off)",
    above=1.0,
    optional=True,
  ),
  Number("tau_pos", 1.0, "SAPO's τ for A > 0", above=0.0),
  Number("tau_neg", 1.05, "SAPO's τ for A <= 0", above=0.0),
  Number("importance_cap", 2.0, "the IS ratio cap C", above=0.0, read_by="importance"),
  Number("entropy_coef", 0.0, "the entropy bonus coefficient c", switch=True, read_by="loss"),
  Number(
    "max_tokens",
    None,
    "the constant of seq-mean-token-sum-norm, or None for the padded length",
    at_least=1,
    integer=True,
    optional=True,
    carrier="static",
    read_by="loss",
  ),
  Number("std_ddof", 0, "ddof of the std", at_least=0, integer=True, carrier="config", read_by="advantages"),
  Number("std_eps", 1e-6, "eps added to the std", at_least=0.0, carrier="config", read_by="advantages"),
  Number(
    "num_iterations", 1, "μ, updates per rollout batch", at_least=1, integer=True, carrier="config", read_by="step"
  ),
  Number(
    "importance_low",
    None,
    "the band's lower bound L, or None for IcePop's α, importance.DEFAULT_LOW",
    above=0.0,
    optional=True,
    carrier="config",
    read_by="importance",
  ),
)

#: the coefficients whose static 0 leaves their term out of the program (and β: the reference pass)
SWITCHED = tuple(n for n, d in NUMBERS.items() if d.switch)


def names(*, carrier: str | tuple[str, ...] = CARRIERS, read_by: str | tuple[str, ...] = READERS) -> tuple[str, ...]:
  """The names of the numbers with the given carrier(s) and reader(s), in :data:`NUMBERS`' order.

  >>> names(carrier="traced", read_by="surrogate")
  ('clip_eps_low', 'clip_eps_high', 'dual_clip', 'tau_pos', 'tau_neg')
  """
  carrier = (carrier,) if isinstance(carrier, str) else carrier
  read_by = (read_by,) if isinstance(read_by, str) else read_by
  return tuple(n for n, d in NUMBERS.items() if d.carrier in carrier and d.read_by in read_by)


def add_fields(names_: tuple[str, ...], *, annotation=None, first: bool = False, read_by=None):
  """A class decorator, applied *under* ``@dataclasses.dataclass``: the numbers ``names_`` become fields of the
  class, with their defaults and their types (``annotation``, e.g. ``Any`` for a carrier of arrays, else
  :attr:`Number.annotation`), before the class's own fields (``first``) or after them; each gets its
  :func:`describe` line at the top (``first``) or the end of the docstring's ``Attributes:`` section (its last) (``read_by``: an optional
  ``name -> str | None`` saying who reads it)."""

  def add(cls):
    own = dict(cls.__dict__.get("__annotations__", {}))
    new = {n: NUMBERS[n].annotation if annotation is None else annotation for n in names_}
    clash = set(own) & set(new)
    assert not clash, f"{cls.__name__} declares {sorted(clash)} itself"
    cls.__annotations__ = {**new, **own} if first else {**own, **new}
    for n in names_:
      setattr(cls, n, NUMBERS[n].default)
    lines = "".join(f"    {describe(n, read_by(n) if read_by else None)}\n" for n in names_)
    assert "\n  Attributes:\n" in cls.__doc__, f"{cls.__name__}'s docstring has no Attributes section (the last)"
    if first:
      cls.__doc__ = cls.__doc__.replace("\n  Attributes:\n", "\n  Attributes:\n" + lines, 1)
    else:
      cls.__doc__ = f"{cls.__doc__.rstrip()}\n{lines}  "
    return cls

  return add


def describe(name: str, read_by: str | None = None) -> str:
  """One docstring line for the number ``name``: its hint, range, default and reader (``read_by``: who reads
  it, when the caller knows better than :attr:`Number.read_by`, e.g. the surrogates' names).

  >>> describe("tau_pos", "loss 'sapo'")
  "tau_pos: SAPO's τ for A > 0 (a float > 0.0; default 1.0; read by loss 'sapo'; may be traced, as a GRPOHyper array)"
  """
  d = NUMBERS[name]
  bound = f" >= {d.at_least}" if d.at_least is not None else f" > {d.above}" if d.above is not None else ""
  kind = f"{'an int' if d.integer else 'a float'}{bound}"
  how = {"traced": "; may be traced, as a GRPOHyper array", "static": "; static", "config": ""}[d.carrier]
  return f"{name}: {d.hint} ({kind}; default {d.default!r}; read by {read_by or _READ_BY[d.read_by]}{how})"


_READ_BY = {
  "surrogate": "the surrogates that list it",
  "loss": "the loss",
  "importance": "the off-policy correction",
  "advantages": "the group advantages",
  "step": "the train step",
}
