"""Collecting one batch of scored groups: place the prompts (:func:`place_prompts`), sample them with the
policy (:func:`sample`) or an engine (:func:`engine_sample`, pushing the policy first), recompute the policy's
own log-probs when an engine's are not (:func:`policy_logp_fn`, :func:`engine_old_logp`), score the rows
with a Python reward function (:func:`score`) and pick the informative groups for dynamic sampling
(:func:`select_groups`). ``jaxgrpo.loop.iteration`` chains these into one iteration; the trainer's
rollout source calls them one at a time.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np
from flax import nnx

from jaxgrpo import _checks
from jaxgrpo.kernels.importance import mismatch_k3
from jaxgrpo.rewards.reward_set import group_is_informative
from jaxgrpo.rollout.engines.base import check_engine, check_generation
from jaxgrpo.rollout.engines.builtin import place_prompts
from jaxgrpo.rollout.sampling import Rollout, SamplingConfig, check_sampling, generate
from jaxgrpo.step.batch import Batch
from jaxgrpo.step.train import (
  TrainStep,
  make_reference_fn,
)

__all__ = [
  "sampled_token_mismatch",
  "GroupSelection",
  "engine_old_logp",
  "engine_sample",
  "place_prompts",
  "policy_logp_fn",
  "recompute_old_logp",
  "sample",
  "score",
  "select_groups",
]


class GroupSelection(NamedTuple):
  """What :func:`select_groups` returns.

  Attributes:
    kept: ``(round, group)`` of every group of the batch, in batch order (complete when ``done``).
    dropped: how many groups of all rounds so far had equal rewards (counted also when they are
      later used to fill the batch).
    done: True when the batch is decided: ``num_groups`` groups kept, or ``max_rounds`` rounds
      sampled (then the batch is filled with equal-reward groups, the earliest first).
    by_teacher: how many kept groups have equal rewards but a teacher's signal above ``min_signal`` (kept for the
      teacher alone; 0 without ``signal``).
  """

  kept: list[tuple[int, int]]
  dropped: int
  done: bool
  by_teacher: int = 0


def select_groups(
  rewards: Sequence[Any],
  *,
  num_groups: int,
  group_size: int,
  max_rounds: int,
  dynamic: bool = True,
  signal: Sequence[Any] | None = None,
  min_signal: float = 0.0,
) -> GroupSelection:
  """DAPO's dynamic sampling (Yu et al., arXiv:2503.14476, eq. 11) as a host function of the rounds so far.

  Each round samples ``num_groups`` groups of ``group_size`` rows (row ``i`` of a round belongs to
  group ``i // group_size``). Walking the rounds in order, then the groups in order, a group whose
  rewards are not all equal (its advantages are not all zero) is kept while fewer than ``num_groups``
  are kept; a group with equal rewards is dropped. When ``max_rounds`` rounds are sampled and the
  batch is still short, it is filled with the dropped groups, earliest first (zero-advantage groups).
  ``dynamic=False`` keeps the first round as it is. Call it after every round with all rounds so far;
  sample another round while ``done`` is False.

  Args:
    rewards: one ``f[num_groups · group_size]`` array of rewards per round sampled so far (>= 1).
    num_groups: groups per batch (``rollout.prompts_per_step``), >= 1.
    group_size: G, rows per group, >= 1.
    max_rounds: the most rounds (``rollout.dynamic_sampling_max_rounds``), >= 1.
    dynamic: apply dynamic sampling (``GRPOConfig.dynamic_sampling``).
    signal: with a distillation teacher, one ``f[num_groups]`` array per round, each group's teacher signal
      (``jaxgrpo.loop.scoring.teacher_signal``): a group is then informative when its rewards are not all equal
      **or** its signal is above ``min_signal`` (the teacher still has something to teach it). None: rewards only.

  Returns:
    a :class:`GroupSelection`.
  """
  for name, value in (("num_groups", num_groups), ("group_size", group_size), ("max_rounds", max_rounds)):
    _checks.check_python_int(value, name, minimum=1)
  if len(rewards) < 1:
    raise ValueError("`rewards` must hold the rewards of at least one round; got none")
  group_ids = np.repeat(np.arange(num_groups), group_size)
  if signal is not None and len(signal) != len(rewards):
    raise ValueError(f"`signal` must hold one array per round ({len(rewards)}); got {len(signal)}")
  kept, spare, by_teacher = [], [], 0
  for r, round_rewards in enumerate(rewards):
    shape = np.shape(round_rewards)
    if shape != (num_groups * group_size,):
      raise ValueError(
        f"`rewards[{r}]` must have shape [num_groups · group_size] = [{num_groups * group_size}]; got {list(shape)}"
      )
    varied = group_is_informative(round_rewards, group_ids, num_groups) if dynamic else np.ones(num_groups, bool)
    taught = np.zeros(num_groups, bool) if signal is None else np.asarray(signal[r]) > min_signal
    for b in range(num_groups):
      if not (varied[b] or taught[b]):
        spare.append((r, b))
      elif len(kept) < num_groups:
        kept.append((r, b))
        by_teacher += int(not varied[b])
  if len(kept) < num_groups and len(rewards) >= max_rounds:
    kept += spare[: num_groups - len(kept)]  # give up refilling: these groups have zero advantage
  return GroupSelection(kept=kept, dropped=len(spare), done=len(kept) == num_groups, by_teacher=by_teacher)


def sample(model, prompt_tokens, prompt_mask, sampling: SamplingConfig, *, key, temperature: float = 1.0) -> Rollout:
  """G completions of each prompt: ``jaxgrpo.rollout.sampling.generate`` with ``sampling``'s arguments.

  Args:
    model: the policy (:func:`policy_model`).
    prompt_tokens: ``int32[B, P]`` left-padded prompts (NumPy, or placed on the mesh by
      :func:`place_prompts` for multi-host runs); prompt_mask: ``bool[B, P]``.
    sampling: a :class:`SamplingConfig`.
    key: a PRNG key.
    temperature: the sampling temperature (0: greedy): for training, the step's
      ``step.train_config.temperature`` (what :func:`grpo_iteration` passes); evaluation its own.

  Returns:
    A ``Rollout`` of N = B·G rows; row ``b·G + g`` is sample g of prompt b (``group_ids`` = b).
  """
  check_sampling(sampling, "sample")
  sampling.require_max_new_tokens("sample")
  return generate(model, prompt_tokens, prompt_mask, sampling, key=key, temperature=temperature)


def _sampled_model(model, sampling: SamplingConfig):
  """The model to sample from: ``model`` merged (``lora.merge_lora``) when ``sampling.merge_lora`` and it has
  adapters, else ``model`` (:meth:`SamplingConfig.model_to_sample`)."""
  return sampling.model_to_sample(model)


def timed_push(engine, model, sampling: SamplingConfig) -> float:
  """Push the model to sample from (:func:`_sampled_model`) into ``engine``; the seconds it took."""
  model = _sampled_model(model, sampling)
  t0 = time.perf_counter()
  engine.push_weights(model)
  return time.perf_counter() - t0


def engine_sample(
  engine, model, prompt_tokens, prompt_mask, sampling: SamplingConfig, *, key, temperature: float = 1.0
) -> tuple[Rollout, dict]:
  """:func:`sample` through an :class:`~jaxgrpo.rollout.engines.Engine`: push ``model`` (merged first with
  ``sampling.merge_lora``), then ``engine.generate`` with ``sampling``'s arguments.

  The push happens on every call: the policy changes with every update, and an engine that sampled from the
  previous weights would be silently off-policy (the built-in engine's previous weights are even deleted by
  the step's donation). An engine makes a push of unchanged weights cheap if it can.

  The engine's ``Generation`` is checked before it is used (``jaxgrpo.rollout.engines.base.check_generation``:
  B·G rows, group ids, shapes, prefix masks, finite log-probs on real tokens, and a reported temperature equal
  to ``temperature``): a ValueError naming the engine and what was wrong.

  Returns:
    ``(rollout, times)``: the ``Rollout`` of N = B·G rows (``num_steps`` None; ``log_probs`` the engine's;
    ``temperature`` the engine's, else ``temperature``) and ``{"engine/push_s", "engine/generate_s"}`` in seconds.
  """
  check_engine(engine)
  if sampling.record_routing:
    raise ValueError("sampling.record_routing: an engine records no routing; sample without engine= for MoE replay")
  push_s = timed_push(engine, model, sampling)
  t1 = time.perf_counter()
  sampling.require_max_new_tokens("engine_sample")
  gen = engine.generate(prompt_tokens, prompt_mask, sampling, key=key, temperature=temperature)
  gen = check_generation(
    engine,
    gen,
    num_prompts=int(np.shape(prompt_tokens)[0]),
    num_samples=sampling.num_samples,
    max_new_tokens=sampling.max_new_tokens,
    temperature=temperature,
  )
  rollout = jax.block_until_ready(gen.rollout._replace(num_steps=None))
  return rollout, {"engine/push_s": push_s, "engine/generate_s": time.perf_counter() - t1}


# step -> its jitted policy log-prob pass (built once per step object; dropped with the step)
_POLICY_LOGP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def policy_logp_fn(step: TrainStep) -> Callable:
  """The jitted ``(policy_params(state), batch) -> f32[B, T]`` log-probs of the batch's completions under
  the policy (:func:`jaxgrpo.step.train.make_reference_fn` on the step's graph, mesh, micro-batches, packing and
  temperature: the numbers the step computes for ``old_logp``). Built once per step (cached)."""
  fn = _POLICY_LOGP.get(step)
  if fn is None:
    sh = step.shardings
    param_sh = nnx.merge_state(sh.params, sh.frozen) if jax.tree.leaves(sh.frozen) else sh.params
    fn = make_reference_fn(
      step.graphdef, mesh=step.mesh, param_shardings=param_sh, train_config=step.train_config, rules=step.rules
    )
    _POLICY_LOGP[step] = fn
  return fn


def sampled_token_mismatch(old_logp, behavior_logp, mask, policy_mask=None):
  """``(k3, max |log π_old − log μ|)`` over the tokens the sampler drew (``kernels.importance.mismatch_k3``):
  ``mask`` (``bool[B, T]``), and of it only ``policy_mask`` for multi-turn rows (observation tokens were not
  sampled). The engine path here and the learner (``jaxgrpo.loop.schedule.Learner``, jitted) share it."""
  if policy_mask is not None:
    mask = mask & policy_mask
  return mismatch_k3(old_logp, behavior_logp, mask.astype(bool))


def recompute_old_logp(logp_fn: Callable, params, batch: Batch, *, mismatch: Callable = sampled_token_mismatch):
  """The one log-prob recomputation (the learner's, ``jaxgrpo.loop.schedule.Learner``, and the engine path's,
  :func:`engine_old_logp`): ``batch`` (placed; ``old_logp`` the sampler's log-probs μ) with ``old_logp`` :=
  ``logp_fn(params, batch)`` (π_old: :func:`policy_logp_fn`) and ``behavior_logp`` := μ, and
  ``mismatch(π_old, μ, mask, policy_mask)`` (:func:`sampled_token_mismatch`: ``(k3, max |log π_old − log μ|)``
  over the sampled tokens; the learner passes it jitted). Nothing is waited for.

  Returns:
    ``(batch, mismatch)``.
  """
  old = logp_fn(params, batch)
  return batch._replace(old_logp=old, behavior_logp=batch.old_logp), mismatch(
    old, batch.old_logp, batch.mask, batch.policy_mask
  )


def engine_old_logp(logp_fn: Callable, params, batch: Batch) -> tuple[Batch, dict]:
  """``batch`` (placed, ``behavior_logp`` = the engine's log-probs μ) with ``old_logp`` recomputed by the
  policy, ``logp_fn(params, batch)`` (:func:`policy_logp_fn`, :func:`policy_params`), for an engine whose
  log-probs are not the policy's (``jaxgrpo.rollout.engines.logprobs_are_policy`` False: other kernels, dtype,
  weights): :func:`recompute_old_logp`. The ratio of the objective is then against the policy that sampled, and
  the engine mismatch is left to ``GRPOConfig.importance_correction`` (TIS/MIS on ``behavior_logp``).

  Returns:
    ``(batch, metrics)``: ``engine/mismatch_k3``, the mean over real (policy, when the batch has a
    ``policy_mask``) tokens of ``r − log r − 1`` with
    ``r = π_old/μ`` (``jaxgrpo.kernels.importance.mismatch_k3``), and ``engine/logp_abs_diff_max``, max |log π_old − log μ|.
  """
  batch, (k3, diff) = recompute_old_logp(logp_fn, params, batch._replace(old_logp=batch.behavior_logp))
  metrics = {"engine/mismatch_k3": float(k3), "engine/logp_abs_diff_max": float(diff)}
  return batch, metrics


def score(
  reward_fn: Callable[..., Sequence[float | None]],
  rollout: Rollout,
  *,
  decode: Callable[[list[int]], Any] | None = None,
  prompts: Sequence[Any] | None = None,
  columns: Mapping[str, Sequence[Any]] | None = None,
) -> np.ndarray:
  """Rewards of every rollout row from a plain Python function (host side).

  Calls ``reward_fn(prompts, completions, **columns)`` once, with one entry per row (N = B·G):

  - ``completions[i]``: row i's real completion tokens as a list of ints, or ``decode(ids)`` (e.g.
    ``tokenizer.decode``) when ``decode`` is given;
  - ``prompts[i]``: ``prompts[group_ids[i]]`` when ``prompts`` (one entry per prompt, e.g. the prompt
    texts) is given, else the row's real prompt tokens (decoded when ``decode`` is given);
  - ``columns``: per-prompt data (e.g. ``{"answer": answers}``), repeated to rows the same way.

  ``reward_fn`` returns N numbers; None, NaN or ±inf marks a missing sample (e.g. a verifier that
  timed out): it gets advantage 0 and stays out of the loss (counted in ``rewards_nonfinite``).

  Returns:
    ``f32[N]`` NumPy rewards.
  """
  comps, mask = np.asarray(rollout.completions), np.asarray(rollout.mask, bool)
  gids = np.asarray(rollout.group_ids)
  n = comps.shape[0]
  ids = [c[m].tolist() for c, m in zip(comps, mask)]
  completions = ids if decode is None else [decode(x) for x in ids]
  if prompts is None:
    ptoks, pmask = np.asarray(rollout.prompt_tokens), np.asarray(rollout.prompt_mask, bool)
    rows = [p[m].tolist() for p, m in zip(ptoks, pmask)]
    row_prompts = rows if decode is None else [decode(x) for x in rows]
  else:
    row_prompts = _per_row(prompts, gids, "prompts")
  row_columns = {name: _per_row(values, gids, f"columns[{name!r}]") for name, values in (columns or {}).items()}
  out = reward_fn(row_prompts, completions, **row_columns)
  try:
    rewards = np.asarray([np.nan if r is None else r for r in out], np.float32)
  except (TypeError, ValueError) as e:
    raise TypeError(f"reward_fn must return {n} numbers (or None for a missing sample); got {out!r:.200}") from e
  if rewards.shape != (n,):
    raise ValueError(f"reward_fn must return one reward per rollout row ({n}); got shape {rewards.shape}")
  return rewards


def _per_row(values: Sequence[Any], group_ids: np.ndarray, name: str) -> list:
  if group_ids.size and len(values) <= int(group_ids.max()):
    raise ValueError(f"`{name}` has {len(values)} entries, but the rollout has {int(group_ids.max()) + 1} prompts")
  return [values[int(g)] for g in group_ids]
