"""What the trainer calls for a run with an ``env:`` section (``jaxgrpo.run.trainer``): a multi-turn rollout
batch of dataset examples, and the held-out evaluation by environment reward.

Both are plain functions of the policy, the examples and the settings — the trainer's loop, resume,
packing, LoRA and checkpoints stay the trainer's. One process holds every row of a rollout.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxgrpo.rewards.reward_set import finite_reward_stats
from jaxgrpo.rollout.environments.rollout import MultiTurnConfig, MultiTurnRollout, rollout_metrics, sample_multiturn
from jaxgrpo.step.train import Batch

__all__ = ["env_evaluate", "env_rollout_batch", "example_row"]


def example_row(example) -> dict[str, Any]:
  """A ``jaxgrpo.data.MathExample`` as the row an environment gets: its columns, ``prompt``,
  ``answer``, and ``problem`` (the prompt when it is a string, else its last user message). A mapping
  (an episode row of ``env.episodes``: ``{"seed", "episode", "split"}``) is passed as it is (a copy)."""
  if isinstance(example, Mapping):
    return dict(example)
  prompt = example.prompt
  if isinstance(prompt, str):
    problem = prompt
  else:
    problem = next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")
  return {**dict(example.columns), "prompt": prompt, "problem": problem, "answer": example.answer}


def env_rollout_batch(
  policy,
  examples: Sequence[Any],
  make_env: Callable[[Mapping[str, Any]], Any],
  tokenizer,
  sampling,
  env_config: MultiTurnConfig,
  *,
  key,
  temperature: float = 1.0,
  should_stop: Callable[[], bool] | None = None,
  engine=None,
  speculative=None,
) -> tuple[Batch, dict[str, float], int]:
  """``(Batch with policy_mask, metrics, real tokens)`` of G multi-turn trajectories per example, sampled
  at ``temperature`` (the train step's ``TrainConfig.temperature``); ``should_stop`` and ``engine`` as for
  ``sample_multiturn`` (``RolloutInterrupted`` when it turns true during an environment call; each turn
  sent to the engine as token ids, its weights pushed by the caller); ``speculative``: the built-in engine's
  ``SpeculativeSwitch`` (``sample_multiturn``'s)."""
  t0 = time.perf_counter()
  out: MultiTurnRollout = sample_multiturn(
    policy,
    [example_row(e) for e in examples],
    make_env,
    tokenizer,
    sampling,
    env_config,
    key=key,
    temperature=temperature,
    should_stop=should_stop,
    engine=engine,
    speculative=speculative,
  )
  metrics = rollout_metrics(out, time.perf_counter() - t0)
  metrics.update(
    **finite_reward_stats(out.rewards),
    completion_length=float(out.mask.sum(1).mean()),
  )
  return Batch.from_rollout(out, out.rewards), metrics, int(out.mask.sum())


def env_evaluate(
  policy,
  examples: Sequence[Any],
  make_env: Callable[[Mapping[str, Any]], Any],
  tokenizer,
  sampling,
  env_config: MultiTurnConfig,
  *,
  k: int,
  key,
  batch_prompts: int = 128,
  temperature: float = 1.0,
  should_stop: Callable[[], bool] | None = None,
  engine=None,
) -> dict[str, float]:
  """mean@k of the environment reward on ``examples`` (``eval_env_reward``; k trajectories each at
  ``temperature``) and the per-trajectory turn metrics (``eval_env/...``); ``engine`` as for
  ``sample_multiturn``."""
  k_sampling = dataclasses.replace(sampling, num_samples=k)
  rewards, parts = [], []
  for start in range(0, len(examples), batch_prompts):
    chunk = examples[start : start + batch_prompts]
    out = sample_multiturn(
      policy,
      [example_row(e) for e in chunk],
      make_env,
      tokenizer,
      k_sampling,
      env_config,
      key=key,
      temperature=temperature,
      should_stop=should_stop,
      engine=engine,
    )
    rewards.append(out.rewards)
    parts.append(rollout_metrics(out))
  result = {"eval_env_reward": float(np.concatenate(rewards).mean())}
  for name in parts[0]:
    result[f"eval_{name}"] = float(np.mean([p[name] for p in parts]))
  return result
