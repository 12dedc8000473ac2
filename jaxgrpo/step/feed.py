"""From host rows to the step's inputs: the :class:`~jaxgrpo.step.batch.Batch` placed on the train mesh
(:func:`place`: bucket padding, packing with ``TrainConfig.packing``, per-process rows; :func:`make_batch`
from a rollout and its rewards), the frozen reference pass (:func:`make_reference`) and the policy a train
state holds (:func:`policy_model`, :func:`policy_params`).

Everything here sits between the rollout side and the jitted step, so both the one-call iteration
(``jaxgrpo.loop.iteration``) and a trainer's own loop build the step's inputs one way.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxgrpo.models import lora
from jaxgrpo.parallel import distributed, transfer
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step.batch import REFERENCE_FIELDS, Batch
from jaxgrpo.step.batch_packing import DEFAULT_BUCKETS, pack_batch, pad_to_bucket
from jaxgrpo.step.state import TrainConfig, TrainState, check_not_donated, merge_model
from jaxgrpo.step.terms import distill_of
from jaxgrpo.step.train import TrainStep, make_reference_fn

__all__ = [
  "Reference",
  "TEACHER_FIELDS",
  "Teacher",
  "TeacherDevices",
  "teacher_host_scores",
  "check_teacher_mesh",
  "check_teacher_vocab",
  "make_teacher",
  "make_batch",
  "make_reference",
  "place",
  "policy_model",
  "policy_params",
]


class Reference(NamedTuple):
  """The frozen reference policy: its parameters and the jitted log-prob pass.

  ``params``: a copy of the initial parameters (full fine-tuning), or a LoRA policy's frozen base
  weights — the train state's own ``frozen`` arrays, not a copy (the reference is the base model:
  ``models.lora.base_model``).

  ``reference(batch)`` returns ``batch`` with ``ref_logp`` ``f32[B, T]`` filled in;
  ``reference.log_probs(batch)`` returns the log-probs alone. Built by :func:`make_reference`.
  """

  params: Any
  fn: Callable

  def log_probs(self, batch: Batch) -> jax.Array:
    """``f32[B, T]`` reference log-probs of ``batch``'s completions (batch-sharded)."""
    return self.fn(self.params, batch)

  def __call__(self, batch: Batch) -> Batch:
    return batch._replace(ref_logp=self.log_probs(batch))


class Teacher(NamedTuple):
  """A distillation teacher: its parameters on the train mesh (or on a mesh of its own) and its jitted log-prob
  pass — a reference pass (:func:`jaxgrpo.step.train.make_reference_fn`: chunked head, float32, the step's
  micro-batches, packing and temperature) of another model that shares the policy's vocabulary.

  ``teacher(batch)`` returns ``batch`` with ``teacher_logp`` ``f32[B, T]`` filled in (the teacher's
  ``log π_t(y_t)`` of each completion token given the prompt and the tokens before it) and, with ``top_k`` = k
  (a top-k distillation form), ``teacher_topk_ids`` ``int32[B, T, k]`` and ``teacher_topk_logp`` ``f32[B, T, k]``:
  only those numbers leave the pass (the top-k is taken chunk by chunk where the teacher's parameters are). A
  mixture-of-experts student's recorded routing is not the teacher's: the teacher routes by its own top-k
  experts. ``devices``: a teacher on devices of its own (:class:`TeacherDevices`), None on the train mesh.
  Built by :func:`make_teacher`.
  """

  params: Any
  fn: Callable
  top_k: int | None = None
  devices: TeacherDevices | None = None

  def _run(self, batch: Batch):
    packed = None if batch.packed is None else batch.packed._replace(routing=None)  # the student's experts
    batch = batch._replace(routing=None, packed=packed)
    if self.devices is None:
      return self.fn(self.params, batch)
    return self.devices.back(self.fn(self.params, self.devices.there(batch)))

  def log_probs(self, batch: Batch) -> jax.Array:
    """``f32[B, T]`` the teacher's log-probs of ``batch``'s completions (batch-sharded on the train mesh)."""
    out = self._run(batch)
    return out if self.top_k is None else out[0]

  def __call__(self, batch: Batch) -> Batch:
    if self.top_k is None:
      return batch._replace(teacher_logp=self.log_probs(batch))
    logp, ids, topk_logp = self._run(batch)
    return batch._replace(teacher_logp=logp, teacher_topk_ids=ids, teacher_topk_logp=topk_logp)


class TeacherDevices(NamedTuple):
  """A teacher on a mesh of its own (``devices.teacher``): what crosses between it and the train mesh.

  :meth:`there` moves the inputs of the teacher's pass — a placed batch's ``prompts``, ``prompt_mask``,
  ``completions``, ``mask`` and its packed layout — to the teacher mesh (rows over its ``data × fsdp``);
  :meth:`back` moves the pass's outputs (``f32[B, T]``, and ``int32[B, T, k]``, ``f32[B, T, k]``) to the train
  mesh's rows. Nothing else crosses: the parameters, the activations and the ``[B, C, V]`` logits chunks stay
  on the teacher's devices (``jaxgrpo.parallel.transfer.move``: a device-to-device copy).
  """

  mesh: Mesh
  train_mesh: Mesh
  rules: Any = None

  def there(self, batch: Batch) -> Batch:
    names = [n for n in REFERENCE_FIELDS if getattr(batch, n) is not None]
    tree = {n: getattr(batch, n) for n in names}
    if batch.packed is not None:
      tree["packed"] = batch.packed
    moved = transfer.move(_as_arrays(tree), shd.batch_sharding(self.mesh, self.rules))
    return batch._replace(**moved)

  def back(self, out):
    return transfer.move(out, shd.batch_sharding(self.train_mesh, self.rules))


def _as_arrays(tree):
  """Host arrays of a batch's fields as ``jax.Array`` s (a placed batch's are already)."""
  return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), tree)


def check_teacher_vocab(student_vocab: int, teacher_vocab: int) -> None:
  """ValueError in one line unless the teacher's vocabulary size equals the student's (the teacher scores the
  student's token ids: the same tokenizer is needed, and its size is the check the models allow)."""
  if int(student_vocab) != int(teacher_vocab):
    raise ValueError(
      f"distillation teacher's vocab_size={teacher_vocab} but the policy's is {student_vocab}: the teacher must "
      "share the policy's tokenizer (it scores the policy's token ids); pick a teacher of the same tokenizer"
    )


def make_teacher(
  step: TrainStep, teacher: nnx.Module, *, student_vocab: int | None = None, mesh: Mesh | None = None
) -> Teacher:
  """The teacher ``teacher`` (a Flax model of any family or size) placed on ``mesh`` (None: ``step``'s mesh),
  sharded by its own logical-axis rules like the policy (FSDP over ``fsdp``, tensor parallelism over ``tensor``),
  and its jitted log-prob pass (:class:`Teacher`). Its parameters are a copy (never donated, never trained).

  ``student_vocab``: the policy's vocabulary size, checked against the teacher's (:func:`check_teacher_vocab`)
  before anything is placed. On the train mesh the parameters sit beside the policy's: ``4·N_teacher`` bytes more
  in float32. ``mesh``: a mesh of other devices (``devices.teacher``, ``jaxgrpo.loop.async_rollout.make_teacher_mesh``):
  the parameters and the pass (the step's micro-batches, chunking, temperature) live there, and per batch only
  the pass's inputs go there and its ``[B, T]`` (and ``[B, T, k]``) outputs come back (:class:`TeacherDevices`).
  A step whose config has a top-k distillation form (``GRPOConfig.distill.kind``) gets a top-k pass of its
  ``distill.top_k``.
  """
  d = distill_of(step.config) if step is not None else None
  top_k = None if d is None or d.sampled else d.top_k
  vocab = getattr(getattr(teacher, "config", None), "vocab_size", None)
  if student_vocab is not None and vocab is not None:
    check_teacher_vocab(student_vocab, vocab)
  own = mesh is not None and mesh is not step.mesh
  if own:
    check_teacher_mesh(mesh, step.mesh, step.train_config)
  target = mesh if own else step.mesh
  graphdef, params = nnx.split(teacher)
  shardings = shd.tree_shardings(params, target, teacher.rules)
  params = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=shardings)(params)
  fn = make_reference_fn(graphdef, mesh=target, param_shardings=shardings, train_config=step.train_config, top_k=top_k)
  return Teacher(params, fn, top_k, TeacherDevices(mesh, step.mesh) if own else None)


def teacher_host_scores(
  teacher: Teacher, batch: Batch, *, mesh: Mesh, train_config: TrainConfig | None = None
) -> Batch:
  """Host ``batch`` (this process's rows: every row in one process; on several, the rows
  ``sharding.process_batch_rows`` of ``mesh`` names) with the teacher's fields filled in as NumPy of its own width
  ``T``: ``teacher_logp`` ``f32[B, T]`` (and the top-k's ``int32[B, T, k]``, ``f32[B, T, k]``), from one pass of
  ``teacher`` on the batch placed on ``mesh`` like the step's (:func:`place` with ``process_local``: bucket,
  packing; every process enters the one program with its own rows and takes its own rows of the result,
  ``distributed.process_rows``). What a dynamic-sampling round is scored with when it is sampled: the filter reads
  the signal and the step trains on these numbers (the learner does not score a batch that carries them)."""
  t = np.shape(batch.completions)[1]
  scored = teacher(place(batch, mesh=mesh, train_config=train_config, process_local=True))
  fields = {n: getattr(scored, n) for n in TEACHER_FIELDS if getattr(scored, n) is not None}
  return batch._replace(**{n: x[:, :t] for n, x in distributed.process_rows(fields, mesh).items()})


#: the fields a teacher fills in (:class:`Teacher`)
TEACHER_FIELDS = ("teacher_logp", "teacher_topk_ids", "teacher_topk_logp")


def check_teacher_mesh(mesh: Mesh, train_mesh: Mesh, train_config: TrainConfig | None) -> None:
  """ValueError in one line unless the teacher's own mesh can run the step's batches: its devices disjoint from
  the train mesh's, and with ``TrainConfig.packing`` the same ``data × fsdp`` size (the teacher scores the
  step's packed layout, whose slots are cut per train-mesh shard)."""
  shared = {d.id for d in mesh.devices.flat} & {d.id for d in train_mesh.devices.flat}
  if shared:
    raise ValueError(
      f"the teacher's mesh shares devices {sorted(shared)} with the train mesh: `devices.teacher` gives the "
      "teacher devices of its own (unset it to place the teacher on the train mesh)"
    )
  mine, theirs = shd.batch_shards(mesh), shd.batch_shards(train_mesh)
  if train_config is not None and train_config.packing is not None and mine != theirs:
    raise ValueError(
      f"`devices.teacher_mesh` splits the rows over data×fsdp = {mine} devices but the train mesh over {theirs}: "
      f"with `step.packing` the teacher scores the step's packed layout; give the teacher mesh data×fsdp = "
      f"{theirs} (e.g. `fsdp={theirs}` and the rest on tensor)"
    )


def policy_model(graphdef, state: TrainState) -> nnx.Module:
  """The policy as a model, ``nnx.merge(graphdef, state.params, state.frozen)``, for the next rollout.

  It shares ``state``'s arrays: valid until the next call of the train step consumes ``state``.
  """
  check_not_donated(state, "state")
  return merge_model(graphdef, state.params, state.frozen)


def _trains_adapters_only(params, frozen) -> bool:
  """Whether ``params`` are exactly the LoRA adapters and ``frozen`` everything else."""
  flat = nnx.to_flat_state(params)
  frozen_flat = [] if frozen is None else nnx.to_flat_state(frozen)
  return (
    bool(flat)
    and all(isinstance(v, nnx.LoRAParam) for _, v in flat)
    and not any(isinstance(v, nnx.LoRAParam) for _, v in frozen_flat)
  )


def make_reference(step: TrainStep, state: TrainState) -> Reference:
  """The reference policy of ``step`` and the jitted log-prob pass (:func:`jaxgrpo.step.train.make_reference_fn`,
  same mesh, micro-batches, temperature and chunking as the step). Build it once, from the initial state.

  - LoRA (``state.params`` are the adapters, ``state.frozen`` the base weights — ``init_train_state(...,
    trainable=nnx.LoRAParam)``): the reference is the base model with the adapters removed
    (``models.lora.base_model``) running on ``state.frozen`` itself — never donated, not copied. This
    saves a second copy of the base weights: 2 bytes × N parameters in bf16 (8.0 GB for Qwen3-4B).
  - Otherwise: a copy of ``state.params`` (placed like the policy's, never donated); a policy whose
    frozen part is not empty is merged with it unchanged.

  ``state`` may also be the parameters alone (``state.params``, the earlier form) when nothing is frozen.
  """
  if not isinstance(state, TrainState):
    if jax.tree.leaves(step.shardings.frozen):
      raise TypeError(
        "make_reference needs the TrainState (not its params) when the step has frozen variables (LoRA): "
        "make_reference(step, state)"
      )
    state = TrainState(state, None, None, None)
  check_not_donated((state.params, state.frozen), "state")
  kw = dict(mesh=step.mesh, train_config=step.train_config, rules=step.rules)
  if _trains_adapters_only(state.params, state.frozen):
    base = lora.base_model(merge_model(step.graphdef, state.params, state.frozen))
    fn = make_reference_fn(nnx.graphdef(base), param_shardings=step.shardings.frozen, **kw)
    return Reference(state.frozen, fn)
  copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=step.shardings.params)
  params, shardings = copy(state.params), step.shardings.params
  if state.frozen is not None and jax.tree.leaves(state.frozen):  # a custom filter: frozen, not copied
    params, shardings = nnx.merge_state(params, state.frozen), nnx.merge_state(shardings, step.shardings.frozen)
  return Reference(params, make_reference_fn(step.graphdef, param_shardings=shardings, **kw))


def policy_params(state: TrainState):
  """The policy's variables of ``state`` as one state: ``params`` merged with ``frozen`` when it is not empty."""
  frozen = state.frozen
  return nnx.merge_state(state.params, frozen) if frozen is not None and jax.tree.leaves(frozen) else state.params


def place(
  batch: Batch,
  *,
  mesh: Mesh,
  rules: Mapping[str, Any] | None = None,
  buckets: Sequence[int] | None = DEFAULT_BUCKETS,
  process_local: bool = False,
  train_config: TrainConfig | None = None,
) -> Batch:
  """A host :class:`~jaxgrpo.step.train.Batch` bucket-padded, packed (with ``train_config.packing``) and
  placed on ``mesh`` (rows over ``data × fsdp``).

  Args:
    batch: the batch (NumPy or JAX arrays).
    buckets: completion-length buckets for :func:`jaxgrpo.step.train.pad_to_bucket` (None: keep T).
    process_local: ``batch`` holds only this process's rows (multi-host: each process feeds its slice,
      ``jaxgrpo.parallel.sharding.process_batch_rows``); every process then pads to the same bucket, and packs
      its own device shards' slots with the same rows and head length.
    train_config: the step's :class:`~jaxgrpo.step.train.TrainConfig`; with ``packing`` set the batch is
      packed once here (:func:`jaxgrpo.step.train.pack_batch`, the step's slots), and the reference pass
      and the step use that layout. None: not packed (the step packs it itself if it packs).
  """
  multi = process_local and jax.process_count() > 1
  if buckets is not None:
    length = None
    if multi:
      mask = np.asarray(batch.mask)
      local = int(mask.any(axis=0).nonzero()[0].max() + 1) if mask.any() else 1
      length = int(np.max(multihost_utils.process_allgather(np.int32(local))))
    batch = pad_to_bucket(batch, buckets, length=length)
  if train_config is not None and train_config.packing is not None and batch.packed is None:
    batch = _pack(batch, train_config, mesh, rules, multi)
  placed = shd.place_batch(batch._replace(packed=None), mesh, rules, process_local=process_local)
  if batch.packed is None:
    return placed
  # packed arrays: rows, slots or sequences first; each over data × fsdp on its own leading axis, in the step's dtype
  place_one = lambda x, dtype: shd.place_batch(np.asarray(x, dtype), mesh, rules, process_local=process_local)
  return placed._replace(packed=batch.packed.map_arrays(place_one))


def _pack(batch: Batch, tc: TrainConfig, mesh: Mesh, rules, multi: bool) -> Batch:
  """``jaxgrpo.step.train.pack_batch`` for the step of ``tc`` on ``mesh``. With process-local rows (``multi``)
  this process packs its own shards' slots, then every process repacks to the largest rows per slot and
  head length of any process, so the global arrays have one shape."""
  shards = shd.batch_shards(mesh, rules)
  if multi:  # the rows of one process (1/process_count of the batch, as place_batch assumes) cover its shards
    if shards % jax.process_count():
      raise ValueError(
        f"packing process-local rows needs the batch mesh axes (data×fsdp = {shards}) to divide over the "
        f"{jax.process_count()} processes"
      )
    shards //= jax.process_count()
  pack = lambda **kw: pack_batch(
    batch,
    row_length=tc.packing,
    shards=shards,
    mini_batches=tc.mini_batches,
    micro_batches=tc.micro_batches,
    sharing=tc.prefix_sharing,
    **kw,
  )
  packed = pack(rows=tc.packing_rows)
  if not multi:
    return packed
  rows, head = packed.packed.rows_per_slot, packed.packed.head_index.shape[1] // packed.packed.rows_per_slot
  rows, head = (int(x) for x in np.max(multihost_utils.process_allgather(np.int32([rows, head])), axis=0))
  return pack(rows=rows, head_length=head)


def make_batch(
  rollout: Any,
  rewards,
  *,
  mesh: Mesh,
  rules: Mapping[str, Any] | None = None,
  advantages=None,
  token_weights=None,
  behavior_logp=None,
  buckets: Sequence[int] | None = DEFAULT_BUCKETS,
  process_local: bool = False,
  train_config: TrainConfig | None = None,
) -> Batch:
  """A rollout and its ``f32[N]`` rewards as a placed :class:`~jaxgrpo.step.train.Batch` (see :func:`place`:
  bucketed, packed for ``train_config`` when it packs), with optional precomputed ``advantages``
  (``f32[N]`` or ``f32[N, T]``) and ``token_weights`` (``f32[N, T]``), and the behaviour policy's
  ``behavior_logp`` (``f32[N, T]``) when the rollout's log-probs are not the behaviour policy's
  (off-policy correction, ``GRPOConfig.importance_correction``)."""
  batch = Batch.from_rollout(
    rollout, rewards, advantages=advantages, token_weights=token_weights, behavior_logp=behavior_logp
  )
  return place(batch, mesh=mesh, rules=rules, buckets=buckets, process_local=process_local, train_config=train_config)
