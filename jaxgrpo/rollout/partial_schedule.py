"""Partial rollouts under the bounded-staleness schedule (``rollout.partial``; docs/async.md, "Partial rollouts").

:class:`PartialRollouts` is ``AsyncRollouts`` whose batches come from a :class:`~jaxgrpo.rollout.partial.RowPool`
kept across weight updates: producing batch m with the newest published version v decodes until
``prompts_per_step`` groups are complete and takes those (drawing order); rows still running stay in their
slots and continue, re-prefilled, under the next version. Every token carries its version and the log-prob it
was sampled with (the batch's ``old_logp``; the learner recomputes π_old and keeps them as μ, so TIS/MIS weigh
each token by π_old/μ of its own version).

Staleness, per token: a token of version u trained in step m has staleness ``m - 1 - u``. The producer runs
``ahead`` <= k - 1 batches ahead of the learner (default k - 1), leaving k - ahead versions for a row to cross.
A group started with version u must be trained by batch u + 1 + k; a new group starts only while every started
group can still meet its deadline (at most ``prompts_per_step`` groups per batch: ``RowPool.may_start``), and
producing batch m does not stop while a group holding a token older than ``m - k`` is incomplete (left running,
it could not be trained in batch m + 1 within k): such rows are finished now (no new rows enter meanwhile;
``rollout/finishing_boundaries``). Before producing batch m, any group (running, queued or complete) still
holding a token older than ``m - 1 - k`` — a complete group that waited, a restored or altered pool — is
dropped and counted (``rollout/dropped_rows``, ``rollout/dropped_rows_total``; the ledger's ``dropped``), never
trained; the learner then checks every trained group's oldest token against k as before.

Checkpoints: the state after step n records the prompts drawn and not yet trained nor dropped
(``data_position["untrained"]``, one round, drawing order) and the iterator's position after batch n was
produced; the rows in flight are **discarded**, and a resume draws those prompts again first (sampled anew
with the restored version), then continues the iterator. So kill and resume train or drop every drawn prompt
exactly once, in drawing order up to the pool's reordering of groups that finish early.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxgrpo import data as data_lib
from jaxgrpo.data import rewards as rewards_lib
from jaxgrpo.rollout.async_rollout import AsyncRollouts, ProducedBatch
from jaxgrpo.rollout.partial import PoolGroup, RowPool
from jaxgrpo.rollout.partial_env import EpisodePool
from jaxgrpo.rollout.sampling import Rollout
from jaxgrpo.step import feed
from jaxgrpo.step.batch import Batch
from jaxgrpo.step.train import TrainState

__all__ = ["PartialRollouts"]


class PartialRollouts(AsyncRollouts):
  """``AsyncRollouts`` with partial rollouts (the module docstring).

  Args:
    source, learner, state, max_staleness, rollout_mesh, steps, out_dir, resumed, profile: as for
      ``AsyncRollouts`` (k = ``max_staleness`` >= 1: the bound on every token).
    num_slots: rows in flight (None: a step's B·G rows).
    refill_every, refill: the pool's boundaries (``RowPool``).
    ahead: batches produced ahead of the learner, in ``[0, k - 1]`` (None: k - 1).
    budget_of: ``RowPool``'s (benchmarks: imposed completion lengths).
  """

  def __init__(
    self,
    source,
    learner,
    state,
    *,
    max_staleness: int,
    num_slots: int | None = None,
    refill_every: int = 8,
    refill: bool = True,
    ahead: int | None = None,
    budget_of=None,
    **kw,
  ):
    super().__init__(source, learner, state, max_staleness=max_staleness, **kw)
    if max_staleness < 1:
      raise ValueError(f"partial rollouts need `max_staleness` >= 1 (a row crosses a version); got {max_staleness}")
    ahead = max_staleness - 1 if ahead is None else ahead
    if not 0 <= ahead < max_staleness:
      raise ValueError(
        f"`rollout.partial.ahead`={ahead} must be in [0, max_staleness - 1 = {max_staleness - 1}]: a row carried "
        "into the next batch would otherwise be older than max_staleness"
      )
    if jax.process_count() > 1:
      raise ValueError("partial rollouts run in one process (the row pool is this process's)")
    self.ahead = ahead
    rows = source.rows_per_step
    if source.turns is not None:  # multi-turn: trajectories kept turn by turn (jaxgrpo.rollout.partial_env)
      self.pool = EpisodePool(source, num_slots=rows if num_slots is None else num_slots, refill=refill)
    else:
      self.pool = RowPool(
        sampling=source.sampling,
        temperature=source.temperature,
        prompt_len=source.prompt_len,
        num_slots=rows if num_slots is None else num_slots,
        refill_every=refill_every,
        refill=refill,
        budget_of=budget_of,
      )
    self.dropped_rows_total = 0
    self._dropped_by_index: dict[int, list[int]] = {}  # batch index -> prompts dropped while producing it

  def start(self, state) -> None:
    """As ``AsyncRollouts.start``; the pool starts empty with the state's untrained prompts queued first."""
    if self._started:
      return
    super().start(state)
    self.pool.reset()
    self._resume_round = [int(p) for r in state[2].get("untrained", []) for p in r]

  def close(self, timeout: float | None = None) -> None:
    """As ``AsyncRollouts.close``; the rows in flight are dropped too (drawn again after a restart)."""
    super().close(timeout)
    self.pool.reset()

  def _draw(self, rounds: list) -> list[int]:
    if self._resume_round:
      out, self._resume_round = self._resume_round, []
    else:
      out = [int(i) for i in self.source.iterator.next(self.source.prompts_per_step)]
    rounds.append(out)
    return out

  def _produce(self, dispatched) -> None:
    n = self._next_index
    key, sample_key = jax.random.split(self._key)
    version, params = self._published
    model = feed.policy_model(self.graphdef, TrainState(params, None, None, self._frozen))
    t0 = time.perf_counter()
    dropped = self.pool.drop_older(n - 1 - self.k)
    rounds: list = []
    info = self.pool.run(
      model,
      version,
      sample_key,
      need=self.source.prompts_per_step,
      draw=lambda: self._draw(rounds),
      prompt_tokens=None if self.source.prompts is None else self.source.prompts.tokens,
      batch=n,
      max_staleness=self.k,
      on_dispatched=dispatched,
    )
    groups = self.pool.take(self.source.prompts_per_step)
    batch, metrics, tokens, versions = self._scored(groups)
    dropped_rows = sum(len(g.rows) for g in dropped)
    self.dropped_rows_total += dropped_rows
    spans = np.asarray([r.span()[1] - r.span()[0] for g in groups for r in g.rows])
    metrics.update(
      {
        "rollout/partial_rows": int((spans > 0).sum()),
        "rollout/version_span": int(spans.max()),
        "rollout/dropped_rows": dropped_rows,
        "rollout/dropped_rows_total": self.dropped_rows_total,
        "rollout/in_flight_rows": self.pool.running(),
        "rollout/reprefilled_rows": info["reprefilled"],
        "rollout/boundaries": info["boundaries"],
        "rollout/finishing_boundaries": info["finishing_boundaries"],
      }
    )
    self._drawn += rounds
    untrained = self.pool.untrained()
    self._queue.append(
      ProducedBatch(
        index=n,
        batch=batch,
        metrics=metrics,
        tokens=tokens,
        prompts=np.asarray([g.prompt for g in groups], np.int64),
        versions=np.asarray([g.oldest() for g in groups], np.int64),
        key_after=key,
        position_after={**self.source.iterator.state(), "untrained": [untrained] if untrained else []},
        rounds=rounds,
        generate_s=time.perf_counter() - t0,
        token_versions=versions,
      )
    )
    self._dropped_by_index[n] = [g.prompt for g in dropped]
    self._key, self._next_index = key, n + 1

  def _scored(self, groups: list[PoolGroup]) -> tuple[Batch, dict, int, np.ndarray]:
    """The host batch of ``groups`` (their rows, scored by the source's rewards), its rollout metrics, its
    completion tokens and the ``int64[rows, T]`` token versions."""
    if isinstance(self.pool, EpisodePool):  # environment rewards, policy and observation tokens
      return self.pool.scored(groups)
    src, g = self.source, self.source.sampling.num_samples
    prompts = [grp.prompt for grp in groups]
    tokens, mask = data_lib.pad_left([src.prompts.tokens[i] for i in prompts], src.prompt_len, src.pad_id)
    rows = [r for grp in groups for r in grp.rows]
    t_max = rows[0].tokens.shape[0]
    lengths = np.asarray([r.t for r in rows], np.int32)
    rollout = Rollout(
      prompt_tokens=np.repeat(tokens, g, axis=0),
      prompt_mask=np.repeat(mask, g, axis=0),
      completions=np.stack([r.tokens for r in rows]),
      mask=np.arange(t_max)[None] < lengths[:, None],
      log_probs=np.stack([r.logp for r in rows]),
      group_ids=np.repeat(np.arange(len(groups), dtype=np.int32), g),
      num_steps=None,
      routing=None,
    )
    res = src.score(prompts, rollout)
    rewards = np.asarray(res.total, np.float32)
    metrics = rewards_lib.finite_reward_stats(rewards)
    for name, values in res.per_fn.items():
      metrics[f"reward/{name}"] = rewards_lib.finite_reward_stats(np.asarray(values, np.float32))["reward_mean"]
    metrics["completion_length"] = float(lengths.mean())
    for k in sorted(res.counters):
      metrics[f"reward_counters/{k}"] = res.counters[k]
    versions = np.stack([r.versions for r in rows])
    return Batch.from_rollout(rollout, rewards), metrics, int(lengths.sum()), versions

  def untrained(self) -> list[list[int]]:
    """The prompts drawn and neither trained nor dropped (one round, drawing order)."""
    u = self.pool.untrained() + [int(p) for b in self._queue for p in b.prompts]
    return [u] if u else []

  def _position_after(self, item: ProducedBatch) -> dict:
    return item.position_after

  def _ledger_record(self, n: int, item: ProducedBatch) -> dict:
    rec = super()._ledger_record(n, item)
    live = item.token_versions[item.token_versions >= 0]
    rec["newest"] = int(live.max()) if live.size else None
    rec["dropped"] = self._dropped_by_index.pop(n, [])
    return rec
