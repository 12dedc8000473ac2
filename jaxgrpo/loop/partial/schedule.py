"""Partial rollouts under the bounded-staleness schedule (``rollout.partial``; docs/trainer.md, "Partial rollouts").

:class:`PartialRollouts` is ``AsyncRollouts`` whose batches come from a :class:`~jaxgrpo.loop.partial.pool.RowPool`
kept across weight updates (an engine's run: :class:`~jaxgrpo.loop.partial.engine.EnginePool`, which
re-submits each running row to the engine at every boundary): producing batch m with the newest published
version v decodes until ``prompts_per_step`` groups are complete and takes those (drawing order); rows still running stay in their
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

Dynamic sampling (``objective.dynamic_sampling``): each complete group is scored once and filtered when its
rewards are all equal (the synchronous rule), unless a distillation teacher (``objective.distill``) still
disagrees with the student on its tokens: the teacher scores each complete group once, and the step trains on
those log-probs; rounds of the pool run until ``prompts_per_step`` informative groups are complete, at most
``max_rounds``, then the batch is filled with filtered groups as the synchronous path fills it
(:meth:`PartialRollouts._informative`). Filtered prompts are consumed (the ledger's ``filtered``). Several
processes: each pool filters its own groups for its own block (with a teacher, whose pass spans the processes,
in turns every process takes); the counts are summed, the rounds the largest.

Checkpoints: the state after step n records the prompts drawn and not yet trained nor dropped
(``data_position["untrained"]``, one round, drawing order; filtered prompts are not) and the iterator's position after batch n was
produced; the rows in flight are **discarded**, and a resume draws those prompts again first (sampled anew
with the restored version), then continues the iterator. So kill and resume train or drop every drawn prompt
exactly once, in drawing order up to the pool's reordering of groups that finish early.

Several processes (P; colocated or disaggregated). A pool's rows are host state and its programs take each
row's context from the host, so a pool cannot be one program over devices of several processes: **every
process runs a pool of its own**, on its first device of the rollout mesh, with a whole copy of the version
(gathered from the processes' shards once per version; replicated leaves are copied device to device). The
design keeps what one process guarantees:

- *Rows.* The train mesh gives process p the groups ``[first_p, first_p + B/P)`` of a batch (checked at
  construction: P equal disjoint blocks of whole groups). Every process draws the same rounds from its copy of
  the data iterator and queues its share of each: entries ``rank, rank + P, ...`` of the round (rank = p's block
  among the P; the same rule splits a resume's untrained list of any length). Its pool decodes with ``slots``
  slots (default B·G/P) and a batch takes its first B/P complete groups, so the sharded batch holds the same
  number of rows on every process and each process feeds its own; the row keys fold in ``first_p``.
- *Iterator in step.* A process draws a round when its own queue runs dry, so processes may draw different
  numbers of rounds while producing batch m; after it each draws (and queues its share of) the rounds it is
  behind the furthest one (one small all-gather), so every iterator is at the same position.
- *Staleness*, per process and per token, as above with B/P groups per batch (``may_start``, finishing, drops):
  the bound on every token is unchanged.
- *Bookkeeping, global.* Each group keeps its place in the global drawing order (round offset + index in the
  round). After producing batch m one all-gather gives every process the batch's prompts and oldest versions
  (in batch order: by ``first_p``), the dropped groups and the untrained groups (the union over processes, in
  global drawing order), every row's reward and length, and the pool counters; so the ledger (written by process
  0: prompts, versions, ``newest``, ``dropped`` of every process), the checkpoint's ``untrained`` and every
  metric (``rollout/*`` rows summed, ``rollout/version_span`` and the boundary counts the maximum, rewards and
  lengths over all rows) are the same on every process. A resume deals the recorded untrained prompts out again
  (the rule above), so every drawn prompt is trained or dropped exactly once.
- *Order of collectives.* The learner's programs span the processes; with several processes they are
  dispatched at one fixed point of each production (before the pool runs) rather than after the pool's first
  boundary (which a process with enough complete groups never reaches).
"""

from __future__ import annotations

import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxgrpo import data as data_lib
from jaxgrpo.loop import scoring
from jaxgrpo.loop.async_rollout import AsyncRollouts, ProducedBatch
from jaxgrpo.loop.partial.engine import EnginePool
from jaxgrpo.loop.partial.env import EpisodePool
from jaxgrpo.loop.partial.pool import PoolGroup, RowPool
from jaxgrpo.loop.partial.teacher import teacher_scores
from jaxgrpo.parallel import distributed
from jaxgrpo.rewards import reward_set as rewards_lib
from jaxgrpo.rollout.engines import driver
from jaxgrpo.rollout.sampling import Rollout
from jaxgrpo.rollout.speculative import SpeculativeStats
from jaxgrpo.step import feed
from jaxgrpo.step.batch import Batch
from jaxgrpo.step.train import TrainState

__all__ = ["PartialRollouts"]


class PartialRollouts(AsyncRollouts):
  """``AsyncRollouts`` with partial rollouts (the module docstring).

  One job, in over 300 lines: the bounded-staleness schedule when rows stay in flight across updates — which
  pool rows are admitted, finished, scored and trained at each step, and their version bookkeeping.

  Args:
    source, learner, state, max_staleness, rollout_mesh, steps, out_dir, resumed, profile: as for
      ``AsyncRollouts`` (k = ``max_staleness`` >= 1: the bound on every token).
    num_slots: rows in flight, per process (None: a step's B·G rows, B·G/P with P processes).
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
    self.ahead = ahead
    self._init_processes()
    rows = source.rows_per_step // self._procs
    if source.turns is not None:  # multi-turn: trajectories kept turn by turn (jaxgrpo.loop.partial.env)
      self.pool = EpisodePool(source, num_slots=rows if num_slots is None else num_slots, refill=refill)
    else:
      # the built-in engine's rows decode in the pool's own slots; another engine's pool re-submits each running
      # row at every boundary (jaxgrpo.loop.partial.engine)
      on_mesh = driver.samples_on_mesh(source.engine)
      # the built-in engine's rollout.speculative switch: the pool's own verify steps (prompt lookup)
      speculative = {"speculative": getattr(source.engine, "switch", None)}
      engine = (
        speculative if on_mesh else {"engine_for": source.engine_holding, "engine_sampling": source.engine_sampling}
      )
      self.pool = (RowPool if on_mesh else EnginePool)(
        **engine,
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
    self._newest_by_index: dict[int, int | None] = {}  # batch index -> its newest token version (every process)
    # dynamic sampling: the rewards of complete groups, by seq (scored once), and the prompts filtered per batch
    self._group_scores: dict[int, tuple[np.ndarray, dict]] = {}
    self._filtered_by_index: dict[int, list[int]] = {}

  def start(self, state) -> None:
    """As ``AsyncRollouts.start``; the pool starts empty with the state's untrained prompts queued first."""
    if self._started:
      return
    super().start(state)
    self.pool.reset()
    self._group_scores = {}
    self._resume_round = [int(p) for r in state[2].get("untrained", []) for p in r]
    self._iter_rounds, self._drawn_count, self._pos, self._local = 0, 0, {}, None

  def close(self, timeout: float | None = None) -> None:
    """As ``AsyncRollouts.close``; the rows in flight are dropped too (drawn again after a restart)."""
    super().close(timeout)
    self.pool.reset()
    self._group_scores = {}

  def _draw(self, rounds: list) -> list[int]:
    """The next round (the resume's untrained prompts first, then the iterator's), recorded whole in ``rounds``;
    returns this process's share of it (the next round when the share is empty)."""
    while True:
      if self._resume_round:
        out, self._resume_round = self._resume_round, []
      else:
        out = [int(i) for i in self.source.iterator.next(self.source.prompts_per_step)]
        self._iter_rounds += 1
      rounds.append(out)
      share = self._share(out)
      if share:
        return share

  def _produce(self, dispatched) -> None:
    n = self._next_index
    key, sample_key = jax.random.split(self._key)
    version, params = self._published
    model = self._sampling_model(version, params)
    t0 = time.perf_counter()
    self.source.engine_times = {}  # an engine's push_s (engine_for)
    dropped = self.pool.drop_older(n - 1 - self.k)
    rounds: list = []
    sample_key, catch_up_key = self._process_keys(sample_key)
    if self._procs > 1:
      dispatched()  # at a fixed point of every process's sequence of collectives (the module docstring)
    info = self.pool.run(
      model,
      version,
      sample_key,
      need=self._need,
      draw=lambda: self._draw(rounds),
      prompt_tokens=None if self.source.prompts is None else self.source.prompts.tokens,
      batch=n,
      max_staleness=self.k,
      on_dispatched=dispatched if self._procs == 1 else None,
    )
    if self.source.dynamic_sampling:
      groups, scores, filtered, selection = self._informative(model, version, sample_key, n, info, rounds)
    else:
      groups, scores, filtered, selection = self.pool.take(self._need), None, [], None
    self._catch_up(rounds, catch_up_key)  # after every draw (take only removes complete groups: order-free)
    batch, metrics, tokens, versions = self._scored(groups, scores)
    every = self._gather_bookkeeping(groups, dropped, info, versions, filtered, selection)
    self.dropped_rows_total += every["dropped_rows"]
    metrics.update(
      {
        "rollout/partial_rows": every["partial_rows"],
        "rollout/version_span": every["version_span"],
        "rollout/dropped_rows": every["dropped_rows"],
        "rollout/dropped_rows_total": self.dropped_rows_total,
        "rollout/in_flight_rows": every["in_flight"],
        "rollout/reprefilled_rows": every["reprefilled"],
        "rollout/boundaries": every["boundaries"],
        "rollout/finishing_boundaries": every["finishing_boundaries"],
        **every["selection"],
        **every["speculative"],  # rollout.speculative's, when on: over every process's pool
      }
    )
    if not driver.samples_on_mesh(self.source.engine):  # EnginePool, or an EpisodePool's turns through the engine
      metrics.update({**self.source.engine_times, "engine/generate_s": self.pool.generate_s})
    self._drawn += rounds
    untrained = every["untrained"]
    self._queue.append(
      ProducedBatch(
        index=n,
        batch=batch,
        metrics=metrics,
        tokens=tokens,
        prompts=np.asarray(every["prompts"], np.int64),
        versions=np.asarray(every["versions"], np.int64),
        key_after=key,
        position_after={**self.source.iterator.state(), "untrained": [untrained] if untrained else []},
        rounds=rounds,
        generate_s=time.perf_counter() - t0,
        token_versions=versions,
      )
    )
    self._dropped_by_index[n] = every["dropped"]
    self._newest_by_index[n] = every["newest"]
    self._filtered_by_index[n] = every["filtered"]
    self._key, self._next_index = key, n + 1

  def _informative(self, model, version, key, n, info, rounds) -> tuple[list[PoolGroup], tuple, list, dict]:
    """Dynamic sampling (``objective.dynamic_sampling``), the synchronous path's rule and limit on the pool:
    each complete group is scored once; one whose rewards are all equal (``rewards.group_is_informative``,
    what ``collect.select_groups`` applies) leaves the pool, filtered — unless a distillation teacher still
    disagrees with the student on its tokens (its signal above ``min_signal``, :func:`teacher_scores`: the
    synchronous rule too). A round is one :meth:`RowPool.run` to this pool's groups of a batch complete (the
    first is ``_produce``'s, whose ``info`` this adds to); while fewer informative groups are complete and fewer
    than ``max_rounds`` rounds ran, another round decodes (and draws) on. At the limit the batch is filled with
    the filtered groups, earliest drawn first (zero advantage), as ``select_groups`` fills it. With a teacher and
    several processes every process takes every turn of the loop (the teacher's pass spans them), a process
    whose pool is done scoring no rows. Returns (groups, their ``(rewards, per_fn, counters, teacher fields or
    None)``, the filtered groups not trained, ``{"dropped_groups", "rounds"}`` of this pool, and
    ``"kept_by_teacher"`` with a teacher)."""
    src, need, g = self.source, self._need, self.source.sampling.num_samples
    taught, episodes = src.teacher is not None, isinstance(self.pool, EpisodePool)
    counters: dict[str, int] = {}
    spare: list[PoolGroup] = []
    done = 1
    while True:
      fresh = [grp for grp in self.pool.complete() if grp.seq not in self._group_scores]
      rows_of = self._fresh_rows(fresh) if fresh else None
      signal, fields = teacher_scores(src, rows_of, len(fresh), episodes=episodes) if taught else (None, None)
      if fresh:
        if episodes:  # the environments' rewards, in the trajectories
          res = rewards_lib.RewardResult(rows_of.rewards, {}, {})
        else:
          res = src.score([grp.prompt for grp in fresh], rows_of)
        total = np.asarray(res.total, np.float32)
        informative = scoring.informative(total, g)
        for name, count in res.counters.items():
          counters[name] = counters.get(name, 0) + count
        for j, grp in enumerate(fresh):
          rows = slice(j * g, (j + 1) * g)
          per_fn = {name: np.asarray(v, np.float32)[rows] for name, v in res.per_fn.items()}
          # equal rewards, but the teacher still disagrees with the student on the group's tokens: kept
          by_teacher = bool(taught and not informative[j] and signal[j] > src.min_teacher_signal)
          own = None if fields is None else {name: x[rows] for name, x in fields.items()}
          self._group_scores[grp.seq] = (total[rows], per_fn, own, by_teacher)
          if not (informative[j] or by_teacher):
            spare.append(self.pool.groups.pop(grp.seq))
      finished = len(self.pool.complete()) >= need or done >= src.max_rounds
      if taught and self._procs > 1:  # the teacher's pass spans the processes: each turn is taken by all of them
        if all(distributed.gather_objects(finished)):
          break
        if finished:
          continue
      elif finished:
        break
      done += 1
      more = self.pool.run(
        model,
        version,
        jax.random.fold_in(key, done),  # the first round's rows are keyed from `key` itself
        need=need,
        draw=lambda: self._draw(rounds),
        prompt_tokens=None if src.prompts is None else src.prompts.tokens,
        batch=n,
        max_staleness=self.k,
      )
      for name in info:
        info[name] += more[name]
    groups = self.pool.take(need)
    spare.sort(key=lambda grp: grp.seq)  # drawing order (a group drawn early may complete in a later round)
    groups += spare[: need - len(groups)]  # the round limit: zero-advantage groups, earliest drawn first
    used = {grp.seq for grp in groups}
    filtered = [grp for grp in spare if grp.seq not in used]
    scores = [self._group_scores.pop(grp.seq) for grp in groups]
    for grp in filtered:
      self._group_scores.pop(grp.seq)
    live = set(self.pool.groups)  # groups dropped (staleness) since they were scored: forgotten
    self._group_scores = {q: v for q, v in self._group_scores.items() if q in live}
    total = np.concatenate([s[0] for s in scores])
    per_fn = {name: np.concatenate([s[1][name] for s in scores]) for name in scores[0][1]}
    fields = None if not taught else {n: np.concatenate([s[2][n] for s in scores]) for n in scores[0][2]}
    selection = {"dropped_groups": len(spare), "rounds": done}
    if taught:
      selection["kept_by_teacher"] = sum(s[3] for s in scores)
    return groups, (total, per_fn, counters, fields), filtered, selection

  def _fresh_rows(self, fresh: list[PoolGroup]):
    """The complete ``fresh`` groups' rows (this process's, group ids their positions in ``fresh``): a
    :class:`Rollout` of the pool's rows, or an environment pool's trajectories (their rewards in them)."""
    if isinstance(self.pool, EpisodePool):
      return self.pool.scored(fresh)[0]
    return self._rollout(fresh)[0]

  def _rollout(self, groups: list[PoolGroup]) -> tuple[Rollout, np.ndarray]:
    """The :class:`Rollout` of ``groups``' rows (group ids: positions in ``groups``) and the rows' lengths."""
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
    return rollout, lengths

  def _scored(self, groups: list[PoolGroup], scores: tuple | None = None) -> tuple[Batch, dict, int, np.ndarray]:
    """The host batch of ``groups`` (their rows, scored by the source's rewards unless ``scores`` =
    ``(rewards, per_fn, counters, teacher fields or None)`` of these rows is given: :meth:`_informative`'s), its
    rollout metrics (``scoring.batch_metrics`` over every process's rows), its completion tokens and the
    ``int64[rows, T]`` token versions."""
    teacher_fields = {} if scores is None or scores[3] is None else scores[3]  # scored when selected
    if isinstance(self.pool, EpisodePool):  # environment rewards, policy and observation tokens
      batch, *rest = self._scored_episodes(groups)
      return (batch._replace(**teacher_fields), *rest)
    rollout, lengths = self._rollout(groups)
    if scores is None:
      res = self.source.score([grp.prompt for grp in groups], rollout)
      scores = (res.total, res.per_fn, res.counters)
    rewards = np.asarray(scores[0], np.float32)
    every = scoring.gather_scores(rewards, scores[1], lengths, scores[2], self.source.mesh)
    versions = np.stack([r.versions for grp in groups for r in grp.rows])
    rollout = rollout._replace(group_ids=rollout.group_ids + self._first)  # the groups' places in the global batch
    batch = Batch.from_rollout(rollout, rewards)._replace(**teacher_fields)
    return batch, scoring.batch_metrics(*every), int(every[2].sum()), versions

  def _scored_episodes(self, groups: list[PoolGroup]) -> tuple[Batch, dict, int, np.ndarray]:
    """``_scored`` of environment trajectories: their batch (one prompt width on every process), the metrics of
    the synchronous environment batch over every process's rows, the real tokens, the token versions."""
    out, env_metrics, versions = self.pool.scored(groups)
    lengths = out.mask.sum(1).astype(np.int32)
    rewards, _, every_length, _ = scoring.gather_scores(out.rewards, {}, lengths, {}, self.source.mesh)
    rows = Batch.from_rollout(out._replace(group_ids=out.group_ids + self._first), out.rewards)
    rows, env_metrics = scoring.gather_env_rows(rows, env_metrics, self.source.pad_id)
    metrics = scoring.batch_metrics(rewards, {}, every_length, {}, env=env_metrics)
    return rows, metrics, int(every_length.sum()), versions

  def untrained(self) -> list[list[int]]:
    """The prompts drawn and neither trained nor dropped (one round, drawing order; several processes: this
    process's pool, and the queued batches' prompts of every process)."""
    u = self.pool.untrained() + [int(p) for b in self._queue for p in b.prompts]
    return [u] if u else []

  def _position_after(self, item: ProducedBatch) -> dict:
    for done in [i for i in self._newest_by_index if i <= item.index]:  # processes without the ledger
      self._newest_by_index.pop(done)
      self._dropped_by_index.pop(done, None)
      self._filtered_by_index.pop(done, None)
    return item.position_after

  def _ledger_record(self, n: int, item: ProducedBatch) -> dict:
    rec = super()._ledger_record(n, item)
    live = item.token_versions[item.token_versions >= 0]
    rec["newest"] = self._newest_by_index.pop(n, int(live.max()) if live.size else None)
    rec["dropped"] = self._dropped_by_index.pop(n, [])
    filtered = self._filtered_by_index.pop(n, [])
    if self.source.dynamic_sampling:
      rec["filtered"] = filtered
    return rec

  # ------------------------------------------------------------------ several processes (the module docstring)
  def _init_processes(self) -> None:
    """``_procs`` (P), ``_need`` (groups per batch of this process's pool), ``_rank`` and ``_first`` (its block
    of the batch's groups) and ``_device`` (where its pool runs). ValueError unless the train mesh splits the
    batch into P equal disjoint blocks of whole groups."""
    self._procs, self._need, self._rank, self._first, self._device = 1, self.source.prompts_per_step, 0, 0, None
    self._iter_rounds, self._drawn_count, self._pos, self._local = 0, 0, {}, None
    self._local_frozen: tuple | None = None
    procs = jax.process_count()
    if procs == 1:
      return
    b = self.source.prompts_per_step
    first, last = self.source.own_groups_range(b)
    blocks = sorted({(int(a), int(z)) for a, z in distributed.gather_objects([int(first), int(last)])})
    per = b // procs
    if b % procs or blocks != [(i * per, (i + 1) * per) for i in range(procs)]:
      raise ValueError(
        f"partial rollouts with {procs} processes: each process's pool feeds its own block of whole groups, so the "
        f"train mesh (`devices.mesh`) must give the {procs} processes equal disjoint blocks of the "
        f"`rollout.prompts_per_step`={b} groups (G = {self.source.sampling.num_samples} rows each); it gives "
        f"groups {blocks}: put the processes on the batch axes (data or fsdp) and make prompts_per_step a "
        "multiple of the process count"
      )
    self._procs, self._need, self._rank, self._first = procs, per, first // per, first
    self._device = next(d for d in self.rollout_mesh.devices.flat if d.process_index == jax.process_index())

  def _sampling_model(self, version: int, params):
    """The policy the pool samples: the published one (one process), or a whole copy of it on this process's
    device (several; made once per version: a collective, at the same point on every process)."""
    if self._procs == 1:
      return feed.policy_model(self.graphdef, TrainState(params, None, None, self._frozen))
    if self._local_frozen is None:
      self._local_frozen = (None if self._frozen is None else self._to_local(self._frozen),)
    if self._local is None or self._local[0] != version:
      self._local = (version, self._to_local(params))
    return feed.policy_model(self.graphdef, TrainState(self._local[1], None, None, self._local_frozen[0]))

  def _to_local(self, tree):
    """``tree`` (global arrays) whole on this process's device: replicated leaves copied device to device,
    sharded ones gathered from every process's shards (``process_allgather``) first."""

    def one(x):
      if not isinstance(x, jax.Array):
        return x
      if x.is_fully_replicated:
        return jax.device_put(x.addressable_data(0), self._device)
      return jax.device_put(np.asarray(multihost_utils.process_allgather(x, tiled=True)), self._device)

    return jax.tree.map(one, tree)

  def _process_keys(self, sample_key):
    """``(the pool's key, the catch-up rounds' key)``: one process, ``(sample_key, None)``; several, both folded
    with this process's first group (the processes' rows draw different uniforms)."""
    if self._procs == 1:
      return sample_key, None
    return tuple(jax.random.split(jax.random.fold_in(sample_key, self._first)))

  def _share(self, drawn: list[int]) -> list[int]:
    """This process's share of a drawn round (entries ``rank, rank + P, ...``), each group's place in the global
    drawing order recorded by the ``seq`` the pool gives it next."""
    picked = range(self._rank, len(drawn), self._procs)
    for j, i in enumerate(picked):
      self._pos[self.pool.next_seq + j] = self._drawn_count + i
    self._drawn_count += len(drawn)
    return [drawn[i] for i in picked]

  def _catch_up(self, rounds: list, key) -> None:
    """Several processes: draws the rounds this process is behind the furthest one (its share queued), so every
    process's iterator is at the same position."""
    if self._procs == 1:
      return
    behind = max(distributed.gather_objects(self._iter_rounds)) - self._iter_rounds
    for i in range(behind):
      out = [int(p) for p in self.source.iterator.next(self.source.prompts_per_step)]
      self._iter_rounds += 1
      rounds.append(out)
      self.pool.add_round(self._share(out), jax.random.fold_in(key, i))

  def _gather_bookkeeping(
    self, groups: list[PoolGroup], dropped: list[PoolGroup], info: dict, versions, filtered=(), selection=None
  ) -> dict:
    """The produced batch's bookkeeping over every process (one all-gather; one process: its own): the batch's
    prompts and oldest versions (batch order), the dropped, filtered and untrained prompts (global drawing
    order), the row counts, the newest token version and the ``dynamic_sampling/*`` metrics (``selection``:
    this pool's; counts summed, rounds the largest; {} without dynamic sampling)."""
    pos = lambda g: self._pos.pop(g.seq)
    live = versions[versions >= 0]
    mine = {
      "first": self._first,
      "prompts": [g.prompt for g in groups],
      "versions": [g.oldest() for g in groups],
      "spans": [r.span()[1] - r.span()[0] for g in groups for r in g.rows],
      "dropped": [[pos(g), g.prompt] for g in dropped],
      "dropped_rows": sum(len(g.rows) for g in dropped),
      "filtered": [[pos(g), g.prompt] for g in filtered],
      "selection": selection,
      "untrained": [[self._pos[q], g.prompt] for q, g in sorted(self.pool.groups.items())],
      "in_flight": self.pool.running(),
      "newest": int(live.max()) if live.size else None,
      "speculative": self.pool.spec_counts,
      **{k: info[k] for k in ("reprefilled", "boundaries", "finishing_boundaries")},
    }
    for g in groups:
      pos(g)
    every = sorted(distributed.gather_objects(mine), key=lambda e: e["first"])
    spans = np.asarray([s for e in every for s in e["spans"]])
    newest = [e["newest"] for e in every if e["newest"] is not None]
    return {
      "prompts": [p for e in every for p in e["prompts"]],
      "versions": [v for e in every for v in e["versions"]],
      "partial_rows": int((spans > 0).sum()),
      "version_span": int(spans.max()),
      "dropped": [p for _, p in sorted(x for e in every for x in e["dropped"])],
      "dropped_rows": sum(e["dropped_rows"] for e in every),
      "filtered": [p for _, p in sorted(x for e in every for x in e["filtered"])],
      "selection": {}
      if selection is None
      else {
        "dynamic_sampling/dropped_groups": sum(e["selection"]["dropped_groups"] for e in every),
        "dynamic_sampling/rounds": max(e["selection"]["rounds"] for e in every),
        **(
          {"dynamic_sampling/kept_by_teacher": sum(e["selection"]["kept_by_teacher"] for e in every)}
          if "kept_by_teacher" in selection
          else {}
        ),
      },
      "untrained": [p for _, p in sorted(x for e in every for x in e["untrained"])],
      "speculative": _spec_metrics([e["speculative"] for e in every if e["speculative"] is not None]),
      "in_flight": sum(e["in_flight"] for e in every),
      "reprefilled": sum(e["reprefilled"] for e in every),
      "boundaries": max(e["boundaries"] for e in every),
      "finishing_boundaries": max(e["finishing_boundaries"] for e in every),
      "newest": max(newest) if newest else None,
    }


def _spec_metrics(counts: list) -> dict[str, float]:
  """``rollout/speculative_on`` (the share of the processes' pools whose last run speculated: each pool is its own
  process's programs, so ``auto`` may choose per process) and ``rollout/spec_acceptance`` (accepted over drafted,
  summed over those pools: ``SpeculativeStats.acceptance``) of the pools' ``spec_counts`` ``[(speculated, drafted,
  accepted)]``; {} without a switch. One process: the numbers of its pool's own ``sample_metrics``."""
  if not counts:
    return {}
  on = [c for c in counts if c[0]]
  out = {"rollout/speculative_on": len(on) / len(counts)}
  if on:
    summed = SpeculativeStats(0, sum(c[1] for c in on), sum(c[2] for c in on))
    out["rollout/spec_acceptance"] = summed.acceptance
  return out
