"""From a run config to the parts of a run: the checks that must pass before anything heavy runs (the mesh,
the rows, the processes, the combination of options), the rollout engine, the sampling settings, the
prompts or environment episodes, the rewards, the optimizer, the rollout source and the schedule that meets it
with the learner. ``jaxgrpo.run.trainer.Trainer`` composes what these return with the loop.
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxgrpo import _checks
from jaxgrpo.loop.async_rollout import AsyncRollouts
from jaxgrpo.loop.partial.schedule import PartialRollouts
from jaxgrpo.loop.schedule import Learner, Synchronous
from jaxgrpo.loop.source import RolloutSource, Turns
from jaxgrpo.models import backend, load_hf, load_tokenizer, moe
from jaxgrpo.models.attention import DECODE_BLOCKED_FROM, context_implementation, decode_block, resolve_implementation
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.parallel.target import platform_of
from jaxgrpo.rewards import judge, remote, reward_model
from jaxgrpo.rewards import reward_set as rewards_lib
from jaxgrpo.rollout.engines import logprobs_are_policy
from jaxgrpo.rollout.engines import registry as engine_registry
from jaxgrpo.rollout.engines.builtin import BuiltinEngine
from jaxgrpo.rollout.environments import spec as env_spec
from jaxgrpo.rollout.sampling import SamplingConfig, cache_slots
from jaxgrpo.run import builders
from jaxgrpo.run.composition import PARTIAL_ROUTING_REPLAY_ERROR, check_composition
from jaxgrpo.run.spec_schema import RewardSourceSpec
from jaxgrpo.run.specs import TrainerConfig
from jaxgrpo.step import batch_packing as train_batching
from jaxgrpo.step import feed

__all__ = [
  "DataParts",
  "check_before_build",
  "check_context_rows",
  "check_mesh_fits",
  "build_data",
  "build_rewards",
  "reward_source",
  "reward_sources",
  "optimizer",
  "sampling_config",
  "attention_line",
  "engine_sampling",
  "start_engine",
  "check_engine_policy",
  "rollout_source",
  "schedule",
]


def check_before_build(cfg: TrainerConfig) -> None:
  """What needs the processes (``check_composition`` with ``jax.process_count()``) and the engine's install
  (``engines.registry.check_installed``: vLLM's): refused before any weight is read."""
  engine_registry.check_installed(cfg.rollout.engine)
  check_composition(cfg, process_count=jax.process_count())


def check_mesh_fits(cfg: TrainerConfig, mesh) -> None:
  """ValueError naming its real cause, before any weight is read or the warm-up runs: the model
  directory (``config.json``, ``model_type``, tokenizer, chat template: ``model.path``), the row
  length (``builders.check_lengths``: prompt + completion within the model's positions), the
  rollout batch over ``step.micro_batches × step.mini_batches``, and the mesh (``devices.mesh``):
  the model's parameters (abstract; a hub id is checked by the loader, which names the mesh too)
  and the batch rows over ``data × fsdp``."""
  roll, step = cfg.rollout, cfg.step
  rows = roll.prompts_per_step * roll.group_size
  abstract = None
  if cfg.model.synthetic is not None or os.path.isdir(cfg.model.path):
    abstract, tokenizer = builders.abstract_policy(cfg.model)
    if cfg.model.path is not None:
      builders.check_chat_template(tokenizer, cfg.model)
    builders.check_lengths(cfg, abstract.config)
    check_engine_policy(cfg, abstract.config)
  splits = step.micro_batches * step.mini_batches
  if rows % splits:
    raise ValueError(
      f"the rollout batch of {rows} rows (rollout.prompts_per_step {roll.prompts_per_step} × rollout.group_size "
      f"{roll.group_size}) does not split into step.micro_batches {step.micro_batches} × step.mini_batches "
      f"{step.mini_batches} = {splits} equal parts"
    )
  try:
    if abstract is not None:
      shd.tree_shardings(nnx.split(abstract)[1], mesh)
    shd.check_batch_divisible(
      rows,
      mesh,
      splits=splits,
      what="the rollout batch (rollout.prompts_per_step × rollout.group_size)",
    )
    _check_processes(cfg, mesh, rows)
    check_context_rows(cfg, mesh)
  except ValueError as e:
    spec = cfg.devices.mesh or "fsdp=-1"
    raise ValueError(f"devices.mesh {spec!r} ({mesh.size} devices) does not fit: {e}") from None


def check_context_rows(cfg: TrainerConfig, mesh) -> None:
  """With a ``context`` mesh axis of size n > 1: ValueError (one line) unless every row the run can train on splits
  into n chunks — ``step.packing`` when packing, else every ``[prompt ‖ completion]`` length: a prompt bucket
  (multiples of 16 up to ``data.max_prompt_tokens``) plus a completion bucket (``DEFAULT_BUCKETS`` up to the one of
  ``rollout.max_new_tokens``)."""
  n = shd.context_size(mesh)
  if n < 2:
    return
  if cfg.step.packing is not None:
    shd.check_sequence_divisible(cfg.step.packing, mesh, "step.packing (the packed row)")
    return
  longest = train_batching.bucket_length(cfg.rollout.max_new_tokens)
  completions = sorted({b for b in train_batching.DEFAULT_BUCKETS if b < longest} | {longest})
  prompts = range(16, -(-cfg.data.max_prompt_tokens // 16) * 16 + 16, 16)
  bad = next(((p, t) for p in prompts for t in completions if (p + t) % n), None)
  if bad is not None:
    p, t = bad
    raise ValueError(
      f"a [prompt ‖ completion] row of {p} + {t} = {p + t} positions (a prompt bucket of 16s + a completion "
      f"bucket) is not divisible by the context axis (context={n}); use a context size that divides every row "
      f"(e.g. one dividing 16), or step.packing with a multiple of {n}"
    )


def _check_processes(cfg: TrainerConfig, mesh, rows: int) -> None:
  """Several processes: each must hold whole groups of the rollout batch, one contiguous block of
  ``rows / process_count`` rows (the batch axes ``data × fsdp`` split over the processes)."""
  n, g = jax.process_count(), cfg.rollout.group_size
  if n == 1:
    return
  mine = shd.process_batch_rows(mesh, rows)
  if mine.stop - mine.start != rows // n or rows % n:
    raise ValueError(
      f"with {n} processes every process must feed 1/{n} of the rollout batch, but process "
      f"{jax.process_index()}'s devices hold rows {mine.start}..{mine.stop - 1} of {rows}: the batch axes "
      f"(data×fsdp = {shd.batch_shards(mesh)}) must be a multiple of the process count; put the "
      "processes on data or fsdp, not on tensor"
    )
  if cfg.rollout.prompts_per_step % n:
    raise ValueError(
      f"rollout.prompts_per_step {cfg.rollout.prompts_per_step} does not divide over {n} processes: "
      f"every process samples and scores whole groups of G = {g}"
    )


class DataParts(NamedTuple):
  """The training and held-out rows: encoded prompts (``data.PromptSet``; None for environment episodes,
  whose reset renders the prompt), the examples (``data.MathExample`` or episode rows) and the padded
  prompt length (None for episodes)."""

  prompts: Any
  examples: Sequence[Any]
  eval_prompts: Any
  eval_examples: Sequence[Any] | None
  prompt_len: int | None


def build_data(cfg: TrainerConfig, tokenizer, model_config) -> DataParts:
  """The run's rows: ``env.episodes`` rows from seeds (no dataset), else ``builders.build_prompts``;
  ValueError when the longest prompt plus ``rollout.max_new_tokens`` exceeds the model's positions."""
  if cfg.env is not None and cfg.env.episodes is not None:  # env.episodes: rows from seeds, no dataset
    n_eval = cfg.env.eval_episodes
    evals = None if n_eval is None else env_spec.episode_rows(n_eval, "eval")
    return DataParts(None, env_spec.episode_rows(cfg.env.episodes, "train"), None, evals, None)
  sets = builders.build_prompts(cfg.data, cfg.eval, tokenizer, seed=cfg.run.seed)
  p, t = sets.prompt_len, cfg.rollout.max_new_tokens
  _checks.check_positions(
    [(f"prompt length {p}", p), (f"rollout.max_new_tokens {t}", t)],
    model_config.max_position_embeddings,
    "the model (max_position_embeddings)",
    "lower data.max_prompt_tokens or rollout.max_new_tokens",
  )
  return DataParts(sets.train, sets.train_examples, sets.eval, sets.eval_examples, sets.prompt_len)


def verifier(cfg: TrainerConfig) -> rewards_lib.MathAccuracy:
  """The run's answer verifier (``reward.timeout_s``, ``reward.on_error``): the accuracy reward and the
  held-out evaluation's scorer (the trainer's and ``scripts/eval.py --checkpoint``'s)."""
  return rewards_lib.MathAccuracy(timeout_s=cfg.reward.timeout_s, on_error=cfg.reward.on_error)


def build_rewards(
  cfg: TrainerConfig, reward_fns=None, *, mesh=None
) -> tuple[rewards_lib.MathAccuracy, rewards_lib.RewardSet]:
  """``(accuracy, reward_set)``: the verifier (also the evaluation's) and the weighted reward functions —
  ``reward_fns`` ``{name: (fn, weight)}``, else ``reward.weights`` over ``accuracy`` and ``format``; plus the
  learned and remote rewards of ``reward.sources`` (:func:`reward_sources`; its reward models on ``mesh``,
  the trainer's: beside the policy)."""
  accuracy = verifier(cfg)
  if reward_fns is None:
    table = {"accuracy": accuracy, "format": rewards_lib.format_reward}
    reward_fns = {name: (table[name], float(w)) for name, w in cfg.reward.weights.items()}
  sources = reward_sources(cfg, mesh=mesh)
  clash = sorted(set(sources) & set(reward_fns))
  if clash:
    raise ValueError(f"`reward.sources` names {clash} are also names of `reward_fns`; rename the sources")
  return accuracy, rewards_lib.RewardSet({**reward_fns, **sources}, on_error=cfg.reward.on_error)


def reward_source(spec: RewardSourceSpec, *, mesh=None):
  """The reward function of one ``reward.sources`` entry (``jaxgrpo.rewards``): a reward model (its parameters
  sharded over ``mesh`` by the policy's rules, ``DEFAULT_RULES``; None: the default device), a judge model run
  by the built-in engine on the default device, or a reward service.

  Raises:
    ValueError: a reward model's ``batch_size`` that does not split over ``mesh``'s batch axes (data × fsdp)."""
  dtype = jnp.dtype(spec.dtype)
  if spec.kind == "reward_model":
    mesh = _process_mesh(mesh)
    if mesh is not None and spec.batch_size % shd.batch_shards(mesh):
      raise ValueError(
        f"`reward.sources[{spec.name!r}].batch_size` must be a multiple of the mesh's batch shards (data × fsdp = "
        f"{shd.batch_shards(mesh)}): the reward model scores its batches on the policy's mesh; got {spec.batch_size}"
      )
    return reward_model.RewardModelReward(spec.path, batch_size=spec.batch_size, name=spec.name, dtype=dtype, mesh=mesh)
  if spec.kind == "judge":
    kw = {k: v for k, v in (("template", spec.template), ("rubric", spec.rubric)) if v is not None}
    engine = BuiltinEngine(load_hf(spec.path, dtype=dtype, param_dtype=dtype))
    return judge.JudgeReward(
      engine,
      load_tokenizer(spec.path),
      reference_column=spec.reference_column,
      max_new_tokens=spec.max_new_tokens,
      name=spec.name,
      **kw,
    )
  return remote.RemoteReward(
    spec.url,
    batch_size=spec.batch_size,
    max_concurrency=spec.max_concurrency,
    timeout_s=spec.timeout_s,
    retries=spec.retries,
    deadline_s=spec.deadline_s,
    name=spec.name,
  )


def _process_mesh(mesh):
  """``mesh``, or with several processes this process's devices of it as one ``fsdp`` axis: every process
  scores its own rows (``RolloutSource.score``), so its reward model must be addressable by it alone."""
  if mesh is None or jax.process_count() == 1:
    return mesh
  mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  return Mesh(np.asarray(mine), ("fsdp",))


def reward_sources(cfg: TrainerConfig, *, mesh=None) -> dict[str, tuple[Any, float]]:
  """``{name: (fn, weight)}`` of ``reward.sources`` (empty when there are none); reward models on ``mesh``."""
  return {s.name: (reward_source(s, mesh=mesh), float(s.weight)) for s in cfg.reward.sources}


def optimizer(cfg: TrainerConfig) -> optax.GradientTransformation:
  """AdamW at ``optim.learning_rate`` (linear warm-up over ``optim.warmup_steps`` steps' updates)."""
  o = cfg.optim
  lr = o.learning_rate
  if o.warmup_steps:
    updates = o.warmup_steps * cfg.step.mini_batches * cfg.objective.num_iterations
    lr = optax.linear_schedule(0.0, o.learning_rate, updates)
  return optax.adamw(lr, b1=o.adam_b1, b2=o.adam_b2, weight_decay=o.weight_decay)


def sampling_config(cfg: TrainerConfig, model, *, pad_id: int, eos_ids: Sequence[int]) -> SamplingConfig:
  """The rollout's sampling settings; a mixture of experts records its routing while sampling when
  ``rollout.routing_replay`` is ``rollout`` (replayed by the step); ``rollout.ignore_eos``: no EOS ids (every
  completion has ``max_new_tokens`` tokens)."""
  roll = cfg.rollout
  return SamplingConfig(
    num_samples=roll.group_size,
    max_new_tokens=roll.max_new_tokens,
    top_p=roll.top_p,
    top_k=roll.top_k,
    eos_ids=() if roll.ignore_eos else tuple(eos_ids),
    pad_id=pad_id,
    merge_lora=roll.merge_lora,
    record_routing=roll.routing_replay == "rollout" and moe.is_moe(model),
    quantize=None if roll.quantize == "none" else roll.quantize,
  )


def attention_line(cfg: TrainerConfig, mesh: Mesh, prompt_len: int | None) -> str:
  """The log line naming the attention the train step runs: ``model.attention`` resolved
  (``models.attention.resolve_implementation``) for rows of ``step.packing`` positions when packing, else
  ``prompt_len +`` the completion width (``rollout.max_new_tokens``; with ``env``, ``env.max_tokens``: a
  trajectory's tokens), on the platform of ``mesh``'s devices; ring attention over a ``context`` axis
  (``models.attention.context_implementation``). ``prompt_len`` None (multi-turn episodes, whose prompt width is
  known per batch) without packing: the line says the choice is made per batch. With the built-in sampler
  (``rollout.engine: jax``) it ends with what a decode step reads of the KV cache (:func:`decode_phrase`)."""
  return _train_step_attention(cfg, mesh, prompt_len) + decode_phrase(cfg, prompt_len)


def _train_step_attention(cfg: TrainerConfig, mesh: Mesh, prompt_len: int | None) -> str:
  name = f"attention: model.attention={cfg.model.attention!r}"
  ring = context_implementation(cfg.model.attention, shd.context_size(mesh))
  if ring is not None:
    return f"{name} -> ring attention over the context axis (blockwise inside) in the train step"
  width = cfg.rollout.max_new_tokens if cfg.env is None else cfg.env.multiturn_config().max_tokens
  rows = cfg.step.packing or (None if prompt_len is None else prompt_len + width)
  if rows is None:
    return f"{name} in the train step: chosen per batch by its row length (episodes' prompts vary)"
  impl = resolve_implementation(cfg.model.attention, rows, platform_of(mesh))
  return f"{name} -> {impl} in the train step ({rows} positions a row)"


def decode_phrase(cfg: TrainerConfig, prompt_len: int | None) -> str:
  """What the built-in sampler's decode step reads of its KV cache (``models.attention.decode_block``): the
  filled slots in blocks from ``DECODE_BLOCKED_FROM`` slots on, else the whole cache; for a single-turn rollout of
  ``jaxgrpo.rollout.sampling.cache_slots`` slots (with ``rollout.speculative_tokens`` for drafts when speculating)
  the numbers; a multi-turn run's or an unknown prompt width's cache is sized per call. Empty for another engine."""
  if cfg.rollout.engine != "jax":
    return ""
  if cfg.model.attention == "dense":
    return "; the sampler's decode reads its whole KV cache (attention 'dense')"
  if cfg.env is not None or prompt_len is None:
    return f"; the sampler's decode reads only the filled slots of a KV cache of {DECODE_BLOCKED_FROM} slots or more"
  k = cfg.rollout.speculative_tokens if cfg.rollout.speculative != "off" else 0
  slots = cache_slots(prompt_len, cfg.rollout.max_new_tokens, k)
  block = decode_block(cfg.model.attention, slots)
  if not block:
    return f"; the sampler's decode reads its whole {slots}-slot KV cache (under {DECODE_BLOCKED_FROM} slots)"
  return f"; the sampler's decode reads the filled part of its {slots}-slot KV cache, in blocks of {block}"


def precision_line(cfg: TrainerConfig, mesh: Mesh) -> str | None:
  """The log line for ``model.dtype: bfloat16`` on CPU devices whose process may not use AMX
  (``models.backend.native_bf16_dots`` False): there the bf16 products run as float32 products and only the
  activations are rounded, which costs the rollout 2-4% against float32 (BENCHMARKS.md, run L), so float32 —
  the default — is the faster and exact choice there; None otherwise."""
  if jnp.dtype(cfg.model.dtype) != jnp.bfloat16 or platform_of(mesh) != "cpu" or backend.native_bf16_dots():
    return None
  return (
    "precision: model.dtype bfloat16 on a CPU without AMX: its products run as float32 products (bf16 ones are "
    "slower here) and only the activations are rounded to bf16, so rollouts take 2-4% longer than in float32, "
    "the default; set model.dtype float32 on this machine unless you need bf16's numbers"
  )


def engine_sampling(cfg: TrainerConfig, sampling: SamplingConfig) -> SamplingConfig:
  """What the engine of ``rollout.engine`` receives, by its class's capabilities (``engines.registry``): the
  routing record only when it records routing (``records_routing``: the built-in sampler; another engine's
  experts are not the policy's program), and no suppressed ids at a temperature other than 1 when its log-probs
  are then those of the filtered distribution (``filtered_logprobs_off_unit_temperature``: vLLM)."""
  name = cfg.rollout.engine
  filtered = cfg.step.temperature != 1.0 and engine_registry.capability(name, "filtered_logprobs_off_unit_temperature")
  routing = sampling.record_routing and engine_registry.capability(name, "records_routing")
  return dataclasses.replace(sampling, record_routing=routing, **({"suppress_ids": ()} if filtered else {}))


def check_engine_policy(cfg: TrainerConfig, model_config) -> None:
  """What the engine cannot do for this policy, one line each, before any weight is read (the model's
  config is known): routing replay of a MoE policy through an engine that refuses it (its class's
  ``routing_replay_refusal``: vLLM)."""
  roll = cfg.rollout
  refusal = engine_registry.capability(roll.engine, "routing_replay_refusal", None)
  if refusal and roll.routing_replay == "rollout" and hasattr(model_config, "num_experts"):
    raise ValueError(refusal)


def start_engine(cfg: TrainerConfig, model, *, prompt_len: int):
  """The engine of ``rollout.engine``, built by name (``engines.registry.build_engine``): the built-in sampler
  (``jax``), vLLM (``rollout.vllm``), or a user's factory (``package.module:callable``, called with the keywords
  ``config`` — the policy's model config —, ``max_model_len``, ``temperature`` and ``seed``; it must return a
  ``jaxgrpo.rollout.engines.Engine``). Multi-turn (``env``): ``max_model_len`` holds the prompt, ``env.max_tokens``
  and one turn; None for ``env.episodes`` (no encoded prompts: the model's own positions)."""
  roll = cfg.rollout
  check_engine_policy(cfg, model.config)
  if prompt_len is None:  # env.episodes: the environments render the prompts (the model's positions bound them)
    max_len = None
  elif cfg.env is None:
    max_len = prompt_len + roll.max_new_tokens
  else:  # every turn sends prompt ‖ trajectory: the prompt, the trajectory's budget and one more turn
    mt = cfg.env.multiturn_config()
    max_len = prompt_len + mt.max_tokens + mt.per_turn
  speculates = engine_registry.capability(roll.engine, "speculates")
  return engine_registry.build_engine(
    roll.engine,
    model,
    max_model_len=max_len,
    temperature=cfg.step.temperature,
    seed=cfg.run.seed,
    # the engine's own section (rollout.vllm), if it has one; the built-in sampler's: rollout.speculative
    options=roll.speculative_config() if speculates else getattr(roll, roll.engine, None),
    lora_rank=None if cfg.lora is None else cfg.lora.rank,
  )


def rollout_source(
  cfg: TrainerConfig,
  *,
  policy,
  sampling: SamplingConfig,
  mesh,
  iterator,
  data: DataParts,
  tokenizer,
  reward_set,
  pad_id: int,
  engine=None,
  make_env=None,
  should_stop=None,
  teacher=None,
) -> RolloutSource:
  """The run's rollout source: ``engine`` (:func:`start_engine`; None: the built-in sampler) with what it
  receives (:func:`engine_sampling`; its log-probs the policy's only when it declares so,
  ``engines.logprobs_are_policy``), single-turn scoring or the environments of ``env`` (``make_env``),
  dynamic sampling from ``objective``/``rollout`` (see ``jaxgrpo.loop.source.RolloutSource``). ``teacher``: the
  run's distillation teacher (``feed.make_teacher``): with dynamic sampling it scores each round when it is
  sampled (the filter reads its signal) and the learner trains on those log-probs (no second pass)."""
  roll = cfg.rollout
  collects = teacher is not None and cfg.objective.dynamic_sampling
  d = cfg.objective.distill
  return RolloutSource(
    policy=policy,
    sampling=sampling,
    temperature=cfg.step.temperature,
    mesh=mesh,
    iterator=iterator,
    examples=data.examples,
    prompts=data.prompts,
    prompt_len=data.prompt_len,
    pad_id=pad_id,
    tokenizer=tokenizer,
    reward_set=reward_set,
    prompts_per_step=roll.prompts_per_step,
    dynamic_sampling=cfg.objective.dynamic_sampling,
    max_rounds=roll.dynamic_sampling_max_rounds,
    merge_lora=roll.merge_lora,
    engine=engine,
    engine_sampling=engine_sampling(cfg, sampling),
    # quantised rollout weights: the sampler's log-probs are μ's, so the learner recomputes old_logp
    logprobs_are_policy=(engine is None or logprobs_are_policy(engine)) and roll.quantize == "none",
    turns=None if make_env is None else Turns(make_env, cfg.env.multiturn_config()),
    should_stop=should_stop,
    teacher=partial(feed.teacher_host_scores, teacher, mesh=mesh, train_config=cfg.train_config())
    if collects
    else None,
    min_teacher_signal=d.min_signal if collects else 0.0,
  )


def schedule(cfg: TrainerConfig, source: RolloutSource, learner: Learner, state, *, rollout_mesh, resumed: bool):
  """The run's schedule: :class:`~jaxgrpo.loop.schedule.Synchronous`, or with ``rollout.max_staleness`` >= 1
  or ``devices.rollout`` (``rollout_mesh``) the bounded-staleness producer/learner
  (``jaxgrpo.loop.async_rollout.AsyncRollouts``, its ledger in ``run.out``); with ``rollout.partial.enabled`` its
  partial-rollouts form (``jaxgrpo.loop.partial.schedule.PartialRollouts``)."""
  if not cfg.rollout.max_staleness and rollout_mesh is None:
    return Synchronous(source, learner)
  common = dict(
    max_staleness=cfg.rollout.max_staleness,
    rollout_mesh=rollout_mesh,
    steps=cfg.run.steps,
    out_dir=cfg.run.out,
    resumed=resumed,
  )
  part = cfg.rollout.partial
  if part.enabled and source.sampling.record_routing:  # a MoE checkpoint (the load-time check sees synthetic ones)
    raise ValueError(PARTIAL_ROUTING_REPLAY_ERROR)
  if part.enabled:  # rows in flight across updates (jaxgrpo.loop.partial.schedule)
    return PartialRollouts(
      source,
      learner,
      state,
      num_slots=part.slots,
      refill_every=part.refill_every,
      refill=part.refill,
      ahead=part.ahead,
      **common,
    )
  return AsyncRollouts(source, learner, state, **common)
