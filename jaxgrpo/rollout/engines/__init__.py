"""Inference engines behind one interface (:class:`~jaxgrpo.rollout.engines.base.Engine`): the built-in jitted
sampler (:class:`~jaxgrpo.rollout.engines.builtin.BuiltinEngine`, the default) and vLLM
(:class:`~jaxgrpo.rollout.engines.vllm.VLLMEngine`, imported on use: it needs the ``vllm`` extra). See
docs/sampling.md, "Engines"."""

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
