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
here (``train.Batch``, ``train.pad_to_bucket``, ``train.pack_batch``, ...). So are the state and static
configuration (``jaxgrpo.step.state``: :class:`TrainState`, :class:`TrainConfig`, :func:`init_train_state`).
The step's pieces are plain functions, each callable alone:

- ``jaxgrpo.step.hooks``: the hooks' contract (the keywords the step passes, the trace-time checks of what
  they return) and the hyper-parameter pytree (schedules, the terms a config leaves out);
- ``jaxgrpo.step.terms``: what a call computes before its updates (``step_hyper``; ``prepare_rows``: step 1 and
  the ``[M, K, R, ...]`` split; ``pass_fields``: the per-pass LoRA dropout keys) and one micro-batch's loss terms
  (``micro_terms``; the router strategy ``RouterLosses`` / ``NO_ROUTER`` built once from the model);
- ``jaxgrpo.step.update``: steps 2-4 (``token_scale``, ``accumulate_grads``, ``apply_update``, ``update``,
  ``train_epochs``).

MoE routing replay (a row field), LoRA dropout keys (per-pass row fields) and packing (the packed slots split
like the rows) reach them as inputs, not as branches of the step. This module composes them (``_step_fn``),
jits the composition (:class:`TrainStep`, :func:`make_train_step`) and compiles the reference pass on the same
mesh (:func:`make_reference_fn`).

One job at ~700 lines: composing the pieces above into one jitted step and its reference pass (the checks
that run before the jitted call included); every piece it composes is in its own module.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxgrpo.kernels.config import GRPOConfig, GRPOHyper
from jaxgrpo.kernels.losses import LossTerms
from jaxgrpo.kernels.objective import objective_terms, rollout_advantages
from jaxgrpo.models import moe
from jaxgrpo.models.log_probs import check_temperature, completion_log_probs, packed_log_probs
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step.batch import (
  FIELDS,
  REFERENCE_FIELDS,
  Batch,
  abstract_batch,
  check_fields,
  check_policy_mask,
  check_routing,
  host_values,
  place_fields,
  place_packed,
  place_routing,
)
from jaxgrpo.step.batch_packing import (
  DEFAULT_BUCKETS,
  batch_slots,
  bucket_length,
  check_packing,
  pack_batch,
  pad_to_bucket,
)
from jaxgrpo.step.hooks import (
  advantages_keywords,
  check_denominator,
  check_keywords,
  check_unread,
  objective_keywords,
  reads_behavior,
  schedule_terms,
)
from jaxgrpo.step.state import (
  TrainConfig,
  TrainState,
  check_not_donated,
  checked_rules,
  graph_rules,
  init_train_state,
  merge_model,
)
from jaxgrpo.step.terms import (
  StepSpec,
  contiguous_split,
  distill_of,
  group_bound,
  merge_rows,
  micro_log_probs,
  micro_terms,
  num_iterations_of,
  pass_fields,
  prepare_rows,
  router_losses,
  slot_inputs,
  split_micro,
  split_slots,
  step_hyper,
)
from jaxgrpo.step.update import reduce_updates, train_epochs

__all__ = [
  "DEFAULT_BUCKETS",
  "Batch",
  "TrainConfig",
  "TrainState",
  "TrainStep",
  "batch_slots",
  "bucket_length",
  "check_context_length",
  "completion_log_probs",
  "init_train_state",
  "make_reference_fn",
  "make_train_step",
  "pack_batch",
  "pad_to_bucket",
]


def _step_fn(spec: StepSpec, state: TrainState, frozen, batch: Batch, hyper, dropout_key=None):
  """One train step, traced: ``(TrainState without frozen, metrics)`` from the state, the frozen variables,
  the placed batch, the call's hyper-parameter pytree (or None) and the run's dropout key (or None) — the
  hyper-parameters applied (:func:`~jaxgrpo.step.terms.step_hyper`), the rows
  (:func:`~jaxgrpo.step.terms.prepare_rows`), μ passes of M updates (:func:`~jaxgrpo.step.update.train_epochs`),
  the metrics reduced over the updates."""
  hyper = step_hyper(spec, state.step, hyper)
  prepared = prepare_rows(spec, batch, hyper)  # once per rollout batch: rows [M, K, R, ...]
  check_denominator(spec.objective_fn, spec.config, prepared.example, hyper)
  terms = functools.partial(micro_terms, spec, frozen, hyper)  # (params, mb, scale) -> (scale·numerator, aux)
  shapes = jax.eval_shape(lambda p, mb: terms(p, mb, 1.0)[1], state.params, prepared.example)
  passes = num_iterations_of(spec.config)
  per_pass = pass_fields(dropout_key, state.step, passes, batch.completions.shape[0])  # dropout keys, or {}
  grad_fn = jax.grad(terms, has_aux=True)
  carry = (state.params, state.opt_state)
  (params, opt_state), metrics = train_epochs(spec, grad_fn, shapes, *carry, prepared.rows, per_pass, passes)
  metrics = reduce_updates(metrics)
  metrics.update(prepared.extra)
  return TrainState(params, opt_state, state.step + 1), metrics  # frozen: reattached by TrainStep


def _check_distill_batch(config, batch: Batch) -> None:
  """ValueError in one line when a config's distillation term (``GRPOConfig.distill``) cannot be computed for
  ``batch``: the sampled-token form needs ``batch.teacher_logp``; precomputed ``batch.advantages`` already hold
  whatever the caller mixed in; the top-k forms are not in the step."""
  d = distill_of(config)
  if d is None:
    return
  if not d.sampled:
    _check_topk_batch(config, d, batch)
    return
  if batch.teacher_logp is None:
    raise ValueError(
      "the config has a distillation term (distill) but batch.teacher_logp is None: fill it with the teacher's "
      "log-probs f32[B, T] (jaxgrpo.step.feed.make_teacher(step, teacher_model)(batch))"
    )
  if batch.advantages is not None:
    raise ValueError(
      "batch.advantages is given with a distillation term (distill) in the config: the step adds w·A_distill to "
      "the advantages it computes; pass rewards (or rewards=None for distillation alone), not advantages"
    )


def _check_topk_batch(config, d, batch: Batch) -> None:
  """A top-k distillation form: the teacher's ids and log-probs ``[B, T, k]`` of one k (the
  term is aggregated like the policy term, ``jaxgrpo.step.terms``), packed or not."""
  ids, logp = batch.teacher_topk_ids, batch.teacher_topk_logp
  if ids is None or logp is None:
    raise ValueError(
      f"distill.kind={d.kind!r} needs batch.teacher_topk_ids int32[B, T, k] and batch.teacher_topk_logp "
      "f32[B, T, k]: fill them with the teacher's top-k pass (jaxgrpo.step.feed.make_teacher(step, teacher)(batch))"
    )
  if np.shape(ids) != np.shape(logp):
    raise ValueError(
      f"batch.teacher_topk_ids {np.shape(ids)} and batch.teacher_topk_logp {np.shape(logp)} must have one shape [B, T, k]"
    )


def _options(tc: TrainConfig):
  return None if tc.compiler_options is None else dict(tc.compiler_options)


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

  def __init__(self, spec: StepSpec, mesh: Mesh, shardings: TrainState, rules):
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
    # the dropout key is an argument, not a constant: runs that differ only in their seed share one program.
    # Placed at the first call (lower places nothing: the mesh may be compile-only)
    self._dropout_key = None
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
    ``batch.rewards`` may be None when ``batch.advantages`` is given. A ``batch.temperature`` (the rollout's)
    must match ``train_config.temperature`` (:func:`~jaxgrpo.models.log_probs.check_temperature`)."""
    c, tc = self.config, self.train_config
    b, t = check_fields(batch, FIELDS, rewards_optional=distill_of(c) is not None)
    _check_batch_temperature(batch, tc)
    _check_distill_batch(c, batch)
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
    check_context_length(batch, tc, self.mesh)
    check_policy_mask(batch)
    check_routing(batch, b, t)
    check_packing(batch, tc, shd.batch_shards(self.mesh, self.rules), tc.mini_batches * tc.micro_batches)
    g, num_groups = group_bound(tc.group_size, b)
    ids = host_values(batch.group_ids)
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
    check_fields(batch, FIELDS, rewards_optional=distill_of(self.config) is not None)  # before the packer reads it
    return pack_batch(
      batch,
      row_length=tc.packing,
      shards=shd.batch_shards(self.mesh, self.rules),
      mini_batches=tc.mini_batches,
      micro_batches=tc.micro_batches,
      rows=tc.packing_rows,
      sharing=tc.prefix_sharing,
    )

  def _prepare_batch(self, batch: Batch) -> Batch:
    """``batch`` packed (:meth:`pack`) and validated (:meth:`check_batch`), without the fields this step never
    reads (one compiled program whether they are given or not)."""
    _check_batch_temperature(batch, self.train_config)  # before packing: one line, nothing computed
    batch = self.pack(batch)
    self.check_batch(batch)
    batch = batch._replace(temperature=None)  # checked: one compiled program whatever the batch carries
    if self.dropout_key is None and batch.packed is not None and batch.packed.row_in_slot is not None:
      batch = batch._replace(packed=batch.packed._replace(row_in_slot=None))  # no dropout keys to take from rows
    if not self.reads_ref_logp and batch.ref_logp is not None:
      batch = batch._replace(ref_logp=None)  # not used: keep one compiled program
    if not reads_behavior(self.config) and batch.behavior_logp is not None:
      batch = batch._replace(behavior_logp=None)  # not read by this config: one compiled program
    d = distill_of(self.config)  # the teacher's fields the config does not read: one compiled program
    if d is None or d.sampled:
      batch = batch._replace(teacher_topk_ids=None, teacher_topk_logp=None)
    if d is None:
      batch = batch._replace(teacher_logp=None)
    return batch

  def place_batch(self, batch: Batch) -> Batch:
    """``batch`` packed (:meth:`pack`), validated (:meth:`check_batch`) and placed on the mesh with the
    step's dtypes; what each call does before the jitted step (a no-op for a batch this returned)."""
    batch = self._prepare_batch(batch)
    placed = place_packed(place_fields(batch, FIELDS, self.batch_sharding), self.batch_sharding)
    return place_routing(placed, self.batch_sharding)

  def check_hyper(self, hyper):
    """``hyper`` as the step takes it: every leaf an array (``f32[]`` for a :class:`GRPOHyper`,
    checked against the config by :meth:`GRPOConfig.check_hyper` when concrete); None stays None."""
    if hyper is None:
      return None
    if self.hyper_schedule is None:  # the hooks get hyper= from this call on
      check_keywords(self.objective_fn, "objective_fn", {"hyper": "a hyper-parameter pytree was passed"})
      check_keywords(self.advantages_fn, "advantages_fn", {"hyper": "a hyper-parameter pytree was passed"})
    if isinstance(self.config, GRPOConfig):
      if not isinstance(hyper, GRPOHyper):
        raise TypeError(f"hyper must be a jaxgrpo.GRPOHyper (config.hyper(...)) or None; got {type(hyper).__name__}")
      # every number traced (one program for every value), whether given as an array or a Python float
      arrays = {n: jnp.asarray(v, jnp.float32) for n, v in hyper.numbers().items() if v is not None}
      hyper = self.config.check_hyper(hyper._replace(**arrays))
      check_unread(self.config, hyper)
      return hyper
    return jax.tree.map(jnp.asarray, hyper)

  def _args(self, state: TrainState, batch: Batch, hyper=None):
    if not isinstance(state, TrainState):
      raise TypeError(f"state must be a jaxgrpo.step.train.TrainState; got {type(state).__name__}")
    check_not_donated(state, "state")
    hyper = self.check_hyper(hyper)
    replicated = NamedSharding(self.mesh, PartitionSpec())
    if hyper is not None:  # replicated over the mesh, as the jitted step takes it (every process: the same values)
      hyper = jax.device_put(hyper, replicated)
    if self._dropout_key is None and self.dropout_key is not None:
      self._dropout_key = jax.device_put(self.dropout_key, replicated)
    return state._replace(frozen=None), state.frozen, self.place_batch(batch), hyper, self._dropout_key

  def __call__(self, state: TrainState, batch: Batch, hyper=None):
    """One step; ``hyper``: optional hyper-parameter pytree (see the class docstring)."""
    args = self._args(state, batch, hyper)
    with jax.set_mesh(self.mesh):  # the models' activation constraints apply while this mesh is set
      new, metrics = self.jitted(*args)
    return new._replace(frozen=state.frozen), metrics

  def lower(self, state: TrainState, batch: Batch, hyper=None) -> jax.stages.Lowered:
    """The program a call ``self(state, batch, hyper)`` runs, lowered (not compiled, not run; nothing placed or
    transferred): ``.compile()`` then ``.memory_analysis()`` / ``.as_text()`` describe it.

    ``state``: a :class:`TrainState` of arrays, or of ``jax.ShapeDtypeStruct`` s with shardings
    (``init_train_state(..., abstract=True)``). ``batch``: a :class:`Batch` of NumPy arrays, placed arrays or
    ``jax.ShapeDtypeStruct`` s (only shapes and dtypes are read, checked as a call checks them; the value checks
    need values: group ids, a packed layout's index map). Packing (``TrainConfig.packing``) packs on the host:
    give NumPy fields, or an abstract batch that already carries ``packed``. ``hyper``: as for a call (concrete
    values or None). The batch, ``hyper`` and the dropout key enter as ``ShapeDtypeStruct`` s with the step's
    dtypes and shardings, so this works on any mesh, compile-only devices included
    (``jax.experimental.topologies``), and lowers the same program as a call."""
    if not isinstance(state, TrainState):
      raise TypeError(f"state must be a jaxgrpo.step.train.TrainState; got {type(state).__name__}")
    check_not_donated(state, "state")
    replicated = NamedSharding(self.mesh, PartitionSpec())
    as_struct = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=replicated)
    hyper = jax.tree.map(as_struct, self.check_hyper(hyper))
    key = None if self.dropout_key is None else as_struct(self.dropout_key)
    batch = abstract_batch(self._prepare_batch(batch), FIELDS, self.batch_sharding)
    with jax.set_mesh(self.mesh):
      return self.jitted.lower(state._replace(frozen=None), state.frozen, batch, hyper, key)


def check_context_length(batch: Batch, tc: TrainConfig, mesh: Mesh) -> None:
  """ValueError (one line, before anything is compiled) unless the rows the model reads — ``[prompt ‖ completion]``
  of ``P + T`` positions, or the packed rows of ``train_config.packing`` — split evenly over the mesh's ``context``
  axis (context parallelism); the message says how much to pad (a no-op without the axis)."""
  if shd.context_size(mesh) < 2:
    return
  if tc.packing is not None:
    shd.check_sequence_divisible(tc.packing, mesh, "TrainConfig.packing (the packed row)")
  else:
    p, t = np.shape(batch.prompt_tokens)[1], np.shape(batch.completions)[1]
    shd.check_sequence_divisible(p + t, mesh, f"the [prompt ‖ completion] row ({p} + {t})")


def _check_batch_temperature(batch: Batch, tc: TrainConfig) -> None:
  check_temperature(
    batch.temperature,
    tc.temperature,
    "the batch (batch.temperature, from its Rollout)",
    f"sample at the step's temperature (jaxgrpo.sample(..., temperature=step.train_config.temperature), as "
    f"grpo_iteration does), or build the step with TrainConfig(temperature={float(batch.temperature or 1.0)!r})",
  )


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
  With ``importance_correction``: ``is_policy_loss``, ``is_weight_mean``, ``is_ratio_mean``, ``is_ratio_max``,
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
      config, _ = schedule_terms(config, hyper_schedule)
  check_keywords(objective_fn, "objective_fn", objective_keywords(config, objective_fn, hyper_schedule is not None))
  if advantages_fn is not rollout_advantages:
    check_keywords(advantages_fn, "advantages_fn", advantages_keywords(hyper_schedule is not None))
  train_config = TrainConfig() if train_config is None else train_config
  if not isinstance(train_config, TrainConfig):
    raise TypeError(f"train_config must be a jaxgrpo.step.train.TrainConfig; got {type(train_config).__name__}")
  abstract = merge_model(graphdef, shardings.params, shardings.frozen)  # static attributes only
  rules = checked_rules(abstract.sharding_rules, rules, "make_train_step")
  rows_sh = NamedSharding(mesh, PartitionSpec(None, None, *shd.batch_sharding(mesh, rules).spec))
  spec = StepSpec(
    graphdef,
    optimizer,
    config,
    train_config,
    objective_fn,
    advantages_fn,
    shardings.params,
    rows_sh,
    blocks=shd.batch_shards(mesh, rules),
    dropout_key=_check_run_key(dropout_key),
    hyper_schedule=hyper_schedule,
    router=router_losses(abstract, train_config),  # a mixture of experts' router losses, or none
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


def _packed_top_k(model, mb: dict, tc: TrainConfig, blocks: int, top_k: int):
  """One packed slot's teacher pass: ``(logp f32[R, T], ids int32[R, T, k], topk_logp f32[R, T, k])``."""
  args = (mb["tokens"], mb["positions"], mb["segment_ids"], mb["head_index"], mb["unpack_index"])
  kw = dict(temperature=tc.temperature, chunk_size=tc.chunk_size)
  logp, _, (ids, topk_logp) = packed_log_probs(model, *args, blocks=blocks, kv_end=mb.get("kv_end"), top_k=top_k, **kw)
  return logp, ids, topk_logp


def make_reference_fn(
  graphdef,
  *,
  mesh: Mesh,
  param_shardings,
  train_config: TrainConfig | None = None,
  rules: Mapping[str, Any] | None = None,
  top_k: int | None = None,
) -> Callable:
  """Jitted ``(ref_params, batch) -> ref_logp f32[B, T]`` (batch-sharded) under the same mesh; its ``.lower(ref_params,
  batch)`` lowers the program ahead of time from arrays or ``jax.ShapeDtypeStruct`` s (as :meth:`TrainStep.lower`).

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

  ``top_k``: k, a distillation teacher's pass: it returns ``(logp f32[B, T], ids int32[B, T, k], topk_logp
  f32[B, T, k])``, the k most likely ids at each position and their log-probs, computed chunk by chunk on the
  devices that hold the parameters (only the top-k leave the pass; ``jaxgrpo.models.log_probs.chunked_top_k``).
  With packing, from the packed forward's head rows (``jaxgrpo.models.log_probs.packed_log_probs``).
  """
  tc = TrainConfig() if train_config is None else train_config
  rules = checked_rules(graph_rules(graphdef, param_shardings), rules, "make_reference_fn")
  bsh = shd.batch_sharding(mesh, rules)
  rows_sh = NamedSharding(mesh, PartitionSpec(None, None, *bsh.spec))
  blocks = shd.batch_shards(mesh, rules)
  k = tc.micro_batches
  slots = tc.mini_batches * tc.micro_batches  # per device shard, when packed

  def fn(params, cols):
    model = nnx.merge(graphdef, params)
    shape = cols[2].shape
    cols = [jax.lax.with_sharding_constraint(split_micro(x, 1, k), rows_sh)[0] for x in cols]  # [K, R, ...]

    def one(mb):
      kw = dict(temperature=tc.temperature, chunk_size=tc.chunk_size)
      with moe.routing_scope(replay=mb[4] if len(mb) > 4 else None):  # MoE: the rollout's experts if given
        if top_k is None:
          return completion_log_probs(model, *mb[:4], **kw)[0]
        logp, _, (ids, topk_logp) = completion_log_probs(model, *mb[:4], top_k=top_k, **kw)
        return logp, ids, topk_logp

    out = jax.lax.map(one, tuple(cols))  # [K, R, T, ...]
    return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1).reshape(shape + x.shape[3:]), out)  # inverse of split_micro

  def to_slots(x):  # [B, ...] -> [M·K, B/(M·K), ...]: the rows of slot j of every device shard, as the step splits
    if not contiguous_split(tc):
      return jax.lax.with_sharding_constraint(split_micro(x, 1, slots), rows_sh)[0]
    x = split_micro(x, tc.mini_batches, k, blocks=blocks, contiguous=True)
    return jax.lax.with_sharding_constraint(x.reshape((1, slots) + x.shape[2:]), rows_sh)[0]

  def from_slots(x):  # the inverse of to_slots
    if not contiguous_split(tc):
      return merge_rows(x[None], 1, slots)
    return merge_rows(x.reshape((tc.mini_batches, k) + x.shape[1:]), tc.mini_batches, k, blocks=blocks, contiguous=True)

  def fn_packed(params, unpack_index, packed_rows):
    model = nnx.merge(graphdef, params)
    mbs = {"unpack_index": to_slots(unpack_index)}
    for name, x in packed_rows.items():  # [M·K, blocks·X, ...]: slot j of every device shard
      mbs[name] = jax.lax.with_sharding_constraint(split_slots(x, blocks, 1, slots), rows_sh)[0]
    if top_k is None:

      def one(mb):
        with moe.routing_scope(replay=mb.get("routing")):  # MoE: the rollout's experts, packed, if given
          return micro_log_probs(model, mb, tc, blocks, False)[0]

      return from_slots(jax.lax.map(one, mbs))  # [M·K, R, T] -> [B, T]
    teach = lambda mb: _packed_top_k(model, mb, tc, blocks, top_k)
    return jax.tree.map(from_slots, jax.lax.map(teach, mbs))  # [B, T, ...] each

  options = _options(tc)
  jitted = jax.jit(fn, in_shardings=(param_shardings, bsh), out_shardings=bsh, compiler_options=options)
  jitted_packed = jax.jit(
    fn_packed, in_shardings=(param_shardings, bsh, bsh), out_shardings=bsh, compiler_options=options
  )

  def prepare(ref_params, batch: Batch) -> Batch:
    b, _ = check_fields(batch, REFERENCE_FIELDS)
    _check_batch_temperature(batch, tc)
    check_not_donated(ref_params, "ref_params")
    shd.check_batch_divisible(b, mesh, rules, splits=slots if tc.packing else k)
    check_context_length(batch, tc, mesh)
    if tc.packing is not None and batch.packed is None:
      batch = pack_batch(
        batch,
        row_length=tc.packing,
        shards=blocks,
        mini_batches=tc.mini_batches,
        micro_batches=k,
        rows=tc.packing_rows,
        sharing=tc.prefix_sharing,
      )
    check_packing(batch, tc, blocks, slots)
    check_routing(batch, b, np.shape(batch.completions)[1])
    if batch.packed is not None and batch.packed.row_in_slot is not None:  # no dropout here: one program
      batch = batch._replace(packed=batch.packed._replace(row_in_slot=None))
    return batch

  def program(placed: Batch):
    """(the jitted program, its arguments after the parameters) for a placed (or abstract) batch."""
    if placed.packed is not None:
      return jitted_packed, (placed.packed.unpack_index, slot_inputs(placed.packed))
    cols = tuple(getattr(placed, name) for name in REFERENCE_FIELDS)
    return jitted, (cols if placed.routing is None else cols + (placed.routing,),)

  def reference_log_probs(ref_params, batch: Batch):
    batch = prepare(ref_params, batch)
    fn, args = program(place_routing(place_packed(place_fields(batch, REFERENCE_FIELDS, bsh), bsh), bsh))
    with jax.set_mesh(mesh):  # the models' activation constraints apply while this mesh is set
      return fn(ref_params, *args)

  def lower(ref_params, batch: Batch) -> jax.stages.Lowered:
    """The program ``reference_log_probs(ref_params, batch)`` runs, lowered (nothing placed or run), for
    parameters and a batch of arrays or ``jax.ShapeDtypeStruct`` s (as :meth:`TrainStep.lower`)."""
    fn, args = program(abstract_batch(prepare(ref_params, batch), REFERENCE_FIELDS, bsh))
    with jax.set_mesh(mesh):
      return fn.lower(ref_params, *args)

  # the jitted programs (``.jitted.lower(params, columns)``), and ``.lower(ref_params, batch)`` for ahead-of-time
  # lowering (scripts/bench_compile.py, jaxgrpo.plan)
  reference_log_probs.jitted, reference_log_probs.jitted_packed = jitted, jitted_packed
  reference_log_probs.lower = lower
  return reference_log_probs
