"""Partial rollouts through an engine (vLLM, a user's ``package.module:callable``, the ``BuiltinEngine``).

:class:`EnginePool` is a :class:`~jaxgrpo.loop.partial.pool.RowPool` whose boundaries call an engine's
``generate`` (``jaxgrpo.rollout.engines.base.Engine``) instead of the pool's own jitted programs. The
bookkeeping — groups, queue, slots, refill, the staleness deadlines, ``take`` / ``drop_older`` /
``untrained`` — is the row pool's; only how a boundary decodes differs::

    per boundary (every running row, the rows admitted at it included):
      context = prompt ‖ completion[:t]          one prompt per row, left-padded, ``num_samples=1``
      n       = min(K, budget − t)               K = ``refill_every``; rows grouped by n, one generate per group
      engine.generate(contexts, sampling with max_new_tokens=n)
      the returned tokens get the current version and the engine's log-probs (μ); a row that sampled an
      EOS ("stop"), returned fewer than n tokens or reached its budget ends and frees its slot
    a version change: the new weights are pushed first (``engine_for(model, version)``: the rollout
    source's push, whose engine drops any cache computed with the old weights)

**Re-submission, not abort/resume.** vLLM 0.32's offline ``LLM.generate`` runs its requests to completion
under one set of weights and has no call that pauses a request and resumes it after a weight update; so each
boundary is a complete generate of K tokens, and the next boundary re-submits the context as the prompt.
Within one version the engine's prefix cache holds the context's full KV blocks (vLLM caches the blocks of
generated tokens too), so a re-submission prefills only the tokens past the last full block; after a push the
cache is empty (``VLLMEngine.push_weights`` resets it: a re-submitted context is never continued from KV of
the old weights) and every running context is prefilled once under the new weights — as the built-in pool
re-prefills its rows. Every token t is thus sampled from ``π_v(· | prompt, completion[:t])`` of one version v.

Each generate call's key is ``fold_in(run key, call)`` (``call`` counts the calls of a :meth:`~RowPool.run`):
a row's tokens depend on the rows it was batched with (unlike the built-in pool's per-row keys), which is
all an engine's seeds allow. An engine that compiles a program per shape (the built-in one: the class
attribute ``static_shapes = True``) gets the rows padded to a power of two (copies of the first row, their
output discarded) and the context width to a bucket, so few programs compile.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxgrpo.data import pad_left
from jaxgrpo.loop.partial.pool import RowPool
from jaxgrpo.rollout import conversation as _conversation
from jaxgrpo.rollout.sampling import SamplingConfig

__all__ = ["EnginePool"]


class EnginePool(RowPool):
  """A :class:`~jaxgrpo.loop.partial.pool.RowPool` decoded by an engine (the module docstring).

  Args:
    engine_for: ``engine_for(model, version) -> engine``: the engine holding ``version``'s weights (pushed when
      it holds another; ``jaxgrpo.loop.source.RolloutSource._engine``).
    engine_sampling: the ``SamplingConfig`` the engine receives (EOS, pad, filters); ``num_samples`` and
      ``max_new_tokens`` are set per call.
    sampling, temperature, prompt_len, num_slots, refill_every, refill, budget_of: as for ``RowPool``
      (``refill_every``: K, the tokens a row gets per boundary).
  """

  def __init__(self, *, engine_for, engine_sampling: SamplingConfig, **kw):
    super().__init__(**kw)
    self.engine_for, self.engine_sampling = engine_for, engine_sampling
    self.generate_s = 0.0  # seconds in engine.generate during the last run

  def _prepare(self, model, version: int, key):
    self._key, self._calls, self.generate_s = key, 0, 0.0
    return self.engine_for(model, version)

  def _boundary(self, engine, admit: list[int], version: int, prompt_tokens) -> None:
    """One generate call per distinct n over the running rows (``admit``: already in their slots); the rows'
    host copies updated, ended rows' slots freed."""
    by_n: dict[int, list[int]] = {}
    for s, row in enumerate(self._slot_rows):
      if row is not None:
        by_n.setdefault(min(self.every, row.budget - row.t), []).append(s)
    for n, slots in sorted(by_n.items()):
      self._generate(engine, slots, n, version, prompt_tokens)
    self._stop = np.zeros(self.slots, bool)

  def _generate(self, engine, slots: list[int], n: int, version: int, prompt_tokens) -> None:
    rows = [self._slot_rows[s] for s in slots]
    contexts = [list(prompt_tokens[row.prompt]) + row.tokens[: row.t].tolist() for row in rows]
    width = max(len(c) for c in contexts)
    count = len(rows)
    if getattr(engine, "static_shapes", False) is True:  # few shapes: few compiled programs
      width = _conversation.bucket_width(width, self.prompt_len + self.t_max - n)
      count = min(self.slots, 1 << (count - 1).bit_length())
    contexts += [contexts[0]] * (count - len(rows))  # padding rows: copies of the first, their output discarded
    tokens, mask = pad_left(contexts, width, self.engine_sampling.pad_id)
    sampling = dataclasses.replace(self.engine_sampling, num_samples=1, max_new_tokens=n)
    key = jax.random.fold_in(self._key, self._calls)
    self._calls += 1
    t0 = time.perf_counter()
    gen = engine.generate(tokens, mask, sampling, key=key, temperature=self.temperature)
    comps, cmask = np.asarray(gen.rollout.completions), np.asarray(gen.rollout.mask, bool)
    logps, reasons = np.asarray(gen.rollout.log_probs, np.float32), np.asarray(gen.finish_reasons)
    self.generate_s += time.perf_counter() - t0
    if comps.shape[0] != count or cmask.shape != comps.shape:
      raise ValueError(
        f"{getattr(engine, 'name', type(engine).__name__)}.generate returned completions {comps.shape} and mask "
        f"{cmask.shape} for {count} prompts with num_samples=1: expected [{count}, <= {n}] each"
      )
    for i, (s, row) in enumerate(zip(slots, rows)):
      k = int(cmask[i].sum())
      if not 1 <= k <= n:
        raise ValueError(f"the engine returned {k} tokens for a row with max_new_tokens={n}: expected 1 to {n}")
      row.tokens[row.t : row.t + k] = comps[i, :k]
      row.logp[row.t : row.t + k] = logps[i, :k]
      row.versions[row.t : row.t + k] = version
      row.t += k
      if reasons[i] == "stop" or k < n or row.t >= row.budget:
        row.done, self._slot_rows[s] = True, None
