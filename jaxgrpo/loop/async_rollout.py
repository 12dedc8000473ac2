"""Bounded-staleness rollouts: the next batches are generated while the learner updates.

With ``rollout.max_staleness: k`` (k >= 1) one thread runs a fixed schedule; each learner step n
(trainer's ``train_step``): produce batch n now if it is not produced yet (``async/learner_idle_s``);
produce batches up to ``n + k`` with the newest published version θ(n-1), dispatching the learner's
programs (π_old recomputation of stale groups, reference, update → θ(n)) right after the first
sampler dispatch; block on the update's metrics (``async/producer_idle_s``); publish θ(n) to the
rollout devices (``async/weight_transfer_s``).

Version v is the policy after v updates; a group sampled with version u and trained in step n has
staleness ``n - 1 - u`` in ``[0, k]`` (checked). k = 0 is the synchronous loop, bit for bit. One
thread and JAX's asynchronous dispatch give the overlap, and make several processes run exactly what
one process runs on the same global meshes. A stale group's sampler log-probs are the behaviour
policy μ (``Batch.behavior_logp``); the learner recomputes ``old_logp`` (π_old) so
``objective.importance_correction`` reweights by π_old/μ. Colocated, a version is a device-side copy;
disaggregated (``devices.rollout``), a ``jax.device_put`` to the rollout mesh (:func:`make_meshes`;
LoRA: only the adapters move). The trainer state after step n holds the iterator position and key as
the producer left them plus ``untrained`` (prompts drawn beyond it), so a resume trains every prompt
once. The schedule, metrics, placement and failure behaviour: docs/trainer.md "Asynchronous rollouts".
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxgrpo.loop.schedule import StepOut, step_metrics
from jaxgrpo.parallel import distributed, transfer
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.parallel.target import platform_of
from jaxgrpo.services.checkpoint_files import move_aside
from jaxgrpo.services.metrics import truncate_jsonl
from jaxgrpo.step import feed
from jaxgrpo.step.train import Batch, TrainState

__all__ = ["AsyncRollouts", "ProducedBatch", "make_meshes", "make_teacher_mesh", "split_teacher_devices", "LEDGER"]

#: The file (in ``run.out``) listing each trained step's prompt indices and group versions.
LEDGER = "rollouts.jsonl"


def make_meshes(devices_spec, devices=None) -> tuple[Mesh, Mesh | None]:
  """``(train mesh, rollout mesh or None)`` from a ``jaxgrpo.run.specs.DevicesSpec``.

  Colocated (``rollout`` None): one mesh ``mesh`` over every device (``devices.train`` must then be
  None). Disaggregated: the train mesh (``mesh`` spec) over ``train`` devices (None: all but the
  rollout ones) and the rollout mesh (``rollout_mesh`` spec) over ``rollout`` others; disjoint by
  construction. One process: the first ``train`` devices, then the next ``rollout``. P processes:
  every process gives its first ``train / P`` devices to the train mesh and its next ``rollout / P``
  to the rollout mesh (both meshes list the devices by process, so each process samples and trains
  its own block of rows). ValueError naming the field when they do not fit. With ``devices.teacher``
  the teacher's devices (:func:`make_teacher_mesh`) are set aside first: both meshes divide the others.
  """
  devices = split_teacher_devices(devices_spec, devices)[0]
  spec = devices_spec.mesh or None
  if devices_spec.rollout is None:
    if devices_spec.train is not None:
      raise ValueError(
        f"`devices.train`={devices_spec.train} needs `devices.rollout` (disaggregated placement); colocated runs "
        "train on every device"
      )
    return shd.make_mesh(spec, devices=devices), None
  r = devices_spec.rollout
  t = len(devices) - r if devices_spec.train is None else devices_spec.train
  if t < 1 or t + r > len(devices):
    raise ValueError(
      f"`devices.train`={devices_spec.train} + `devices.rollout`={r} do not fit the {len(devices)} devices "
      f"{_after_teacher(devices_spec)}(each needs >= 1, disjoint)"
    )
  procs = sorted({d.process_index for d in devices})
  if len(procs) == 1:
    train_devices, rollout_devices = devices[:t], devices[t : t + r]
  else:
    p = len(procs)
    local = [[d for d in devices if d.process_index == i] for i in procs]
    if t % p or r % p or t // p + r // p > min(len(x) for x in local):
      raise ValueError(
        f"`devices.train`={t} and `devices.rollout`={r} must each divide over the {p} processes and fit each "
        f"process's {min(len(x) for x in local)} devices (every process trains and samples its own rows)"
      )
    train_devices = [d for x in local for d in x[: t // p]]
    rollout_devices = [d for x in local for d in x[t // p : t // p + r // p]]
  train = shd.make_mesh(spec, devices=train_devices)
  rollout = shd.make_mesh(devices_spec.rollout_mesh or None, devices=rollout_devices)
  return train, rollout


def split_teacher_devices(devices_spec, devices=None) -> tuple[list, list]:
  """``(the devices left to the train and rollout meshes, the teacher's devices)`` of ``devices`` (default
  ``jax.devices()``) for ``devices.teacher`` = q: the last q (P processes: the last q / P of each process, so
  every process holds the same share of both). ``devices.teacher`` None: ``(devices, [])``. ValueError naming
  the field when q leaves no device to train on or does not divide over the processes."""
  devices = list(jax.devices() if devices is None else devices)
  q = getattr(devices_spec, "teacher", None)
  if q is None:
    return devices, []
  procs = sorted({d.process_index for d in devices})
  local = [[d for d in devices if d.process_index == i] for i in procs]
  fewest = min(len(x) for x in local)
  if q % len(procs) or q // len(procs) >= fewest:
    raise ValueError(
      f"`devices.teacher`={q} must divide over the {len(procs)} processes and leave each process at least one "
      f"of its {fewest} devices to train on ({len(devices)} devices in all): use 1..{len(devices) - len(procs)} "
      "in steps of the process count, or unset it (the teacher on the train mesh)"
    )
  per = q // len(procs)
  rest = [d for x in local for d in x[: len(x) - per]]
  return rest, [d for x in local for d in x[len(x) - per :]]


def make_teacher_mesh(devices_spec, devices=None) -> Mesh | None:
  """The distillation teacher's own mesh (``devices.teacher`` devices: :func:`split_teacher_devices`; axes
  ``devices.teacher_mesh``, ``""``: every one on fsdp), disjoint from the train and rollout meshes of
  :func:`make_meshes`; None without ``devices.teacher`` (the teacher shares the train mesh)."""
  teacher_devices = split_teacher_devices(devices_spec, devices)[1]
  if not teacher_devices:
    return None
  try:
    return shd.make_mesh(devices_spec.teacher_mesh or None, devices=teacher_devices)
  except ValueError as e:
    raise ValueError(
      f"`devices.teacher_mesh`={devices_spec.teacher_mesh!r} over the teacher's {len(teacher_devices)} devices: {e}"
    ) from None


def _after_teacher(devices_spec) -> str:
  q = getattr(devices_spec, "teacher", None)
  return "" if q is None else f"left after `devices.teacher`={q} "


class ProducedBatch(NamedTuple):
  """One produced batch (host side, this process's rows).

  Attributes:
    index: n, the step that trains it (1-based).
    batch: the host :class:`~jaxgrpo.step.train.Batch`; ``old_logp`` holds the sampler's log-probs.
    metrics: the rollout metrics of ``RolloutSource.batch`` (rewards, lengths, dynamic sampling).
    tokens: completion tokens of the batch.
    prompts: ``int64[groups]`` the prompt index of each group, in batch order.
    versions: ``int64[groups]`` the parameter version that sampled each group (every turn of a
      multi-turn group: one batch is sampled with one version).
    key_after: the PRNG key after this batch (the trainer state's key once it is trained).
    position_after: the data-iterator position after this batch.
    rounds: the prompt indices of each sampling round (dynamic sampling: several).
    generate_s: wall time of sampling and scoring.
    token_versions: partial rollouts: ``int64[rows, T]`` the version that sampled each completion token
      (-1 on padding); None: every token of a group has the group's version.
  """

  index: int
  batch: Batch
  metrics: dict
  tokens: int
  prompts: np.ndarray
  versions: np.ndarray
  key_after: Any
  position_after: dict
  rounds: list
  generate_s: float
  token_versions: np.ndarray | None = None


class _Once:
  """Calls ``fn`` the first time it is called (the learner's dispatch, after the first sampler call)."""

  def __init__(self, fn: Callable[[], None] | None):
    self.fn = fn

  def __call__(self, *_) -> None:
    fn, self.fn = self.fn, None
    if fn is not None:
      fn()


class AsyncRollouts:
  """The bounded-staleness schedule (the module docstring): ``step(state)`` trains batch n while batches
  up to n + k are produced with the newest published version.

  Args:
    source: the run's rollout source (``jaxgrpo.loop.source.RolloutSource``: sampler or engine,
      single- or multi-turn, dynamic sampling).
    learner: the run's learner (``jaxgrpo.loop.schedule.Learner``).
    state: the run's state ``(train, key, data_position)`` at construction (the parameters' placement
      and the frozen variables; a restored state's record of untrained prompts).
    max_staleness: k >= 0.
    rollout_mesh: the mesh the sampler runs on (None: the learner's mesh, colocated).
    steps: the last step a batch is produced for (``run.steps``).
    out_dir: where process 0 writes :data:`LEDGER` (None: no ledger).
    resumed: the state was restored (the ledger is cut back to its step).
    profile: wait after each learner phase to time it (``async/old_logp_s``, ``time/reference_s``,
      ``time/update_s`` in every step) — the update then no longer overlaps the next batch's rewards.
  """

  def __init__(
    self,
    source,
    learner,
    state,
    *,
    max_staleness: int,
    rollout_mesh: Mesh | None = None,
    steps: int,
    out_dir: str | None = None,
    resumed=False,
    profile: bool = False,
  ):
    if not isinstance(max_staleness, int) or max_staleness < 0:
      raise ValueError(f"`max_staleness` must be an int >= 0; got {max_staleness!r}")
    self.source, self.learner = source, learner
    self.k, self.steps, self.profile = max_staleness, steps, profile
    self.ahead = max_staleness  # batches produced ahead of the learner (partial rollouts: fewer)
    self.colocated = rollout_mesh is None
    self.rollout_mesh = learner.mesh if rollout_mesh is None else rollout_mesh
    if not self.colocated and jax.process_count() > 1:
      _check_same_rows(learner.mesh, self.rollout_mesh, source.rows_per_step)
    tstate, step_fn = state[0], learner.step_fn
    self.graphdef = step_fn.graphdef
    # the rollout side's placement of the trained parameters (and, once, the frozen ones)
    rules = step_fn.rules
    if self.colocated:
      self._transfer = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=step_fn.shardings.params)
      self._frozen = tstate.frozen
    else:
      self.rollout_shardings = shd.tree_shardings(tstate.params, self.rollout_mesh, rules)
      self._transfer = transfer.transfer_fn(tstate.params, self.rollout_shardings)
      self._frozen = None
      if tstate.frozen is not None and jax.tree.leaves(tstate.frozen):
        frozen_shardings = shd.tree_shardings(tstate.frozen, self.rollout_mesh, rules)
        self._frozen = transfer.transfer_fn(tstate.frozen, frozen_shardings)(tstate.frozen)
    # CPU processes (gloo): programs on two device sets must not exchange data at the same time (their
    # collectives share one connection per pair of processes): each program is waited for in turn
    self._serial = jax.process_count() > 1 and platform_of(step_fn.mesh) == "cpu"
    self._queue: collections.deque[ProducedBatch] = collections.deque()
    self._published: tuple[int, Any] | None = None
    self._started = False
    self._drawn: list[list[int]] = []  # rounds drawn beyond the trained position
    self._last_transfer_s = 0.0
    self._ledger = os.path.join(out_dir, LEDGER) if out_dir is not None and jax.process_index() == 0 else None
    self._resumed = resumed
    self._check_untrained = list(state[2].get("untrained", []))
    #: called with every trained :class:`ProducedBatch` (inspection, tests); None: nothing
    self.observe: Callable[[ProducedBatch], None] | None = None

  # ------------------------------------------------------------------ lifecycle
  def start(self, state) -> None:
    """Publishes the parameters of ``state`` (version = its step); batches are then produced from its
    data position. Every process checks that all agree on the state first."""
    if self._started:
      return
    train, key, position = state
    step = int(train.step)
    _check_processes_agree(step, key, position)
    if self._ledger is not None:
      os.makedirs(os.path.dirname(self._ledger), exist_ok=True)
      if self._resumed:
        truncate_jsonl(self._ledger, step)
      elif step == 0 and os.path.exists(self._ledger):  # an earlier run's: kept, as its metrics.jsonl
        move_aside(self._ledger, "earlier")
    # produce from the trained position (after a close(), the iterator is ahead of it)
    self.source.iterator.restore(position)
    self._queue.clear()
    self._drawn = []
    self._publish(step, train.params)
    self._next_index, self._key = step + 1, key
    self._started = True

  def close(self, timeout: float | None = None) -> None:
    """Drops the batches produced ahead; a later :meth:`start` (the next :meth:`step`) produces
    them again from the trained position. (Nothing runs between two calls: no thread to stop.)"""
    self._queue.clear()
    self._drawn = []
    self._started = False

  # ------------------------------------------------------------------ producing
  def _publish(self, version: int, params) -> None:
    t0 = time.perf_counter()
    placed = jax.block_until_ready(self._transfer(params))
    self._last_transfer_s = time.perf_counter() - t0
    self._published = (version, placed)

  def _latest(self) -> tuple[int, Any]:
    return self._published

  def _produce(self, dispatched: _Once) -> None:
    """The next batch: the source's batch (dynamic sampling, environments, an engine included) of the
    newest published version on the rollout mesh, from the producer's key, queued. The learner's
    dispatch runs once the first sampler call is dispatched."""
    n = self._next_index
    key, sample_key = jax.random.split(self._key)
    version, params = self._published
    model = feed.policy_model(self.graphdef, TrainState(params, None, None, self._frozen))

    def on_sampled(rollout):
      if self._serial and rollout is not None:
        jax.block_until_ready(rollout)
      dispatched()  # the update now runs alongside (disjoint devices) or after (colocated) the sampler

    produced = self.source.batch(
      sample_key, policy=model, version=version, mesh=self.rollout_mesh, on_sampled=on_sampled
    )
    self._drawn += produced.rounds
    self._queue.append(
      ProducedBatch(
        index=n,
        batch=produced.batch,
        metrics=produced.metrics,
        tokens=produced.tokens,
        prompts=np.asarray([produced.rounds[r][b] for r, b in produced.kept], np.int64),
        versions=np.full(len(produced.kept), version, np.int64),
        key_after=key,
        position_after=self.source.iterator.state(),
        rounds=produced.rounds,
        generate_s=produced.rollout_s,
      )
    )
    self._key, self._next_index = key, n + 1

  def untrained(self) -> list[list[int]]:
    """The prompt indices of every sampling round drawn beyond the trained position (batches
    produced, not trained), in drawing order: what a checkpoint records as not yet trained."""
    return [list(r) for r in self._drawn]

  # ------------------------------------------------------------------ learner
  def step(self, state) -> StepOut:
    """One learner step (the schedule of the module docstring) from ``state`` = ``(train, key,
    data_position)``; returns the state after it and its metrics (the synchronous step's, plus
    ``async/*`` and ``time/*``), the same on every process but for the times."""
    self.start(state)
    train = state[0]
    t0 = time.perf_counter()
    n = int(train.step) + 1
    depth = len(self._queue)
    while self._next_index <= n:  # the learner's own batch is not there yet: produce it now
      self._produce(_Once(None))
    idle = time.perf_counter() - t0
    item = self._queue.popleft()
    del self._drawn[: len(item.rounds)]  # its prompts are trained from now on
    if item.index != n:
      raise RuntimeError(f"the producer's batch {item.index} reached the learner at step {n}")
    staleness = (n - 1) - item.versions
    if staleness.size and (staleness.max() > self.k or staleness.min() < 0):
      raise RuntimeError(
        f"step {n}: a group of staleness {int(staleness.max())} outside [0, {self.k}] (versions "
        f"{item.versions.tolist()}): the producer broke the staleness bound"
      )
    self._check_resumed(item)
    ahead = min(n + self.ahead, self.steps)  # batches produced while this update runs
    overlapped = self._next_index <= ahead
    learned: dict[str, Any] = {}
    timed = self.profile or self._serial or not overlapped  # wait after each phase (and time it)
    engine = not self.source.logprobs_are_policy
    recompute = bool(staleness.any()) or engine
    dispatched = _Once(lambda: learned.update(self.learner(train, item.batch, recompute=recompute, timed=timed)))
    if not overlapped:
      dispatched()
    while self._next_index <= ahead:
      self._produce(dispatched)  # the first sampler call dispatches the learner
    dispatched()
    t_wait = time.perf_counter()
    jax.block_until_ready(learned["metrics"])
    t_done = time.perf_counter()
    metrics = step_metrics(item.metrics, item.tokens, item.generate_s, learned, t0=t0, engine=engine)
    self._publish(n, learned["state"].params)
    mismatch = 0.0 if learned["mismatch"] is None else float(jax.device_get(learned["mismatch"][0]))
    metrics.update(
      {
        "async/staleness_mean": float(staleness.mean()),
        "async/staleness_max": int(staleness.max()),
        **{f"async/staleness_hist/{s}": int((staleness == s).sum()) for s in range(self.k + 1)},
        "async/queue_depth": depth,
        "async/learner_idle_s": idle,
        "async/producer_idle_s": t_done - t_wait if overlapped else 0.0,
        "async/weight_transfer_s": self._last_transfer_s,
        "async/mismatch_kl": mismatch,
        "time/generate_s": item.generate_s,
        "time/learner_s": t_done - learned["t0"],
        **learned["times"],
      }
    )
    if self._ledger is not None:
      with open(self._ledger, "a") as f:
        f.write(json.dumps(self._ledger_record(n, item)) + "\n")
    if self.observe is not None:
      self.observe(item)
    return StepOut(learned["state"], item.key_after, self._position_after(item), metrics)

  def _ledger_record(self, n: int, item: ProducedBatch) -> dict:
    """The :data:`LEDGER` line of step ``n``."""
    return {"step": n, "prompts": item.prompts.tolist(), "versions": item.versions.tolist()}

  def _position_after(self, item: ProducedBatch) -> dict:
    """The data position the state records after training ``item``: the iterator's, and the rounds drawn
    beyond it (untrained)."""
    return {**item.position_after, "untrained": self.untrained()}

  def _check_resumed(self, item: ProducedBatch) -> None:
    """After a resume: the first sampling round drawn again must be the first one the checkpoint
    recorded as untrained (the iterator position and the record agree)."""
    if not self._check_untrained:
      return
    expected, self._check_untrained = self._check_untrained[0], []
    if item.rounds and list(item.rounds[0]) != list(expected):
      raise RuntimeError(
        f"resumed at the checkpoint's data position, the producer drew prompts {item.rounds[0][:8]}... but the "
        f"checkpoint recorded {expected[:8]}... as the next untrained ones: the data or its order changed"
      )


def _check_same_rows(train: Mesh, rollout: Mesh, rows: int) -> None:
  """Several processes, disaggregated: each process must hold the same rows of the ``rows``-row rollout batch
  on both meshes (it scores the rows it sampled and feeds them to the update); ValueError otherwise."""
  a, b = shd.process_batch_rows(train, rows), shd.process_batch_rows(rollout, rows)
  if a != b:
    raise ValueError(
      f"`devices.rollout_mesh`: process {jax.process_index()} holds rows {b.start}..{b.stop - 1} of the "
      f"{rows}-row rollout batch on the rollout mesh but rows {a.start}..{a.stop - 1} on the train mesh; put "
      "the processes on the batch axes (data or fsdp) of both meshes"
    )


def _check_processes_agree(step: int, key, position: dict) -> None:
  """Several processes: RuntimeError unless every process holds the same step, PRNG key and data
  position (with its untrained record) — a resume that read different checkpoints would otherwise
  train different prompts on different hosts. One small all-gather."""
  if jax.process_count() == 1:
    return
  state = json.dumps([step, np.asarray(jax.random.key_data(key)).tolist(), position], sort_keys=True, default=str)
  digest = hashlib.sha256(state.encode()).hexdigest()
  every = distributed.gather_objects([digest, state[:300]])
  if len({d for d, _ in every}) > 1:
    lines = "; ".join(f"process {i}: {s}" for i, (_, s) in enumerate(every))
    raise RuntimeError(f"the processes start the rollouts from different states (step, key, data position): {lines}")
