"""One GRPO iteration, as small composable functions and one convenience function.

An iteration is ``sample → score → batch → reference → update``::

    step = train.make_train_step(graphdef, optimizer, config, mesh=mesh, shardings=shardings)
    reference = make_reference(step, state)                   # once: the jitted pass (β > 0) + its weights
    for prompts, prompt_mask in data:
      policy = policy_model(step.graphdef, state)             # the current policy, for sampling
      rollout = sample(policy, prompts, prompt_mask, sampling, key=key)
      rewards = score(reward_fn, rollout, decode=tokenizer.decode)  # your Python reward function
      batch = make_batch(rollout, rewards, mesh=step.mesh,    # bucket-padded (packed with
                         train_config=step.train_config)      # TrainConfig.packing), placed
      batch = reference(batch)                                # adds ref_logp (only when β > 0)
      state, metrics = step(state, batch)                     # advantages + μ·M updates, jitted

:func:`grpo_iteration` runs exactly these calls and times each phase (``rollout_s``, ``reward_s``,
``reference_s``, ``update_s``). A trainer with its own data handling — several rollouts per step for
dynamic sampling, per-host scoring in multi-host runs — calls the pieces: :func:`sample` as often as it
needs, :func:`score` (or its own scorer), builds a host :class:`~jaxgrpo.step.train.Batch` and places it with
:func:`place` (bucket padding, ``process_local=True`` for per-host rows), then the reference and the step.
``jaxgrpo.run.trainer`` does so. Multi-host, per process::

    tokens, mask = place_prompts(tokens, mask, mesh=step.mesh)    # each process sends its own prompts
    rollout = sample(policy, tokens, mask, sampling, key=key)      # one program on the global mesh
    mine = jaxgrpo.parallel.distributed.process_rows(rollout._replace(num_steps=None), step.mesh)  # NumPy
    rewards = score(reward_fn, mine, ...)                          # this host's rows only
    batch = place(Batch.from_rollout(mine, rewards), mesh=step.mesh, process_local=True,
                  train_config=step.train_config)

Donation: the step consumes ``state`` (its arrays are deleted), so a policy model merged from it is
valid until the next update; sample first, then update — as :func:`grpo_iteration` does. The reference
parameters are never donated: a copy of the initial parameters, or, for a LoRA policy
(``jaxgrpo.models.lora``), the state's own frozen base weights with the adapters left out.

Engines: :func:`grpo_iteration` (``engine=``) samples through any :class:`jaxgrpo.rollout.engines.Engine`, pushing
the policy first (:func:`engine_sample`); when the engine's log-probs are not the policy's
(``jaxgrpo.rollout.engines.logprobs_are_policy``), they become ``behavior_logp`` and :func:`engine_old_logp`
recomputes ``old_logp`` with :func:`policy_logp_fn` — the trainer and the multi-turn path use the same two.

The pieces live where they belong — sampling and scoring in ``jaxgrpo.loop.collect``, the step's
inputs in ``jaxgrpo.step.feed``, ``SamplingConfig`` in ``jaxgrpo.rollout.sampling`` — and are re-exported
here, so ``jaxgrpo.iteration.sample`` (the public module attribute) keeps naming them.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from jaxgrpo.kernels.config import GRPOConfig
from jaxgrpo.kernels.losses import finalize_terms
from jaxgrpo.kernels.objective import objective_terms, rollout_advantages
from jaxgrpo.loop.collect import (
  GroupSelection,
  engine_old_logp,
  engine_sample,
  place_prompts,
  policy_logp_fn,
  sample,
  score,
  select_groups,
  timed_push,
)
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rewards.reward_set import finite_reward_stats
from jaxgrpo.rollout.engines.base import check_engine, logprobs_are_policy
from jaxgrpo.rollout.environments.rollout import MultiTurnConfig, MultiTurnRollout, rollout_metrics, sample_multiturn
from jaxgrpo.rollout.sampling import Rollout, SamplingConfig
from jaxgrpo.step.batch import Batch
from jaxgrpo.step.batch_packing import DEFAULT_BUCKETS
from jaxgrpo.step.feed import (
  Reference,
  make_batch,
  make_reference,
  place,
  policy_model,
  policy_params,
)
from jaxgrpo.step.train import (
  TrainState,
  TrainStep,
)

__all__ = [
  "GroupSelection",
  "IterationResult",
  "Reference",
  "SamplingConfig",
  "engine_old_logp",
  "engine_sample",
  "grpo_iteration",
  "make_batch",
  "make_reference",
  "multiturn_iteration",
  "place",
  "place_prompts",
  "policy_logp_fn",
  "policy_model",
  "policy_params",
  "rollout_loss",
  "sample",
  "sample_multiturn",
  "score",
  "select_groups",
]


class IterationResult(NamedTuple):
  """What :func:`grpo_iteration` returns.

  Attributes:
    state: the updated :class:`~jaxgrpo.step.train.TrainState` (the one passed in is consumed).
    metrics: ``{name: float}``: the step's metrics, ``reward_mean``/``reward_std`` (over finite
      rewards), ``completion_length`` (mean real tokens per row) and the phase times in seconds
      ``rollout_s``, ``reward_s``, ``reference_s`` (batch building and the reference pass),
      ``update_s`` and ``iteration_s``.
    rollout: the sampled :class:`~jaxgrpo.rollout.sampling.Rollout` (N = prompts × G rows), for inspection.
    rewards: ``f32[N]`` the rewards (NaN: a missing sample).
  """

  state: TrainState
  metrics: dict
  rollout: Rollout
  rewards: np.ndarray


def rollout_loss(
  config,
  logp,
  old_logp,
  rewards,
  tokens,
  mask,
  group_ids,
  num_groups: int,
  *,
  ref_logp=None,
  max_group_size: int | None = None,
  objective_fn: Callable = objective_terms,
  advantages_fn: Callable = rollout_advantages,
  hyper=None,
):
  """The loss of one whole rollout batch in one piece: ``advantages_fn`` → ``objective_fn`` →
  ``finalize_terms``, with the train step's hooks and their defaults (the presets).

  What the train step computes for μ = 1 and one micro-batch, as a pure function of arrays:
  differentiate it with respect to ``logp`` (``jax.grad``, ``jax.vjp``), ``vmap`` it over seeds or
  algorithms. For tasks whose whole batch fits at once and whose policy is not a ``jaxgrpo.models``
  model, e.g. the binary-tree task's table of leaf log-probs; LLM training uses :func:`grpo_iteration`.

  Args:
    config: the objective (a ``GRPOConfig``, or what your hooks take).
    logp: ``f32[B, T]`` current-policy log-probs (differentiable).
    old_logp: ``f32[B, T]`` rollout log-probs (no gradient).
    rewards: ``f32[B]``; tokens: ``int32[B, T]``; mask: ``bool[B, T]``; group_ids: ``int32[B]``;
      num_groups: static int.
    ref_logp: ``f32[B, T]`` reference log-probs (when β > 0).
    max_group_size: static bound on the group size (λ presets' process sets).
    objective_fn, advantages_fn: the hooks of ``jaxgrpo.step.train.make_train_step`` (same signatures).
    hyper: optional hyper-parameter pytree passed to both hooks as ``hyper=`` (a
      :class:`~jaxgrpo.kernels.config.GRPOHyper` for the defaults: β, ε, ... as traced ``f32[]``, e.g. a
      ``vmap``-ped grid); None: the config's numbers, static.

  Returns:
    ``(loss f32[], metrics)`` as :func:`jaxgrpo.kernels.losses.finalize_terms` gives them (the loss and the
    usual metrics dict; with ``jax.grad`` use ``has_aux=True``).
  """
  extras = {} if hyper is None else {"hyper": hyper}
  sg = jax.lax.stop_gradient
  adv, weights = advantages_fn(
    config,
    rewards,
    tokens,
    mask,
    group_ids,
    num_groups,
    old_logp=sg(old_logp),
    ref_logp=ref_logp,
    max_group_size=max_group_size,
    **extras,
  )
  terms = objective_fn(config, logp, sg(old_logp), adv, mask, token_weights=weights, ref_logp=ref_logp, **extras)
  return finalize_terms(terms)


def _check_iteration(step: TrainStep, sampling: SamplingConfig, reference, num_prompts: int) -> None:
  """Everything that would fail after the rollout, checked before it."""
  if not isinstance(step, TrainStep):
    raise TypeError(f"step must be a jaxgrpo.step.train.TrainStep (make_train_step); got {type(step).__name__}")
  if not isinstance(sampling, SamplingConfig):
    raise TypeError(f"sampling must be a jaxgrpo.rollout.sampling.SamplingConfig; got {type(sampling).__name__}")
  tc = step.train_config
  if tc.group_size is not None and tc.group_size < sampling.num_samples:
    raise ValueError(
      f"sampling.num_samples={sampling.num_samples} exceeds the step's TrainConfig.group_size={tc.group_size}"
    )
  shd.check_batch_divisible(
    num_prompts * sampling.num_samples, step.mesh, step.rules, splits=tc.micro_batches * tc.mini_batches
  )
  if reference is None and step.requires_ref_logp():
    c = step.config
    name = c.name if isinstance(c, GRPOConfig) else type(c).__name__
    raise ValueError(f"{name!r} (β > 0) needs reference log-probs: pass reference=make_reference(step, state)")
  if reference is not None and not isinstance(reference, Reference):
    raise TypeError(f"reference must be a jaxgrpo.step.feed.Reference (make_reference); got {type(reference).__name__}")


def _update_batch(step, state, rollout, rewards, buckets, reference, recompute: bool, engine_metrics: dict) -> Batch:
  """The placed batch the update trains on: :func:`make_batch` of ``rollout`` and ``rewards``; with ``recompute``
  (an engine whose log-probs are not the policy's) its log-probs become ``behavior_logp`` and ``old_logp`` is the
  policy's (:func:`engine_old_logp`, whose metrics go into ``engine_metrics``); then the reference pass when the
  step reads ``ref_logp``."""
  batch = make_batch(
    rollout,
    rewards,
    mesh=step.mesh,
    rules=step.rules,
    buckets=buckets,
    train_config=step.train_config,
    behavior_logp=rollout.log_probs if recompute else None,
  )
  if recompute:  # the engine's log-probs are μ (behavior_logp); old_logp is the policy's own
    batch, mismatch = engine_old_logp(policy_logp_fn(step), policy_params(state), batch)
    engine_metrics.update(mismatch)
  if reference is not None and step.reads_ref_logp:
    batch = reference(batch)
    jax.block_until_ready(batch.ref_logp)
  return batch


def grpo_iteration(
  step: TrainStep,
  state: TrainState,
  prompt_tokens,
  prompt_mask,
  *,
  key,
  reward_fn: Callable[..., Sequence[float | None]],
  sampling: SamplingConfig,
  reference: Reference | None = None,
  decode: Callable[[list[int]], Any] | None = None,
  prompts: Sequence[Any] | None = None,
  columns: Mapping[str, Sequence[Any]] | None = None,
  buckets: Sequence[int] | None = DEFAULT_BUCKETS,
  hyper=None,
  engine=None,
) -> IterationResult:
  """One GRPO iteration: sample G completions per prompt, score them with ``reward_fn``, build and
  place the batch, run the reference pass (only when the step reads ``ref_logp``: β > 0 or a custom
  function) and update.

  Args:
    step: the train step (:func:`jaxgrpo.step.train.make_train_step`); its configuration decides the
      advantages and the objective.
    state: the train state; consumed (donated) by the update — use the returned one.
    prompt_tokens: ``int32[B, P]`` left-padded prompts; prompt_mask: ``bool[B, P]``.
    key: PRNG key of the rollout.
    reward_fn: ``reward_fn(prompts, completions, **columns) -> N rewards`` (see :func:`score`).
    sampling: a :class:`SamplingConfig` (the temperature is the step's ``TrainConfig.temperature``).
    reference: :func:`make_reference`'s result; required when the step needs ``ref_logp``.
    decode, prompts, columns: passed to :func:`score`.
    buckets: completion-length buckets (None: keep ``max_new_tokens`` columns).
    hyper: optional hyper-parameter pytree of the update (``step(state, batch, hyper)``; e.g.
      ``config.hyper(beta=...)``, a :class:`~jaxgrpo.kernels.config.GRPOHyper`), or None.
    engine: an :class:`~jaxgrpo.rollout.engines.Engine` to sample with instead of the built-in sampler (None).
      Every call pushes the current policy into it first (:func:`engine_sample`; the caller never pushes).
      When the engine does not declare its log-probs the policy's (``jaxgrpo.rollout.engines.logprobs_are_policy``),
      its log-probs become the batch's ``behavior_logp`` and ``old_logp`` is recomputed with the policy
      (:func:`engine_old_logp`, one forward pass; metrics ``engine/mismatch_k3``,
      ``engine/logp_abs_diff_max``); ``engine/push_s`` and ``engine/generate_s`` are added either way. The same
      recomputation (and metrics) with ``sampling.quantize``: the sampler's log-probs are the quantised policy's.

  Returns:
    An :class:`IterationResult` ``(state, metrics, rollout, rewards)``.

  Everything that would fail after the rollout (group size, divisibility, a missing
  reference) is checked before it. One process, or every process with the same prompts: for per-host
  scoring in multi-host runs, compose the pieces with ``place(..., process_local=True)``.
  """
  _check_iteration(step, sampling, reference, int(np.shape(prompt_tokens)[0]))
  hyper = step.check_hyper(hyper)  # before the rollout, as the other checks
  # quantised rollout weights (sampling.quantize): the sampler's log-probs are μ's, not the policy's
  engine_metrics, recompute = {}, sampling.quantize is not None
  if engine is not None:
    check_engine(engine)
    recompute = recompute or not logprobs_are_policy(engine)
  t0 = time.perf_counter()
  policy, temperature = policy_model(step.graphdef, state), step.train_config.temperature
  if engine is None:
    rollout = jax.block_until_ready(
      sample(policy, prompt_tokens, prompt_mask, sampling, key=key, temperature=temperature)
    )
  else:
    rollout, engine_metrics = engine_sample(
      engine, policy, prompt_tokens, prompt_mask, sampling, key=key, temperature=temperature
    )
  t1 = time.perf_counter()
  rewards = score(reward_fn, rollout, decode=decode, prompts=prompts, columns=columns)
  t2 = time.perf_counter()
  batch = _update_batch(step, state, rollout, rewards, buckets, reference, recompute, engine_metrics)
  t3 = time.perf_counter()
  state, step_metrics = step(state, batch) if hyper is None else step(state, batch, hyper)
  step_metrics = jax.device_get(step_metrics)
  jax.block_until_ready(state)
  t4 = time.perf_counter()
  metrics = {k: float(v) for k, v in step_metrics.items()}
  metrics.update(
    **finite_reward_stats(rewards),
    completion_length=float(np.asarray(rollout.mask).sum(axis=1).mean()),
    rollout_s=t1 - t0,
    reward_s=t2 - t1,
    reference_s=t3 - t2,
    update_s=t4 - t3,
    iteration_s=t4 - t0,
    **engine_metrics,
  )
  return IterationResult(state, metrics, rollout, rewards)


def multiturn_iteration(
  step: TrainStep,
  state: TrainState,
  rows: Sequence[Mapping[str, Any]],
  *,
  key,
  make_env: Callable[[Mapping[str, Any]], Any],
  tokenizer,
  sampling: SamplingConfig,
  env_config: MultiTurnConfig,
  reference: Reference | None = None,
  buckets: Sequence[int] | None = DEFAULT_BUCKETS,
  engine=None,
) -> IterationResult:
  """One GRPO iteration over multi-turn trajectories: :func:`sample_multiturn` (G per row, the
  environments' rewards), a :class:`~jaxgrpo.step.train.Batch` with the rollout's ``policy_mask`` (placed,
  packed with ``TrainConfig.packing``), the reference pass when the step reads ``ref_logp``, the update.

  Args:
    step, state, key, sampling, reference, buckets: as for :func:`grpo_iteration` (``sampling``'s
      ``max_new_tokens`` is unused: ``env_config`` bounds the tokens).
    rows: B dataset rows; ``make_env(row)`` builds one environment per trajectory.
    tokenizer: the policy's tokenizer (a chat template; turns decoded, observations encoded).
    env_config: a :class:`~jaxgrpo.rollout.environments.MultiTurnConfig`.
    engine: an :class:`~jaxgrpo.rollout.engines.Engine` for the turns (None: the built-in sampler), as for
      :func:`grpo_iteration`: the policy is pushed first, every turn goes to the engine as token ids, and
      when the engine's log-probs are not the policy's they become ``behavior_logp`` and ``old_logp`` is
      recomputed with the policy (``engine/mismatch_k3`` over policy tokens only). The same with
      ``sampling.quantize`` (the turns sample the quantised policy μ).

  Returns:
    An :class:`IterationResult` whose ``rollout`` is the :class:`~jaxgrpo.rollout.environments.MultiTurnRollout`
    and whose metrics add the turn metrics (``env/turns``, ``env/tool_calls``, ``env/tool_errors``,
    ``env/tool_s``, ``env/policy_tokens``, ... — :func:`jaxgrpo.rollout.environments.rollout_metrics`).
  """
  _check_iteration(step, sampling, reference, len(rows))
  # quantised rollout weights (sampling.quantize): the turns' log-probs are μ's, not the policy's
  engine_metrics, recompute = {}, sampling.quantize is not None
  policy = policy_model(step.graphdef, state)
  if engine is not None:
    check_engine(engine)
    recompute = recompute or not logprobs_are_policy(engine)
    engine_metrics["engine/push_s"] = timed_push(engine, policy, sampling)
  t0 = time.perf_counter()
  rollout: MultiTurnRollout = sample_multiturn(
    policy,
    rows,
    make_env,
    tokenizer,
    sampling,
    env_config,
    key=key,
    temperature=step.train_config.temperature,
    engine=engine,
  )
  t1 = time.perf_counter()
  batch = _update_batch(step, state, rollout, rollout.rewards, buckets, reference, recompute, engine_metrics)
  t2 = time.perf_counter()
  state, step_metrics = step(state, batch)
  step_metrics = jax.device_get(step_metrics)
  jax.block_until_ready(state)
  t3 = time.perf_counter()
  metrics = {k: float(v) for k, v in step_metrics.items()}
  metrics.update(rollout_metrics(rollout))
  metrics.update(engine_metrics)
  metrics.update(
    **finite_reward_stats(rollout.rewards),
    completion_length=float(rollout.mask.sum(axis=1).mean()),
    rollout_s=t1 - t0,
    reward_s=0.0,
    reference_s=t2 - t1,
    update_s=t3 - t2,
    iteration_s=t3 - t0,
  )
  return IterationResult(state, metrics, rollout, rollout.rewards)
