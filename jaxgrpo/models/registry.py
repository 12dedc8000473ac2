"""The model-family registry: what the library chooses by a config's family, declared once per family.

A family is one :class:`Family` record: its config class (``model_type``, ``from_hf`` / ``to_hf``), its model
class, its Hugging Face name map, the modules whose projections carry LoRA adapters, and what the layers above
support for it (the vLLM engine, sequence-classifier reward models, routed experts). ``build_model``,
``config_from_hf``, ``hf_entries`` / ``load_hf`` / ``save_hf``, the LoRA sites and PEFT files, the vLLM engine
and the reward model ask :func:`family_of` or :func:`config_class`; nothing else branches on a config's class.

The built-in families (GPT-2, Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE) are the entries of
``jaxgrpo.models.families``. A new family is one module (its config, model and name map) and one
:func:`register_family` call, touching no file of the library (docs/models.md, "Adding a model family").
This module imports nothing of ``jaxgrpo.models``, so every module of the folder can ask it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["Family", "config_class", "family_of", "register_family", "registered", "unregister_family"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
  """One model family.

  Attributes:
    config: the config class: a frozen dataclass with the class attribute ``model_type`` (the ``model_type`` of
      its HF ``config.json``), ``from_hf(dict)`` (a classmethod) and ``to_hf() -> dict`` (whose ``architectures``
      names the transformers class), and the common fields ``vocab_size``, ``hidden_size``, ``num_layers``,
      ``num_heads``, ``num_kv_heads``, ``head_dim``, ``max_position_embeddings``, ``tie_word_embeddings``.
      A subclass of a registered config that is not registered itself belongs to its nearest registered base.
    model: the ``CausalLM`` class, called as ``model(cfg, *, rngs, dtype, param_dtype, remat, rules,
      scan_layers)`` (``build_model``'s arguments); it refuses what it cannot build (e.g. ``scan_layers``).
    hf_names: ``cfg -> list`` of ``jaxgrpo.models.hf.Entry`` / ``StackedEntry``: one per parameter of
      ``model(cfg)``, its HF tensor name, shape and layout conversions (``load_hf``, ``save_hf``, PEFT files,
      the vLLM weight push).
    lora_modules: the module classes whose projections can carry LoRA adapters; each lists them in
      ``PROJECTIONS`` (name -> number of contracted dims) and holds ``<name>_lora`` beside each weight.
    hf_conv1d: the HF checkpoint stores the adapted projections as ``Conv1D`` ``[in, out]`` (GPT-2): PEFT's
      ``fan_in_fan_out`` in a saved adapter config.
    vllm: the vLLM engine serves it (vLLM picks its implementation by ``to_hf()["architectures"]``).
    reward_model: ``*ForSequenceClassification`` checkpoints of it load as ``jaxgrpo.rewards.RewardModel``
      (a dense decoder whose ``hidden`` the score head reads).
    experts: a mixture of experts (routed ``num_experts`` / ``moe_intermediate_size`` fields): the vLLM engine
      checks its expert sizes on CPU.
  """

  config: type
  model: Callable[..., Any]
  hf_names: Callable[[Any], list]
  lora_modules: tuple[type, ...]
  hf_conv1d: bool = False
  vllm: bool = False
  reward_model: bool = False
  experts: bool = False

  @property
  def model_type(self) -> str:
    """The ``model_type`` of the family's HF ``config.json``."""
    return self.config.model_type


_REGISTRY: dict[type, Family] = {}  # config class -> its family, in registration order


def _check_family(family: Family) -> None:
  """One line naming the field and the fix when ``family`` cannot be registered."""
  if not isinstance(family, Family):
    raise TypeError(f"register_family takes a jaxgrpo.models.Family; got {type(family).__name__}")
  cfg = family.config
  if not isinstance(cfg, type):
    raise TypeError(f"Family.config must be a config class; got {cfg!r:.80}")
  missing = [a for a in ("from_hf", "to_hf") if not callable(getattr(cfg, a, None))]
  if not isinstance(getattr(cfg, "model_type", None), str):
    missing.insert(0, "model_type (a str)")
  if missing:
    raise TypeError(
      f"Family.config={cfg.__name__} lacks {missing}: a config class needs the class attribute model_type and "
      "the methods from_hf / to_hf"
    )
  for name in ("model", "hf_names"):
    if not callable(getattr(family, name)):
      raise TypeError(f"Family.{name} must be callable; got {getattr(family, name)!r:.80}")
  bad = [m for m in family.lora_modules if not isinstance(getattr(m, "PROJECTIONS", None), dict)]
  if not isinstance(family.lora_modules, tuple) or bad:
    raise TypeError(
      f"Family.lora_modules must be a tuple of module classes with a PROJECTIONS dict; got {family.lora_modules!r}"
    )
  other = next((c for c in _REGISTRY if c.model_type == cfg.model_type and c is not cfg), None)
  if other is not None:
    raise ValueError(
      f"model_type={cfg.model_type!r} of {cfg.__name__} is already the family of {other.__name__}; "
      "give the new config class its own model_type"
    )


def register_family(family: Family) -> Family:
  """Add ``family`` to the registry (replacing the entry of the same config class); returns it.

  Raises:
    TypeError: a field of the wrong kind (named).
    ValueError: its ``model_type`` already belongs to another config class.
  """
  _check_family(family)
  _REGISTRY[family.config] = family
  return family


def unregister_family(config: type) -> None:
  """Remove the family of the config class ``config`` (a test's or a plugin's); KeyError when none."""
  del _REGISTRY[config]


def registered() -> tuple[Family, ...]:
  """Every registered family, in registration order."""
  return tuple(_REGISTRY.values())


def family_of(config) -> Family:
  """The family of a config instance (or class): its class's entry, else its nearest registered base's.

  Raises:
    TypeError: ``config`` is not a config of a registered family (naming the registered classes).
  """
  cls = config if isinstance(config, type) else type(config)
  for klass in cls.__mro__:
    if klass in _REGISTRY:
      return _REGISTRY[klass]
  raise TypeError(
    f"cfg must be a model config of a registered family ({', '.join(c.__name__ for c in _REGISTRY)}; "
    f"jaxgrpo.models.register_family adds one); got {cls.__name__}"
  )


def config_class(model_type) -> type:
  """The config class registered for a HF ``model_type``.

  Raises:
    ValueError: no family has it (naming the supported ones).
  """
  for cls in _REGISTRY:
    if cls.model_type == model_type:
      return cls
  raise ValueError(f"Unsupported model_type={model_type!r}; supported: {sorted(c.model_type for c in _REGISTRY)}")
