"""The pieces of the compiled step (``jaxgrpo.step.train``), each a named function of the step's spec:

- :func:`prepare_rows` — once per rollout batch, no gradient: advantages and token weights, the loss mask,
  the rows split into ``[M, K, R, ...]`` mini/micro-batches (packed slots included);
- :func:`micro_terms` — one micro-batch's loss terms (the policy merged with its frozen base, MoE routing
  replay and router losses, LoRA dropout keys, packed log-probs: all read from the micro-batch's inputs);
- :func:`accumulate_grads` — Σ_k ∇numerator_k over the K micro-batches (``lax.scan``);
- :func:`apply_update` — the one division by Σ_k denominator_k, clipping, the optimizer;
- :func:`update` — one optimizer update (the two above); :func:`train_epochs` — μ passes of M updates;
- ``_step_fn`` — composes them.

With the helpers they share (row splitting, the objective's keyword checks, the hyper-parameter schedule).
One job at ~610 lines: what happens inside the compiled step, which must agree on one row layout and one
scale; the jitted wrapper, its shardings and the reference pass are ``jaxgrpo.step.train``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex_core
from jax.sharding import NamedSharding

from jaxgrpo import _checks
from jaxgrpo.kernels.config import SWITCHED_TERMS, GRPOConfig, GRPOHyper
from jaxgrpo.kernels.losses import LossTerms, combine_terms, finalize_terms
from jaxgrpo.kernels.objective import rollout_advantages
from jaxgrpo.kernels.process_sets import process_set_sizes, process_tree_stats
from jaxgrpo.models import lora, moe
from jaxgrpo.models.log_probs import completion_log_probs, packed_log_probs
from jaxgrpo.step.batch import (
  Batch,
)
from jaxgrpo.step.packing import PackedSlots
from jaxgrpo.step.state import TrainConfig, TrainState, _merge_model

__all__ = [
  "Rows",
  "accumulate_grads",
  "apply_update",
  "micro_terms",
  "prepare_rows",
  "token_scale",
  "train_epochs",
  "update",
]


def _split_rows(x, m: int, k: int):
  """``[B, ...] -> [M, K, B/(M·K), ...]`` with row ``i·(M·K) + m·K + k`` at ``[m, k, i]``."""
  if x is None:
    return None
  b = x.shape[0]
  x = x.reshape((b // (m * k), m, k) + x.shape[1:])
  return jnp.moveaxis(x, 0, 2)


def _split_slots(x, n: int, m: int, k: int):
  """Packed slot arrays ``[n·M·K·X, ...]`` (slot ``d·(M·K) + m·K + k`` = device shard d, mini-batch m,
  micro-batch k; X rows or one head buffer per slot) -> ``[M, K, n·X, ...]``, shard d's X at
  ``[m, k, d·X : (d+1)·X]``: the layout of :func:`_split_rows`' ``[M, K, B/(M·K), ...]``."""
  x = x.reshape((n, m, k, x.shape[0] // (n * m * k)) + x.shape[1:])
  x = jnp.moveaxis(x, 0, 2)  # [M, K, n, X, ...]
  return x.reshape(x.shape[:2] + (n * x.shape[3],) + x.shape[4:])


def _merge_rows(x, m: int, k: int):
  """Inverse of :func:`_split_rows`: ``[M, K, B/(M·K), ...] -> [B, ...]``."""
  x = jnp.moveaxis(x, 2, 0)
  return x.reshape((x.shape[0] * m * k,) + x.shape[3:])


def _model_inputs(batch: Batch) -> dict:
  """What the model call of a micro-batch reads, per row of the batch (split like every ``[B, ...]``
  field): the prompt and completion tokens, or with packing the rows' head entries."""
  if batch.packed is None:
    inputs = dict(
      prompt_tokens=batch.prompt_tokens,
      prompt_mask=batch.prompt_mask,
      completions=batch.completions,
      mask=batch.mask,  # attention: every real token of the row
    )
    if batch.routing is not None:  # routing replay: the sampler's experts [B, P + T, M, k]
      inputs["routing"] = batch.routing
    return inputs
  return dict(unpack_index=batch.packed.unpack_index)


def _router_terms(model, mb: dict, scope, tc: "TrainConfig"):
  """A mixture of experts' router terms of one micro-batch's forward (``scope``: its routes):
  ``(c_aux·aux + c_z·z, routing sums)`` over the forward's real tokens; ``(0, {})`` for a dense model."""
  if not scope.routes:
    return jnp.zeros((), jnp.float32), {}
  route = scope.stacked()  # [R, S, M, ...]
  if "head_index" in mb:
    real = mb["segment_ids"] > 0
  else:
    real = jnp.concatenate([mb["prompt_mask"], mb["mask"]], axis=1)
  num_experts = model.config.num_experts
  aux, z = moe.load_balancing_loss(route, real, num_experts), moe.router_z_loss(route, real)
  extra = tc.router_aux_loss * aux + tc.router_z_loss * z
  sums = moe.routing_sums(route, real, num_experts)
  sums.update(aux_loss=aux * sums["tokens"], z_loss=z * sums["tokens"])  # token-weighted, for the metrics
  return extra, jax.lax.stop_gradient(sums)


def _slot_inputs(packed: PackedSlots) -> dict:
  """The packed rows and head buffers (split by slot, :func:`_split_slots`)."""
  return dict(
    tokens=packed.tokens, positions=packed.positions, segment_ids=packed.segment_ids, head_index=packed.head_index
  )


def _micro_log_probs(model, mb: dict, tc: "TrainConfig", blocks: int, with_entropy: bool, entropy_grad: bool = False):
  """``(logp f32[R, T], entropy or None)`` of one micro-batch's R rows: from ``[prompt ‖ completion]``
  rows, or from their packed rows (``blocks`` device shards, each with its own sequences). The entropy
  has a gradient only with ``entropy_grad`` (an entropy bonus in the loss)."""
  kw = dict(temperature=tc.temperature, chunk_size=tc.chunk_size, with_entropy=with_entropy, entropy_grad=entropy_grad)
  if "head_index" in mb:  # no adapter dropout here: _check_dropout refuses it with packing
    args = (mb["tokens"], mb["positions"], mb["segment_ids"], mb["head_index"], mb["unpack_index"])
    return packed_log_probs(model, *args, blocks=blocks, **kw)
  args = (mb["prompt_tokens"], mb["prompt_mask"], mb["completions"], mb["mask"])
  return completion_log_probs(model, *args, dropout_key=mb.get("dropout_key"), **kw)


def _zero_terms(example: LossTerms) -> LossTerms:
  big = jnp.float32(jnp.finfo(jnp.float32).max)
  zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)
  extrema = {k: (-big if k.endswith("_max") else big) for k in example.extrema}
  return LossTerms(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros(example.sums), extrema)


def _reduce_updates(metrics):
  """Metrics stacked over the μ·M updates -> one value each (max of maxima, min of minima, else mean)."""
  out = {}
  for k, v in metrics.items():
    v = v.reshape(-1)
    out[k] = jnp.max(v) if k.endswith("_max") else jnp.min(v) if k.endswith("_min") else jnp.mean(v)
  return out


def _safe_div(num, den):
  ok = den != 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def _depends_on(jaxpr, invar_index: int) -> bool:
  """Whether the (single) output of ``jaxpr`` is computed from its input ``invar_index``: a dataflow
  walk over the equations (conservative inside nested jaxprs: any input reaches every output)."""
  tainted = {jaxpr.invars[invar_index]}
  for eqn in jaxpr.eqns:
    if any(isinstance(v, jex_core.Var) and v in tainted for v in eqn.invars):
      tainted.update(eqn.outvars)
  return any(isinstance(v, jex_core.Var) and v in tainted for v in jaxpr.outvars)


def _wants_entropy(config, objective_fn=None) -> bool:
  """Whether the objective takes the entropy (with its gradient): a GRPOConfig with an entropy bonus, or
  an ``objective_fn`` that asks for it (``objective_fn.uses_entropy = True``, :func:`jaxgrpo.kernels.objective.uses_entropy`)."""
  return (isinstance(config, GRPOConfig) and config.entropy_coef != 0) or bool(
    getattr(objective_fn, "uses_entropy", False)
  )


def _reads_behavior(config) -> bool:
  """Whether the objective takes ``behavior_logp``: a GRPOConfig with an off-policy correction."""
  return isinstance(config, GRPOConfig) and config.importance_correction is not None


def _objective_extras(config, behavior_logp, entropy, hyper, objective_fn=None) -> dict:
  """The objective's keywords beyond the pinned signature, passed only when the config asks for them
  or the step has a hyper-parameter pytree (so a custom ``objective_fn`` with the pinned signature
  works with every other config)."""
  extras = {}
  if _reads_behavior(config):
    extras["behavior_logp"] = behavior_logp
  if _wants_entropy(config, objective_fn):
    extras["entropy"] = entropy
  if hyper is not None:
    extras["hyper"] = hyper
  return extras


def _structural_zeros(config, hyper):
  """``hyper`` with a concrete 0 for each coefficient whose term the (effective) config leaves out: a
  call's ``hyper`` was checked to hold 0 there (:meth:`GRPOConfig.check_hyper`), a schedule's was found
  not to set it (:func:`_schedule_terms`); the kernels then keep the term out, as the config does."""
  if not isinstance(config, GRPOConfig) or not isinstance(hyper, GRPOHyper):
    return hyper
  return hyper._replace(**{n: np.float32(0.0) for n in SWITCHED_TERMS if getattr(config, n) == 0})


def _schedule_terms(config: GRPOConfig, schedule) -> tuple[GRPOConfig, GRPOHyper]:
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


def _check_unread(config: GRPOConfig, hyper: GRPOHyper) -> None:
  """ValueError for a concrete ``hyper`` value that differs from the config's in a field the config's
  program never reads (it would be logged nowhere and applied nowhere: a silent no-op)."""
  for n in sorted(set(GRPOHyper._fields) - set(config.applied_hyper) - set(SWITCHED_TERMS)):
    value, own = _checks.concrete_or_none(getattr(hyper, n)), getattr(config, n)
    if value is not None and own is not None and (value != np.float32(own)).any():
      raise ValueError(
        f"`hyper.{n}` = {value} differs from the config's {own}, but config {config.name!r} (loss={config.loss!r}, "
        f"importance_correction={config.importance_correction!r}) never reads {n}: leave it at the config's value"
      )


def _fn_name(fn) -> str:
  return getattr(fn, "__name__", repr(fn))


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


def _check_keywords(fn, what: str, keywords: Mapping[str, str]) -> None:
  """TypeError naming the keywords (and why the step passes them) that the hook ``fn`` does not accept."""
  missing = _accepts(fn, keywords)
  if missing:
    why = "; ".join(f"{k}= ({keywords[k]})" for k in missing)
    raise TypeError(
      f"{what} {_fn_name(fn)!r} does not accept the keyword(s) the train step passes: {why}. Add them to its "
      "signature (or **kwargs)"
    )


def _objective_keywords(config, objective_fn, hyper: bool) -> dict[str, str]:
  """The keywords the step passes to ``objective_fn``, each with the reason."""
  kw = {"token_weights": "always", "ref_logp": "always"}
  if _reads_behavior(config):
    kw["behavior_logp"] = "config.importance_correction is set"
  if _wants_entropy(config, objective_fn):
    kw["entropy"] = "entropy_coef != 0 or objective_fn.uses_entropy"
  if hyper:
    kw["hyper"] = "the step has a hyper-parameter pytree"
  return kw


def _advantages_keywords(hyper: bool) -> dict[str, str]:
  kw = {k: "always" for k in ("old_logp", "ref_logp", "max_group_size")}
  if hyper:
    kw["hyper"] = "the step has a hyper-parameter pytree"
  return kw


def _check_denominator(objective_fn, config, mb, hyper=None) -> None:
  """Trace-time check of the objective contract: the denominator has no gradient with respect to
  ``logp`` (nor to the entropy, when the objective takes it). Its tangent (``jax.jvp``) must be a
  symbolic zero — true for anything built from masks, advantages, rewards, shapes or
  ``stop_gradient`` of the log-probs."""

  def tangent(logp, dlogp, old, adv, mask, weights, ref, behavior, hyper):
    def den(lp, ent):
      extras = _objective_extras(config, behavior, ent, _structural_zeros(config, hyper), objective_fn)
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


def _check_advantages_out(adv, weights, b: int, t: int) -> None:
  """Trace-time check of what ``advantages_fn`` returned (a custom one may get it wrong)."""
  if np.shape(adv) not in ((b,), (b, t)) or not jnp.issubdtype(adv.dtype, jnp.floating):
    raise ValueError(
      f"advantages_fn must return advantages f32[{b}] or f32[{b}, {t}]; got {adv.dtype}{list(adv.shape)}"
    )
  if weights is not None and (np.shape(weights) != (b, t) or not jnp.issubdtype(weights.dtype, jnp.floating)):
    raise ValueError(
      f"advantages_fn must return token_weights f32[{b}, {t}] or None; got {weights.dtype}{list(weights.shape)}"
    )


def _finalize(terms: LossTerms) -> dict:
  """Metrics of the accumulated terms: :func:`~jaxgrpo.kernels.losses.finalize_terms`' when the objective
  returned the sums of ``policy_loss_terms``; otherwise ``loss`` plus the objective's own sums
  (``objective/<name>``, summed over the batch) and extrema."""
  try:
    return finalize_terms(terms)[1]
  except KeyError:  # a custom objective with its own metric sums (the contract allows any dicts)
    metrics = {"loss": _safe_div(terms.numerator, terms.denominator)}
    metrics.update({f"objective/{k}": v for k, v in terms.sums.items()})
    metrics.update({f"objective/{k}": v for k, v in terms.extrema.items()})
    return metrics


def _num_iterations(config) -> int:
  """μ: ``GRPOConfig.num_iterations``; 1 for any other config object."""
  return config.num_iterations if isinstance(config, GRPOConfig) else 1


def _group_bound(group_size: int | None, b: int) -> tuple[int, int]:
  """``(largest group, number of groups)`` the step is compiled for: ``(B, B)`` without a group size."""
  g = b if group_size is None else min(group_size, b)
  return g, (b if group_size is None else -(-b // g))


@dataclasses.dataclass(frozen=True)
class _StepSpec:
  graphdef: Any
  optimizer: optax.GradientTransformation
  config: Any
  tc: "TrainConfig"
  objective_fn: Callable
  advantages_fn: Callable
  param_sh: Any
  rows_sh: NamedSharding
  blocks: int = 1  # data × fsdp: the device shards of the batch rows (packing: one slot each)
  dropout_key: Any = None  # the run's typed PRNG key for adapter dropout, or None
  hyper_schedule: Callable | None = None  # step -> hyper-parameter pytree, or None


def _rollout_terms(spec: _StepSpec, batch: Batch, num_groups: int, g: int, hyper):
  """Once per rollout batch: ``(advantages, token weights, process-set sizes or None)``."""
  config = spec.config
  if batch.policy_mask is not None and batch.ref_logp is not None:  # observations: δ = 0, f(1) = 0
    batch = batch._replace(ref_logp=jnp.where(batch.policy_mask, batch.ref_logp, batch.old_logp))
  if batch.advantages is None:
    extras = {} if hyper is None else {"hyper": hyper}
    adv, weights = spec.advantages_fn(
      config,
      batch.rewards,
      batch.completions,
      batch.mask,
      batch.group_ids,
      num_groups,
      old_logp=batch.old_logp,
      ref_logp=batch.ref_logp,
      max_group_size=g,
      **extras,
    )
  else:
    adv, weights = batch.advantages, None
  sizes = None
  lambda_weights = (
    spec.advantages_fn is rollout_advantages and isinstance(config, GRPOConfig) and config.process_weights
  )
  if batch.advantages is None and batch.token_weights is None and lambda_weights:
    # 1/|λ| exactly; |λ| is a small integer, so round(1/w) recovers it
    sizes = jnp.where(weights > 0, jnp.round(1.0 / jnp.where(weights > 0, weights, 1.0)), 0).astype(jnp.int32)
  elif spec.tc.tree_stats:
    valid = None if batch.rewards is None else jnp.isfinite(batch.rewards)  # missing samples: in no process set
    sizes = process_set_sizes(batch.completions, batch.mask, batch.group_ids, valid=valid, max_group_size=g)
  if batch.token_weights is not None:
    weights = batch.token_weights
  return adv, weights, sizes


def _row_dropout_keys(run_key, step, passes: int, b: int) -> jax.Array:
  """``key[μ, B]``: row r's adapter-dropout key in pass i of step s,
  ``fold_in(fold_in(fold_in(run_key, s), i), r)`` — the same for a row on every mesh and under any
  micro/mini-batch split (the masks depend on the row's key only, ``models.layers.LoRA``)."""
  step_key = jax.random.fold_in(run_key, step)
  rows = jnp.arange(b, dtype=jnp.uint32)
  per_pass = lambda i: jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.fold_in(step_key, i), rows)
  return jax.vmap(per_pass)(jnp.arange(passes, dtype=jnp.uint32))


def _check_dropout(spec: _StepSpec, model, packed: bool) -> None:
  """Trace-time: adapters with dropout > 0 need the step's ``dropout_key`` (no silent no-dropout) and
  an unpacked batch (the per-row masks are drawn in the ``[prompt ‖ completion]`` row layout)."""
  rate = lora.adapter_dropout(model)
  if rate > 0 and spec.dropout_key is None:
    raise ValueError(
      f"the model's LoRA adapters have dropout {rate} but make_train_step got no dropout_key: pass "
      "dropout_key=jax.random.key(seed) (or build the adapters with dropout=0)"
    )
  if rate > 0 and packed:
    raise ValueError(
      f"the model's LoRA adapters have dropout {rate} and the batch is packed (TrainConfig.packing): adapter "
      "dropout is not supported with packing (its masks are drawn per unpacked row); build the adapters with "
      "dropout=0 (lora.dropout: 0) or train unpacked"
    )


class Rows(NamedTuple):
  """What :func:`prepare_rows` returns.

  Attributes:
    rows: the per-token inputs of the loss, ``[M, K, R, ...]`` (M mini-batches, K micro-batches, R rows of
      this split, sharded over data×fsdp): the model inputs (or packed slots), ``loss_mask``, ``old_logp``,
      ``adv``, ``weights``, ``ref_logp``, ``behavior_logp`` (None where absent).
    extra: metrics of the rollout batch: ``rewards_nonfinite``, ``hyper/*`` (applied values), ``tree/*``.
    example: one micro-batch of ``rows`` (``rows[0, 0]``), for shapes.
  """

  rows: dict
  extra: dict
  example: dict


def prepare_rows(spec: _StepSpec, batch: Batch, hyper) -> Rows:
  """Once per rollout batch, no gradient: the advantages and token weights (:func:`_rollout_terms`), the loss
  mask (real tokens of rows with a finite reward; policy tokens of a multi-turn row), and the rows split into
  ``[M, K, R, ...]`` mini/micro-batches (``row = i·(M·K) + m·K + k``), packed slots included."""
  config, tc = spec.config, spec.tc
  b, t = batch.completions.shape
  mm, kk = tc.mini_batches, tc.micro_batches
  g, num_groups = _group_bound(tc.group_size, b)
  adv, weights, sizes = _rollout_terms(spec, batch, num_groups, g, hyper)
  _check_advantages_out(adv, weights, b, t)
  # [B] missing samples (non-finite rewards): advantage 0, no tokens in the loss; none without rewards
  missing = jnp.zeros((b,), bool) if batch.rewards is None else ~jnp.isfinite(batch.rewards)
  loss_mask = batch.mask & ~missing[:, None]  # [B, T]
  if batch.policy_mask is not None:  # multi-turn: observation tokens are context, not loss
    loss_mask = loss_mask & batch.policy_mask
  adv = jnp.where(missing if adv.ndim == 1 else missing[:, None], 0.0, adv.astype(jnp.float32))
  select = lambda x: None if x is None else jnp.where(loss_mask, x.astype(jnp.float32), 0.0)
  extra = {"rewards_nonfinite": jnp.sum(missing).astype(jnp.float32)}
  if isinstance(hyper, GRPOHyper):  # the values applied: a field the config's program does not read is not logged
    extra.update({f"hyper/{k}": jnp.asarray(getattr(hyper, k), jnp.float32) for k in config.applied_hyper})
  if sizes is not None:
    stats = process_tree_stats(batch.completions, batch.mask, batch.group_ids, num_groups, sizes=sizes)
    extra.update({f"tree/{k}": v for k, v in stats.items()})
  rows = dict(
    _model_inputs(batch),
    loss_mask=loss_mask,  # the loss: real tokens of rows with a finite reward
    old_logp=select(batch.old_logp),
    adv=adv,
    weights=select(weights),
    ref_logp=select(batch.ref_logp),
    behavior_logp=select(batch.behavior_logp),
  )
  # [M, K, R, ...], R over data×fsdp: each device keeps its own rows
  rows = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(_split_rows(x, mm, kk), spec.rows_sh), rows)
  if batch.packed is not None:  # and its own packed rows: slot d·(M·K) + m·K + k
    split = lambda x: jax.lax.with_sharding_constraint(_split_slots(x, spec.blocks, mm, kk), spec.rows_sh)
    rows.update(jax.tree.map(split, _slot_inputs(batch.packed)))
  return Rows(rows, extra, jax.tree.map(lambda x: x[0, 0], rows))


def micro_terms(spec: _StepSpec, frozen, hyper, params, mb: dict, scale):
  """One micro-batch ``mb`` (``[R, ...]``): ``(scale · numerator, (LossTerms, Σ entropy, routing sums))``.

  The policy is ``params`` merged with the ``frozen`` base; a MoE policy replays ``mb["routing"]`` when the
  batch carries it (``moe.routing_scope``) and adds its router losses weighted like the objective,
  ``Σ_k (num_k + c·aux_k·den_k) / Σ_k den_k``; LoRA dropout reads ``mb["dropout_key"]`` when present; a packed
  micro-batch (``head_index`` in ``mb``) takes its log-probs from the packed slots. The gradient of the first
  output is :func:`accumulate_grads`' term."""
  config, tc = spec.config, spec.tc
  model = _merge_model(spec.graphdef, params, frozen)
  _check_dropout(spec, model, packed="head_index" in mb)
  wants_entropy = _wants_entropy(config, spec.objective_fn)
  with moe.routing_scope(replay=mb.get("routing")) as scope:  # MoE: replay the rollout's experts if given
    logp, ent = _micro_log_probs(model, mb, tc, spec.blocks, tc.entropy or wants_entropy, wants_entropy)
  router_loss, route_sums = _router_terms(model, mb, scope, tc)
  extras = _objective_extras(config, mb["behavior_logp"], ent, hyper, spec.objective_fn)
  terms = spec.objective_fn(
    config,
    logp,
    mb["old_logp"],
    mb["adv"],
    mb["loss_mask"],
    token_weights=mb["weights"],
    ref_logp=mb["ref_logp"],
    **extras,
  )
  if not isinstance(terms, LossTerms):
    raise TypeError(f"objective_fn must return jaxgrpo.kernels.losses.LossTerms; got {type(terms).__name__}")
  ent = None if ent is None else jax.lax.stop_gradient(ent)
  ent_sum = jnp.zeros((), jnp.float32) if ent is None else jnp.sum(jnp.where(mb["loss_mask"], ent, 0.0))
  # the router losses, weighted like the objective: Σ_k (num_k + c·aux_k·den_k) / Σ_k den_k
  numerator = terms.numerator + router_loss * jax.lax.stop_gradient(terms.denominator)
  return numerator * scale, (terms, ent_sum, route_sums)


def token_scale(mini: dict) -> jax.Array:
  """``2^-e ≈ 1/(real tokens of the mini-batch)``: keeps the accumulated gradients at the scale of a token
  mean (low-precision parameters) and cancels in the one division; a power of two, so scaling rounds nothing."""
  _, e = jnp.frexp(jnp.maximum(jnp.sum(mini["loss_mask"]).astype(jnp.float32), 1.0))
  return jnp.ldexp(jnp.float32(1.0), -e)


def accumulate_grads(spec: _StepSpec, grad_fn: Callable, shapes, params, mini: dict, scale):
  """``lax.scan`` over the K micro-batches of ``mini`` (``[K, R, ...]``): ``(Σ_k scale·∇numerator_k (float32,
  sharded like the parameters), Σ_k LossTerms, Σ entropy, Σ real tokens, Σ routing sums)``. ``grad_fn`` is
  ``jax.grad`` of :func:`micro_terms` (``has_aux``); ``shapes`` the abstract ``(LossTerms, _, routes)`` of one."""
  terms_shape, _, routes_shape = shapes

  def accumulate(acc, mb):
    grads, terms, ent, tokens, routes = acc
    g_k, (terms_k, ent_k, routes_k) = grad_fn(params, mb, scale)  # scale · ∇numerator_k
    grads = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), grads, g_k)
    grads = jax.lax.with_sharding_constraint(grads, spec.param_sh)
    tokens = tokens + jnp.sum(mb["loss_mask"]).astype(jnp.float32)
    routes = jax.tree.map(jnp.add, routes, routes_k)
    return (grads, combine_terms(terms, terms_k), ent + ent_k, tokens, routes), None

  zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  zero_grads = jax.lax.with_sharding_constraint(zero_grads, spec.param_sh)
  zero = jnp.zeros((), jnp.float32)
  zero_routes = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), routes_shape)
  init = (zero_grads, _zero_terms(terms_shape), zero, zero, zero_routes)
  return jax.lax.scan(accumulate, init, mini)[0]


def apply_update(spec: _StepSpec, params, opt_state, grads, terms: LossTerms, scale):
  """Divide once (``∇L = Σ_k ∇numerator_k / Σ_k denominator_k``), clip by global norm
  (``TrainConfig.max_grad_norm``), cast to the parameters' dtypes and apply the optimizer:
  ``(params, opt_state, grad_norm)``."""
  tc = spec.tc
  inv_den = _safe_div(1.0, scale * terms.denominator)  # divide once: Σ_k ∇numerator_k / Σ_k denominator_k
  grads = jax.tree.map(lambda x: x * inv_den, grads)
  grad_norm = optax.tree.norm(grads)
  if tc.max_grad_norm is not None:
    scale = jnp.where(grad_norm > tc.max_grad_norm, tc.max_grad_norm / jnp.maximum(grad_norm, 1e-30), 1.0)
    grads = jax.tree.map(lambda x: x * scale, grads)
  grads = jax.tree.map(lambda x, p: x.astype(p.dtype), grads, params)
  updates, opt_state = spec.optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, grad_norm


def update(spec: _StepSpec, grad_fn: Callable, shapes, carry, mini: dict):
  """One optimizer update on the mini-batch ``mini`` (``[K, R, ...]``): :func:`accumulate_grads` then
  :func:`apply_update`; ``((params, opt_state), metrics)`` with the loss terms, ``entropy``, ``grad_norm`` and,
  for a mixture of experts, the per-layer expert load and router entropy."""
  params, opt_state = carry
  scale = token_scale(mini)
  grads, terms, ent, tokens, routes = accumulate_grads(spec, grad_fn, shapes, params, mini, scale)
  params, opt_state, grad_norm = apply_update(spec, params, opt_state, grads, terms, scale)
  metrics = _finalize(terms)
  metrics["entropy"] = _safe_div(ent, tokens)
  metrics["grad_norm"] = grad_norm
  if routes:  # a mixture of experts: per-layer expert load and router entropy
    metrics.update(moe.routing_metrics(routes))
  return (params, opt_state), metrics


def train_epochs(spec: _StepSpec, grad_fn: Callable, shapes, params, opt_state, rows: dict, keys, passes: int):
  """μ = ``passes`` passes over ``rows`` (``[M, K, R, ...]``), M updates each: ``((params, opt_state), metrics
  [μ, M])``. ``keys`` (``key[μ, B]``, :func:`_row_dropout_keys`) gives every row its LoRA dropout key per pass
  (``rows["dropout_key"]``); None: no adapter dropout."""
  tc = spec.tc
  step = functools.partial(update, spec, grad_fn, shapes)

  def epoch(carry, keys):  # keys: key[B], this pass's row dropout keys, or None
    if keys is None:
      return jax.lax.scan(step, carry, rows)
    keys = jax.lax.with_sharding_constraint(_split_rows(keys, tc.mini_batches, tc.micro_batches), spec.rows_sh)
    return jax.lax.scan(step, carry, {**rows, "dropout_key": keys})

  return jax.lax.scan(epoch, (params, opt_state), keys, length=passes)


def _step_fn(spec: _StepSpec, state: TrainState, frozen, batch: Batch, hyper, dropout_key=None):
  """The step: the hyper-parameters of this step (a schedule's, structural zeros folded in), the rows
  (:func:`prepare_rows`), μ passes of M updates (:func:`train_epochs`), the metrics averaged over updates."""
  if hyper is None and spec.hyper_schedule is not None:
    hyper = spec.hyper_schedule(state.step)  # traced: one program for every step
  hyper = _structural_zeros(spec.config, hyper)
  prepared = prepare_rows(spec, batch, hyper)
  _check_denominator(spec.objective_fn, spec.config, prepared.example, hyper)
  terms = functools.partial(micro_terms, spec, frozen, hyper)
  shapes = jax.eval_shape(lambda p, mb: terms(p, mb, 1.0)[1], state.params, prepared.example)
  passes = _num_iterations(spec.config)
  b = batch.completions.shape[0]
  keys = None if dropout_key is None else _row_dropout_keys(dropout_key, state.step, passes, b)
  grad_fn = jax.grad(terms, has_aux=True)
  (params, opt_state), metrics = train_epochs(
    spec, grad_fn, shapes, state.params, state.opt_state, prepared.rows, keys, passes
  )
  metrics = _reduce_updates(metrics)
  metrics.update(prepared.extra)
  return TrainState(params, opt_state, state.step + 1), metrics  # frozen: reattached by TrainStep
