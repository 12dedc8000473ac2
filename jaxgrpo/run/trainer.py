"""The training loop: rollout → reward → update, with evaluation, metrics and checkpoint hooks.

One step, through the public pieces of ``jaxgrpo.rollout.iteration``::

    prompt indices   = PromptIterator.next(prompts_per_step)             (every process: the same B)
    rollout          = iteration.sample(policy_model(...), place_prompts(this process's prompts))
                                                                          (jitted, on the global mesh)
    mine             = distributed.process_rows(rollout)                  (this process's G·B/P rows)
    rewards          = RewardSet(prompts, completions, columns)           (host: this process's rows)
    [dynamic sampling: every process gathers the rewards (one small all-gather), drops the same
     groups with equal rewards, samples again, refills: iteration.select_groups]
    batch            = iteration.place(Batch(...), process_local=True)    (each process feeds its rows)
    batch            = reference(batch)                                   (make_reference; β > 0 only)
    state, metrics   = train_step(state, batch)                           (jitted, sharded)
    log → OUT/metrics.jsonl; every eval.every steps: pass@k / mean@k on the held-out set;
    every checkpoint.every steps (and at every evaluation when checkpoint.best_metric is set, so the
    best evaluated state is on disk): checkpoint_fn(snapshot, run_meta)

Several processes (docs/train.md, "Running on a pod / a cluster"): every process draws the same
prompt indices, decodes, scores and feeds only its own rows; what they must agree on (dynamic
sampling's rewards, metrics, evaluation counts) comes from small all-gathers, so the result equals a
one-process run on the same mesh. With ``rollout.max_staleness`` >= 1 or ``devices.rollout``,
``train_step`` is the learner's step of ``jaxgrpo.rollout.async_rollout.AsyncRollouts`` (docs/trainer.md).

The run is a :class:`~jaxgrpo.run.specs.TrainerConfig`; the model and prompts are built by
``jaxgrpo.run.builders``, evaluation is ``jaxgrpo.run.evaluation.evaluate_policy``. Everything a resume needs
is explicit in :class:`TrainerState`: trained parameters, optimizer state and step
(``jaxgrpo.step.train.TrainState``), the PRNG key, the data-iterator position. Checkpoints go through
``jaxgrpo.services.checkpoint.Checkpointer``'s hooks with :func:`run_meta` (what identifies the run; a LoRA
run's base-weights fingerprint included). Failures and what each keeps: docs/failure_modes.md.

One job at ~980 lines: the loop of a run and the state it must hand over exactly (data position, key,
signals, checkpoints, several processes agreeing); the pieces it calls (sampling, scoring, the step,
evaluation, dynamic sampling's ``iteration.select_groups``, async rollouts) live in their own modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from jaxgrpo import data as data_lib
from jaxgrpo.data import rewards as rewards_lib
from jaxgrpo.models import lora, moe
from jaxgrpo.parallel import distributed
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout import async_rollout, iteration
from jaxgrpo.rollout.engines import check_engine, load_engine_factory, logprobs_are_policy
from jaxgrpo.rollout.engines import vllm as vllm_engine
from jaxgrpo.rollout.environments import spec as env_spec
from jaxgrpo.rollout.environments import training as env_training
from jaxgrpo.rollout.environments.rollout import RolloutInterrupted
from jaxgrpo.rollout.sampling import Rollout
from jaxgrpo.run import builders
from jaxgrpo.run.collapse import DEFAULT_GUARD, CollapseGuard, CollapseWatch, PolicyCollapsed
from jaxgrpo.run.evaluation import evaluate_policy
from jaxgrpo.run.specs import TrainerConfig
from jaxgrpo.services import runlock
from jaxgrpo.services.checkpoint import NonFiniteError, RunMeta, Snapshot, first_nonfinite
from jaxgrpo.services.metrics import MetricsWriteError, append_record, truncate_jsonl
from jaxgrpo.step import train as train_lib

__all__ = [
  "Trainer",
  "TrainerState",
  "TrainingInterrupted",
  "TrainingAborted",
  "run_meta",
  "dropout_key",
  "IDENTITY_FIELDS",
  "GUARDED_FIELDS",
]

#: Config fields that change the parameter tree or the training prompts and their order: a
#: checkpoint written with other values is refused.
IDENTITY_FIELDS = (
  "model.path",
  "model.synthetic",
  "model.param_dtype",
  "lora",
  "data.dataset",
  "data.dataset_config",
  "data.split",
  "data.mapping",
  "data.arithmetic.max_operand",
  "data.arithmetic.train_size",
  "data.arithmetic.eval_size",
  "data.max_prompt_tokens",
  "data.instruction",
  "run.seed",
  "env.factory",
)
#: Config fields a resumed run must not change silently: refused unless explicitly allowed
#: (``Checkpointer(allow_changed=True)``, ``scripts/train.py --allow-changed-config``).
GUARDED_FIELDS = ("optim.learning_rate", "rollout.group_size")


def _get(d: Mapping[str, Any], path: str):
  for part in path.split("."):
    d = d.get(part) if isinstance(d, Mapping) else None
  return d


def run_meta(config: TrainerConfig, *, base_fingerprint: str | None = None) -> RunMeta:
  """What identifies a run for its checkpoints: :data:`IDENTITY_FIELDS`, :data:`GUARDED_FIELDS`,
  the whole config (``to_dict()``), which ``jaxgrpo.run.builders.load_policy`` rebuilds the model from,
  and, for a LoRA run, ``base_fingerprint`` (``models.lora.base_fingerprint`` of the frozen base
  weights, known once the model is built) as the ``builders.BASE_WEIGHTS`` fingerprint."""
  d = config.to_dict()
  return RunMeta(
    identity={p: _get(d, p) for p in IDENTITY_FIELDS},
    guarded={p: _get(d, p) for p in GUARDED_FIELDS},
    config=d,
    fingerprints={} if base_fingerprint is None else {builders.BASE_WEIGHTS: base_fingerprint},
  )


class TrainingInterrupted(Exception):
  """``run()`` stopped on SIGTERM/SIGINT at a step boundary, after handing that step to
  ``checkpoint_fn`` (a background save may still be in flight: wait for it, e.g. ``Checkpointer.close``).

  Attributes:
    signum: the signal (``signal.SIGTERM`` or ``signal.SIGINT``); a command line exits with
      ``128 + signum``.
    step: the last completed (and checkpointed) step.
  """

  def __init__(self, message: str, *, signum: int, step: int):
    super().__init__(message)
    self.signum, self.step = signum, step


class TrainingAborted(KeyboardInterrupt):
  """A second SIGTERM/SIGINT during ``run()``: raised at once, without finishing the step or the
  save in flight (a ``KeyboardInterrupt``, so code that handles Ctrl-C handles it too).

  Attributes:
    signum: the second signal.
  """

  def __init__(self, signum: int):
    super().__init__(f"aborted by a second {signal.Signals(signum).name}")
    self.signum = signum


def _nonfinite_error(
  step: int, metrics: Mapping[str, Any], state_where: str | None, *, stop_on_loss: bool
) -> NonFiniteError | None:
  """The error that stops the run after ``step``, or None to go on.

  ``state_where`` is the first non-finite parameter / optimizer-state entry (None: all finite). A
  non-finite state always stops; a non-finite ``loss`` stops when ``stop_on_loss``.
  """
  bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
  loss_bad = "loss" in bad
  if state_where is None and not (loss_bad and stop_on_loss):
    return None
  parts = []
  if bad:
    parts.append(
      f"first non-finite metric: {bad[0]} = {metrics[bad[0]]}" + (f" (all: {', '.join(bad)})" if len(bad) > 1 else "")
    )
  if state_where is not None:
    parts.append(f"first non-finite entry of the updated state: {state_where}")
  else:
    parts.append(
      "the parameters are still finite (--on-nonfinite-loss continue, Trainer(stop_on_nonfinite_loss=False), "
      "would go on)"
    )
  return NonFiniteError(
    f"training stopped at step {step}: non-finite values; " + "; ".join(parts) + f". Nothing of step {step} was "
    "saved and the earlier checkpoints are kept. Usual causes: a learning rate too large, no gradient "
    "clipping (step.max_grad_norm), an extreme reward. Resume from the last checkpoint with other settings "
    "(a changed learning rate needs --allow-changed-config).",
    step=step,
    where=bad[0] if bad else state_where,
  )


class TrainerState(NamedTuple):
  """The full resumable state: ``train`` (params, opt_state, step; and the frozen base weights of a
  LoRA run, which are not part of a snapshot), ``key`` (PRNG key of the next step) and
  ``data_position`` (``PromptIterator.state()``)."""

  train: train_lib.TrainState
  key: jax.Array
  data_position: dict

  def snapshot(self) -> Snapshot:
    """The state as a ``jaxgrpo.services.checkpoint.Snapshot`` (the same arrays, not copies; the trained
    parameters only: ``train.frozen`` is rebuilt, not saved)."""
    t = self.train
    return Snapshot(t.params, t.opt_state, t.step, self.key, self.data_position)

  @classmethod
  def from_snapshot(cls, snap: Snapshot, frozen=None) -> TrainerState:
    """The state held by a snapshot (e.g. a restored checkpoint), with the run's ``frozen`` variables."""
    train = train_lib.TrainState(snap.params, snap.opt_state, snap.step, frozen)
    return cls(train, snap.key, dict(snap.data_position))


def _optimizer(cfg: TrainerConfig) -> optax.GradientTransformation:
  o = cfg.optim
  lr = o.learning_rate
  if o.warmup_steps:
    updates = o.warmup_steps * cfg.step.mini_batches * cfg.objective.num_iterations
    lr = optax.linear_schedule(0.0, o.learning_rate, updates)
  return optax.adamw(lr, b1=o.adam_b1, b2=o.adam_b2, weight_decay=o.weight_decay)


def _rows_to_columns(examples: Sequence[data_lib.MathExample], repeat: int) -> dict[str, list]:
  """Per-row reward columns: ``answer`` plus every dataset column, each example repeated G times."""
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


class Trainer:
  """Builds the model, data, rewards, mesh and jitted steps from a :class:`~jaxgrpo.run.specs.TrainerConfig`;
  ``run()`` trains, logging to ``OUT/metrics.jsonl``.

  Args:
    config: the run.
    checkpoint_fn: called as ``checkpoint_fn(snapshot: jaxgrpo.services.checkpoint.Snapshot, run: RunMeta)``
      every ``checkpoint.every`` steps and after the last step. The snapshot's arrays are donated to
      the next train step: the function must save or copy them before it returns.
    restore_fn: ``restore_fn(run: RunMeta, template: Snapshot) -> Snapshot | None``, called once at
      construction: the snapshot to resume from, or None to start fresh. ``template`` is the freshly
      built state (shapes, dtypes, shardings of this mesh).
    on_record: called with every metrics record (steps and evaluations), e.g. a
      ``jaxgrpo.services.metrics.MetricsLogger`` or ``Checkpointer.observe`` (best checkpoint by eval metric).
    reward_fns: extra/replacement reward functions ``{name: (fn, weight)}`` (plain callables
      ``(prompts, completions, **columns) -> list[float]``); None: ``config.reward.weights``.
    log: print function for progress lines (None: silent).
    progress: a tqdm bar with an ETA for the supervised warm-up instead of its ``log`` lines.
    stop_on_nonfinite_loss: stop (``NonFiniteError``) when a step's loss is NaN or infinite, even
      if the parameters are still finite. A non-finite parameter or optimizer state always stops.
    collapse_guard: ``jaxgrpo.run.collapse.CollapseGuard``: a policy that collapses with finite values
      (entropy near ln V, or a zero reward for N steps) stops the run
      (``jaxgrpo.run.collapse.PolicyCollapsed``, before the step is evaluated or saved) or logs a warning.
      Default: stop when the entropy reaches 95% of ln V. None: off.
  """

  def __init__(
    self,
    config: TrainerConfig,
    *,
    checkpoint_fn: Callable[[Snapshot, RunMeta], None] | None = None,
    restore_fn: Callable[[RunMeta, Snapshot], Snapshot | None] | None = None,
    reward_fns: Mapping[str, tuple] | None = None,
    log: Callable[[str], None] | None = print,
    progress: bool = False,
    on_record: Callable[[dict], None] | None = None,
    stop_on_nonfinite_loss: bool = True,
    collapse_guard: CollapseGuard | None = DEFAULT_GUARD,
  ):
    if not isinstance(config, TrainerConfig):
      raise TypeError(f"`config` must be a jaxgrpo.run.specs.TrainerConfig; got {type(config).__name__}")
    self.config = cfg = config
    if cfg.rollout.engine == "vllm":  # before anything heavy
      vllm_engine.check_installed()
    if cfg.rollout.engine != "jax" and jax.process_count() > 1:
      raise ValueError(
        f"`rollout.engine: {cfg.rollout.engine}` runs in one process (the engine colocated in it); this run has several"
      )
    self.objective = cfg.objective
    self.checkpoint_fn = checkpoint_fn
    self.on_record = on_record
    self.log = log or (lambda s: None)
    self.progress = progress
    self.stop_on_nonfinite_loss = stop_on_nonfinite_loss
    self.collapse_guard = collapse_guard
    self.stop_signal: int | None = None  # set by the signal handlers of handle_signals()
    self.mesh, self.rollout_mesh = async_rollout.make_meshes(cfg.devices)  # rollout_mesh: None colocated
    self._check_mesh_fits()
    self._build_model_and_data()
    fingerprint = None if cfg.lora is None else lora.base_fingerprint(self.model)
    self.run_meta = run_meta(cfg, base_fingerprint=fingerprint)
    self.accuracy = rewards_lib.MathAccuracy(timeout_s=cfg.reward.timeout_s, on_error=cfg.reward.on_error)
    if reward_fns is None:
      table = {"accuracy": self.accuracy, "format": rewards_lib.format_reward}
      reward_fns = {name: (table[name], float(w)) for name, w in cfg.reward.weights.items()}
    self.reward_set = rewards_lib.RewardSet(reward_fns, on_error=cfg.reward.on_error)
    self.optimizer = _optimizer(cfg)
    trainable = nnx.Param if cfg.lora is None else nnx.LoRAParam  # LoRA: the adapters only
    self.graphdef, train_state, self.shardings = train_lib.init_train_state(
      self.model, self.optimizer, self.mesh, trainable=trainable
    )
    self.train_config = cfg.train_config()
    self.step_fn = train_lib.make_train_step(
      self.graphdef,
      self.optimizer,
      self.objective,
      mesh=self.mesh,
      shardings=self.shardings,
      train_config=self.train_config,
      dropout_key=None if cfg.lora is None else dropout_key(cfg.run.seed),
    )
    # the frozen reference, only when β > 0: a copy (the step donates the policy's parameters); LoRA: the
    # frozen base itself, no copy
    self.reference = iteration.make_reference(self.step_fn, train_state) if self.step_fn.reads_ref_logp else None
    roll = cfg.rollout
    self.sampling = iteration.SamplingConfig(
      num_samples=roll.group_size,
      max_new_tokens=roll.max_new_tokens,
      top_p=roll.top_p,
      top_k=roll.top_k,
      eos_ids=self.eos_ids,
      pad_id=self.pad_id,
      merge_lora=roll.merge_lora,
      # a mixture of experts: record the experts while sampling, replayed by the step (rollout.routing_replay)
      record_routing=roll.routing_replay == "rollout" and moe.is_moe(self.model),
    )
    self.engine, self.policy_logp_fn, self._engine_stale, self._engine_times = None, None, True, {}
    if roll.engine != "jax":
      self._start_engine()
    # env: multi-turn rollouts in the environments of env.factory (jaxgrpo.rollout.environments.training)
    self.make_env = None if cfg.env is None else cfg.env.make_env()
    if cfg.env is not None and jax.process_count() > 1:
      raise ValueError("`env` (multi-turn rollouts) runs in one process; multi-host runs are not supported yet")
    self.iterator = data_lib.PromptIterator(len(self.examples), seed=cfg.run.seed)
    self.state = TrainerState(train_state, jax.random.key(cfg.run.seed), self.iterator.state())
    self.resumed = False
    if restore_fn is not None:
      restored = restore_fn(self.run_meta, self.state.snapshot())
      if restored is not None:
        self.state = TrainerState.from_snapshot(restored, train_state.frozen)
        self.iterator.restore(self.state.data_position)
        self.resumed = True
    # rollout.max_staleness >= 1 or devices.rollout: the producer/learner pipeline replaces train_step
    self.rollouts = None
    if roll.max_staleness or self.rollout_mesh is not None:
      self.rollouts = async_rollout.AsyncRollouts(
        self,
        max_staleness=roll.max_staleness,
        rollout_mesh=self.rollout_mesh,
        steps=cfg.run.steps,
        resumed=self.resumed,
      )

  # ------------------------------------------------------------------ construction
  def _start_engine(self) -> None:
    """The rollout engine of ``rollout.engine``: vLLM (``rollout.vllm``), or a user's factory
    (``package.module:callable``, called with the keywords ``config`` — the policy's model config —,
    ``max_model_len``, ``temperature`` and ``seed``; it must return a ``jaxgrpo.rollout.engines.Engine``); and,
    unless the engine declares its log-probs the policy's (``engines.logprobs_are_policy``), the jitted pass
    that recomputes the policy's own ``old_logp`` of its samples (``iteration.policy_logp_fn``: the same
    micro-batches, temperature and packing as the step)."""
    roll, tc = self.config.rollout, self.train_config
    settings = dict(max_model_len=self.prompt_len + roll.max_new_tokens, seed=self.config.run.seed)
    if roll.engine == "vllm":
      v = roll.vllm
      self.engine = vllm_engine.VLLMEngine(
        self.model.config,
        dtype=v.dtype,
        kv_cache_bytes=v.kv_cache_bytes,
        gpu_memory_utilization=v.gpu_memory_utilization,
        max_num_seqs=v.max_num_seqs,
        enforce_eager=v.enforce_eager,
        logprobs_temperature=tc.temperature,
        **settings,
      )
    else:
      factory = load_engine_factory(roll.engine)
      self.engine = factory(config=self.model.config, temperature=tc.temperature, **settings)
      check_engine(self.engine, f"the object `rollout.engine: {roll.engine}` returned")
    if not logprobs_are_policy(self.engine):
      self.policy_logp_fn = iteration.policy_logp_fn(self.step_fn)

  def close(self) -> None:
    """Shut the rollout engine down (``engine.close()``); the built-in sampler holds nothing."""
    if self.engine is not None:
      self.engine.close()
      self.engine = None

  def _check_mesh_fits(self) -> None:
    """ValueError naming its real cause, before any weight is read or the warm-up runs: the model
    directory (``config.json``, ``model_type``, tokenizer, chat template: ``model.path``), the row
    length (``builders.check_lengths``: prompt + completion within the model's positions), the
    rollout batch over ``step.micro_batches × step.mini_batches``, and the mesh (``devices.mesh``):
    the model's parameters (abstract; a hub id is checked by the loader, which names the mesh too)
    and the batch rows over ``data × fsdp``."""
    cfg = self.config
    roll, step = cfg.rollout, cfg.step
    rows = roll.prompts_per_step * roll.group_size
    abstract = None
    if cfg.model.synthetic is not None or os.path.isdir(cfg.model.path):
      abstract, tokenizer = builders.abstract_policy(cfg.model)
      if cfg.model.path is not None:
        builders.check_chat_template(tokenizer, cfg.model)
      builders.check_lengths(cfg, abstract.config)
    splits = step.micro_batches * step.mini_batches
    if rows % splits:
      raise ValueError(
        f"the rollout batch of {rows} rows (rollout.prompts_per_step {roll.prompts_per_step} × rollout.group_size "
        f"{roll.group_size}) does not split into step.micro_batches {step.micro_batches} × step.mini_batches "
        f"{step.mini_batches} = {splits} equal parts"
      )
    try:
      if abstract is not None:
        shd.tree_shardings(nnx.split(abstract)[1], self.mesh)
      shd.check_batch_divisible(
        rows,
        self.mesh,
        splits=splits,
        what="the rollout batch (rollout.prompts_per_step × rollout.group_size)",
      )
      self._check_processes(rows)
    except ValueError as e:
      spec = cfg.devices.mesh or "fsdp=-1"
      raise ValueError(f"devices.mesh {spec!r} ({self.mesh.size} devices) does not fit: {e}") from None

  def _check_processes(self, rows: int) -> None:
    """Several processes: each must hold whole groups of the rollout batch, one contiguous block of
    ``rows / process_count`` rows (the batch axes ``data × fsdp`` split over the processes)."""
    n, g = jax.process_count(), self.config.rollout.group_size
    if n == 1:
      return
    mine = shd.process_batch_rows(self.mesh, rows)
    if mine.stop - mine.start != rows // n or rows % n:
      raise ValueError(
        f"with {n} processes every process must feed 1/{n} of the rollout batch, but process "
        f"{jax.process_index()}'s devices hold rows {mine.start}..{mine.stop - 1} of {rows}: the batch axes "
        f"(data×fsdp = {shd.batch_shards(self.mesh)}) must be a multiple of the process count; put the "
        "processes on data or fsdp, not on tensor"
      )
    if self.config.rollout.prompts_per_step % n:
      raise ValueError(
        f"rollout.prompts_per_step {self.config.rollout.prompts_per_step} does not divide over {n} processes: "
        f"every process samples and scores whole groups of G = {g}"
      )

  def _build_model_and_data(self):
    cfg = self.config
    # the base model (HF weights, or the synthetic model after its warm-up), then the run's adapters
    base = builders.run_base_dir(cfg.run.out) if self.checkpoint_fn is not None else None  # LoRA: no re-warm-up
    self.model, self.tokenizer = builders.build_run_policy(
      cfg, mesh=self.mesh, log=self.log, save_base=base, progress=self.progress
    )
    self.pad_id, self.eos_ids = builders.special_ids(self.tokenizer)
    if cfg.env is not None and cfg.env.episodes is not None:  # env.episodes: rows from seeds, no dataset
      self.prompts = self.eval_prompts = self.prompt_len = None  # reset renders the prompts (sample_multiturn checks)
      self.examples = env_spec.episode_rows(cfg.env.episodes, "train")
      n_eval = cfg.env.eval_episodes
      self.eval_examples = None if n_eval is None else env_spec.episode_rows(n_eval, "eval")
      return
    sets = builders.build_prompts(cfg.data, cfg.eval, self.tokenizer, seed=cfg.run.seed)
    self.prompts, self.examples = sets.train, sets.train_examples
    self.eval_prompts, self.eval_examples = sets.eval, sets.eval_examples
    self.prompt_len = sets.prompt_len
    limit = self.model.config.max_position_embeddings
    if self.prompt_len + cfg.rollout.max_new_tokens > limit:
      raise ValueError(
        f"prompt length {self.prompt_len} + rollout.max_new_tokens {cfg.rollout.max_new_tokens} exceeds the "
        f"model's max_position_embeddings {limit}"
      )

  # ------------------------------------------------------------------ pieces of a step
  def policy(self) -> nnx.Module:
    """The current policy: the model with the state's parameters (and frozen base weights; no copy)."""
    return iteration.policy_model(self.graphdef, self.state.train)

  def sampling_policy(self) -> nnx.Module:
    """What sampling and evaluation run: :meth:`policy`, or its ``models.lora.merge_lora`` with
    ``rollout.merge_lora`` (a plain model; a merged copy of the adapted weights while it lives)."""
    policy = self.policy()
    return lora.merge_lora(policy) if self.config.rollout.merge_lora else policy

  def _sample(self, indices, key, *, policy=None, mesh=None) -> Rollout:
    """This process's rows (NumPy; all rows in one process) of G completions of the prompts
    ``indices`` (every process passes the same): one sampler program on the global mesh, each process
    sending its own prompts (``iteration.place_prompts``). ``policy``/``mesh``: another policy and
    its mesh (the rollout producer's; default :meth:`policy` on the trainer's mesh)."""
    mesh = self.mesh if mesh is None else mesh
    tokens, mask = data_lib.pad_left([self.prompts.tokens[i] for i in indices], self.prompt_len, self.pad_id)
    if self.engine is not None:  # the engine holds the pushed weights (max_staleness 0 only, checked in the spec)
      return self._sample_engine(tokens, mask, key)
    tokens, mask = iteration.place_prompts(tokens, mask, mesh=mesh)
    rollout = iteration.sample(
      self.policy() if policy is None else policy,
      tokens,
      mask,
      self.sampling,
      key=key,
      temperature=self.train_config.temperature,
    )
    return distributed.process_rows(rollout._replace(num_steps=None), mesh)

  def _sample_engine(self, tokens, mask, key) -> Rollout:
    """The rollout from the engine; the policy's weights are pushed first when an update (or a restore)
    changed them. Times go to ``self._engine_times`` (``engine/push_s``, ``engine/generate_s``)."""
    t0 = time.perf_counter()
    if self._engine_stale:
      self.engine.push_weights(self.sampling_policy())
      self._engine_stale = False
      self._engine_times["engine/push_s"] = time.perf_counter() - t0
    # VLLMEngine at τ != 1 reports full-vocabulary log-probs only without suppressed ids: () there
    vllm_tau = self.train_config.temperature != 1.0 and self.config.rollout.engine == "vllm"
    s = dataclasses.replace(self.sampling, record_routing=False, **({"suppress_ids": ()} if vllm_tau else {}))
    t1 = time.perf_counter()
    gen = self.engine.generate(tokens, mask, s, key=key, temperature=self.train_config.temperature)
    self._engine_times["engine/generate_s"] = self._engine_times.get("engine/generate_s", 0.0) + (
      time.perf_counter() - t1
    )
    return gen.rollout._replace(num_steps=None)

  def _engine_logp(self, placed: train_lib.Batch) -> tuple[train_lib.Batch, dict]:
    """``placed`` with ``old_logp`` recomputed by the trainer (the engine's log-probs stay as
    ``behavior_logp``: TIS/MIS with ``objective.importance_correction``), and the mismatch metrics
    ``engine/mismatch_k3`` and ``engine/logp_abs_diff_max`` (``iteration.engine_old_logp``)."""
    return iteration.engine_old_logp(self.policy_logp_fn, iteration.policy_params(self.state.train), placed)

  def _decode(self, completions: np.ndarray, mask: np.ndarray) -> list[str]:
    rows = [c[m].tolist() for c, m in zip(completions, mask)]
    return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

  def _score(self, indices, rows: Rollout) -> rewards_lib.RewardResult:
    """Rewards of this process's ``rows`` of the rollout of the prompts ``indices`` (row i belongs to
    prompt ``indices[rows.group_ids[i]]``)."""
    prompt_of_row = np.asarray(indices)[np.asarray(rows.group_ids)]
    texts = self._decode(rows.completions, rows.mask)
    prompts = [self.prompts.texts[i] for i in prompt_of_row]
    columns = _rows_to_columns([self.examples[i] for i in prompt_of_row], 1)
    return self.reward_set(prompts, texts, columns)

  def _rollout_batch(self, key, *, sample=None, kept_groups=None) -> tuple[train_lib.Batch, dict, int]:
    """Samples ``prompts_per_step`` groups (refilled under dynamic sampling) → (this process's rows of
    the Batch, metrics, completion tokens of the whole batch). ``sample(indices, key)``: the sampling
    call (default :meth:`_sample`); ``kept_groups``: a list extended with ``(round, group)`` of every
    group of the batch, in batch order.

    Each process scores its own rows; every row's reward and length is then gathered (one small
    all-gather per round), so every process keeps the same groups, in the same order, as one process
    would, and computes the same metrics."""
    roll, g = self.config.rollout, self.config.rollout.group_size
    groups = roll.prompts_per_step
    rounds, counters = [], {}
    selection = None
    while selection is None or not selection.done:
      key, sub = jax.random.split(key)
      indices = self.iterator.next(groups)
      rows = (self._sample if sample is None else sample)(indices, sub)
      res = self._score(indices, rows)
      lengths = np.asarray(rows.mask).sum(1).astype(np.int32)
      total, per_fn, lengths = distributed.all_rows((res.total, res.per_fn, lengths), self.mesh)
      for c in distributed.gather_objects(res.counters):
        for k, v in c.items():
          counters[k] = counters.get(k, 0) + v
      rounds.append((rows, total, per_fn, lengths))
      selection = iteration.select_groups(
        [r[1] for r in rounds],
        num_groups=groups,
        group_size=g,
        max_rounds=roll.dynamic_sampling_max_rounds,
        dynamic=self.objective.dynamic_sampling,
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
    if self.objective.dynamic_sampling:
      metrics["dynamic_sampling/dropped_groups"] = dropped
      metrics["dynamic_sampling/rounds"] = len(rounds)
    for k, v in counters.items():
      metrics[f"reward_counters/{k}"] = v
    return batch, metrics, int(lengths.sum())

  def _own_groups(self, rounds: list, kept: list[tuple[int, int]]) -> train_lib.Batch:
    """This process's rows of the batch of the ``kept`` groups (``(round, group)``, in batch order).

    The group at position j is fed by the process that sampled position j of a round; a kept group
    sampled by another process is fetched from it (``all_rows`` of its round: only for rounds some
    process needs, decided identically everywhere from ``kept``)."""
    g = self.config.rollout.group_size
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
    return train_lib.Batch(
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

  # ------------------------------------------------------------------ evaluation
  def evaluate(self, key=None) -> dict[str, float]:
    """mean@k (``eval_accuracy``) and ``eval_pass@k`` on the held-out set with k = eval_samples; with
    several processes each scores its share of the problems and the counts are gathered."""
    if self.eval_examples is None:
      return {}
    with contextlib.nullcontext() if self.rollouts is None else self.rollouts.paused():  # shared reward workers
      return self._evaluate(key)

  def _evaluate(self, key) -> dict[str, float]:
    cfg = self.config
    key = jax.random.key(cfg.run.seed + 1) if key is None else key
    if self.make_env is not None:  # mean@k of the environment reward
      return env_training.env_evaluate(
        self.sampling_policy(),
        self.eval_examples,
        self.make_env,
        self.tokenizer,
        self.sampling,
        cfg.env.multiturn_config(),
        k=cfg.eval.samples,
        key=key,
        batch_prompts=cfg.eval.batch_prompts,
        temperature=cfg.step.temperature if cfg.eval.temperature is None else cfg.eval.temperature,
        should_stop=self._stop_requested,
      )
    return evaluate_policy(
      self.sampling_policy(),
      self.tokenizer,
      self.eval_prompts.tokens,
      [e.answer for e in self.eval_examples],
      accuracy=self.accuracy,
      k=cfg.eval.samples,
      pass_k=cfg.eval.pass_k,
      temperature=cfg.step.temperature if cfg.eval.temperature is None else cfg.eval.temperature,
      max_new_tokens=cfg.rollout.max_new_tokens,
      prompt_len=self.prompt_len,
      pad_id=self.pad_id,
      eos_ids=self.eos_ids,
      batch_prompts=cfg.eval.batch_prompts,
      top_p=cfg.rollout.top_p,
      top_k=cfg.rollout.top_k,
      key=jax.random.key(cfg.run.seed + 1) if key is None else key,
      mesh=self.mesh,
    )

  def save_model(self, out_dir: str) -> list[str]:
    """Writes the current policy as a Hugging Face directory (``builders.save_policy``); a LoRA run
    writes the merged model there and its adapters as a PEFT directory, ``<out_dir>-peft`` (on the
    synthetic model: with its base in ``<out_dir>-base``, which the PEFT directory names). With
    several processes every process must call it (they all take part in gathering parameters that
    span processes) and process 0 writes. Returns the directories written (none on other processes)."""
    cfg, t = self.config, self.state.train
    model = self.policy()
    if jax.process_count() > 1:
      params, frozen = distributed.to_host((t.params, t.frozen))
      model = iteration.policy_model(self.graphdef, t._replace(params=params, frozen=frozen))
    if jax.process_index() != 0:
      return []
    if cfg.lora is None:
      return builders.save_policy(model, self.tokenizer, out_dir)
    return builders.save_policy(model, self.tokenizer, out_dir, **builders.lora_export_dirs(cfg, out_dir))

  # ------------------------------------------------------------------ the loop
  def train_step(self) -> dict[str, Any]:
    """One rollout → reward → update step; returns its metrics (the same on every process). With
    ``rollout.max_staleness`` >= 1 or ``devices.rollout``: the learner's step of ``self.rollouts``
    (``jaxgrpo.rollout.async_rollout``)."""
    if self.rollouts is not None:
      return self.rollouts.train_step()
    t0 = time.perf_counter()
    tstate, key, _ = self.state
    key, sample_key = jax.random.split(key)
    self._engine_times = {}
    if self.make_env is None:
      batch, metrics, tokens = self._rollout_batch(sample_key)
    else:  # multi-turn: G trajectories per prompt in the environments; rewards are theirs
      examples = [self.examples[i] for i in self.iterator.next(self.config.rollout.prompts_per_step)]
      batch, metrics, tokens = env_training.env_rollout_batch(
        self.sampling_policy(),
        examples,
        self.make_env,
        self.tokenizer,
        self.sampling,
        self.config.env.multiturn_config(),
        key=sample_key,
        temperature=self.train_config.temperature,
        should_stop=self._stop_requested,
      )
    t_roll = time.perf_counter() - t0
    # bucketed, packed if set; each process feeds its own rows
    placed = iteration.place(batch, mesh=self.mesh, train_config=self.train_config, process_local=True)
    if self.policy_logp_fn is not None:  # the trainer's own old_logp; the engine's log-probs are behavior_logp
      placed, engine_metrics = self._engine_logp(placed)
      metrics.update(engine_metrics)
    if self.engine is not None:
      metrics.update(self._engine_times)
    if self.reference is not None:
      placed = self.reference(placed)
    tstate, step_metrics = self.step_fn(tstate, placed)
    self._engine_stale = True  # the engine's weights are the old policy's until the next push
    step_metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
    self.state = TrainerState(tstate, key, self.iterator.state())
    dt = time.perf_counter() - t0
    metrics.update(step_metrics)
    metrics.update({"step": int(tstate.step), "tokens_per_sec": tokens / dt, "step_time": dt, "rollout_time": t_roll})
    metrics.setdefault("kl", 0.0)
    return metrics

  # ------------------------------------------------------------------ failure paths
  def _check_finite(self, metrics: Mapping[str, Any]) -> None:
    """After a step: NonFiniteError when the updated state (or, with ``stop_on_nonfinite_loss``, the
    loss) is not finite — before ``checkpoint_fn`` could save it; a log line for other non-finite metrics."""
    step = int(metrics["step"])
    t = self.state.train
    where = first_nonfinite(t.params, "params") or first_nonfinite(t.opt_state, "opt_state")
    err = _nonfinite_error(step, metrics, where, stop_on_loss=self.stop_on_nonfinite_loss)
    if err is not None:
      raise err
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
      self.log(
        f"warning: step {step}: non-finite metrics {', '.join(bad)}; the parameters are finite, training goes on"
      )

  def _checkpoint_after_write_error(self, error: MetricsWriteError, last_saved: int) -> MetricsWriteError:
    """After a failed metrics write (a full disk): a checkpoint attempt of the current step, unless it
    was saved already or its state is not finite. Returns ``error`` with the outcome in its message."""
    step, t = int(self.state.train.step), self.state.train
    bad = None
    if jax.process_count() == 1:
      bad = first_nonfinite(t.params, "params") or first_nonfinite(t.opt_state, "opt_state")
    if self.checkpoint_fn is None:
      what = "no checkpoint_fn: nothing saved"
    elif step <= last_saved:
      what = f"step {step} was checkpointed already"
    elif jax.process_count() > 1:  # a save is collective; only process 0 writes the metrics
      what = f"step {step} not checkpointed: with several processes a save needs all of them"
    elif bad is not None:
      what = f"step {step} not checkpointed: {bad} is not finite"
    else:
      try:
        self.checkpoint_fn(self.state.snapshot(), self.run_meta)
        what = f"a checkpoint of step {step} was started"
      except Exception as ce:  # noqa: BLE001 - reported in the message; the write error stays the cause
        what = f"the checkpoint attempt of step {step} failed too: {' '.join(str(ce).split())[:500]}"
    return MetricsWriteError(
      f"{error}; training stopped after step {step} ({what})", path=error.path, step=step, reason=error.reason
    )

  @contextlib.contextmanager
  def handle_signals(self) -> Iterator[None]:
    """SIGTERM/SIGINT → ``self.stop_signal``: ``run()`` finishes the current step, checkpoints it and
    raises :class:`TrainingInterrupted`. A second signal raises :class:`TrainingAborted` (a
    ``KeyboardInterrupt``) at once: a save in flight is abandoned, and its temporary directory is
    ignored and removed by the next run. Installed only in the main thread; the previous handlers
    are restored on exit. Re-entrant (``scripts/train.py`` also holds it while the last save is
    written)."""
    if threading.current_thread() is not threading.main_thread():
      yield
      return

    def handler(signum, frame):
      if self.stop_signal is not None:
        raise TrainingAborted(signum)
      self.stop_signal = signum
      # no print() here: the main thread may be inside one (reentrant call)
      msg = (
        f"\n{signal.Signals(signum).name} received: finishing the current step (or abandoning it while an "
        "environment call hangs), then writing a checkpoint and stopping; send it again to abort at once\n"
      )
      os.write(2, msg.encode())

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
      yield
    finally:
      for s, h in previous.items():
        signal.signal(s, h)

  def _stop_requested(self) -> bool:
    """Whether SIGTERM/SIGINT asked to stop (this process; the env rollout polls it while an environment call
    runs, so a hung environment does not hold the signal back)."""
    return self.stop_signal is not None

  def _requested_stop(self) -> int:
    """The signal that asks to stop (0: none), agreed by every process (a multi-host run stops at
    the same step everywhere: one tiny all-gather per step)."""
    signum = self.stop_signal or 0
    if jax.process_count() > 1:
      signum = int(np.max(multihost_utils.process_allgather(np.int32(signum))))
    return signum

  def _stop_if_requested(self, step: int, *, saved: bool, trained: bool = True) -> None:
    """At a step boundary: after SIGTERM/SIGINT, checkpoint ``step`` (unless ``saved`` already, or
    nothing was ``trained`` since the run started) and raise :class:`TrainingInterrupted`. The
    checkpoint is handed to ``checkpoint_fn``, which may still be writing it: the message says
    "started", never "written" (``scripts/train.py`` waits for it and reports what is on disk)."""
    signum = self._requested_stop()
    if not signum:
      return
    name = signal.Signals(signum).name
    if not trained:
      what = "no step was trained since the start: nothing new to save"
    elif self.checkpoint_fn is None:
      what = "no checkpoint_fn: nothing saved"
    else:
      if not saved:
        self.checkpoint_fn(self.state.snapshot(), self.run_meta)
      # checkpoint_fn may write in the background: whether it completed is for its owner to say
      what = f"checkpoint of step {step} started; it is complete once it is written"
    self.log(f"{name}: stopping after step {step} ({what})")
    raise TrainingInterrupted(f"stopped by {name} after step {step} ({what})", signum=signum, step=step)

  def run(self, *, handle_signals: bool = True) -> list[dict]:
    """Trains for ``run.steps`` steps; writes ``OUT/metrics.jsonl`` and ``OUT/config.json``;
    returns the logged records. A resumed run first cuts ``metrics.jsonl`` back to its step.

    Args:
      handle_signals: turn SIGTERM/SIGINT into a stop at the next step boundary
        (:meth:`handle_signals`; main thread only).
    Raises:
      jaxgrpo.services.runlock.RunDirLocked: another process runs in ``run.out`` (process 0 holds the
        directory's lock while it runs; re-entrant within one process).
      NonFiniteError: a step made the parameters or optimizer state (or the loss) non-finite.
      jaxgrpo.run.collapse.PolicyCollapsed: the policy collapsed with finite values (``collapse_guard``).
      jaxgrpo.services.metrics.MetricsWriteError: writing ``metrics.jsonl`` (or ``on_record``) failed, e.g. a
        full disk; a checkpoint of the current step was attempted first (the message says how it went).
      TrainingInterrupted: SIGTERM/SIGINT; the step it stopped at was checkpointed. The signal
        waits for the current step to finish (rollout, update, and the evaluation when one is due).

    With several processes the run is watched (``jaxgrpo.parallel.distributed.watch_hosts`` with
    ``devices.host_timeout_s``): when another process dies or raises, this one prints a message
    naming it and exits (``os._exit``, status ``jaxgrpo.parallel.distributed.EXIT_HOST_FAILED``); an exception
    of this process is reported to the others before it propagates. ``NonFiniteError``,
    ``PolicyCollapsed`` and ``TrainingInterrupted`` are raised by every process at the same step and
    are not reported.
    """
    watch = distributed.watch_hosts(
      self.config.devices.host_timeout_s, collective=(NonFiniteError, PolicyCollapsed, TrainingInterrupted)
    )
    with self.handle_signals() if handle_signals else contextlib.nullcontext(), watch:
      return self._run()

  def _run(self) -> list[dict]:
    cfg, run = self.config, self.config.run
    is_main = jax.process_index() == 0
    lock = runlock.RunLock(run.out).acquire() if is_main else None  # one run per directory (jaxgrpo.services.runlock)
    records: list[dict] = []
    path = os.path.join(run.out, "metrics.jsonl")
    start = last_saved = int(self.state.train.step)
    f = None
    if is_main:
      try:
        if self.resumed:  # drop records of steps after the restored checkpoint, and a cut last line
          dropped = truncate_jsonl(path, start)
          if dropped:
            self.log(f"{path}: dropped {dropped} line(s) after step {start} or cut short (resuming from step {start})")
        f = open(path, "ab" if self.resumed else "wb", buffering=0)  # unbuffered: a failed write leaves nothing behind
        with open(os.path.join(run.out, "config.json"), "w") as cf:
          json.dump(cfg.to_dict(), cf, indent=1)
      except OSError as e:  # a full disk at the start: one line, not a traceback
        if f is not None:
          f.close()
        lock.release()
        raise MetricsWriteError.of(e, path=path, step=start) from e

    def emit(rec):
      records.append(rec)
      try:
        if self.on_record is not None:
          self.on_record(rec)
      except OSError as e:  # e.g. TensorBoard files on a full disk
        raise MetricsWriteError.of(e, path=os.path.join(run.out, "(on_record)"), step=rec["step"]) from e
      if f is not None:
        append_record(f, rec, path=path)

    every = lambda n, step: (n and step % n == 0) or step == run.steps
    guard = self.collapse_guard
    collapse = CollapseWatch(guard, self.model.config.vocab_size) if guard and guard.action != "off" else None
    try:
      if self.eval_examples is not None and start == 0:
        try:
          ev = self.evaluate()
        except RolloutInterrupted:  # a signal while an environment call of the evaluation hung
          self._stop_if_requested(start, saved=False, trained=False)
          raise
        emit({"step": 0, **ev})
        self.log(f"step 0 eval {_fmt(ev)}")
      self._stop_if_requested(start, saved=False, trained=False)  # a signal during the first evaluation
      for _ in range(start, run.steps):
        try:
          m = self.train_step()
        except RolloutInterrupted:  # a signal while an environment call hung: the step is abandoned
          done = int(self.state.train.step)
          self._stop_if_requested(done, saved=done == last_saved, trained=done > start)
          raise
        emit(m)
        step = m["step"]
        if every(run.log_every, step):
          self.log(
            f"step {step} loss {m['loss']:.4f} reward {m['reward_mean']:.3f} kl {m['kl']:.4f} "
            f"len {m['completion_length']:.1f} {m['tokens_per_sec']:.0f} tok/s"
          )
        self._check_finite(m)  # before anything of this step is evaluated or saved
        if collapse is not None:
          collapse.check(m, self.log)  # a collapse with finite values (jaxgrpo.run.collapse)
        evaluated = self.eval_examples is not None and every(cfg.eval.every, step)
        if evaluated:
          try:
            ev = self.evaluate()
          except RolloutInterrupted:  # the step is trained: checkpoint it, then stop
            self._stop_if_requested(step, saved=False)
            raise
          emit({"step": step, **ev})
          self.log(f"step {step} eval {_fmt(ev)}")
        # an evaluated step is also saved when the best checkpoint by an eval metric is kept
        best = evaluated and cfg.checkpoint.best_metric is not None
        saved = self.checkpoint_fn is not None and bool(every(cfg.checkpoint.every, step) or best)
        if saved:
          self.checkpoint_fn(self.state.snapshot(), self.run_meta)
          last_saved = step
        self._stop_if_requested(step, saved=saved)
      if run.save_model:
        self.save_model(os.path.join(run.out, "model"))
    except MetricsWriteError as e:  # disk full: try to keep the steps done, then stop
      raise self._checkpoint_after_write_error(e, last_saved) from e.__cause__
    finally:
      if self.rollouts is not None:
        self.rollouts.close()
      if f is not None:
        f.close()
      self.accuracy.close()
      if lock is not None:
        lock.release()
    return records


def dropout_key(seed: int) -> jax.Array:
  """The run's LoRA adapter-dropout key: ``fold_in(key(seed), "drop")``, a stream of its own (the
  step folds in the step, pass and row, ``jaxgrpo.step.train.make_train_step``), so a resumed run
  draws the same masks."""
  return jax.random.fold_in(jax.random.key(seed), _DROPOUT_STREAM)


_DROPOUT_STREAM = 0x64726F70  # "drop"


def _fmt(d: Mapping[str, float]) -> str:
  return " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items())
