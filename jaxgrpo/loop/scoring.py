"""One scorer's bookkeeping for every schedule: the scored rows of a sampling round or a pool's complete groups,
gathered over the processes, and the rollout metrics of a batch.

The synchronous source (``jaxgrpo.loop.source.RolloutSource``; the bounded-staleness producer calls it) and
the partial pools (``jaxgrpo.loop.partial.schedule.PartialRollouts``) score rows the same way (single-turn:
``RolloutSource.score`` with the run's ``RewardSet``; multi-turn: the environments' rewards) and report the same
metrics from the same numbers::

    Scored(rows, rewards, per_fn, lengths, counters, metrics)   this process's host rows; every process's rewards
                                                               (f32[N]), per-function rewards, lengths (int32[N])
    gather_scores(rewards, per_fn, lengths, counters, mesh)    every process's rows, in batch order; counters summed
    gather_env_rows(rows, metrics, pad_id)                     one prompt width, the environments' metrics over
                                                               every process's rows
    batch_metrics(rewards, per_fn, lengths, counters, env=...) reward_mean/std (finite rewards), reward/<fn>,
                                                               completion_length, reward_counters/<k>, env/*
    informative(rewards, group_size)                           bool[groups]: rewards not all equal (dynamic sampling)
    teacher_signal(rows, group_size)                           f32[groups]: a distillation teacher's per-token signal
    gather_groups(values, group_size, mesh)                    every process's per-group values, in batch order
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxgrpo.parallel import distributed
from jaxgrpo.rewards import reward_set as rewards_lib
from jaxgrpo.step.batch import Batch

__all__ = [
  "Scored",
  "batch_metrics",
  "gather_env_rows",
  "gather_groups",
  "gather_scores",
  "informative",
  "pad_prompts",
  "teacher_signal",
]


class Scored(NamedTuple):
  """Scored rows: a sampling round of the source, or a pool's groups.

  Attributes:
    rows: this process's rows (host :class:`~jaxgrpo.step.batch.Batch`, rewards set).
    rewards: ``f32[N]`` every row's reward, every process (batch order).
    per_fn: ``{name: f32[N]}`` every row's unweighted reward per function ({} for environment rewards).
    lengths: ``int32[N]`` every row's completion length.
    counters: the reward functions' counters, summed over the processes.
    metrics: multi-turn: the environments' metrics ({} for single-turn rows).
    signal: ``f32[groups]`` every group's distillation signal (:func:`teacher_signal`) when a teacher scored the
      round for dynamic sampling; None otherwise.
  """

  rows: Batch
  rewards: np.ndarray
  per_fn: dict
  lengths: np.ndarray
  counters: dict
  metrics: dict
  signal: np.ndarray | None = None


def pad_prompts(rows: Batch, width: int, pad_id: int) -> Batch:
  """``rows`` with the prompts left-padded to ``width`` columns."""
  pad = lambda x, v: np.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=v)
  return rows._replace(prompt_tokens=pad(rows.prompt_tokens, pad_id), prompt_mask=pad(rows.prompt_mask, False))


def gather_scores(rewards, per_fn: dict, lengths, counters: dict, mesh) -> tuple[np.ndarray, dict, np.ndarray, dict]:
  """Every process's ``rewards`` (``f32``), ``per_fn`` and ``lengths`` (this process's rows: those
  ``sharding.process_batch_rows`` of ``mesh`` names) in batch order (``distributed.all_rows``), and the counters
  summed over the processes (one all-gather). One process: its own, as given."""
  total, per_fn, lengths = distributed.all_rows((np.asarray(rewards, np.float32), per_fn, lengths), mesh)
  summed: dict[str, int] = {}
  for c in distributed.gather_objects(counters):
    for k, v in c.items():
      summed[k] = summed.get(k, 0) + v
  return total, per_fn, lengths, summed


def gather_groups(values, group_size: int, mesh) -> np.ndarray:
  """Every process's per-group ``values`` (``f32[groups / P]`` of this process's groups: its rows,
  ``sharding.process_batch_rows`` of ``mesh``, hold whole groups of ``group_size``) as ``f32[groups]`` in batch
  order on every process (each value rides on its group's rows through ``distributed.all_rows``, as the rewards
  do). One process: its own, as given."""
  rows = np.repeat(np.asarray(values, np.float32), group_size)
  return distributed.all_rows(rows, mesh)[::group_size]


def gather_env_rows(rows: Batch, metrics: dict, pad_id: int) -> tuple[Batch, dict]:
  """Several processes: ``rows`` (this process's environment trajectories) left-padded to the widest prompt of
  every process (one width for the global arrays) and ``metrics`` (this process's means) the mean over the
  processes (equal rows per process: every row's mean). One process: both as given."""
  every = distributed.gather_objects([rows.prompt_tokens.shape[1], metrics])
  if len(every) == 1:
    return rows, metrics
  rows = pad_prompts(rows, max(w for w, _ in every), pad_id)
  names = sorted({k for _, m in every for k in m})
  return rows, {k: float(np.mean([m.get(k, 0.0) for _, m in every])) for k in names}


def batch_metrics(rewards, per_fn: dict, lengths, counters: dict, *, extra: dict | None = None, env=None) -> dict:
  """A batch's rollout metrics from every row of it: ``reward_mean``/``reward_std`` over the finite ``rewards``
  (``rewards.finite_reward_stats``: a missing sample is not a number to average), ``reward/<name>`` the finite
  mean of each function's ``per_fn`` rewards, ``completion_length`` the mean of ``lengths``, then ``extra`` (e.g.
  ``dynamic_sampling/*``), ``reward_counters/<k>`` (sorted) and the environments' ``env`` metrics."""
  metrics = rewards_lib.finite_reward_stats(np.asarray(rewards, np.float32))
  for name, values in per_fn.items():
    metrics[f"reward/{name}"] = rewards_lib.finite_reward_stats(np.asarray(values, np.float32))["reward_mean"]
  metrics["completion_length"] = float(np.asarray(lengths).mean())
  metrics.update(extra or {})
  for k in sorted(counters):
    metrics[f"reward_counters/{k}"] = counters[k]
  metrics.update(env or {})
  return metrics


def informative(rewards, group_size: int) -> np.ndarray:
  """``bool[groups]``: the groups (``group_size`` consecutive rows of ``rewards``) whose rewards are not all equal
  (``rewards.group_is_informative``: the groups dynamic sampling keeps)."""
  groups = len(rewards) // group_size
  return rewards_lib.group_is_informative(rewards, np.repeat(np.arange(groups), group_size), groups)


def teacher_signal(rows: Batch, group_size: int) -> np.ndarray:
  """``f32[groups]``: each group's (``group_size`` consecutive rows) mean over its distilled tokens (``mask``, and
  ``policy_mask`` in multi-turn rows: observation tokens are not distilled) of ``|log π_s(y_t) − log π_t(y_t)|``,
  the sampler's log-prob (``old_logp``) against the teacher's (``teacher_logp``); 0 for a group without such tokens.

  Why this statistic: the sampled-token advantage is ``w·clip(log π_t − log π_s)`` per token, so a group whose mean
  ``|log π_s − log π_t|`` is below ε moves the policy by at most ``w·ε`` per token from the teacher — as little as
  a zero-advantage group moves it from the rewards; and it is 0 exactly where the teacher agrees with the student on
  every sampled token. It needs only the teacher's log-prob of each sampled token (every form computes it), so
  the top-k forms use it too (their divergence needs the student's logits, which collection does not compute).
  """
  mask = np.asarray(rows.mask, bool)
  if rows.policy_mask is not None:
    mask = mask & np.asarray(rows.policy_mask, bool)
  diff = np.abs(np.asarray(rows.old_logp, np.float64) - np.asarray(rows.teacher_logp, np.float64))
  groups = mask.shape[0] // group_size
  total = np.where(mask, diff, 0.0).reshape(groups, -1).sum(1)
  count = mask.reshape(groups, -1).sum(1)
  return (total / np.maximum(count, 1)).astype(np.float32)
