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
needs, :func:`score` (or its own scorer), builds a host :class:`~jaxgrpo.train.Batch` and places it with
:func:`place` (bucket padding, ``process_local=True`` for per-host rows), then the reference and the step.
``jaxgrpo.trainer`` does so. Multi-host, per process::

    tokens, mask = place_prompts(tokens, mask, mesh=step.mesh)    # each process sends its own prompts
    rollout = sample(policy, tokens, mask, sampling, key=key)      # one program on the global mesh
    mine = jaxgrpo.distributed.process_rows(rollout._replace(num_steps=None), step.mesh)  # NumPy
    rewards = score(reward_fn, mine, ...)                          # this host's rows only
    batch = place(Batch.from_rollout(mine, rewards), mesh=step.mesh, process_local=True,
                  train_config=step.train_config)

Donation: the step consumes ``state`` (its arrays are deleted), so a policy model merged from it is
valid until the next update; sample first, then update — as :func:`grpo_iteration` does. The reference
parameters are never donated: a copy of the initial parameters, or, for a LoRA policy
(``jaxgrpo.models.lora``), the state's own frozen base weights with the adapters left out.

Engines: :func:`grpo_iteration` (``engine=``) samples through any :class:`jaxgrpo.engines.Engine`, pushing
the policy first (:func:`engine_sample`); when the engine's log-probs are not the policy's
(``jaxgrpo.engines.logprobs_are_policy``), they become ``behavior_logp`` and :func:`engine_old_logp`
recomputes ``old_logp`` with :func:`policy_logp_fn` — the trainer and the multi-turn path use the same two.

One job at ~840 lines: the host-side glue of one iteration (sample, score, build and place the batch,
select groups, the reference pass, the engine path, the convenience functions that chain them); each piece
is a small function a trainer can call alone.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxgrpo import _checks
from jaxgrpo import sharding as shd
from jaxgrpo.batch import Batch
from jaxgrpo.batch_packing import DEFAULT_BUCKETS, pack_batch, pad_to_bucket
from jaxgrpo.config import GRPOConfig
from jaxgrpo.engines.base import check_engine, logprobs_are_policy
from jaxgrpo.environments.rollout import MultiTurnConfig, MultiTurnRollout, rollout_metrics, sample_multiturn
from jaxgrpo.kl import kl_penalty
from jaxgrpo.losses import finalize_terms
from jaxgrpo.models import lora
from jaxgrpo.objective import objective_terms, rollout_advantages
from jaxgrpo.rewards import finite_reward_stats, group_is_informative
from jaxgrpo.sampling import Rollout, generate
from jaxgrpo.train import (
  TrainConfig,
  TrainState,
  TrainStep,
  _check_not_donated,
  _merge_model,
  make_reference_fn,
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
  """How :func:`sample` draws completions (the keyword arguments of ``jaxgrpo.sampling.generate``).

  The temperature is not here: it is the train step's ``TrainConfig.temperature`` (the rollout
  log-probs must refer to the temperature the step computes its log-probs at), which
  :func:`grpo_iteration` passes to :func:`sample`.

  Attributes:
    num_samples: G, completions per prompt (the group size).
    max_new_tokens: T, the completion length budget of single-turn sampling (:func:`sample`,
      :func:`grpo_iteration`: required there). None (the default) for multi-turn sampling, whose token
      budgets are ``MultiTurnConfig``'s (``max_tokens``, ``turn_tokens``); a value given there is ignored.
    top_p, top_k: nucleus and top-k filtering (1.0 and 0: off).
    eos_ids: token ids that end a completion (empty: every completion has T tokens).
    pad_id: id written after the end of each completion.
    suppress_ids: token ids never sampled (``generate``'s ``suppress_ids``; None: the pad id unless
      it is also an EOS id; ``()``: none).
    merge_lora: sample a LoRA policy from ``models.lora.merge_lora(model)`` (a plain model: no
      adapter matmuls per token, but a merged copy of every adapted weight while sampling and one
      merge per call) instead of the adapted model (default). Ignored for a model without adapters.
    record_routing: record each token's experts (``Rollout.routing``: a mixture-of-experts policy's
      routing replay, ``jaxgrpo.models.moe``); ValueError from ``generate`` for a dense model.
  """

  num_samples: int
  max_new_tokens: int | None = None
  top_p: float = 1.0
  top_k: int = 0
  eos_ids: tuple[int, ...] = ()
  pad_id: int = 0
  suppress_ids: tuple[int, ...] | None = None
  merge_lora: bool = False
  record_routing: bool = False

  def __post_init__(self):
    object.__setattr__(self, "eos_ids", tuple(self.eos_ids))
    if self.suppress_ids is not None:
      object.__setattr__(self, "suppress_ids", tuple(self.suppress_ids))
    for name in ("num_samples", "max_new_tokens"):
      v = getattr(self, name)
      if (v is not None or name == "num_samples") and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
        raise ValueError(
          f"`{name}` must be an int >= 1{' or None (multi-turn)' if name != 'num_samples' else ''}; got {v!r}"
        )

  def generate_kwargs(self, temperature: float, where: str) -> dict[str, Any]:
    """The keyword arguments of ``jaxgrpo.sampling.generate`` / ``Engine.generate`` for single-turn sampling
    at ``temperature`` (``key`` and ``record_routing`` are the caller's); ``where`` names the caller in the
    error of a None ``max_new_tokens``."""
    return dict(
      num_samples=self.num_samples,
      max_new_tokens=self.require_max_new_tokens(where),
      temperature=temperature,
      top_p=self.top_p,
      top_k=self.top_k,
      eos_ids=self.eos_ids,
      pad_id=self.pad_id,
      suppress_ids=self.suppress_ids,
    )

  def require_max_new_tokens(self, where: str) -> int:
    """``max_new_tokens``, or a ValueError naming ``where`` when it is None (single-turn sampling needs it)."""
    if self.max_new_tokens is None:
      raise ValueError(
        f"{where}: `SamplingConfig.max_new_tokens` is None; single-turn sampling needs the completion length budget "
        "(None is for multi-turn sampling only)"
      )
    return self.max_new_tokens


class Reference(NamedTuple):
  """The frozen reference policy: its parameters and the jitted log-prob pass.

  ``params``: a copy of the initial parameters (full fine-tuning), or a LoRA policy's frozen base
  weights — the train state's own ``frozen`` arrays, not a copy (the reference is the base model:
  ``models.lora.base_model``).

  ``reference(batch)`` returns ``batch`` with ``ref_logp`` ``f32[B, T]`` filled in;
  ``reference.log_probs(batch)`` returns the log-probs alone. Built by :func:`make_reference`.
  """

  params: Any
  fn: Callable

  def log_probs(self, batch: Batch) -> jax.Array:
    """``f32[B, T]`` reference log-probs of ``batch``'s completions (batch-sharded)."""
    return self.fn(self.params, batch)

  def __call__(self, batch: Batch) -> Batch:
    return batch._replace(ref_logp=self.log_probs(batch))


class IterationResult(NamedTuple):
  """What :func:`grpo_iteration` returns.

  Attributes:
    state: the updated :class:`~jaxgrpo.train.TrainState` (the one passed in is consumed).
    metrics: ``{name: float}``: the step's metrics, ``reward_mean``/``reward_std`` (over finite
      rewards), ``completion_length`` (mean real tokens per row) and the phase times in seconds
      ``rollout_s``, ``reward_s``, ``reference_s`` (batch building and the reference pass),
      ``update_s`` and ``iteration_s``.
    rollout: the sampled :class:`~jaxgrpo.sampling.Rollout` (N = prompts × G rows), for inspection.
    rewards: ``f32[N]`` the rewards (NaN: a missing sample).
  """

  state: TrainState
  metrics: dict
  rollout: Rollout
  rewards: np.ndarray


class GroupSelection(NamedTuple):
  """What :func:`select_groups` returns.

  Attributes:
    kept: ``(round, group)`` of every group of the batch, in batch order (complete when ``done``).
    dropped: how many groups of all rounds so far had equal rewards (counted also when they are
      later used to fill the batch).
    done: True when the batch is decided: ``num_groups`` groups kept, or ``max_rounds`` rounds
      sampled (then the batch is filled with equal-reward groups, the earliest first).
  """

  kept: list[tuple[int, int]]
  dropped: int
  done: bool


def select_groups(
  rewards: Sequence[Any], *, num_groups: int, group_size: int, max_rounds: int, dynamic: bool = True
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

  Returns:
    a :class:`GroupSelection`.
  """
  for name, value in (("num_groups", num_groups), ("group_size", group_size), ("max_rounds", max_rounds)):
    _checks.check_python_int(value, name, minimum=1)
  if len(rewards) < 1:
    raise ValueError("`rewards` must hold the rewards of at least one round; got none")
  group_ids = np.repeat(np.arange(num_groups), group_size)
  kept, spare = [], []
  for r, round_rewards in enumerate(rewards):
    shape = np.shape(round_rewards)
    if shape != (num_groups * group_size,):
      raise ValueError(
        f"`rewards[{r}]` must have shape [num_groups · group_size] = [{num_groups * group_size}]; got {list(shape)}"
      )
    informative = group_is_informative(round_rewards, group_ids, num_groups) if dynamic else np.ones(num_groups, bool)
    for b in range(num_groups):
      if not informative[b]:
        spare.append((r, b))
      elif len(kept) < num_groups:
        kept.append((r, b))
  if len(kept) < num_groups and len(rewards) >= max_rounds:
    kept += spare[: num_groups - len(kept)]  # give up refilling: these groups have zero advantage
  return GroupSelection(kept=kept, dropped=len(spare), done=len(kept) == num_groups)


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
    objective_fn, advantages_fn: the hooks of ``jaxgrpo.train.make_train_step`` (same signatures).
    hyper: optional hyper-parameter pytree passed to both hooks as ``hyper=`` (a
      :class:`~jaxgrpo.config.GRPOHyper` for the defaults: β, ε, ... as traced ``f32[]``, e.g. a
      ``vmap``-ped grid); None: the config's numbers, static.

  Returns:
    ``(loss f32[], metrics)`` as :func:`jaxgrpo.losses.finalize_terms` gives them (the loss and the
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


def policy_model(graphdef, state: TrainState) -> nnx.Module:
  """The policy as a model, ``nnx.merge(graphdef, state.params, state.frozen)``, for the next rollout.

  It shares ``state``'s arrays: valid until the next call of the train step consumes ``state``.
  """
  _check_not_donated(state, "state")
  return _merge_model(graphdef, state.params, state.frozen)


def _trains_adapters_only(params, frozen) -> bool:
  """Whether ``params`` are exactly the LoRA adapters and ``frozen`` everything else."""
  flat = nnx.to_flat_state(params)
  frozen_flat = [] if frozen is None else nnx.to_flat_state(frozen)
  return (
    bool(flat)
    and all(isinstance(v, nnx.LoRAParam) for _, v in flat)
    and not any(isinstance(v, nnx.LoRAParam) for _, v in frozen_flat)
  )


def make_reference(step: TrainStep, state: TrainState) -> Reference:
  """The reference policy of ``step`` and the jitted log-prob pass (:func:`jaxgrpo.train.make_reference_fn`,
  same mesh, micro-batches, temperature and chunking as the step). Build it once, from the initial state.

  - LoRA (``state.params`` are the adapters, ``state.frozen`` the base weights — ``init_train_state(...,
    trainable=nnx.LoRAParam)``): the reference is the base model with the adapters removed
    (``models.lora.base_model``) running on ``state.frozen`` itself — never donated, not copied. This
    saves a second copy of the base weights: 2 bytes × N parameters in bf16 (8.0 GB for Qwen3-4B).
  - Otherwise: a copy of ``state.params`` (placed like the policy's, never donated); a policy whose
    frozen part is not empty is merged with it unchanged.

  ``state`` may also be the parameters alone (``state.params``, the earlier form) when nothing is frozen.
  """
  if not isinstance(state, TrainState):
    if jax.tree.leaves(step.shardings.frozen):
      raise TypeError(
        "make_reference needs the TrainState (not its params) when the step has frozen variables (LoRA): "
        "make_reference(step, state)"
      )
    state = TrainState(state, None, None, None)
  _check_not_donated((state.params, state.frozen), "state")
  kw = dict(mesh=step.mesh, train_config=step.train_config, rules=step.rules)
  if _trains_adapters_only(state.params, state.frozen):
    base = lora.base_model(_merge_model(step.graphdef, state.params, state.frozen))
    fn = make_reference_fn(nnx.graphdef(base), param_shardings=step.shardings.frozen, **kw)
    return Reference(state.frozen, fn)
  copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=step.shardings.params)
  params, shardings = copy(state.params), step.shardings.params
  if state.frozen is not None and jax.tree.leaves(state.frozen):  # a custom filter: frozen, not copied
    params, shardings = nnx.merge_state(params, state.frozen), nnx.merge_state(shardings, step.shardings.frozen)
  return Reference(params, make_reference_fn(step.graphdef, param_shardings=shardings, **kw))


def place_prompts(prompt_tokens, prompt_mask, *, mesh: Mesh, rules: Mapping[str, Any] | None = None):
  """The prompts of one :func:`sample` call laid out for the global mesh, so that the sampler runs on
  every process's devices with each process transferring only its own prompts.

  When B divides the batch axes (``data × fsdp``) the rows are placed over them: each process passes
  only the prompts :func:`jaxgrpo.sharding.process_batch_rows` gives it
  (``place_batch(..., process_local=True)``), and its devices sample those prompts' G·B/``process_count``
  rows. Otherwise the arrays are returned as they are (NumPy, replicated: the same on every process).
  Either way the sampler is one program over the global mesh, so each row's tokens — its PRNG draws
  depend only on the key, the step and the row's global index — do not depend on how many
  processes run it; :func:`jaxgrpo.distributed.process_rows` then gives each process its own rows.

  Args:
    prompt_tokens: ``int32[B, P]`` left-padded prompts, every process the same (NumPy);
      prompt_mask: ``bool[B, P]``.
    mesh, rules: the mesh and rules table of the step.

  Returns:
    ``(prompt_tokens, prompt_mask)`` for :func:`sample`.
  """
  tokens, mask = np.asarray(prompt_tokens), np.asarray(prompt_mask)
  b = tokens.shape[0]
  if b % shd.batch_shards(mesh, rules):
    return tokens, mask
  rows = shd.process_batch_rows(mesh, b, rules)
  return shd.place_batch((tokens[rows], mask[rows]), mesh, rules, process_local=True)


def sample(model, prompt_tokens, prompt_mask, sampling: SamplingConfig, *, key, temperature: float = 1.0) -> Rollout:
  """G completions of each prompt: ``jaxgrpo.sampling.generate`` with ``sampling``'s arguments.

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
  if not isinstance(sampling, SamplingConfig):
    raise TypeError(f"sampling must be a jaxgrpo.iteration.SamplingConfig; got {type(sampling).__name__}")
  return generate(
    _sampled_model(model, sampling),
    prompt_tokens,
    prompt_mask,
    **sampling.generate_kwargs(temperature, "sample"),
    key=key,
    record_routing=sampling.record_routing,
  )


def _sampled_model(model, sampling: SamplingConfig):
  """The model to sample from: ``model`` merged (``lora.merge_lora``) when ``sampling.merge_lora`` and it has
  adapters, else ``model``."""
  return lora.merge_lora(model) if sampling.merge_lora and lora.has_adapters(model) else model


def _push_policy(engine, model, sampling: SamplingConfig) -> float:
  """Push the model to sample from (:func:`_sampled_model`) into ``engine``; the seconds it took."""
  model = _sampled_model(model, sampling)
  t0 = time.perf_counter()
  engine.push_weights(model)
  return time.perf_counter() - t0


def engine_sample(
  engine, model, prompt_tokens, prompt_mask, sampling: SamplingConfig, *, key, temperature: float = 1.0
) -> tuple[Rollout, dict]:
  """:func:`sample` through an :class:`~jaxgrpo.engines.Engine`: push ``model`` (merged first with
  ``sampling.merge_lora``), then ``engine.generate`` with ``sampling``'s arguments.

  The push happens on every call: the policy changes with every update, and an engine that sampled from the
  previous weights would be silently off-policy (the built-in engine's previous weights are even deleted by
  the step's donation). An engine makes a push of unchanged weights cheap if it can.

  Returns:
    ``(rollout, times)``: the ``Rollout`` of N = B·G rows (``num_steps`` None; ``log_probs`` the engine's)
    and ``{"engine/push_s", "engine/generate_s"}`` in seconds.
  """
  check_engine(engine)
  if sampling.record_routing:
    raise ValueError("sampling.record_routing: an engine records no routing; sample without engine= for MoE replay")
  push_s = _push_policy(engine, model, sampling)
  t1 = time.perf_counter()
  gen = engine.generate(prompt_tokens, prompt_mask, **sampling.generate_kwargs(temperature, "engine_sample"), key=key)
  rollout = jax.block_until_ready(gen.rollout._replace(num_steps=None))
  return rollout, {"engine/push_s": push_s, "engine/generate_s": time.perf_counter() - t1}


_POLICY_LOGP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def policy_params(state: TrainState):
  """The policy's variables of ``state`` as one state: ``params`` merged with ``frozen`` when it is not empty."""
  frozen = state.frozen
  return nnx.merge_state(state.params, frozen) if frozen is not None and jax.tree.leaves(frozen) else state.params


def policy_logp_fn(step: TrainStep) -> Callable:
  """The jitted ``(policy_params(state), batch) -> f32[B, T]`` log-probs of the batch's completions under
  the policy (:func:`jaxgrpo.train.make_reference_fn` on the step's graph, mesh, micro-batches, packing and
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


def engine_old_logp(logp_fn: Callable, params, batch: Batch) -> tuple[Batch, dict]:
  """``batch`` (placed, ``behavior_logp`` = the engine's log-probs μ) with ``old_logp`` recomputed by the
  policy, ``logp_fn(params, batch)`` (:func:`policy_logp_fn`, :func:`policy_params`), for an engine whose
  log-probs are not the policy's (``jaxgrpo.engines.logprobs_are_policy`` False: other kernels, dtype,
  weights). The ratio of the objective is then against the policy that sampled, and the engine mismatch
  is left to ``GRPOConfig.importance_correction`` (TIS/MIS on ``behavior_logp``).

  Returns:
    ``(batch, metrics)``: ``engine/mismatch_k3``, the mean over real (policy, when the batch has a
    ``policy_mask``) tokens of ``r − log r − 1`` with
    ``r = π_old/μ`` (``jaxgrpo.kl``'s k3), and ``engine/logp_abs_diff_max``, max |log π_old − log μ|.
  """
  old = logp_fn(params, batch)
  behavior, mask = batch.behavior_logp, batch.mask
  if batch.policy_mask is not None:  # multi-turn: observation tokens were not sampled by the engine
    mask = mask & batch.policy_mask
  k3 = kl_penalty(old, behavior, "forward_k3", mask=mask)
  n = jnp.maximum(mask.sum(), 1)
  metrics = {
    "engine/mismatch_k3": float((k3 * mask).sum() / n),
    "engine/logp_abs_diff_max": float(jnp.where(mask, abs(old - behavior), 0.0).max()),
  }
  return batch._replace(old_logp=old), metrics


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


def place(
  batch: Batch,
  *,
  mesh: Mesh,
  rules: Mapping[str, Any] | None = None,
  buckets: Sequence[int] | None = DEFAULT_BUCKETS,
  process_local: bool = False,
  train_config: TrainConfig | None = None,
) -> Batch:
  """A host :class:`~jaxgrpo.train.Batch` bucket-padded, packed (with ``train_config.packing``) and
  placed on ``mesh`` (rows over ``data × fsdp``).

  Args:
    batch: the batch (NumPy or JAX arrays).
    buckets: completion-length buckets for :func:`jaxgrpo.train.pad_to_bucket` (None: keep T).
    process_local: ``batch`` holds only this process's rows (multi-host: each process feeds its slice,
      ``jaxgrpo.sharding.process_batch_rows``); every process then pads to the same bucket, and packs
      its own device shards' slots with the same rows and head length.
    train_config: the step's :class:`~jaxgrpo.train.TrainConfig`; with ``packing`` set the batch is
      packed once here (:func:`jaxgrpo.train.pack_batch`, the step's slots), and the reference pass
      and the step use that layout. None: not packed (the step packs it itself if it packs).
  """
  multi = process_local and jax.process_count() > 1
  if buckets is not None:
    length = None
    if multi:
      mask = np.asarray(batch.mask)
      local = int(mask.any(axis=0).nonzero()[0].max() + 1) if mask.any() else 1
      length = int(np.max(multihost_utils.process_allgather(np.int32(local))))
    batch = pad_to_bucket(batch, buckets, length=length)
  if train_config is not None and train_config.packing is not None and batch.packed is None:
    batch = _pack(batch, train_config, mesh, rules, multi)
  placed = shd.place_batch(batch._replace(packed=None), mesh, rules, process_local=process_local)
  if batch.packed is None:
    return placed
  # packed arrays: rows, slots or sequences first; each over data × fsdp on its own leading axis
  place_one = lambda x: shd.place_batch(np.asarray(x, np.int32), mesh, rules, process_local=process_local)
  return placed._replace(packed=jax.tree.map(place_one, batch.packed))


def _pack(batch: Batch, tc: TrainConfig, mesh: Mesh, rules, multi: bool) -> Batch:
  """``jaxgrpo.train.pack_batch`` for the step of ``tc`` on ``mesh``. With process-local rows (``multi``)
  this process packs its own shards' slots, then every process repacks to the largest rows per slot and
  head length of any process, so the global arrays have one shape."""
  shards = shd.batch_shards(mesh, rules)
  if multi:  # the rows of one process (1/process_count of the batch, as place_batch assumes) cover its shards
    if shards % jax.process_count():
      raise ValueError(
        f"packing process-local rows needs the batch mesh axes (data×fsdp = {shards}) to divide over the "
        f"{jax.process_count()} processes"
      )
    shards //= jax.process_count()
  pack = lambda **kw: pack_batch(
    batch, row_length=tc.packing, shards=shards, mini_batches=tc.mini_batches, micro_batches=tc.micro_batches, **kw
  )
  packed = pack(rows=tc.packing_rows)
  if not multi:
    return packed
  rows, head = packed.packed.rows_per_slot, packed.packed.head_index.shape[1] // packed.packed.rows_per_slot
  rows, head = (int(x) for x in np.max(multihost_utils.process_allgather(np.int32([rows, head])), axis=0))
  return pack(rows=rows, head_length=head)


def make_batch(
  rollout: Rollout,
  rewards,
  *,
  mesh: Mesh,
  rules: Mapping[str, Any] | None = None,
  advantages=None,
  token_weights=None,
  behavior_logp=None,
  buckets: Sequence[int] | None = DEFAULT_BUCKETS,
  process_local: bool = False,
  train_config: TrainConfig | None = None,
) -> Batch:
  """A rollout and its ``f32[N]`` rewards as a placed :class:`~jaxgrpo.train.Batch` (see :func:`place`:
  bucketed, packed for ``train_config`` when it packs), with optional precomputed ``advantages``
  (``f32[N]`` or ``f32[N, T]``) and ``token_weights`` (``f32[N, T]``), and the behaviour policy's
  ``behavior_logp`` (``f32[N, T]``) when the rollout's log-probs are not the behaviour policy's
  (off-policy correction, ``GRPOConfig.importance_correction``)."""
  batch = Batch.from_rollout(
    rollout, rewards, advantages=advantages, token_weights=token_weights, behavior_logp=behavior_logp
  )
  return place(batch, mesh=mesh, rules=rules, buckets=buckets, process_local=process_local, train_config=train_config)


def _check_iteration(step: TrainStep, sampling: SamplingConfig, reference, num_prompts: int) -> None:
  """Everything that would fail after the rollout, checked before it."""
  if not isinstance(step, TrainStep):
    raise TypeError(f"step must be a jaxgrpo.train.TrainStep (make_train_step); got {type(step).__name__}")
  if not isinstance(sampling, SamplingConfig):
    raise TypeError(f"sampling must be a jaxgrpo.iteration.SamplingConfig; got {type(sampling).__name__}")
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
    raise TypeError(f"reference must be a jaxgrpo.iteration.Reference (make_reference); got {type(reference).__name__}")


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
    step: the train step (:func:`jaxgrpo.train.make_train_step`); its configuration decides the
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
      ``config.hyper(beta=...)``, a :class:`~jaxgrpo.config.GRPOHyper`), or None.
    engine: an :class:`~jaxgrpo.engines.Engine` to sample with instead of the built-in sampler (None).
      Every call pushes the current policy into it first (:func:`engine_sample`; the caller never pushes).
      When the engine does not declare its log-probs the policy's (``jaxgrpo.engines.logprobs_are_policy``),
      its log-probs become the batch's ``behavior_logp`` and ``old_logp`` is recomputed with the policy
      (:func:`engine_old_logp`, one forward pass; metrics ``engine/mismatch_k3``,
      ``engine/logp_abs_diff_max``); ``engine/push_s`` and ``engine/generate_s`` are added either way.

  Returns:
    An :class:`IterationResult` ``(state, metrics, rollout, rewards)``.

  Everything that would fail after the rollout (group size, divisibility, a missing
  reference) is checked before it. One process, or every process with the same prompts: for per-host
  scoring in multi-host runs, compose the pieces with ``place(..., process_local=True)``.
  """
  _check_iteration(step, sampling, reference, int(np.shape(prompt_tokens)[0]))
  hyper = step.check_hyper(hyper)  # before the rollout, as the other checks
  engine_metrics, recompute = {}, False
  if engine is not None:
    check_engine(engine)
    recompute = not logprobs_are_policy(engine)
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
  environments' rewards), a :class:`~jaxgrpo.train.Batch` with the rollout's ``policy_mask`` (placed,
  packed with ``TrainConfig.packing``), the reference pass when the step reads ``ref_logp``, the update.

  Args:
    step, state, key, sampling, reference, buckets: as for :func:`grpo_iteration` (``sampling``'s
      ``max_new_tokens`` is unused: ``env_config`` bounds the tokens).
    rows: B dataset rows; ``make_env(row)`` builds one environment per trajectory.
    tokenizer: the policy's tokenizer (a chat template; turns decoded, observations encoded).
    env_config: a :class:`~jaxgrpo.environments.MultiTurnConfig`.
    engine: an :class:`~jaxgrpo.engines.Engine` for the turns (None: the built-in sampler), as for
      :func:`grpo_iteration`: the policy is pushed first, every turn goes to the engine as token ids, and
      when the engine's log-probs are not the policy's they become ``behavior_logp`` and ``old_logp`` is
      recomputed with the policy (``engine/mismatch_k3`` over policy tokens only).

  Returns:
    An :class:`IterationResult` whose ``rollout`` is the :class:`~jaxgrpo.environments.MultiTurnRollout`
    and whose metrics add the turn metrics (``env/turns``, ``env/tool_calls``, ``env/tool_errors``,
    ``env/tool_s``, ``env/policy_tokens``, ... — :func:`jaxgrpo.environments.rollout_metrics`).
  """
  _check_iteration(step, sampling, reference, len(rows))
  engine_metrics, recompute = {}, False
  policy = policy_model(step.graphdef, state)
  if engine is not None:
    check_engine(engine)
    recompute = not logprobs_are_policy(engine)
    engine_metrics["engine/push_s"] = _push_policy(engine, policy, sampling)
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
