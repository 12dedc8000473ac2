"""The train step's input: :class:`Batch`, one rollout batch, its validation and its placement.

``Batch`` holds ``[B, ...]`` fields (B trajectories, P prompt slots, T completion slots; see its
docstring for every field's shape and dtype). The step (``jaxgrpo.step.train``) and the reference pass
validate a batch here (ranks, row and column counts, dtypes, one line naming the field) and place it
on the mesh (``int32``/``bool``/``f32`` arrays on the batch sharding), so a NumPy batch and a placed
one reach ``jit`` with the same signature. Re-exported as ``jaxgrpo.step.train.Batch``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo import _checks
from jaxgrpo.models.log_probs import Temperature
from jaxgrpo.step.packing import PackedSlots, check_routing_array

__all__ = ["Batch"]


class Batch(NamedTuple):
  """One rollout batch (B = N trajectories, P prompt slots, T completion slots).

  Attributes:
    prompt_tokens: ``int32[B, P]`` left-padded prompts (``Rollout.prompt_tokens``), P >= 1.
    prompt_mask: ``bool[B, P]`` real prompt tokens.
    completions: ``int32[B, T]`` sampled tokens, right-padded.
    mask: ``bool[B, T]`` real completion tokens.
    old_logp: ``f32[B, T]`` rollout-policy log-probs of the completions (``Rollout.log_probs``).
    group_ids: ``int32[B]`` prompt index of each row.
    rewards: ``f32[B]`` outcome rewards r_i; NaN or ±inf marks a missing sample (advantage 0, its
      tokens left out of the loss, counted in the ``rewards_nonfinite`` metric) — also when
      ``advantages`` are given: the row is skipped, its given advantage unused. None is allowed only
      with ``advantages`` given (the step then reads no rewards and skips no row).
    ref_logp: ``f32[B, T]`` reference-model log-probs (``jaxgrpo.step.train.make_reference_fn``), or None when
      nothing reads them (β = 0).
    advantages: ``f32[B]`` or ``f32[B, T]`` precomputed advantages, or None: the step computes them
      with its ``advantages_fn``. When given, ``advantages_fn`` is not called and ``rewards`` may be
      None.
    token_weights: ``f32[B, T]`` precomputed token weights (λ-GRPO: ``1/|λ|``), or None: the weights
      of ``advantages_fn`` (or none at all when ``advantages`` is given).
    behavior_logp: ``f32[B, T]`` the behaviour policy's log-probs of the completions when they differ
      from ``old_logp`` (another inference engine or dtype, an older checkpoint), read by a
      ``GRPOConfig`` with ``importance_correction``; None: ``old_logp`` is the behaviour policy's.
      Dropped (one compiled program) when the config does not read it.
    routing: ``int[B, P + T, M, k]`` the experts each of the M sparse layers of a mixture of experts
      used for each token of ``[prompt ‖ completion]`` when sampling (``Rollout.routing``, any integer
      dtype), or None. Given, the step's and the reference pass's forwards use exactly these experts
      (routing replay, ``jaxgrpo.models.moe``); None: each forward routes by its own top-k. Packing moves
      it into the packed layout (``packed.routing``; this field is then None).
    packed: the sequences packed for the step's slots (``jaxgrpo.step.packing.PackedSlots``,
      :func:`~jaxgrpo.step.batch_packing.pack_batch`), or None. Only the model's forward/backward reads it; every other quantity
      stays on the ``[B, T]`` fields. A step with ``TrainConfig.packing`` packs a batch without it.
    policy_mask: ``bool[B, T]`` the tokens the policy sampled (a subset of ``mask``), or None: all of
      ``mask``. Multi-turn rollouts (``jaxgrpo.rollout.environments.rollout.sample_multiturn``) interleave the policy's turns
      with environment observations in ``completions``; the observations are context only: ``mask``
      (attention, process sets) covers them, the loss does not — they leave the loss numerator and its
      token count, the KL term, the importance weights, the entropy bonus and the metrics, and their
      ``ref_logp`` is replaced by ``old_logp`` before ``advantages_fn`` (so FRPO's future KL, whose
      f-divergence is 0 at πref = πθold, sums over policy tokens only).
    temperature: the temperature the rollout was sampled at (a ``jaxgrpo.models.log_probs.Temperature``; ``Rollout.temperature``,
      copied by :meth:`from_rollout`), or None: not known, not checked. The step refuses a batch whose log-probs
      refer to another temperature than its ``TrainConfig.temperature`` (``jaxgrpo.models.log_probs.check_temperature``; greedy
      rollouts, temperature 0, refer to 1) and drops the field before its compiled program.
    teacher_logp: ``f32[B, T]`` a distillation teacher's log-probs of the completions (``jaxgrpo.step.feed.Teacher``:
      a reference pass of the teacher model), read by a config with ``distill`` (``GRPOConfig.distill``, the
      sampled-token form: ``A += w·(teacher_logp − old_logp)`` on the policy's tokens); None otherwise.
      Dropped (one compiled program) when the config does not read it.
    teacher_topk_ids: ``int32[B, T, k]`` a distillation teacher's k most likely ids at each completion
      position, and ``teacher_topk_logp`` ``f32[B, T, k]`` their log-probs (``jaxgrpo.step.feed.Teacher`` with
      ``top_k``), read by a config whose ``distill.kind`` is a top-k form (the loss adds
      ``w·topk_divergence`` at the student's log-probs of those ids); None otherwise.

  Integer fields may be any integer dtype and float fields any float dtype (the step converts them
  to ``int32``/``f32``); masks must be boolean.
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  completions: jax.Array
  mask: jax.Array
  old_logp: jax.Array
  group_ids: jax.Array
  rewards: jax.Array | None
  ref_logp: jax.Array | None = None
  advantages: jax.Array | None = None
  token_weights: jax.Array | None = None
  behavior_logp: jax.Array | None = None
  packed: PackedSlots | None = None
  policy_mask: jax.Array | None = None
  routing: jax.Array | None = None
  temperature: Temperature | None = None
  teacher_logp: jax.Array | None = None
  teacher_topk_ids: jax.Array | None = None
  teacher_topk_logp: jax.Array | None = None

  @classmethod
  def from_rollout(
    cls, rollout, rewards, ref_logp=None, *, advantages=None, token_weights=None, behavior_logp=None, policy_mask=None
  ) -> "Batch":
    """A batch from a ``jaxgrpo.rollout.sampling.Rollout`` and its ``f32[N]`` rewards (a list, NumPy or JAX
    array; None with ``advantages`` given), with optional reference log-probs, precomputed advantages
    / token weights and behaviour log-probs; the rollout's recorded experts (``Rollout.routing``, routing
    replay) and sampling temperature (``Rollout.temperature``) when it has them."""
    if rewards is not None:
      rewards = rewards.astype(jnp.float32) if isinstance(rewards, jax.Array) else np.asarray(rewards, np.float32)
    return cls(
      rollout.prompt_tokens,
      rollout.prompt_mask,
      rollout.completions,
      rollout.mask,
      rollout.log_probs,
      rollout.group_ids,
      rewards,
      ref_logp,
      advantages,
      token_weights,
      behavior_logp,
      policy_mask=getattr(rollout, "policy_mask", None) if policy_mask is None else policy_mask,
      routing=getattr(rollout, "routing", None),
      temperature=_as_temperature(getattr(rollout, "temperature", None)),
    )


def _as_temperature(t) -> Temperature | None:
  return None if t is None else Temperature(t)


# name: (allowed ranks, dtype kind, notation); "T" fields share the completion length
FIELDS = {
  "prompt_tokens": ((2,), "int", "int32[B, P]"),
  "prompt_mask": ((2,), "bool", "bool[B, P]"),
  "completions": ((2,), "int", "int32[B, T]"),
  "mask": ((2,), "bool", "bool[B, T]"),
  "old_logp": ((2,), "float", "f32[B, T]"),
  "group_ids": ((1,), "int", "int32[B]"),
  "rewards": ((1,), "float", "f32[B]"),
  "ref_logp": ((2,), "float", "f32[B, T]"),
  "advantages": ((1, 2), "float", "f32[B] or f32[B, T]"),
  "token_weights": ((2,), "float", "f32[B, T]"),
  "behavior_logp": ((2,), "float", "f32[B, T]"),
  "policy_mask": ((2,), "bool", "bool[B, T]"),
  "teacher_logp": ((2,), "float", "f32[B, T]"),
  "teacher_topk_ids": ((3,), "int", "int32[B, T, k]"),
  "teacher_topk_logp": ((3,), "float", "f32[B, T, k]"),
}
_DTYPES = {"int": jnp.int32, "bool": jnp.bool_, "float": jnp.float32}
_CHECK_DTYPE = {"int": _checks.check_int, "bool": _checks.check_bool, "float": _checks.check_float}
_REQUIRED = ("prompt_tokens", "prompt_mask", "completions", "mask", "old_logp", "group_ids", "rewards")
REFERENCE_FIELDS = ("prompt_tokens", "prompt_mask", "completions", "mask")


def check_fields(batch: Batch, names, *, rewards_optional: bool = False) -> tuple[int, int]:
  """Ranks, rows, completion length and dtypes of ``batch``'s fields ``names``; returns ``(B, T)``.
  ``rewards_optional``: None rewards are allowed without ``advantages`` (a distillation term alone)."""
  if not isinstance(batch, Batch):
    raise TypeError(f"batch must be a jaxgrpo.step.train.Batch; got {type(batch).__name__}")
  b, t = np.shape(batch.completions) if np.ndim(batch.completions) == 2 else (None, None)
  if b is None:
    raise ValueError(f"batch.completions must have rank 2 (int32[B, T]); got shape {np.shape(batch.completions)}")
  for name in names:
    x = getattr(batch, name)
    if x is None:
      if name == "rewards" and batch.advantages is None and not rewards_optional:
        raise ValueError("batch.rewards is required (f32[B]) unless batch.advantages is given; got None")
      if name in _REQUIRED and name != "rewards":
        raise ValueError(f"batch.{name} is required ({FIELDS[name][2]}); got None")
      continue
    ranks, kind, notation = FIELDS[name]
    shape = np.shape(x)
    allowed = [
      (b,) if r == 1 else (b, t, "k") if r == 3 else (b, t) if notation.endswith("T]") else (b, "P") for r in ranks
    ]
    if not any(len(shape) == len(a) and all(d == e or e in ("P", "k") for d, e in zip(shape, a)) for a in allowed):
      want = " or ".join(str(a).replace("'P'", "P").replace("'k'", "k") for a in allowed)
      raise ValueError(f"batch.{name} must be {notation} with B = {b} rows and T = {t}, i.e. shape {want}; got {shape}")
    _CHECK_DTYPE[kind](x, f"batch.{name}", notation)
  if "prompt_tokens" in names:
    if np.shape(batch.prompt_tokens)[1] < 1:
      raise ValueError(f"batch.prompt_tokens needs at least one column; got shape {np.shape(batch.prompt_tokens)}")
    if np.shape(batch.prompt_mask) != np.shape(batch.prompt_tokens):
      raise ValueError(
        f"batch.prompt_mask shape {np.shape(batch.prompt_mask)} != prompt_tokens shape {np.shape(batch.prompt_tokens)}"
      )
  return b, t


def check_policy_mask(batch: Batch) -> None:
  """ValueError when ``batch.policy_mask`` (values on this host) marks a token outside ``batch.mask``."""
  if batch.policy_mask is None:
    return
  pm, m = host_values(batch.policy_mask), host_values(batch.mask)
  if pm is not None and m is not None and (pm & ~m).any():
    row = int(np.flatnonzero((pm & ~m).any(axis=1))[0])
    raise ValueError(
      f"batch.policy_mask must be a subset of batch.mask (policy tokens are real tokens); row {row} is not"
    )


def check_routing(batch: Batch, b: int, t: int) -> None:
  """``batch.routing``: ``int[B, P + T, M, k]`` (routing replay); a packed batch carries it in ``packed.routing``."""
  if batch.routing is None:
    return
  check_routing_array(batch.routing, b, np.shape(batch.prompt_tokens)[1], t, "batch.routing")
  if batch.packed is not None:
    raise ValueError(
      "batch.routing is set on a batch that is already packed: a packed batch replays the routing of its packed "
      "layout (batch.packed.routing); pack the batch with its routing (step.pack / pack_batch move it there)"
    )


def place_routing(batch: Batch, sharding) -> Batch:
  if batch.routing is None:
    return batch
  r = batch.routing if isinstance(batch.routing, jax.Array) else np.asarray(batch.routing)
  return batch._replace(routing=jax.device_put(r, sharding))


def place_fields(batch: Batch, names, sharding) -> Batch:
  """The fields ``names`` as ``int32``/``bool``/``f32`` arrays on ``sharding`` (a no-op for fields
  already placed there), so NumPy and placed batches reach ``jit`` with identical signatures."""
  placed = {}
  for name in names:
    x = getattr(batch, name)
    if x is None:
      continue
    dtype = _DTYPES[FIELDS[name][1]]
    if isinstance(x, jax.Array):
      x = x if x.dtype == dtype else x.astype(dtype)
    else:
      x = np.asarray(x, dtype)
    placed[name] = x
  return batch._replace(**jax.device_put(placed, sharding))


def abstract_batch(batch: Batch, names, sharding) -> Batch:
  """``batch`` as :func:`place_fields`, :func:`place_packed` and :func:`place_routing` would place it (the
  fields ``names`` in the step's dtypes, ``packed`` int32, ``routing`` as given), every array a
  ``jax.ShapeDtypeStruct`` on ``sharding`` instead: nothing transferred, for lowering ahead of time."""
  sds = lambda x, dtype: jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)
  fields = {n: sds(getattr(batch, n), _DTYPES[FIELDS[n][1]]) for n in names if getattr(batch, n) is not None}
  if batch.packed is not None:
    fields["packed"] = batch.packed.map_arrays(sds)
  if batch.routing is not None:
    fields["routing"] = sds(batch.routing, batch.routing.dtype)
  return batch._replace(**fields)


def host_values(x) -> np.ndarray | None:
  """``x`` as NumPy when its values are on this host (NumPy, or a fully addressable ``jax.Array``); None for a
  tracer, a ``jax.ShapeDtypeStruct`` (no values) or an array on other hosts."""
  if isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
    return None
  if isinstance(x, jax.Array):
    return np.asarray(x) if x.is_fully_addressable else None
  return np.asarray(x)


def place_packed(batch: Batch, sharding) -> Batch:
  """``batch.packed`` as ``int32`` arrays on ``sharding`` (leading axes over ``data × fsdp``); its ``routing``
  keeps its compact dtype (``jaxgrpo.models.moe.replay_dtype``), as ``batch.routing`` does."""
  if batch.packed is None:
    return batch
  as_dtype = lambda x, dtype: (
    (x if x.dtype == dtype else x.astype(dtype)) if isinstance(x, jax.Array) else np.asarray(x, dtype)
  )
  return batch._replace(packed=jax.device_put(batch.packed.map_arrays(as_dtype), sharding))
