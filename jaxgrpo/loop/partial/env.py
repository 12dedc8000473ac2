"""Partial rollouts of multi-turn environments: trajectories kept in flight across weight updates, turn by turn.

:class:`EpisodePool` is the environment counterpart of :class:`~jaxgrpo.loop.partial.pool.RowPool` (the same
group bookkeeping: drawing rounds, ``take``, ``drop_older``, the staleness deadlines of ``may_start`` and the
finishing rule; docs/trainer.md, "Partial rollouts"). Its unit of work is a *turn*: every trajectory in one of
the S places samples its next turn with the current version, its environment steps, and the observation is
appended; a trajectory that ends (``done``, an error, ``max_turns``, ``max_tokens``) frees its place for the next
queued one. A batch takes the first ``prompts_per_step`` groups whose G trajectories all ended; the others stay,
and their next turns run under whatever version is published by then. So an episode with many turns no longer
holds the batch back; it finishes in a later one. With the built-in engine's ``rollout.speculative`` each turn is
sampled by ``generate_speculative`` (exact: every token its version's log-prob; ``auto`` compares one run's sampling
seconds of each kind)::

    group drawn --> G environments reset (when its first trajectory gets a place) --> prompt ids
    per boundary, over the trajectories in places:   turn_i = sample(π_v, prompt_i ‖ traj_i)   (one turn)
                                                      env_i.step(turn_i); traj_i += turn_i ‖ observation_i
    a batch = the first complete groups; the rest carry over (their environments with them)

**Version granularity: the turn.** A turn is sampled whole by one version (the version changes only between
batches, and a batch ends at a turn boundary), so every policy token carries the version of its turn and its
behaviour log-prob; observation tokens carry the version of the turn they follow (they are not trained on).
Every turn re-prefills ``prompt ‖ trajectory`` (``jaxgrpo.rollout.environments.rollout.sample_turn``): a
trajectory crossing a version is sampled from exactly ``π_v(· | context)`` — the KV-cached
``ConversationSampler``, whose cache lives for one rollout, is not used here. With an engine
(``rollout.engine``) each turn goes to the engine as token ids, its weights pushed when the version changed.

Checkpoints discard the trajectories in flight (their prompts are recorded as untrained and drawn again on
resume), as for the built-in pool: environments hold state no checkpoint can restore.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxgrpo.loop.episodes import example_row
from jaxgrpo.loop.partial.pool import PoolGroup, RowPool
from jaxgrpo.rollout.engines import driver
from jaxgrpo.rollout.environments import rollout as _episodes

__all__ = ["EpisodePool"]


class _Place:
  """One trajectory of a group (``PoolGroup.rows`` entry): its :class:`Trajectory` once the group started."""

  def __init__(self, prompt: int, group: int, index: int):
    self.prompt, self.group, self.index = prompt, group, index
    self.trajectory: _episodes.Trajectory | None = None
    self.done = False

  @property
  def t(self) -> int:
    """Policy tokens sampled so far."""
    return 0 if self.trajectory is None else sum(self.trajectory.policy)

  def span(self) -> tuple[int, int]:
    """(oldest, newest) version of the sampled policy tokens."""
    tr = self.trajectory
    v = [ver for ver, pol in zip(tr.version, tr.policy) if pol]
    return min(v), max(v)


class EpisodePool(RowPool):
  """S places of multi-turn trajectories kept between batches (the module docstring).

  Args:
    source: the run's rollout source (``jaxgrpo.loop.source.RolloutSource`` with ``turns``): its
      examples, environments, tokenizer, sampling settings, temperature, engine and ``should_stop``.
    num_slots: S >= G, trajectories in flight at once.
    refill: a place freed by an ended trajectory takes the next queued one at the next turn; False: new
      trajectories enter only when none runs.
  """

  def __init__(self, source, *, num_slots: int, refill: bool = True):
    self.source = source
    self.sampling = source.engine_sampling  # what the engine receives (the built-in one: the run's settings)
    self.cfg = source.turns.config
    self.g = self.sampling.num_samples
    if num_slots < self.g:
      raise ValueError(f"`rollout.partial.slots`={num_slots} must hold a group's {self.g} trajectories")
    self.t_max, self.slots, self.refill = self.cfg.max_tokens, num_slots, refill
    self.generate_s = 0.0  # seconds sampling turns in the last run (the engine's ``engine/generate_s``)
    # the built-in engine's rollout.speculative: each turn by generate_speculative (RowPool.run times the kinds)
    self.speculative = getattr(source.engine, "switch", None)
    self.reset()

  def add_round(self, prompts, key) -> None:
    """Queues the G trajectories of each prompt index of ``prompts`` (a drawing round)."""
    for p in (int(p) for p in prompts):
      rows = [_Place(p, self._seq, j) for j in range(self.g)]
      self.groups[self._seq] = PoolGroup(self._seq, p, rows)
      self._queue.extend(rows)
      self._seq += 1

  def _start(self, place: _Place) -> None:
    """The place's group's environments, made and reset when its first trajectory enters."""
    if place.trajectory is not None:
      return
    grp = self.groups[place.group]
    src = self.source
    row = example_row(src.examples[grp.prompt])
    envs = _episodes.make_envs(src.turns.make_env, row, len(grp.rows), grp.seq)
    trs = _episodes.start_group(envs, row, grp.seq, src.tokenizer, self.sampling.eos_ids, self.cfg, src.should_stop)
    for r, tr in zip(grp.rows, trs):
      r.trajectory = tr

  def _readmitted(self) -> list[int]:
    """The trajectories that continue under a new version (every turn re-prefills its context anyway)."""
    return [s for s, r in enumerate(self._slot_rows) if r is not None and r.t > 0]

  def _sampler_seconds(self, t0: float) -> float:
    """The seconds of this run's turn sampling (``rollout.speculative: auto`` compares those, not the
    environments' time)."""
    return self.generate_s

  def _prepare(self, model, version: int, key):
    """What :meth:`_boundary` runs turns with in this ``run``: the source's engine holding ``model`` (version
    ``version``; ``engines.driver.turn_sampler``: the built-in one's pushed policy re-prefilled by ``sample_turn``,
    another engine's ``generate``); the context limit; the turns' key (the rows' keys are not used)."""
    engine = self.source.engine_holding(model, version)
    policy, engine = driver.turn_sampler(engine, model)  # this process's pool: no collective rounds
    sampler = None if engine is not None else policy
    self.generate_s, self._turns = 0.0, 0
    limit = policy.config.max_position_embeddings
    return sampler, engine, jax.random.fold_in(key, 1 << 30), limit

  def _boundary(self, decoder, admit: list[int], version: int, prompt_tokens) -> None:
    """The admitted trajectories' environments started (a group's when its first one enters), then one turn of
    every trajectory in a place (``prompt_tokens`` unused: the environments render the prompts)."""
    for s in admit:
      self._start(self._slot_rows[s])
    sampler, engine, turn_key, limit = decoder
    self._turn(sampler, engine, jax.random.fold_in(turn_key, self._turns), version, limit)
    self._turns += 1

  def _turn(self, sampler, engine, key, version: int, limit: int) -> None:
    """One turn of every trajectory in a place (re-prefilled, one call per stop set), the environments
    stepped concurrently (``add_turns``); ended trajectories leave their places."""
    places = [s for s, r in enumerate(self._slot_rows) if r is not None]
    trs = {s: self._slot_rows[s].trajectory for s in places}
    width = _episodes.context_width(max(len(tr.prompt) for tr in trs.values()), self.cfg, limit)
    sampled, t0 = {}, time.perf_counter()
    on = self._spec_counts is not None and engine is None  # this run speculates (the built-in sampler's turns)
    spec, stats = (self.speculative.config, self.speculative.draft_model) if on else None, np.zeros(3, np.int64)
    for k, rows_now in _episodes.turn_batches(places, {s: trs[s].stop for s in places}, key):
      sampled.update(
        _episodes.sample_turn(
          sampler,
          trs,
          rows_now,
          k,
          self.sampling,
          self.cfg.per_turn,
          width,
          temperature=self.source.temperature,
          engine=engine,
          speculative=spec,
          stats=stats,
        )
      )
    self.generate_s += time.perf_counter() - t0
    if on:
      self._spec_counts = [a + int(b) for a, b in zip(self._spec_counts, stats)]
    self._sampled_total += sum(int(sampled[s][1].sum()) for s in places)
    running = _episodes.add_turns(
      [trs[s] for s in places],
      [_episodes.policy_turn(sampled[s]) for s in places],
      cfg=self.cfg,
      tokenizer=self.source.tokenizer,
      should_stop=self.source.should_stop,
      last_turn=[trs[s].turns == self.cfg.max_turns - 1 for s in places],
      version=version,
    )
    for s, still in zip(places, running):
      if not still:
        self._slot_rows[s].done, self._slot_rows[s] = True, None

  def scored(self, groups: list[PoolGroup]) -> tuple[_episodes.MultiTurnRollout, dict, np.ndarray]:
    """The rollout of the complete ``groups`` (this process's rows; environment rewards), its environment
    metrics (per-trajectory means, ``rollout_metrics``) and the ``int64[rows, T]`` token versions (-1 on
    padding)."""
    trs = [r.trajectory for grp in groups for r in grp.rows]
    out = _episodes.assemble(trs, self.g, self.t_max, self.sampling.pad_id)
    versions = np.full((len(trs), self.t_max), -1, np.int64)
    for i, tr in enumerate(trs):
      versions[i, : len(tr.version)] = tr.version
    return out, _episodes.rollout_metrics(out), versions
