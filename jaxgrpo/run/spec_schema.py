"""The schema of a training run: nested, frozen, keyword-only specs and their validation.

A :class:`TrainerConfig` is a few sections, each a frozen dataclass; two of them are the library's
own configs, embedded as they are::

    model       ModelSpec        an HF directory, or the arithmetic task's synthetic model; dtypes
    lora        LoRAConfig       LoRA/QLoRA adapters (``jaxgrpo.models.lora``); absent: full fine-tuning
    data        DataSpec         the prompt set (a dataset, or the synthetic arithmetic task)
    objective   GRPOConfig       the algorithm (``jaxgrpo.kernels.config``): a preset plus overrides
    rollout     RolloutSpec      G, prompts per step, T, top-p/top-k, dynamic-sampling rounds
    step        TrainConfig      the jitted step (``jaxgrpo.step.train``): micro/mini-batches, clipping,
                                 chunking, packing, and the sampling temperature the log-probs refer to
    optim       OptimSpec        AdamW and its warm-up
    reward      RewardSpec       reward functions and weights, verifier time limit, error policy
    eval        EvalSpec         held-out set, k samples, pass@k, cadence
    checkpoint  CheckpointSpec   cadence and retention
    run         RunSpec          steps, seed, output directory, logging, HF export
    devices     DevicesSpec      mesh and multi-host start-up
    env         EnvSpec          multi-turn environment and its bounds (``jaxgrpo.rollout.environments``); absent:
                                 single-turn completions scored by ``reward``

Every field's type is checked on construction (``jaxgrpo.run._spec_fields``: TypeError naming the
field, the expected type and the value), then each section's values (ValueError naming
``section.field``), then the constraints between sections. Reading YAML and dotted overrides is
``jaxgrpo.run.specs``, which re-exports every name here. Which combinations of sections a run refuses is
``jaxgrpo.run.composition``.

One job at ~620 lines: the sections of one config and their checks; each section is short, and splitting them
across modules would scatter the one schema a user reads.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Literal

import jax.numpy as jnp

from jaxgrpo import _checks
from jaxgrpo.data import INSTRUCTION
from jaxgrpo.kernels.config import GRPOConfig, preset
from jaxgrpo.models import RematPolicy
from jaxgrpo.models.attention import IMPLEMENTATIONS
from jaxgrpo.models.lora import LoRAConfig
from jaxgrpo.rollout.engines import registry as _engine_registry
from jaxgrpo.rollout.engines.base import load_engine_factory
from jaxgrpo.rollout.environments.spec import EnvSpec
from jaxgrpo.rollout.speculative import SpeculativeConfig
from jaxgrpo.run._spec_fields import check_fields
from jaxgrpo.run.composition import check_composition
from jaxgrpo.run.task_specs import ArithmeticTask, SyntheticModel
from jaxgrpo.step.train import TrainConfig

__all__ = [
  "check_composition",
  "DTYPES",
  "REWARD_FUNCTIONS",
  "REWARD_SOURCE_KINDS",
  "RewardSourceSpec",
  "ENGINES",
  "ModelSpec",
  "DataSpec",
  "RolloutSpec",
  "VLLMSpec",
  "PartialSpec",
  "OptimSpec",
  "RewardSpec",
  "EvalSpec",
  "CheckpointSpec",
  "RunSpec",
  "DevicesSpec",
  "TrainerConfig",
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
      (:class:`jaxgrpo.run.task_specs.SyntheticModel`), randomly initialised from ``run.seed``.
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
      values. A MoE model only when every layer is sparse. Default false (docs/models.md, "Layers as a scan": measured).
    attention: the attention implementation (``jaxgrpo.models.attention.IMPLEMENTATIONS``): ``auto`` (dense
      below 512 tokens a row, the platform's kernel from there: memory linear in the length), ``dense``,
      ``blockwise``, ``splash`` (TPU only), ``cudnn`` (GPU only) (docs/models.md, "Attention implementations").
  """

  path: str | None = None
  synthetic: SyntheticModel | None = None
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: Literal["none", "full", "dots", "dots_no_batch"] | bool = "none"
  scan_layers: bool = False
  attention: str = "auto"

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
    if self.attention not in IMPLEMENTATIONS:
      raise ValueError(f"`model.attention` must be one of {', '.join(IMPLEMENTATIONS)}; got {self.attention!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSpec:
  """The training prompts: exactly one of ``dataset`` and ``arithmetic``.

  Attributes:
    dataset: hub id or local file/directory (see ``jaxgrpo.data.load_math_dataset``).
    dataset_config: the hub configuration name (e.g. ``main`` for ``openai/gsm8k``).
    split: dataset split.
    mapping: column mapping: None (detect), a built-in name (``openrs``, ``dapo``, ``gsm8k``,
      ``math500``) or ``{prompt: <column>, answer: <column>}``.
    arithmetic: the synthetic task "What is a + b?" (:class:`jaxgrpo.run.task_specs.ArithmeticTask`),
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


#: the engines ``rollout.engine`` names (``jaxgrpo.rollout.engines.registry``); else "package.module:callable"
ENGINES = tuple(_engine_registry.ENGINES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VLLMSpec:
  """The vLLM engine of ``rollout.engine: vllm`` (``jaxgrpo.rollout.engines.vllm.VLLMEngine``; docs/sampling.md,
  "Engines").

  Attributes:
    dtype: vLLM's weight and compute dtype: ``float32``, ``bfloat16`` or ``float16``.
    kv_cache_bytes: the KV cache, in bytes (CPU; vLLM's ``kv_cache_memory_bytes``).
    gpu_memory_utilization: vLLM's share of the GPU's memory, in (0, 1] (GPU only; leave the rest to XLA:
      ``XLA_PYTHON_CLIENT_MEM_FRACTION`` + this < 1).
    max_num_seqs: the most sequences vLLM decodes at once.
    enforce_eager: no torch.compile / CUDA graphs (faster start-up, slower decoding on a GPU).
    lora_sync: a LoRA run pushes only the adapters (vLLM's LoRA support; the base weights once) instead of the
      merged weights. Off by default: on the CPU build vLLM's LoRA decoding is 1.7-3.3x slower than decoding
      merged weights, more than the cheaper push saves (BENCHMARKS.md, "LoRA into vLLM").
  """

  dtype: str = "float32"
  kv_cache_bytes: int = 256 * 2**20
  gpu_memory_utilization: float = 0.3
  max_num_seqs: int = 256
  enforce_eager: bool = True
  lora_sync: bool = False

  def __post_init__(self):
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"`rollout.vllm.dtype` must be float32, bfloat16 or float16; got {self.dtype!r}")
    _ints("rollout.vllm", self, ("kv_cache_bytes", "max_num_seqs"))
    _float("rollout.vllm", self, "gpu_memory_utilization", above=0.0, at_most=1.0)
    _checks.check_python_bool(self.enforce_eager, "rollout.vllm.enforce_eager")
    _checks.check_python_bool(self.lora_sync, "rollout.vllm.lora_sync")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartialSpec:
  """Partial rollouts (``jaxgrpo.loop.partial.schedule``; docs/trainer.md, "Partial rollouts"): rows still
  decoding when a batch is complete stay in flight across the weight update and continue under the new version;
  every token keeps the version and log-prob it was sampled with, and the staleness bound applies per token.

  Attributes:
    enabled: on (needs ``rollout.max_staleness`` >= 1).
    slots: rows in flight at once, per process (None: a step's ``prompts_per_step`` x ``group_size`` rows, divided
      by the number of processes).
    refill: a slot freed by an ended row takes the next row at the next boundary (slot refill); false: new rows
      enter only when every slot is free.
    refill_every: decode steps between boundaries (where rows enter and the host reads the slots).
    ahead: batches produced ahead of the learner, in [0, max_staleness - 1] (None: max_staleness - 1), so a
      row can cross max_staleness - ahead versions before it is dropped.
  """

  enabled: bool = False
  slots: int | None = None
  refill: bool = True
  refill_every: int = 8
  ahead: int | None = None

  def __post_init__(self):
    _checks.check_python_bool(self.enabled, "rollout.partial.enabled")
    _checks.check_python_bool(self.refill, "rollout.partial.refill")
    _ints("rollout.partial", self, ("refill_every",))
    if self.slots is not None:
      _ints("rollout.partial", self, ("slots",))
    if self.ahead is not None:
      _ints("rollout.partial", self, ("ahead",), minimum=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSpec:
  """Sampling the groups of one step (the temperature is ``step.temperature``: the train step's
  log-probs refer to it, so it is one value for both).

  Attributes:
    group_size: G, completions per prompt.
    prompts_per_step: prompts (groups) per step.
    max_new_tokens: T, the longest completion.
    ignore_eos: sample every completion to ``max_new_tokens`` tokens, EOS included as an ordinary token
      (a run at a fixed length: benchmarks, the long-completion demo); default False: a completion ends at EOS.
    top_p, top_k: nucleus and top-k sampling (1.0 and 0: off).
    dynamic_sampling_max_rounds: with ``objective.dynamic_sampling`` (DAPO), the most sampling
      rounds per step before the batch is filled with zero-advantage groups (partial rollouts: runs of the row
      pool to ``prompts_per_step`` complete groups).
    merge_lora: with a ``lora`` section, sample (and evaluate) from ``models.lora.merge_lora`` of
      the policy — no adapter matmuls per token, but a merged copy of the adapted weights while
      sampling — instead of the adapted model (default; see docs/models.md, "Sampling").
    max_staleness: k, the most updates the parameters that sampled a group may lag behind the ones
      it is trained from. 0: the synchronous loop; >= 1: a producer samples the next batches while
      the learner updates (``jaxgrpo.loop.async_rollout``; docs/trainer.md, "Asynchronous rollouts").
    engine: what generates the rollouts: ``jax`` (the built-in jitted sampler, default), ``vllm``
      (vLLM in this process, the policy's weights pushed after every update; its log-probs become the
      batch's ``behavior_logp`` and the trainer recomputes ``old_logp``), or ``package.module:callable``, a
      factory of a ``jaxgrpo.rollout.engines.Engine`` (imported and checked callable when the config loads; called
      with ``config``, ``max_model_len``, ``temperature``, ``seed``; docs/sampling.md, "Engines").
    vllm: the vLLM engine's settings (read with ``engine: vllm``).
    partial: partial rollouts (:class:`PartialSpec`; off by default).
    routing_replay: a mixture-of-experts policy only (``jaxgrpo.models.moe``): ``rollout`` (default)
      records each token's experts while sampling and the train step and the reference pass reuse
      them (routing replay); ``none``: every forward routes by its own top-k. Ignored by a dense model.
    speculative: speculative decoding in the built-in sampler (``jaxgrpo.rollout.speculative``; exact: the same
      distribution and log-probs): ``off`` (default), ``ngram`` (prompt-lookup drafts, always), ``draft`` (the
      draft model of ``speculative_draft``, always) or ``auto`` (plain and speculative decoding — the draft model
      when ``speculative_draft`` is set, else ngram — each timed on the first calls, the faster kept; the
      measurement logged). docs/sampling.md, "Speculative decoding".
    speculative_tokens: k, tokens drafted per verify step; speculative_ngram: n, the suffix length looked up.
    speculative_draft: the draft model's directory (a HF causal LM of the policy's tokenizer; its vocabulary size
      checked against the policy's before its weights are read), for ``draft`` and ``auto``.
    quantize: ``none`` (default), ``int8`` or ``fp8``: the built-in sampler draws from weight-only quantised
      copies of the policy's projections (per output channel, made at every push, LoRA merged first;
      ``SamplingConfig.quantize``); its log-probs are then μ's, so the learner recomputes ``old_logp`` and
      ``objective.importance_correction`` (tis/mis) corrects the gap (metric ``engine/mismatch_k3``). ``fp8`` needs
      a GPU/TPU. ``engine: jax`` only; single-turn, partial and multi-turn (``env``) rollouts (docs/sampling.md,
      "Quantized rollout weights").
  """

  group_size: int = 6
  prompts_per_step: int = 4
  max_new_tokens: int = 1024
  ignore_eos: bool = False
  top_p: float = 1.0
  top_k: int = 0
  dynamic_sampling_max_rounds: int = 4
  merge_lora: bool = False
  max_staleness: int = 0
  engine: str = "jax"
  vllm: VLLMSpec = dataclasses.field(default_factory=VLLMSpec)
  partial: PartialSpec = dataclasses.field(default_factory=PartialSpec)
  routing_replay: Literal["rollout", "none"] = "rollout"
  speculative: Literal["off", "ngram", "draft", "auto"] = "off"
  speculative_tokens: int = 4
  speculative_ngram: int = 2
  speculative_draft: str | None = None
  quantize: Literal["none", "int8", "fp8"] = "none"

  def __post_init__(self):
    if not isinstance(self.engine, str):
      raise ValueError(f"`rollout.engine` must be 'jax', 'vllm' or 'package.module:callable'; got {self.engine!r}")
    if self.engine not in ENGINES:  # a user's engine factory: importable and callable, checked now
      load_engine_factory(self.engine)
    _ints("rollout", self, ("group_size", "prompts_per_step", "max_new_tokens", "dynamic_sampling_max_rounds"))
    _ints("rollout", self, ("top_k", "max_staleness"), minimum=0)
    _float("rollout", self, "top_p", above=0.0, at_most=1.0)
    _checks.check_python_bool(self.merge_lora, "rollout.merge_lora")
    _checks.check_python_bool(self.ignore_eos, "rollout.ignore_eos")
    if self.routing_replay not in ("rollout", "none"):
      raise ValueError(f"`rollout.routing_replay` must be 'rollout' or 'none'; got {self.routing_replay!r}")
    if self.quantize not in ("none", "int8", "fp8"):
      raise ValueError(f"`rollout.quantize` must be 'none', 'int8' or 'fp8'; got {self.quantize!r}")
    if self.quantize != "none" and self.engine != "jax":
      raise ValueError(
        f"`rollout.quantize`={self.quantize!r} quantises the built-in sampler's weights; `rollout.engine` is "
        f"{self.engine!r} (it loads its own weights): use `engine: jax` or `quantize: none`"
      )
    self.speculative_config()  # one line for a bad mode, k or n

  def speculative_config(self) -> SpeculativeConfig | None:
    """The :class:`~jaxgrpo.rollout.speculative.SpeculativeConfig` of ``speculative`` (None: ``off``)."""
    spec = SpeculativeConfig(
      mode=self.speculative, num_draft=self.speculative_tokens, ngram=self.speculative_ngram,
      draft=self.speculative_draft,
    )  # fmt: skip
    return None if spec.mode == "off" else spec


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


REWARD_SOURCE_KINDS = ("reward_model", "judge", "remote")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSourceSpec:
  """One learned or remote reward of ``reward.sources`` (``jaxgrpo.rewards``; docs/rewards.md).

  Attributes:
    name: its name in the metrics (``reward/<name>``, ``reward_counters/<name>/...``); not ``accuracy``/``format``.
    kind: ``reward_model`` (``path``: a ``*ForSequenceClassification`` folder), ``judge`` (``path``: the judge's
      causal-LM folder, run by the built-in engine) or ``remote`` (``url``).
    weight: its weight in the sum.
    path, url: where it is (see ``kind``).
    dtype: ``float32`` or ``bfloat16`` (reward model, judge).
    batch_size: rows per reward-model call or per request.
    template, rubric: the judge's prompt (None: ``jaxgrpo.rewards.judge`` defaults).
    reference_column: the column filling the judge template's ``{reference}``.
    max_new_tokens: the judge's reply budget.
    timeout_s, retries, max_concurrency, deadline_s: the remote client's limits.
  """

  name: str
  kind: str
  weight: float = 1.0
  path: str | None = None
  url: str | None = None
  dtype: str = "float32"
  batch_size: int = 8
  template: str | None = None
  rubric: str | None = None
  reference_column: str | None = None
  max_new_tokens: int = 64
  timeout_s: float = 30.0
  retries: int = 2
  max_concurrency: int = 4
  deadline_s: float = 120.0

  def __post_init__(self):
    where = f"reward.sources[{self.name!r}]"
    if not self.name or self.name in REWARD_FUNCTIONS:
      raise ValueError(f"`{where}.name` must be a non-empty name other than {REWARD_FUNCTIONS}; got {self.name!r}")
    _checks.check_choice(self.kind, REWARD_SOURCE_KINDS, f"{where}.kind")
    _checks.check_choice(self.dtype, ("float32", "bfloat16"), f"{where}.dtype")
    _checks.check_python_float(self.weight, f"{where}.weight")
    need = "url" if self.kind == "remote" else "path"
    if not getattr(self, need):
      raise ValueError(f"`{where}.{need}` is required for kind {self.kind!r}")
    for name in ("batch_size", "max_new_tokens", "max_concurrency"):
      _checks.check_python_int(getattr(self, name), f"{where}.{name}", minimum=1)
    _checks.check_python_int(self.retries, f"{where}.retries", minimum=0)
    for name in ("timeout_s", "deadline_s"):
      _checks.check_python_float(getattr(self, name), f"{where}.{name}", above=0.0, hint="seconds")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSpec:
  """The reward: a weighted sum of named functions.

  Attributes:
    weights: ``{name: weight}`` over ``accuracy`` (``jaxgrpo.rewards.reward_set.MathAccuracy``: the boxed
      answer is right) and ``format`` (``jaxgrpo.rewards.reward_set.format_reward``: a boxed answer is present).
    timeout_s: per-sample verifier time limit in a worker process (None: no worker process).
    on_error: ``raise`` (stop, showing the sample) or ``zero`` (score 0 and count it).
    sources: learned and remote rewards added to the sum (:class:`RewardSourceSpec`: reward models, judges,
      reward services); their unscored rows are missing samples (NaN, counted), whatever ``on_error`` says.
  """

  weights: Mapping[str, float] = dataclasses.field(default_factory=lambda: {"accuracy": 1.0})
  timeout_s: float | None = 10.0
  on_error: str = "raise"
  sources: tuple[RewardSourceSpec, ...] = ()

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
    names = [s.name for s in self.sources]
    if len(set(names)) != len(names):
      raise ValueError(f"`reward.sources` names must be distinct; got {names}")


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
  """Checkpoints in ``OUT/checkpoints`` (``jaxgrpo.services.checkpoint``); whether to resume is a command-line
  choice (``scripts/train.py --resume/--no-resume``), not part of the run.

  Attributes:
    every: save every ``every`` steps (0: only after the last step).
    keep: keep the last ``keep`` checkpoints.
    best_metric: also keep the best checkpoint by this evaluation metric (None: recency only). A run with
      an ``env`` section logs its held-out metric as ``eval_env_reward`` (the mean environment reward, not an
      accuracy): there ``eval_accuracy`` (the default) stands for it.
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
    max_zero_advantage_steps: stop (``jaxgrpo.run.collapse.NoLearningSignal``, exit 1) after this many consecutive
      steps in which every advantage was 0 or no reward was finite: nothing is learned from such a step (a reward
      that never varies within a group, every reward NaN). 0: never stop.
    imports: Python modules imported before the rest of the config is read (``["my_pkg.losses"]``): a module that
      registers a surrogate (``register_surrogate``), a model family (``register_family``) or an engine makes its
      name usable in ``objective.loss``, the model's ``config.json`` or ``rollout.engine``. Importable from the
      Python path (installed, or on ``PYTHONPATH``); recorded in ``config.json``, so a resume imports them again.
  """

  steps: int = 100
  seed: int = 0
  out: str = "runs/train"
  log_every: int = 1
  save_model: bool = False
  max_zero_advantage_steps: int = 20
  imports: tuple[str, ...] = ()

  def __post_init__(self):
    _ints("run", self, ("steps", "seed", "max_zero_advantage_steps"), minimum=0)
    _ints("run", self, ("log_every",))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DevicesSpec:
  """Devices and hosts.

  Attributes:
    mesh: ``"data=2,fsdp=2,tensor=2"`` (``""``: every device on fsdp; see ``jaxgrpo.parallel.sharding``).
    distributed: call ``jaxgrpo.parallel.distributed.initialize`` first (multi-host runs).
    coordinator_address, num_processes, process_id: its arguments (None: from the environment).
    host_timeout_s: several processes: a process that sent no heartbeat for this many seconds
      counts as dead and the others stop, naming it (``jaxgrpo.parallel.distributed.HostWatchdog``); JAX's own
      heartbeat timeout is set to twice this value.
    rollout: disaggregated placement: sample on a mesh of this many devices of their own (the last
      ones) and train on the others (``mesh``); None: colocated, one mesh time-shared.
    train: with ``rollout``: the devices of the training mesh (the first ones; None: all the
      rollout mesh leaves).
    rollout_mesh: the rollout mesh's axes (like ``mesh``; ``""``: every rollout device on fsdp).
    teacher: a distillation teacher (``objective.distill``) on a mesh of this many devices of its own (the last
      ones of each process; the train and rollout meshes divide the others): its parameters, its log-prob pass
      and its top-k stay there, and only the per-token log-probs (and top-k) move to the train mesh; None: the
      teacher sits on the train mesh beside the policy.
    teacher_mesh: the teacher mesh's axes (like ``mesh``; ``""``: every teacher device on fsdp).
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
  teacher: int | None = None
  teacher_mesh: str = ""

  def __post_init__(self):
    _float("devices", self, "host_timeout_s", at_least=1.0, hint="seconds")
    _ints("devices", self, tuple(f for f in ("rollout", "train", "teacher") if getattr(self, f) is not None))
    if self.train is not None and self.rollout is None:
      raise ValueError(f"`devices.train`={self.train} needs `devices.rollout` (disaggregated placement)")
    if self.teacher_mesh and self.teacher is None:
      raise ValueError(
        f"`devices.teacher_mesh`={self.teacher_mesh!r} needs `devices.teacher` (the teacher's device count); "
        "without it the teacher shares the train mesh"
      )


def _check_best_metric(name: str | None, ev: EvalSpec, env: bool) -> None:
  """``checkpoint.best_metric`` must be a metric the held-out evaluation logs (a mistyped one would never be seen,
  silently turning keep-best off): ``eval_accuracy`` and ``eval_pass@k`` (k of ``eval.pass_k``); with ``env``,
  ``eval_env_reward`` and ``eval_env/<name>`` (the environment's own metrics are known only when it runs)."""
  if name is None:
    return
  known = ["eval_env_reward", "eval_env/<metric>"] if env else ["eval_accuracy", *(f"eval_pass@{k}" for k in ev.pass_k)]
  if not isinstance(name, str) or not (name in known or (env and name.startswith("eval_env/") and len(name) > 9)):
    raise ValueError(
      f"`checkpoint.best_metric`={name!r} is not a metric the evaluation logs, so no checkpoint would be kept as "
      f"the best: use one of {known} (null: keep the last `checkpoint.keep` only)"
    )


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
    check_fields(self, "")
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
    if self.rollout.quantize != "none" and self.objective.importance_correction is None:
      warnings.warn(
        f"`rollout.quantize`={self.rollout.quantize!r} without `objective.importance_correction`: the groups are "
        "sampled by the quantised policy μ but trained as if by the learner's π (no π_old/μ reweighting; the gap is "
        "logged as engine/mismatch_k3); set `objective.importance_correction: tis` (or mis) to correct it",
        UserWarning,
        stacklevel=3,
      )
    if self.rollout.max_staleness and self.objective.importance_correction is None:
      warnings.warn(
        f"`rollout.max_staleness`={self.rollout.max_staleness} without `objective.importance_correction`: stale "
        "groups are trained as if sampled by the current policy (no π_old/μ reweighting); set "
        "`objective.importance_correction: tis` (or mis) to correct them",
        UserWarning,
        stacklevel=3,
      )
    check_composition(self)
    if self.env is not None and self.env.episodes is not None:
      given = [f"{k}={v!r}" for k, v in (("data.dataset", self.data.dataset), ("eval.dataset", self.eval.dataset)) if v]
      if given:
        raise ValueError(
          f"`env.episodes`={self.env.episodes} makes the prompts (the environment's reset builds them from seeds) "
          f"but {', '.join(given)} names a dataset too: unset it, or unset `env.episodes` to train on the dataset"
        )
    if self.env is not None and self.checkpoint.best_metric == "eval_accuracy":  # the env run's held-out metric
      object.__setattr__(self, "checkpoint", dataclasses.replace(self.checkpoint, best_metric="eval_env_reward"))
    _check_best_metric(self.checkpoint.best_metric, self.eval, self.env is not None)
    _check_can_learn(self)

  def train_config(self) -> TrainConfig:
    """The step's :class:`~jaxgrpo.step.train.TrainConfig` with ``group_size`` = G (``rollout.group_size``)."""
    return dataclasses.replace(self.step, group_size=self.rollout.group_size)

  def to_dict(self) -> dict:
    """The nested, JSON-serialisable form; ``config_from_dict(cfg.to_dict()) == cfg``."""
    return _plain(self)


def _check_can_learn(cfg: TrainerConfig) -> None:
  """ValueError when no step of the run could learn: a group of one (every advantage is relative to its group's
  rewards, so it is 0), or a weight of 0 on every reward of a single-turn run (every reward is 0)."""
  if cfg.rollout.group_size == 1:
    raise ValueError(
      "`rollout.group_size` is 1: every advantage is relative to its group (r - the group's mean reward), so a "
      "group of one has advantage 0 and nothing is learned; set `rollout.group_size` >= 2 (the demo uses 8)"
    )
  weights = [*cfg.reward.weights.values(), *(s.weight for s in cfg.reward.sources)]
  distills = cfg.objective.distill is not None and cfg.objective.distill.weight > 0  # the teacher's signal
  if cfg.env is None and not any(weights) and not distills:
    raise ValueError(
      f"`reward.weights`={dict(cfg.reward.weights)}: every reward has weight 0"
      + (" (`reward.sources` too)" if cfg.reward.sources else "")
      + ", so every reward is 0, every advantage is 0 and nothing is learned; give a reward a non-zero weight, "
      "e.g. `--reward.weights '{accuracy: 1.0}'`"
    )


def _plain(x):
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
  if isinstance(x, Mapping):
    return {k: _plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  return x
