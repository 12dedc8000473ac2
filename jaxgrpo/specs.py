"""What a training run is: nested, frozen, keyword-only specs, their YAML form, and validation.

A :class:`TrainerConfig` is a few sections, each a frozen dataclass; two of them are the library's
own configs, embedded as they are::

    model       ModelSpec        an HF directory, or the arithmetic task's synthetic model; dtypes
    lora        LoRAConfig       LoRA/QLoRA adapters (``jaxgrpo.models.lora``); absent: full fine-tuning
    data        DataSpec         the prompt set (a dataset, or the synthetic arithmetic task)
    objective   GRPOConfig       the algorithm (``jaxgrpo.config``): a preset plus overrides
    rollout     RolloutSpec      G, prompts per step, T, top-p/top-k, dynamic-sampling rounds
    step        TrainConfig      the jitted step (``jaxgrpo.train``): micro/mini-batches, clipping,
                                 chunking, packing, and the sampling temperature the log-probs refer to
    optim       OptimSpec        AdamW and its warm-up
    reward      RewardSpec       reward functions and weights, verifier time limit, error policy
    eval        EvalSpec         held-out set, k samples, pass@k, cadence
    checkpoint  CheckpointSpec   cadence and retention
    run         RunSpec          steps, seed, output directory, logging, HF export
    devices     DevicesSpec      mesh and multi-host start-up
    env         EnvSpec          multi-turn environment and its bounds (``jaxgrpo.environments``); absent:
                                 single-turn completions scored by ``reward``

YAML mirrors it (``scripts/configs/*.yaml``)::

    model: {path: Qwen/Qwen3-1.7B-Base, dtype: bfloat16}
    lora: {rank: 64, alpha: 128, dropout: 0.05}  # optional: train adapters only (quantize: nf4 = QLoRA)
    data: {dataset: BytedTsinghua-SIA/DAPO-Math-17k, mapping: dapo}
    objective: {preset: frpo, beta: 0.01}       # a preset name plus GRPOConfig fields
    rollout: {group_size: 5, prompts_per_step: 256, max_new_tokens: 8192}
    step: {mini_batches: 4, micro_batches: 8, temperature: 1.0}
    optim: {learning_rate: 1.0e-6}

:func:`load_config` reads a file, applies ``overrides`` (dotted keys, ``{"rollout.group_size": 8}``)
on top of it — or on top of the defaults without a file — and checks every field's type and value,
naming the field, the expected type and the value, before anything is built. Numbers such as
``1e-4`` are floats (YAML 1.1 would read them as strings); NaN and ±inf are refused. Keys are the
section names and dotted paths only: a key of the earlier flat config (``group_size``,
``demo_layers``, ...) is an unknown key, and its error names the dotted key to write.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax.numpy as jnp
import yaml

from jaxgrpo import _checks
from jaxgrpo.config import GRPOConfig, preset
from jaxgrpo.data import INSTRUCTION
from jaxgrpo.environments.spec import EnvSpec
from jaxgrpo.models import RematPolicy
from jaxgrpo.models.lora import LoRAConfig
from jaxgrpo.tasks.arithmetic import ArithmeticTask, SyntheticModel
from jaxgrpo.train import TrainConfig

__all__ = [
  "DTYPES",
  "REWARD_FUNCTIONS",
  "ModelSpec",
  "DataSpec",
  "RolloutSpec",
  "VLLMSpec",
  "ENGINES",
  "OptimSpec",
  "RewardSpec",
  "EvalSpec",
  "CheckpointSpec",
  "RunSpec",
  "DevicesSpec",
  "TrainerConfig",
  "config_from_dict",
  "load_config",
  "read_yaml",
  "parse_value",
  "parse_override",
  "field_type",
]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REWARD_FUNCTIONS = ("accuracy", "format")


def _ints(section: str, spec, names: tuple[str, ...], minimum: int = 1) -> None:
  """``_checks.check_python_int`` of each field ``names`` of ``spec``, named ``section.name``."""
  for name in names:
    _checks.check_python_int(getattr(spec, name), f"{section}.{name}", minimum=minimum)


def _float(section: str, spec, name: str, **bounds) -> None:
  """``_checks.check_python_float`` (finite, in range) of field ``name`` of ``spec``, named ``section.name``."""
  _checks.check_python_float(getattr(spec, name), f"{section}.{name}", **bounds)


# ----------------------------------------------------------------------------- the sections


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
  """The policy: exactly one of ``path`` and ``synthetic``.

  Attributes:
    path: a Hugging Face model directory (``config.json``, safetensors, tokenizer) or hub id.
    synthetic: the arithmetic task's tiny Qwen3 model and locally built tokenizer
      (:class:`jaxgrpo.tasks.arithmetic.SyntheticModel`), randomly initialised from ``run.seed``.
    dtype: compute dtype (``float32``, ``bfloat16``, ``float16``).
    param_dtype: storage dtype of the parameters.
    remat: activation checkpointing of every layer (``jaxgrpo.models.RematPolicy``): ``none`` (store
      everything: fastest, most memory), ``full`` (store each layer's input, recompute the layer in the
      backward pass), ``dots`` (store matmul outputs, recompute the rest), ``dots_no_batch`` (store the
      projections, recompute attention scores and the rest: the choice for long rows); ``true`` /
      ``false`` are ``full`` / ``none``. Values and gradients are the same for every policy
      (docs/train.md, "Packing, remat, activation sharding").
    scan_layers: store the layers stacked and run them as one ``jax.lax.scan``
      (``jaxgrpo.models.build_model``): compiles the layer once instead of once per layer; same
      values. Not for MoE models. Default false (docs/models.md, "Layers as a scan": measured).
  """

  path: str | None = None
  synthetic: SyntheticModel | None = None
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: Literal["none", "full", "dots", "dots_no_batch"] | bool = "none"
  scan_layers: bool = False

  def __post_init__(self):
    if (self.path is None) == (self.synthetic is None):
      raise ValueError(
        "`model` needs exactly one of `path` (an HF directory or hub id) and `synthetic` (the arithmetic "
        f"task's tiny model, e.g. {{hidden_size: 64, num_layers: 2}}); got path={self.path!r}, "
        f"synthetic={self.synthetic!r}"
      )
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"`model.{name}` must be one of {sorted(DTYPES)}; got {getattr(self, name)!r}")
    try:
      RematPolicy.parse(self.remat)
    except (TypeError, ValueError) as e:
      raise ValueError(f"`model.remat`: {e}") from None
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"`model.scan_layers` must be true or false; got {self.scan_layers!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSpec:
  """The training prompts: exactly one of ``dataset`` and ``arithmetic``.

  Attributes:
    dataset: hub id or local file/directory (see ``jaxgrpo.data.load_math_dataset``).
    dataset_config: the hub configuration name (e.g. ``main`` for ``openai/gsm8k``).
    split: dataset split.
    mapping: column mapping: None (detect), a built-in name (``openrs``, ``dapo``, ``gsm8k``,
      ``math500``) or ``{prompt: <column>, answer: <column>}``.
    arithmetic: the synthetic task "What is a + b?" (:class:`jaxgrpo.tasks.arithmetic.ArithmeticTask`),
      which brings its own held-out set and the synthetic model's supervised warm-up.
    max_prompt_tokens: longer prompts are dropped (counted), never truncated.
    instruction: appended to each question (the papers' ``\\boxed{}`` instruction; None: none).
  """

  dataset: str | None = None
  dataset_config: str | None = None
  split: str = "train"
  mapping: str | Mapping[str, str] | None = None
  arithmetic: ArithmeticTask | None = None
  max_prompt_tokens: int = 512
  instruction: str | None = INSTRUCTION

  def __post_init__(self):
    if (self.dataset is None) == (self.arithmetic is None):
      raise ValueError(
        "`data` needs exactly one of `dataset` (a hub id or local file) and `arithmetic` (the synthetic task, "
        f"e.g. {{train_size: 4000, eval_size: 128}}); got dataset={self.dataset!r}, arithmetic={self.arithmetic!r}"
      )
    _ints("data", self, ("max_prompt_tokens",))


ENGINES = ("jax", "vllm")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VLLMSpec:
  """The vLLM engine of ``rollout.engine: vllm`` (``jaxgrpo.engines.vllm.VLLMEngine``; docs/sampling.md,
  "Engines").

  Attributes:
    dtype: vLLM's weight and compute dtype: ``float32``, ``bfloat16`` or ``float16``.
    kv_cache_bytes: the KV cache, in bytes (CPU; vLLM's ``kv_cache_memory_bytes``).
    gpu_memory_utilization: vLLM's share of the GPU's memory, in (0, 1] (GPU only; leave the rest to XLA:
      ``XLA_PYTHON_CLIENT_MEM_FRACTION`` + this < 1).
    max_num_seqs: the most sequences vLLM decodes at once.
    enforce_eager: no torch.compile / CUDA graphs (faster start-up, slower decoding on a GPU).
  """

  dtype: str = "float32"
  kv_cache_bytes: int = 256 * 2**20
  gpu_memory_utilization: float = 0.3
  max_num_seqs: int = 256
  enforce_eager: bool = True

  def __post_init__(self):
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"`rollout.vllm.dtype` must be float32, bfloat16 or float16; got {self.dtype!r}")
    _ints("rollout.vllm", self, ("kv_cache_bytes", "max_num_seqs"))
    _float("rollout.vllm", self, "gpu_memory_utilization", above=0.0, at_most=1.0)
    _checks.check_python_bool(self.enforce_eager, "rollout.vllm.enforce_eager")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSpec:
  """Sampling the groups of one step (the temperature is ``step.temperature``: the train step's
  log-probs refer to it, so it is one value for both).

  Attributes:
    group_size: G, completions per prompt.
    prompts_per_step: prompts (groups) per step.
    max_new_tokens: T, the longest completion.
    top_p, top_k: nucleus and top-k sampling (1.0 and 0: off).
    dynamic_sampling_max_rounds: with ``objective.dynamic_sampling`` (DAPO), the most sampling
      rounds per step before the batch is filled with zero-advantage groups.
    merge_lora: with a ``lora`` section, sample (and evaluate) from ``models.lora.merge_lora`` of
      the policy — no adapter matmuls per token, but a merged copy of the adapted weights while
      sampling — instead of the adapted model (default; see docs/models.md, "Sampling").
    max_staleness: k, the most updates the parameters that sampled a group may lag behind the ones
      it is trained from. 0: the synchronous loop; >= 1: a producer samples the next batches while
      the learner updates (``jaxgrpo.async_rollout``; docs/trainer.md, "Asynchronous rollouts").
    engine: what generates the rollouts: ``jax`` (the built-in jitted sampler, default) or ``vllm``
      (vLLM in this process, the policy's weights pushed after every update; its log-probs become the
      batch's ``behavior_logp`` and the trainer recomputes ``old_logp``; docs/sampling.md, "Engines").
    vllm: the vLLM engine's settings (read with ``engine: vllm``).
    routing_replay: a mixture-of-experts policy only (``jaxgrpo.models.moe``): ``rollout`` (default)
      records each token's experts while sampling and the train step and the reference pass reuse
      them (routing replay); ``none``: every forward routes by its own top-k. Ignored by a dense model.
  """

  group_size: int = 6
  prompts_per_step: int = 4
  max_new_tokens: int = 1024
  top_p: float = 1.0
  top_k: int = 0
  dynamic_sampling_max_rounds: int = 4
  merge_lora: bool = False
  max_staleness: int = 0
  engine: str = "jax"
  vllm: VLLMSpec = dataclasses.field(default_factory=VLLMSpec)
  routing_replay: Literal["rollout", "none"] = "rollout"

  def __post_init__(self):
    if self.engine not in ENGINES:
      raise ValueError(f"`rollout.engine` must be one of {ENGINES}; got {self.engine!r}")
    if self.engine != "jax" and self.max_staleness:
      raise ValueError(
        f"`rollout.max_staleness`={self.max_staleness} needs `rollout.engine: jax` (asynchronous rollouts run the "
        f"built-in sampler on the producer's parameters); got `rollout.engine: {self.engine}`"
      )
    _ints("rollout", self, ("group_size", "prompts_per_step", "max_new_tokens", "dynamic_sampling_max_rounds"))
    _ints("rollout", self, ("top_k", "max_staleness"), minimum=0)
    _float("rollout", self, "top_p", above=0.0, at_most=1.0)
    _checks.check_python_bool(self.merge_lora, "rollout.merge_lora")
    if self.routing_replay not in ("rollout", "none"):
      raise ValueError(f"`rollout.routing_replay` must be 'rollout' or 'none'; got {self.routing_replay!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimSpec:
  """AdamW (``optax.adamw``), with a linear warm-up of the learning rate.

  Attributes:
    learning_rate: the peak learning rate.
    weight_decay: decoupled weight decay.
    adam_b1, adam_b2: Adam's β₁, β₂.
    warmup_steps: RL steps of linear warm-up from 0 (each step makes μ × mini_batches updates).
  """

  learning_rate: float = 1e-6
  weight_decay: float = 0.0
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  warmup_steps: int = 0

  def __post_init__(self):
    _float("optim", self, "learning_rate", above=0.0)
    _float("optim", self, "weight_decay", at_least=0.0)
    for name in ("adam_b1", "adam_b2"):
      _float("optim", self, name, at_least=0.0, hint="in [0, 1)")
      if not getattr(self, name) < 1.0:
        raise ValueError(f"`optim.{name}` must be in [0, 1); got {getattr(self, name)}")
    _ints("optim", self, ("warmup_steps",), minimum=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSpec:
  """The reward: a weighted sum of named functions.

  Attributes:
    weights: ``{name: weight}`` over ``accuracy`` (``jaxgrpo.rewards.MathAccuracy``: the boxed
      answer is right) and ``format`` (``jaxgrpo.rewards.format_reward``: a boxed answer is present).
    timeout_s: per-sample verifier time limit in a worker process (None: no worker process).
    on_error: ``raise`` (stop, showing the sample) or ``zero`` (score 0 and count it).
  """

  weights: Mapping[str, float] = dataclasses.field(default_factory=lambda: {"accuracy": 1.0})
  timeout_s: float | None = 10.0
  on_error: str = "raise"

  def __post_init__(self):
    unknown = set(self.weights) - set(REWARD_FUNCTIONS)
    if not self.weights or unknown:
      raise ValueError(f"`reward.weights` must map names from {REWARD_FUNCTIONS} to weights; got {dict(self.weights)}")
    if self.on_error not in ("raise", "zero"):
      raise ValueError(f"`reward.on_error` must be 'raise' or 'zero'; got {self.on_error!r}")
    for name, weight in self.weights.items():
      _checks.check_python_float(weight, f"reward.weights.{name}")
    if self.timeout_s is not None:
      _float("reward", self, "timeout_s", above=0.0, hint="seconds, or None for no worker process")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSpec:
  """Held-out evaluation: mean@k (``eval_accuracy``) and the unbiased pass@k.

  Attributes:
    dataset, dataset_config, split, mapping: the held-out set (None: none; the arithmetic task
      brings its own, so leave it None with ``data.arithmetic``).
    limit: the first ``limit`` problems (None: all).
    every: evaluate every ``every`` steps (0: only before and after training).
    samples: k samples per problem.
    pass_k: the j of the reported ``eval_pass@j`` (each in ``[1, samples]``).
    temperature: sampling temperature (None: ``step.temperature``; 0: greedy).
    batch_prompts: prompts per sampling call.
  """

  dataset: str | None = None
  dataset_config: str | None = None
  split: str = "test"
  mapping: str | Mapping[str, str] | None = None
  limit: int | None = None
  every: int = 0
  samples: int = 4
  pass_k: tuple[int, ...] = (1,)
  temperature: float | None = None
  batch_prompts: int = 64

  def __post_init__(self):
    _ints("eval", self, ("samples", "batch_prompts"))
    _ints("eval", self, ("every",), minimum=0)
    if self.limit is not None:
      _ints("eval", self, ("limit",))
    bad = [k for k in self.pass_k if not isinstance(k, int) or not 1 <= k <= self.samples]
    if bad:
      raise ValueError(f"`eval.pass_k` entries must be ints in [1, eval.samples={self.samples}]; got {bad}")
    if self.temperature is not None:
      _float("eval", self, "temperature", at_least=0.0, hint="0: greedy; None: step.temperature")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
  """Checkpoints in ``OUT/checkpoints`` (``jaxgrpo.checkpoint``); whether to resume is a command-line
  choice (``scripts/train.py --resume/--no-resume``), not part of the run.

  Attributes:
    every: save every ``every`` steps (0: only after the last step).
    keep: keep the last ``keep`` checkpoints.
    best_metric: also keep the best checkpoint by this evaluation metric (None: recency only).
    async_save: write in the background (the next save waits for it).
  """

  every: int = 0
  keep: int = 3
  best_metric: str | None = "eval_accuracy"
  async_save: bool = True

  def __post_init__(self):
    _ints("checkpoint", self, ("every",), minimum=0)
    _ints("checkpoint", self, ("keep",))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
  """The run itself.

  Attributes:
    steps: RL steps.
    seed: seeds the model initialisation (synthetic model), data order, arithmetic task and sampling.
    out: output directory (``metrics.jsonl``, ``config.json``, ``checkpoints/``, ``model/``).
    log_every: a progress line every ``log_every`` steps.
    save_model: write the final policy and tokenizer to ``OUT/model`` as a Hugging Face directory.
  """

  steps: int = 100
  seed: int = 0
  out: str = "runs/train"
  log_every: int = 1
  save_model: bool = False

  def __post_init__(self):
    _ints("run", self, ("steps", "seed"), minimum=0)
    _ints("run", self, ("log_every",))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DevicesSpec:
  """Devices and hosts.

  Attributes:
    mesh: ``"data=2,fsdp=2,tensor=2"`` (``""``: every device on fsdp; see ``jaxgrpo.sharding``).
    distributed: call ``jaxgrpo.distributed.initialize`` first (multi-host runs).
    coordinator_address, num_processes, process_id: its arguments (None: from the environment).
    host_timeout_s: several processes: a process that sent no heartbeat for this many seconds
      counts as dead and the others stop, naming it (``jaxgrpo.distributed.HostWatchdog``); JAX's own
      heartbeat timeout is set to twice this value.
    rollout: disaggregated placement: sample on a mesh of this many devices of their own (the last
      ones) and train on the others (``mesh``); None: colocated, one mesh time-shared.
    train: with ``rollout``: the devices of the training mesh (the first ones; None: all the
      rollout mesh leaves).
    rollout_mesh: the rollout mesh's axes (like ``mesh``; ``""``: every rollout device on fsdp).
  """

  mesh: str = ""
  distributed: bool = False
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  host_timeout_s: float = 90.0
  rollout: int | None = None
  train: int | None = None
  rollout_mesh: str = ""

  def __post_init__(self):
    _float("devices", self, "host_timeout_s", at_least=1.0, hint="seconds")
    _ints("devices", self, tuple(f for f in ("rollout", "train") if getattr(self, f) is not None))
    if self.train is not None and self.rollout is None:
      raise ValueError(f"`devices.train`={self.train} needs `devices.rollout` (disaggregated placement)")


def _arithmetic_model() -> ModelSpec:
  return ModelSpec(synthetic=SyntheticModel())


def _arithmetic_data() -> DataSpec:
  return DataSpec(arithmetic=ArithmeticTask())


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
  """Everything a run needs, by concern (see the module docstring). The defaults are the offline
  arithmetic demo: the synthetic model on the synthetic task, the ``grpo`` preset.

  Every field's type is checked on construction (``TypeError`` naming the field, the expected type
  and the value), then each section's values (``ValueError``), then the constraints between sections.
  ``rollout.group_size: 1`` warns: every advantage of a group of one is 0.
  """

  model: ModelSpec = dataclasses.field(default_factory=_arithmetic_model)
  lora: LoRAConfig | None = None
  data: DataSpec = dataclasses.field(default_factory=_arithmetic_data)
  objective: GRPOConfig = dataclasses.field(default_factory=lambda: preset("grpo"))
  rollout: RolloutSpec = dataclasses.field(default_factory=RolloutSpec)
  step: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  optim: OptimSpec = dataclasses.field(default_factory=OptimSpec)
  reward: RewardSpec = dataclasses.field(default_factory=RewardSpec)
  eval: EvalSpec = dataclasses.field(default_factory=EvalSpec)
  checkpoint: CheckpointSpec = dataclasses.field(default_factory=CheckpointSpec)
  run: RunSpec = dataclasses.field(default_factory=RunSpec)
  devices: DevicesSpec = dataclasses.field(default_factory=DevicesSpec)
  env: EnvSpec | None = None

  def __post_init__(self):
    _check_fields(self, "")
    arithmetic = self.data.arithmetic
    if arithmetic is not None and arithmetic.sft_steps and self.model.synthetic is None:
      raise ValueError(
        f"`data.arithmetic.sft_steps`={arithmetic.sft_steps} warms up the synthetic model only: set it to 0 "
        "to train `model.path` on the arithmetic task"
      )
    if arithmetic is not None and self.eval.dataset is not None:
      raise ValueError(
        f"`eval.dataset`={self.eval.dataset!r}: the arithmetic task brings its own held-out set "
        "(`data.arithmetic.eval_size`); leave `eval.dataset` unset"
      )
    if self.step.group_size is not None and self.step.group_size != self.rollout.group_size:
      raise ValueError(
        f"`step.group_size`={self.step.group_size} must equal `rollout.group_size`={self.rollout.group_size} "
        "or be unset (the trainer passes G to the step)"
      )
    if self.rollout.merge_lora and self.lora is None:
      raise ValueError("`rollout.merge_lora` is true but there is no `lora` section: there are no adapters to merge")
    if self.lora is not None and self.lora.dropout > 0 and self.step.packing is not None:
      raise ValueError(
        f"`lora.dropout`={self.lora.dropout} with `step.packing`={self.step.packing}: adapter dropout is not "
        "supported with packing (its masks are drawn per unpacked row); set `lora.dropout: 0` or unset `step.packing`"
      )
    if self.rollout.max_staleness and self.objective.importance_correction is None:
      warnings.warn(
        f"`rollout.max_staleness`={self.rollout.max_staleness} without `objective.importance_correction`: stale "
        "groups are trained as if sampled by the current policy (no π_old/μ reweighting); set "
        "`objective.importance_correction: tis` (or mis) to correct them",
        UserWarning,
        stacklevel=3,
      )
    roll = self.rollout
    if roll.engine == "vllm" and self.step.temperature != 1.0 and (roll.top_k or roll.top_p < 1.0):
      raise ValueError(
        f"`rollout.engine: vllm` with `step.temperature`={self.step.temperature} != 1 cannot report full-vocabulary "
        f"log-probs after top-k/top-p filtering (rollout.top_k={roll.top_k}, rollout.top_p={roll.top_p}): use "
        'temperature 1 or no filtering (docs/sampling.md, "Engines")'
      )
    if self.env is not None and (
      self.rollout.max_staleness
      or self.objective.dynamic_sampling
      or self.devices.rollout
      or self.rollout.engine != "jax"
    ):
      raise ValueError(
        "`env` (multi-turn rollouts) does not combine with `rollout.max_staleness`, `objective.dynamic_sampling`, "
        "`devices.rollout` or `rollout.engine: vllm` yet; unset them"
      )
    if self.rollout.group_size == 1:
      warnings.warn(
        "`rollout.group_size` is 1: every group-relative advantage is 0, so the policy gradient is 0",
        UserWarning,
        stacklevel=3,
      )

  def train_config(self) -> TrainConfig:
    """The step's :class:`~jaxgrpo.train.TrainConfig` with ``group_size`` = G (``rollout.group_size``)."""
    return dataclasses.replace(self.step, group_size=self.rollout.group_size)

  def to_dict(self) -> dict:
    """The nested, JSON-serialisable form; ``config_from_dict(cfg.to_dict()) == cfg``."""
    return _plain(self)


def _plain(x):
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
  if isinstance(x, Mapping):
    return {k: _plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  return x


# ----------------------------------------------------------------------------- types


def _type_name(hint) -> str:
  if hint is type(None):
    return "null"
  if isinstance(hint, type):
    return hint.__name__
  return str(hint).replace("typing.", "").replace("collections.abc.", "")


def _type_error(path: str, hint, value) -> TypeError:
  return TypeError(f"config field `{path}`: expected {_type_name(hint)}; got {value!r} ({type(value).__name__})")


def _join(path: str, key) -> str:
  return f"{path}.{key}" if path else str(key)


def _convert(value, hint, path: str):
  """``value`` checked against the annotation ``hint``; mappings become dataclasses, lists tuples and
  ints floats where the annotation says so. Raises TypeError naming ``path``."""
  if hint is Any:
    return value
  origin = typing.get_origin(hint)
  if origin in (types.UnionType, typing.Union):
    args = typing.get_args(hint)
    if value is None:
      if type(None) in args:
        return None
      raise _type_error(path, hint, value)
    specs = [a for a in args if dataclasses.is_dataclass(a)]
    if isinstance(value, Mapping) and len(specs) == 1:  # a section: its own field errors, not the union's
      return _convert(value, specs[0], path)
    for arg in args:
      if arg is type(None):
        continue
      try:
        return _convert(value, arg, path)
      except TypeError:
        continue
    raise _type_error(path, hint, value)
  if hint is bool:
    if isinstance(value, bool):
      return value
    raise _type_error(path, hint, value)
  if hint is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    raise _type_error(path, hint, value)
  if hint is float:
    if isinstance(value, str) and value.strip().lower() in _NONFINITE:  # YAML reads `inf`, `nan` as strings
      value = _NONFINITE[value.strip().lower()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      if not math.isfinite(value):
        raise ValueError(f"config field `{path}`: expected a finite number; got {value}")
      return float(value)
    raise _type_error(path, hint, value)
  if hint is str:
    if isinstance(value, str):
      return value
    raise _type_error(path, hint, value)
  if origin is typing.Literal:
    if value in typing.get_args(hint):
      return value
    raise _type_error(path, hint, value)
  if origin in (tuple, Sequence):
    (item, *_) = typing.get_args(hint) or (Any,)
    if isinstance(value, (list, tuple)):
      return tuple(_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    raise _type_error(path, hint, value)
  if origin in (Mapping, dict, typing.Mapping):
    key_hint, value_hint = typing.get_args(hint)
    if isinstance(value, Mapping):
      return {_convert(k, key_hint, path): _convert(v, value_hint, _join(path, k)) for k, v in value.items()}
    raise _type_error(path, hint, value)
  if dataclasses.is_dataclass(hint):
    if isinstance(value, hint):
      _check_fields(value, path)
      return value
    if isinstance(value, Mapping):
      return _build(hint, value, path)
    raise _type_error(path, hint, value)
  if isinstance(hint, type):
    if isinstance(value, hint):
      return value
    raise _type_error(path, hint, value)
  return value  # e.g. a Callable field of a library config: not written in YAML; its class checks it


def _check_fields(spec, path: str) -> None:
  """Type-checks every field of a constructed spec (recursively); TypeError naming the field."""
  hints = typing.get_type_hints(type(spec))
  for f in dataclasses.fields(spec):
    _convert(getattr(spec, f.name), hints[f.name], _join(path, f.name))


def _build(cls, d: Mapping[str, Any], path: str):
  if cls is GRPOConfig and "preset" in d:
    return _build_preset(d, path)
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls) if f.init]
  unknown = sorted(str(k) for k in set(d) - set(names))
  if unknown:
    extra = " (or `preset`)" if cls is GRPOConfig else ""
    raise ValueError(f"unknown key(s) {unknown} in `{path or 'config'}`; valid keys: {names}{extra}")
  kwargs = {k: _convert(v, hints[k], _join(path, k)) for k, v in d.items()}
  if cls is TrainerConfig:
    return cls(**kwargs)  # its messages name whole paths already
  try:
    return cls(**kwargs)
  except ValueError as e:
    raise ValueError(f"in `{path}`: {e}") from None


def _build_preset(d: Mapping[str, Any], path: str) -> GRPOConfig:
  """``objective: {preset: NAME, <GRPOConfig field>: value, ...}`` → ``preset(NAME, **fields)``."""
  rest = {k: v for k, v in d.items() if k != "preset"}
  name = _convert(d["preset"], str, _join(path, "preset"))
  if "name" in rest:
    raise ValueError(f"`{path}`: give `preset` (a preset and overrides) or `name` (a custom config), not both")
  hints = typing.get_type_hints(GRPOConfig)
  unknown = sorted(set(rest) - set(hints))
  if unknown:
    raise ValueError(f"unknown key(s) {unknown} in `{path}`; valid keys: preset, {sorted(hints)}")
  try:
    return preset(name, **{k: _convert(v, hints[k], _join(path, k)) for k, v in rest.items()})
  except ValueError as e:
    raise ValueError(f"in `{path}`: {e}") from None


# ----------------------------------------------------------------------------- keys


SECTIONS = tuple(f.name for f in dataclasses.fields(TrainerConfig))
# sections that may be null (absent): `lora`
_OPTIONAL_SECTIONS = tuple(
  name for name, hint in typing.get_type_hints(TrainerConfig).items() if type(None) in typing.get_args(hint)
)


def field_type(path: str):
  """The annotation of the config field at dotted ``path`` (``"rollout.group_size"`` → ``int``).

  ``objective.preset`` is a string; a path that continues into a mapping field
  (``reward.weights.format``) names one of its entries. Raises ValueError for an unknown path,
  listing the valid keys at the point where it goes wrong.
  """
  cls, walked = TrainerConfig, ""
  parts = path.split(".")
  for i, part in enumerate(parts):
    if cls is GRPOConfig and part == "preset" and i == len(parts) - 1:
      return str
    hints = typing.get_type_hints(cls)
    if part not in hints:
      valid = sorted(hints) + (["preset"] if cls is GRPOConfig else [])
      raise ValueError(f"unknown config key `{path}`: `{walked or 'config'}` has no `{part}`; valid keys: {valid}")
    hint, walked = hints[part], _join(walked, part)
    if i == len(parts) - 1:
      return hint
    union = typing.get_origin(hint) in (types.UnionType, typing.Union)
    inner = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
    spec = [a for a in inner if dataclasses.is_dataclass(a)]
    maps = [a for a in inner if typing.get_origin(a) in (Mapping, dict, typing.Mapping)]
    if spec:
      cls = spec[0]
    elif maps and i == len(parts) - 2:
      return typing.get_args(maps[0])[1]
    else:
      raise ValueError(f"unknown config key `{path}`: `{walked}` is a value, not a section")
  raise AssertionError("unreachable")


def _leaf_paths(cls=None, prefix: str = "") -> list[str]:
  """Every dotted field path of the config (``rollout.group_size``, ``model.synthetic.num_layers``, ...)."""
  cls = TrainerConfig if cls is None else cls
  out = []
  for name, hint in typing.get_type_hints(cls).items():
    path = _join(prefix, name)
    union = typing.get_origin(hint) in (types.UnionType, typing.Union)
    inner = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
    sub = [a for a in inner if dataclasses.is_dataclass(a)]
    out += _leaf_paths(sub[0], path) if sub else [path]
  if cls is GRPOConfig:
    out.append(_join(prefix, "preset"))
  return out


#: the papers' symbols and abbreviations in key names → the words of the field names (error hints only)
_WORDS = {"epsilon": "clip_eps", "mu": "num_iterations", "lr": "learning_rate"}


def _unknown_key(key: str) -> ValueError:
  """The error for a key that is neither a section nor a dotted path, naming the dotted key(s) it most
  likely means: a field of that name (``group_size`` → ``rollout.group_size``), a section prefix
  (``eval_every`` → ``eval.every``), a field name it begins (``demo_sft_batch`` → ``...sft_batch_size``),
  the papers' symbols spelled out (``mu`` → ``objective.num_iterations``), else the closest spellings."""
  paths = _leaf_paths()
  leaf: dict[str, list[str]] = {}
  for path in paths:
    leaf.setdefault(path.rsplit(".", 1)[-1], []).append(path)

  def matches(name: str) -> list[str]:
    found = list(leaf.get(name, []))
    found += [f"{sec}.{name.removeprefix(sec + '_')}" for sec in SECTIONS if name.startswith(sec + "_")]
    found += [p for w in leaf if w.startswith(name + "_") for p in leaf[w]]
    return [p for p in found if p in paths]

  spelled = "_".join(_WORDS.get(w, w) for w in key.split("_"))
  close = []
  for name in (key, spelled, spelled.partition("_")[2]):
    close = close or (matches(name) if name else [])
  if not close:
    words = difflib.get_close_matches(key, list(leaf), n=3, cutoff=0.7)
    close = [p for w in words for p in leaf[w]] + difflib.get_close_matches(key, paths + list(SECTIONS), n=2)
  close = list(dict.fromkeys(close))[:4]
  if key == "resume":
    hint = " (resuming is a command-line choice: scripts/train.py --resume / --no-resume)"
  else:
    hint = f" (did you mean {' or '.join(f'`{c}`' for c in close)}?)" if close else ""
  return ValueError(
    f"unknown config key `{key}`{hint}: use a section ({', '.join(SECTIONS)}) or a dotted key such as "
    "`rollout.group_size`"
  )


def _check_key(key: str) -> str:
  """``key`` if it is a section or a dotted field path, else ValueError naming the likely dotted key."""
  if key in SECTIONS:
    return key
  if "." in key:
    field_type(key)
    return key
  raise _unknown_key(key)


#: ``{token: float}``: the spellings of NaN and ±inf read as floats on the command line (plain YAML
#: reads ``nan``/``inf`` as strings), so that the field check refuses them as non-finite numbers
_NONFINITE = {t: float(t.replace(".", "")) for t in ("nan", ".nan", "inf", ".inf", "infinity")}
_NONFINITE.update({sign + t: float(sign + t.replace(".", "")) for t in ("inf", ".inf", "infinity") for sign in "+-"})


def parse_override(key: str, text: str):
  """A command-line value for the dotted ``key``: the raw text for string fields (``null``: None),
  YAML otherwise (``1e-4`` → float, ``[1, 4]`` → list, ``{accuracy: 1.0}`` → dict; ``nan``, ``inf``,
  ``-inf`` → floats, refused later as non-finite)."""
  path = _check_key(key)
  hint = field_type(path) if path not in SECTIONS else dict
  args = set(typing.get_args(hint)) or {hint}
  if args <= {str, type(None)}:
    return None if text in ("null", "~") and type(None) in args else text
  if float in args and text.strip().lower() in _NONFINITE:
    return _NONFINITE[text.strip().lower()]
  value = parse_value(text)
  if path in SECTIONS and not isinstance(value, Mapping) and not (value is None and path in _OPTIONAL_SECTIONS):
    raise ValueError(
      f"--{path} sets a whole section: give a mapping such as '{{field: value}}' or a dotted key such as "
      f"--{path}.<field>; got {text!r}"
    )
  return value


def _assign(nested: dict, path: str, value) -> None:
  parts = path.split(".")
  node = nested
  for i, part in enumerate(parts[:-1]):
    child = node.get(part)
    if child is None:
      child = node[part] = {}
    elif not isinstance(child, dict):
      raise ValueError(f"cannot set `{path}`: `{'.'.join(parts[: i + 1])}` is {child!r}, not a section")
    node = child
  node[parts[-1]] = value


def _nest(d: Mapping[str, Any], where: str) -> dict:
  """A copy of a config mapping, checked to be sections (``model: {...}``, ``lora: null``)."""
  if not isinstance(d, Mapping):
    raise TypeError(f"{where}: a config must be a mapping of sections; got {type(d).__name__}")
  out: dict = {}
  for key, value in d.items():
    if not isinstance(key, str):
      raise TypeError(f"{where}: config keys must be strings; got {key!r}")
    if key not in SECTIONS:
      raise ValueError(f"{where}: {_unknown_key(key)}")
    if isinstance(value, Mapping):
      out[key] = copy.deepcopy(dict(value))
    elif key in _OPTIONAL_SECTIONS and value is None:  # e.g. `lora: null`: no adapters
      out[key] = None
    else:
      raise TypeError(f"{where}: config section `{key}` must be a mapping of fields; got {value!r}")
  return out


#: sections whose default is one of two exclusive sources, ``{section: (default source, sources)}``:
#: an override into such a section that the file does not give starts from the default source
_DEFAULT_SOURCE = {"model": ("synthetic", ("path", "synthetic")), "data": ("arithmetic", ("dataset", "arithmetic"))}


def _with_default_sources(nested: dict, overrides: Mapping[str, Any]) -> dict:
  """``nested`` with the default source (``model.synthetic``, ``data.arithmetic``) added to each section
  that neither the file nor the overrides give a source for, but that an override sets a field of:
  ``--data.max_prompt_tokens 64`` alone keeps the arithmetic task, ``--model.dtype bfloat16`` the
  synthetic model, as they would be without the override."""
  for section, (default, sources) in _DEFAULT_SOURCE.items():
    if section in nested:
      continue
    touched = [k for k in overrides if k == section or k.startswith(section + ".")]
    given = any(k == section or k.split(".")[1] in sources for k in touched)
    if touched and not given:
      nested[section] = {default: {}}
  return nested


# ----------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
  """YAML 1.1 with the YAML 1.2 float rule: ``1e-4`` and ``3E5`` are floats, not strings."""


_Loader.add_implicit_resolver(
  "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def parse_value(text: str):
  """A command-line value parsed as YAML (``1e-4`` → float, ``null`` → None, ``[1, 4]`` → list)."""
  try:
    return yaml.load(text, Loader=_Loader)
  except yaml.YAMLError as e:
    raise ValueError(f"cannot parse {text!r} as a YAML value: {e}") from None


def read_yaml(path: str) -> dict:
  """The mapping in a YAML file; a file that is not valid YAML or not a mapping gives one ValueError
  naming the file and the position."""
  try:
    with open(path) as f:
      d = yaml.load(f, Loader=_Loader)
  except OSError as e:
    raise ValueError(f"cannot read config file {path}: {e.strerror}") from None
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e)
    raise ValueError(f"config file {path} is not valid YAML{at}: {problem}") from None
  if d is None:
    return {}
  if not isinstance(d, dict):
    raise ValueError(f"config file {path} must hold a mapping of sections; got {type(d).__name__}")
  return d


def config_from_dict(d: Mapping[str, Any], *, where: str = "config") -> TrainerConfig:
  """A :class:`TrainerConfig` from its nested dict form (YAML, ``to_dict()``). Unknown keys are errors
  naming the valid ones (for a key of the earlier flat config: its dotted form)."""
  return _build(TrainerConfig, _nest(d, where), "")


def load_config(path: str | None, overrides: Mapping[str, Any] | None = None) -> TrainerConfig:
  """A YAML file (None: the defaults) with ``overrides`` on top: ``{dotted key or section: value}``,
  e.g. ``{"rollout.group_size": 8, "model.synthetic.hidden_size": 32, "objective.beta": 0.04}``.

  A section the file does not give keeps its default; an override of a field of the default model
  or data set keeps that source (``{"data.max_prompt_tokens": 64}`` alone: the arithmetic task with
  64 prompt tokens).

  Raises:
    ValueError: unreadable or malformed file (named), unknown keys, invalid or non-finite values.
    TypeError: a value of the wrong type (the field, the expected type and the value named).
  """
  where = f"config file {path}" if path else "config"
  overrides = {_check_key(k): v for k, v in (overrides or {}).items()}
  nested = _with_default_sources(_nest(read_yaml(path) if path else {}, where), overrides)
  for key, value in overrides.items():
    _assign(nested, key, copy.deepcopy(value))
  return _build(TrainerConfig, nested, "")
