"""Bounded-staleness rollouts: a producer samples the next batches while the learner updates.

With ``rollout.max_staleness: k`` (k >= 1) the trainer's step is split in two loops that overlap::

    producer thread                                   learner (the trainer's thread)
    ---------------                                   ------------------------------
    for n = 1, 2, ...:                                for n = 1, 2, ...:
      wait until version >= n - 1 - k is published      batch n  <- queue         (learner idle)
      params = the newest published version u           check n - 1 - version <= k for every group
      batch n = rollout(params) (+ rewards;              old_logp = π_θ(n-1)(batch)   (recomputed)
        dynamic-sampling refills take the newest)        behavior_logp = the sampler's log-probs
      queue <- batch n, version u per group              reference, update → θ(n)
                                                         publish θ(n) to the rollout devices (timed)

Parameter version v is the policy after v updates (v = 0: the initial or restored one); the learner
trains batch n with θ(n-1), so a group sampled with version u has staleness ``n - 1 - u``, and the
producer may not start batch n before version ``n - 1 - k`` exists: at most ``k + 1`` batches are
ahead of the learner. k = 0 is the synchronous loop (the trainer then runs its own ``train_step``;
this class with k = 0 runs the same computation, serially, and equals it bit for bit — tested).

**Off-policy correction.** A stale group's sampler log-probs are the *behaviour* policy μ (the version
that generated it); the learner recomputes ``old_logp`` (π_old, what the PPO ratio is taken against)
under its current parameters and passes the sampler's log-probs as ``Batch.behavior_logp``, so
``objective.importance_correction`` (TIS/MIS, ``jaxgrpo.importance``) reweights by π_old/μ and the
step reports its ``is_*``/``mismatch_kl`` metrics. A batch whose groups are all fresh (staleness 0)
skips the recomputation: its sampler log-probs are π_old (as in the synchronous step).

**Placement.** Colocated (default): producer and learner share the devices; publishing a version is
a device-side copy of the trained parameters (the step donates its own). Disaggregated
(``devices.rollout: R``): the producer samples on a mesh of R other devices (``devices.train``
devices train), and a version is published by ``jax.device_put`` of the trained parameters to the
rollout mesh's shardings (``async/weight_transfer_s``). LoRA: only the adapters move; the frozen base
weights are placed on the rollout mesh once.

**Bookkeeping.** The trainer state after step n holds the data-iterator position and PRNG key *as
the producer left them after batch n*, plus ``untrained``: the prompt indices the producer had drawn
beyond it (batches queued or in progress). A checkpoint of step n therefore resumes at the first
prompt not trained; the untrained groups are generated again (with the resumed parameters) from the
same iterator draws and keys — no prompt skipped, none trained twice. ``OUT/rollouts.jsonl`` (process
0) lists every trained step's prompt indices and the version of each group, cut back to the restored
step on resume like ``metrics.jsonl``.

**Metrics** (added to each step's record): ``async/staleness_mean``, ``async/staleness_max``,
``async/staleness_hist/<s>`` (groups per staleness s = 0..k), ``async/queue_depth`` (batches ready
when the learner asked), ``async/learner_idle_s`` (learner waiting for a batch), ``async/producer_idle_s``
(the producer waiting for a version or queue room before this batch), ``async/weight_transfer_s``,
``async/old_logp_s`` (the recomputation), ``async/mismatch_kl`` (mean k3 of π_old against μ over the
batch's tokens, 0 when fresh), and the phase times ``time/generate_s`` (sampling + rewards of the
batch, on the producer), ``time/reference_s``, ``time/update_s``.

One process only: with several processes the producers' collectives would interleave with the
learner's in a different order on every host (refused at construction).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxgrpo import iteration
from jaxgrpo import sharding as shd
from jaxgrpo.metrics import truncate_jsonl
from jaxgrpo.train import Batch, TrainState, make_reference_fn

__all__ = ["AsyncRollouts", "ProducedBatch", "check_single_process", "make_meshes", "LEDGER"]

#: The file (in ``run.out``) listing each trained step's prompt indices and group versions.
LEDGER = "rollouts.jsonl"


def make_meshes(devices_spec, devices=None) -> tuple[Mesh, Mesh | None]:
  """``(train mesh, rollout mesh or None)`` from a ``jaxgrpo.specs.DevicesSpec``.

  Colocated (``rollout`` None): one mesh ``mesh`` over every device (``devices.train`` must then be
  None). Disaggregated: the train mesh (``mesh`` spec) over the first ``train`` devices (None: all but
  the rollout ones) and the rollout mesh (``rollout_mesh`` spec) over the next ``rollout`` devices;
  disjoint by construction. ValueError naming the field when they do not fit.
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
  if jax.process_count() > 1:
    raise ValueError("`devices.rollout` (disaggregated placement) is supported in one process only")
  train = shd.make_mesh(spec, devices=devices[:t])
  rollout = shd.make_mesh(devices_spec.rollout_mesh or None, devices=devices[t : t + r])
  return train, rollout


def check_single_process(max_staleness: int) -> None:
  """ValueError when the pipeline would run in several processes (refused before any weight is read)."""
  if jax.process_count() > 1:
    raise ValueError(
      f"`rollout.max_staleness`={max_staleness} / `devices.rollout` run in one process only: with "
      f"{jax.process_count()} processes the producer's collectives would interleave with the learner's in a "
      "different order on every host; multi-host runs use `rollout.max_staleness: 0` and colocated devices"
    )


class ProducedBatch(NamedTuple):
  """One batch from the producer (host side, this process's rows).

  Attributes:
    index: n, the step that trains it (1-based).
    batch: the host :class:`~jaxgrpo.train.Batch`; ``old_logp`` holds the sampler's log-probs.
    metrics: the rollout metrics of ``Trainer._rollout_batch`` (rewards, lengths, dynamic sampling).
    tokens: completion tokens of the batch.
    prompts: ``int64[groups]`` the prompt index of each group, in batch order.
    versions: ``int64[groups]`` the parameter version that sampled each group.
    key_after: the PRNG key after this batch (the trainer state's key once it is trained).
    position_after: the data-iterator position after this batch.
    rounds: the prompt indices of each sampling round (dynamic sampling: several).
    generate_s: wall time of sampling and scoring on the producer.
    producer_idle_s: time the producer waited before it could start this batch.
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
  producer_idle_s: float


class _Stopped(Exception):
  """The pipeline is closing: the producer leaves its batch unfinished."""


class AsyncRollouts:
  """The producer thread, the queue of produced batches and the learner's step of a
  ``jaxgrpo.trainer.Trainer`` (see the module docstring).

  Args:
    trainer: the trainer (its state, iterator, jitted step and reference, ``_rollout_batch``); this
      object replaces its ``train_step`` (``trainer.rollouts``).
    max_staleness: k >= 0.
    rollout_mesh: the mesh the producer samples on (None: the trainer's mesh, colocated).
    steps: the last step the producer samples for (``run.steps``).
    resumed: the trainer state was restored (the ledger is cut back to its step).
  """

  def __init__(self, trainer, *, max_staleness: int, rollout_mesh: Mesh | None = None, steps: int, resumed=False):
    if not isinstance(max_staleness, int) or max_staleness < 0:
      raise ValueError(f"`max_staleness` must be an int >= 0; got {max_staleness!r}")
    check_single_process(max_staleness)
    self.trainer, self.k, self.steps = trainer, max_staleness, steps
    self.colocated = rollout_mesh is None
    self.rollout_mesh = trainer.mesh if rollout_mesh is None else rollout_mesh
    tstate = trainer.state.train
    step_fn = trainer.step_fn
    # the rollout side's placement of the trained parameters (and, once, the frozen ones)
    rules = step_fn.rules
    if self.colocated:
      self._transfer = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=step_fn.shardings.params)
      self._frozen = tstate.frozen
    else:
      self.rollout_shardings = shd.tree_shardings(tstate.params, self.rollout_mesh, rules)
      self._transfer = lambda t: jax.device_put(t, self.rollout_shardings)
      self._frozen = None
      if tstate.frozen is not None and jax.tree.leaves(tstate.frozen):
        self._frozen = jax.device_put(tstate.frozen, shd.tree_shardings(tstate.frozen, self.rollout_mesh, rules))
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
    self._cond = threading.Condition()
    self._queue: collections.deque[ProducedBatch] = collections.deque()
    self._published: tuple[int, Any] | None = None
    self._error: BaseException | None = None
    self._stop = False
    self._thread: threading.Thread | None = None
    self._busy = threading.Lock()  # held while the producer samples and scores (paused() waits for it)
    self._drawn: list[list[int]] = []  # rounds drawn by the producer beyond the trained position
    self._last_transfer_s = 0.0
    out = trainer.config.run.out
    self._ledger = os.path.join(out, LEDGER) if jax.process_index() == 0 else None
    self._resumed = resumed
    self._check_untrained = list(trainer.state.data_position.get("untrained", []))
    #: called with every trained :class:`ProducedBatch` (inspection, tests); None: nothing
    self.observe: Callable[[ProducedBatch], None] | None = None

  # ------------------------------------------------------------------ lifecycle
  def start(self) -> None:
    """Publishes the current parameters (version = the state's step) and starts the producer."""
    if self._thread is not None:
      return
    t = self.trainer
    step = int(t.state.train.step)
    if self._ledger is not None:
      os.makedirs(os.path.dirname(self._ledger), exist_ok=True)
      if self._resumed:
        truncate_jsonl(self._ledger, step)
      elif step == 0 and os.path.exists(self._ledger):
        os.remove(self._ledger)
    # the producer draws from the trained position (after a close(), the iterator is ahead of it)
    t.iterator.restore(t.state.data_position)
    self._queue.clear()
    self._drawn, self._stop, self._error = [], False, None
    self._publish(step, t.state.train.params)
    self._next_index, self._key = step + 1, t.state.key
    self._thread = threading.Thread(target=self._produce_loop, name="jaxgrpo-rollout-producer", daemon=True)
    self._thread.start()

  def close(self, timeout: float = 600.0) -> None:
    """Stops the producer (it finishes the sampling call in flight) and drops the queued batches; a
    later :meth:`start` (the next ``train_step``) samples them again from the trained position."""
    with self._cond:
      self._stop = True
      self._cond.notify_all()
    if self._thread is not None:
      self._thread.join(timeout)
    self._thread = None
    self._queue.clear()

  @contextlib.contextmanager
  def paused(self):
    """Holds the producer between two batches (e.g. while the trainer evaluates with the shared
    reward workers)."""
    with self._busy:
      yield

  # ------------------------------------------------------------------ producer
  def _publish(self, version: int, params) -> None:
    t0 = time.perf_counter()
    placed = jax.block_until_ready(self._transfer(params))
    self._last_transfer_s = time.perf_counter() - t0
    with self._cond:
      self._published = (version, placed)
      self._cond.notify_all()

  def _latest(self) -> tuple[int, Any]:
    with self._cond:
      return self._published

  def _sample(self, indices, key, versions: list, rounds: list):
    """One sampling round of the producer: the newest published version on the rollout mesh."""
    drawn = [int(i) for i in indices]
    with self._cond:
      if self._stop:
        raise _Stopped
      version, params = self._published
      self._drawn.append(drawn)
    versions.append(version)
    rounds.append(drawn)
    model = iteration.policy_model(self.trainer.graphdef, TrainState(params, None, None, self._frozen))
    return self.trainer._sample(indices, key, policy=model, mesh=self.rollout_mesh)

  def _produce(self, n: int, idle: float) -> ProducedBatch:
    """Batch n: the trainer's rollout batch (dynamic sampling included) from the producer's key,
    each sampling round on the newest published version."""
    t1 = time.perf_counter()
    tr = self.trainer
    key, sample_key = jax.random.split(self._key)
    versions: list[int] = []
    rounds: list[list[int]] = []
    groups: list[tuple[int, int]] = []
    batch, metrics, tokens = tr._rollout_batch(
      sample_key, sample=lambda i, k: self._sample(i, k, versions, rounds), kept_groups=groups
    )
    return ProducedBatch(
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
      producer_idle_s=idle,
    )

  def _produce_loop(self) -> None:
    try:
      while True:
        n = self._next_index
        if n > self.steps:
          return
        t0 = time.perf_counter()
        with self._cond:  # version n-1-k must exist; at most k+1 batches ahead of the learner
          while not self._stop and self._published[0] < n - 1 - self.k:
            self._cond.wait()
          if self._stop:
            return
        idle = time.perf_counter() - t0
        with self._busy:
          produced = self._produce(n, idle)
        with self._cond:
          self._queue.append(produced)
          self._key, self._next_index = produced.key_after, n + 1
          self._cond.notify_all()
    except _Stopped:
      return
    except BaseException as e:  # handed to the learner, raised in its thread
      with self._cond:
        self._error = e
        self._cond.notify_all()

  # ------------------------------------------------------------------ learner
  def _next_batch(self) -> tuple[ProducedBatch, int, float]:
    t0 = time.perf_counter()
    with self._cond:
      depth = len(self._queue)
      while not self._queue and self._error is None:
        if self._thread is None or not self._thread.is_alive():
          raise RuntimeError("the rollout producer stopped without a batch (was the pipeline closed?)")
        self._cond.wait(1.0)
      if self._error is not None and not self._queue:
        raise self._error
      item = self._queue.popleft()
      # the prompts of this batch are trained from now on: drop them from the untrained record
      del self._drawn[: len(item.rounds)]
    return item, depth, time.perf_counter() - t0

  def untrained(self) -> list[list[int]]:
    """The prompt indices of every sampling round drawn beyond the trained position (queued or in
    progress), in drawing order: what a checkpoint records as not yet trained."""
    with self._cond:
      return [list(r) for r in self._drawn]

  def train_step(self) -> dict[str, Any]:
    """One learner step: the next produced batch → (recomputed π_old) → reference → update →
    publish; returns its metrics (the trainer's, plus ``async/*`` and ``time/*``)."""
    tr = self.trainer
    self.start()
    t0 = time.perf_counter()
    item, depth, waited = self._next_batch()
    tstate = tr.state.train
    n = int(tstate.step) + 1
    if item.index != n:
      raise RuntimeError(f"the producer's batch {item.index} reached the learner at step {n}")
    staleness = (n - 1) - item.versions
    if staleness.size and (staleness.max() > self.k or staleness.min() < 0):
      raise RuntimeError(
        f"step {n}: a group of staleness {int(staleness.max())} outside [0, {self.k}] (versions "
        f"{item.versions.tolist()}): the producer broke the staleness bound"
      )
    self._check_resumed(item)
    placed = iteration.place(item.batch, mesh=tr.mesh, train_config=tr.train_config, process_local=True)
    t1 = time.perf_counter()
    mismatch, old_logp_s = 0.0, 0.0
    if staleness.any():
      params = nnx.merge_state(tstate.params, tstate.frozen) if self._merged else tstate.params
      old = jax.block_until_ready(self._policy_logp(params, placed))
      mismatch = _mean_k3(np.asarray(old), np.asarray(placed.old_logp), np.asarray(placed.mask))
      placed = placed._replace(old_logp=old, behavior_logp=placed.old_logp)
      old_logp_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    if tr.reference is not None:
      placed = tr.reference(placed)
      jax.block_until_ready(placed.ref_logp)
    t3 = time.perf_counter()
    tstate, step_metrics = tr.step_fn(tstate, placed)
    step_metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
    t4 = time.perf_counter()
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
        "async/learner_idle_s": waited,
        "async/producer_idle_s": item.producer_idle_s,
        "async/weight_transfer_s": self._last_transfer_s,
        "async/old_logp_s": old_logp_s,
        "async/mismatch_kl": mismatch,
        "time/generate_s": item.generate_s,
        "time/reference_s": t3 - t2,
        "time/update_s": t4 - t3,
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


def _mean_k3(old: np.ndarray, behavior: np.ndarray, mask: np.ndarray) -> float:
  """Mean over real tokens of ``k3 = r − log r − 1``, ``r = exp(old − behavior)`` (KL(μ‖π_old) under
  μ's samples, as ``jaxgrpo.importance``'s ``mismatch_kl``)."""
  m = mask.astype(bool)
  if not m.any():
    return 0.0
  d = np.clip((old - behavior)[m].astype(np.float64), -20.0, 20.0)
  return float(np.mean(np.exp(d) - d - 1.0))
