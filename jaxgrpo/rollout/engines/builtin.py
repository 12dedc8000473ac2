"""The built-in engine: :func:`jaxgrpo.rollout.sampling.generate` (the jitted static-batch sampler) behind the
:class:`~jaxgrpo.rollout.engines.base.Engine` interface.

It samples from the model it was last given, in the same process and on the same arrays (no copy: a push
is a reference swap, so an engine built from a policy that shares the train state's arrays sees every
update once it is given the new policy). Its log-probs are those the train step recomputes, up to float32
rounding (``logprobs_are_policy = True``). It is mesh-aware (``samples_on_mesh = True``):
:meth:`~BuiltinEngine.sample_rows` is one program over a mesh that may span several processes, each process
placing its own prompts (:func:`place_prompts`) and taking back its own rows
(``jaxgrpo.parallel.distributed.process_rows``); that is how the trainer's rollout source samples through it. A policy merged from a train state shares that state's arrays,
which the next train step donates (deletes): after an update, :meth:`~BuiltinEngine.generate` refuses to run
until the new policy is pushed (one line naming ``push_weights``, not XLA's "Buffer has been deleted or
donated"). It holds no memory of its own between calls: ``release_memory`` / ``reacquire_memory`` do
nothing (XLA frees the KV cache of a call when the call returns).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxgrpo.parallel import distributed
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.engines.base import Generation, finish_reasons
from jaxgrpo.rollout.sampling import Rollout, SamplingConfig, check_sampling, generate
from jaxgrpo.rollout.speculative import SpeculativeConfig, SpeculativeSwitch

__all__ = ["BuiltinEngine", "place_prompts"]


def place_prompts(prompt_tokens, prompt_mask, *, mesh: Mesh, rules: Mapping[str, Any] | None = None):
  """The prompts of one sampler call laid out for the global mesh, so that the sampler runs on
  every process's devices with each process transferring only its own prompts.

  When B divides the batch axes (``data × fsdp``) the rows are placed over them: each process passes
  only the prompts :func:`jaxgrpo.parallel.sharding.process_batch_rows` gives it
  (``place_batch(..., process_local=True)``), and its devices sample those prompts' G·B/``process_count``
  rows. Otherwise the arrays are returned as they are (NumPy, replicated: the same on every process).
  Either way the sampler is one program over the global mesh, so each row's tokens — its PRNG draws
  depend only on the key, the step and the row's global index — do not depend on how many
  processes run it; :func:`jaxgrpo.parallel.distributed.process_rows` then gives each process its own rows.

  Args:
    prompt_tokens: ``int32[B, P]`` left-padded prompts, every process the same (NumPy);
      prompt_mask: ``bool[B, P]``.
    mesh, rules: the mesh and rules table of the step.

  Returns:
    ``(prompt_tokens, prompt_mask)`` for ``jaxgrpo.loop.collect.sample``.
  """
  tokens, mask = np.asarray(prompt_tokens), np.asarray(prompt_mask)
  b = tokens.shape[0]
  if b % shd.batch_shards(mesh, rules):
    return tokens, mask
  rows = shd.process_batch_rows(mesh, b, rules)
  return shd.place_batch((tokens[rows], mask[rows]), mesh, rules, process_local=True)


class BuiltinEngine:
  """:func:`jaxgrpo.rollout.sampling.generate` as an engine.

  Args:
    model: the ``jaxgrpo.models`` decoder to sample from (None: call :meth:`push_weights` first).
    speculative: a :class:`~jaxgrpo.rollout.speculative.SpeculativeConfig` (``rollout.speculative``): sample by
      speculative decoding (``ngram``) or let a :class:`~jaxgrpo.rollout.speculative.SpeculativeSwitch` choose by
      measure (``auto``); None or ``off``: :func:`~jaxgrpo.rollout.sampling.generate`. The last call's
      ``rollout/speculative_on`` and ``rollout/spec_acceptance`` are in :attr:`sample_metrics`.
    draft_model: the draft model of ``speculative`` (``draft``, or ``auto`` with a draft), or None.
  """

  name = "jax"
  logprobs_are_policy = True
  static_shapes = True  # one compiled program per shape: callers bucket shapes (jaxgrpo.loop.partial.engine)
  samples_on_mesh = True  # sample_rows: one program on the caller's mesh; the library's programs run on .model
  records_routing = True  # SamplingConfig.record_routing: a mixture of experts' routing, replayed by the step
  speculates = True  # rollout.speculative: built with a SpeculativeConfig (jaxgrpo.rollout.speculative)

  def __init__(self, model=None, *, speculative: SpeculativeConfig | None = None, draft_model=None):
    self.model = model
    on = speculative is not None and speculative.mode != "off"
    self.switch = SpeculativeSwitch(config=speculative, draft_model=draft_model) if on else None
    self.sample_metrics: dict[str, float] = {}

  def _generate(self, prompt_tokens, prompt_mask, sampling, *, key, temperature, collective=False) -> Rollout:
    """:func:`~jaxgrpo.rollout.sampling.generate`, or the speculative switch's call (its metrics kept;
    ``collective``: one program over every process, timed alike on each: ``SpeculativeSwitch.sample``)."""
    if self.switch is None:
      return generate(self.model, prompt_tokens, prompt_mask, sampling, key=key, temperature=temperature)
    rollout, self.sample_metrics = self.switch.sample(
      self.model, prompt_tokens, prompt_mask, sampling, key=key, temperature=temperature, collective=collective
    )
    return rollout

  def push_weights(self, model) -> None:
    """Sample from ``model`` from now on (a reference, not a copy)."""
    self.model = model

  def release_memory(self) -> None:
    """Nothing to free: the sampler's KV cache lives only during a call."""

  def reacquire_memory(self) -> None:
    """Nothing to reacquire (see :meth:`release_memory`)."""

  def close(self) -> None:
    """Drop the reference to the model (nothing else is held)."""
    self.model = None

  def _check_weights(self) -> None:
    """RuntimeError when no model was pushed or its arrays were deleted (donated to a train step update)."""
    if self.model is None:
      raise RuntimeError("BuiltinEngine.generate: no model yet; call push_weights(model) first")
    for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(self.model)):
      if isinstance(x, jax.Array) and x.is_deleted():
        raise RuntimeError(
          "BuiltinEngine.generate: the pushed model's weights were deleted (a train step donated the state they "
          f"came from; first: {jax.tree_util.keystr(path)}); call engine.push_weights(policy) with the updated "
          "policy after every update"
        )

  def generate(
    self, prompt_tokens, prompt_mask, sampling: SamplingConfig, *, key: jax.Array, temperature: float = 1.0
  ) -> Generation:
    """:func:`jaxgrpo.rollout.sampling.generate` on the last pushed model, plus finish reasons (see
    :meth:`jaxgrpo.rollout.engines.base.Engine.generate`; ``sampling.merge_lora`` and ``record_routing`` are
    honoured as by ``generate``)."""
    self._check_weights()
    rollout = self._generate(prompt_tokens, prompt_mask, sampling, key=key, temperature=temperature)
    reasons = finish_reasons(np.asarray(rollout.completions), np.asarray(rollout.mask), sampling.eos_ids)
    return Generation(rollout, reasons)

  def sample_rows(
    self,
    prompt_tokens,
    prompt_mask,
    sampling: SamplingConfig,
    *,
    key: jax.Array,
    temperature: float,
    mesh: Mesh,
    on_dispatched: Callable[[Rollout], None] | None = None,
  ) -> Rollout:
    """This process's rows (NumPy; all N = B·G in one process) of G completions of each of the B prompts
    (``int32[B, P]`` / ``bool[B, P]``, every process the same): one sampler program on ``mesh``, each process
    sending its own prompts (:func:`place_prompts`) and taking back its own rows. ``on_dispatched(rollout)`` is
    called with the device rollout once the program is dispatched, before its rows are fetched (the learner
    may run meanwhile). ``num_steps`` is None (the rows of a process do not know the batch's)."""
    check_sampling(sampling, "sample")
    sampling.require_max_new_tokens("sample")
    self._check_weights()
    tokens, mask = place_prompts(prompt_tokens, prompt_mask, mesh=mesh)
    rollout = self._generate(tokens, mask, sampling, key=key, temperature=temperature, collective=True)
    if on_dispatched is not None:
      on_dispatched(rollout)
    return distributed.process_rows(rollout._replace(num_steps=None), mesh)
