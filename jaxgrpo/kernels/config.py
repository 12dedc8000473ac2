"""Algorithm configuration: one frozen dataclass whose fields are the papers' symbols, and named presets.

=================  ==========================================================================
preset             what it is
=================  ==========================================================================
``grpo``           GRPO (DeepSeekMath) with group-std advantages and token-mean aggregation,
                   the form analysed by λ-GRPO; β=0 (set ``beta=0.04`` for the k3 KL term)
``dr_grpo``        Dr.GRPO: no std division, ``seq-mean-token-sum-norm``
``dapo``           DAPO: clip-higher (ε_low 0.2, ε_high 0.28), token-mean, β=0, dynamic sampling
``lambda_grpo``    λ-GRPO: GRPO with every token term divided by ``|λ(i,t)|``
``frpo``           FRPO: β=0.01 future-KL (reverse k1) cost-to-go inside the advantage
``lambda_frpo``    FRPO advantages with λ-GRPO's ``1/|λ|`` token weights (no paper has run it)
``gspo``           GSPO: sequence-level ratio, ε 3e-4/4e-4, mean over sequences (arXiv:2507.18071)
``gspo_token``     GSPO-token: GSPO's ratio with per-token gradient routing (same defaults)
``cispo``          CISPO: clipped stop-gradient IS weight on REINFORCE, weight ≤ 5 and no lower bound
                   (ε_low 1, ε_high 4; arXiv:2506.13585, ScaleRL's ε_max = 5), token-mean
``sapo``           SAPO: soft gate, τ_pos 1.0, τ_neg 1.05, mean over sequences (arXiv:2511.20347)
``gmpo``           GMPO: geometric mean of token ratios clipped to (e^−0.4, e^0.4), mean over
                   sequences (arXiv:2507.20673)
=================  ==========================================================================

Composition with λ-GRPO's ``1/|λ|`` weights (``process_weights``) and FRPO's per-token future-KL
advantage (``kl_placement="future"``) — new combinations, no paper or peer has run them:

- token-level losses (``ppo``, ``gspo_token``, ``cispo``, ``sapo``): both compose — the weight
  multiplies the token term, the per-token advantage enters the token's surrogate (and picks SAPO's
  τ by its sign);
- sequence losses (``gspo``, ``gmpo``): refused when the config is built (``ValueError``): their term
  is one value per sequence, so neither a per-token weight nor a per-token advantage has a meaning
  there without a new definition; ``gspo_token`` is GSPO with both.

Off-policy correction (``importance_correction``, :mod:`jaxgrpo.kernels.importance`) and the entropy bonus
(``entropy_coef``) compose with every loss.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo import _checks
from jaxgrpo.kernels import importance as _importance
from jaxgrpo.kernels import numbers as _numbers
from jaxgrpo.kernels import surrogates as _surrogates
from jaxgrpo.kernels.advantages import ADVANTAGE_SCALES
from jaxgrpo.kernels.distill import DistillConfig
from jaxgrpo.kernels.hyper import GRPOHyper
from jaxgrpo.kernels.importance import CORRECTIONS, IMPORTANCE_LEVELS
from jaxgrpo.kernels.kl import FUTURE_KL_KINDS, KL_KINDS
from jaxgrpo.kernels.losses import AGGREGATIONS
from jaxgrpo.kernels.numbers import NUMBERS

__all__ = ["KL_PLACEMENTS", "GRPOConfig", "GRPOHyper", "PRESETS", "preset"]

KL_PLACEMENTS = ("loss", "future")
# the hyper-parameters whose static 0 leaves their term out of the program (and β: the reference pass)
SWITCHED_TERMS = _numbers.SWITCHED
# the GRPOHyper fields that are structure: the config's program, not the carrier's
_STRUCTURE = ("loss", "aggregation", *_numbers.names(carrier="static"))


def _f32(v):
  """A hyper-parameter value as ``f32[]``: a JAX array (or tracer) as a JAX array, anything else as NumPy."""
  if v is None:
    return None
  if isinstance(v, jax.Array):
    return jnp.asarray(v, jnp.float32)
  return np.asarray(v, np.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
@_numbers.add_fields(tuple(NUMBERS), read_by=_surrogates.read_by)
class GRPOConfig:
  """The objective of one GRPO-family algorithm. Validated on construction.

  Every field is checked for its type (``TypeError``: e.g. ``beta="0.1"``, ``std_ddof=True``) and
  its value (``ValueError``: negative, NaN or infinite numbers, unknown names). The config is
  frozen and hashable, so the jitted kernels take it as a static argument: its numbers are
  compile-time constants there. To pass them as traced inputs instead (a β/ε/entropy schedule, a
  ``vmap``-ped grid: one program for every value), build a :class:`GRPOHyper` with :meth:`hyper`.

  The numbers (the fields after ``distill``) are declared once, in
  :data:`jaxgrpo.kernels.numbers.NUMBERS` (default, range, hint, reader); their lines below are generated
  from it. ε_low, ε_high bound the token ratio (``ppo``), the sequence ratio (``gspo``, ``gspo_token``), the
  IS weight (``cispo``) or the log-ratio (``gmpo``); ``importance_cap`` is also the band's upper bound for
  ``"icepop"`` / ``"seq_mask"`` (IcePop: 5; verl's TIS threshold 2, TRL's 3), ``importance_low`` its lower
  bound (read by those two only; None: ``jaxgrpo.kernels.importance.DEFAULT_LOW``); a non-zero
  ``entropy_coef`` adds ``−c·H(i,t)`` per token, aggregated like the loss (the train step then computes the
  entropy with its gradient).

  Attributes:
    name: label (the preset's name, or "custom").
    advantage_scale: ``"group"`` (a_i = (r_i - mean_g)/(std_g + eps)), ``"none"`` (Dr.GRPO) or
      ``"batch"`` (std over the batch). See ``group_advantages``.
    process_weights: λ-GRPO — multiply each token term by ``1/|λ(i,t)|``.
    kl_estimator: the KL estimator D: for ``kl_placement="loss"`` one of k1, k2, k3, forward_k3;
      for ``"future"`` one of k1, k3, forward_k3.
    kl_placement: ``"loss"`` (GRPO: ``+β·D(i,t)`` per token in the loss) or ``"future"`` (FRPO:
      ``Â = sg(a_i - β·future_kl)`` in the advantage, no KL loss term).
    loss: the per-token policy term, a name of :data:`jaxgrpo.kernels.surrogates.REGISTRY`: ``"ppo"``
      (PPO/GRPO's clipped ratio), ``"gspo"``, ``"gspo_token"``, ``"cispo"``, ``"sapo"``, ``"gmpo"`` or a
      registered one.
    aggregation: loss aggregation mode (see ``policy_loss``).
    dynamic_sampling: DAPO — drop groups whose rewards are all equal and refill (trainer).
    importance_correction: off-policy correction for a behaviour policy μ (inference engine, dtype,
      staleness) that differs from the rollout log-probs π_old: None, ``"tis"`` (truncated IS), ``"mis"``
      (masked IS), ``"icepop"`` (two-sided token masking to the band ``[importance_low, importance_cap]``) or
      ``"seq_mask"`` (a whole row masked when its geometric-mean ratio leaves the band); see
      ``jaxgrpo.kernels.importance``. The behaviour log-probs come from
      ``Batch.behavior_logp`` (None there: μ = π_old, every weight 1).
    importance_level: ``"token"`` (a ratio per token) or ``"sequence"`` (the product over the row).
    distill: an on-policy distillation term (:class:`jaxgrpo.kernels.distill.DistillConfig`: a teacher's
      signal added to the advantages with its weight), or None (docs/distillation.md).
  """

  name: str = "custom"
  advantage_scale: str = "group"
  process_weights: bool = False
  kl_estimator: str = "k3"
  kl_placement: str = "loss"
  loss: str = "ppo"
  aggregation: str = "token-mean"
  dynamic_sampling: bool = False
  importance_correction: str | None = None
  importance_level: str = "token"
  distill: DistillConfig | None = None

  def __post_init__(self):
    c = _checks  # `name` is a free label, checked by whoever builds it (e.g. jaxgrpo.run.specs)
    c.check_choice(self.advantage_scale, ADVANTAGE_SCALES, "advantage_scale")
    c.check_python_bool(self.process_weights, "process_weights")
    c.check_choice(self.kl_placement, KL_PLACEMENTS, "kl_placement")
    kinds = KL_KINDS if self.kl_placement == "loss" else FUTURE_KL_KINDS
    c.check_choice(self.kl_estimator, kinds, "kl_estimator")
    c.check_choice(self.aggregation, AGGREGATIONS, "aggregation")
    c.check_python_bool(self.dynamic_sampling, "dynamic_sampling")
    if self.importance_correction is not None:
      c.check_choice(self.importance_correction, CORRECTIONS, "importance_correction")
    c.check_choice(self.importance_level, IMPORTANCE_LEVELS, "importance_level")
    if self.distill is not None and not isinstance(self.distill, DistillConfig):
      raise TypeError(f"`distill` must be a jaxgrpo.kernels.distill.DistillConfig or None; got {self.distill!r}")
    for name, number in NUMBERS.items():
      number.check(getattr(self, name))
    _surrogates.check_loss(self.loss, {n: getattr(self, n) for n in _surrogates.NUMBERS_READ})
    self._check_importance_band()
    self._check_composition()

  def _check_importance_band(self) -> None:
    """``importance_low`` only with a band correction (``icepop``, ``seq_mask``), below ``importance_cap``;
    ``seq_mask`` at ``importance_level="token"`` (it is sequence-level by its geometric mean)."""
    band = self.importance_correction in _importance.BAND_CORRECTIONS
    if self.importance_low is not None and not band:
      raise ValueError(
        f"`importance_low`={self.importance_low!r} is the lower bound of a band, read only with "
        f"importance_correction 'icepop' or 'seq_mask'; got importance_correction={self.importance_correction!r}: "
        "drop importance_low or choose a band correction"
      )
    if not band:
      return
    low = _importance.DEFAULT_LOW if self.importance_low is None else self.importance_low
    if not low < self.importance_cap:
      raise ValueError(
        f"the band [importance_low, importance_cap] must have importance_low < importance_cap; got "
        f"importance_low={low!r}{' (the default)' if self.importance_low is None else ''}, "
        f"importance_cap={self.importance_cap!r}"
      )
    if self.importance_correction == "seq_mask" and self.importance_level != "token":
      raise ValueError(
        "importance_correction='seq_mask' is sequence-level by definition (the geometric mean of a row's token "
        f"ratios): leave importance_level at 'token' (got {self.importance_level!r}), or use 'icepop' with "
        "importance_level='sequence' for the product of the ratios"
      )

  def _check_composition(self) -> None:
    """The sequence losses refuse per-token weights and per-token advantages (module docstring)."""
    if not _surrogates.surrogate_spec(self.loss).sequence_level:
      return
    if self.process_weights:
      raise ValueError(
        f"loss={self.loss!r} is a sequence-level loss: λ-GRPO's per-token 1/|λ| weights (process_weights=True) "
        "are undefined for it. Use loss='gspo_token' (GSPO's sequence ratio with token weights) or a token-level "
        "loss ('ppo', 'cispo', 'sapo')"
      )
    if self.kl_placement == "future" and self.beta > 0:
      raise ValueError(
        f"loss={self.loss!r} takes one advantage per sequence, but kl_placement='future' (FRPO) makes per-token "
        "advantages. Use loss='gspo_token' or a token-level loss ('ppo', 'cispo', 'sapo')"
      )

  def hyper(self, **overrides) -> GRPOHyper:
    """This config's numbers as a :class:`GRPOHyper` of ``f32[]`` arrays, some replaced by ``overrides``
    (Python floats or arrays, e.g. a traced ``beta`` computed from the step), checked by
    :meth:`check_hyper`. A Python or NumPy number becomes a NumPy ``float32[]`` (concrete even inside
    ``jit``, so a 0 built there still leaves its term out); a JAX array stays a JAX array (traced inside
    ``jit``: a traced β or entropy coefficient builds its term, :meth:`with_terms_of`).

    >>> preset("grpo", beta=0.04).hyper(beta=0.02).beta
    array(0.02, dtype=float32)
    """
    unknown = set(overrides) - set(GRPOHyper._fields)
    if unknown:
      raise TypeError(f"unknown hyper-parameter(s) {sorted(unknown)}; expected some of {list(GRPOHyper._fields)}")
    values = {n: overrides.get(n, getattr(self, n)) for n in GRPOHyper._fields}
    structure = {n: getattr(self, n) for n in _STRUCTURE}
    # checked once, by check_hyper (its messages name `hyper.<field>`)
    return self.check_hyper(GRPOHyper()._replace(**{n: _f32(v) for n, v in values.items()}, **structure))

  def check_hyper(self, hyper: GRPOHyper) -> GRPOHyper:
    """``hyper`` if it fits this config (TypeError/ValueError naming the field otherwise): a
    :class:`GRPOHyper`, ``dual_clip`` None exactly when the config's is, each number in its range, and
    no non-zero β / entropy coefficient where the config has switched the term off. Values are
    checked when concrete (a traced value, e.g. a schedule's inside the step, cannot be)."""
    if not isinstance(hyper, GRPOHyper):
      raise TypeError(f"`hyper` must be a jaxgrpo.GRPOHyper (config.hyper(...)); got {type(hyper).__name__}")
    for name in GRPOHyper._fields:
      if NUMBERS[name].optional and (getattr(hyper, name) is None) != (getattr(self, name) is None):
        raise ValueError(
          f"`hyper.{name}` must be None exactly when the config's is (None leaves it out of the program: it is "
          f"structural); got {getattr(hyper, name)} with config {name}={getattr(self, name)}"
        )
    for name in _STRUCTURE:  # structure: the config's program, not the carrier's
      if getattr(hyper, name) != getattr(self, name):
        raise ValueError(
          f"`hyper.{name}`={getattr(hyper, name)!r} but the config's is {getattr(self, name)!r}: build the "
          "hyper-parameters with config.hyper(...) so that they describe this config's loss"
        )
    for name in GRPOHyper._fields:
      NUMBERS[name].check_value(getattr(hyper, name), f"hyper.{name}")
    for name in SWITCHED_TERMS:
      values = _checks.concrete_or_none(getattr(hyper, name))
      if getattr(self, name) == 0 and values is not None and (values != 0).any():
        raise ValueError(
          f"`hyper.{name}` = {values} but the config's {name} is 0, which leaves its term out of the program: "
          f"build the step/config with a non-zero {name} (any value; the traced one is used)"
        )
    return hyper

  def with_terms_of(self, hyper: GRPOHyper | None, *, on=None) -> "GRPOConfig":
    """This config with the KL term (β) and the entropy bonus switched on where ``hyper`` may set a
    non-zero coefficient while the config's is 0 (which would leave the term out of the program).

    ``on``: the names to switch on (a subset of ``("beta", "entropy_coef")``); None: those whose value in
    ``hyper`` is traced (not concrete: a ``jit``-ted hyper pytree). The switched-on coefficient is a
    placeholder (1.0): the structure only, the value applied is ``hyper``'s. Unchanged when nothing
    switches (the same object, so the default path compiles to the same program)."""
    if hyper is None:
      return self
    if on is None:
      on = tuple(n for n in SWITCHED_TERMS if _checks.concrete_or_none(getattr(hyper, n)) is None)
    changes = {n: 1.0 for n in on if getattr(self, n) == 0}
    return self.replace(**changes) if changes else self

  @property
  def applied_hyper(self) -> tuple[str, ...]:
    """The :class:`GRPOHyper` fields this config's program reads: a surrogate's number when ``loss`` reads
    it (ε_low/ε_high unless ``loss="sapo"``, τ± for ``"sapo"``), the IS cap with ``importance_correction``,
    β and the entropy coefficient when != 0 — an optional number (``dual_clip``) only when set. The others
    are not applied (the train step neither logs nor accepts a schedule of them)."""
    return tuple(n for n in GRPOHyper._fields if self._reads(n))

  def _reads(self, name: str) -> bool:
    """Whether this config's program reads the number ``name`` (:attr:`applied_hyper`)."""
    number, value = NUMBERS[name], getattr(self, name)
    on = {
      "surrogate": lambda: name in _surrogates.surrogate_spec(self.loss).numbers,
      "importance": lambda: self.importance_correction is not None,
    }.get(number.read_by, lambda: True)()
    return on and value is not None and not (number.switch and value == 0)

  @property
  def needs_reference(self) -> bool:
    """Whether reference-model log-probs are needed (β > 0)."""
    return self.beta > 0

  def replace(self, **changes) -> "GRPOConfig":
    """A copy with some fields changed (validated again)."""
    return dataclasses.replace(self, **changes)


PRESETS: dict[str, dict] = {
  "grpo": dict(),
  "dr_grpo": dict(advantage_scale="none", aggregation="seq-mean-token-sum-norm"),
  "dapo": dict(clip_eps_high=0.28, dynamic_sampling=True),
  "lambda_grpo": dict(process_weights=True),
  "frpo": dict(beta=0.01, kl_placement="future", kl_estimator="k1"),
  "lambda_frpo": dict(beta=0.01, kl_placement="future", kl_estimator="k1", process_weights=True),
  "gspo": dict(loss="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, aggregation="seq-mean-token-mean"),
  "gspo_token": dict(loss="gspo_token", clip_eps_low=3e-4, clip_eps_high=4e-4, aggregation="seq-mean-token-mean"),
  "cispo": dict(loss="cispo", clip_eps_low=1.0, clip_eps_high=4.0),
  "sapo": dict(loss="sapo", tau_pos=1.0, tau_neg=1.05, aggregation="seq-mean-token-mean"),
  "gmpo": dict(loss="gmpo", clip_eps_low=0.4, clip_eps_high=0.4, aggregation="seq-mean-token-mean"),
}


def preset(name: str, **overrides) -> GRPOConfig:
  """The named preset (see the module table), with optional field overrides.

  >>> preset("lambda_grpo", beta=0.04).process_weights
  True
  """
  _checks.check_choice(name, tuple(PRESETS), "preset name")
  return GRPOConfig(name=name, **{**PRESETS[name], **overrides})
