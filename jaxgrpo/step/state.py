"""The train step's state and static configuration: :class:`TrainState` (trained parameters, optimizer
state, step; a LoRA run's frozen base beside them), :class:`TrainConfig` (how the step runs: micro- and
mini-batches, clipping, temperature, chunking, packing, router losses) and :func:`init_train_state`
(split a model once, place its parameters and optimizer state on a mesh with one rules table).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxgrpo import _checks
from jaxgrpo.models.base import freeze_rules
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step.prefix_tree import SHARING

HEAD_LOGITS = ("recompute", "keep")  # TrainConfig.head_logits: how the head's logits reach the backward pass

__all__ = ["TrainConfig", "TrainState", "init_train_state"]


def check_not_donated(tree, what: str) -> None:
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


def merge_model(graphdef, params, frozen=None):
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
      (``jaxgrpo.loop.iteration.grpo_iteration`` and the trainer sample at it).
    chunk_size: positions per chunk of the float32 logits (None: unchunked). A chunk holds
      ``rows per micro-batch × chunk_size × V`` float32 logits: aim for a few thousand tokens (64 rows ×
      32 positions at V = 32000 is 262 MB; larger chunks were slower, BENCHMARKS.md "Peers", run C).
    head_logits: ``"recompute"`` (default) or ``"keep"``: how the LM head's float32 logits reach the backward
      pass of the loss. ``recompute`` keeps one logsumexp per position and recomputes each chunk's logits (one
      head matmul more: a quarter of the head's work in the step); ``keep`` holds every chunk's logits of a
      micro-batch until its backward pass, ``rows per micro-batch × completion positions × V × 4`` bytes more,
      and skips that matmul. Same values and gradients. ``keep`` pays where the step is bound by arithmetic and
      that memory is free (a CPU; small vocabularies); at users' sizes on accelerators the logits do not fit.
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
    prefix_sharing: ``"none"`` (default), ``"prompt"`` or ``"tree"`` (needs ``packing``): the packed rows hold
      each micro-batch's sequences as prefix trees (``jaxgrpo.step.prefix_tree``), so a prompt shared by the
      sequences of a slot (``"prompt"``), or any common prefix, completions included (``"tree"``), is computed
      once in the step, the reference pass and the π_old recomputation; values and gradients are the
      row-wise step's. With sharing the micro-batches take consecutive rows of their mini-batch (the same
      mini-batches; ``jaxgrpo.step.terms.split_micro(contiguous=True)``), so a group's rows share one tree.
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
  head_logits: str = "recompute"
  group_size: int | None = None
  tree_stats: bool = False
  entropy: bool = True
  compiler_options: Mapping[str, Any] | None = None
  packing: int | None = None
  packing_rows: int | None = None
  prefix_sharing: str = "none"
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
    c.check_choice(self.prefix_sharing, SHARING, "prefix_sharing")
    c.check_choice(self.head_logits, HEAD_LOGITS, "head_logits")
    if self.packing is None and self.prefix_sharing != "none":
      raise ValueError(
        f"`prefix_sharing`={self.prefix_sharing!r} needs `packing` (the row length L: the trees are packed rows); "
        "set packing, e.g. to the longest prompt + max_new_tokens"
      )
    if self.packing is None and self.packing_rows is not None:
      raise ValueError(f"`packing_rows`={self.packing_rows} needs `packing` (the row length L)")


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


def checked_rules(model_rules: tuple, rules: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
  """The one rules table of a model: its own (``model.sharding_rules``, which its activation
  constraints use) when ``rules`` is None, else ``rules``, which must be the same table."""
  if rules is not None and freeze_rules(rules) != model_rules:
    raise ValueError(
      f"{where}: `rules` differ from the model's own rules table (model.rules = {dict(model_rules)}, which its "
      f"activation constraints use); got {dict(rules)}. Build the model with these rules "
      "(build_model/load_hf(..., rules=...)) or leave `rules` unset"
    )
  return dict(model_rules)


def graph_rules(graphdef, param_shardings, frozen_shardings=None) -> tuple:
  """``model.sharding_rules`` of the model ``graphdef`` describes (merged with the parameter and frozen
  shardings: only the static attributes are read)."""
  return merge_model(graphdef, param_shardings, frozen_shardings).sharding_rules


def _check_can_hold_arrays(mesh: Mesh) -> None:
  """ValueError in one line when ``mesh``'s devices belong to no backend of this process (compile-only devices of
  ``jax.experimental.topologies``, e.g. a TPU slice described on a CPU host): they cannot hold the state."""
  device = mesh.devices.flat[0]
  try:
    local = device in jax.devices(device.platform)
  except RuntimeError:  # no such backend in this process
    local = False
  if not local:
    raise ValueError(
      f"init_train_state: the mesh's devices ({device.device_kind}, platform {device.platform!r}) are not devices of "
      "this process (compile-only, e.g. from jax.experimental.topologies) and cannot hold arrays; pass "
      "abstract=True to describe the state and compile the step ahead of time (TrainStep.lower)"
    )


def init_train_state(
  model,
  optimizer: optax.GradientTransformation,
  mesh: Mesh,
  rules: Mapping[str, Any] | None = None,
  *,
  trainable=nnx.Param,
  abstract: bool = False,
):
  """Split ``model`` once into trained and frozen variables; place both and a fresh optimizer state
  (of the trained variables only) on ``mesh`` — or, with ``abstract=True``, only describe them.

  Args:
    model: a ``jaxgrpo.models`` model (or any NNX module holding only ``nnx.Param`` s).
    optimizer: the optax transformation; its state is built for the trained variables only.
    mesh, rules: the mesh and the logical-axis rules (default ``jaxgrpo.parallel.sharding.DEFAULT_RULES``).
    trainable: an NNX filter of the trained variables: ``nnx.Param`` (default: every parameter, full
      fine-tuning) or ``nnx.LoRAParam`` (the adapters of ``jaxgrpo.models.lora``; LoRA/QLoRA: the
      base weights are frozen, gradients and Adam moments exist for the adapters only). Any
      ``nnx.filterlib`` filter works; it must select floating-point arrays only (quantised codes are
      refused, naming them).
    abstract: False (default): the state's arrays are placed on ``mesh``. True: nothing is allocated, placed or
      compiled; the state holds ``jax.ShapeDtypeStruct`` s with the same shapes, dtypes and shardings (the
      parameters in their ``nnx.Variable`` s, as ``jaxgrpo.parallel.sharding.abstract_tree`` gives them), for
      :meth:`TrainStep.lower <jaxgrpo.step.train.TrainStep.lower>` and ``.compile().memory_analysis()`` ahead of
      time — on any mesh, compile-only devices included (``jax.experimental.topologies``: a TPU slice described
      on a CPU host). ``model`` may then be abstract itself (``nnx.eval_shape(lambda: build_model(...))``: no
      parameter ever materialised on the host).

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
  abstract = _checks.check_python_bool(abstract, "abstract")
  rules = checked_rules(model.sharding_rules, rules, "init_train_state")
  graphdef, params, frozen = nnx.split(model, trainable, ...)
  _check_params_only(nnx.state(model))
  _check_trainable(params, trainable)
  param_sh = shd.tree_shardings(params, mesh, rules)
  frozen_sh = shd.tree_shardings(frozen, mesh, rules)
  opt_abstract = jax.eval_shape(optimizer.init, params)
  opt_sh = shd.tree_shardings(opt_abstract, mesh, rules)
  replicated = NamedSharding(mesh, PartitionSpec())
  shardings = TrainState(param_sh, opt_sh, replicated, frozen_sh)
  if not abstract:
    _check_can_hold_arrays(mesh)
  if abstract:
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    state = TrainState(shd.abstract_tree(params, param_sh), shd.abstract_tree(opt_abstract, opt_sh), step)
    return graphdef, state._replace(frozen=shd.abstract_tree(frozen, frozen_sh)), shardings
  params = jax.device_put(params, param_sh)
  # the step donates its state: copy, so that the model's own arrays are never donated
  params = jax.jit(_copy_tree, out_shardings=param_sh)(params)
  frozen = jax.device_put(frozen, frozen_sh)  # a no-op for arrays already placed so
  opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
  return graphdef, TrainState(params, opt_state, step, frozen), shardings
