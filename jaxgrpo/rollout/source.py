"""The rollout source: one object that yields this process's scored rows of a step's batch.

A source composes what a run's config names, each part an argument rather than a branch of the loop::

    sampler     the built-in sampler on a policy (``collect.place_prompts`` + ``collect.sample`` on a mesh),
                or an engine (vLLM, a user's) that gets the policy's weights pushed when the version it
                holds is not the one asked for
    turns       single-turn: decode, score with the ``RewardSet``; or multi-turn: G trajectories per
                prompt in the environments (``make_env``), rewards theirs, each turn sent to the sampler
                or the engine as token ids
    selection   rounds until the batch holds ``prompts_per_step`` groups; with dynamic sampling only
                informative ones (``collect.select_groups``); every process keeps the same groups and
                feeds its own rows

:meth:`RolloutSource.batch` returns the host rows (:class:`Produced`); the learner
(``jaxgrpo.rollout.schedule.Learner``) places them, recomputes ``old_logp`` when the sampler's log-probs
are not the policy's (an engine, a stale version) and updates. The schedules
(``jaxgrpo.rollout.schedule.Synchronous``, ``jaxgrpo.rollout.async_rollout.AsyncRollouts``) call the source
with the policy and version they sample; the source holds no train state. It is built from a run config
by ``jaxgrpo.run.assemble``.

Several processes: every process draws the same prompt indices, samples one program on the global mesh,
decodes and scores its own rows; every row's reward and length is then gathered (one small all-gather
per round), so every process keeps the same groups, in the same order, as one process would.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np
from flax import nnx

from jaxgrpo import data as data_lib
from jaxgrpo.data import rewards as rewards_lib
from jaxgrpo.models import lora
from jaxgrpo.parallel import distributed
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout import collect
from jaxgrpo.rollout.engines.base import check_generation
from jaxgrpo.rollout.engines.collective import CollectiveSampler
from jaxgrpo.rollout.environments import training as env_training
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


class _Round(NamedTuple):
  rows: Batch  # this process's rows (host; group_ids = the group within the round)
  rewards: np.ndarray  # every row's reward, every process
  per_fn: dict
  lengths: np.ndarray
  counters: dict
  metrics: dict  # multi-turn: the environments' metrics of the round


def pad_prompts(rows: Batch, width: int, pad_id: int) -> Batch:
  """``rows`` with the prompts left-padded to ``width`` columns."""
  pad = lambda x, v: np.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=v)
  return rows._replace(prompt_tokens=pad(rows.prompt_tokens, pad_id), prompt_mask=pad(rows.prompt_mask, False))


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
    reward_set: a ``data.rewards.RewardSet`` (single-turn).
    prompts_per_step: B, groups per step.
    dynamic_sampling, max_rounds: drop groups with equal rewards and sample again, at most ``max_rounds``.
    merge_lora: sample the merged policy (``models.lora.merge_lora``).
    engine: an engine (None: the built-in sampler); ``engine_sampling`` the SamplingConfig it receives.
    logprobs_are_policy: the sampler's log-probs are the policy's own (the built-in sampler; an engine that
      declares it): False makes the learner recompute ``old_logp`` and keep these as ``behavior_logp``.
    turns: :class:`Turns` for multi-turn rollouts (None: single-turn).
    should_stop: polled during environment calls (a signal stops a hung environment).
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
  ):
    self._policy = policy
    self.sampling, self.temperature, self.mesh = sampling, temperature, mesh
    self.iterator, self.examples = iterator, examples
    self.prompts, self.prompt_len, self.pad_id = prompts, prompt_len, pad_id
    self.tokenizer, self.reward_set = tokenizer, reward_set
    self.prompts_per_step, self.dynamic_sampling, self.max_rounds = prompts_per_step, dynamic_sampling, max_rounds
    self.merge_lora = merge_lora
    self.engine, self.engine_sampling = engine, engine_sampling
    self.logprobs_are_policy = logprobs_are_policy
    self.turns, self.should_stop = turns, should_stop
    self._engine_version: Any = None  # the version whose weights the engine holds (None: none yet)
    self._engine_times: dict[str, float] = {}

  @property
  def rows_per_step(self) -> int:
    """B·G rows of a step's batch."""
    return self.prompts_per_step * self.sampling.num_samples

  def _own_groups_range(self, groups: int) -> tuple[int, int]:
    """``[first, last)``: the groups of a ``groups``-group batch whose rows this process holds
    (``sharding.process_batch_rows``; all of them in one process)."""
    g = self.sampling.num_samples
    mine = shd.process_batch_rows(self.mesh, groups * g)
    return mine.start // g, mine.stop // g

  def _add_generate_time(self, t0: float) -> None:
    self._engine_times["engine/generate_s"] = self._engine_times.get("engine/generate_s", 0.0) + (
      time.perf_counter() - t0
    )

  # ------------------------------------------------------------------ sampling
  def sampling_policy(self, policy: nnx.Module | None = None) -> nnx.Module:
    """What sampling and evaluation run: ``policy`` (default the current one), or its
    ``models.lora.merge_lora`` with ``merge_lora``."""
    policy = self._policy() if policy is None else policy
    return lora.merge_lora(policy) if self.merge_lora else policy

  def _engine(self, policy, version):
    """The engine, holding ``version``'s weights: pushed first when it holds another version (or none).
    Several processes: each process's engine gets the whole policy, gathered from every process's shards
    (``distributed.to_host``). Times go to ``engine/push_s`` and ``engine/generate_s``."""
    if version is None or version != self._engine_version:
      t0 = time.perf_counter()
      model = self.sampling_policy(policy)
      if jax.process_count() > 1:  # the parameters span the processes: a whole host copy for this one's engine
        graphdef, state = nnx.split(model)
        model = nnx.merge(graphdef, distributed.to_host(state))
      self.engine.push_weights(model)
      self._engine_version = version
      self._engine_times["engine/push_s"] = time.perf_counter() - t0
    return self.engine

  def _generate(self, tokens, mask, key, *, policy, version) -> Rollout:
    engine = self._engine(policy, version)
    t0 = time.perf_counter()
    gen = engine.generate(tokens, mask, self.engine_sampling, key=key, temperature=self.temperature)
    s = self.engine_sampling
    gen = check_generation(
      engine,
      gen,
      num_prompts=len(tokens),
      num_samples=s.num_samples,
      max_new_tokens=s.max_new_tokens,
      temperature=self.temperature,
    )
    self._add_generate_time(t0)
    return gen.rollout._replace(num_steps=None)

  def sample(self, indices, key, *, policy=None, mesh=None, version=None, on_sampled=None) -> Rollout:
    """This process's rows (NumPy; all rows in one process) of G completions of the prompts ``indices``
    (every process passes the same): one sampler program on ``mesh`` (default the train mesh), each process
    sending its own prompts (``collect.place_prompts``), or the engine (each process's its own prompts). ``policy``: the policy to sample
    (default the current one); ``version``: its version (an engine gets it pushed when it holds another);
    ``on_sampled(rollout)``: called once the sampler is dispatched, before its rows are fetched."""
    tokens, mask = data_lib.pad_left([self.prompts.tokens[i] for i in indices], self.prompt_len, self.pad_id)
    if self.engine is not None:  # several processes: each process's engine samples its own groups
      first = 0
      if jax.process_count() > 1:
        first, last = self._own_groups_range(len(indices))
        tokens, mask, key = tokens[first:last], mask[first:last], jax.random.fold_in(key, first)
      if on_sampled is not None:
        on_sampled(None)  # the learner runs while the engine samples
      rollout = self._generate(tokens, mask, key, policy=policy, version=version)
      return rollout._replace(group_ids=np.asarray(rollout.group_ids) + first)
    mesh = self.mesh if mesh is None else mesh
    tokens, mask = collect.place_prompts(tokens, mask, mesh=mesh)
    rollout = collect.sample(
      self._policy() if policy is None else policy, tokens, mask, self.sampling, key=key, temperature=self.temperature
    )
    if on_sampled is not None:
      on_sampled(rollout)
    return distributed.process_rows(rollout._replace(num_steps=None), mesh)

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
  def _round(self, indices, key, *, policy, mesh, version, on_sampled) -> _Round:
    """One sampling round of the prompts ``indices``: this process's rows, and every row's reward and length."""
    if self.turns is not None:
      return self._env_round(indices, key, policy=policy, mesh=mesh, version=version, on_sampled=on_sampled)
    rows = self.sample(indices, key, policy=policy, mesh=mesh, version=version, on_sampled=on_sampled)
    res = self.score(indices, rows)
    lengths = np.asarray(rows.mask).sum(1).astype(np.int32)
    total, per_fn, lengths = distributed.all_rows((res.total, res.per_fn, lengths), self.mesh)
    counters: dict[str, int] = {}
    for c in distributed.gather_objects(res.counters):
      for k, v in c.items():
        counters[k] = counters.get(k, 0) + v
    return _Round(Batch.from_rollout(rows, res.total), total, per_fn, lengths, counters, {})

  def _env_round(self, indices, key, *, policy, mesh, version, on_sampled) -> _Round:
    """G trajectories per prompt in the environments, each turn sampled by the built-in sampler on ``policy``
    or by the engine holding ``version``. Several processes: each runs the environments of its own groups,
    its turns sampled in collective rounds (``engines.collective.CollectiveSampler``); rewards, lengths and
    the environments' metrics are gathered."""
    procs = jax.process_count()
    first, last = self._own_groups_range(len(indices)) if procs > 1 else (0, len(indices))
    # the model the turns run on (merged once); with an engine only its config is read (the engine samples)
    model = self.sampling_policy(policy) if self.engine is None else (self._policy() if policy is None else policy)
    collective = None
    if self.engine is None and procs > 1:
      collective = CollectiveSampler(model, self.mesh if mesh is None else mesh, key=key)
    engine = collective or (None if self.engine is None else self._engine(policy, version))
    if on_sampled is not None:
      on_sampled(None)  # the learner may run while the environments step (the sampler's copy is its own)
    t0 = time.perf_counter()
    rows, metrics, _ = env_training.env_rollout_batch(
      model,
      [self.examples[i] for i in indices[first:last]],
      self.turns.make_env,
      self.tokenizer,
      self.sampling if self.engine is None else self.engine_sampling,
      self.turns.config,
      key=key,
      temperature=self.temperature,
      should_stop=self.should_stop,
      engine=engine,
    )
    if collective is not None:
      collective.drain()  # the other processes' turns may still need this one's devices
    elif engine is not None:
      self._add_generate_time(t0)
    for k in ("reward_mean", "reward_std", "completion_length"):
      metrics.pop(k)  # the batch's, over the kept groups: batch()
    lengths = np.asarray(rows.mask).sum(1).astype(np.int32)
    rows = rows._replace(group_ids=np.asarray(rows.group_ids) + first)
    if procs > 1:  # one prompt width (global arrays), the environments' metrics over every row
      every = distributed.gather_objects([rows.prompt_tokens.shape[1], metrics])
      rows = pad_prompts(rows, max(w for w, _ in every), self.pad_id)
      metrics = {k: float(np.mean([m.get(k, 0.0) for _, m in every])) for k in sorted({k for _, m in every for k in m})}
    rewards, lengths = distributed.all_rows((np.asarray(rows.rewards, np.float32), lengths), self.mesh)
    return _Round(rows, rewards, {}, lengths, {}, metrics)

  # ------------------------------------------------------------------ one step's batch
  def batch(self, key, *, policy=None, version=None, mesh=None, on_sampled=None) -> Produced:
    """Samples ``prompts_per_step`` groups (refilled under dynamic sampling), scored: this process's rows
    of the host Batch. ``policy``/``version``/``mesh``/``on_sampled``: as for :meth:`sample` (the
    asynchronous producer passes the version it publishes and the rollout mesh)."""
    t0 = time.perf_counter()
    self._engine_times = {}
    g, groups = self.sampling.num_samples, self.prompts_per_step
    rounds: list[_Round] = []
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
      )
    kept = selection.kept
    batch = self._own_groups(rounds, kept)
    of_kept = lambda values: np.concatenate([values(rounds[r])[b * g : (b + 1) * g] for r, b in kept])
    rewards = of_kept(lambda r: r.rewards).astype(np.float32)
    lengths = of_kept(lambda r: r.lengths)
    metrics = rewards_lib.finite_reward_stats(rewards)  # a missing sample (NaN) is not a number to average
    for name in rounds[0].per_fn:
      values = of_kept(lambda r, name=name: r.per_fn[name])
      metrics[f"reward/{name}"] = rewards_lib.finite_reward_stats(values)["reward_mean"]
    metrics["completion_length"] = float(lengths.mean())
    if self.dynamic_sampling:
      metrics["dynamic_sampling/dropped_groups"] = selection.dropped
      metrics["dynamic_sampling/rounds"] = len(rounds)
    for k in sorted({k for r in rounds for k in r.counters}):
      metrics[f"reward_counters/{k}"] = sum(r.counters.get(k, 0) for r in rounds)
    for name in rounds[0].metrics:  # multi-turn: the environments' metrics, mean over the rounds
      metrics[name] = float(np.mean([r.metrics[name] for r in rounds if name in r.metrics]))
    if self.engine is not None:
      metrics.update(self._engine_times)
    return Produced(batch, metrics, int(lengths.sum()), drawn, list(kept), version, time.perf_counter() - t0)

  def _own_groups(self, rounds: list[_Round], kept: list[tuple[int, int]]) -> Batch:
    """This process's rows of the batch of the ``kept`` groups (``(round, group)``, in batch order).

    The group at position j is fed by the process that sampled position j of a round; a kept group
    sampled by another process is fetched from it (``all_rows`` of its round: only for rounds some
    process needs, decided identically everywhere from ``kept``)."""
    g = self.sampling.num_samples
    first, last = self._own_groups_range(len(kept))
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
    """Shut the engine down (``engine.close()``); the built-in sampler holds nothing."""
    if self.engine is not None:
      self.engine.close()
      self.engine = None
