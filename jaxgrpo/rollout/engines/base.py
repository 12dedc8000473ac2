"""The inference-engine interface: what the trainer asks of whatever generates its rollouts.

An engine holds a copy (or a view) of the policy's weights and samples groups of completions from it::

    engine.push_weights(policy)                   # after every optimizer update: the engine's weights := policy's
    sampling = SamplingConfig(num_samples=G, max_new_tokens=T, eos_ids=(eos,), pad_id=pad)   # top_p, top_k, ...
    gen = engine.generate(prompt_tokens, prompt_mask, sampling, key=key, temperature=1.0)
    gen.rollout.completions / .mask / .log_probs  # int32[N, T], bool[N, T], f32[N, T]; N = B·G
    gen.finish_reasons                            # str[N]: "stop" (an EOS id was sampled) or "length"
    engine.release_memory(); ...; engine.reacquire_memory()   # around the update, on one accelerator
    engine.close()                                # at the end: frees what the engine holds (idempotent)

:meth:`Engine.generate` has the signature of :func:`jaxgrpo.rollout.sampling.generate` without the model,
``generate(prompt_tokens, prompt_mask, sampling, *, key, temperature=1.0)``: the settings travel in one
:class:`jaxgrpo.rollout.sampling.SamplingConfig`, so the built-in sampler and an external engine are drop-in
replacements (:func:`check_engine` refuses an engine whose ``generate`` cannot be called that way, e.g. the
retired keyword form ``generate(prompt_tokens, prompt_mask, *, num_samples, max_new_tokens, ..., key)``).
``Generation.rollout`` has the layout of :class:`jaxgrpo.rollout.sampling.Rollout` (row ``b·G + g`` is sample g
of prompt b, completions right-padded with ``pad_id``, prompts left-padded as given); its
``log_probs`` are the **engine's own** log-probs of the sampled tokens, ``log_softmax(logits / temperature)``
over the full vocabulary (temperature 0: temperature 1), i.e. the behaviour policy μ of
``jaxgrpo.kernels.importance``. For the built-in sampler they equal the trainer's recomputation up to float32
rounding; for another engine (other kernels, another dtype) they differ, and the trainer recomputes the
rollout policy's log-probs itself and passes the engine's as ``Batch.behavior_logp`` (TIS/MIS correction).
An engine says which with the optional class attribute ``logprobs_are_policy`` (:func:`logprobs_are_policy`:
True only for an engine that declares it; an engine without the attribute gets its log-probs recomputed,
which is exact for every engine, at the cost of one forward pass). A second optional class attribute,
``static_shapes = True``, says that ``generate`` compiles a program per input shape (a jitted sampler): callers
that vary the batch (partial rollouts, ``jaxgrpo.loop.partial.engine``) then pad it to few shapes.

Implementations: :class:`jaxgrpo.rollout.engines.builtin.BuiltinEngine` (the default: the jitted sampler, in
process, no copy of the weights) and :class:`jaxgrpo.rollout.engines.vllm.VLLMEngine` (vLLM, colocated in
process, weights pushed through the Hugging Face name map).
"""

from __future__ import annotations

import inspect
import typing
from typing import NamedTuple, Protocol, Sequence, runtime_checkable

import jax
import numpy as np

from jaxgrpo import _checks
from jaxgrpo.models.log_probs import Temperature, check_temperature
from jaxgrpo.rollout.sampling import Rollout, SamplingConfig

__all__ = [
  "Engine",
  "Generation",
  "FINISH_REASONS",
  "GENERATE_SIGNATURE",
  "check_engine",
  "check_generation",
  "factory_engine_class",
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
    self, prompt_tokens, prompt_mask, sampling: SamplingConfig, *, key: jax.Array, temperature: float = 1.0
  ) -> Generation:
    """G = ``sampling.num_samples`` completions of each of the B left-padded prompts ``int32[B, P]`` /
    ``bool[B, P]``, drawn with ``sampling``'s settings (those of :func:`jaxgrpo.rollout.sampling.generate`:
    ``max_new_tokens``, ``top_p``, ``top_k``, ``eos_ids``, ``pad_id``, ``suppress_ids``) at ``temperature``;
    the same ``key`` and weights give the same rollout. ``sampling.merge_lora`` concerns the push (the caller
    merges before :meth:`push_weights`); an engine that records no expert routing refuses
    ``sampling.record_routing=True``."""
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
  ``behavior_logp``: ``jaxgrpo.loop.collect.engine_old_logp``)."""
  return getattr(engine, "logprobs_are_policy", False) is True


#: How :meth:`Engine.generate` is called (the errors of :func:`check_engine` and :func:`load_engine_factory` quote it).
GENERATE_SIGNATURE = "generate(prompt_tokens, prompt_mask, sampling: SamplingConfig, *, key, temperature=1.0)"


def check_engine(engine, what: str = "engine") -> None:
  """TypeError naming ``what`` unless ``engine`` has the :class:`Engine` interface: the missing members, or a
  ``generate`` that cannot be called as :data:`GENERATE_SIGNATURE` (e.g. the retired keyword form
  ``generate(prompt_tokens, prompt_mask, *, num_samples, max_new_tokens, ..., key)``; read with
  ``inspect.signature``, nothing is run)."""
  if not isinstance(engine, Engine):
    members = ("name", "generate", "push_weights", "release_memory", "reacquire_memory", "close")
    missing = [m for m in members if not hasattr(engine, m)]
    raise TypeError(
      f"{what} must implement jaxgrpo.rollout.engines.Engine; got {type(engine).__name__} "
      f"(missing: {', '.join(missing)})"
    )
  problem = _generate_signature_problem(engine.generate, bound=True)
  if problem:
    raise TypeError(_signature_message(what, type(engine).__name__, problem))


def load_engine_factory(path: str, what: str = "rollout.engine"):
  """The callable named by ``"package.module:callable"`` (imported); ValueError naming ``what`` and ``path``
  when the string has another form, the module does not import or the name is missing or not callable, or when
  the engine class it names (the callable itself, or its return annotation) has a ``generate`` that cannot be
  called as :data:`GENERATE_SIGNATURE` — checked on the class, before any engine is built. A factory whose
  engine class is not known until it runs is checked by :func:`check_engine` on the engine it returns."""
  factory = _checks.load_callable(path, what, "'jax', 'vllm' or 'package.module:callable'")
  cls = factory_engine_class(factory)
  if cls is not None:
    problem = _generate_signature_problem(
      cls.generate, bound=isinstance(inspect.getattr_static(cls, "generate"), (staticmethod, classmethod))
    )
    if problem:
      raise ValueError(_signature_message(f"`{what}`: {path!r}", cls.__name__, problem))
  return factory


def factory_engine_class(factory) -> type | None:
  """The class whose instances ``factory`` makes, when known without calling it (a class with ``generate``, or a
  function whose return annotation is one); None otherwise."""
  cls = factory
  if not isinstance(factory, type):
    try:
      cls = typing.get_type_hints(factory).get("return")
    except Exception:  # an annotation that does not resolve: the engine is checked once it is built
      return None
  return cls if isinstance(cls, type) and callable(getattr(cls, "generate", None)) else None


def _generate_signature_problem(generate, *, bound: bool) -> str | None:
  """Why ``generate`` (a bound method, or with ``bound=False`` a function taking ``self`` first) cannot be called
  as :data:`GENERATE_SIGNATURE`; None when it can or its signature cannot be read (a C callable)."""
  try:
    sig = inspect.signature(generate)
  except (TypeError, ValueError):
    return None
  params = list(sig.parameters.values())
  positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
  if not bound and params and params[0].kind in positional:
    sig = sig.replace(parameters=params[1:])  # self
  try:
    sig.bind("prompt_tokens", "prompt_mask", "sampling", key="key", temperature=1.0)
  except TypeError as e:
    return f"generate{sig}: {e}"
  return None


def _signature_message(what: str, name: str, problem: str) -> str:
  return (
    f"{what}: {name}.{problem}; an engine's generate must be {GENERATE_SIGNATURE} "
    "(the keyword form num_samples=, max_new_tokens=, ... was retired: read them from the "
    "jaxgrpo.rollout.sampling.SamplingConfig; CHANGELOG.md, 'One generate signature')"
  )


def check_generation(
  engine, gen, *, num_prompts: int, num_samples: int, max_new_tokens: int, temperature: float
) -> Generation:
  """What ``engine.generate`` returned, checked before anything trains on it; ``gen`` with its rollout's
  ``temperature`` set to ``temperature`` when the engine left it None (the temperature it was asked for).

  Checked: a :class:`Generation` whose rollout has N = ``num_prompts`` × ``num_samples`` rows; ``completions``
  ``int[N, T]`` with 1 <= T <= ``max_new_tokens``; ``mask`` ``bool[N, T]``, True on a prefix of each row;
  ``log_probs`` ``float[N, T]``, finite where ``mask`` is True; ``group_ids`` ``int[N]`` equal to
  ``b`` for row ``b·G + g``; ``prompt_tokens``/``prompt_mask`` with N rows; ``finish_reasons`` N long; and the
  rollout's ``temperature``, when the engine reports one, the one asked for (log-probs at 1 for greedy).

  Raises:
    ValueError (TypeError for a wrong type): one line naming the engine and what was wrong.
  """
  name = f"engine {getattr(engine, 'name', '?')!r} ({type(engine).__name__})"
  problem = _generation_problem(gen, num_prompts * num_samples, num_samples, max_new_tokens)
  if problem is not None:
    kind, why = problem
    raise kind(
      f"{name}.generate returned {why}; an engine must return {num_prompts} prompts × {num_samples} = "
      f"{num_prompts * num_samples} rows in the layout of jaxgrpo.rollout.sampling.Rollout"
    )
  rollout = gen.rollout
  if rollout.temperature is None:
    return gen._replace(rollout=rollout._replace(temperature=Temperature(temperature)))
  check_temperature(
    rollout.temperature,
    temperature,
    f"{name}: its rollout (Generation.rollout.temperature)",
    f"the engine must sample at the temperature it is given (generate(..., temperature={temperature!r}))",
  )
  return gen


def _generation_problem(gen, n: int, g: int, max_new_tokens: int) -> tuple[type, str] | None:
  """``(exception type, what is wrong)`` with ``gen``, or None (see :func:`check_generation`)."""
  if not isinstance(gen, Generation) or not isinstance(gen.rollout, Rollout):
    return TypeError, f"a {type(gen).__name__}, not a jaxgrpo.rollout.engines.Generation(rollout=Rollout(...), ...)"
  r = gen.rollout
  comps, mask, logp = (np.asarray(x) for x in (r.completions, r.mask, r.log_probs))
  if comps.ndim != 2 or comps.shape[0] != n:
    return ValueError, f"completions of shape {comps.shape}: {comps.shape[0] if comps.ndim else 0} rows, not {n}"
  t = comps.shape[1]
  if not 1 <= t <= max_new_tokens:
    return (
      ValueError,
      f"completions of shape {comps.shape}: {t} columns, not between 1 and max_new_tokens={max_new_tokens}",
    )
  for field, x, kind in (("mask", mask, np.bool_), ("log_probs", logp, np.floating)):
    if x.shape != (n, t) or not np.issubdtype(x.dtype, kind):
      return (
        ValueError,
        f"{field} of shape {x.shape} and dtype {x.dtype}, not {'bool' if kind is np.bool_ else 'float'}[{n}, {t}]",
      )
  if (mask[:, 1:] & ~mask[:, :-1]).any():
    row = int(np.flatnonzero((mask[:, 1:] & ~mask[:, :-1]).any(axis=1))[0])
    return ValueError, f"a mask that is not a prefix of row {row} (a real token after padding)"
  bad = mask & ~np.isfinite(logp)
  if bad.any():
    row, col = (int(i[0]) for i in np.nonzero(bad))
    return ValueError, f"a non-finite log-prob {logp[row, col]} on the real token [{row}, {col}]"
  gids = np.asarray(r.group_ids)
  want = np.repeat(np.arange(n // g), g)
  if gids.shape != (n,) or not np.array_equal(gids, want):
    return (
      ValueError,
      f"group_ids {gids.tolist()[:12]}{'...' if gids.size > 12 else ''} (shape {gids.shape}), not b for row b·G + g",
    )
  for field in ("prompt_tokens", "prompt_mask"):
    shape = np.shape(getattr(r, field))
    if len(shape) != 2 or shape[0] != n:
      return ValueError, f"{field} of shape {shape}, not [{n}, P]"
  if len(gen.finish_reasons) != n:
    return ValueError, f"{len(gen.finish_reasons)} finish_reasons for {n} rows"
  return None


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
