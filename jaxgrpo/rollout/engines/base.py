"""The inference-engine interface: what the trainer asks of whatever generates its rollouts.

An engine holds a copy (or a view) of the policy's weights and samples groups of completions from it::

    engine.push_weights(policy)                   # after every optimizer update: the engine's weights := policy's
    gen = engine.generate(prompt_tokens, prompt_mask, num_samples=G, max_new_tokens=T,
                          temperature=1.0, top_p=1.0, top_k=0, eos_ids=(eos,), pad_id=pad, key=key)
    gen.rollout.completions / .mask / .log_probs  # int32[N, T], bool[N, T], f32[N, T]; N = B·G
    gen.finish_reasons                            # str[N]: "stop" (an EOS id was sampled) or "length"
    engine.release_memory(); ...; engine.reacquire_memory()   # around the update, on one accelerator
    engine.close()                                # at the end: frees what the engine holds (idempotent)

The keyword arguments of :meth:`Engine.generate` are those of :func:`jaxgrpo.rollout.sampling.generate` (and of
``jaxgrpo.rollout.sampling.SamplingConfig``), so the built-in sampler and an external engine are drop-in
replacements. ``Generation.rollout`` has the layout of :class:`jaxgrpo.rollout.sampling.Rollout` (row ``b·G + g`` is
sample g of prompt b, completions right-padded with ``pad_id``, prompts left-padded as given); its
``log_probs`` are the **engine's own** log-probs of the sampled tokens, ``log_softmax(logits / temperature)``
over the full vocabulary (temperature 0: temperature 1), i.e. the behaviour policy μ of
``jaxgrpo.kernels.importance``. For the built-in sampler they equal the trainer's recomputation up to float32
rounding; for another engine (other kernels, another dtype) they differ, and the trainer recomputes the
rollout policy's log-probs itself and passes the engine's as ``Batch.behavior_logp`` (TIS/MIS correction).
An engine says which with the optional class attribute ``logprobs_are_policy`` (:func:`logprobs_are_policy`:
True only for an engine that declares it; an engine without the attribute gets its log-probs recomputed,
which is exact for every engine, at the cost of one forward pass).

Implementations: :class:`jaxgrpo.rollout.engines.builtin.BuiltinEngine` (the default: the jitted sampler, in
process, no copy of the weights) and :class:`jaxgrpo.rollout.engines.vllm.VLLMEngine` (vLLM, colocated in
process, weights pushed through the Hugging Face name map).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence, runtime_checkable

import jax
import numpy as np

from jaxgrpo import _checks
from jaxgrpo.rollout.sampling import Rollout

__all__ = [
  "Engine",
  "Generation",
  "FINISH_REASONS",
  "check_engine",
  "finish_reasons",
  "load_engine_factory",
  "logprobs_are_policy",
]

#: The values of ``Generation.finish_reasons``.
FINISH_REASONS = ("stop", "length")


class Generation(NamedTuple):
  """What :meth:`Engine.generate` returns.

  Attributes:
    rollout: a :class:`jaxgrpo.rollout.sampling.Rollout` of N = B·G rows (NumPy or JAX arrays); ``log_probs`` are
      the engine's log-probs of the sampled tokens (0 on padding).
    finish_reasons: ``str[N]`` NumPy array: ``"stop"`` when the row ended with one of ``eos_ids``,
      ``"length"`` when it used the whole ``max_new_tokens`` budget without one.
  """

  rollout: Rollout
  finish_reasons: np.ndarray


@runtime_checkable
class Engine(Protocol):
  """An inference engine (see the module docstring). ``name`` identifies it in metrics and errors."""

  name: str

  def generate(
    self,
    prompt_tokens,
    prompt_mask,
    *,
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_ids: Sequence[int] = (),
    pad_id: int,
    suppress_ids: Sequence[int] | None = None,
    key: jax.Array,
  ) -> Generation:
    """G = ``num_samples`` completions of each of the B left-padded prompts ``int32[B, P]`` /
    ``bool[B, P]``, drawn with the given settings (those of :func:`jaxgrpo.rollout.sampling.generate`); the same
    ``key`` and weights give the same rollout."""
    ...

  def push_weights(self, model) -> None:
    """Make the engine sample from ``model`` (a ``jaxgrpo.models`` decoder, LoRA adapters allowed) from
    the next :meth:`generate` on; any cached state computed with the old weights is dropped."""
    ...

  def release_memory(self) -> None:
    """Free what the engine holds on the accelerator (KV cache, its weight copy) until
    :meth:`reacquire_memory`; :meth:`generate` must not be called in between."""
    ...

  def reacquire_memory(self) -> None:
    """Undo :meth:`release_memory` (the weights are pushed again afterwards)."""
    ...

  def close(self) -> None:
    """Free everything the engine holds (processes, memory, files); nothing is called on it afterwards."""
    ...


def logprobs_are_policy(engine) -> bool:
  """Whether ``engine``'s ``Generation.rollout.log_probs`` are the policy's own (the train step's recomputation
  up to float32 rounding), so they can serve as ``old_logp``: the engine's ``logprobs_are_policy`` attribute,
  False when it has none (then the caller recomputes ``old_logp`` with the policy and keeps the engine's as
  ``behavior_logp``: ``jaxgrpo.rollout.collect.engine_old_logp``)."""
  return getattr(engine, "logprobs_are_policy", False) is True


def check_engine(engine, what: str = "engine") -> None:
  """TypeError naming ``what`` unless ``engine`` has the :class:`Engine` interface (the missing members)."""
  if not isinstance(engine, Engine):
    members = ("name", "generate", "push_weights", "release_memory", "reacquire_memory", "close")
    missing = [m for m in members if not hasattr(engine, m)]
    raise TypeError(
      f"{what} must implement jaxgrpo.rollout.engines.Engine; got {type(engine).__name__} (missing: {', '.join(missing)})"
    )


def load_engine_factory(path: str, what: str = "rollout.engine"):
  """The callable named by ``"package.module:callable"`` (imported); ValueError naming ``what`` and ``path``
  when the string has another form, the module does not import or the name is missing or not callable."""
  return _checks.load_callable(path, what, "'jax', 'vllm' or 'package.module:callable'")


def finish_reasons(completions: np.ndarray, mask: np.ndarray, eos_ids: Sequence[int]) -> np.ndarray:
  """``str[N]`` finish reasons of right-padded completions: ``"stop"`` where the last real token of the row
  is one of ``eos_ids``, else ``"length"``.

  Args:
    completions: ``int32[N, T]``; mask: ``bool[N, T]`` (True on a prefix of each row); eos_ids: ints.
  """
  completions, mask = np.asarray(completions), np.asarray(mask, bool)
  lengths = mask.sum(axis=1)
  last = completions[np.arange(len(completions)), np.maximum(lengths - 1, 0)]
  stopped = (lengths > 0) & np.isin(last, np.asarray(list(eos_ids), np.int64))
  return np.where(stopped, FINISH_REASONS[0], FINISH_REASONS[1])
