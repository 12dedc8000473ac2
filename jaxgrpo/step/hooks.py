"""The step's contract with its hooks and its hyper-parameter pytree, checked before anything runs.

``objective_fn`` and ``advantages_fn`` (``jaxgrpo.step.train.make_train_step``) get a pinned signature plus
keywords the configuration asks for (``behavior_logp=``, ``entropy=``, ``hyper=``): which ones
(:func:`objective_extras`, :func:`objective_keywords`, :func:`advantages_keywords`), the check that a hook
takes them (:func:`check_keywords`), the trace-time checks of what the hooks return (:func:`check_denominator`:
the denominator has no gradient; :func:`check_advantages_out`: shapes), and the hyper-parameter pytree
(:func:`schedule_terms`: the terms a ``hyper_schedule`` sets; :func:`structural_zeros`: the terms the config
leaves out stay out; :func:`check_unread`: no silently ignored value). Everything here is a pure function of
the configuration, the hooks and abstract shapes; ``jaxgrpo.step.train`` re-exports the names.
"""

from __future__ import annotations

import inspect
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jaxgrpo import _checks
from jaxgrpo.kernels.config import SWITCHED_TERMS, GRPOConfig, GRPOHyper

__all__ = []


def _fn_name(fn) -> str:
  return getattr(fn, "__name__", repr(fn))


def _depends_on(jaxpr, invar_index: int) -> bool:
  """Whether the (single) output of ``jaxpr`` is computed from its input ``invar_index``: a dataflow
  walk over the equations (conservative inside nested jaxprs: any input reaches every output)."""
  tainted = {jaxpr.invars[invar_index]}
  for eqn in jaxpr.eqns:
    if any(isinstance(v, jex_core.Var) and v in tainted for v in eqn.invars):
      tainted.update(eqn.outvars)
  return any(isinstance(v, jex_core.Var) and v in tainted for v in jaxpr.outvars)


def needs_entropy(config, objective_fn=None) -> bool:
  """Whether the objective takes the entropy (with its gradient): a GRPOConfig with an entropy bonus, or
  an ``objective_fn`` that asks for it (``objective_fn.uses_entropy = True``, :func:`jaxgrpo.kernels.objective.uses_entropy`)."""
  return (isinstance(config, GRPOConfig) and config.entropy_coef != 0) or bool(
    getattr(objective_fn, "uses_entropy", False)
  )


def reads_behavior(config) -> bool:
  """Whether the objective takes ``behavior_logp``: a GRPOConfig with an off-policy correction."""
  return isinstance(config, GRPOConfig) and config.importance_correction is not None


def objective_extras(config, behavior_logp, entropy, hyper, objective_fn=None) -> dict:
  """The objective's keywords beyond the pinned signature, passed only when the config asks for them
  or the step has a hyper-parameter pytree (so a custom ``objective_fn`` with the pinned signature
  works with every other config)."""
  extras = {}
  if reads_behavior(config):
    extras["behavior_logp"] = behavior_logp
  if needs_entropy(config, objective_fn):
    extras["entropy"] = entropy
  if hyper is not None:
    extras["hyper"] = hyper
  return extras


def structural_zeros(config, hyper):
  """``hyper`` with a concrete 0 for each coefficient whose term the (effective) config leaves out: a
  call's ``hyper`` was checked to hold 0 there (:meth:`GRPOConfig.check_hyper`), a schedule's was found
  not to set it (:func:`schedule_terms`); the kernels then keep the term out, as the config does."""
  if not isinstance(config, GRPOConfig) or not isinstance(hyper, GRPOHyper):
    return hyper
  return hyper._replace(**{n: np.float32(0.0) for n in SWITCHED_TERMS if getattr(config, n) == 0})


def schedule_terms(config: GRPOConfig, schedule) -> tuple[GRPOConfig, GRPOHyper]:
  """``(config with every term the schedule sets switched on, its value at step 0)``, checked.

  A field is set by the schedule when it depends on the step or differs from the config's value at step 0.
  β or the entropy coefficient set over a config's 0 switch their term on (and β the reference pass); a
  field the config's program never reads (τ± outside SAPO, the IS cap without ``importance_correction``,
  ε under SAPO) is refused, naming it: it would be logged and never applied."""
  first = schedule(jnp.int32(0))
  if not isinstance(first, GRPOHyper):
    raise TypeError(f"`hyper_schedule` must return a jaxgrpo.GRPOHyper (config.hyper(...)); got {type(first).__name__}")
  names = [n for n in GRPOHyper._fields if getattr(first, n) is not None]
  jaxpr = jax.make_jaxpr(lambda step: tuple(getattr(schedule(step), n) for n in names))(jnp.int32(0)).jaxpr
  tainted = {jaxpr.invars[0]}
  for eqn in jaxpr.eqns:
    if any(isinstance(v, jex_core.Var) and v in tainted for v in eqn.invars):
      tainted.update(eqn.outvars)
  varies = {n for n, v in zip(names, jaxpr.outvars) if isinstance(v, jex_core.Var) and v in tainted}
  sets = {n for n in names if n in varies or np.float32(getattr(first, n)) != np.float32(getattr(config, n))}
  config = config.with_terms_of(first, on=tuple(n for n in SWITCHED_TERMS if n in sets))
  unread = sorted(sets - set(config.applied_hyper))
  if unread:
    raise ValueError(
      f"`hyper_schedule` sets {unread}, which config {config.name!r} (loss={config.loss!r}, importance_correction="
      f"{config.importance_correction!r}) never reads: they would be logged and not applied; drop them from the "
      "schedule or choose a config that uses them"
    )
  return config, config.check_hyper(first)


def check_unread(config: GRPOConfig, hyper: GRPOHyper) -> None:
  """ValueError for a concrete ``hyper`` value that differs from the config's in a field the config's
  program never reads (it would be logged nowhere and applied nowhere: a silent no-op)."""
  for n in sorted(set(GRPOHyper._fields) - set(config.applied_hyper) - set(SWITCHED_TERMS)):
    value, own = _checks.concrete_or_none(getattr(hyper, n)), getattr(config, n)
    if value is not None and own is not None and (value != np.float32(own)).any():
      raise ValueError(
        f"`hyper.{n}` = {value} differs from the config's {own}, but config {config.name!r} (loss={config.loss!r}, "
        f"importance_correction={config.importance_correction!r}) never reads {n}: leave it at the config's value"
      )


def _accepts(fn, keywords) -> list[str]:
  """The ``keywords`` that ``fn`` cannot take by name (none with ``**kwargs`` or an unreadable signature)."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return []
  if any(p.kind is p.VAR_KEYWORD for p in params):
    return []
  names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  return [k for k in keywords if k not in names]


def check_keywords(fn, what: str, keywords: Mapping[str, str]) -> None:
  """TypeError naming the keywords (and why the step passes them) that the hook ``fn`` does not accept."""
  missing = _accepts(fn, keywords)
  if missing:
    why = "; ".join(f"{k}= ({keywords[k]})" for k in missing)
    raise TypeError(
      f"{what} {_fn_name(fn)!r} does not accept the keyword(s) the train step passes: {why}. Add them to its "
      "signature (or **kwargs)"
    )


def objective_keywords(config, objective_fn, hyper: bool) -> dict[str, str]:
  """The keywords the step passes to ``objective_fn``, each with the reason."""
  kw = {"token_weights": "always", "ref_logp": "always"}
  if reads_behavior(config):
    kw["behavior_logp"] = "config.importance_correction is set"
  if needs_entropy(config, objective_fn):
    kw["entropy"] = "entropy_coef != 0 or objective_fn.uses_entropy"
  if hyper:
    kw["hyper"] = "the step has a hyper-parameter pytree"
  return kw


def advantages_keywords(hyper: bool) -> dict[str, str]:
  kw = {k: "always" for k in ("old_logp", "ref_logp", "max_group_size")}
  if hyper:
    kw["hyper"] = "the step has a hyper-parameter pytree"
  return kw


def check_denominator(objective_fn, config, mb, hyper=None) -> None:
  """Trace-time check of the objective contract: the denominator has no gradient with respect to
  ``logp`` (nor to the entropy, when the objective takes it). Its tangent (``jax.jvp``) must be a
  symbolic zero — true for anything built from masks, advantages, rewards, shapes or
  ``stop_gradient`` of the log-probs."""

  def tangent(logp, dlogp, old, adv, mask, weights, ref, behavior, hyper):
    def den(lp, ent):
      extras = objective_extras(config, behavior, ent, structural_zeros(config, hyper), objective_fn)
      return objective_fn(config, lp, old, adv, mask, token_weights=weights, ref_logp=ref, **extras).denominator

    return jax.jvp(den, (logp, logp), (dlogp, dlogp))[1]

  abstract = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)
  logp = jax.ShapeDtypeStruct(mb["old_logp"].shape, jnp.float32)
  args = [abstract(mb.get(k)) for k in ("old_logp", "adv", "loss_mask", "weights", "ref_logp", "behavior_logp")]
  hyper = jax.tree.map(abstract, hyper)
  jaxpr = jax.make_jaxpr(tangent)(logp, logp, *args, hyper).jaxpr
  if _depends_on(jaxpr, 1):
    name = getattr(objective_fn, "__name__", repr(objective_fn))
    raise ValueError(
      f"objective_fn {name!r} returns a denominator that depends on `logp` (it has a gradient). The step "
      "sums the numerators' gradients over micro-batches and divides once by the summed denominators, which "
      "is the gradient of the loss only when the denominator is a constant of the parameters: build it from "
      "masks, advantages, rewards or shapes (or jax.lax.stop_gradient(logp))"
    )


def check_advantages_out(adv, weights, b: int, t: int) -> None:
  """Trace-time check of what ``advantages_fn`` returned (a custom one may get it wrong)."""
  if np.shape(adv) not in ((b,), (b, t)) or not jnp.issubdtype(adv.dtype, jnp.floating):
    raise ValueError(
      f"advantages_fn must return advantages f32[{b}] or f32[{b}, {t}]; got {adv.dtype}{list(adv.shape)}"
    )
  if weights is not None and (np.shape(weights) != (b, t) or not jnp.issubdtype(weights.dtype, jnp.floating)):
    raise ValueError(
      f"advantages_fn must return token_weights f32[{b}, {t}] or None; got {weights.dtype}{list(weights.shape)}"
    )
