"""Autoregressive sampling: one jitted program that prefills each prompt once and decodes G samples.

Data flow (axis names: B prompts, G samples per prompt, N = B*G rows, P prompt tokens, T new
tokens, V vocabulary):

    prompts [B, P] (left-padded) --prefill--> KV cache [B, P+T-1] --repeat_cache(G)--> [N, P+T-1]
    --lax.while_loop over t (one token per row per step; exits once every row has finished)-->
    Rollout(completions [N, T] right-padded, mask, log_probs, ...)

The log-probs returned for the sampled tokens are those the train step recomputes for the rollout
(``jaxgrpo.step.train.completion_log_probs``: one forward over ``[prompt_tokens ‖ completions]`` with the
mask ``[prompt_mask ‖ mask]``, at the same temperature; ``jaxgrpo.models.log_probs`` gives the same
numbers): ``log_softmax(logits / temperature)`` over the *full* vocabulary, in float32, whatever
top-k/top-p filtering or suppressed ids restricted the draw. The train step therefore sees
``old_logp == log-probs(params at sampling time)`` up to float32 rounding: the PPO ratio is 1
on-policy.

One job, the built-in sampler, in over 600 lines: its settings (``SamplingConfig`` and the policy
every jitted sampler takes, ``SamplingPolicy``), its draw (``filter_logits``, ``sample_categorical``, ``block_draw``, ``draw_token``:
shared by the slot-refill, partial and conversation samplers) and its program (``generate``, ``lower_generate``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo import _checks
from jaxgrpo import models as _models
from jaxgrpo.models import lora as _lora
from jaxgrpo.models import moe as _moe
from jaxgrpo.models import quant as _quant
from jaxgrpo.models.log_probs import Temperature
from jaxgrpo.parallel.target import platform_of, target_platform

__all__ = [
  "Rollout",
  "SamplingConfig",
  "SamplingPolicy",
  "cache_slots",
  "categorical_from_uniform",
  "check_sampling",
  "filter_logits",
  "generate",
  "lower_generate",
  "sample_categorical",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
  """How completions are drawn: the settings argument of :func:`generate` and of every engine's
  ``Engine.generate`` (``jaxgrpo.rollout.engines``), and of ``jaxgrpo.loop.collect.sample``.

  The temperature is not here: it is the train step's ``TrainConfig.temperature`` (the rollout
  log-probs must refer to the temperature the step computes its log-probs at), a separate keyword of
  ``generate(model, prompt_tokens, prompt_mask, sampling, *, key, temperature=1.0)`` that
  ``jaxgrpo.loop.iteration.grpo_iteration`` passes through ``collect.sample``. The two meet once, where a
  sampler starts, in the :class:`SamplingPolicy` its jitted programs take.

  Attributes:
    num_samples: G, completions per prompt (the group size).
    max_new_tokens: T, the completion length budget of single-turn sampling (:func:`generate`,
      ``Engine.generate``, ``grpo_iteration``: required there). None (the default) for multi-turn sampling, whose token
      budgets are ``MultiTurnConfig``'s (``max_tokens``, ``turn_tokens``); a value given there is ignored.
    top_p, top_k: nucleus and top-k filtering (1.0 and 0: off).
    eos_ids: token ids that end a completion (empty: every completion has T tokens).
    pad_id: id written after the end of each completion.
    suppress_ids: token ids never sampled (None: the pad id unless it is also an EOS id; ``()``: none).
    merge_lora: sample a LoRA policy from ``models.lora.merge_lora(model)`` (a plain model: no
      adapter matmuls per token, but a merged copy of every adapted weight while sampling and one
      merge per call) instead of the adapted model (default). Ignored for a model without adapters.
      An engine samples the weights it was pushed: ``collect.engine_sample`` merges before the push, so
      an ``Engine.generate`` need not read this field (the built-in engine merges an adapted push itself).
    record_routing: record each token's experts (``Rollout.routing``: a mixture-of-experts policy's
      routing replay, ``jaxgrpo.models.moe``); ValueError from ``generate`` for a dense model. An engine
      that records no routing (vLLM) refuses it.
    quantize: None (default), ``"int8"`` or ``"fp8"``: the built-in samplers draw from
      ``models.lora.rollout_weights(model, quantize)`` — weight-only, one scale per output channel, made from the
      model's current arrays at every call (adapters merged first) — and record that policy's log-probs (μ, not
      the learner's π: the learner recomputes ``old_logp`` and TIS/MIS correct the gap; docs/sampling.md,
      "Quantized rollout weights"). ``"fp8"`` (e4m3) is refused for a model on the CPU (no fp8 dots there).
  """

  num_samples: int
  max_new_tokens: int | None = None
  top_p: float = 1.0
  top_k: int = 0
  eos_ids: tuple[int, ...] = ()
  pad_id: int = 0
  suppress_ids: tuple[int, ...] | None = None
  merge_lora: bool = False
  record_routing: bool = False
  quantize: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "eos_ids", tuple(self.eos_ids))
    if self.quantize is not None and self.quantize not in _quant.ROLLOUT_KINDS:
      raise ValueError(
        f"`quantize` must be None or one of {_quant.ROLLOUT_KINDS} (weight-only, per output channel); "
        f"got {self.quantize!r}"
      )
    if self.suppress_ids is not None:
      object.__setattr__(self, "suppress_ids", tuple(self.suppress_ids))
    for name in ("num_samples", "max_new_tokens"):
      v = getattr(self, name)
      if (v is not None or name == "num_samples") and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
        raise ValueError(
          f"`{name}` must be an int >= 1{' or None (multi-turn)' if name != 'num_samples' else ''}; got {v!r}"
        )

  def model_to_sample(self, model):
    """The model :func:`generate` samples from: with ``quantize``, ``models.lora.rollout_weights(model, quantize)``
    (adapters merged, projections quantised from the current arrays; ``"fp8"`` refused on the CPU in one line);
    else ``models.lora.merge_lora(model)`` when ``merge_lora`` and ``model`` has adapters, else ``model`` itself
    (also what ``jaxgrpo.loop.collect`` pushes to an engine)."""
    if self.quantize is not None:
      platform = platform_of(nnx.state(model))
      if self.quantize == "fp8" and platform == "cpu":
        raise ValueError(
          "SamplingConfig.quantize='fp8': the model is on the CPU, which has no fp8 dots (XLA would emulate them, "
          "slower than float32); use quantize='int8' there, or fp8 on a GPU/TPU"
        )
      return _lora.rollout_weights(model, self.quantize)
    return _lora.merge_lora(model) if self.merge_lora and _lora.has_adapters(model) else model

  def require_max_new_tokens(self, where: str) -> int:
    """``max_new_tokens``, or a ValueError naming ``where`` when it is None (single-turn sampling needs it)."""
    if self.max_new_tokens is None:
      raise ValueError(
        f"{where}: `SamplingConfig.max_new_tokens` is None; single-turn sampling needs the completion length budget "
        "(None is for multi-turn sampling only)"
      )
    return self.max_new_tokens


def cache_slots(prompt_len: int, max_new_tokens: int, num_draft: int = 0) -> int:
  """The KV-cache slots a sampler needs for ``prompt_len`` prompt slots and ``max_new_tokens`` new tokens:
  ``P + T - 1`` (the last sampled token is never fed back), ``+ k`` when speculating with k drafted tokens (a verify
  step may write k slots past the last kept one). Every built-in sampler sizes its cache by it."""
  return prompt_len + max_new_tokens - 1 + num_draft


def check_sampling(sampling, where: str) -> SamplingConfig:
  """``sampling``, or a TypeError naming ``where`` unless it is a :class:`SamplingConfig` (the one argument that
  carries the sampler's settings since the keyword form ``num_samples=, max_new_tokens=, ...`` was retired)."""
  if not isinstance(sampling, SamplingConfig):
    raise TypeError(
      f"{where}: `sampling` must be a jaxgrpo.rollout.sampling.SamplingConfig (num_samples, max_new_tokens, top_p, "
      f"top_k, eos_ids, pad_id, suppress_ids, merge_lora, record_routing, quantize); got {type(sampling).__name__}"
    )
  return sampling


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingPolicy:
  """What a jitted sampler draws with: a :class:`SamplingConfig`'s settings, checked and resolved against the
  model's vocabulary, **and the temperature** — the one static (hashable) argument of every jitted sampler
  (``generate``'s program, the slot-refill boundary of ``jaxgrpo.rollout.refill``, the partial pool's admit and
  decode programs, the conversation turn of ``jaxgrpo.rollout.conversation``). Built by :meth:`from_config`;
  passed to :func:`lower_generate`.

  A policy of its own rather than a ``temperature`` field on ``SamplingConfig``: the temperature belongs to the
  train step (``TrainConfig.temperature``; the rollout's log-probs must refer to the temperature the step
  recomputes them at), so the user's config does not carry a second copy that could disagree with it; the
  policy is derived from both once, where a sampler starts, and then travels as one value.

  Attributes:
    num_samples: G >= 1, samples per prompt.
    max_new_tokens: T >= 1, the completion budget (a conversation turn's own); None: multi-turn sampling.
    temperature: >= 0 (0 = greedy), a float.
    top_p: in (0, 1] (1 = off); top_k: >= 0 (0 = off).
    eos_ids: the token ids that end a completion, each in ``[0, vocab_size)``.
    pad_id: the id written after the end of each completion.
    suppress_ids: the ids never sampled, resolved (sorted; ``SamplingConfig.suppress_ids`` None: the pad id
      unless it is a stop id or outside the vocabulary).
    record_routing: record each token's experts (mixture of experts, ``Rollout.routing``).
  """

  num_samples: int
  max_new_tokens: int | None
  temperature: float
  top_p: float
  top_k: int
  eos_ids: tuple[int, ...]
  pad_id: int
  suppress_ids: tuple[int, ...]
  record_routing: bool = False

  @classmethod
  def from_config(
    cls, sampling: SamplingConfig, *, temperature: float, vocab_size: int, stop_ids=None, where: str = "SamplingPolicy"
  ) -> SamplingPolicy:
    """The :class:`SamplingPolicy` of ``sampling`` at ``temperature`` for a vocabulary of ``vocab_size`` ids: every
    setting checked (TypeError / ValueError in one line naming the field, e.g. ``top_p=0``, an id outside the
    vocabulary, ``suppress_ids`` that share an EOS id), ``suppress_ids`` resolved. ``stop_ids``: the ids the default
    ``suppress_ids`` is resolved against (None: ``sampling.eos_ids``; a conversation's turns stop at their own
    ids). ``where`` names the caller in a wrong-type message."""
    check_sampling(sampling, where)
    vocab_size = _checks.check_python_int(vocab_size, "vocab_size", minimum=1)
    eos_ids = _checks.check_token_ids(sampling.eos_ids, "eos_ids", vocab_size)
    pad_id = _checks.check_python_int(sampling.pad_id, "pad_id", minimum=0)
    stops = eos_ids if stop_ids is None else _checks.check_token_ids(tuple(stop_ids), "stop_ids", vocab_size)
    if not isinstance(sampling.record_routing, bool):
      raise TypeError(f"record_routing must be a bool; got {sampling.record_routing!r}")
    return cls(
      num_samples=_checks.check_python_int(
        sampling.num_samples, "num_samples", minimum=1, hint="G, samples per prompt"
      ),
      max_new_tokens=sampling.max_new_tokens,
      temperature=_checks.check_python_float(temperature, "temperature", at_least=0.0, hint="0 = greedy"),
      top_p=_check_top_p(sampling.top_p),
      top_k=_check_top_k(sampling.top_k),
      eos_ids=eos_ids,
      pad_id=pad_id,
      suppress_ids=_suppressed_ids(sampling.suppress_ids, pad_id, stops, vocab_size),
      record_routing=sampling.record_routing,
    )


class Rollout(NamedTuple):
  """The output of ``generate``. Row ``b*G + g`` is sample g of prompt b (N = B*G rows).

  Attributes:
    prompt_tokens: ``int32[N, P]`` — the prompt of each row (prompt b repeated G times), left-padded.
    prompt_mask: ``bool[N, P]`` — True on real prompt tokens (False on the left padding).
    completions: ``int32[N, T]`` — sampled tokens, right-padded with ``pad_id`` after the end. No
      real token is one of the ``suppress_ids`` of the call (by default the pad id).
    mask: ``bool[N, T]`` — True on real completion tokens: every token up to and including the first
      EOS (when one was sampled), all T tokens otherwise. ``mask[:, t]`` implies ``mask[:, t-1]``.
    log_probs: ``f32[N, T]`` — ``log π(token_t | prompt, tokens_<t)`` under the temperature-scaled
      softmax over the *full* vocabulary (suppressed and filtered ids included in the
      normalisation; see ``generate``); 0 where ``mask`` is False.
    group_ids: ``int32[N]`` — ``b`` for row ``b*G + g`` (which prompt the row belongs to).
    num_steps: ``int32[]`` — how many token positions the decode loop produced (≤ T; smaller when
      every row hit EOS early). Columns ≥ num_steps are padding in every row.
    routing: ``uint8/int16[N, P + T, M, k]`` — with ``SamplingConfig(record_routing=True)`` on a
      mixture of experts (``jaxgrpo.models.moe``, M sparse layers, top-k): the experts each sparse
      layer routed each token of ``[prompt ‖ completion]`` to while sampling (prompt columns from the
      prefill, completion token t from the decode step that fed it; the last completion column, never
      fed, is 0). The routing replay of the train step (``Batch.routing``). None otherwise.
    temperature: the temperature the rows were sampled at (a ``jaxgrpo.models.log_probs.Temperature``: a float that
      ``jax.tree.map`` and ``jit`` pass through), set by :func:`generate`; ``Batch.from_rollout`` carries it to
      the train step, which refuses log-probs of another temperature than its own. None: not known (a rollout
      built by hand or by an engine that does not say), not checked.
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  completions: jax.Array
  mask: jax.Array
  log_probs: jax.Array
  group_ids: jax.Array
  num_steps: jax.Array
  routing: jax.Array | None = None
  temperature: Temperature | None = None


def filter_logits(logits: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """Top-k then top-p (nucleus) filtering: removed tokens get -inf, kept ones keep their value.

  Applied to already temperature-scaled logits, in this order (as in transformers' sampling):
    1. top_k > 0: keep tokens whose logit is >= the k-th largest logit (ties at the k-th value are
       all kept); top_k = 0 keeps everything; top_k >= V keeps everything.
    2. top_p < 1: with p = softmax(logits after step 1), sorted descending, keep the smallest
       prefix whose total probability is >= top_p — i.e. token i of the sorted order is kept iff
       sum_{j<i} p_j < top_p (so the most likely token is always kept) — plus every token tied
       with the last kept logit.

  Both thresholds are found without sorting (XLA's CPU sort of a [128, 32000] array takes seconds):
  a 32-step bisection over the order-preserving uint32 images of the float32 logits finds the
  largest logit c with count(logits >= c) >= top_k, resp. mass(logits >= c) >= top_p; c is a
  logit of the row, and exactly the smallest kept one of the definitions above. Cost: 32 passes
  over [..., V] per filter.

  Args:
    logits: ``f32[..., V]`` (computed in float32; entries already at -inf stay removed).
    top_k: int >= 0 (static).
    top_p: float in (0, 1] (static).

  Returns:
    ``f32[..., V]``: the logits with removed entries set to -inf.
  """
  _checks.check_float(logits, "logits", "f32[..., V]")
  if not _checks.shape_of(logits):
    raise ValueError("`logits` must have a vocabulary axis (f32[..., V]); got a scalar")
  return _filter_logits(logits, top_k=_check_top_k(top_k), top_p=_check_top_p(top_p))


@functools.partial(jax.jit, static_argnames=("top_k", "top_p"))
def _filter_logits(logits, *, top_k, top_p):
  logits = jnp.asarray(logits, jnp.float32)
  vocab = logits.shape[-1]
  if 0 < top_k < vocab:
    # Float counts: a float where-sum is faster on CPU than an int/bool count (BENCHMARKS.md, "Sampler").
    threshold = _largest_passing_value(
      logits, lambda v: jnp.sum(jnp.where(logits >= v, 1.0, 0.0), -1, keepdims=True) >= top_k
    )
    logits = jnp.where(logits >= threshold, logits, -jnp.inf)
  if top_p < 1.0:
    probs = jax.nn.softmax(logits, axis=-1)
    threshold = _largest_passing_value(
      logits, lambda v: jnp.sum(jnp.where(logits >= v, probs, 0.0), -1, keepdims=True) >= top_p
    )
    logits = jnp.where(logits >= threshold, logits, -jnp.inf)
  return logits


def _to_ordered_uint32(x: jax.Array) -> jax.Array:
  """float32 -> uint32 with the same order (x < y iff key(x) < key(y)), for non-NaN x."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_ordered_uint32(key: jax.Array) -> jax.Array:
  """Inverse of `_to_ordered_uint32` (keys between those of -inf and +inf are non-NaN floats)."""
  bits = jnp.where(key >> 31 == 1, key ^ jnp.uint32(0x80000000), ~key)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_passing_value(x: jax.Array, passes) -> jax.Array:
  """Largest float32 v in [min(x), max(x)] (per row, [..., 1]) with passes(v) True.

  `passes` must be monotone (True up to some v*, False above) and True at min(x); when v* is
  where a count or mass over {x >= v} drops, v* is an element of x. Bisection over the ordered
  uint32 images of the floats: 32 steps cover every float exactly.
  """
  lo = _to_ordered_uint32(jnp.min(x, axis=-1, keepdims=True))
  hi = _to_ordered_uint32(jnp.max(x, axis=-1, keepdims=True))

  def step(_, bounds):
    lo, hi = bounds
    gap = hi - lo
    mid = lo + (gap >> 1) + (gap & 1)  # ceil((lo + hi) / 2) without overflow
    ok = passes(_from_ordered_uint32(mid))
    return jnp.where(ok, mid, lo), jnp.where(ok | (mid == lo), hi, mid - 1)

  lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
  return _from_ordered_uint32(lo)


def _block_size(vocab: int) -> int:
  """A block length near sqrt(V) for `sample_categorical`: the divisor of V closest to sqrt(V)
  within a factor 2 (no padding copy of the [N, V] probabilities), else ceil(sqrt(V))."""
  root = max(1, math.isqrt(vocab - 1) + 1)
  divisors = [d for d in range(max(1, root // 2), 2 * root + 1) if vocab % d == 0]
  return min(divisors, key=lambda d: abs(d - root)) if divisors else root


def sample_categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
  """One draw per row from softmax(logits), by inverting the CDF with a single uniform per row.

  Equivalent in distribution to `jax.random.categorical(key, logits)` (entries at -inf are never
  drawn), but it needs N random numbers instead of N*V Gumbel draws, which dominate a decode
  step on CPU (BENCHMARKS.md, "Sampler"). The vocabulary is cut into
  ~sqrt(V) blocks: the block is found from the cumulative block masses, then the token within
  the block from the block's own cumulative mass, so every cumulative sum is short (float32
  rounding ~1e-7 relative; XLA's CPU cumsum is also slow on long axes). With u ~ U[0, 1) and
  target = (1 - u) * total in (0, total], the first index whose cumulative mass reaches the
  target always has positive probability. Resolution: probabilities below ~1e-7 of the row's
  mass are not reproduced exactly (as with the float32 Gumbel sampler).

  Args:
    key: a PRNG key.
    logits: ``f32[N, V]``, unnormalised; -inf for impossible tokens (at least one finite per row).

  Returns:
    ``int32[N]``.
  """
  _checks.check_float(logits, "logits", "f32[N, V]")
  _checks.check_rank(logits, 2, "logits", "f32[N, V]")
  return _sample_categorical(key, logits)


@jax.jit
def _sample_categorical(key, logits):
  return categorical_from_uniform(jax.random.uniform(key, (logits.shape[0],), jnp.float32), logits)


def categorical_from_uniform(u, logits):
  """``sample_categorical`` given its uniforms ``u f32[N]`` in [0, 1) (one per row)."""
  return block_draw(u, logits)[0]


def block_draw(u, logits, suppress_ids: tuple[int, ...] = ()):
  """The draw of :func:`categorical_from_uniform` from ``logits`` with the ``suppress_ids`` removed (as if they were
  -inf), and the two row statistics it computes on the way.

  The vocabulary is cut into ``nb`` blocks of ``~sqrt(V)`` ids. With ``m`` the row maximum over the ids not
  suppressed, the block masses ``sum(exp(logits - m))`` are reduced straight from the logits (one pass; neither the
  ``[N, V]`` probabilities nor a masked copy of the logits is written): only the few blocks that hold a suppressed
  id (static) are gathered and summed again without it. The block ``b`` holding ``target = (1 - u) * total`` is
  found from the cumulative block masses, and only that block's probabilities are recomputed from its logits for
  the token inside it. The same numbers as masking, then writing the probabilities out: ``exp(logits - m)``
  elementwise (0 on a suppressed id), summed per block.

  Args:
    u: ``f32[N]`` in [0, 1), one uniform per row.
    logits: ``f32[N, V]``, unnormalised; -inf for impossible tokens (at least one finite per row outside
      ``suppress_ids``).
    suppress_ids: static ids never drawn (sorted, each in ``[0, V)``).

  Returns:
    ``(token int32[N], m f32[N], total f32[N])``: the draw, the row maximum and ``sum exp(logits_v - m)`` over the
    ids not suppressed (:func:`logsumexp_from_draw` turns them into the log-prob's normaliser).
  """
  n, vocab = logits.shape
  block = _block_size(vocab)
  num_blocks = -(-vocab // block)
  if num_blocks * block != vocab:
    logits = jnp.pad(logits, ((0, 0), (0, num_blocks * block - vocab)), constant_values=-jnp.inf)
  blocks = logits.reshape(n, num_blocks, block)
  held = np.zeros(num_blocks * block, bool)
  held[list(suppress_ids)] = True
  held = held.reshape(num_blocks, block)  # [nb, block], True on a suppressed id
  fix = np.flatnonzero(held.any(axis=1))  # the blocks that hold one (static, few)
  fixed = jnp.where(held[fix], -jnp.inf, blocks[:, fix])  # [N, F, block]
  block_max = jnp.max(blocks, axis=-1)  # [N, nb]
  if fix.size:
    block_max = block_max.at[:, fix].set(jnp.max(fixed, axis=-1))
  m = jnp.max(block_max, axis=-1, keepdims=True)  # [N, 1]
  block_mass = jnp.sum(jnp.exp(blocks - m[:, :, None]), axis=-1)  # [N, nb], 0 where -inf
  if fix.size:
    block_mass = block_mass.at[:, fix].set(jnp.sum(jnp.exp(fixed - m[:, :, None]), axis=-1))
  cum = jnp.cumsum(block_mass, axis=-1)  # inclusive
  before = jnp.concatenate([jnp.zeros((n, 1), cum.dtype), cum[:, :-1]], axis=-1)  # exclusive
  target = (1.0 - u) * cum[:, -1]  # (0, total]
  b = jnp.minimum(jnp.sum(cum < target[:, None], axis=-1), num_blocks - 1)  # [N]
  take = lambda x: jnp.take_along_axis(x, b[:, None], axis=-1)[:, 0]
  # Position of the target inside block b, as a fraction of the block's mass: U(0, 1] given b.
  frac = jnp.clip((target - take(before)) / take(block_mass), 0.0, 1.0)
  inner = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]  # [N, block], block b's logits
  if fix.size:
    inner = jnp.where(jnp.asarray(held)[b], -jnp.inf, inner)
  inner_cum = jnp.cumsum(jnp.exp(inner - m), axis=-1)
  inner_target = jnp.maximum(frac * inner_cum[:, -1], jnp.finfo(jnp.float32).tiny)
  j = jnp.minimum(jnp.sum(inner_cum < inner_target[:, None], axis=-1), block - 1)
  return (b * block + j).astype(jnp.int32), m[:, 0], cum[:, -1]


def logsumexp_from_draw(scaled, m, total, suppress_ids: tuple[int, ...]):
  """``logsumexp(scaled)`` per row (``f32[N]``) from what :func:`block_draw` computed over ``scaled f32[N, V]``
  without the ``suppress_ids``: its row maximum ``m f32[N]`` and ``total = sum_{v not suppressed}
  exp(scaled_v - m)``, plus the suppressed ids' own terms gathered from ``scaled f32[N, V]`` (a few columns, not a
  pass over V):

      logsumexp(scaled) = M + log(total * exp(m - M) + sum_{s in suppress_ids} exp(scaled_s - M)),
      M = max(m, max_s scaled_s)

  (no suppressed ids: ``m + log(total)``, the usual max-shifted formula)."""
  if not suppress_ids:
    return m + jnp.log(total)
  held = scaled[:, np.asarray(suppress_ids)]  # [N, S]
  big = jnp.maximum(m, jnp.max(held, axis=-1))
  return big + jnp.log(total * jnp.exp(m - big) + jnp.sum(jnp.exp(held - big[:, None]), axis=-1))


def generate(
  model: nnx.Module,
  prompt_tokens: jax.Array,
  prompt_mask: jax.Array,
  sampling: SamplingConfig,
  *,
  key: jax.Array,
  temperature: float = 1.0,
) -> Rollout:
  """Samples ``sampling.num_samples`` completions per prompt with a KV cache, in one jitted program.

  Each prompt is prefilled once (B rows) and its cache shared by its G samples (``repeat_cache``).
  The decode loop is a ``lax.while_loop`` producing one token per row per step; it stops once
  every row has finished (sampled one of ``eos_ids``, or reached ``max_new_tokens``).

  Token t of a row is drawn from the *sampling distribution*: the logits of the ``suppress_ids``
  are set to -inf (the sampler never emits them), then

    * temperature > 0: ``softmax(filter_logits(logits_t / temperature, top_k, top_p))``, with
      ``sample_categorical`` (one uniform per row) and the key ``fold_in(key, t)``;
    * temperature == 0: ``argmax(logits_t)`` over the ids not suppressed (greedy; top_k/top_p are
      irrelevant).

  Its *reported* log-prob (``Rollout.log_probs``) is ``log_softmax(logits_t / temperature)[token]``
  in float32 over the **full** vocabulary — not over the suppressed or filtered distribution it was
  drawn from. That is the policy the train step optimises and recomputes
  (``jaxgrpo.step.train.completion_log_probs`` at the same temperature) without knowing which ids were
  suppressed, so the PPO ratio is exactly 1 on-policy and no mask has to travel with the batch. The
  price, as with top-k/top-p: the tokens are not distributed as these log-probs say (the
  suppressed mass is redistributed over the other ids), which matters only to estimators that
  reweight by the sampler's own probabilities. With temperature == 0 the log-probs are those of
  the unscaled softmax, ``log_softmax(logits_t)[token]`` (temperature 1).

  Positions follow the contract: prompt token i of a row is at position ``cumsum(mask)[i] - 1``, and
  completion token t at position (number of real prompt tokens) + t.

  Args:
    model: a ``jaxgrpo.models`` decoder (any family); with ``sampling.merge_lora`` and adapters, the draw is
      from ``models.lora.merge_lora(model)`` (:meth:`SamplingConfig.model_to_sample`).
    prompt_tokens: ``int32[B, P]``, left-padded prompts (B >= 1, P >= 1).
    prompt_mask: ``bool[B, P]``, True on real tokens; each row is False...False True...True with at
      least one True.
    sampling: a :class:`SamplingConfig`; its fields are the sampler's settings:

      * ``num_samples``: G >= 1, samples per prompt.
      * ``max_new_tokens``: T >= 1, completion length budget (required here: None is multi-turn only).
      * ``top_p``: nucleus mass in (0, 1] (1 = off); ``top_k``: >= 0 (0 = off).
      * ``eos_ids``: token ids that end a completion (included in the completion and its mask). Empty:
        every completion has exactly T tokens.
      * ``pad_id``: int >= 0, the id written after the end of each completion.
      * ``suppress_ids``: token ids the sampler must never emit (each in ``[0, vocab_size)``, not an EOS id,
        not the whole vocabulary). None (default): ``(pad_id,)`` when the pad id is in the vocabulary
        and not one of ``eos_ids`` — so a real token can never be mistaken for padding — else ``()``.
        ``()`` allows every id.
      * ``merge_lora``: see ``model``.
      * ``record_routing``: record the experts of every token in ``Rollout.routing`` (a mixture-of-experts
        model only: ValueError for a dense one). The sampled tokens do not change.
    key: a PRNG key (typed ``jax.random.key`` or raw ``uint32[2]``); same key => same rollout.
    temperature: >= 0 (0 = greedy); the train step's ``TrainConfig.temperature`` when training.

  Returns:
    A ``Rollout`` with N = B*G rows; row b*G + g is sample g of prompt b; ``temperature`` is ``temperature``.

  Raises:
    TypeError: a wrong type or dtype (e.g. float prompt tokens, ``num_samples=2.0``, a string id).
    ValueError: a wrong shape or value (e.g. a mask that is not left-padded, ``top_p=0``, an id
      outside the vocabulary, ``P + T > max_position_embeddings``).
  """
  prompt_tokens, prompt_mask = _checks.check_prompts(prompt_tokens, prompt_mask)
  policy = SamplingPolicy.from_config(
    sampling, temperature=temperature, vocab_size=model.config.vocab_size, where="generate"
  )
  key = _checks.check_prng_key(key)
  if policy.record_routing and not _moe.is_moe(model):
    raise ValueError(
      f"record_routing=True needs a mixture-of-experts model (jaxgrpo.models.moe); got {type(model).__name__}"
    )
  graphdef, state = split_sampled(sampling.model_to_sample(model), prompt_tokens.shape, policy, "generate")
  with target_platform(state):  # the program of the devices that hold the model (docs/models.md, "Target platform")
    rollout = _generate_jit(graphdef, state, prompt_tokens, prompt_mask, key, policy=policy)
  return rollout._replace(temperature=Temperature(policy.temperature))


def lower_generate(
  model: nnx.Module,
  prompt_tokens,
  prompt_mask,
  policy: SamplingPolicy,
  *,
  key,
  mesh: jax.sharding.Mesh | None = None,
) -> jax.stages.Lowered:
  """The program :func:`generate` runs, lowered (traced, not compiled) for these inputs, which may be abstract:
  nothing is allocated, so a program for devices this host cannot run on (a TPU slice from
  ``jax.experimental.topologies``, ``jaxgrpo.plan``) is built from ``jax.ShapeDtypeStruct`` s with shardings.
  ``.compile()`` it for the executable and its ``memory_analysis()``; ``.as_text()`` is the StableHLO.

  The same program as ``generate(model, prompt_tokens, prompt_mask, sampling, key=key, temperature=t)`` for
  ``policy = SamplingPolicy.from_config(sampling, temperature=t, vocab_size=...)`` and arrays of these shapes, dtypes and
  placements (``generate`` runs ``_generate_jit`` with exactly these arguments; tests/test_sampling_policy.py
  compares the two StableHLO texts).

  Args:
    model: the model sampled (``SamplingConfig.model_to_sample``: merge the adapters first for ``merge_lora``),
      real or abstract (``nnx.eval_shape``, or ``nnx.merge(graphdef, abstract_state)``).
    prompt_tokens: ``int32[B, P]``; prompt_mask: ``bool[B, P]`` — arrays or ``jax.ShapeDtypeStruct`` s (only
      shapes, dtypes and shardings are read; no layout check).
    policy: a :class:`SamplingPolicy` with ``max_new_tokens`` set (:meth:`SamplingPolicy.from_config`).
    key: a PRNG key or its ``jax.ShapeDtypeStruct`` (typed key ``[]`` or raw ``uint32[2]``).
    mesh: the mesh the program runs on: traced inside ``jax.set_mesh(mesh)``, for the platform of its devices
      (``jaxgrpo.parallel.target``); None: for the platform of the model's arrays, as ``generate`` traces it.

  Returns:
    A ``jax.stages.Lowered``.

  Raises:
    TypeError / ValueError: in one line, before tracing: ``policy`` not a ``SamplingPolicy``, a wrong rank,
      dtype or shape of the prompts or key, ``P + T`` over the model's positions, routing on a dense model.
  """
  if not isinstance(policy, SamplingPolicy):
    raise TypeError(
      f"lower_generate: `policy` must be a jaxgrpo.rollout.sampling.SamplingPolicy (SamplingPolicy.from_config(sampling, "
      f"temperature=..., vocab_size=...)); got {type(policy).__name__}"
    )
  _check_prompt_specs(prompt_tokens, prompt_mask, key)
  graphdef, state = split_sampled(model, tuple(prompt_tokens.shape), policy, "lower_generate")
  scope = target_platform(state) if mesh is None else jax.set_mesh(mesh)
  with scope:
    return _generate_jit.lower(graphdef, state, prompt_tokens, prompt_mask, key, policy=policy)


def split_sampled(model, prompt_shape: tuple[int, int], policy: SamplingPolicy, where: str):
  """``nnx.split(model)`` once ``policy`` can sample it: ``max_new_tokens`` set, prompt + completion within the
  model's positions, routing recorded only for a mixture of experts (ValueError in one line, naming ``where``)."""
  if policy.max_new_tokens is None:
    raise ValueError(
      f"{where}: `SamplingConfig.max_new_tokens` is None; single-turn sampling needs the completion length budget "
      "(None is for multi-turn sampling only)"
    )
  check_fits_model(prompt_shape[1], policy.max_new_tokens, model.config)
  if policy.record_routing and not _moe.is_moe(model):
    raise ValueError(
      f"record_routing=True needs a mixture-of-experts model (jaxgrpo.models.moe); got {type(model).__name__}"
    )
  return nnx.split(model)


def check_fits_model(prompt_len: int, max_new_tokens: int, config) -> None:
  """ValueError in one line unless a prompt of ``prompt_len`` slots plus ``max_new_tokens`` completion tokens fit
  the ``max_position_embeddings`` of the model ``config`` (``jaxgrpo._checks.check_positions``)."""
  _checks.check_positions(
    [(f"prompt length {prompt_len}", prompt_len), (f"max_new_tokens {max_new_tokens}", max_new_tokens)],
    config.max_position_embeddings,
    "the model (max_position_embeddings)",
    "shorten the prompts or lower SamplingConfig.max_new_tokens",
  )


def _check_prompt_specs(prompt_tokens, prompt_mask, key) -> None:
  """Rank, dtype and shape of abstract sampler inputs (``jax.ShapeDtypeStruct`` or arrays): ``int32[B, P]``
  tokens, a ``bool[B, P]`` mask, a typed ``[]`` or raw ``uint32[2]`` key."""
  for x, name, dtype, want in (
    (prompt_tokens, "prompt_tokens", jnp.int32, "int32[B, P]"),
    (prompt_mask, "prompt_mask", jnp.bool_, "bool[B, P]"),
  ):
    if len(x.shape) != 2 or 0 in x.shape or x.dtype != dtype:
      raise ValueError(f"`{name}` must be {want} with B, P >= 1; got {x.dtype}{list(x.shape)}")
  if tuple(prompt_mask.shape) != tuple(prompt_tokens.shape):
    raise ValueError(
      f"`prompt_mask` must have the shape of `prompt_tokens` {list(prompt_tokens.shape)}; got {list(prompt_mask.shape)}"
    )
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  if (typed and tuple(key.shape) != ()) or (not typed and (key.dtype != jnp.uint32 or tuple(key.shape) != (2,))):
    raise ValueError(f"`key` must be a single PRNG key (typed [] or raw uint32[2]); got {key.dtype}{list(key.shape)}")


def draw_token(logits, uniforms, policy: SamplingPolicy, suppressed):
  """One token per row of ``logits f32[N, V]`` from the sampling distribution of :func:`generate` under
  ``policy`` (its temperature, top-k, top-p), and its log-prob under the full temperature-scaled softmax:
  ``(token int32[N], log-prob f32[N])``. ``uniforms()`` gives the draw's ``f32[N]`` uniforms (not called when
  greedy); ``suppressed``: None or a constant bool[V] (:func:`suppressed_mask` of ``policy.suppress_ids``).

  Without top-k/top-p (GRPO's untruncated policy) the draw is :func:`block_draw` over ``logits / temperature`` with
  the suppressed ids left out, and the log-prob's normaliser ``logsumexp(logits / temperature)`` comes from the
  same pass (:func:`logsumexp_from_draw`): the head's logits are the step's only ``[N, V]`` array (BENCHMARKS.md,
  "Sampler"). With filtering, the filtered logits are drawn from and the normaliser is its own logsumexp."""
  temperature, top_k, top_p = policy.temperature, policy.top_k, policy.top_p
  scaled = logits if temperature == 0.0 else logits / temperature  # [N, V]
  allowed = scaled if suppressed is None else jnp.where(suppressed, -jnp.inf, scaled)
  if temperature == 0.0:
    token = jnp.argmax(allowed, axis=-1).astype(jnp.int32)
    lse = jax.nn.logsumexp(scaled, axis=-1)
  elif top_k == 0 and top_p == 1.0:  # the untruncated policy (GRPO's): the draw's own pass gives the logsumexp
    token, m, total = block_draw(uniforms(), scaled, policy.suppress_ids)
    lse = logsumexp_from_draw(scaled, m, total, policy.suppress_ids)
  else:
    token = categorical_from_uniform(uniforms(), _filter_logits(allowed, top_k=top_k, top_p=top_p))
    lse = jax.nn.logsumexp(scaled, axis=-1)
  chosen = jnp.take_along_axis(scaled, token[:, None], axis=-1)[:, 0]
  return token, chosen - lse


def decode_logits(model, last, pos, active, cache):
  """One decode step of ``N`` rows: token ``last int32[N]`` fed at position ``pos int32[N]`` (rows not
  ``active bool[N]`` masked out of the cache) -> (the next token's logits ``f32[N, V]``, the cache)."""
  hidden, cache = model(last[:, None], pos[:, None], attention_mask=active[:, None], cache=cache)
  return model.logits(hidden[:, 0], out_dtype=jnp.float32), cache


def write_token(t, token, logp, buffers, pad_id):
  """Token ``t`` of every row (``token int32[N]``, ``logp f32[N]``) into ``buffers = (tokens int32[N, T], logps
  f32[N, T], lengths int32[N], done bool[N])``: pad / 0 where a row is done. Returns (tokens, logps, lengths,
  the token written)."""
  tokens, logps, lengths, done = buffers
  token = jnp.where(done, pad_id, token)
  tokens = jax.lax.dynamic_update_index_in_dim(tokens, token, t, axis=1)
  logps = jax.lax.dynamic_update_index_in_dim(logps, jnp.where(done, 0.0, logp), t, axis=1)
  return tokens, logps, lengths + (~done).astype(jnp.int32), token


def is_eos(token, eos_ids):
  """``bool[N]``: whether each of ``token int32[N]`` is one of ``eos_ids`` (a static tuple; empty: never)."""
  if not eos_ids:
    return jnp.zeros(token.shape, bool)
  return jnp.any(token[:, None] == jnp.asarray(eos_ids, jnp.int32)[None, :], axis=-1)


def suppressed_mask(suppress_ids, vocab: int):
  """A constant bool[V] of the suppressed ids (one fused select per step, not a scatter), or None."""
  if not suppress_ids:
    return None
  mask = np.zeros(vocab, bool)
  mask[list(suppress_ids)] = True
  return mask


def _check_top_p(top_p) -> float:
  return _checks.check_python_float(top_p, "top_p", above=0.0, at_most=1.0, hint="1 = no nucleus filtering")


def _check_top_k(top_k) -> int:
  return _checks.check_python_int(top_k, "top_k", minimum=0, hint="0 = no top-k filtering")


def _suppressed_ids(suppress_ids, pad_id: int, eos_ids: tuple[int, ...], vocab_size: int) -> tuple[int, ...]:
  """The sorted, de-duplicated ids ``generate`` must never emit (see its ``suppress_ids``)."""
  if suppress_ids is None:
    return (pad_id,) if pad_id < vocab_size and pad_id not in eos_ids else ()
  ids = tuple(sorted(set(_checks.check_token_ids(suppress_ids, "suppress_ids", vocab_size))))
  both = sorted(set(ids) & set(eos_ids))
  if both:
    raise ValueError(
      f"`suppress_ids` and `eos_ids` share {both}: an id cannot both end a completion and never be emitted"
    )
  if len(ids) == vocab_size:
    raise ValueError(f"`suppress_ids` covers the whole vocabulary ({vocab_size} ids): nothing left to sample")
  return ids


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("policy",))
def _generate_jit(graphdef, state, prompt_tokens, prompt_mask, key, *, policy: SamplingPolicy) -> Rollout:
  """``generate``'s program: G samples of each prompt under ``policy`` (the one static argument besides the
  graph definition)."""
  num_samples, max_new_tokens, pad_id = policy.num_samples, policy.max_new_tokens, policy.pad_id
  model = nnx.merge(graphdef, state)
  # A scanned layer stack (scan_layers) is unstacked here, once per call, outside the decode loop: a scan inside
  # it would slice (copy) every layer's weights out of the stack at every token, and decoding reads the weights
  # once per token anyway (Qwen3 D=1024, 4 layers, bf16, CPU: 1.19x slower scanned; BENCHMARKS.md, "Compile
  # time at depth"). Same values as the loop model: this is the loop model, built in the program.
  model = _models.to_loop_layers(model) if getattr(model, "scan_layers", False) else model
  batch, prompt_len = prompt_tokens.shape
  n_rows = batch * num_samples

  # Prefill: B rows, once per prompt. The last prompt column is real (left padding), so its
  # hidden state gives the logits of the first completion token.
  positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1, dtype=jnp.int32) - 1, 0)  # [B, P]
  cache = model.init_cache(batch, cache_slots(prompt_len, max_new_tokens))
  with _moe.routing_scope() as scope:
    hidden, cache = model(prompt_tokens, positions, attention_mask=prompt_mask, cache=cache)
  routes = None
  if policy.record_routing:  # [N, T, M, k] for the completion tokens, filled by the decode loop
    prompt_routes = jnp.repeat(scope.stacked().experts, num_samples, axis=0)  # [N, P, M, k]
    routes = jnp.zeros((n_rows, max_new_tokens) + prompt_routes.shape[2:], jnp.int32)
  first_logits = model.logits(hidden[:, -1], out_dtype=jnp.float32)  # [B, V]
  cache = _models.repeat_cache(cache, num_samples)  # [N, ...]
  first_logits = jnp.repeat(first_logits, num_samples, axis=0)  # [N, V]
  # Position of completion token 0 in every row.
  start_pos = jnp.repeat(jnp.sum(prompt_mask, axis=1, dtype=jnp.int32), num_samples)  # [N]

  suppressed = suppressed_mask(policy.suppress_ids, first_logits.shape[-1])

  def sample(t, logits):
    """logits f32[N, V] for step t -> (token int32[N], log-prob f32[N] under the full softmax)."""
    uniforms = lambda: jax.random.uniform(jax.random.fold_in(key, t), (logits.shape[0],), jnp.float32)
    return draw_token(logits, uniforms, policy, suppressed)

  def record(t, logits, carry):
    """Samples token t and writes it into the carry's buffers (pad / 0 for finished rows)."""
    tokens, logps, lengths, token = write_token(t, *sample(t, logits), carry, pad_id)
    return tokens, logps, lengths, carry[3] | is_eos(token, policy.eos_ids), token

  buffers = (
    jnp.full((n_rows, max_new_tokens), pad_id, jnp.int32),  # tokens
    jnp.zeros((n_rows, max_new_tokens), jnp.float32),  # log-probs
    jnp.zeros((n_rows,), jnp.int32),  # lengths (real tokens so far)
    jnp.zeros((n_rows,), bool),  # done
  )
  *buffers, last_token = record(0, first_logits, buffers)

  def cond(loop_carry):
    t, _, _, buffers, _ = loop_carry
    return (t < max_new_tokens) & ~jnp.all(buffers[3])

  def body(loop_carry):
    t, cache, last_token, buffers, routes = loop_carry
    done = buffers[3]
    # Feed token t-1 (at position start + t - 1) to get the logits of token t.
    with _moe.routing_scope() as scope:
      logits, cache = decode_logits(model, last_token, start_pos + t - 1, ~done, cache)  # [N, V]
    if routes is not None:  # the experts of completion token t-1
      routes = jax.lax.dynamic_update_index_in_dim(routes, scope.stacked().experts[:, 0], t - 1, axis=1)
    *buffers, last_token = record(t, logits, buffers)
    return t + 1, cache, last_token, tuple(buffers), routes

  num_steps, _, _, (tokens, logps, lengths, _), routes = jax.lax.while_loop(
    cond, body, (jnp.int32(1), cache, last_token, tuple(buffers), routes)
  )
  if routes is not None:
    routes = jnp.concatenate([prompt_routes, routes], axis=1).astype(_moe.replay_dtype(model.config.num_experts))
  mask = jnp.arange(max_new_tokens, dtype=jnp.int32)[None, :] < lengths[:, None]  # [N, T]
  return Rollout(
    prompt_tokens=jnp.repeat(prompt_tokens, num_samples, axis=0),
    prompt_mask=jnp.repeat(prompt_mask, num_samples, axis=0),
    completions=tokens,
    mask=mask,
    log_probs=logps,
    group_ids=jnp.repeat(jnp.arange(batch, dtype=jnp.int32), num_samples),
    num_steps=num_steps,
    routing=routes,
  )
