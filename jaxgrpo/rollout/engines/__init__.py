"""Inference engines behind one interface (:class:`~jaxgrpo.rollout.engines.base.Engine`): the built-in jitted
sampler (:class:`~jaxgrpo.rollout.engines.builtin.BuiltinEngine`, the default) and vLLM
(:class:`~jaxgrpo.rollout.engines.vllm.VLLMEngine`; the ``vllm`` package is imported on use: it needs the ``vllm``
extra). A run builds one by name (:mod:`jaxgrpo.rollout.engines.registry`) and drives it by its class's
capabilities, never its name (:mod:`jaxgrpo.rollout.engines.driver`). See docs/sampling.md, "Engines"."""

from jaxgrpo.rollout.engines.base import (
  FINISH_REASONS,
  GENERATE_SIGNATURE,
  Engine,
  Generation,
  check_engine,
  check_generation,
  finish_reasons,
  load_engine_factory,
  logprobs_are_policy,
)
from jaxgrpo.rollout.engines.builtin import BuiltinEngine

__all__ = [
  "BuiltinEngine",
  "Engine",
  "FINISH_REASONS",
  "GENERATE_SIGNATURE",
  "Generation",
  "check_engine",
  "check_generation",
  "finish_reasons",
  "load_engine_factory",
  "logprobs_are_policy",
]
