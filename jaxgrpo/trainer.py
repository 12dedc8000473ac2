"""The training loop: rollout → reward → update, with evaluation, metrics and a checkpoint hook.

One step::

    prompt indices   = PromptIterator.next(prompts_per_step)                  (host)
    rollout          = sampling.generate(policy, prompts, G, T, temperature)  (jitted)
    rewards          = RewardSet(prompts, completions, columns)               (host; this host's rows)
    [dynamic sampling: drop groups with equal rewards, sample again, refill]
    ref_logp         = reference_fn(ref_params, batch)                       (only when β > 0)
    state, metrics   = train_step(state, batch)                               (jitted, sharded)
    log → OUT/metrics.jsonl; every eval_every steps: pass@k / mean@k on the held-out set;
    every checkpoint_every steps: checkpoint_fn(TrainerState, config)

Everything a resume needs is explicit in :class:`TrainerState`: parameters, optimizer state and
step (``jaxgrpo.train.TrainState``), the PRNG key, the data-iterator position; plus the resolved
:class:`TrainerConfig`. Checkpointing itself is a later issue: pass ``checkpoint_fn``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxgrpo import data as data_lib
from jaxgrpo import models
from jaxgrpo import rewards as rewards_lib
from jaxgrpo import sharding as shd
from jaxgrpo import train as train_lib
from jaxgrpo.config import PRESETS, GRPOConfig, preset
from jaxgrpo.evaluation import summarize_eval
from jaxgrpo.sampling import generate

__all__ = ["TrainerConfig", "TrainerState", "Trainer", "load_config", "config_from_dict", "evaluate_policy"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REWARD_FUNCTIONS = ("accuracy", "format")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
  """Everything a run needs; YAML keys and ``--field value`` overrides use these names.

  Model and data:
    model: a Hugging Face model directory (or hub id), or ``"demo"`` (tiny Qwen3 + local tokenizer
      + supervised warm-up, no downloads; see ``jaxgrpo.demo``).
    dtype, param_dtype: compute and storage dtypes (``float32``, ``bfloat16``).
    dataset: hub id or local file/dir (see ``jaxgrpo.data.load_math_dataset``), or ``"demo"``.
    split, dataset_config, mapping: dataset split; hub configuration name (e.g. ``main`` for
      ``openai/gsm8k``); column mapping (None: detect; a name; ``{prompt:, answer:}``).
    eval_dataset, eval_dataset_config, eval_mapping, eval_split, eval_limit: held-out set (None:
      no evaluation), its own mapping, first ``eval_limit`` rows.
    max_prompt_tokens: longer prompts are dropped (counted), never truncated.
    instruction: appended to each question (the papers' ``\\boxed{}`` instruction; None: none).
  Algorithm (paper symbols):
    preset: grpo, dr_grpo, dapo, lambda_grpo, frpo, lambda_frpo.
    beta (β), epsilon (ε_low = ε_high unless epsilon_high), epsilon_high, mu (μ updates per batch),
    dynamic_sampling: override the preset's value when not None.
  Rollouts:
    group_size (G), prompts_per_step, max_new_tokens, temperature, top_p, top_k.
  Optimisation:
    learning_rate, weight_decay, adam_b1, adam_b2, warmup_steps, max_grad_norm,
    micro_batches, mini_batches, chunk_size (log-prob chunking).
  Rewards:
    rewards: ``{name: weight}`` over ``accuracy`` and ``format``; reward_timeout_s (per sample,
    None: no worker process); reward_on_error: ``raise`` or ``zero``; dynamic_sampling_max_rounds.
  Run:
    steps, seed, mesh (``"data=2,fsdp=2,tensor=2"``; "" = every device on fsdp), out,
    eval_every (0: only before and after training), eval_samples (k per problem),
    eval_pass_k, eval_temperature (None: temperature), eval_batch_prompts,
    checkpoint_every (0: never), save_model (write the final policy and tokenizer to ``OUT/model``
    as a Hugging Face directory), resume, log_every.
  Multi-host:
    distributed (call ``jax.distributed.initialize``), coordinator_address, num_processes, process_id.
  Demo (model/dataset ``"demo"``):
    demo_hidden_size, demo_layers, demo_max_operand, demo_train_size, demo_eval_size,
    demo_sft_steps, demo_sft_lr, demo_sft_batch, demo_sft_noise (fraction of warm-up
    demonstrations with a wrong answer; see ``jaxgrpo.demo.sft_warmup``).
  """

  model: str = "demo"
  dtype: str = "float32"
  param_dtype: str = "float32"
  dataset: str = "demo"
  split: str = "train"
  dataset_config: str | None = None
  mapping: Any = None
  eval_dataset: str | None = None
  eval_dataset_config: str | None = None
  eval_mapping: Any = None
  eval_split: str = "test"
  eval_limit: int | None = None
  max_prompt_tokens: int = 512
  instruction: str | None = data_lib.INSTRUCTION

  preset: str = "grpo"
  beta: float | None = None
  epsilon: float | None = None
  epsilon_high: float | None = None
  mu: int | None = None
  dynamic_sampling: bool | None = None

  group_size: int = 6
  prompts_per_step: int = 4
  max_new_tokens: int = 1024
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0

  learning_rate: float = 1e-6
  weight_decay: float = 0.0
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  warmup_steps: int = 0
  max_grad_norm: float | None = 1.0
  micro_batches: int = 1
  mini_batches: int = 1
  chunk_size: int | None = 256

  rewards: Mapping[str, float] = dataclasses.field(default_factory=lambda: {"accuracy": 1.0})
  reward_timeout_s: float | None = 10.0
  reward_on_error: str = "raise"
  dynamic_sampling_max_rounds: int = 4

  steps: int = 100
  seed: int = 0
  mesh: str = ""
  out: str = "runs/train"
  eval_every: int = 0
  eval_samples: int = 4
  eval_pass_k: tuple[int, ...] = (1,)
  eval_temperature: float | None = None
  eval_batch_prompts: int = 64
  checkpoint_every: int = 0
  save_model: bool = False
  resume: bool = False
  log_every: int = 1

  distributed: bool = False
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None

  demo_hidden_size: int = 64
  demo_layers: int = 2
  demo_max_operand: int = 19
  demo_train_size: int = 4000
  demo_eval_size: int = 128
  demo_sft_steps: int = 800
  demo_sft_lr: float = 3e-3
  demo_sft_batch: int = 32
  demo_sft_noise: float = 0.7

  def __post_init__(self):
    if self.preset not in PRESETS:
      raise ValueError(f"`preset` must be one of {sorted(PRESETS)}; got {self.preset!r}")
    for name in (
      "group_size",
      "prompts_per_step",
      "max_new_tokens",
      "steps",
      "max_prompt_tokens",
      "eval_samples",
      "eval_batch_prompts",
      "micro_batches",
      "mini_batches",
      "dynamic_sampling_max_rounds",
      "log_every",
    ):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "steps" else 1):
        raise ValueError(f"`{name}` must be a positive int; got {v!r}")
    for name in ("eval_every", "checkpoint_every", "warmup_steps", "demo_sft_steps"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 0:
        raise ValueError(f"`{name}` must be an int >= 0; got {v!r}")
    if self.dtype not in DTYPES or self.param_dtype not in DTYPES:
      raise ValueError(
        f"`dtype`/`param_dtype` must be one of {sorted(DTYPES)}; got {self.dtype!r}, {self.param_dtype!r}"
      )
    if not self.temperature > 0:
      raise ValueError(f"`temperature` must be > 0 for RL sampling; got {self.temperature}")
    if not self.learning_rate > 0:
      raise ValueError(f"`learning_rate` must be > 0; got {self.learning_rate}")
    unknown = set(self.rewards) - set(REWARD_FUNCTIONS)
    if not self.rewards or unknown:
      raise ValueError(f"`rewards` must map names from {REWARD_FUNCTIONS} to weights; got {dict(self.rewards)}")
    if self.reward_on_error not in ("raise", "zero"):
      raise ValueError(f"`reward_on_error` must be 'raise' or 'zero'; got {self.reward_on_error!r}")
    bad_k = [k for k in self.eval_pass_k if not isinstance(k, int) or not 1 <= k <= self.eval_samples]
    if bad_k:
      raise ValueError(f"`eval_pass_k` entries must be ints in [1, eval_samples={self.eval_samples}]; got {bad_k}")
    self.objective()  # validates the preset overrides

  def objective(self) -> GRPOConfig:
    """The GRPOConfig: the preset with β, ε, μ and dynamic sampling overridden when given."""
    overrides = {}
    if self.beta is not None:
      overrides["beta"] = float(self.beta)
    if self.epsilon is not None:
      overrides["clip_eps_low"] = float(self.epsilon)
      overrides["clip_eps_high"] = float(self.epsilon)
    if self.epsilon_high is not None:
      overrides["clip_eps_high"] = float(self.epsilon_high)
    if self.mu is not None:
      overrides["num_iterations"] = int(self.mu)
    if self.dynamic_sampling is not None:
      overrides["dynamic_sampling"] = bool(self.dynamic_sampling)
    return preset(self.preset, **overrides)

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["rewards"] = dict(self.rewards)
    d["eval_pass_k"] = list(self.eval_pass_k)
    return d


def config_from_dict(d: Mapping[str, Any]) -> TrainerConfig:
  """A TrainerConfig from a dict (YAML), with a clear error for unknown keys."""
  fields = {f.name for f in dataclasses.fields(TrainerConfig)}
  unknown = sorted(set(d) - fields)
  if unknown:
    raise ValueError(f"unknown config key(s) {unknown}; valid keys: {sorted(fields)}")
  d = dict(d)
  if "eval_pass_k" in d and d["eval_pass_k"] is not None:
    k = d["eval_pass_k"]
    d["eval_pass_k"] = tuple(int(x) for x in (k if isinstance(k, (list, tuple)) else [k]))
  return TrainerConfig(**d)


def load_config(path: str | None, overrides: Mapping[str, Any] | None = None) -> TrainerConfig:
  """YAML file (None: defaults) with ``overrides`` applied on top."""
  import yaml

  d: dict[str, Any] = {}
  if path is not None:
    with open(path) as f:
      d = yaml.safe_load(f) or {}
    if not isinstance(d, dict):
      raise ValueError(f"config file {path} must hold a mapping of fields; got {type(d).__name__}")
  d.update(overrides or {})
  return config_from_dict(d)


class TrainerState(NamedTuple):
  """The full resumable state: ``train`` (params, opt_state, step), ``key`` (PRNG key of the next
  step) and ``data_position`` (``PromptIterator.state()``)."""

  train: train_lib.TrainState
  key: jax.Array
  data_position: dict


def _optimizer(cfg: TrainerConfig) -> optax.GradientTransformation:
  lr = cfg.learning_rate
  if cfg.warmup_steps:
    lr = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps * cfg.mini_batches * (cfg.mu or 1))
  return optax.adamw(lr, b1=cfg.adam_b1, b2=cfg.adam_b2, weight_decay=cfg.weight_decay)


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
  """Builds the model, data, rewards, mesh and jitted steps from a :class:`TrainerConfig`; ``run()``
  trains, logging to ``OUT/metrics.jsonl``.

  Args:
    config: the run.
    checkpoint_fn: called as ``checkpoint_fn(state: TrainerState, config)`` every
      ``checkpoint_every`` steps and after the last step. The state's arrays are donated to the
      next train step: the function must save or copy them before it returns.
    restore_fn: ``restore_fn(config, template) -> TrainerState | None`` used when ``config.resume``;
      ``template`` is the freshly built state (shapes, dtypes, shardings of this mesh).
    on_record: called with every metrics record (steps and evaluations), e.g. a
      ``jaxgrpo.metrics.MetricsLogger`` or ``Checkpointer.observe`` (best checkpoint by eval metric).
    reward_fns: extra/replacement reward functions ``{name: (fn, weight)}`` (plain callables
      ``(prompts, completions, **columns) -> list[float]``); None: ``config.rewards``.
    log: print function for progress lines (None: silent).
  """

  def __init__(
    self,
    config: TrainerConfig,
    *,
    checkpoint_fn: Callable | None = None,
    restore_fn: Callable | None = None,
    reward_fns: Mapping[str, tuple] | None = None,
    log: Callable[[str], None] | None = print,
    on_record: Callable[[dict], None] | None = None,
  ):
    self.config = cfg = config
    self.objective = cfg.objective()
    self.checkpoint_fn, self.restore_fn = checkpoint_fn, restore_fn
    self.on_record = on_record
    self.log = log or (lambda s: None)
    self.mesh = shd.make_mesh(cfg.mesh or None)
    self._build_model_and_data()
    self.accuracy = rewards_lib.MathAccuracy(timeout_s=cfg.reward_timeout_s)
    if reward_fns is None:
      table = {"accuracy": self.accuracy, "format": rewards_lib.format_reward}
      reward_fns = {name: (table[name], float(w)) for name, w in cfg.rewards.items()}
    self.reward_set = rewards_lib.RewardSet(reward_fns, on_error=cfg.reward_on_error)
    self.optimizer = _optimizer(cfg)
    self.graphdef, train_state, self.shardings = train_lib.init_train_state(self.model, self.optimizer, self.mesh)
    self.train_config = train_lib.TrainConfig(
      micro_batches=cfg.micro_batches,
      mini_batches=cfg.mini_batches,
      max_grad_norm=cfg.max_grad_norm,
      temperature=cfg.temperature,
      chunk_size=cfg.chunk_size,
      group_size=cfg.group_size,
    )
    self.step_fn = train_lib.make_train_step(
      self.graphdef,
      self.optimizer,
      self.objective,
      mesh=self.mesh,
      shardings=self.shardings,
      train_config=self.train_config,
    )
    self.ref_params, self.ref_fn = None, None
    if self.objective.needs_reference:
      # a separate copy: the train step donates (and so invalidates) the policy parameters
      self.ref_params = jax.tree.map(lambda x: x.copy(), train_state.params)
      self.ref_fn = train_lib.make_reference_fn(
        self.graphdef, mesh=self.mesh, param_shardings=self.shardings.params, train_config=self.train_config
      )
    self.iterator = data_lib.PromptIterator(len(self.prompts.tokens), seed=cfg.seed)
    self.state = TrainerState(train_state, jax.random.key(cfg.seed), self.iterator.state())
    if cfg.resume:
      if restore_fn is None:
        raise ValueError("`resume` is set but no checkpoint restore is available (restore_fn=None); pass --no-resume")
      restored = restore_fn(cfg, self.state)
      if restored is not None:
        self.state = restored
        self.iterator.restore(restored.data_position)

  # ------------------------------------------------------------------ construction
  def _build_model_and_data(self):
    cfg = self.config
    dtype, param_dtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
    if cfg.model == "demo":
      from jaxgrpo import demo

      self.tokenizer = demo.build_tokenizer()
      mcfg = demo.tiny_model_config(len(self.tokenizer), hidden_size=cfg.demo_hidden_size, num_layers=cfg.demo_layers)
      self.model = models.build_model(mcfg, rngs=nnx.Rngs(cfg.seed), dtype=dtype, param_dtype=param_dtype)
    else:
      self.model = models.load_hf(cfg.model, dtype=dtype, param_dtype=param_dtype, mesh=self.mesh)
      self.tokenizer = models.load_tokenizer(cfg.model)
    tok = self.tokenizer
    if tok.pad_token_id is None and tok.eos_token_id is None:
      raise ValueError(f"tokenizer of {cfg.model!r} has neither a pad nor an EOS token")
    self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = tok.eos_token_id
    self.eos_ids = tuple(sorted({int(e) for e in ([eos] if isinstance(eos, int) else eos or [])}))
    if cfg.dataset == "demo":
      from jaxgrpo import demo

      train_rows, eval_rows = demo.arithmetic_split(
        cfg.demo_train_size, cfg.demo_eval_size, seed=cfg.seed, max_operand=cfg.demo_max_operand
      )
      train = data_lib.examples_from_rows(train_rows, "openrs")
      evals = data_lib.examples_from_rows(eval_rows, "openrs")
      if cfg.model == "demo" and cfg.demo_sft_steps:
        res = demo.sft_warmup(
          self.model,
          tok,
          train_rows,
          steps=cfg.demo_sft_steps,
          batch_size=cfg.demo_sft_batch,
          learning_rate=cfg.demo_sft_lr,
          seed=cfg.seed,
          noise=cfg.demo_sft_noise,
          log_every=max(1, cfg.demo_sft_steps // 4),
        )
        self.log(
          f"supervised warm-up: {cfg.demo_sft_steps} steps in {res.seconds:.1f} s, final loss {res.losses[-1]:.3f}"
        )
    else:
      train = data_lib.load_math_dataset(cfg.dataset, split=cfg.split, mapping=cfg.mapping, name=cfg.dataset_config)
      evals = None
      if cfg.eval_dataset:
        evals = data_lib.load_math_dataset(
          cfg.eval_dataset,
          split=cfg.eval_split,
          mapping=cfg.eval_mapping,
          limit=cfg.eval_limit,
          name=cfg.eval_dataset_config,
        )
    self.prompts = data_lib.encode_prompts(
      tok, train, max_prompt_tokens=cfg.max_prompt_tokens, instruction=cfg.instruction
    )
    self.examples = [train[i] for i in self.prompts.kept]
    self.eval_prompts = self.eval_examples = None
    if evals is not None:
      if cfg.eval_limit is not None:
        evals = evals[: cfg.eval_limit]
      self.eval_prompts = data_lib.encode_prompts(
        tok, evals, max_prompt_tokens=cfg.max_prompt_tokens, instruction=cfg.instruction
      )
      self.eval_examples = [evals[i] for i in self.eval_prompts.kept]
    longest = max(len(t) for t in self.prompts.tokens + (self.eval_prompts.tokens if evals else []))
    self.prompt_len = train_lib.bucket_length(longest, tuple(range(16, cfg.max_prompt_tokens + 16, 16)))
    limit = self.model.config.max_position_embeddings
    if self.prompt_len + cfg.max_new_tokens > limit:
      raise ValueError(
        f"prompt length {self.prompt_len} + max_new_tokens {cfg.max_new_tokens} exceeds the "
        f"model's max_position_embeddings {limit}"
      )

  # ------------------------------------------------------------------ pieces of a step
  def policy(self):
    return nnx.merge(self.graphdef, self.state.train.params)

  def _sample(self, token_lists, *, num_samples, temperature, key):
    tokens, mask = data_lib.pad_left(token_lists, self.prompt_len, self.pad_id)
    return generate(
      self.policy(),
      jnp.asarray(tokens),
      jnp.asarray(mask),
      num_samples=num_samples,
      max_new_tokens=self.config.max_new_tokens,
      temperature=temperature,
      top_p=self.config.top_p,
      top_k=self.config.top_k,
      eos_ids=self.eos_ids,
      pad_id=self.pad_id,
      key=key,
    )

  def _decode(self, completions: np.ndarray, mask: np.ndarray) -> list[str]:
    rows = [c[m].tolist() for c, m in zip(completions, mask)]
    return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

  def _score(self, indices, rollout) -> tuple[dict, np.ndarray, dict]:
    """Rewards of every rollout row; in multi-host runs each host scores its slice of rows."""
    g = self.config.group_size
    texts = self._decode(rollout.completions, rollout.mask)
    prompts = [self.prompts.texts[i] for i in indices for _ in range(g)]
    columns = _rows_to_columns([self.examples[i] for i in indices], g)
    nproc, pid = jax.process_count(), jax.process_index()
    sl = slice(None)
    if nproc > 1:
      n = len(texts)
      per = n // nproc
      sl = slice(pid * per, (pid + 1) * per)
      data_lib.host_slice(np.arange(n), pid, nproc)  # validates divisibility
    res = self.reward_set(prompts[sl], texts[sl], {k: v[sl] for k, v in columns.items()})
    total, per_fn = res.total, res.per_fn
    if nproc > 1:
      from jax.experimental import multihost_utils

      total = np.asarray(multihost_utils.process_allgather(total, tiled=True))
      per_fn = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in per_fn.items()}
    return per_fn, total, res.counters

  def _rollout_batch(self, key):
    """Samples ``prompts_per_step`` groups (refilled under dynamic sampling) → (Batch, metrics)."""
    cfg, g = self.config, self.config.group_size
    need = cfg.prompts_per_step
    kept_rows, counters = [], {}
    dropped = rounds = 0
    spare = []  # uninformative groups, used only when refill fails
    while need > 0:
      rounds += 1
      key, sub = jax.random.split(key)
      indices = self.iterator.next(cfg.prompts_per_step)
      rollout = self._sample(
        [self.prompts.tokens[i] for i in indices], num_samples=g, temperature=cfg.temperature, key=sub
      )
      host = _to_host(rollout._replace(num_steps=jnp.zeros(())))
      per_fn, total, c = self._score(indices, host)
      for k, v in c.items():
        counters[k] = counters.get(k, 0) + v
      groups = np.arange(cfg.prompts_per_step)
      informative = rewards_lib.group_is_informative(total, np.asarray(host.group_ids), len(groups))
      if not self.objective.dynamic_sampling:
        informative[:] = True
      for b in groups:
        rows = np.arange(b * g, (b + 1) * g)
        entry = (host, rows, total[rows], {k: v[rows] for k, v in per_fn.items()})
        if informative[b] and need > 0:
          kept_rows.append(entry)
          need -= 1
        elif not informative[b]:
          dropped += 1
          spare.append(entry)
      if need > 0 and rounds >= cfg.dynamic_sampling_max_rounds:
        kept_rows += spare[:need]  # give up refilling: these groups have zero advantage
        need = 0
    parts = kept_rows[: cfg.prompts_per_step]
    cat = lambda f: np.concatenate([getattr(h, f)[r] for h, r, _, _ in parts])
    rewards = np.concatenate([t for _, _, t, _ in parts]).astype(np.float32)
    group_ids = np.repeat(np.arange(len(parts), dtype=np.int32), g)
    batch = train_lib.Batch(
      prompt_tokens=cat("prompt_tokens"),
      prompt_mask=cat("prompt_mask"),
      completions=cat("completions"),
      mask=cat("mask"),
      old_logp=cat("log_probs"),
      group_ids=group_ids,
      rewards=rewards,
    )
    metrics = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std())}
    for name in parts[0][3]:
      metrics[f"reward/{name}"] = float(np.concatenate([f[name] for _, _, _, f in parts]).mean())
    metrics["completion_length"] = float(batch.mask.sum(1).mean())
    if self.objective.dynamic_sampling:
      metrics["dynamic_sampling/dropped_groups"] = dropped
      metrics["dynamic_sampling/rounds"] = rounds
    for k, v in counters.items():
      metrics[f"reward_counters/{k}"] = v
    return batch, metrics, key

  # ------------------------------------------------------------------ evaluation
  def evaluate(self, key=None) -> dict[str, float]:
    """mean@k (``eval_accuracy``) and ``eval_pass@k`` on the held-out set with k = eval_samples."""
    if self.eval_prompts is None:
      return {}
    cfg = self.config
    return evaluate_policy(
      self.policy(),
      self.tokenizer,
      self.eval_prompts.tokens,
      [e.answer for e in self.eval_examples],
      accuracy=self.accuracy,
      k=cfg.eval_samples,
      pass_k=cfg.eval_pass_k,
      temperature=cfg.temperature if cfg.eval_temperature is None else cfg.eval_temperature,
      max_new_tokens=cfg.max_new_tokens,
      prompt_len=self.prompt_len,
      pad_id=self.pad_id,
      eos_ids=self.eos_ids,
      batch_prompts=cfg.eval_batch_prompts,
      top_p=cfg.top_p,
      top_k=cfg.top_k,
      key=jax.random.key(cfg.seed + 1) if key is None else key,
    )

  # ------------------------------------------------------------------ the loop
  def train_step(self) -> dict[str, Any]:
    """One rollout → reward → update step; returns its metrics."""
    t0 = time.perf_counter()
    tstate, key, _ = self.state
    key, sample_key = jax.random.split(key)
    batch, metrics, _ = self._rollout_batch(sample_key)
    t_roll = time.perf_counter() - t0
    batch = train_lib.pad_to_bucket(batch)
    placed = shd.place_batch(batch, self.mesh)
    if self.ref_fn is not None:
      placed = placed._replace(ref_logp=self.ref_fn(self.ref_params, placed))
    tstate, step_metrics = self.step_fn(tstate, placed)
    step_metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
    self.state = TrainerState(tstate, key, self.iterator.state())
    dt = time.perf_counter() - t0
    tokens = float(np.asarray(batch.mask).sum())
    metrics.update(step_metrics)
    metrics.update({"step": int(tstate.step), "tokens_per_sec": tokens / dt, "step_time": dt, "rollout_time": t_roll})
    metrics.setdefault("kl", 0.0)
    return metrics

  def run(self) -> list[dict]:
    """Trains for ``config.steps`` steps; writes ``OUT/metrics.jsonl`` and ``OUT/config.json``;
    returns the logged records."""
    cfg = self.config
    is_main = jax.process_index() == 0
    os.makedirs(cfg.out, exist_ok=True)
    records: list[dict] = []
    path = os.path.join(cfg.out, "metrics.jsonl")
    if cfg.resume and is_main:  # drop records of steps after the restored checkpoint
      from jaxgrpo.metrics import truncate_jsonl

      truncate_jsonl(path, int(self.state.train.step))
    f = open(path, "a" if cfg.resume else "w") if is_main else None

    def emit(rec):
      records.append(rec)
      if self.on_record is not None:
        self.on_record(rec)
      if f is not None:
        f.write(json.dumps(rec) + "\n")
        f.flush()

    if is_main:
      with open(os.path.join(cfg.out, "config.json"), "w") as cf:
        json.dump(cfg.to_dict(), cf, indent=1)
    try:
      start = int(self.state.train.step)
      if self.eval_prompts is not None and start == 0:
        ev = self.evaluate()
        emit({"step": 0, **ev})
        self.log(f"step 0 eval {_fmt(ev)}")
      for _ in range(start, cfg.steps):
        m = self.train_step()
        emit(m)
        step = m["step"]
        if step % cfg.log_every == 0 or step == cfg.steps:
          self.log(
            f"step {step} loss {m['loss']:.4f} reward {m['reward_mean']:.3f} kl {m['kl']:.4f} "
            f"len {m['completion_length']:.1f} {m['tokens_per_sec']:.0f} tok/s"
          )
        if self.eval_prompts is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps):
          ev = self.evaluate()
          emit({"step": step, **ev})
          self.log(f"step {step} eval {_fmt(ev)}")
        if self.checkpoint_fn is not None and (
          (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps
        ):
          self.checkpoint_fn(self.state, cfg)
      if cfg.save_model and is_main:
        models.save_hf(self.policy(), os.path.join(cfg.out, "model"))
        self.tokenizer.save_pretrained(os.path.join(cfg.out, "model"))
    finally:
      if f is not None:
        f.close()
      self.accuracy.close()
    return records


def evaluate_policy(
  model,
  tokenizer,
  token_lists: Sequence[Sequence[int]],
  answers: Sequence[str],
  *,
  accuracy: Callable,
  k: int,
  pass_k: Sequence[int] = (1,),
  temperature: float,
  max_new_tokens: int,
  prompt_len: int,
  pad_id: int,
  eos_ids: Sequence[int],
  batch_prompts: int = 64,
  top_p: float = 1.0,
  top_k: int = 0,
  key,
) -> dict[str, float]:
  """Samples ``k`` completions per prompt and scores them with ``accuracy`` (a reward function,
  e.g. :class:`~jaxgrpo.rewards.MathAccuracy`) → ``{"eval_accuracy": mean@k, "eval_pass@j": ...}``
  (unbiased estimator, :func:`jaxgrpo.evaluation.pass_at_k`) plus the verifier's counters.

  Prompts go in batches of ``batch_prompts`` (the last one padded by repetition: one compiled shape).
  """
  nb = min(batch_prompts, len(token_lists))
  correct = []
  for start in range(0, len(token_lists), nb):
    chunk = list(range(start, min(start + nb, len(token_lists))))
    padded = chunk + [chunk[-1]] * (nb - len(chunk))
    tokens, mask = data_lib.pad_left([token_lists[i] for i in padded], prompt_len, pad_id)
    ro = generate(
      model,
      jnp.asarray(tokens),
      jnp.asarray(mask),
      num_samples=k,
      max_new_tokens=max_new_tokens,
      temperature=temperature,
      top_p=top_p,
      top_k=top_k,
      eos_ids=tuple(eos_ids),
      pad_id=pad_id,
      key=jax.random.fold_in(key, start),
    )
    ro = _to_host(ro._replace(num_steps=jnp.zeros(())))
    comp, cmask = ro.completions, ro.mask
    texts = tokenizer.batch_decode([c[m].tolist() for c, m in zip(comp, cmask)], skip_special_tokens=True)
    texts = texts[: len(chunk) * k]
    gold = [answers[i] for i in chunk for _ in range(k)]
    scores = accuracy([""] * len(texts), texts, answer=gold)
    correct.append(np.asarray(scores).reshape(len(chunk), k) > 0.5)
  out = summarize_eval(np.concatenate(correct), ks=pass_k)
  if isinstance(accuracy, rewards_lib.CountingReward):
    out.update({f"eval_{c}": v for c, v in accuracy.pop_counters().items()})
  return out


def _to_host(tree):
  """NumPy copies of (possibly multi-host, sharded) arrays: every process gets the global values."""
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  from jax.experimental import multihost_utils

  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)


def _fmt(d: Mapping[str, float]) -> str:
  return " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items())
