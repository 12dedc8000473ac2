"""The rollout source: one object that yields this process's placed, scored batch of a step.

A source composes what a run's config names, each part an argument rather than a branch of the loop::

    sampler     the built-in sampler on the current policy (``collect.place_prompts`` + ``collect.sample``
                on the global mesh), or an engine (vLLM, a user's) that gets the policy's weights
                pushed when an update made them stale
    turns       single-turn: decode, score with the ``RewardSet``, gather every row's reward; or
                multi-turn: G trajectories per prompt in the environments (``make_env``), rewards theirs
    selection   dynamic sampling: rounds until the batch holds ``prompts_per_step`` informative groups
                (``collect.select_groups``); every process keeps the same groups and feeds its own rows
    correction  an engine whose log-probs are not the policy's: they become ``behavior_logp`` and the
                policy's ``old_logp`` is recomputed (``collect.engine_old_logp``: the mismatch metrics)

The loop (``jaxgrpo.run.trainer.Trainer``) calls :meth:`RolloutSource.next` once per step, the step, then
:meth:`RolloutSource.after_step`; the asynchronous producer (``jaxgrpo.rollout.async_rollout``) calls
:meth:`RolloutSource.batch` with its own sampler. The source holds no train state: it reads the current
policy through the two callables it is given. It is built from a run config by ``jaxgrpo.run.assemble``.

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
from jaxgrpo.rollout.environments import training as env_training
from jaxgrpo.rollout.environments.rollout import MultiTurnConfig
from jaxgrpo.rollout.sampling import Rollout, SamplingConfig
from jaxgrpo.step import feed
from jaxgrpo.step.batch import Batch
from jaxgrpo.step.train import TrainConfig

__all__ = ["RolloutSource", "Scored", "Turns", "rows_to_columns"]


class Scored(NamedTuple):
  """What :meth:`RolloutSource.next` returns.

  Attributes:
    batch: this process's rows as a placed :class:`~jaxgrpo.step.batch.Batch` (bucketed, packed when the
      step packs; ``old_logp`` the policy's, ``behavior_logp`` an engine's when they differ).
    metrics: ``{name: float}``: rewards, completion length, dynamic sampling, engine and env metrics.
    tokens: completion tokens of the whole batch (every process).
    rollout_s: seconds of sampling and scoring (before placement).
  """

  batch: Batch
  metrics: dict
  tokens: int
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
  """Yields this process's scored, placed batch of a step (see the module docstring).

  Args:
    policy: ``policy() -> nnx.Module``, the current policy (parameters of the current train state).
    params: ``params() -> pytree``, the current policy parameters as the step's log-prob pass takes them
      (``feed.policy_params``; read only when ``policy_logp_fn`` is set).
    sampling: the :class:`~jaxgrpo.rollout.sampling.SamplingConfig` (G = ``num_samples``).
    train_config: the step's ``TrainConfig`` (temperature, buckets, packing).
    mesh: the train mesh (prompts are placed on it; the batch is fed to it).
    iterator: the ``data.PromptIterator`` over ``examples`` (its position is the run's data position).
    examples: the training rows (``data.MathExample``, or environment episode rows).
    prompts, prompt_len, pad_id: the encoded prompts (None for environment episodes).
    tokenizer: decodes completions (single-turn scoring) and renders turns (multi-turn).
    reward_set: a ``data.rewards.RewardSet`` (single-turn).
    prompts_per_step: B, groups per step.
    dynamic_sampling, max_rounds: drop groups with equal rewards and sample again, at most ``max_rounds``.
    merge_lora: sample the merged policy (``models.lora.merge_lora``).
    engine: an engine (None: the built-in sampler); ``engine_sampling`` the SamplingConfig it receives.
    policy_logp_fn: the jitted policy log-prob pass (``collect.policy_logp_fn``) when the engine's log-probs
      are not the policy's (None otherwise).
    turns: :class:`Turns` for multi-turn rollouts (None: single-turn).
    should_stop: polled during environment calls (a signal stops a hung environment).
  """

  def __init__(
    self,
    *,
    policy: Callable[[], nnx.Module],
    params: Callable[[], Any],
    sampling: SamplingConfig,
    train_config: TrainConfig,
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
    policy_logp_fn: Callable | None = None,
    turns: Turns | None = None,
    should_stop: Callable[[], bool] | None = None,
  ):
    self._policy, self._params = policy, params
    self.sampling, self.train_config, self.mesh = sampling, train_config, mesh
    self.iterator, self.examples = iterator, examples
    self.prompts, self.prompt_len, self.pad_id = prompts, prompt_len, pad_id
    self.tokenizer, self.reward_set = tokenizer, reward_set
    self.prompts_per_step, self.dynamic_sampling, self.max_rounds = prompts_per_step, dynamic_sampling, max_rounds
    self.merge_lora = merge_lora
    self.engine, self.engine_sampling, self.policy_logp_fn = engine, engine_sampling, policy_logp_fn
    self.turns, self.should_stop = turns, should_stop
    self.engine_stale = True  # the engine holds no weights of this policy yet
    self.engine_times: dict[str, float] = {}

  # ------------------------------------------------------------------ sampling
  def sampling_policy(self) -> nnx.Module:
    """What sampling and evaluation run: the policy, or its ``models.lora.merge_lora`` with ``merge_lora``."""
    policy = self._policy()
    return lora.merge_lora(policy) if self.merge_lora else policy

  def sample(self, indices, key, *, policy=None, mesh=None) -> Rollout:
    """This process's rows (NumPy; all rows in one process) of G completions of the prompts ``indices``
    (every process passes the same): one sampler program on the global mesh, each process sending its own
    prompts (``collect.place_prompts``). ``policy``/``mesh``: another policy and its mesh (the rollout
    producer's; default the current policy on the train mesh)."""
    mesh = self.mesh if mesh is None else mesh
    tokens, mask = data_lib.pad_left([self.prompts.tokens[i] for i in indices], self.prompt_len, self.pad_id)
    if self.engine is not None:  # the engine holds the pushed weights (max_staleness 0 only, checked in the spec)
      return self._sample_engine(tokens, mask, key)
    tokens, mask = collect.place_prompts(tokens, mask, mesh=mesh)
    rollout = collect.sample(
      self._policy() if policy is None else policy,
      tokens,
      mask,
      self.sampling,
      key=key,
      temperature=self.train_config.temperature,
    )
    return distributed.process_rows(rollout._replace(num_steps=None), mesh)

  def _sample_engine(self, tokens, mask, key) -> Rollout:
    """The rollout from the engine; the policy's weights are pushed first when an update (or a restore)
    changed them. Times go to ``engine_times`` (``engine/push_s``, ``engine/generate_s``)."""
    t0 = time.perf_counter()
    if self.engine_stale:
      self.engine.push_weights(self.sampling_policy())
      self.engine_stale = False
      self.engine_times["engine/push_s"] = time.perf_counter() - t0
    temperature = self.train_config.temperature
    t1 = time.perf_counter()
    gen = self.engine.generate(tokens, mask, self.engine_sampling, key=key, temperature=temperature)
    self.engine_times["engine/generate_s"] = self.engine_times.get("engine/generate_s", 0.0) + (
      time.perf_counter() - t1
    )
    return gen.rollout._replace(num_steps=None)

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
    return self.reward_set(prompts, texts, columns)

  def batch(self, key, *, sample=None, kept_groups=None) -> tuple[Batch, dict, int]:
    """Samples ``prompts_per_step`` groups (refilled under dynamic sampling) → (this process's rows of
    the host Batch, metrics, completion tokens of the whole batch). ``sample(indices, key)``: the sampling
    call (default :meth:`sample`); ``kept_groups``: a list extended with ``(round, group)`` of every
    group of the batch, in batch order."""
    g, groups = self.sampling.num_samples, self.prompts_per_step
    rounds, counters = [], {}
    selection = None
    while selection is None or not selection.done:
      key, sub = jax.random.split(key)
      indices = self.iterator.next(groups)
      rows = (self.sample if sample is None else sample)(indices, sub)
      res = self.score(indices, rows)
      lengths = np.asarray(rows.mask).sum(1).astype(np.int32)
      total, per_fn, lengths = distributed.all_rows((res.total, res.per_fn, lengths), self.mesh)
      for c in distributed.gather_objects(res.counters):
        for k, v in c.items():
          counters[k] = counters.get(k, 0) + v
      rounds.append((rows, total, per_fn, lengths))
      selection = collect.select_groups(
        [r[1] for r in rounds],
        num_groups=groups,
        group_size=g,
        max_rounds=self.max_rounds,
        dynamic=self.dynamic_sampling,
      )
    kept, dropped = selection.kept, selection.dropped
    if kept_groups is not None:
      kept_groups.extend(kept)
    batch = self._own_groups(rounds, kept)
    rewards = np.concatenate([rounds[r][1][b * g : (b + 1) * g] for r, b in kept]).astype(np.float32)
    lengths = np.concatenate([rounds[r][3][b * g : (b + 1) * g] for r, b in kept])
    metrics = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std())}
    for name in rounds[0][2]:
      values = np.concatenate([rounds[r][2][name][b * g : (b + 1) * g] for r, b in kept])
      metrics[f"reward/{name}"] = float(values.mean())
    metrics["completion_length"] = float(lengths.mean())
    if self.dynamic_sampling:
      metrics["dynamic_sampling/dropped_groups"] = dropped
      metrics["dynamic_sampling/rounds"] = len(rounds)
    for k, v in counters.items():
      metrics[f"reward_counters/{k}"] = v
    return batch, metrics, int(lengths.sum())

  def _own_groups(self, rounds: list, kept: list[tuple[int, int]]) -> Batch:
    """This process's rows of the batch of the ``kept`` groups (``(round, group)``, in batch order).

    The group at position j is fed by the process that sampled position j of a round; a kept group
    sampled by another process is fetched from it (``all_rows`` of its round: only for rounds some
    process needs, decided identically everywhere from ``kept``)."""
    g = self.sampling.num_samples
    mine = shd.process_batch_rows(self.mesh, len(kept) * g)
    first, last = mine.start // g, mine.stop // g
    per = last - first  # groups per process
    elsewhere = sorted({r for j, (r, b) in enumerate(kept) if b // per != j // per})
    fetched = {r: distributed.all_rows(rounds[r][0], self.mesh) for r in elsewhere}
    parts = []
    for j in range(first, last):
      r, b = kept[j]
      rows, start = (rounds[r][0], (b - first) * g) if b // per == j // per else (fetched[r], b * g)
      parts.append(Rollout(*[None if x is None else x[start : start + g] for x in rows]))
    cat = lambda field: np.concatenate([getattr(p, field) for p in parts])
    return Batch(
      prompt_tokens=cat("prompt_tokens"),
      prompt_mask=cat("prompt_mask"),
      completions=cat("completions"),
      mask=cat("mask"),
      old_logp=cat("log_probs"),
      group_ids=np.repeat(np.arange(first, last, dtype=np.int32), g),
      rewards=np.concatenate([rounds[r][1][b * g : (b + 1) * g] for r, b in kept[first:last]]).astype(np.float32),
      behavior_logp=None if self.policy_logp_fn is None else cat("log_probs"),  # the engine's: μ
      routing=None if parts[0].routing is None else cat("routing"),  # a MoE policy's routing replay
    )

  # ------------------------------------------------------------------ one step's batch
  def next(self, key) -> Scored:
    """The step's batch: sampled and scored (single- or multi-turn), placed on the train mesh (each process
    its own rows), with the engine's mismatch correction and timings."""
    t0 = time.perf_counter()
    self.engine_times = {}
    if self.turns is None:
      batch, metrics, tokens = self.batch(key)
    else:  # multi-turn: G trajectories per prompt in the environments; rewards are theirs
      examples = [self.examples[i] for i in self.iterator.next(self.prompts_per_step)]
      batch, metrics, tokens = env_training.env_rollout_batch(
        self.sampling_policy(),
        examples,
        self.turns.make_env,
        self.tokenizer,
        self.sampling,
        self.turns.config,
        key=key,
        temperature=self.train_config.temperature,
        should_stop=self.should_stop,
      )
    rollout_s = time.perf_counter() - t0
    # bucketed, packed if set; each process feeds its own rows
    placed = feed.place(batch, mesh=self.mesh, train_config=self.train_config, process_local=True)
    if self.policy_logp_fn is not None:  # the policy's own old_logp; the engine's log-probs are behavior_logp
      placed, engine_metrics = collect.engine_old_logp(self.policy_logp_fn, self._params(), placed)
      metrics.update(engine_metrics)
    if self.engine is not None:
      metrics.update(self.engine_times)
    return Scored(placed, metrics, tokens, rollout_s)

  def after_step(self) -> None:
    """An update changed the policy: the engine's weights are the old policy's until the next push."""
    self.engine_stale = True

  def close(self) -> None:
    """Shut the engine down (``engine.close()``); the built-in sampler holds nothing."""
    if self.engine is not None:
      self.engine.close()
      self.engine = None
