"""The engines a run can name (``rollout.engine``): name → how to build it, and what its class can do.

::

    ENGINES = {"jax": BuiltinEngine, "vllm": VLLMEngine (the vllm package itself imported on use)}
    engine_class(name)          the engine class a name (or a user's "package.module:callable") builds, for the
                                questions a run asks before it builds one (capabilities: its class attributes)
    capability(name, attr)      one such answer, e.g. capability("vllm", "routing_replay_refusal")
    check_installed(name)       ImportError with the install hint when the engine's package is missing
    build_engine(name, model, max_model_len=..., temperature=..., seed=..., options=..., lora_rank=...)

A user's engine is ``"package.module:callable"`` (:func:`~jaxgrpo.rollout.engines.base.load_engine_factory`):
called with the keywords ``config`` (the policy's model config), ``max_model_len``, ``temperature`` and ``seed``;
its class's capabilities are known before it is built when the callable is the class or is annotated with it
(otherwise every capability has its default). Adding an engine is one entry of :data:`ENGINES`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxgrpo.rollout.engines import vllm
from jaxgrpo.rollout.engines.base import check_engine, factory_engine_class, load_engine_factory
from jaxgrpo.rollout.engines.builtin import BuiltinEngine
from jaxgrpo.rollout.speculative import load_draft

__all__ = ["ENGINES", "EngineEntry", "build_engine", "capability", "check_installed", "engine_class"]


@dataclasses.dataclass(frozen=True)
class EngineEntry:
  """One named engine.

  Attributes:
    load: ``() -> the engine class`` (imports its module).
    build: ``(model, *, max_model_len, temperature, seed, options, lora_rank) -> engine``: ``model`` the policy
      (a ``jaxgrpo.models`` decoder), ``options`` the engine's own section of the run config (``rollout.vllm``;
      None when it has none), ``lora_rank`` the policy's LoRA rank (None without adapters).
    check_installed: raises ImportError (with the install hint) when the engine cannot be imported.
  """

  load: Callable[[], type]
  build: Callable[..., Any]
  check_installed: Callable[[], None] = lambda: None


def _build_builtin(model, *, options=None, **_):
  """The built-in sampler: nothing to start (the rollout source pushes the policy before every call); ``options``:
  its ``SpeculativeConfig`` (``rollout.speculative``; its draft model loaded once its vocabulary is checked) or
  None."""
  draft = None if options is None or options.draft is None else load_draft(options.draft, model.config.vocab_size)
  return BuiltinEngine(speculative=options, draft_model=draft)


def _build_vllm(model, *, max_model_len, temperature, seed, options, lora_rank, **_):
  """vLLM with the ``rollout.vllm`` settings; a LoRA policy synced as adapters when ``options.lora_sync``."""
  return vllm.VLLMEngine(
    model.config,
    dtype=options.dtype,
    kv_cache_bytes=options.kv_cache_bytes,
    gpu_memory_utilization=options.gpu_memory_utilization,
    max_num_seqs=options.max_num_seqs,
    enforce_eager=options.enforce_eager,
    logprobs_temperature=temperature,
    lora_rank=lora_rank if options.lora_sync else None,
    max_model_len=max_model_len,
    seed=seed,
  )


#: name → :class:`EngineEntry` (``rollout.engine``).
ENGINES: dict[str, EngineEntry] = {
  "jax": EngineEntry(load=lambda: BuiltinEngine, build=_build_builtin),
  "vllm": EngineEntry(load=lambda: vllm.VLLMEngine, build=_build_vllm, check_installed=vllm.check_installed),
}


def engine_class(name: str) -> type | None:
  """The class of the engine ``name`` builds (a name of :data:`ENGINES`, or a user's ``"package.module:callable"``:
  the callable when it is a class, else its return annotation); None when not known before it is built."""
  entry = ENGINES.get(name)
  if entry is not None:
    return entry.load()
  return factory_engine_class(load_engine_factory(name))


def capability(name: str, attr: str, default: Any = False) -> Any:
  """The class attribute ``attr`` of the engine ``name`` builds (:func:`engine_class`); ``default`` when it has
  none or its class is unknown."""
  return getattr(engine_class(name), attr, default)


def check_installed(name: str) -> None:
  """ImportError with the install hint when the engine ``name`` cannot be imported (a named engine's check; a
  user's factory was imported when the config loaded)."""
  entry = ENGINES.get(name)
  if entry is not None:
    entry.check_installed()


def build_engine(
  name: str,
  model,
  *,
  max_model_len: int | None,
  temperature: float,
  seed: int,
  options: Any = None,
  lora_rank: int | None = None,
):
  """The engine ``name`` (an :data:`ENGINES` name or a user's ``"package.module:callable"``) for ``model``.

  Raises:
    ValueError: a user's factory that raised (one line naming ``rollout.engine``; its exception the cause).
    TypeError: what the factory returned lacks the ``Engine`` interface (``check_engine``).
  """
  entry = ENGINES.get(name)
  if entry is not None:
    return entry.build(
      model, max_model_len=max_model_len, temperature=temperature, seed=seed, options=options, lora_rank=lora_rank
    )
  factory = load_engine_factory(name)
  try:
    engine = factory(config=model.config, temperature=temperature, max_model_len=max_model_len, seed=seed)
  except Exception as e:  # the user's factory: one line naming it (its traceback is the cause)
    raise ValueError(f"`rollout.engine: {name}`: the factory raised {type(e).__name__}: {e}") from e
  check_engine(engine, f"the object `rollout.engine: {name}` returned")
  return engine
