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

YAML mirrors it (``scripts/configs/*.yaml``)::

    model: {path: Qwen/Qwen3-1.7B-Base, dtype: bfloat16}
    lora: {rank: 64, alpha: 128, dropout: 0.05}  # optional: train adapters only (quantize: nf4 = QLoRA)
    data: {dataset: BytedTsinghua-SIA/DAPO-Math-17k, mapping: dapo}
    objective: {preset: frpo, beta: 0.01}       # a preset name plus GRPOConfig fields
    rollout: {group_size: 5, prompts_per_step: 256, max_new_tokens: 8192}
    step: {mini_batches: 4, micro_batches: 8, temperature: 1.0}
    optim: {learning_rate: 1.0e-6}

:func:`load_config` reads a file, applies ``overrides`` (dotted keys, ``{"rollout.group_size": 8}``),
and checks every field's type — naming the field, the expected type and the value — before anything
is built. Numbers such as ``1e-4`` are floats (YAML 1.1 would read them as strings). The flat keys of
the earlier single-class config (``group_size``, ``beta``, ``demo_layers``, ...) are still read,
through :data:`FLAT_KEYS`, with a ``FutureWarning`` naming their nested form; ``model``/``dataset``
as plain strings and ``resume`` are errors that say what to write instead.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax.numpy as jnp
import yaml

from jaxgrpo.config import GRPOConfig, preset
from jaxgrpo.data import INSTRUCTION
from jaxgrpo.models import RematPolicy
from jaxgrpo.models.lora import LoRAConfig
from jaxgrpo.tasks.arithmetic import ArithmeticTask, SyntheticModel
from jaxgrpo.train import TrainConfig

__all__ = [
  "DTYPES",
  "REWARD_FUNCTIONS",
  "FLAT_KEYS",
  "ModelSpec",
  "DataSpec",
  "RolloutSpec",
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
  "translate_keys",
]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REWARD_FUNCTIONS = ("accuracy", "format")


def _positive(section: str, spec, names: tuple[str, ...], minimum: int = 1) -> None:
  for name in names:
    v = getattr(spec, name)
    if not isinstance(v, int) or isinstance(v, bool):
      raise TypeError(f"`{section}.{name}` must be an int >= {minimum}; got {v!r} ({type(v).__name__})")
    if v < minimum:
      raise ValueError(f"`{section}.{name}` must be an int >= {minimum}; got {v!r}")


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
  """

  path: str | None = None
  synthetic: SyntheticModel | None = None
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: Literal["none", "full", "dots", "dots_no_batch"] | bool = "none"

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
    _positive("data", self, ("max_prompt_tokens",))


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
  routing_replay: Literal["rollout", "none"] = "rollout"

  def __post_init__(self):
    _positive("rollout", self, ("group_size", "prompts_per_step", "max_new_tokens", "dynamic_sampling_max_rounds"))
    _positive("rollout", self, ("top_k",), minimum=0)
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"`rollout.top_p` must be in (0, 1]; got {self.top_p}")


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
    if not self.learning_rate > 0:
      raise ValueError(f"`optim.learning_rate` must be > 0; got {self.learning_rate}")
    if self.weight_decay < 0:
      raise ValueError(f"`optim.weight_decay` must be >= 0; got {self.weight_decay}")
    for name in ("adam_b1", "adam_b2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"`optim.{name}` must be in [0, 1); got {getattr(self, name)}")
    _positive("optim", self, ("warmup_steps",), minimum=0)


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
    if self.timeout_s is not None and not self.timeout_s > 0:
      raise ValueError(f"`reward.timeout_s` must be > 0 or None; got {self.timeout_s}")


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
    _positive("eval", self, ("samples", "batch_prompts"))
    _positive("eval", self, ("every",), minimum=0)
    if self.limit is not None:
      _positive("eval", self, ("limit",))
    bad = [k for k in self.pass_k if not isinstance(k, int) or not 1 <= k <= self.samples]
    if bad:
      raise ValueError(f"`eval.pass_k` entries must be ints in [1, eval.samples={self.samples}]; got {bad}")
    if self.temperature is not None and self.temperature < 0:
      raise ValueError(f"`eval.temperature` must be >= 0 or None; got {self.temperature}")


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
    _positive("checkpoint", self, ("every",), minimum=0)
    _positive("checkpoint", self, ("keep",))


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
    _positive("run", self, ("steps", "seed"), minimum=0)
    _positive("run", self, ("log_every",))


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
  """

  mesh: str = ""
  distributed: bool = False
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  host_timeout_s: float = 90.0

  def __post_init__(self):
    if not self.host_timeout_s >= 1:
      raise ValueError(f"`devices.host_timeout_s` must be >= 1 (seconds); got {self.host_timeout_s!r}")


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
    if isinstance(value, (int, float)) and not isinstance(value, bool):
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

#: The flat keys of the earlier single-class ``TrainerConfig`` → their nested paths (read with a
#: ``FutureWarning``; the command line accepts them silently as short forms).
FLAT_KEYS: dict[str, tuple[str, ...]] = {
  "dtype": ("model.dtype",),
  "param_dtype": ("model.param_dtype",),
  "split": ("data.split",),
  "dataset_config": ("data.dataset_config",),
  "mapping": ("data.mapping",),
  "max_prompt_tokens": ("data.max_prompt_tokens",),
  "instruction": ("data.instruction",),
  "eval_dataset": ("eval.dataset",),
  "eval_dataset_config": ("eval.dataset_config",),
  "eval_mapping": ("eval.mapping",),
  "eval_split": ("eval.split",),
  "eval_limit": ("eval.limit",),
  "eval_every": ("eval.every",),
  "eval_samples": ("eval.samples",),
  "eval_pass_k": ("eval.pass_k",),
  "eval_temperature": ("eval.temperature",),
  "eval_batch_prompts": ("eval.batch_prompts",),
  "preset": ("objective.preset",),
  "beta": ("objective.beta",),
  "epsilon": ("objective.clip_eps_low", "objective.clip_eps_high"),
  "epsilon_high": ("objective.clip_eps_high",),
  "mu": ("objective.num_iterations",),
  "dynamic_sampling": ("objective.dynamic_sampling",),
  "group_size": ("rollout.group_size",),
  "prompts_per_step": ("rollout.prompts_per_step",),
  "max_new_tokens": ("rollout.max_new_tokens",),
  "top_p": ("rollout.top_p",),
  "top_k": ("rollout.top_k",),
  "dynamic_sampling_max_rounds": ("rollout.dynamic_sampling_max_rounds",),
  "temperature": ("step.temperature",),
  "max_grad_norm": ("step.max_grad_norm",),
  "micro_batches": ("step.micro_batches",),
  "mini_batches": ("step.mini_batches",),
  "chunk_size": ("step.chunk_size",),
  "learning_rate": ("optim.learning_rate",),
  "weight_decay": ("optim.weight_decay",),
  "adam_b1": ("optim.adam_b1",),
  "adam_b2": ("optim.adam_b2",),
  "warmup_steps": ("optim.warmup_steps",),
  "rewards": ("reward.weights",),
  "reward_timeout_s": ("reward.timeout_s",),
  "reward_on_error": ("reward.on_error",),
  "checkpoint_every": ("checkpoint.every",),
  "steps": ("run.steps",),
  "seed": ("run.seed",),
  "out": ("run.out",),
  "log_every": ("run.log_every",),
  "save_model": ("run.save_model",),
  "mesh": ("devices.mesh",),
  "distributed": ("devices.distributed",),
  "coordinator_address": ("devices.coordinator_address",),
  "num_processes": ("devices.num_processes",),
  "process_id": ("devices.process_id",),
  "demo_hidden_size": ("model.synthetic.hidden_size",),
  "demo_layers": ("model.synthetic.num_layers",),
  "demo_max_operand": ("data.arithmetic.max_operand",),
  "demo_train_size": ("data.arithmetic.train_size",),
  "demo_eval_size": ("data.arithmetic.eval_size",),
  "demo_sft_steps": ("data.arithmetic.sft_steps",),
  "demo_sft_lr": ("data.arithmetic.sft_learning_rate",),
  "demo_sft_batch": ("data.arithmetic.sft_batch_size",),
  "demo_sft_noise": ("data.arithmetic.sft_noise",),
}
# flat keys whose None meant "the preset's value": a None is dropped
_NONE_IS_PRESET = ("beta", "epsilon", "epsilon_high", "mu", "dynamic_sampling")
# flat keys with no one-to-one nested form: what to write instead
_REMOVED = {
  "model": "write `model: {path: <HF directory or hub id>}`, or `model: {synthetic: {hidden_size: 64, "
  "num_layers: 2}}` for the arithmetic task's tiny model (command line: --model.path DIR)",
  "dataset": "write `data: {dataset: <hub id or file>}`, or `data: {arithmetic: {train_size: 4000, "
  "eval_size: 128}}` for the synthetic arithmetic task (command line: --data.dataset SET)",
  "resume": "resuming is a command-line choice: scripts/train.py --resume / --no-resume (default: resume "
  "when OUT/checkpoints holds a checkpoint)",
}


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


def _paths(key: str) -> tuple[str, ...]:
  """The dotted paths a key sets (checked): itself, or its :data:`FLAT_KEYS` entry."""
  if key in SECTIONS:
    return (key,)
  if "." in key:
    field_type(key)
    return (key,)
  if key in _REMOVED:
    raise ValueError(f"config key `{key}` is gone: {_REMOVED[key]}")
  if key not in FLAT_KEYS:
    close = difflib.get_close_matches(key, list(FLAT_KEYS) + list(SECTIONS), n=3)
    raise ValueError(
      f"unknown config key `{key}`"
      + (f" (did you mean {', '.join(f'`{c}`' for c in close)}?)" if close else "")
      + f": use a section ({', '.join(SECTIONS)}) or a dotted key such as `rollout.group_size`"
    )
  return FLAT_KEYS[key]


def translate_keys(items) -> list[tuple[str, str, Any]]:
  """``(key, dotted path, value)`` for each ``(key, value)`` of ``items``: dotted keys and sections as
  they are, flat keys through :data:`FLAT_KEYS`. As in the flat config, ``epsilon`` sets ε_low and ε_high
  but ``epsilon_high`` wins for ε_high, and a None ``beta``/``epsilon``/``epsilon_high``/``mu``/
  ``dynamic_sampling`` means the preset's value (sets nothing)."""
  items = list(items)
  keys = {k for k, _ in items}
  out = []
  for key, value in items:
    if key in _REMOVED and key in SECTIONS and not isinstance(value, Mapping):
      raise ValueError(f"config key `{key}: {value!r}` is the old flat form: {_REMOVED[key]}")
    paths = _paths(key)
    if value is None and key in _NONE_IS_PRESET:
      continue
    if key == "epsilon" and "epsilon_high" in keys:
      paths = ("objective.clip_eps_low",)
    out += [(key, path, value) for path in paths]
  return out


def parse_override(key: str, text: str):
  """A command-line value for ``key``: the raw text for string fields (``null``: None), YAML otherwise
  (``1e-4`` → float, ``[1, 4]`` → list, ``{accuracy: 1.0}`` → dict)."""
  path = _paths(key)[0]
  hint = field_type(path) if path not in SECTIONS else dict
  args = set(typing.get_args(hint)) or {hint}
  if args <= {str, type(None)}:
    value = None if text in ("null", "~") and type(None) in args else text
  else:
    value = parse_value(text)
  translate_keys([(key, value)])  # the old flat `model`/`dataset` forms are errors here already
  return value


def _lookup(nested: Mapping, path: str):
  node = nested
  for part in path.split("."):
    if not isinstance(node, Mapping) or part not in node:
      return dataclasses.MISSING
    node = node[part]
  return node


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
  """A config mapping in nested form: sections kept, flat keys moved to their paths (one warning)."""
  if not isinstance(d, Mapping):
    raise TypeError(f"{where}: a config must be a mapping of sections; got {type(d).__name__}")
  out: dict = {}
  flat = []
  for key, value in d.items():
    if not isinstance(key, str):
      raise TypeError(f"{where}: config keys must be strings; got {key!r}")
    if key in SECTIONS and isinstance(value, Mapping):
      out[key] = copy.deepcopy(dict(value))
    elif key in _OPTIONAL_SECTIONS and value is None:  # e.g. `lora: null`: no adapters
      out[key] = None
    elif key in SECTIONS and key not in _REMOVED:
      raise TypeError(f"{where}: config section `{key}` must be a mapping of fields; got {value!r}")
    else:
      flat.append((key, value))
  given = copy.deepcopy(out)
  moved: dict[str, list[str]] = {k: [] for k, _ in flat}
  for key, path, v in translate_keys(flat):
    if _lookup(given, path) is not dataclasses.MISSING:
      raise ValueError(f"{where}: both `{key}` and `{path}` are given; keep `{path}`")
    _assign(out, path, v)
    moved[key].append(path)
  moved = [f"{k} → {', '.join(p) or '(the preset value)'}" for k, p in moved.items() if k in FLAT_KEYS]
  if moved:
    warnings.warn(
      f"{where}: old flat config keys, read as: {'; '.join(moved)}. Write the nested form (docs/trainer.md).",
      FutureWarning,
      stacklevel=3,
    )
  return out


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
  """A :class:`TrainerConfig` from its nested dict form (YAML, ``to_dict()``); flat keys are read
  through :data:`FLAT_KEYS` with a ``FutureWarning``. Unknown keys are errors listing the valid ones."""
  return _build(TrainerConfig, _nest(d, where), "")


def load_config(path: str | None, overrides: Mapping[str, Any] | None = None) -> TrainerConfig:
  """A YAML file (None: the defaults) with ``overrides`` on top: ``{dotted or flat key: value}``,
  e.g. ``{"rollout.group_size": 8, "model.synthetic.hidden_size": 32, "beta": 0.04}``.

  Raises:
    ValueError: unreadable or malformed file (named), unknown keys, invalid values.
    TypeError: a value of the wrong type (the field, the expected type and the value named).
  """
  where = f"config file {path}" if path else "config"
  nested = _nest(read_yaml(path) if path else {}, where)
  for _, path, value in translate_keys((overrides or {}).items()):
    _assign(nested, path, copy.deepcopy(value))
  return _build(TrainerConfig, nested, "")
