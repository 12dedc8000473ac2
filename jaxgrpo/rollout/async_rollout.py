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
import contextlib
import hashlib
import json
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxgrpo import data as data_lib
from jaxgrpo.kernels.importance import mismatch_k3
from jaxgrpo.parallel import distributed
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout import collect
from jaxgrpo.services.metrics import truncate_jsonl
from jaxgrpo.step import feed
from jaxgrpo.step.train import Batch, TrainState, make_reference_fn

__all__ = ["AsyncRollouts", "ProducedBatch", "make_meshes", "LEDGER"]

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
  its own block of rows). ValueError naming the field when they do not fit.
  """
  devices = list(jax.devices() if devices is None else devices)
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
      "(each needs >= 1, disjoint)"
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


class ProducedBatch(NamedTuple):
  """One produced batch (host side, this process's rows).

  Attributes:
    index: n, the step that trains it (1-based).
    batch: the host :class:`~jaxgrpo.step.train.Batch`; ``old_logp`` holds the sampler's log-probs.
    metrics: the rollout metrics of ``RolloutSource.batch`` (rewards, lengths, dynamic sampling).
    tokens: completion tokens of the batch.
    prompts: ``int64[groups]`` the prompt index of each group, in batch order.
    versions: ``int64[groups]`` the parameter version that sampled each group.
    key_after: the PRNG key after this batch (the trainer state's key once it is trained).
    position_after: the data-iterator position after this batch.
    rounds: the prompt indices of each sampling round (dynamic sampling: several).
    generate_s: wall time of sampling and scoring.
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


class _Once:
  """Calls ``fn`` the first time it is called (the learner's dispatch, after the first sampler call)."""

  def __init__(self, fn: Callable[[], None] | None):
    self.fn = fn

  def __call__(self) -> None:
    fn, self.fn = self.fn, None
    if fn is not None:
      fn()


class AsyncRollouts:
  """The produced batches and the learner's step of a ``jaxgrpo.run.trainer.Trainer`` (the schedule of
  the module docstring).

  Args:
    trainer: the trainer (its state, iterator, jitted step and reference, ``source.batch``); this
      object replaces its ``train_step`` (``trainer.rollouts``).
    max_staleness: k >= 0.
    rollout_mesh: the mesh the sampler runs on (None: the trainer's mesh, colocated).
    steps: the last step a batch is produced for (``run.steps``).
    resumed: the trainer state was restored (the ledger is cut back to its step).
    profile: wait after each learner phase to time it (``async/old_logp_s``, ``time/reference_s``,
      ``time/update_s`` in every step) — the update then no longer overlaps the next batch's rewards.
  """

  def __init__(
    self,
    trainer,
    *,
    max_staleness: int,
    rollout_mesh: Mesh | None = None,
    steps: int,
    resumed=False,
    profile: bool = False,
  ):
    if not isinstance(max_staleness, int) or max_staleness < 0:
      raise ValueError(f"`max_staleness` must be an int >= 0; got {max_staleness!r}")
    self.trainer, self.k, self.steps, self.profile = trainer, max_staleness, steps, profile
    self.colocated = rollout_mesh is None
    self.rollout_mesh = trainer.mesh if rollout_mesh is None else rollout_mesh
    if not self.colocated and jax.process_count() > 1:
      _check_same_rows(trainer.mesh, self.rollout_mesh, trainer.config.rollout)
    tstate = trainer.state.train
    step_fn = trainer.step_fn
    # the rollout side's placement of the trained parameters (and, once, the frozen ones)
    rules = step_fn.rules
    if self.colocated:
      self._transfer = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=step_fn.shardings.params)
      self._frozen = tstate.frozen
    else:
      self.rollout_shardings = shd.tree_shardings(tstate.params, self.rollout_mesh, rules)
      self._transfer = _transfer_fn(tstate.params, self.rollout_shardings)
      self._frozen = None
      if tstate.frozen is not None and jax.tree.leaves(tstate.frozen):
        frozen_shardings = shd.tree_shardings(tstate.frozen, self.rollout_mesh, rules)
        self._frozen = _transfer_fn(tstate.frozen, frozen_shardings)(tstate.frozen)
    # π_old of a stale batch: the learner's current parameters (merged with the frozen ones), one pass
    logp_shardings, self._merged = step_fn.shardings.params, False
    if tstate.frozen is not None and jax.tree.leaves(tstate.frozen):
      logp_shardings, self._merged = nnx.merge_state(logp_shardings, step_fn.shardings.frozen), True
    self._policy_logp = make_reference_fn(
      step_fn.graphdef,
      mesh=trainer.mesh,
      param_shardings=logp_shardings,
      train_config=trainer.train_config,
      rules=rules,
    )
    self._mismatch = jax.jit(lambda old, behavior, mask: mismatch_k3(old, behavior, mask.astype(bool))[0])
    # CPU processes (gloo): programs on two device sets must not exchange data at the same time (their
    # collectives share one connection per pair of processes): each program is waited for in turn
    self._serial = jax.process_count() > 1 and jax.default_backend() == "cpu"
    self._queue: collections.deque[ProducedBatch] = collections.deque()
    self._published: tuple[int, Any] | None = None
    self._started = False
    self._drawn: list[list[int]] = []  # rounds drawn beyond the trained position
    self._last_transfer_s = 0.0
    out = trainer.config.run.out
    self._ledger = os.path.join(out, LEDGER) if jax.process_index() == 0 else None
    self._resumed = resumed
    self._check_untrained = list(trainer.state.data_position.get("untrained", []))
    #: called with every trained :class:`ProducedBatch` (inspection, tests); None: nothing
    self.observe: Callable[[ProducedBatch], None] | None = None

  # ------------------------------------------------------------------ lifecycle
  def start(self) -> None:
    """Publishes the current parameters (version = the state's step); batches are then produced
    from the trained position. Every process checks that all agree on the state first."""
    if self._started:
      return
    t = self.trainer
    step = int(t.state.train.step)
    _check_processes_agree(step, t.state.key, t.state.data_position)
    if self._ledger is not None:
      os.makedirs(os.path.dirname(self._ledger), exist_ok=True)
      if self._resumed:
        truncate_jsonl(self._ledger, step)
      elif step == 0 and os.path.exists(self._ledger):
        os.remove(self._ledger)
    # produce from the trained position (after a close(), the iterator is ahead of it)
    t.iterator.restore(t.state.data_position)
    self._queue.clear()
    self._drawn = []
    self._publish(step, t.state.train.params)
    self._next_index, self._key = step + 1, t.state.key
    self._started = True

  def close(self, timeout: float | None = None) -> None:
    """Drops the batches produced ahead; a later :meth:`start` (the next ``train_step``) produces
    them again from the trained position. (Nothing runs between two calls: no thread to stop.)"""
    self._queue.clear()
    self._drawn = []
    self._started = False

  @contextlib.contextmanager
  def paused(self):
    """Kept for the trainer's evaluation: nothing is produced between two ``train_step`` calls."""
    yield

  # ------------------------------------------------------------------ producing
  def _publish(self, version: int, params) -> None:
    t0 = time.perf_counter()
    placed = jax.block_until_ready(self._transfer(params))
    self._last_transfer_s = time.perf_counter() - t0
    self._published = (version, placed)

  def _latest(self) -> tuple[int, Any]:
    return self._published

  def _sample(self, indices, key, versions: list, rounds: list, dispatched: _Once):
    """One sampling round on the newest published version and the rollout mesh: the rollout
    source's ``sample`` with the learner's dispatch between the sampler's call and the fetch of its rows."""
    tr = self.trainer
    drawn = [int(i) for i in indices]
    version, params = self._published
    self._drawn.append(drawn)
    versions.append(version)
    rounds.append(drawn)
    model = feed.policy_model(tr.graphdef, TrainState(params, None, None, self._frozen))
    tokens, mask = data_lib.pad_left([tr.prompts.tokens[i] for i in indices], tr.prompt_len, tr.pad_id)
    tokens, mask = collect.place_prompts(tokens, mask, mesh=self.rollout_mesh)
    rollout = collect.sample(model, tokens, mask, tr.sampling, key=key, temperature=tr.train_config.temperature)
    if self._serial:
      jax.block_until_ready(rollout)
    dispatched()  # the update now runs alongside (disjoint devices) or after (colocated) the sampler
    return distributed.process_rows(rollout._replace(num_steps=None), self.rollout_mesh)

  def _produce(self, dispatched: _Once) -> None:
    """The next batch: the trainer's rollout batch (dynamic sampling included) from the producer's
    key, queued."""
    t1 = time.perf_counter()
    n = self._next_index
    tr = self.trainer
    key, sample_key = jax.random.split(self._key)
    versions: list[int] = []
    rounds: list[list[int]] = []
    groups: list[tuple[int, int]] = []
    batch, metrics, tokens = tr.source.batch(
      sample_key, sample=lambda i, k: self._sample(i, k, versions, rounds, dispatched), kept_groups=groups
    )
    self._queue.append(
      ProducedBatch(
        index=n,
        batch=batch,
        metrics=metrics,
        tokens=tokens,
        prompts=np.asarray([rounds[r][b] for r, b in groups], np.int64),
        versions=np.asarray([versions[r] for r, _ in groups], np.int64),
        key_after=key,
        position_after=tr.iterator.state(),
        rounds=rounds,
        generate_s=time.perf_counter() - t1,
      )
    )
    self._key, self._next_index = key, n + 1

  def untrained(self) -> list[list[int]]:
    """The prompt indices of every sampling round drawn beyond the trained position (batches
    produced, not trained), in drawing order: what a checkpoint records as not yet trained."""
    return [list(r) for r in self._drawn]

  # ------------------------------------------------------------------ learner
  def _dispatch(self, item: ProducedBatch, stale: bool, timed: bool) -> dict:
    """Places batch ``item`` and dispatches π_old (stale groups), the reference and the update; with
    ``timed`` waits after each phase to time it. Returns the (not yet computed) results."""
    tr = self.trainer
    tstate = tr.state.train
    out: dict[str, Any] = {"t0": time.perf_counter(), "times": {}}
    placed = feed.place(item.batch, mesh=tr.mesh, train_config=tr.train_config, process_local=True)
    t1 = time.perf_counter()
    out["mismatch"] = None
    if stale:
      params = nnx.merge_state(tstate.params, tstate.frozen) if self._merged else tstate.params
      old = self._policy_logp(params, placed)
      out["mismatch"] = self._mismatch(old, placed.old_logp, placed.mask)
      placed = placed._replace(old_logp=old, behavior_logp=placed.old_logp)
      if timed:
        jax.block_until_ready((old, out["mismatch"]))
    if timed:
      out["times"]["async/old_logp_s"] = time.perf_counter() - t1 if stale else 0.0
    t2 = time.perf_counter()
    if tr.reference is not None:
      placed = tr.reference(placed)
      if timed:
        jax.block_until_ready(placed.ref_logp)
    t3 = time.perf_counter()
    out["state"], out["metrics"] = tr.step_fn(tstate, placed)
    if timed:
      jax.block_until_ready((out["state"], out["metrics"]))
      out["times"].update({"time/reference_s": t3 - t2, "time/update_s": time.perf_counter() - t3})
    return out

  def train_step(self) -> dict[str, Any]:
    """One learner step (the schedule of the module docstring); returns its metrics (the trainer's,
    plus ``async/*`` and ``time/*``), the same on every process but for the times."""
    tr = self.trainer
    self.start()
    t0 = time.perf_counter()
    n = int(tr.state.train.step) + 1
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
    ahead = min(n + self.k, self.steps)  # batches produced while this update runs
    overlapped = self._next_index <= ahead
    learner: dict[str, Any] = {}
    timed = self.profile or self._serial or not overlapped  # wait after each phase (and time it)
    dispatched = _Once(lambda: learner.update(self._dispatch(item, bool(staleness.any()), timed)))
    if not overlapped:
      dispatched()
    while self._next_index <= ahead:
      self._produce(dispatched)  # the first sampler call dispatches the learner
    dispatched()
    t_wait = time.perf_counter()
    step_metrics = {k: float(v) for k, v in jax.device_get(learner["metrics"]).items()}
    mismatch = 0.0 if learner["mismatch"] is None else float(jax.device_get(learner["mismatch"]))
    t_done = time.perf_counter()
    tstate = learner["state"]
    self._publish(n, tstate.params)
    position = {**item.position_after, "untrained": self.untrained()}
    tr.state = type(tr.state)(tstate, item.key_after, position)
    dt = time.perf_counter() - t0
    metrics = dict(item.metrics)
    metrics.update(step_metrics)
    metrics.update(
      {
        "step": int(tstate.step),
        "tokens_per_sec": item.tokens / dt,
        "step_time": dt,
        "rollout_time": item.generate_s,
        "async/staleness_mean": float(staleness.mean()),
        "async/staleness_max": int(staleness.max()),
        **{f"async/staleness_hist/{s}": int((staleness == s).sum()) for s in range(self.k + 1)},
        "async/queue_depth": depth,
        "async/learner_idle_s": idle,
        "async/producer_idle_s": t_done - t_wait if overlapped else 0.0,
        "async/weight_transfer_s": self._last_transfer_s,
        "async/mismatch_kl": mismatch,
        "time/generate_s": item.generate_s,
        "time/learner_s": t_done - learner["t0"],
        **learner["times"],
      }
    )
    metrics.setdefault("kl", 0.0)
    if self._ledger is not None:
      with open(self._ledger, "a") as f:
        rec = {"step": n, "prompts": item.prompts.tolist(), "versions": item.versions.tolist()}
        f.write(json.dumps(rec) + "\n")
    if self.observe is not None:
      self.observe(item)
    return metrics

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


def _transfer_fn(tree, shardings) -> Callable:
  """The function that places a tree like ``tree`` (on the train mesh) with ``shardings`` (the rollout
  mesh's). One process: ``jax.device_put``. Several processes, where JAX cannot move arrays between
  two device sets: each process copies its own shards device to device when its rollout devices need
  exactly the blocks its train devices hold (the meshes split the parameters alike per process);
  a leaf for which some process lacks a block goes through the host instead (an all-gather of it, then
  each process places its blocks) — decided once, the same way on every process."""
  if jax.process_count() == 1:
    return lambda t: jax.device_put(t, shardings)
  leaves, treedef = jax.tree.flatten(tree)
  target = jax.tree.leaves(shardings)  # NamedSharding leaves, in the order of the arrays
  assert len(target) == len(leaves), (len(target), len(leaves))
  local = [_local_blocks(x, s) is not None for x, s in zip(leaves, target)]
  every = distributed.gather_objects(local)
  direct = [all(e[i] for e in every) for i in range(len(leaves))]

  def transfer(t):
    out = []
    for x, s, fast in zip(jax.tree.leaves(t), target, direct):
      if fast:
        blocks = _local_blocks(x, s)
      else:
        host = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        blocks = [(d, host[idx]) for d, idx in s.addressable_devices_indices_map(x.shape).items()]
      arrays = [jax.device_put(b, d) for d, b in blocks]
      out.append(jax.make_array_from_single_device_arrays(x.shape, s, arrays))
    return jax.tree.unflatten(treedef, out)

  transfer.direct = direct  # per leaf: shard by shard (True) or through the host (False)
  return transfer


def _local_blocks(x: jax.Array, sharding) -> list | None:
  """``[(rollout device, this process's train shard with exactly its block)]``, or None when a block
  of this process's rollout devices is not one of its train shards."""
  key = lambda idx: tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(idx, x.shape))
  held = {key(s.index): s.data for s in x.addressable_shards}
  blocks = []
  for d, idx in sharding.addressable_devices_indices_map(x.shape).items():
    if key(idx) not in held:
      return None
    blocks.append((d, held[key(idx)]))
  return blocks


def _check_same_rows(train: Mesh, rollout: Mesh, roll) -> None:
  """Several processes, disaggregated: each process must hold the same rows of the rollout batch on
  both meshes (it scores the rows it sampled and feeds them to the update); ValueError otherwise."""
  rows = roll.prompts_per_step * roll.group_size
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
