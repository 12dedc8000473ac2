"""How a run's steps meet the rollout source: the learner and the synchronous schedule.

::

    Learner        places a produced batch on the train mesh (``feed.place``: buckets, packing, each
                   process its own rows), recomputes ``old_logp`` under the current parameters when the
                   sampler's log-probs are not the policy's (an engine's; an older version's) and keeps
                   the sampler's as ``behavior_logp``, runs the reference pass (β > 0) and the jitted step
    Synchronous    one step = the source's batch of the current policy, then the learner
    AsyncRollouts  (``jaxgrpo.loop.async_rollout``) bounded staleness: batches of older versions,
                   produced while the learner updates

A schedule takes the run's state ``(train, key, data_position)`` and returns a :class:`StepOut`; it
holds no train state between steps, so the loop (``jaxgrpo.run.trainer``) owns the one copy that is
checkpointed. Which schedule a run uses, and with which source, is decided by ``jaxgrpo.run.assemble``
from the config — the loop does not branch on it.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax

from jaxgrpo.loop import collect
from jaxgrpo.loop.source import RolloutSource
from jaxgrpo.step import feed
from jaxgrpo.step.batch import Batch
from jaxgrpo.step.train import TrainState, TrainStep

__all__ = ["Learner", "StepOut", "Synchronous", "step_metrics"]


class StepOut(NamedTuple):
  """The state after a step (``train``, ``key``, ``data_position``) and the step's metrics."""

  train: TrainState
  key: Any
  data_position: dict
  metrics: dict


class Learner:
  """What a step applies to a produced batch: placement, π_old recomputation, reference, teacher, update.

  Args:
    step_fn: the jitted step (``jaxgrpo.step.train.make_train_step``).
    reference: the frozen reference (``feed.make_reference``), or None (β = 0).
    mesh: the train mesh; ``train_config``: the step's ``TrainConfig`` (buckets, packing).
    teacher: a distillation teacher (``feed.make_teacher``), or None. It scores the batch here, on the learner
      side, after placement: the exact rows, packing and tokens the step trains (an async or partial batch
      included), with ``old_logp`` already the policy's when it was recomputed.
  """

  def __init__(self, step_fn: TrainStep, reference, *, mesh, train_config, teacher=None):
    self.step_fn, self.reference, self.mesh, self.train_config = step_fn, reference, mesh, train_config
    self.teacher = teacher
    self._mismatch = jax.jit(collect.sampled_token_mismatch)

  def policy_logp(self, train: TrainState, placed: Batch) -> jax.Array:
    """``f32[B, T]`` the policy's log-probs of ``placed``'s completions under ``train``'s parameters
    (``collect.policy_logp_fn``: the step's micro-batches, temperature and packing)."""
    return collect.policy_logp_fn(self.step_fn)(feed.policy_params(train), placed)

  def __call__(self, train: TrainState, batch: Batch, *, recompute: bool, timed: bool = False) -> dict:
    """Dispatches the step on host ``batch`` (nothing waited for unless ``timed``). ``recompute``: the
    batch's ``old_logp`` are the sampler's, not this policy's: they become ``behavior_logp`` (μ, read by
    ``objective.importance_correction``) and ``old_logp`` is recomputed; ``mismatch`` is then
    ``(k3, max |log π_old − log μ|)`` over the sampled tokens (``kernels.importance.mismatch_k3``).

    Returns ``{"state", "metrics", "mismatch", "times", "t0"}`` (``times``: the phases, when ``timed``)."""
    out: dict[str, Any] = {"t0": time.perf_counter(), "times": {}, "mismatch": None}
    placed = feed.place(batch, mesh=self.mesh, train_config=self.train_config, process_local=True)
    t1 = time.perf_counter()
    if recompute:  # collect.recompute_old_logp: the engine path's recomputation too
      logp_fn = collect.policy_logp_fn(self.step_fn)
      params = feed.policy_params(train)
      placed, out["mismatch"] = collect.recompute_old_logp(logp_fn, params, placed, mismatch=self._mismatch)
      if timed:
        jax.block_until_ready((placed.old_logp, out["mismatch"]))
    if timed:
      out["times"]["async/old_logp_s"] = time.perf_counter() - t1 if recompute else 0.0
    t2 = time.perf_counter()
    if self.reference is not None:
      placed = self.reference(placed)
      if timed:
        jax.block_until_ready(placed.ref_logp)
    t3 = time.perf_counter()
    if self.teacher is not None and placed.teacher_logp is None:  # scored when sampled: dynamic sampling's
      placed = self.teacher(placed)
      if timed:
        jax.block_until_ready(placed.teacher_logp)
    t4 = time.perf_counter()
    out["state"], out["metrics"] = self.step_fn(train, placed)
    if timed:
      jax.block_until_ready((out["state"], out["metrics"]))
      out["times"].update({"time/reference_s": t3 - t2, "time/update_s": time.perf_counter() - t4})
      if self.teacher is not None:
        out["times"]["time/teacher_s"] = t4 - t3
    return out


def step_metrics(
  rollout_metrics: dict, tokens: int, rollout_s: float, learned: dict, *, t0: float, engine: bool
) -> dict:
  """A step's metrics (waits for the update): the rollout's (``Produced.metrics``), the update's, ``step``,
  ``tokens_per_sec`` (``tokens`` over the seconds since ``t0``), ``step_time``, ``rollout_time``
  (``rollout_s``) and, for an engine's batch, ``engine/mismatch_k3`` and ``engine/logp_abs_diff_max``."""
  fetched = jax.device_get(learned["metrics"])
  seconds = time.perf_counter() - t0
  metrics = dict(rollout_metrics)
  if engine and learned["mismatch"] is not None:
    k3, diff = jax.device_get(learned["mismatch"])
    metrics.update({"engine/mismatch_k3": float(k3), "engine/logp_abs_diff_max": float(diff)})
  metrics.update({k: float(v) for k, v in fetched.items()})
  metrics.update(
    {
      "step": int(learned["state"].step),
      "tokens_per_sec": tokens / seconds,
      "step_time": seconds,
      "rollout_time": rollout_s,
    }
  )
  metrics.setdefault("kl", 0.0)
  return metrics


class Synchronous:
  """One step: the source's batch of the current policy (version = the state's step), then the learner."""

  def __init__(self, source: RolloutSource, learner: Learner):
    self.source, self.learner = source, learner

  def step(self, state) -> StepOut:
    """``state``: ``(train, key, data_position)`` → the state after one step and its metrics."""
    t0 = time.perf_counter()
    train, key, _ = state
    key, sample_key = jax.random.split(key)
    produced = self.source.batch(sample_key, version=int(train.step))
    engine = not self.source.logprobs_are_policy
    learned = self.learner(train, produced.batch, recompute=engine)
    metrics = step_metrics(produced.metrics, produced.tokens, produced.rollout_s, learned, t0=t0, engine=engine)
    return StepOut(learned["state"], key, self.source.iterator.state(), metrics)

  def close(self) -> None:
    """Nothing is produced ahead."""
