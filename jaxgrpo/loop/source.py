"""The rollout source: one object that yields this process's scored rows of a step's batch.

A source composes what a run's config names, each part an argument rather than a branch of the loop::

    engine      whatever samples (``jaxgrpo.rollout.engines``): the built-in sampler (``BuiltinEngine``, one
                program on a mesh, the default), vLLM or a user's; it gets the policy pushed when the version
                it holds is not the one asked for, and is driven by its capabilities (``engines.driver``:
                one path, no test of which engine it is)
    turns       single-turn: decode, score with the ``RewardSet``; or multi-turn: G trajectories per
                prompt in the environments (``make_env``), rewards theirs, each turn sampled by the engine
    selection   rounds until the batch holds ``prompts_per_step`` groups; with dynamic sampling only
                informative ones (``collect.select_groups``); every process keeps the same groups and
                feeds its own rows

:meth:`RolloutSource.batch` returns the host rows (:class:`Produced`); the learner
(``jaxgrpo.loop.schedule.Learner``) places them, recomputes ``old_logp`` when the sampler's log-probs
are not the policy's (an engine that does not declare ``logprobs_are_policy``, a stale version) and updates.
Scores, their gathering over processes and the batch's metrics are ``jaxgrpo.loop.scoring``'s (the partial
pools use the same). The schedules
(``jaxgrpo.loop.schedule.Synchronous``, ``jaxgrpo.loop.async_rollout.AsyncRollouts``) call the source
with the policy and version they sample; the source holds no train state. It is built from a run config
by ``jaxgrpo.run.assemble``.

Several processes: every process draws the same prompt indices, samples one program on the global mesh,
decodes and scores its own rows; every row's reward and length is then gathered (one small all-gather
per round; with a distillation teacher, every group's signal too), so every process keeps the same groups, in the
same order, as one process would.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np
from flax import nnx

from jaxgrpo import data as data_lib
from jaxgrpo.loop import collect, scoring
from jaxgrpo.loop import episodes as env_training
from jaxgrpo.loop.scoring import Scored, pad_prompts
from jaxgrpo.models import lora
from jaxgrpo.parallel import distributed
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rewards import reward_set as rewards_lib
from jaxgrpo.rollout.engines import driver
from jaxgrpo.rollout.engines.builtin import BuiltinEngine
from jaxgrpo.rollout.environments.rollout import MultiTurnConfig
from jaxgrpo.rollout.sampling import Rollout, SamplingConfig
from jaxgrpo.step.batch import Batch

__all__ = ["RolloutSource", "Produced", "Turns", "pad_prompts", "rows_to_columns"]


class Produced(NamedTuple):
  """What :meth:`RolloutSource.batch` returns.

  Attributes:
    batch: this process's rows as a host :class:`~jaxgrpo.step.batch.Batch` (``old_logp`` the sampler's
      log-probs; ``policy_mask`` for multi-turn rows; ``group_ids`` the group's position in the batch).
    metrics: ``{name: float}``: rewards, completion length, dynamic sampling, env and engine metrics.
    tokens: completion tokens of the whole batch (every process).
    rounds: the prompt indices drawn by each sampling round (dynamic sampling: several).
    kept: ``(round, group)`` of every group of the batch, in batch order.
    version: the policy version that sampled the batch (as given to :meth:`RolloutSource.batch`).
    rollout_s: seconds of sampling and scoring.
  """

  batch: Batch
  metrics: dict
  tokens: int
  rounds: list
  kept: list
  version: Any
  rollout_s: float


@dataclasses.dataclass(frozen=True)
class Turns:
  """Multi-turn rollouts: ``make_env(row) -> Environment`` and the per-turn settings."""

  make_env: Callable
  config: MultiTurnConfig


def rows_to_columns(examples: Sequence[data_lib.MathExample], repeat: int) -> dict[str, list]:
  """Per-row reward columns: ``answer`` plus every dataset column, each example repeated ``repeat`` times."""
  cols: dict[str, list] = {"answer": []}
  for ex in examples:
    for k in ex.columns:
      if k != "answer":
        cols.setdefault(k, [])
  for ex in examples:
    for _ in range(repeat):
      cols["answer"].append(ex.answer)
      for k in cols:
        if k != "answer":
          cols[k].append(ex.columns.get(k))
  return cols


class RolloutSource:
  """Yields this process's scored rows of a step's batch (see the module docstring).

  Args:
    policy: ``policy() -> nnx.Module``, the current policy (parameters of the current train state): what
      :meth:`batch` samples when it is given no other.
    sampling: the :class:`~jaxgrpo.rollout.sampling.SamplingConfig` (G = ``num_samples``).
    temperature: the sampling temperature (the step's ``TrainConfig.temperature``).
    mesh: the train mesh (prompts are placed on it unless a call names another).
    iterator: the ``data.PromptIterator`` over ``examples`` (its position is the run's data position).
    examples: the training rows (``data.MathExample``, or environment episode rows).
    prompts, prompt_len, pad_id: the encoded prompts (None for environment episodes).
    tokenizer: decodes completions (single-turn scoring) and renders turns (multi-turn).
    reward_set: a ``rewards.reward_set.RewardSet`` (single-turn).
    prompts_per_step: B, groups per step.
    dynamic_sampling, max_rounds: drop groups with equal rewards and sample again, at most ``max_rounds``.
    merge_lora: sample the merged policy (``models.lora.merge_lora``).
    engine: what samples (``jaxgrpo.rollout.engines.Engine``; None: a
      :class:`~jaxgrpo.rollout.engines.builtin.BuiltinEngine`, the built-in sampler); ``engine_sampling`` the
      SamplingConfig it receives (None: ``sampling``). How it is driven follows its capabilities
      (``jaxgrpo.rollout.engines.driver``), never its name.
    logprobs_are_policy: the engine's log-probs are the policy's own (the built-in sampler; an engine that
      declares it): False makes the learner recompute ``old_logp`` and keep these as ``behavior_logp``.
    turns: :class:`Turns` for multi-turn rollouts (None: single-turn).
    should_stop: polled during environment calls (a signal stops a hung environment).
    teacher: ``teacher(rows) -> rows`` with the teacher's fields filled (``feed.teacher_host_scores``): dynamic
      sampling with a distillation teacher. Each round is scored by it when it is sampled, a group is kept when its
      rewards vary or its teacher signal (``scoring.teacher_signal``) is above ``min_teacher_signal``, and the
      batch carries those log-probs to the step (``dynamic_sampling/kept_by_teacher``: the groups kept for the
      teacher alone). Several processes: each scores its own rows (one teacher program on the global mesh) and
      every group's signal is gathered with the rewards' rows (``scoring.gather_groups``), so every process keeps
      the same groups. None: rewards only.
  """

  def __init__(
    self,
    *,
    policy: Callable[[], nnx.Module],
    sampling: SamplingConfig,
    temperature: float,
    mesh,
    iterator: data_lib.PromptIterator,
    examples: Sequence[Any],
    prompts,
    prompt_len: int | None,
    pad_id: int,
    tokenizer,
    reward_set: rewards_lib.RewardSet | None,
    prompts_per_step: int,
    dynamic_sampling: bool,
    max_rounds: int,
    merge_lora: bool = False,
    engine=None,
    engine_sampling: SamplingConfig | None = None,
    logprobs_are_policy: bool = True,
    turns: Turns | None = None,
    should_stop: Callable[[], bool] | None = None,
    teacher: Callable[[Batch], Batch] | None = None,
    min_teacher_signal: float = 0.0,
  ):
    self._policy = policy
    self.sampling, self.temperature, self.mesh = sampling, temperature, mesh
    self.iterator, self.examples = iterator, examples
    self.prompts, self.prompt_len, self.pad_id = prompts, prompt_len, pad_id
    self.tokenizer, self.reward_set = tokenizer, reward_set
    self.prompts_per_step, self.dynamic_sampling, self.max_rounds = prompts_per_step, dynamic_sampling, max_rounds
    self.merge_lora = merge_lora
    self.engine = BuiltinEngine() if engine is None else engine
    self.engine_sampling = sampling if engine_sampling is None else engine_sampling
    self.logprobs_are_policy = logprobs_are_policy
    self.turns, self.should_stop = turns, should_stop
    self.teacher, self.min_teacher_signal = teacher, min_teacher_signal
    self._engine_version: Any = None  # the version whose weights the engine holds (None: none yet)
    self.engine_times: dict[str, float] = {}

  @property
  def rows_per_step(self) -> int:
    """B·G rows of a step's batch."""
    return self.prompts_per_step * self.sampling.num_samples

  def own_groups_range(self, groups: int) -> tuple[int, int]:
    """``[first, last)``: the groups of a ``groups``-group batch whose rows this process holds
    (``sharding.process_batch_rows``; all of them in one process)."""
    g = self.sampling.num_samples
    mine = shd.process_batch_rows(self.mesh, groups * g)
    return mine.start // g, mine.stop // g

  def _add_time(self, name: str, seconds: float | None) -> None:
    """Adds ``seconds`` to the metric ``name`` (``engine/*``); None (an engine on the mesh: its calls return
    once dispatched, a push is a reference swap) records nothing."""
    if seconds is not None:
      self.engine_times[name] = self.engine_times.get(name, 0.0) + seconds

  def _seconds_since(self, t0: float) -> float | None:
    """Seconds since ``t0`` of an engine call, None for an engine on the mesh (see :meth:`_add_time`)."""
    return None if driver.samples_on_mesh(self.engine) else time.perf_counter() - t0

  # ------------------------------------------------------------------ sampling
  def sampling_policy(self, policy: nnx.Module | None = None) -> nnx.Module:
    """What sampling and evaluation run: ``policy`` (default the current one), or its
    ``models.lora.merge_lora`` with ``merge_lora``."""
    policy = self._policy() if policy is None else policy
    return lora.merge_lora(policy) if self.merge_lora else policy

  def engine_holding(self, policy, version):
    """The engine, holding ``version``'s weights (``policy``: that version's policy, None: the current one):
    pushed first (``driver.push_policy``: merged with ``merge_lora``; several processes: gathered for an engine
    off the mesh) when it holds another version or none, or on every call for an engine on the mesh (a
    reference swap). Push times go to ``engine/push_s``."""
    if version is None or version != self._engine_version or driver.samples_on_mesh(self.engine):
      t0 = time.perf_counter()
      driver.push_policy(self.engine, self.sampling_policy(policy))
      self.engine_times.pop("engine/push_s", None)  # the last push's
      self._add_time("engine/push_s", self._seconds_since(t0))
      self._engine_version = version
    return self.engine

  def sample(self, indices, key, *, policy=None, mesh=None, version=None, on_sampled=None) -> Rollout:
    """This process's rows (NumPy; all rows in one process) of G completions of the prompts ``indices``
    (every process passes the same), sampled by the engine holding ``version`` (``driver.sample_rows``: the
    built-in one as one program on ``mesh``, default the train mesh, each process sending its own prompts;
    another engine on each process's own prompts). ``policy``: the policy to sample (default the current one);
    ``version``: its version (pushed when the engine holds another); ``on_sampled(rollout)``: called once the
    sampler is dispatched, before its rows are fetched (None for an engine that samples synchronously)."""
    tokens, mask = data_lib.pad_left([self.prompts.tokens[i] for i in indices], self.prompt_len, self.pad_id)
    engine = self.engine_holding(policy, version)
    t0 = time.perf_counter()
    rows = driver.sample_rows(
      engine,
      tokens,
      mask,
      self.engine_sampling,
      key=key,
      temperature=self.temperature,
      mesh=self.mesh if mesh is None else mesh,
      on_dispatched=on_sampled,
    )
    self._add_time("engine/generate_s", self._seconds_since(t0))
    self.engine_times.update(getattr(engine, "sample_metrics", {}))  # rollout.speculative's, when on
    return rows

  # ------------------------------------------------------------------ single-turn scoring
  def _decode(self, completions: np.ndarray, mask: np.ndarray) -> list[str]:
    rows = [c[m].tolist() for c, m in zip(completions, mask)]
    return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

  def score(self, indices, rows: Rollout) -> rewards_lib.RewardResult:
    """Rewards of this process's ``rows`` of the rollout of the prompts ``indices`` (row i belongs to
    prompt ``indices[rows.group_ids[i]]``)."""
    prompt_of_row = np.asarray(indices)[np.asarray(rows.group_ids)]
    texts = self._decode(rows.completions, rows.mask)
    prompts = [self.prompts.texts[i] for i in prompt_of_row]
    columns = rows_to_columns([self.examples[i] for i in prompt_of_row], 1)
    if (
      self.prompts.messages is not None and rewards_lib.PROMPT_MESSAGES not in columns
    ):  # for a reward model's own template
      columns[rewards_lib.PROMPT_MESSAGES] = [self.prompts.messages[i] for i in prompt_of_row]
    return self.reward_set(prompts, texts, columns)

  # ------------------------------------------------------------------ one round
  def _round(self, indices, key, *, policy, mesh, version, on_sampled) -> Scored:
    """One sampling round of the prompts ``indices``: this process's rows, and every row's reward and length
    (with a teacher: its log-probs in the rows and every group's signal)."""
    kw = dict(policy=policy, mesh=mesh, version=version, on_sampled=on_sampled)
    scored = self._env_round(indices, key, **kw) if self.turns is not None else self._single_round(indices, key, **kw)
    if self.teacher is None:
      return scored
    g, rows = self.sampling.num_samples, self.teacher(scored.rows)  # several processes: each scores its own rows
    return scored._replace(rows=rows, signal=scoring.gather_groups(scoring.teacher_signal(rows, g), g, self.mesh))

  def _single_round(self, indices, key, *, policy, mesh, version, on_sampled) -> Scored:
    """One single-turn round: the engine's rows of the prompts ``indices``, their rewards and lengths."""
    rows = self.sample(indices, key, policy=policy, mesh=mesh, version=version, on_sampled=on_sampled)
    res = self.score(indices, rows)
    lengths = np.asarray(rows.mask).sum(1).astype(np.int32)
    total, per_fn, lengths, counters = scoring.gather_scores(res.total, res.per_fn, lengths, res.counters, self.mesh)
    return Scored(Batch.from_rollout(rows, res.total), total, per_fn, lengths, counters, {})

  def _env_round(self, indices, key, *, policy, mesh, version, on_sampled) -> Scored:
    """G trajectories per prompt in the environments, each turn sampled by the engine holding ``version``
    (``driver.turn_sampler``: the built-in one's KV-cached conversation sampler on the pushed policy, another
    engine's ``generate``). Several processes: each runs the environments of its own groups, the built-in
    sampler's turns in collective rounds (``engines.collective.CollectiveSampler``); rewards, lengths and the
    environments' metrics are gathered."""
    procs = jax.process_count()
    first, last = self.own_groups_range(len(indices)) if procs > 1 else (0, len(indices))
    engine = self.engine_holding(policy, version)
    model, turn_engine = driver.turn_sampler(
      engine, self._policy() if policy is None else policy, mesh=self.mesh if mesh is None else mesh, key=key
    )
    if on_sampled is not None:
      on_sampled(None)  # the learner may run while the environments step (the sampler's copy is its own)
    # rollout.speculative: the built-in engine's switch, observed by sample_multiturn in one process, by the
    # collective rounds' finish (numbers agreed by every process) in several
    switch = getattr(engine, "switch", None)
    t0 = time.perf_counter()
    rows, metrics, _ = env_training.env_rollout_batch(
      model,
      [self.examples[i] for i in indices[first:last]],
      self.turns.make_env,
      self.tokenizer,
      self.engine_sampling,
      self.turns.config,
      key=key,
      temperature=self.temperature,
      should_stop=self.should_stop,
      engine=turn_engine,
      speculative=switch if turn_engine is None else None,
    )
    driver.finish_turns(turn_engine, int(np.asarray(rows.policy_mask).sum()))
    if switch is not None:
      self.engine_times.update(switch.metrics)
    self._add_time("engine/generate_s", self._seconds_since(t0))
    for k in ("reward_mean", "reward_std", "completion_length"):
      metrics.pop(k)  # the batch's, over the kept groups: batch()
    lengths = np.asarray(rows.mask).sum(1).astype(np.int32)
    rows = rows._replace(group_ids=np.asarray(rows.group_ids) + first)
    rows, metrics = scoring.gather_env_rows(rows, metrics, self.pad_id)
    rewards, lengths = distributed.all_rows((np.asarray(rows.rewards, np.float32), lengths), self.mesh)
    return Scored(rows, rewards, {}, lengths, {}, metrics)

  # ------------------------------------------------------------------ one step's batch
  def batch(self, key, *, policy=None, version=None, mesh=None, on_sampled=None) -> Produced:
    """Samples ``prompts_per_step`` groups (refilled under dynamic sampling), scored: this process's rows
    of the host Batch. ``policy``/``version``/``mesh``/``on_sampled``: as for :meth:`sample` (the
    asynchronous producer passes the version it publishes and the rollout mesh)."""
    t0 = time.perf_counter()
    self.engine_times = {}
    g, groups = self.sampling.num_samples, self.prompts_per_step
    rounds: list[Scored] = []
    drawn: list[list[int]] = []
    selection = None
    while selection is None or not selection.done:
      # multi-turn's first round samples with the step's key itself (as before rounds applied to it)
      key, sub = jax.random.split(key) if self.turns is None or rounds else (key, key)
      indices = self.iterator.next(groups)
      drawn.append([int(i) for i in indices])
      rounds.append(self._round(indices, sub, policy=policy, mesh=mesh, version=version, on_sampled=on_sampled))
      selection = collect.select_groups(
        [r.rewards for r in rounds],
        num_groups=groups,
        group_size=g,
        max_rounds=self.max_rounds,
        dynamic=self.dynamic_sampling,
        signal=None if self.teacher is None else [r.signal for r in rounds],
        min_signal=self.min_teacher_signal,
      )
    kept = selection.kept
    batch = self._own_groups(rounds, kept)
    of_kept = lambda values: np.concatenate([values(rounds[r])[b * g : (b + 1) * g] for r, b in kept])
    lengths = of_kept(lambda r: r.lengths)
    per_fn = {name: of_kept(lambda r, name=name: r.per_fn[name]) for name in rounds[0].per_fn}
    counters = {k: sum(r.counters.get(k, 0) for r in rounds) for k in {k for r in rounds for k in r.counters}}
    dynamic = {"dynamic_sampling/dropped_groups": selection.dropped, "dynamic_sampling/rounds": len(rounds)}
    if self.teacher is not None:
      dynamic["dynamic_sampling/kept_by_teacher"] = selection.by_teacher
    metrics = scoring.batch_metrics(
      of_kept(lambda r: r.rewards),
      per_fn,
      lengths,
      counters,
      extra=dynamic if self.dynamic_sampling else None,
      # multi-turn: the environments' metrics, mean over the rounds
      env={k: float(np.mean([r.metrics[k] for r in rounds if k in r.metrics])) for k in rounds[0].metrics},
    )
    metrics.update(self.engine_times)
    return Produced(batch, metrics, int(lengths.sum()), drawn, list(kept), version, time.perf_counter() - t0)

  def _own_groups(self, rounds: list[Scored], kept: list[tuple[int, int]]) -> Batch:
    """This process's rows of the batch of the ``kept`` groups (``(round, group)``, in batch order).

    The group at position j is fed by the process that sampled position j of a round; a kept group
    sampled by another process is fetched from it (``all_rows`` of its round: only for rounds some
    process needs, decided identically everywhere from ``kept``)."""
    g = self.sampling.num_samples
    first, last = self.own_groups_range(len(kept))
    per = last - first  # groups per process
    elsewhere = sorted({r for j, (r, b) in enumerate(kept) if b // per != j // per})
    fetched = {r: distributed.all_rows(rounds[r].rows, self.mesh) for r in elsewhere}
    parts = []
    for j in range(first, last):
      r, b = kept[j]
      rows, start = (rounds[r].rows, (b - first) * g) if b // per == j // per else (fetched[r], b * g)
      parts.append(jax.tree.map(lambda x, s=start: x[s : s + g], rows))
    width = max(p.prompt_tokens.shape[1] for p in parts)  # multi-turn rounds differ in prompt width
    if jax.process_count() > 1:
      width = max(distributed.gather_objects(width))
    parts = [pad_prompts(p, width, self.pad_id) for p in parts]
    batch = jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
    return batch._replace(
      group_ids=np.repeat(np.arange(first, last, dtype=np.int32), g),
      rewards=np.asarray(batch.rewards, np.float32),
      behavior_logp=None if self.logprobs_are_policy else batch.old_logp,  # the sampler's: μ
    )

  def close(self) -> None:
    """Shut the engine down (``engine.close()``, once; the built-in sampler drops its reference to the policy)."""
    engine, self.engine = self.engine, None
    if engine is not None:  # closed before
      engine.close()
