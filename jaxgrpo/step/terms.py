"""What one call of the train step computes before its updates, and what one micro-batch contributes.

The pieces ``jaxgrpo.step.train._step_fn`` composes, each a plain function of its inputs (no closure over
the step):

- :func:`step_hyper`: the hyper-parameter pytree of this call (given, from the schedule, or None);
- :func:`prepare_rows`: once per rollout batch, the loss rows — advantages, token weights, masks with the
  missing samples dropped, the extra metrics — split into ``[M, K, R, ...]`` (mini-batch, micro-batch, rows);
  packing enters here, as the batch's ``packed`` slots split the same way;
- :func:`pass_fields`: the row fields that change with the pass over the batch (LoRA dropout keys ``key[μ, B]``
  or nothing);
- :func:`micro_terms`: one micro-batch's forward and loss terms, ``(scale·numerator, (LossTerms, entropy sum,
  routing sums))``; the rows carry the MoE routing to replay and the dropout keys, and a
  :class:`RouterLosses` / :data:`NO_ROUTER` strategy built once from the model adds the router losses.

The optimizer side (accumulation over micro-batches, the update, the passes) is ``jaxgrpo.step.update``, the
hooks' contract and the hyper-parameter pytree ``jaxgrpo.step.hooks``; ``jaxgrpo.step.train`` composes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from jaxgrpo.kernels import distill
from jaxgrpo.kernels.config import GRPOConfig, GRPOHyper
from jaxgrpo.kernels.losses import LossTerms, aggregate
from jaxgrpo.kernels.objective import rollout_advantages
from jaxgrpo.kernels.process_sets import process_set_sizes, process_tree_stats
from jaxgrpo.models import lora, moe
from jaxgrpo.models.log_probs import completion_log_probs, packed_log_probs
from jaxgrpo.step.batch import Batch
from jaxgrpo.step.hooks import check_advantages_out, needs_entropy, objective_extras, structural_zeros
from jaxgrpo.step.packing import PackedSlots
from jaxgrpo.step.state import TrainConfig, merge_model

__all__ = [
  "NO_ROUTER",
  "distill_of",
  "RouterLosses",
  "Rows",
  "loss_rows",
  "micro_terms",
  "pass_fields",
  "prepare_rows",
  "router_losses",
  "split_rows",
  "step_hyper",
]


# ----------------------------------------------------------------------------- row layout


def split_micro(x, m: int, k: int, *, blocks: int = 1, contiguous: bool = False):
  """``[B, ...] -> [M, K, B/(M·K), ...]``: the step's mini/micro-batch split.

  Default (interleaved): row ``i·(M·K) + m·K + k`` at ``[m, k, i]``.

  ``contiguous`` (prefix sharing, :func:`contiguous_split`): the same mini-batches, and within each device shard
  (``blocks`` shards of ``n = B/blocks`` consecutive rows) each micro-batch one run of ``R = n/(M·K)`` consecutive
  rows of its mini-batch. With ``c = i·(M·K) + m·K + k`` a row's index in its shard d, its mini-batch is m as
  before, its rank in the mini-batch's rows of the shard is ``r = i·K + k``, and it sits at
  ``[m, r // R, d·R + r mod R]``. A group of consecutive rows thereby stays in one micro-batch of each
  mini-batch (``jaxgrpo.step.batch_packing.batch_slots``, ``docs/prefix_sharing.md``)."""
  if x is None:
    return None
  b = x.shape[0]
  if not contiguous:
    x = x.reshape((b // (m * k), m, k) + x.shape[1:])
    return jnp.moveaxis(x, 0, 2)
  r, rest = b // (blocks * m * k), x.shape[1:]
  x = jnp.moveaxis(x.reshape((blocks, r, m, k) + rest), 2, 0)  # [M, D, R, K, ...]: c = i·(M·K) + m·K + k
  x = x.reshape((m, blocks, k, r) + rest)  # the rank i·K + k in the mini-batch = k'·R + i'
  return jnp.moveaxis(x, 1, 2).reshape((m, k, blocks * r) + rest)


def contiguous_split(tc: TrainConfig) -> bool:
  """Whether the step of ``tc`` splits its rows contiguously (:func:`split_micro`): with prefix sharing, so that a
  group's rows share one tree per mini-batch; the interleaved split otherwise (the default programs)."""
  return tc.prefix_sharing != "none"


def split_slots(x, n: int, m: int, k: int):
  """Packed slot arrays ``[n·M·K·X, ...]`` (slot ``d·(M·K) + m·K + k`` = device shard d, mini-batch m,
  micro-batch k; X rows or one head buffer per slot) -> ``[M, K, n·X, ...]``, shard d's X at
  ``[m, k, d·X : (d+1)·X]``: the layout of :func:`split_micro`' ``[M, K, B/(M·K), ...]``."""
  x = x.reshape((n, m, k, x.shape[0] // (n * m * k)) + x.shape[1:])
  x = jnp.moveaxis(x, 0, 2)  # [M, K, n, X, ...]
  return x.reshape(x.shape[:2] + (n * x.shape[3],) + x.shape[4:])


def merge_rows(x, m: int, k: int, *, blocks: int = 1, contiguous: bool = False):
  """Inverse of :func:`split_micro` (with the same ``blocks`` and ``contiguous``): ``[M, K, B/(M·K), ...] -> [B,
  ...]``."""
  if not contiguous:
    x = jnp.moveaxis(x, 2, 0)
    return x.reshape((x.shape[0] * m * k,) + x.shape[3:])
  r, rest = x.shape[2] // blocks, x.shape[3:]
  x = jnp.moveaxis(x.reshape((m, k, blocks, r) + rest), 2, 1)  # [M, D, K', R', ...]
  x = jnp.moveaxis(x.reshape((m, blocks, r, k) + rest), 0, 2)  # [D, R, M, K, ...]
  return x.reshape((blocks * r * m * k,) + rest)


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


def slot_inputs(packed: PackedSlots) -> dict:
  """The packed rows and head buffers (split by slot, :func:`split_slots`); prefix-shared rows add ``kv_end``, a
  mixture of experts' routing replay the packed ``routing``."""
  inputs = dict(
    tokens=packed.tokens, positions=packed.positions, segment_ids=packed.segment_ids, head_index=packed.head_index
  )
  if packed.kv_end is not None:  # TrainConfig.prefix_sharing: the trees' mask
    inputs["kv_end"] = packed.kv_end
  if packed.routing is not None:  # routing replay: the sampler's experts at each packed column [R, L, M, k]
    inputs["routing"] = packed.routing
  if packed.row_in_slot is not None:  # LoRA dropout: each column's sequence row (its dropout key)
    inputs["row_in_slot"] = packed.row_in_slot
  return inputs


def micro_log_probs(
  model, mb: dict, tc: "TrainConfig", blocks: int, with_entropy: bool, entropy_grad: bool = False, topk_ids=None
):
  """``(logp f32[R, T], entropy or None)`` of one micro-batch's R rows: from ``[prompt ‖ completion]``
  rows, or from their packed rows (``blocks`` device shards, each with its own sequences). The entropy
  has a gradient only with ``entropy_grad`` (an entropy bonus in the loss). ``topk_ids`` ``int[R, T, k]``
  (packed or not): a third entry, the log-probs at those ids ``f32[R, T, k]`` from the same forward."""
  kw = dict(temperature=tc.temperature, chunk_size=tc.chunk_size, with_entropy=with_entropy, entropy_grad=entropy_grad)
  kw["keep_logits"] = tc.head_logits == "keep"
  if topk_ids is not None:
    kw["topk_ids"] = topk_ids
  if "head_index" in mb:  # adapter dropout: each token's key from its sequence's row key and its position
    args = (mb["tokens"], mb["positions"], mb["segment_ids"], mb["head_index"], mb["unpack_index"])
    dropout = dict(dropout_key=mb.get("dropout_key"), row_in_slot=mb.get("row_in_slot"))
    return packed_log_probs(model, *args, blocks=blocks, kv_end=mb.get("kv_end"), **dropout, **kw)
  args = (mb["prompt_tokens"], mb["prompt_mask"], mb["completions"], mb["mask"])
  return completion_log_probs(model, *args, dropout_key=mb.get("dropout_key"), **kw)


# ----------------------------------------------------------------------------- the step's static description


def num_iterations_of(config) -> int:
  """μ: ``GRPOConfig.num_iterations``; 1 for any other config object."""
  return config.num_iterations if isinstance(config, GRPOConfig) else 1


def group_bound(group_size: int | None, b: int) -> tuple[int, int]:
  """``(largest group, number of groups)`` the step is compiled for: ``(B, B)`` without a group size."""
  g = b if group_size is None else min(group_size, b)
  return g, (b if group_size is None else -(-b // g))


class _NoRouter:
  """A dense model's router strategy: router loss 0 (the numerator's ``+ 0·denominator``, the program it always
  had) and no routing sums or metrics."""

  def terms(self, mb: dict, scope) -> tuple[jax.Array, dict]:
    return jnp.zeros((), jnp.float32), {}

  def metrics(self, routes: dict) -> dict:
    return {}

  def __repr__(self) -> str:
    return "NO_ROUTER"


#: The router strategy of a dense model (see :class:`RouterLosses`).
NO_ROUTER = _NoRouter()


@dataclasses.dataclass(frozen=True)
class RouterLosses:
  """A mixture of experts' router losses and routing metrics, built once from the model
  (:func:`router_losses`); a dense model gets :data:`NO_ROUTER` instead, so no step code asks which it is.

  Attributes:
    num_experts: E, the experts of each sparse layer.
    aux_coef, z_coef: ``TrainConfig.router_aux_loss`` / ``router_z_loss`` (c_aux, c_z; 0: that term off).
  """

  num_experts: int
  aux_coef: float
  z_coef: float

  def terms(self, mb: dict, scope) -> tuple[jax.Array, dict]:
    """One micro-batch's router terms from its forward's routes (``scope``, M sparse layers):
    ``(c_aux·aux + c_z·z f32[], routing sums)`` over the forward's real tokens (packed rows: the segment ids;
    else ``[prompt_mask ‖ mask]``); the sums (:func:`~jaxgrpo.models.moe.routing_sums` plus the token-weighted
    ``aux_loss``/``z_loss``) without gradient."""
    route = scope.stacked()  # [R, S, M, ...]
    if "head_index" in mb:
      real = mb["segment_ids"] > 0
    else:
      real = jnp.concatenate([mb["prompt_mask"], mb["mask"]], axis=1)
    num_experts = self.num_experts
    aux, z = moe.load_balancing_loss(route, real, num_experts), moe.router_z_loss(route, real)
    extra = self.aux_coef * aux + self.z_coef * z
    sums = moe.routing_sums(route, real, num_experts)
    sums.update(aux_loss=aux * sums["tokens"], z_loss=z * sums["tokens"])  # token-weighted, for the metrics
    return extra, jax.lax.stop_gradient(sums)

  def metrics(self, routes: dict) -> dict:
    """Per-layer expert load and router entropy of an update's summed routes (:func:`~jaxgrpo.models.moe.routing_metrics`)."""
    return moe.routing_metrics(routes)


def router_losses(model, tc: TrainConfig) -> RouterLosses | _NoRouter:
  """The router strategy of ``model`` (concrete or merged with its shardings: only static attributes are read):
  :class:`RouterLosses` for a mixture of experts with a sparse layer, :data:`NO_ROUTER` otherwise."""
  if not moe.is_moe(model):
    return NO_ROUTER
  return RouterLosses(model.config.num_experts, tc.router_aux_loss, tc.router_z_loss)


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """Everything static one compiled step is made of (built once by ``make_train_step``)."""

  graphdef: Any
  optimizer: optax.GradientTransformation
  config: Any
  tc: TrainConfig
  objective_fn: Callable
  advantages_fn: Callable
  param_sh: Any
  rows_sh: NamedSharding
  blocks: int = 1  # data × fsdp: the device shards of the batch rows (packing: one slot each)
  dropout_key: Any = None  # the run's typed PRNG key for adapter dropout, or None
  hyper_schedule: Callable | None = None  # step -> hyper-parameter pytree, or None
  router: Any = NO_ROUTER  # RouterLosses of a mixture of experts, or NO_ROUTER


# ----------------------------------------------------------------------------- once per rollout batch


def distill_of(config) -> distill.DistillConfig | None:
  """The distillation term of ``config`` (``GRPOConfig.distill``), or None (any other config, or none set)."""
  return config.distill if isinstance(config, GRPOConfig) else None


def _distill_advantages(d: distill.DistillConfig, batch: Batch, adv):
  """``A = a_RL + w·clip(teacher_logp − old_logp)`` on the policy's tokens (:func:`jaxgrpo.kernels.distill.combine_advantages`;
  ``adv`` None: the term alone), ``f32[B, T]``."""
  own = distill.reverse_kl_advantages(
    batch.old_logp, batch.teacher_logp, batch.mask, policy_mask=batch.policy_mask, clip=d.clip
  )
  return distill.combine_advantages(adv, own, d.weight)


def _distill_metrics(d: distill.DistillConfig, batch: Batch, loss_mask) -> dict:
  """``distill/weight`` (the w applied) and ``distill/reverse_kl``: the mean over the distilled tokens of
  ``old_logp − teacher_logp``, the sampled-token estimate of ``KL(π_s ‖ π_t)`` (every form: the top-k pass
  returns the sampled tokens' log-probs too). The top-k forms add ``distill/topk_divergence`` in the loss."""
  out = {"distill/weight": jnp.asarray(d.weight, jnp.float32)}
  if batch.teacher_logp is None:  # a top-k batch without the sampled tokens' log-probs
    return out
  diff = jnp.where(loss_mask, batch.old_logp.astype(jnp.float32) - batch.teacher_logp.astype(jnp.float32), 0.0)
  count = jnp.maximum(jnp.sum(loss_mask), 1).astype(jnp.float32)
  return {**out, "distill/reverse_kl": jnp.sum(diff) / count}


def _rollout_terms(spec: StepSpec, batch: Batch, num_groups: int, g: int, hyper):
  """Once per rollout batch: ``(advantages, token weights, process-set sizes or None)``; with a distillation
  term (:func:`distill_of`) its advantage is added (rewards None: the term alone)."""
  config = spec.config
  d = distill_of(config)
  if batch.policy_mask is not None and batch.ref_logp is not None:  # observations: δ = 0, f(1) = 0
    batch = batch._replace(ref_logp=jnp.where(batch.policy_mask, batch.ref_logp, batch.old_logp))
  if d is not None and batch.rewards is None:  # the distillation term alone (top-k: in the loss, advantage 0)
    adv = _distill_advantages(d, batch, None) if d.sampled else jnp.zeros(batch.completions.shape[:1], jnp.float32)
    return adv, batch.token_weights, None
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
  if d is not None and d.sampled:
    adv = _distill_advantages(d, batch, adv)
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


def _check_dropout(spec: StepSpec, model, mb: dict) -> None:
  """Trace-time: adapters with dropout > 0 need the step's ``dropout_key`` (no silent no-dropout) and, packed,
  each column's sequence row (``PackedSlots.row_in_slot``, which ``pack_slots`` fills) to draw its key from."""
  rate = lora.adapter_dropout(model)
  if rate > 0 and spec.dropout_key is None:
    raise ValueError(
      f"the model's LoRA adapters have dropout {rate} but make_train_step got no dropout_key: pass "
      "dropout_key=jax.random.key(seed) (or build the adapters with dropout=0)"
    )
  if rate > 0 and "head_index" in mb and "row_in_slot" not in mb:
    raise ValueError(
      f"the model's LoRA adapters have dropout {rate} and batch.packed has no row_in_slot (each column's "
      "sequence row, whose dropout key it takes): pack the batch with step.pack / pack_batch"
    )


def step_hyper(spec: StepSpec, step: jax.Array, hyper):
  """The hyper-parameter pytree this call applies: ``hyper`` as given (a call's own), else
  ``spec.hyper_schedule(step)`` traced on ``step`` (``int32[]``: one program for every step), else None; with
  a concrete 0 for every term the config leaves out (:func:`~jaxgrpo.step.hooks.structural_zeros`)."""
  if hyper is None and spec.hyper_schedule is not None:
    hyper = spec.hyper_schedule(step)  # traced: one program for every step
  return structural_zeros(spec.config, hyper)


def loss_rows(spec: StepSpec, batch: Batch, hyper) -> tuple[dict, dict]:
  """Once per rollout batch (no gradient): the per-row inputs of the loss and the batch's extra metrics.

  Returns ``(rows, extra)``. ``rows``: the model inputs of each row (``prompt_tokens i32[B, P]``,
  ``prompt_mask bool[B, P]``, ``completions i32[B, T]``, ``mask bool[B, T]`` and the MoE ``routing`` to replay
  ``[B, P + T, M, k]`` if the batch has it; a packed batch: ``unpack_index`` only) plus ``loss_mask bool[B, T]``
  (real tokens of rows with a finite reward, policy tokens only with a ``policy_mask``), ``adv f32[B]`` or
  ``f32[B, T]`` (``advantages_fn``'s or the batch's, 0 for missing samples) and ``old_logp``, ``weights``,
  ``ref_logp``, ``behavior_logp`` ``f32[B, T]`` (0 off ``loss_mask``) or None. ``extra``: ``rewards_nonfinite``,
  ``hyper/<field>`` (the values applied) and ``tree/<stat>`` (λ presets or ``tree_stats``), each ``f32[]``.
  """
  config = spec.config
  b, t = batch.completions.shape
  g, num_groups = group_bound(spec.tc.group_size, b)
  adv, weights, sizes = _rollout_terms(spec, batch, num_groups, g, hyper)
  check_advantages_out(adv, weights, b, t)
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
  if distill_of(config) is not None:
    extra.update(_distill_metrics(distill_of(config), batch, loss_mask))
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
  if distill_of(config) is not None and not distill_of(config).sampled:  # the teacher's top-k, per row
    rows.update(teacher_topk_ids=batch.teacher_topk_ids, teacher_topk_logp=batch.teacher_topk_logp)
  return rows, extra


def split_rows(spec: StepSpec, rows: dict, packed: PackedSlots | None) -> dict:
  """``rows`` ``[B, ...]`` -> ``[M, K, R, ...]`` (row ``i·(M·K) + m·K + k`` at ``[m, k, i]``, :func:`split_micro`),
  R over ``data × fsdp``: each device keeps its own rows. With packing, ``packed``'s slot arrays (``tokens``,
  ``positions``, ``segment_ids`` ``i32[n·M·K·X, L]``, ``head_index``) are added, split the same way: slot
  ``d·(M·K) + m·K + k`` (device shard d) at ``[m, k]`` (:func:`split_slots`)."""
  mm, kk = spec.tc.mini_batches, spec.tc.micro_batches
  split_kw = dict(blocks=spec.blocks, contiguous=contiguous_split(spec.tc))
  rows = jax.tree.map(
    lambda x: jax.lax.with_sharding_constraint(split_micro(x, mm, kk, **split_kw), spec.rows_sh), rows
  )
  if packed is not None:  # and its own packed rows: slot d·(M·K) + m·K + k
    split = lambda x: jax.lax.with_sharding_constraint(split_slots(x, spec.blocks, mm, kk), spec.rows_sh)
    rows.update(jax.tree.map(split, slot_inputs(packed)))
  return rows


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


def prepare_rows(spec: StepSpec, batch: Batch, hyper) -> Rows:
  """Once per rollout batch, no gradient: :func:`loss_rows` split into mini/micro-batches (:func:`split_rows`,
  ``row = i·(M·K) + m·K + k``, packed slots included), with one micro-batch as the example of shapes."""
  rows, extra = loss_rows(spec, batch, hyper)
  rows = split_rows(spec, rows, batch.packed)
  return Rows(rows, extra, jax.tree.map(lambda x: x[0, 0], rows))


def pass_fields(dropout_key, step: jax.Array, passes: int, b: int) -> dict:
  """The row fields that differ between the μ = ``passes`` passes over the batch, each ``[μ, B, ...]``: with
  adapter dropout (``dropout_key``, the step's run key) ``{"dropout_key": key[μ, B]}`` (:func:`_row_dropout_keys`),
  otherwise ``{}``. ``jaxgrpo.step.update.train_epochs`` scans over them and adds pass i's to the rows."""
  if dropout_key is None:
    return {}
  return {"dropout_key": _row_dropout_keys(dropout_key, step, passes, b)}


# ----------------------------------------------------------------------------- one micro-batch


def _add_topk_divergence(config, terms: LossTerms, student_topk, mb: dict) -> LossTerms:
  """``terms`` with ``w·N_agg(D)`` added to the numerator: ``D`` ``f32[R, T]`` the per-token top-k divergence
  over the micro-batch's loss tokens (``m = loss_mask``, ``n_i = Σ_t m``), aggregated like the policy term
  (:func:`jaxgrpo.kernels.losses.aggregate`, whose denominator the loss already holds):

  - ``token-mean``: ``N = Σ_{i,t} D`` (the loss gains ``w·Σ D / Σ m``);
  - ``seq-mean-token-mean``: ``N = Σ_{i: n_i>0} Σ_t D / n_i`` (the loss gains ``w·mean_i mean_t D``);
  - ``seq-mean-token-sum-norm``: ``N = Σ_{i,t} D`` (the loss gains ``w·Σ D / (B·max_tokens)``).

  The sum ``Σ D`` goes to ``sums["topk_divergence"]`` (the metric ``distill/topk_divergence``, a token mean
  whatever the aggregation)."""
  d = distill_of(config)
  div = distill.topk_divergence(student_topk, mb["teacher_topk_logp"], mb["loss_mask"], kind=d.kind, beta=d.beta)
  numerator, _ = aggregate(div, mb["loss_mask"].astype(jnp.float32), config.aggregation, config.max_tokens)
  sums = {**terms.sums, "topk_divergence": jnp.sum(div)}
  return terms._replace(numerator=terms.numerator + d.weight * numerator, sums=sums)


def micro_terms(spec: StepSpec, frozen, hyper, params, mb: dict, scale):
  """One micro-batch's loss terms, differentiable in ``params`` (``jax.grad(..., has_aux=True)``).

  Args:
    spec, frozen, hyper: the step (its graph, config, hooks, router strategy), the frozen variables, the
      hyper-parameter pytree or None.
    params: the trained variables (``nnx.State``).
    mb: one micro-batch of :func:`prepare_rows`' rows, ``[R, ...]`` each (plus ``dropout_key key[R]`` with
      adapter dropout, ``routing`` to replay for a mixture of experts).
    scale: ``f32[]``, multiplies the numerator (``jaxgrpo.step.update.token_scale``: 2^-e ≈ 1/tokens).

  Returns:
    ``(scale · (numerator + c·router_loss·stop_gradient(denominator)) f32[], (terms, entropy_sum f32[],
    routing_sums))``: ``terms`` the objective's :class:`~jaxgrpo.kernels.losses.LossTerms`, ``entropy_sum`` the
    policy entropy summed over ``loss_mask`` (no gradient; 0 when not computed), ``routing_sums`` the router's
    sums (``{}`` for a dense model).
  """
  config, tc = spec.config, spec.tc
  model = merge_model(spec.graphdef, params, frozen)
  _check_dropout(spec, model, mb)
  wants_entropy = needs_entropy(config, spec.objective_fn)
  with moe.routing_scope(replay=mb.get("routing")) as scope:  # MoE: replay the rollout's experts if given
    out = micro_log_probs(
      model, mb, tc, spec.blocks, tc.entropy or wants_entropy, wants_entropy, topk_ids=mb.get("teacher_topk_ids")
    )
  logp, ent = out[:2]
  router_loss, route_sums = spec.router.terms(mb, scope)
  extras = objective_extras(config, mb["behavior_logp"], ent, hyper, spec.objective_fn)
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
  if len(out) > 2:  # a top-k distillation form: + w·D(p_t ‖ p_s) over the loss tokens, aggregated like the loss
    terms = _add_topk_divergence(config, terms, out[2], mb)
  ent = None if ent is None else jax.lax.stop_gradient(ent)
  ent_sum = jnp.zeros((), jnp.float32) if ent is None else jnp.sum(jnp.where(mb["loss_mask"], ent, 0.0))
  # the router losses, weighted like the objective: Σ_k (num_k + c·aux_k·den_k) / Σ_k den_k
  numerator = terms.numerator + router_loss * jax.lax.stop_gradient(terms.denominator)
  return numerator * scale, (terms, ent_sum, route_sums)
