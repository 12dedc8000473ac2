"""The sharded GRPO-family train step: one jitted ``(state, batch) -> (state, metrics)``.

Per call (one rollout batch), inside one compiled program:

1. rollout-level quantities, once: the advantages and token weights — ``advantages_fn``
   (default :func:`jaxgrpo.kernels.objective.rollout_advantages`: group advantages, FRPO's future-KL
   advantage, λ-GRPO's ``1/|λ|`` weights), or the batch's own precomputed ``advantages`` /
   ``token_weights`` — and the process-tree statistics;
2. μ (``GRPOConfig.num_iterations``) passes over the batch, each split into ``mini_batches``
   optimizer updates (PPO-style); ratios are always taken against the rollout log-probs;
3. each update accumulates, over ``micro_batches`` (``lax.scan``), the gradient of the objective's
   numerator and its denominator (``objective_fn``, default
   :func:`jaxgrpo.kernels.objective.objective_terms`, returns both as :class:`~jaxgrpo.kernels.losses.LossTerms`),
   and divides once: ``∇L = Σ_k ∇numerator_k / Σ_k denominator_k``. This is the gradient of the
   full-batch loss ``Σ_k numerator_k / Σ_k denominator_k`` because the denominator has no gradient
   (it may depend on the data — masks, advantages, rewards — never on the parameters; the step
   checks this when it traces the objective);
4. clipping by global norm and the optax update.

Rows are assigned to mini/micro-batches by ``row = i·(M·K) + m·K + k`` (mini-batch m, micro-batch k),
so the split is the same on every mesh and stays local to each device's rows.

A non-finite reward marks a missing sample: advantage 0, its tokens dropped from the loss
(numerator and every count), counted in ``rewards_nonfinite`` (docs/train.md, "Missing samples").

The model is split once (``nnx.split``) and the step is a plain function of
``(graphdef, TrainState, Batch)``, jitted with explicit shardings and the state donated. Batches are
validated and placed on the mesh before the jitted call, so a NumPy batch and a placed one run the
same program.

The batch itself (``jaxgrpo.step.batch``: fields, validation, placement) and its fitting to compiled
shapes (``jaxgrpo.step.batch_packing``: bucket padding, slot packing) are their own modules, re-exported
here (``train.Batch``, ``train.pad_to_bucket``, ``train.pack_batch``, ...). What stays is one job,
the compiled update, and the pieces that must agree with it on shardings and shapes: its state
(:class:`TrainState`, :func:`init_train_state`), its static configuration (:class:`TrainConfig`), the
step function and its jitted wrapper (:class:`TrainStep`, :func:`make_train_step`), and the reference
pass compiled on the same mesh (:func:`make_reference_fn`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.extend import core as jex_core
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxgrpo import _checks
from jaxgrpo.kernels.config import SWITCHED_TERMS, GRPOConfig, GRPOHyper
from jaxgrpo.kernels.losses import LossTerms, combine_terms, finalize_terms
from jaxgrpo.kernels.objective import objective_terms, rollout_advantages
from jaxgrpo.kernels.process_sets import process_set_sizes, process_tree_stats
from jaxgrpo.models import lora, moe
from jaxgrpo.models.base import freeze_rules
from jaxgrpo.models.log_probs import completion_log_probs, packed_log_probs
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step.batch import (
  _FIELDS,
  _REFERENCE_FIELDS,
  Batch,
  _check_fields,
  _check_policy_mask,
  _check_routing,
  _host_values,
  _place_fields,
  _place_packed,
  _place_routing,
)
from jaxgrpo.step.batch_packing import (
  DEFAULT_BUCKETS,
  _check_packing,
  batch_slots,
  bucket_length,
  pack_batch,
  pad_to_bucket,
)
from jaxgrpo.step.packing import PackedSlots

__all__ = [
  "DEFAULT_BUCKETS",
  "Batch",
  "TrainConfig",
  "TrainState",
  "TrainStep",
  "batch_slots",
  "bucket_length",
  "completion_log_probs",
  "init_train_state",
  "make_reference_fn",
  "make_train_step",
  "pack_batch",
  "pad_to_bucket",
]


def _check_not_donated(tree, what: str) -> None:
  """ValueError if any array of ``tree`` was deleted (donated to an earlier call)."""
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    if isinstance(x, jax.Array) and x.is_deleted():
      raise ValueError(
        f"{what} was consumed by an earlier call: the train step donates its state, so the arrays of the "
        f"state you passed are deleted (first: {what}{jax.tree_util.keystr(path)}). Use the state the previous "
        "call returned: `state, metrics = step(state, batch)`"
      )


class TrainState(NamedTuple):
  """``params``: the trained variables (``nnx.State``: every parameter, or the LoRA adapters);
  ``opt_state``: optax state of ``params``; ``step``: ``int32[]`` calls of the train step so far;
  ``frozen``: the model's other variables (``nnx.State``: the base weights under LoRA, quantised or
  not; empty for full fine-tuning), or None (nothing frozen).

  The step donates and replaces ``params``, ``opt_state`` and ``step``; it never donates, copies or
  changes ``frozen``: the returned state holds the very same ``frozen`` arrays. The policy for the
  next rollout is ``nnx.merge(graphdef, state.params, state.frozen)``
  (``jaxgrpo.step.feed.policy_model``); it shares the state's arrays, which the next call of the
  step donates.
  """

  params: Any
  opt_state: Any
  step: jax.Array
  frozen: Any = None


def _merge_model(graphdef, params, frozen=None):
  """The model of ``graphdef`` holding ``params`` and ``frozen`` (None: nothing frozen); no copy."""
  return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """How the step is executed (the objective itself is the ``config`` of :func:`make_train_step`).

  Attributes:
    micro_batches: K, gradient-accumulation steps per optimizer update (same update for any K).
    mini_batches: M, optimizer updates per pass over the batch (PPO mini-batches); μ passes are
      made (``GRPOConfig.num_iterations``), so a step makes μ·M updates.
    max_grad_norm: clip the gradient to this global norm (None: no clipping).
    temperature: the sampling temperature the log-probs refer to; the one temperature of training
      (``jaxgrpo.rollout.iteration.grpo_iteration`` and the trainer sample at it).
    chunk_size: positions per chunk of the float32 logits (None: unchunked). A chunk holds
      ``rows per micro-batch × chunk_size × V`` float32 logits: aim for a few thousand tokens (64 rows ×
      32 positions at V = 32000 is 262 MB; larger chunks were slower, BENCHMARKS.md "Peers", run C).
    group_size: G, the largest group (bounds ``process_set_sizes``' work; None: B, always correct).
    tree_stats: compute the process-tree statistics for presets without λ weights too (the λ presets
      always report them: they come free from the weights).
    entropy: report the policy entropy (one extra pass over each logits chunk, no gradient).
    compiler_options: XLA options for compiling the step and the reference pass (None: defaults),
      e.g. ``{"xla_backend_optimization_level": 0}`` compiles about twice as fast on CPU (tests).
    packing: L, the packed row length (None: no packing, one ``[prompt ‖ completion]`` row per
      sequence). With L, the model's forward/backward runs on rows of L tokens holding several
      sequences back to back (:func:`pack_batch`); every sequence (prompt + completion) must fit one.
    packing_rows: rows of L tokens per micro-batch and device (None: the fewest that hold the fullest
      micro-batch, rounded up to a power of two; a fixed value gives one compiled shape and a
      ValueError for a batch that does not fit).
    router_aux_loss: a mixture of experts' load-balancing coefficient c (HF ``router_aux_loss_coef``;
      0: off): the loss becomes ``Σ_k (num_k + c·aux_k·den_k) / Σ_k den_k`` with ``aux_k`` =
      ``jaxgrpo.models.moe.load_balancing_loss`` of micro-batch k's forward over its real tokens (one
      micro-batch: ``loss + c·aux``, HF's form). Ignored by a dense model.
    router_z_loss: the router z-loss coefficient (``moe.router_z_loss``, added the same way; 0: off).
  """

  micro_batches: int = 1
  mini_batches: int = 1
  max_grad_norm: float | None = 1.0
  temperature: float = 1.0
  chunk_size: int | None = 256
  group_size: int | None = None
  tree_stats: bool = False
  entropy: bool = True
  compiler_options: Mapping[str, Any] | None = None
  packing: int | None = None
  packing_rows: int | None = None
  router_aux_loss: float = 0.0
  router_z_loss: float = 0.0

  def __post_init__(self):
    c = _checks
    c.check_python_int(self.micro_batches, "micro_batches", minimum=1, hint="K, gradient-accumulation steps")
    c.check_python_int(self.mini_batches, "mini_batches", minimum=1, hint="M, updates per pass")
    if self.max_grad_norm is not None:
      c.check_python_float(self.max_grad_norm, "max_grad_norm", above=0.0, hint="or None: no clipping")
    c.check_python_float(self.temperature, "temperature", above=0.0, hint="the sampling temperature")
    for name in ("chunk_size", "group_size", "packing", "packing_rows"):
      if getattr(self, name) is not None:
        c.check_python_int(getattr(self, name), name, minimum=1, hint="a positive int or None")
    c.check_python_bool(self.tree_stats, "tree_stats")
    c.check_python_bool(self.entropy, "entropy")
    for name in ("router_aux_loss", "router_z_loss"):
      c.check_python_float(getattr(self, name), name, at_least=0.0, hint="MoE router loss coefficient")
    if self.packing is None and self.packing_rows is not None:
      raise ValueError(f"`packing_rows`={self.packing_rows} needs `packing` (the row length L)")


# ----------------------------------------------------------------------------- state


def _check_params_only(state):
  others = [p for p, v in nnx.to_flat_state(state) if not isinstance(v, nnx.Param)]
  if others:
    raise ValueError(
      f"the model holds non-parameter state {others[:5]}; the train step updates only the trained "
      "parameters and passes the rest through, so the model must hold only nnx.Param"
    )


def _check_trainable(params, trainable) -> None:
  """The trained part must be non-empty and floating point (quantised codes cannot be trained)."""
  flat = nnx.to_flat_state(params)
  if not flat:
    raise ValueError(f"trainable={trainable!r} selects no variable of the model: nothing to train")
  ints = [".".join(map(str, p)) for p, v in flat if not jnp.issubdtype(v.get_value().dtype, jnp.floating)]
  if ints:
    raise ValueError(
      f"trainable={trainable!r} selects non-floating-point arrays {ints[:4]} (quantised base-weight codes, "
      "models.lora QLoRA): they cannot be trained. Train the adapters only: trainable=nnx.LoRAParam"
    )


def _copy_tree(tree):
  return jax.tree.map(jnp.copy, tree)


def _checked_rules(model_rules: tuple, rules: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
  """The one rules table of a model: its own (``model.sharding_rules``, which its activation
  constraints use) when ``rules`` is None, else ``rules``, which must be the same table."""
  if rules is not None and freeze_rules(rules) != model_rules:
    raise ValueError(
      f"{where}: `rules` differ from the model's own rules table (model.rules = {dict(model_rules)}, which its "
      f"activation constraints use); got {dict(rules)}. Build the model with these rules "
      "(build_model/load_hf(..., rules=...)) or leave `rules` unset"
    )
  return dict(model_rules)


def _graph_rules(graphdef, param_shardings, frozen_shardings=None) -> tuple:
  """``model.sharding_rules`` of the model ``graphdef`` describes (merged with the parameter and frozen
  shardings: only the static attributes are read)."""
  return _merge_model(graphdef, param_shardings, frozen_shardings).sharding_rules


def init_train_state(
  model,
  optimizer: optax.GradientTransformation,
  mesh: Mesh,
  rules: Mapping[str, Any] | None = None,
  *,
  trainable=nnx.Param,
):
  """Split ``model`` once into trained and frozen variables; place both and a fresh optimizer state
  (of the trained variables only) on ``mesh``.

  Args:
    model: a ``jaxgrpo.models`` model (or any NNX module holding only ``nnx.Param`` s).
    optimizer: the optax transformation; its state is built for the trained variables only.
    mesh, rules: the mesh and the logical-axis rules (default ``jaxgrpo.parallel.sharding.DEFAULT_RULES``).
    trainable: an NNX filter of the trained variables: ``nnx.Param`` (default: every parameter, full
      fine-tuning) or ``nnx.LoRAParam`` (the adapters of ``jaxgrpo.models.lora``; LoRA/QLoRA: the
      base weights are frozen, gradients and Adam moments exist for the adapters only). Any
      ``nnx.filterlib`` filter works; it must select floating-point arrays only (quantised codes are
      refused, naming them).

  ``rules`` (the logical-axis rules of the parameters) defaults to the model's own table
  (``model.rules``, the one its activation constraints use); other rules raise ValueError.

  Returns:
    ``(graphdef, state, shardings)``: the static graph, a :class:`TrainState` whose parameters,
    optimizer moments and frozen variables are sharded by ``rules`` (FSDP over ``fsdp``, tensor
    parallelism over ``tensor``), and the matching :class:`TrainState` of shardings (for
    :func:`make_train_step`). The trained parameters are copied (the step donates them, never the
    model's own arrays); the frozen ones are not (the step never donates them): ``state.frozen``
    holds the model's own arrays when they already have these shardings. Raises ValueError (before
    anything is compiled) for any dimension the mesh does not divide, e.g. heads % tensor.
  """
  rules = _checked_rules(model.sharding_rules, rules, "init_train_state")
  graphdef, params, frozen = nnx.split(model, trainable, ...)
  _check_params_only(nnx.state(model))
  _check_trainable(params, trainable)
  param_sh = shd.tree_shardings(params, mesh, rules)
  frozen_sh = shd.tree_shardings(frozen, mesh, rules)
  opt_abstract = jax.eval_shape(optimizer.init, params)
  opt_sh = shd.tree_shardings(opt_abstract, mesh, rules)
  replicated = NamedSharding(mesh, PartitionSpec())
  shardings = TrainState(param_sh, opt_sh, replicated, frozen_sh)
  params = jax.device_put(params, param_sh)
  # the step donates its state: copy, so that the model's own arrays are never donated
  params = jax.jit(_copy_tree, out_shardings=param_sh)(params)
  frozen = jax.device_put(frozen, frozen_sh)  # a no-op for arrays already placed so
  opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
  return graphdef, TrainState(params, opt_state, step, frozen), shardings


# ----------------------------------------------------------------------------- the step


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


def _step_fn(spec: _StepSpec, state: TrainState, frozen, batch: Batch, hyper, dropout_key=None):
  graphdef, config, tc = spec.graphdef, spec.config, spec.tc
  b, t = batch.completions.shape
  mm, kk = tc.mini_batches, tc.micro_batches
  g, num_groups = _group_bound(tc.group_size, b)
  if hyper is None and spec.hyper_schedule is not None:
    hyper = spec.hyper_schedule(state.step)  # traced: one program for every step
  hyper = _structural_zeros(config, hyper)

  # 1. once per rollout batch (no gradient): advantages, token weights, tree statistics.
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
  example_mb = jax.tree.map(lambda x: x[0, 0], rows)
  _check_denominator(spec.objective_fn, config, example_mb, hyper)

  def micro_terms(p, mb, scale):
    model = _merge_model(graphdef, p, frozen)
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

  terms_shape, _, routes_shape = jax.eval_shape(lambda p, mb: micro_terms(p, mb, 1.0)[1], state.params, example_mb)
  grad_fn = jax.grad(micro_terms, has_aux=True)

  def update(carry, mini):  # mini: [K, R, ...]
    params, opt_state = carry
    # 2^-e ≈ 1/(real tokens): keeps the accumulated gradients at the scale of a token mean (low-precision
    # parameters) and cancels in the division below; a power of two, so scaling rounds nothing
    _, e = jnp.frexp(jnp.maximum(jnp.sum(mini["loss_mask"]).astype(jnp.float32), 1.0))
    scale = jnp.ldexp(jnp.float32(1.0), -e)

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
    (grads, terms, ent, tokens, routes), _ = jax.lax.scan(accumulate, init, mini)
    inv_den = _safe_div(1.0, scale * terms.denominator)  # divide once: Σ_k ∇numerator_k / Σ_k denominator_k
    grads = jax.tree.map(lambda x: x * inv_den, grads)
    grad_norm = optax.tree.norm(grads)
    if tc.max_grad_norm is not None:
      scale = jnp.where(grad_norm > tc.max_grad_norm, tc.max_grad_norm / jnp.maximum(grad_norm, 1e-30), 1.0)
      grads = jax.tree.map(lambda x: x * scale, grads)
    grads = jax.tree.map(lambda x, p: x.astype(p.dtype), grads, params)
    updates, opt_state = spec.optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = _finalize(terms)
    metrics["entropy"] = _safe_div(ent, tokens)
    metrics["grad_norm"] = grad_norm
    if routes:  # a mixture of experts: per-layer expert load and router entropy
      metrics.update(moe.routing_metrics(routes))
    return (params, opt_state), metrics

  def epoch(carry, keys):  # keys: key[B], this pass's row dropout keys, or None
    if keys is None:
      return jax.lax.scan(update, carry, rows)
    keys = jax.lax.with_sharding_constraint(_split_rows(keys, mm, kk), spec.rows_sh)
    return jax.lax.scan(update, carry, {**rows, "dropout_key": keys})

  passes = _num_iterations(config)
  keys = None if dropout_key is None else _row_dropout_keys(dropout_key, state.step, passes, b)
  (params, opt_state), metrics = jax.lax.scan(epoch, (state.params, state.opt_state), keys, length=passes)
  metrics = _reduce_updates(metrics)
  metrics.update(extra)
  return TrainState(params, opt_state, state.step + 1), metrics  # frozen: reattached by TrainStep


def _options(tc: TrainConfig):
  return None if tc.compiler_options is None else dict(tc.compiler_options)


def _fn_name(fn) -> str:
  return getattr(fn, "__name__", repr(fn))


class TrainStep:
  """The compiled train step; call as ``state, metrics = step(state, batch)``.

  Created by :func:`make_train_step`. Each call packs the batch when ``train_config.packing`` is set
  and the batch is not packed yet (:meth:`pack`), validates it on the host (shapes, dtypes, group
  ids, group sizes, divisibility, the packed layout; clear errors, nothing compiled), places it on the
  mesh (a NumPy batch and a placed one run the same program), checks that ``state`` was not consumed
  by an earlier call, then runs the jitted step with ``state`` donated — except ``state.frozen``, a
  separate, non-donated argument that the returned state holds unchanged (no copy) — under
  ``jax.set_mesh(mesh)`` (the model's activation sharding constraints apply). ``traces`` counts how
  often the step was traced: the same shapes and the same optional fields never retrace or recompile.

  Hyper-parameters as inputs: ``step(state, batch, hyper)`` passes a pytree of ``f32[]`` arrays — for a
  ``GRPOConfig`` a :class:`~jaxgrpo.kernels.config.GRPOHyper` (``config.hyper(beta=...)``), checked against the
  config when concrete — to ``advantages_fn`` and ``objective_fn`` (keyword ``hyper=``); without it,
  ``make_train_step(..., hyper_schedule=fn)`` computes ``fn(state.step)`` inside the step; with
  neither, the config's numbers are compile-time constants. One compiled program serves every value
  (``traces`` stays 1 across a β or ε schedule); the values applied are reported as ``hyper/<name>``.
  A call's concrete ``hyper`` must hold 0 where the config's β / entropy coefficient is 0 (that term is not
  in the program: use ``hyper_schedule`` or a config with the term on) and the config's own value in a
  field its program never reads (ValueError naming the field).

  Attributes:
    graphdef, config, train_config, mesh, shardings, objective_fn, advantages_fn, dropout_key,
      hyper_schedule: as given to :func:`make_train_step` (``config`` with the terms a ``hyper_schedule``
      sets switched on).
    rules: the logical-axis rules (the model's own table).
    batch_sharding: the ``NamedSharding`` of every batch array (rows over ``data × fsdp``).
    reads_ref_logp: whether ``batch.ref_logp`` reaches the step's functions (False only for the
      default functions with a β = 0 GRPOConfig; the field is then dropped, one program either way).
    jitted: the ``jax.jit`` of ``(state without frozen, state.frozen, placed batch, hyper, dropout key)``; :meth:`lower`
      lowers it under ``jax.set_mesh(step.mesh)``, as each call runs it (e.g. ``memory_analysis()``).
  """

  def __init__(self, spec: _StepSpec, mesh: Mesh, shardings: TrainState, rules):
    self.graphdef, self.config, self.train_config = spec.graphdef, spec.config, spec.tc
    self.objective_fn, self.advantages_fn = spec.objective_fn, spec.advantages_fn
    self.dropout_key, self.hyper_schedule = spec.dropout_key, spec.hyper_schedule
    self.mesh, self.rules, self.shardings = mesh, rules, shardings
    self.batch_sharding = shd.batch_sharding(mesh, rules)
    self.traces = 0
    defaults = spec.objective_fn is objective_terms and spec.advantages_fn is rollout_advantages
    self.reads_ref_logp = not (defaults and isinstance(spec.config, GRPOConfig) and not spec.config.needs_reference)

    def fn(state, frozen, batch, hyper, dropout_key):
      self.traces += 1
      return _step_fn(spec, state, frozen, batch, hyper, dropout_key)

    replicated = NamedSharding(mesh, PartitionSpec())
    donated = shardings._replace(frozen=None)
    # the dropout key is an argument, not a constant: runs that differ only in their seed share one program
    self._dropout_key = None if spec.dropout_key is None else jax.device_put(spec.dropout_key, replicated)
    self.jitted = jax.jit(
      fn,
      in_shardings=(donated, shardings.frozen, self.batch_sharding, replicated, replicated),
      out_shardings=(donated, replicated),
      donate_argnums=0,
      compiler_options=_options(spec.tc),
    )

  def requires_ref_logp(self, batch: Batch | None = None) -> bool:
    """Whether the default functions will read ``ref_logp`` for ``batch`` (None: a batch without
    precomputed advantages): a GRPOConfig with β > 0 and the default objective (KL in the loss) or
    the default advantages (FRPO's future-KL). Custom functions that need it say so when traced."""
    c = self.config
    if not (isinstance(c, GRPOConfig) and c.needs_reference):
      return False
    if c.kl_placement == "loss":
      return self.objective_fn is objective_terms
    return (batch is None or batch.advantages is None) and self.advantages_fn is rollout_advantages

  def check_batch(self, batch: Batch) -> None:
    """TypeError/ValueError unless ``batch`` fits this step: shapes and dtypes of every field, the
    fields the configuration needs, divisibility over ``data × fsdp × M × K``, a packed batch's layout
    (``batch.packed``, with ``train_config.packing`` only), and — when the values are on this host —
    group ids in ``[0, num_groups)`` and no group larger than ``train_config.group_size``. Non-finite rewards are allowed (missing samples);
    ``batch.rewards`` may be None when ``batch.advantages`` is given."""
    b, t = _check_fields(batch, _FIELDS)
    c, tc = self.config, self.train_config
    if self.requires_ref_logp(batch) and batch.ref_logp is None:
      raise ValueError(
        f"preset {c.name!r} ({'β from hyper_schedule' if self.hyper_schedule else f'beta={c.beta}'}, "
        f"kl_placement={c.kl_placement!r}) needs batch.ref_logp: compute it "
        "with make_reference_fn (jaxgrpo.step.feed.make_reference)"
      )
    if batch.advantages is None and self.advantages_fn is rollout_advantages and not isinstance(c, GRPOConfig):
      raise ValueError(
        f"config is a {type(c).__name__}, not a GRPOConfig: the default advantages_fn (rollout_advantages) "
        "cannot use it; pass advantages_fn to make_train_step or precomputed batch.advantages"
      )
    if batch.advantages is not None and batch.token_weights is None and isinstance(c, GRPOConfig):
      if c.process_weights:
        raise ValueError(
          f"preset {c.name!r} weights tokens by 1/|λ| but batch.advantages is given without batch.token_weights "
          "(the step would train without the weights): pass token_weights too, e.g. from rollout_advantages"
        )
    shd.check_batch_divisible(b, self.mesh, self.rules, splits=tc.micro_batches * tc.mini_batches)
    _check_policy_mask(batch)
    _check_routing(batch, b, t)
    _check_packing(batch, tc, shd.batch_shards(self.mesh, self.rules), tc.mini_batches * tc.micro_batches)
    g, num_groups = _group_bound(tc.group_size, b)
    ids = _host_values(batch.group_ids)
    if ids is None or ids.size == 0:
      return
    if ids.min() < 0 or ids.max() >= num_groups:
      why = f"TrainConfig.group_size={tc.group_size}: {b} rows hold at most" if tc.group_size else "at most"
      raise ValueError(
        f"batch.group_ids must be in [0, {num_groups}) ({why} {num_groups} groups); "
        f"got values in [{ids.min()}, {ids.max()}]"
      )
    largest = int(np.bincount(ids.astype(np.int64)).max())
    if largest > g:
      raise ValueError(
        f"batch has a group of {largest} rows but TrainConfig.group_size={tc.group_size}: raise group_size "
        "(it bounds the process-set computation) or split the group"
      )

  def pack(self, batch: Batch) -> Batch:
    """``batch`` with its sequences packed for this step (:func:`pack_batch` with the step's row
    length, rows, mesh and split) when ``train_config.packing`` is set and ``batch.packed`` is None;
    otherwise ``batch`` itself. Host side (the batch's values must be on this host)."""
    tc = self.train_config
    if tc.packing is None or batch.packed is not None:
      return batch
    _check_fields(batch, _FIELDS)  # the usual errors for a malformed batch, before the packer reads it
    return pack_batch(
      batch,
      row_length=tc.packing,
      shards=shd.batch_shards(self.mesh, self.rules),
      mini_batches=tc.mini_batches,
      micro_batches=tc.micro_batches,
      rows=tc.packing_rows,
    )

  def place_batch(self, batch: Batch) -> Batch:
    """``batch`` packed (:meth:`pack`), validated (:meth:`check_batch`) and placed on the mesh with the
    step's dtypes; what each call does before the jitted step (a no-op for a batch this returned)."""
    batch = self.pack(batch)
    self.check_batch(batch)
    if not self.reads_ref_logp and batch.ref_logp is not None:
      batch = batch._replace(ref_logp=None)  # not used: keep one compiled program
    if not _reads_behavior(self.config) and batch.behavior_logp is not None:
      batch = batch._replace(behavior_logp=None)  # not read by this config: one compiled program
    placed = _place_packed(_place_fields(batch, _FIELDS, self.batch_sharding), self.batch_sharding)
    return _place_routing(placed, self.batch_sharding)

  def check_hyper(self, hyper):
    """``hyper`` as the step takes it: every leaf an array (``f32[]`` for a :class:`GRPOHyper`,
    checked against the config by :meth:`GRPOConfig.check_hyper` when concrete); None stays None."""
    if hyper is None:
      return None
    if self.hyper_schedule is None:  # the hooks get hyper= from this call on
      _check_keywords(self.objective_fn, "objective_fn", {"hyper": "a hyper-parameter pytree was passed"})
      _check_keywords(self.advantages_fn, "advantages_fn", {"hyper": "a hyper-parameter pytree was passed"})
    if isinstance(self.config, GRPOConfig):
      if not isinstance(hyper, GRPOHyper):
        raise TypeError(f"hyper must be a jaxgrpo.GRPOHyper (config.hyper(...)) or None; got {type(hyper).__name__}")
      hyper = self.config.check_hyper(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), hyper))
      _check_unread(self.config, hyper)
      return hyper
    return jax.tree.map(jnp.asarray, hyper)

  def _args(self, state: TrainState, batch: Batch, hyper=None):
    if not isinstance(state, TrainState):
      raise TypeError(f"state must be a jaxgrpo.step.train.TrainState; got {type(state).__name__}")
    _check_not_donated(state, "state")
    hyper = self.check_hyper(hyper)
    if hyper is not None:  # replicated over the mesh, as the jitted step takes it (every process: the same values)
      hyper = jax.device_put(hyper, NamedSharding(self.mesh, PartitionSpec()))
    return state._replace(frozen=None), state.frozen, self.place_batch(batch), hyper, self._dropout_key

  def __call__(self, state: TrainState, batch: Batch, hyper=None):
    """One step; ``hyper``: optional hyper-parameter pytree (see the class docstring)."""
    args = self._args(state, batch, hyper)
    with jax.set_mesh(self.mesh):  # the models' activation constraints apply while this mesh is set
      new, metrics = self.jitted(*args)
    return new._replace(frozen=state.frozen), metrics

  def lower(self, state: TrainState, batch: Batch, hyper=None) -> jax.stages.Lowered:
    """The jitted step lowered for ``state`` and ``batch`` (checked and placed as a call would be),
    without running it: ``.compile().memory_analysis()`` gives the program's memory footprint."""
    args = self._args(state, batch, hyper)
    with jax.set_mesh(self.mesh):
      return self.jitted.lower(*args)


def make_train_step(
  graphdef,
  optimizer: optax.GradientTransformation,
  config,
  *,
  mesh: Mesh,
  shardings: TrainState,
  train_config: TrainConfig | None = None,
  rules: Mapping[str, Any] | None = None,
  objective_fn: Callable[..., LossTerms] | None = None,
  advantages_fn: Callable | None = None,
  dropout_key: jax.Array | None = None,
  hyper_schedule: Callable[[jax.Array], Any] | None = None,
) -> TrainStep:
  """The jitted step ``(TrainState, Batch) -> (TrainState, metrics)`` for ``config`` on ``mesh``.

  Args:
    graphdef, shardings: from :func:`init_train_state`.
    optimizer: any optax transformation (clipping by global norm is done by the step,
      ``train_config.max_grad_norm``).
    config: the algorithm's configuration, passed unchanged to ``objective_fn`` and
      ``advantages_fn``. A :class:`~jaxgrpo.kernels.config.GRPOConfig` (a preset from ``jaxgrpo.preset``) is
      required by the default functions; the step itself reads only its μ (``num_iterations``) and β
      (whether ``batch.ref_logp`` is needed). A custom ``objective_fn`` may take any object, None
      included: the step then makes one pass (μ = 1). Use an immutable, hashable object (a frozen
      dataclass, a NamedTuple): it is closed over by the compiled program, and your own jitted
      functions can take it as a static argument.
    train_config: micro/mini-batches, clipping, temperature, log-prob chunking, packing.
    rules: logical-axis rules of the parameters and the batch: by default the model's own table
      (``model.rules``, default ``jaxgrpo.parallel.sharding.DEFAULT_RULES``), which its activation constraints
      use; any other table raises ValueError.
    objective_fn: ``objective_fn(config, logp, old_logp, advantages, mask, *, token_weights=None,
      ref_logp=None) -> LossTerms``, the loss of one micro-batch: ``logp`` ``f32[R, T]`` the current
      policy's log-probs (differentiable), ``old_logp`` ``f32[R, T]`` the rollout's, ``advantages``
      ``f32[R]`` or ``f32[R, T]``, ``mask`` ``bool[R, T]`` (False on padding and on missing samples),
      ``token_weights`` ``f32[R, T]`` or None, ``ref_logp`` ``f32[R, T]`` or None (0 wherever ``mask``
      is False). Default :func:`jaxgrpo.kernels.objective.objective_terms`. Contract: the loss of the batch is
      ``Σ numerator / Σ denominator`` over its micro-batches, and the denominator has no gradient
      (masks, advantages, shapes; checked when the step is traced, ValueError otherwise). The metrics
      are :func:`~jaxgrpo.kernels.losses.finalize_terms`' when the terms' ``sums`` are those of
      :func:`~jaxgrpo.kernels.losses.policy_loss_terms` (build on it), else ``loss`` and ``objective/<key>``:
      each ``sums[key]`` added over the micro-batches of an update (a sum, not a mean: divide by a count
      of your own) and averaged over the μ·M updates; ``extrema`` keys (``*_max``/``*_min``) max/min.
      Two keywords are added only when asked for: ``behavior_logp=`` ``f32[R, T]`` or None
      (``importance_correction`` set; ``batch.behavior_logp``) and ``entropy=`` ``f32[R, T]`` with its
      gradient (``entropy_coef != 0``, or an objective marked ``objective_fn.uses_entropy = True`` —
      :func:`jaxgrpo.kernels.objective.uses_entropy` — for any config). A third, ``hyper=``, only when the step
      has a hyper-parameter pytree (a call's ``hyper`` or ``hyper_schedule``); ``advantages_fn``
      receives it too. The hooks' signatures are checked here (and ``hyper=`` at the first call with a
      ``hyper``): a keyword the step will pass and the hook cannot take raises TypeError naming it
      (a hook with ``**kwargs`` takes every keyword).
    advantages_fn: ``advantages_fn(config, rewards, tokens, mask, group_ids, num_groups, *,
      old_logp=None, ref_logp=None, max_group_size=None) -> (advantages, token_weights)`` with
      ``advantages`` ``f32[B]`` or ``f32[B, T]`` and ``token_weights`` ``f32[B, T]`` or None; called
      once per batch inside the step, unless the batch carries precomputed ``advantages``. Rewards are
      passed as given (non-finite = missing, see ``jaxgrpo.kernels.advantages``); the step then zeroes the
      advantages of missing samples. Default :func:`jaxgrpo.kernels.objective.rollout_advantages`.
    dropout_key: the run's PRNG key for LoRA adapter dropout (a typed key or raw ``uint32[2]``), or
      None: no dropout. Row r of the batch, in pass i of the step with ``state.step = s``, uses
      ``fold_in(fold_in(fold_in(dropout_key, s), i), r)``: the same masks on every mesh and for any
      micro/mini-batch split, and a resumed run draws the same masks. Required (ValueError when the
      step is traced) when the model's adapters have dropout > 0. Sampling, the reference pass and
      evaluation never apply dropout. The key is an argument of the compiled step, not a constant in
      it: steps that differ only in their key lower to the same program (a new seed reads it back from
      the persistent compilation cache).
    hyper_schedule: ``hyper_schedule(step int32[]) -> hyper`` (for a ``GRPOConfig`` a
      :class:`~jaxgrpo.kernels.config.GRPOHyper`, e.g. ``lambda s: config.hyper(beta=0.04 * jnp.minimum(s / 100,
      1.0))``), traced inside the step on ``state.step``: a β / ε / entropy schedule in one compiled
      program (a checkpoint resumes it). Evaluated once at step 0 here to check its structure (and
      its values at step 0); a ``hyper`` passed to the call takes precedence. A field the schedule
      *sets* (its value depends on the step, or differs from the config's at step 0) is always applied:
      a β or entropy coefficient set over a config's 0 switches its term on (β: the KL term and the
      reference pass, ``step.reads_ref_logp``; ``step.config`` is then the config with the term on, a
      placeholder coefficient 1.0 whose traced value is the schedule's), and a field the config never
      reads (τ± outside SAPO, the IS cap without ``importance_correction``, ε under SAPO) raises
      ValueError naming it. Custom hooks receive the pytree as ``hyper=`` (see :class:`TrainStep`).

  The state argument is donated, except ``state.frozen`` (see :class:`TrainState`). Metrics (replicated ``f32[]``, averaged over the μ·M updates,
  extrema over them): ``loss``, ``policy_loss``, ``kl``, ``clip_frac_low/high/dual``, ``approx_kl``
  (to the rollout policy), ``ratio_mean/min/max``, ``advantage_mean/std/min/max``, ``entropy``,
  ``grad_norm`` (before clipping), ``tokens``, ``sequences``, ``rewards_nonfinite`` (missing
  samples) and, for λ presets or with ``tree_stats``, ``tree/nontrivial_group_fraction``,
  ``tree/mean_path_depth``, ``tree/intermediate_proportion``, ``tree/mean_process_set_size``.
  With ``importance_correction``: ``is_weight_mean``, ``is_ratio_mean``, ``is_ratio_max``,
  ``is_capped_frac``, ``mismatch_kl`` (see :func:`~jaxgrpo.kernels.losses.policy_loss`). With a
  :class:`~jaxgrpo.kernels.config.GRPOHyper` in use: ``hyper/<field>``, the values this step applied (only the
  fields the config's program reads, :attr:`GRPOConfig.applied_hyper`).
  """
  objective_fn = objective_terms if objective_fn is None else objective_fn
  advantages_fn = rollout_advantages if advantages_fn is None else advantages_fn
  for name, fn in (("objective_fn", objective_fn), ("advantages_fn", advantages_fn)):
    if not callable(fn):
      raise TypeError(f"`{name}` must be callable; got {type(fn).__name__}")
  if objective_fn is objective_terms and not isinstance(config, GRPOConfig):
    raise TypeError(
      f"config must be a GRPOConfig (jaxgrpo.preset(...)) for the default objective; got {type(config).__name__}. "
      "Pass objective_fn to train with another configuration object"
    )
  if hyper_schedule is not None:
    if not callable(hyper_schedule):
      raise TypeError(f"`hyper_schedule` must be callable (step -> hyper) or None; got {type(hyper_schedule).__name__}")
    if isinstance(config, GRPOConfig):
      config, _ = _schedule_terms(config, hyper_schedule)
  _check_keywords(objective_fn, "objective_fn", _objective_keywords(config, objective_fn, hyper_schedule is not None))
  if advantages_fn is not rollout_advantages:
    _check_keywords(advantages_fn, "advantages_fn", _advantages_keywords(hyper_schedule is not None))
  train_config = TrainConfig() if train_config is None else train_config
  if not isinstance(train_config, TrainConfig):
    raise TypeError(f"train_config must be a jaxgrpo.step.train.TrainConfig; got {type(train_config).__name__}")
  rules = _checked_rules(_graph_rules(graphdef, shardings.params, shardings.frozen), rules, "make_train_step")
  rows_sh = NamedSharding(mesh, PartitionSpec(None, None, *shd.batch_sharding(mesh, rules).spec))
  blocks = shd.batch_shards(mesh, rules)
  spec = _StepSpec(
    graphdef,
    optimizer,
    config,
    train_config,
    objective_fn,
    advantages_fn,
    shardings.params,
    rows_sh,
    blocks,
    _check_run_key(dropout_key),
    hyper_schedule,
  )
  return TrainStep(spec, mesh, shardings, rules)


def _check_run_key(key):
  """A typed scalar PRNG key from a typed key or raw ``uint32[2]`` key data (None stays None)."""
  if key is None:
    return None
  if not isinstance(key, jax.Array):
    raise TypeError(f"dropout_key must be a jax PRNG key (jax.random.key(seed)); got {type(key).__name__}")
  if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.dtype != jnp.uint32 or key.shape != (2,):
      raise TypeError(f"dropout_key must be a typed PRNG key or raw uint32[2]; got {key.dtype}{list(key.shape)}")
    key = jax.random.wrap_key_data(key)
  if key.shape != ():
    raise ValueError(f"dropout_key must be one key (shape ()); got shape {key.shape}")
  return key


def make_reference_fn(
  graphdef,
  *,
  mesh: Mesh,
  param_shardings,
  train_config: TrainConfig | None = None,
  rules: Mapping[str, Any] | None = None,
) -> Callable:
  """Jitted ``(ref_params, batch) -> ref_logp f32[B, T]`` (batch-sharded) under the same mesh.

  ``ref_params`` has ``graphdef``'s structure and the shardings ``param_shardings`` and must not be
  the train state's own parameters (the step donates those): ``jaxgrpo.step.feed.make_reference``
  copies them once — or, for a LoRA policy, passes the graph of ``models.lora.base_model`` and the
  state's never-donated ``frozen`` base weights (no copy). Only
  needed when something reads ``ref_logp`` (β > 0: GRPO's KL term in the loss or FRPO's future-KL).
  The rows are processed in ``train_config.micro_batches`` sequential micro-batches (``lax.map``),
  exactly as the train step splits them, so the reference pass never holds more activations or
  logits chunks than one micro-batch of the step. With ``train_config.packing`` the batch is packed
  as the step packs it (a batch that carries ``packed`` is used as it is) and the pass runs the M·K
  slots of each device one after the other, each exactly one micro-batch of the step. Only the
  prompt and completion fields of the batch are read, and ``batch.routing`` (a mixture of experts'
  routing replay: the reference forward uses the rollout's experts); NumPy and placed batches run the
  same program.
  The pass is traced under ``jax.set_mesh(mesh)`` (activation constraints apply); ``rules`` as for
  :func:`make_train_step` (default: the model's own table).
  """
  tc = TrainConfig() if train_config is None else train_config
  rules = _checked_rules(_graph_rules(graphdef, param_shardings), rules, "make_reference_fn")
  bsh = shd.batch_sharding(mesh, rules)
  rows_sh = NamedSharding(mesh, PartitionSpec(None, None, *bsh.spec))
  blocks = shd.batch_shards(mesh, rules)
  k = tc.micro_batches
  slots = tc.mini_batches * tc.micro_batches  # per device shard, when packed

  def fn(params, cols):
    model = nnx.merge(graphdef, params)
    shape = cols[2].shape
    cols = [jax.lax.with_sharding_constraint(_split_rows(x, 1, k), rows_sh)[0] for x in cols]  # [K, R, ...]

    def one(mb):
      with moe.routing_scope(replay=mb[4] if len(mb) > 4 else None):  # MoE: the rollout's experts if given
        return completion_log_probs(model, *mb[:4], temperature=tc.temperature, chunk_size=tc.chunk_size)[0]

    logp = jax.lax.map(one, tuple(cols))  # [K, R, T]
    return jnp.moveaxis(logp, 0, 1).reshape(shape)  # inverse of _split_rows

  def fn_packed(params, unpack_index, packed_rows):
    model = nnx.merge(graphdef, params)
    mbs = {"unpack_index": jax.lax.with_sharding_constraint(_split_rows(unpack_index, 1, slots), rows_sh)[0]}
    for name, x in packed_rows.items():  # [M·K, blocks·X, ...]: slot j of every device shard
      mbs[name] = jax.lax.with_sharding_constraint(_split_slots(x, blocks, 1, slots), rows_sh)[0]
    logp = jax.lax.map(lambda mb: _micro_log_probs(model, mb, tc, blocks, False)[0], mbs)  # [M·K, R, T]
    return _merge_rows(logp[None], 1, slots)

  options = _options(tc)
  jitted = jax.jit(fn, in_shardings=(param_shardings, bsh), out_shardings=bsh, compiler_options=options)
  jitted_packed = jax.jit(
    fn_packed, in_shardings=(param_shardings, bsh, bsh), out_shardings=bsh, compiler_options=options
  )

  def reference_log_probs(ref_params, batch: Batch):
    b, _ = _check_fields(batch, _REFERENCE_FIELDS)
    _check_not_donated(ref_params, "ref_params")
    shd.check_batch_divisible(b, mesh, rules, splits=slots if tc.packing else k)
    if tc.packing is not None and batch.packed is None:
      batch = pack_batch(
        batch, row_length=tc.packing, shards=blocks, mini_batches=tc.mini_batches, micro_batches=k, rows=tc.packing_rows
      )
    _check_packing(batch, tc, blocks, slots)
    _check_routing(batch, b, np.shape(batch.completions)[1])
    placed = _place_routing(_place_packed(_place_fields(batch, _REFERENCE_FIELDS, bsh), bsh), bsh)
    with jax.set_mesh(mesh):  # the models' activation constraints apply while this mesh is set
      if placed.packed is not None:
        return jitted_packed(ref_params, placed.packed.unpack_index, _slot_inputs(placed.packed))
      cols = tuple(getattr(placed, name) for name in _REFERENCE_FIELDS)
      return jitted(ref_params, cols if placed.routing is None else cols + (placed.routing,))

  return reference_log_probs
