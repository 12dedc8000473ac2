"""The built-in engine: :func:`jaxgrpo.rollout.sampling.generate` (the jitted static-batch sampler) behind the
:class:`~jaxgrpo.rollout.engines.base.Engine` interface.

It samples from the model it was last given, in the same process and on the same arrays (no copy: a push
is a reference swap, so an engine built from a policy that shares the train state's arrays sees every
update once it is given the new policy). Its log-probs are those the train step recomputes, up to float32
rounding (``logprobs_are_policy = True``). A policy merged from a train state shares that state's arrays,
which the next train step donates (deletes): after an update, :meth:`~BuiltinEngine.generate` refuses to run
until the new policy is pushed (one line naming ``push_weights``, not XLA's "Buffer has been deleted or
donated"). It holds no memory of its own between calls: ``release_memory`` / ``reacquire_memory`` do
nothing (XLA frees the KV cache of a call when the call returns).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxgrpo.rollout.engines.base import Generation, finish_reasons
from jaxgrpo.rollout.sampling import SamplingConfig, generate

__all__ = ["BuiltinEngine"]


class BuiltinEngine:
  """:func:`jaxgrpo.rollout.sampling.generate` as an engine.

  Args:
    model: the ``jaxgrpo.models`` decoder to sample from (None: call :meth:`push_weights` first).
  """

  name = "jax"
  logprobs_are_policy = True
  static_shapes = True  # one compiled program per shape: callers bucket shapes (jaxgrpo.rollout.partial_engine)

  def __init__(self, model=None):
    self.model = model

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
    rollout = generate(self.model, prompt_tokens, prompt_mask, sampling, key=key, temperature=temperature)
    reasons = finish_reasons(np.asarray(rollout.completions), np.asarray(rollout.mask), sampling.eos_ids)
    return Generation(rollout, reasons)
