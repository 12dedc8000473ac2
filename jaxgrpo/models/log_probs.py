"""Per-token log-probabilities (and entropies) without materialising the float32 ``[B, T, V]`` logits.
One job: the policy's log-probs of given tokens — one chunked head kernel and the entry points that feed it —
and the temperature they refer to (:class:`Temperature`, :func:`check_temperature`, below the samplers and the step).

One kernel, :func:`chunked_log_probs`, computes ``log_softmax(logits / temperature)[target]`` and,
optionally, the entropy of that distribution, one chunk of positions at a time, with its own gradient
(:func:`head_log_probs`: the backward pass recomputes a chunk's logits and needs nothing else but the
chunk's logsumexp). Everything else here calls it: :func:`token_log_probs` (hidden states in),
:func:`log_probs` (a token sequence in) and :func:`completion_log_probs` (prompts and completions in:
the train step's and the reference pass's path) and :func:`packed_log_probs` (the same for packed
rows, ``jaxgrpo.step.packing.PackedSlots``).

**Forward mode.** The head kernel and the model's attention softmax and SwiGLU have hand-written
reverse-mode gradients (``jax.custom_vjp``), which JAX cannot differentiate in forward mode. Every
function here takes ``forward_mode=True`` (default False) to trace them as plain autodiff instead
(``jaxgrpo.models.layers.forward_mode_autodiff``): the same values, and ``jax.jvp`` /
``jax.linearize`` / ``jax.jacfwd`` work through it (Fisher- or Hessian-vector products, natural
gradients); reverse mode then needs more temporary memory.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from jaxgrpo import _checks
from jaxgrpo.models.base import CausalLM, head_logits, positions_from_mask
from jaxgrpo.models.layers import forward_mode_active, forward_mode_autodiff
from jaxgrpo.parallel.target import current_platform

__all__ = [
  "Temperature",
  "check_temperature",
  "chunked_log_probs",
  "chunked_top_k",
  "chunked_topk_log_probs",
  "completion_log_probs",
  "head_log_probs",
  "log_probs",
  "logprob_temperature",
  "packed_log_probs",
  "token_dropout_keys",
  "token_log_probs",
]


@jax.tree_util.register_static
class Temperature(float):
  """The temperature a rollout was sampled at, as ``Rollout.temperature`` and ``Batch.temperature`` carry it: a
  ``float`` that is a pytree node without leaves, so ``jax.tree.map``, ``jit`` and ``device_put`` pass it through
  unchanged (a plain float would be a leaf: sliced, concatenated and traced like the arrays)."""

  def __repr__(self) -> str:
    return f"Temperature({float(self)!r})"


def logprob_temperature(temperature: float) -> float:
  """The temperature that log-probs sampled at ``temperature`` refer to: ``temperature`` itself, or 1 for greedy
  sampling (0: the sampler reports the unscaled softmax, ``jaxgrpo.rollout.sampling.generate``)."""
  return 1.0 if float(temperature) == 0.0 else float(temperature)


def check_temperature(sampled_at, step_temperature: float, what: str, fix: str) -> None:
  """ValueError in one line when log-probs sampled at ``sampled_at`` (None: unknown, not checked) do not refer to
  ``step_temperature`` (``TrainConfig.temperature``): the step would compute its ratio against log-probs of
  another distribution (the first, supposedly on-policy, update already off 1). ``what`` names the source,
  ``fix`` the remedy."""
  if sampled_at is None or logprob_temperature(sampled_at) == logprob_temperature(step_temperature):
    return
  greedy = " (greedy: log-probs at temperature 1)" if float(sampled_at) == 0.0 else ""
  raise ValueError(
    f"{what} was sampled at temperature {float(sampled_at)!r}{greedy}, but the train step's "
    f"TrainConfig.temperature is {float(step_temperature)!r}: its log-probs are not the step's, so the ratio "
    f"π_θ/π_old would be off 1 before any update; {fix}"
  )


_JVP_ERROR = "can't apply forward-mode autodiff"


def _forward_mode_hint(fn):
  """``fn`` re-raising JAX's "can't apply forward-mode autodiff (jvp) to a custom_vjp function" with the
  fix: the hand-written reverse-mode gradients are traced as plain autodiff with ``forward_mode=True``."""
  fix = (
    "forward_mode=True"
    if fn.__name__ != "packed_log_probs"
    else "`with jaxgrpo.models.layers.forward_mode_autodiff():`"
  )

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except TypeError as e:
      if _JVP_ERROR not in str(e) or "forward_mode" in str(e):
        raise
      raise TypeError(
        f"{fn.__name__}: jax.jvp / jax.linearize / jax.jacfwd cannot go through the default log-probs (their "
        f"head, attention softmax and SwiGLU have reverse-mode-only custom VJPs): call it with {fix} "
        f"(the same values, plain autodiff). JAX said: {e}"
      ) from e

  return wrapper


def _check_chunk_size(chunk_size) -> None:
  if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0):
    raise ValueError(f"`chunk_size` must be a positive int or None; got {chunk_size!r}")


def head_log_probs(
  w: jax.Array,
  hidden: jax.Array,
  targets: jax.Array,
  *,
  tied: bool,
  dtype,
  temperature: float | jax.Array = 1.0,
  with_entropy: bool = False,
  entropy_grad: bool = False,
  keep_logits: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
  """Log-probs of ``targets`` (and the entropy) under the LM head ``w``, with a hand-written gradient.

  With ``z = head_logits(w, hidden) / temperature`` in float32 (``jaxgrpo.models.base.head_logits``:
  ``w`` is the tied embedding ``[V, D]`` when ``tied``, else ``[D, V]``)::

      logp[b, t]    = z[targets[b, t]] - lse,           lse = logsumexp(z)
      entropy[b, t] = lse - Σ_v p_v · z_v,              p = softmax(z) = exp(z - lse)

  The forward pass keeps only ``lse`` (and the entropy) per position; the backward pass recomputes
  ``z`` (one matmul) and forms the logits' cotangent in one elementwise pass from the saved ``lse``
  (no second max / sum over the vocabulary, no scatter). With ``keep_logits`` the forward pass keeps ``z``
  itself instead (``[B, C, V]`` float32 until the backward pass) and the backward pass skips the recompute: one
  head matmul less for ``B·C·V·4`` bytes more (``TrainConfig.head_logits``)::

      ∂logp/∂z_v    = [v = target] - p_v
      ∂entropy/∂z_v = -p_v · (z_v - (lse - entropy))        (only with ``entropy_grad``)

  then ``∂/∂w`` and ``∂/∂hidden`` by the head matmul's own transpose. Without ``entropy_grad`` the
  entropy is a metric: its cotangent is ignored (it has no gradient).

  Args:
    w: the head weight (``CausalLM.head_weight``).
    hidden: ``[B, C, D]`` hidden states (compute dtype).
    targets: ``int32[B, C]`` the token scored at each position.
    tied, dtype: as ``head_logits`` takes them (static).
    temperature: positive scalar dividing the logits (no gradient).
    with_entropy: also return the entropy (static).
    entropy_grad: differentiate the entropy too (static; requires ``with_entropy``).
    keep_logits: keep the chunk's logits for the backward pass instead of recomputing them (static).

  Returns:
    ``(logp f32[B, C], entropy f32[B, C] or None)``.
  """
  if w.ndim != 2:
    raise ValueError(f"`w` must be the head weight [V, D] (tied) or [D, V]; got shape {w.shape}")
  d = w.shape[1] if tied else w.shape[0]
  if hidden.ndim != 3 or hidden.shape[-1] != d:
    raise ValueError(f"`hidden` must be [B, C, {d}] for a head weight of shape {w.shape}; got {hidden.shape}")
  if targets.shape != hidden.shape[:2]:
    raise ValueError(f"`targets` shape {targets.shape} != hidden[:2] {hidden.shape[:2]}")
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise TypeError(f"`targets` must be an integer array; got {targets.dtype}")
  if isinstance(temperature, (int, float)) and temperature <= 0:
    raise ValueError(f"`temperature` must be > 0; got {temperature}")
  if entropy_grad and not with_entropy:
    raise ValueError("`entropy_grad=True` needs `with_entropy=True`")
  _checks.check_python_bool(keep_logits, "keep_logits")
  static = (bool(tied), jnp.dtype(dtype), bool(with_entropy), bool(entropy_grad), keep_logits)
  return _head_log_probs(static, w, hidden, targets.astype(jnp.int32), jnp.asarray(temperature, jnp.float32))


def _head_forward(static, w, h, tgt, temperature):
  tied, dtype, with_entropy, _, _ = static
  z = head_logits(w, h, tied=tied, dtype=dtype, out_dtype=jnp.float32) / temperature  # [B, C, V] f32
  lse = jax.nn.logsumexp(z, axis=-1)
  logp = jnp.take_along_axis(z, tgt[..., None], axis=-1)[..., 0] - lse
  ent = lse - jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1) if with_entropy else None  # H = lse - Σ p·z
  return (logp, ent), lse, z


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _head_log_probs(static, w, h, tgt, temperature):
  return _head_forward(static, w, h, tgt, temperature)[0]


def _head_log_probs_fwd(static, w, h, tgt, temperature):
  (logp, ent), lse, z = _head_forward(static, w, h, tgt, temperature)
  return (logp, ent), (w, h, tgt, temperature, lse, ent, z if static[4] else None)


def _head_log_probs_bwd(static, residuals, cotangents):
  tied, dtype, _, entropy_grad, _ = static
  w, h, tgt, temperature, lse, ent, kept = residuals
  g_logp, g_ent = cotangents
  logits, head_vjp = jax.vjp(lambda w, h: head_logits(w, h, tied=tied, dtype=dtype, out_dtype=jnp.float32), w, h)
  # the kept logits (keep_logits): the vjp's own forward matmul then has no use, and XLA drops it as dead code
  z = logits / temperature if kept is None else kept
  p = jnp.exp(z - lse[..., None])
  target = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) == tgt[..., None]
  dz = jnp.where(target, g_logp[..., None], 0.0) - g_logp[..., None] * p
  if entropy_grad:
    dz = dz - g_ent[..., None] * p * (z - (lse - ent)[..., None])
  if jnp.dtype(dtype) != jnp.float32 and current_platform() != "cpu":
    dw, dh = _head_matmul_grads(w, h, dz / temperature, tied=tied, dtype=dtype)
  else:
    dw, dh = head_vjp(dz / temperature)
  return dw, dh, None, None


def _head_matmul_grads(w, h, g, *, tied: bool, dtype):
  """``(∂/∂w, ∂/∂h)`` of the head matmul ``z = h·wᵀ`` (``tied``: ``w [V, D]``) or ``h·w`` (``w [D, V]``) from
  the logits' float32 cotangent ``g [B, C, V]``, for a low-precision ``dtype`` on an accelerator: ``g`` rounded
  to ``dtype`` so that both products are ``dtype × dtype`` accumulated in float32 (the forward's precision; the
  transpose of the forward's dot would multiply a float32 ``g`` by the ``dtype`` operand, which TPUs run as a
  float32 matmul):

      ∂h[b, c, d] = Σ_v g[b, c, v] · w[v, d]  (tied)   or  Σ_v g[b, c, v] · w[d, v]
      ∂w[v, d]    = Σ_bc g[b, c, v] · h[b, c, d]  (tied),  ∂w[d, v] = Σ_bc h[b, c, d] · g[b, c, v]

  returned in ``w``'s and ``h``'s dtypes. Float32 programs and XLA:CPU keep the transpose (``jax.vjp``): their
  values and programs do not change (``tests/test_target_platform.py`` pins the CPU ones)."""
  g, hc, wc = g.astype(dtype), h.astype(dtype), w.astype(dtype)
  f32 = jnp.float32
  if tied:
    dh = jnp.einsum("bcv,vd->bcd", g, wc, preferred_element_type=f32)
    dw = jnp.einsum("bcv,bcd->vd", g, hc, preferred_element_type=f32)
  else:
    dh = jnp.einsum("bcv,dv->bcd", g, wc, preferred_element_type=f32)
    dw = jnp.einsum("bcd,bcv->dv", hc, g, preferred_element_type=f32)
  return dw.astype(w.dtype), dh.astype(h.dtype)


_head_log_probs.defvjp(_head_log_probs_fwd, _head_log_probs_bwd)


def _check_forward_mode(enabled) -> bool:
  if not isinstance(enabled, bool):
    raise TypeError(f"`forward_mode` must be a bool; got {enabled!r}")
  return enabled


def _forward_mode(enabled: bool):
  """``forward_mode_autodiff()`` when ``enabled``, else no change (an enclosing one stays in effect)."""
  return forward_mode_autodiff() if _check_forward_mode(enabled) else contextlib.nullcontext()


def _uses_head_kernel(model) -> bool:
  """Whether :func:`chunked_log_probs` runs :func:`head_log_probs` for ``model`` (a ``CausalLM``: its
  head is ``head_logits`` of ``head_weight``) rather than autodiff under ``jax.checkpoint``. One
  predicate, so ``scripts/bench_head.py`` and the tests can compile the same program both ways."""
  return isinstance(model, CausalLM)


@_forward_mode_hint
def chunked_log_probs(
  model,
  hidden: jax.Array,
  targets: jax.Array,
  *,
  temperature: float = 1.0,
  chunk_size: int | None = 256,
  with_entropy: bool = False,
  entropy_grad: bool = False,
  forward_mode: bool = False,
  keep_logits: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
  """Log-probs of ``targets`` and (optionally) the policy entropy, chunked over positions.

  With ``z = logits(hidden[b, t]) / temperature`` in float32::

      logp[b, t]    = z[targets[b, t]] - logsumexp(z)
      entropy[b, t] = logsumexp(z) - Σ_v softmax(z)_v · z_v

  The float32 logits of one chunk, ``f32[B, chunk_size, V]``, are the largest intermediate. Chunks
  run sequentially (``lax.map``) and the backward pass recomputes each chunk's logits instead of
  storing all of them: for a ``jaxgrpo.models`` model (a ``CausalLM``) with :func:`head_log_probs`,
  whose backward pass needs only the chunk's logsumexp besides the recomputed logits; for any other
  model under ``jax.checkpoint``. The entropy is computed from the same chunk, with no gradient (a
  metric) unless ``entropy_grad`` (an entropy bonus in the loss: its gradient
  ``∇H = −Σ_v p_v (z_v − Σ_u p_u z_u) ∇z_v`` flows through the recomputed chunk like the log-probs').

  Args:
    model: a model with ``logits(hidden, out_dtype=...)``.
    hidden: ``[B, T, D]`` hidden states (compute dtype).
    targets: ``int32[B, T]`` the token scored at each position.
    temperature: positive float dividing the logits.
    chunk_size: positions per chunk; None (or >= T) computes everything in one chunk.
    with_entropy: also return the entropy.
    entropy_grad: differentiate the entropy too (requires ``with_entropy``).
    forward_mode: the chunk under ``jax.checkpoint`` (plain autodiff, forward mode included) also
      for a ``CausalLM``, instead of :func:`head_log_probs`'s reverse-only gradient (module docstring).
    keep_logits: every chunk's logits kept for the backward pass instead of recomputed (``[B, T, V]`` float32
      in all, one head matmul less per chunk; :func:`head_log_probs`, or autodiff without ``jax.checkpoint``).

  Returns:
    ``(logp f32[B, T], entropy f32[B, T] or None)``; padding positions are not masked here.
  """
  if hidden.ndim != 3:
    raise ValueError(f"`hidden` must be [B, T, D]; got shape {hidden.shape}")
  if targets.shape != hidden.shape[:2]:
    raise ValueError(f"`targets` shape {targets.shape} != hidden[:2] {hidden.shape[:2]}")
  if isinstance(temperature, (int, float)) and temperature <= 0:
    raise ValueError(f"`temperature` must be > 0; got {temperature}")
  _check_chunk_size(chunk_size)
  if entropy_grad and not with_entropy:
    raise ValueError("`entropy_grad=True` needs `with_entropy=True`")
  _checks.check_python_bool(keep_logits, "keep_logits")
  b, t, d = hidden.shape
  targets = targets.astype(jnp.int32)

  if _uses_head_kernel(model) and not (_check_forward_mode(forward_mode) or forward_mode_active()):
    w, tied, dtype = model.head_weight, model.lm_head is None, model.dtype

    def chunk(args):
      h, tgt = args  # [B, C, D], [B, C]
      kw = dict(tied=tied, dtype=dtype, temperature=temperature, with_entropy=with_entropy, keep_logits=keep_logits)
      logp, ent = head_log_probs(w, h, tgt, entropy_grad=entropy_grad, **kw)
      return logp, ent if ent is None or entropy_grad else jax.lax.stop_gradient(ent)

  else:  # any model with `logits`: autodiff, the chunk's logits recomputed under jax.checkpoint (unless kept)

    def chunk(args):
      h, tgt = args  # [B, C, D], [B, C]
      logits = model.logits(h, out_dtype=jnp.float32) / temperature  # [B, C, V] f32
      lse = jax.nn.logsumexp(logits, axis=-1)
      logp = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0] - lse
      if not with_entropy:
        return logp, None
      sl, slse = (logits, lse) if entropy_grad else (jax.lax.stop_gradient(logits), jax.lax.stop_gradient(lse))
      ent = slse - jnp.sum(jnp.exp(sl - slse[..., None]) * sl, axis=-1)  # H = lse - Σ p·z
      return logp, ent

    chunk = chunk if keep_logits else jax.checkpoint(chunk)

  if chunk_size is None or chunk_size >= t:
    return chunk((hidden, targets))
  n = -(-t // chunk_size)
  pad = n * chunk_size - t
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk_size, d).swapaxes(0, 1)  # [n, B, C, D]
  tgt = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk_size).swapaxes(0, 1)  # [n, B, C]
  logp, ent = jax.lax.map(chunk, (h, tgt))  # [n, B, C]

  def unchunk(x):
    return None if x is None else x.swapaxes(0, 1).reshape(b, n * chunk_size)[:, :t]

  return unchunk(logp), unchunk(ent)


def _over_chunks(fn, hidden: jax.Array, extra: jax.Array | None, chunk_size: int | None):
  """``fn(h [B, C, D], extra [B, C, ...] or None) -> pytree of [B, C, ...]`` over position chunks of ``hidden``
  (``lax.map``), the chunks put back to ``[B, T, ...]``."""
  b, t, d = hidden.shape
  if chunk_size is None or chunk_size >= t:
    return fn(hidden, extra)
  n = -(-t // chunk_size)
  pad = n * chunk_size - t

  def split(x):
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    return x.reshape((b, n, chunk_size) + x.shape[2:]).swapaxes(0, 1)  # [n, B, C, ...]

  out = jax.lax.map(lambda a: fn(a[0], a[1]), (split(hidden), None if extra is None else split(extra)))
  return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape((b, n * chunk_size) + x.shape[3:])[:, :t], out)


def _chunk_logits(model, h, temperature):
  """``f32[B, C, V]`` one chunk's temperature-scaled logits (the only ``V``-wide array of the top-k passes)."""
  return model.logits(h, out_dtype=jnp.float32) / temperature


def chunked_topk_log_probs(
  model,
  hidden: jax.Array,
  ids: jax.Array,
  *,
  temperature: float = 1.0,
  chunk_size: int | None = 256,
  keep_logits: bool = False,
) -> jax.Array:
  """The log-probs of k given ids per position, ``log_softmax(logits(hidden) / temperature)[ids]``, chunked
  over positions like :func:`chunked_log_probs` (the ``f32[B, C, V]`` logits of one chunk at a time, recomputed
  in the backward pass under ``jax.checkpoint``; never the ``[B, T, V]`` logits at once). Differentiable: the
  gradient reaches the logits at the k ids (and, through the logsumexp, every logit).

  Args:
    model: a model with ``logits(hidden, out_dtype=...)``; ``hidden``: ``[B, T, D]``; ``ids``: ``int[B, T, k]``.
    keep_logits: the chunks' logits kept for the backward pass (plain autodiff) instead of recomputed.

  Returns:
    ``f32[B, T, k]``.
  """
  if ids.ndim != 3 or ids.shape[:2] != hidden.shape[:2]:
    raise ValueError(f"`ids` must be int[B, T, k] with [B, T] = {hidden.shape[:2]}; got shape {ids.shape}")
  _check_chunk_size(chunk_size)
  _checks.check_python_bool(keep_logits, "keep_logits")

  def chunk(h, i):
    z = _chunk_logits(model, h, temperature)
    lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
    return jnp.take_along_axis(z, i.astype(jnp.int32), axis=-1) - lse

  return _over_chunks(chunk if keep_logits else jax.checkpoint(chunk), hidden, ids, chunk_size)


def chunked_top_k(
  model, hidden: jax.Array, k: int, *, temperature: float = 1.0, chunk_size: int | None = 256
) -> tuple[jax.Array, jax.Array]:
  """The k most likely ids per position and their log-probs, ``top_k(log_softmax(logits(hidden) / temperature))``,
  chunked over positions (one chunk's ``f32[B, C, V]`` logits at a time); no gradient (a teacher's pass).

  Returns:
    ``(ids int32[B, T, k], logp f32[B, T, k])``, ids by decreasing log-prob.
  """
  _check_chunk_size(chunk_size)

  def chunk(h, _):
    z = _chunk_logits(model, h, temperature)
    top, ids = jax.lax.top_k(z, k)
    return ids.astype(jnp.int32), top - jax.nn.logsumexp(z, axis=-1, keepdims=True)

  return jax.lax.stop_gradient(_over_chunks(chunk, hidden, None, chunk_size))


@_forward_mode_hint
def token_log_probs(
  model,
  hidden: jax.Array,
  targets: jax.Array,
  *,
  temperature: float = 1.0,
  chunk_size: int | None = 256,
  forward_mode: bool = False,
) -> jax.Array:
  """``out[b, t] = log_softmax(logits(hidden[b, t]) / temperature)[targets[b, t]]`` in float32.

  :func:`chunked_log_probs` without the entropy.

  Args:
    model: a model with ``logits(hidden, out_dtype=...)``.
    hidden: ``[B, T, D]`` hidden states (compute dtype).
    targets: ``int32[B, T]`` the token scored at each position.
    temperature: positive float dividing the logits.
    chunk_size: positions per chunk (see :func:`chunked_log_probs`); None: one chunk.
    forward_mode: plain autodiff, ``jax.jvp``-able (module docstring).

  Returns:
    ``f32[B, T]``.
  """
  return chunked_log_probs(
    model, hidden, targets, temperature=temperature, chunk_size=chunk_size, forward_mode=forward_mode
  )[0]


@_forward_mode_hint
def log_probs(
  model,
  tokens: jax.Array,
  attention_mask: jax.Array | None = None,
  *,
  temperature: float = 1.0,
  chunk_size: int | None = 256,
  forward_mode: bool = False,
) -> jax.Array:
  """Per-token log-probabilities of a (left-)padded batch of sequences under ``model``.

  ``out[:, t] = log_softmax(logits(hidden[:, t-1]) / temperature)[tokens[:, t]]`` for t >= 1 where
  ``attention_mask[:, t]`` and ``attention_mask[:, t-1]`` hold, else 0; ``out[:, 0] = 0``.
  Positions are ``positions_from_mask(attention_mask)``. The float32 logits exist one chunk of
  ``chunk_size`` positions at a time (see :func:`chunked_log_probs`).

  Args:
    model: a ``jaxgrpo.models`` causal LM.
    tokens: ``int32[B, T]``.
    attention_mask: ``bool[B, T]``, True on real tokens (None: all real).
    temperature: sampling temperature the log-probs refer to.
    chunk_size: positions per chunk (None: unchunked).
    forward_mode: trace the model and the head as plain autodiff, so that ``jax.jvp``,
      ``jax.linearize`` and ``jax.jacfwd`` work through this function (the default's hand-written
      reverse-mode gradients do not support forward mode); the same values.

  Returns:
    ``f32[B, T]``.
  """
  if tokens.ndim != 2:
    raise ValueError(f"`tokens` must be [B, T]; got shape {tokens.shape}")
  if attention_mask is None:
    attention_mask = jnp.ones(tokens.shape, bool)
  if attention_mask.shape != tokens.shape:
    raise ValueError(f"`attention_mask` shape {attention_mask.shape} != tokens shape {tokens.shape}")
  attention_mask = attention_mask.astype(bool)
  positions = positions_from_mask(attention_mask)
  with _forward_mode(forward_mode):
    hidden, _ = model(tokens, positions, attention_mask=attention_mask)
    lp = token_log_probs(model, hidden[:, :-1], tokens[:, 1:], temperature=temperature, chunk_size=chunk_size)
  valid = attention_mask[:, 1:] & attention_mask[:, :-1]
  lp = jnp.where(valid, lp, 0.0)
  return jnp.concatenate([jnp.zeros((tokens.shape[0], 1), jnp.float32), lp], axis=1)


@_forward_mode_hint
def completion_log_probs(
  model,
  prompt_tokens: jax.Array,
  prompt_mask: jax.Array,
  completions: jax.Array,
  mask: jax.Array,
  *,
  temperature: float = 1.0,
  chunk_size: int | None = 256,
  with_entropy: bool = False,
  entropy_grad: bool = False,
  dropout_key: jax.Array | None = None,
  forward_mode: bool = False,
  topk_ids: jax.Array | None = None,
  top_k: int | None = None,
  keep_logits: bool = False,
) -> tuple:
  """Log-probs (and optionally entropies) of the completion tokens given their prompts.

  One forward over ``[prompt ‖ completion]`` (positions from the joint mask); only the T completion
  positions go through the LM head, in float32 chunks (:func:`chunked_log_probs`). This is the
  train step's and the reference pass's log-prob path; it equals ``log_probs`` of the concatenated
  sequence restricted to the completion columns.

  Args:
    model: a ``jaxgrpo.models`` causal LM.
    prompt_tokens: ``int32[B, P]`` left-padded prompts, P >= 1.
    prompt_mask: ``bool[B, P]`` real prompt tokens.
    completions: ``int32[B, T]`` right-padded completions.
    mask: ``bool[B, T]`` real completion tokens.
    temperature: sampling temperature the log-probs refer to.
    chunk_size: completion positions per chunk (None: unchunked).
    with_entropy: also return the entropy of the temperature-scaled policy (no gradient, unless
      ``entropy_grad``: an entropy bonus in the loss).
    entropy_grad: differentiate the entropy too (requires ``with_entropy``).
    dropout_key: LoRA adapter dropout (training only): one key (one mask for the whole input), or one
      key per row (``key[B]`` typed, or raw ``uint32[B, 2]``), each token's mask then drawn from its row's key
      and its position (:func:`token_dropout_keys`: the masks a packed layout gives the same sequence). None:
      no dropout.
    forward_mode: plain autodiff, ``jax.jvp``-able (as :func:`log_probs`).
    topk_ids: ``int[B, T, k]``: also the log-probs at these ids (:func:`chunked_topk_log_probs`, from the same
      forward: a distillation student at its teacher's top-k ids).
    top_k: k: also the k most likely ids and their log-probs (:func:`chunked_top_k`: a distillation teacher).
    keep_logits: the head's chunks keep their logits for the backward pass instead of recomputing them
      (:func:`chunked_log_probs`; ``TrainConfig.head_logits: keep``).

  Returns:
    ``(logp f32[B, T], entropy f32[B, T] or None)``, both 0 where ``mask`` is False; with ``topk_ids`` a third
    entry ``f32[B, T, k]``, with ``top_k`` a third entry ``(ids int32[B, T, k], logp f32[B, T, k])`` (not masked).
  """
  if prompt_tokens.ndim != 2 or prompt_tokens.shape[1] < 1:
    raise ValueError(f"`prompt_tokens` must be [B, P] with P >= 1; got shape {prompt_tokens.shape}")
  p = prompt_tokens.shape[1]
  tokens = jnp.concatenate([prompt_tokens, completions], axis=1).astype(jnp.int32)  # [B, P+T]
  attn = jnp.concatenate([prompt_mask, mask], axis=1).astype(bool)
  positions = positions_from_mask(attn)
  with _forward_mode(forward_mode):
    dropout_key = _row_keys_to_tokens(dropout_key, positions)
    hidden, _ = model(tokens, positions, attention_mask=attn, dropout_key=dropout_key)
    h = hidden[:, p - 1 : -1]  # position p-1+t predicts completions[:, t]
    logp, ent = chunked_log_probs(
      model,
      h,
      completions,
      temperature=temperature,
      chunk_size=chunk_size,
      with_entropy=with_entropy,
      entropy_grad=entropy_grad,
      keep_logits=keep_logits,
    )
    kw = dict(temperature=temperature, chunk_size=chunk_size)
    if topk_ids is not None:
      extra = chunked_topk_log_probs(model, h, topk_ids, keep_logits=keep_logits, **kw)
    elif top_k is not None:
      extra = chunked_top_k(model, h, top_k, **kw)
  logp = jnp.where(mask, logp, 0.0)
  ent = None if ent is None else jnp.where(mask, ent, 0.0)
  if topk_ids is not None or top_k is not None:
    return logp, ent, extra
  return logp, ent


def token_dropout_keys(row_keys: jax.Array, positions: jax.Array, rows: jax.Array | None = None) -> jax.Array:
  """Per-token LoRA dropout keys ``key[N, S]`` from per-row keys: token ``(n, s)`` gets
  ``fold_in(row_keys[rows[n, s]], positions[n, s])`` — the key of its sequence's row and its position in that
  sequence — so a sequence's masks are the same wherever its tokens sit (left-padded rows, packed rows, prefix
  trees; ``layers.LoRA`` draws each token's mask from its own key).

  Args:
    row_keys: ``key[B]`` typed (or raw ``uint32[B, 2]``): one per sequence row.
    positions: ``int[N, S]`` each token's position in its sequence.
    rows: ``int[N, S]`` the row of ``row_keys`` each token belongs to (packed rows); None: row n (``N = B``).
  """
  if not jax.dtypes.issubdtype(row_keys.dtype, jax.dtypes.prng_key):
    row_keys = jax.random.wrap_key_data(row_keys)
  keys = row_keys[:, None] if rows is None else row_keys[jnp.clip(rows, 0, row_keys.shape[0] - 1)]
  keys = jnp.broadcast_to(keys, positions.shape)
  return jax.vmap(jax.vmap(jax.random.fold_in))(keys, positions.astype(jnp.uint32))


def _row_keys_to_tokens(dropout_key, positions):
  """``completion_log_probs``' ``dropout_key``: one key stays one key; per-row keys become per-token keys."""
  if dropout_key is None or dropout_key.ndim == 0:
    return dropout_key
  typed = jax.dtypes.issubdtype(dropout_key.dtype, jax.dtypes.prng_key)
  return token_dropout_keys(dropout_key, positions) if typed or dropout_key.ndim == 2 else dropout_key


def _check_packed_args(tokens, positions, segment_ids, head_index, unpack_index, blocks) -> tuple[int, int]:
  """Shapes of :func:`packed_log_probs`' arguments; returns ``(rows per block, head length H)``."""
  if tokens.ndim != 2:
    raise ValueError(f"`tokens` must be packed rows [R, L]; got shape {tokens.shape}")
  for name, x in (("positions", positions), ("segment_ids", segment_ids)):
    if x.shape != tokens.shape:
      raise ValueError(f"`{name}` shape {x.shape} != tokens shape {tokens.shape}")
  if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
    raise ValueError(f"`blocks` must be a positive int; got {blocks!r}")
  r = tokens.shape[0]
  if r % blocks or head_index.ndim != 2 or head_index.shape[0] != blocks or head_index.shape[1] % (r // blocks):
    raise ValueError(
      f"`head_index` must be int32[blocks, (R / blocks)·H] = [{blocks}, {r // max(blocks, 1)}·H] for {r} rows in "
      f"{blocks} blocks; got shape {head_index.shape}"
    )
  if unpack_index.ndim != 2 or unpack_index.shape[0] % blocks:
    raise ValueError(
      f"`unpack_index` must be int32[B, T] with B a multiple of blocks={blocks}; got {unpack_index.shape}"
    )
  for name, x in (("tokens", tokens), ("head_index", head_index), ("unpack_index", unpack_index)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"`{name}` must be an integer array; got {x.dtype}")
  return r // blocks, head_index.shape[1] // (r // blocks)


@_forward_mode_hint
def packed_log_probs(
  model,
  tokens: jax.Array,
  positions: jax.Array,
  segment_ids: jax.Array,
  head_index: jax.Array,
  unpack_index: jax.Array,
  *,
  blocks: int = 1,
  temperature: float = 1.0,
  chunk_size: int | None = 256,
  with_entropy: bool = False,
  entropy_grad: bool = False,
  kv_end: jax.Array | None = None,
  topk_ids: jax.Array | None = None,
  top_k: int | None = None,
  dropout_key: jax.Array | None = None,
  row_in_slot: jax.Array | None = None,
  keep_logits: bool = False,
) -> tuple:
  """Log-probs (and optionally entropies) of the completion tokens of packed rows, in the rollout's
  ``[B, T]`` completion layout: :func:`completion_log_probs` for ``jaxgrpo.step.packing.PackedSlots``.

  One forward over the packed rows (``segment_ids``: attention never crosses sequences; per-sequence
  ``positions``), then only the completion positions listed in ``head_index`` go through the LM head
  (gathered into ``[blocks·Rb, H, D]``, in float32 chunks of ``chunk_size`` positions,
  :func:`chunked_log_probs`); ``unpack_index`` gathers them back::

      logp[b, t] = log_softmax(logits(hidden[p - 1]) / temperature)[tokens[p]],  p = head_index[k, unpack_index[b, t]]

  where k is the block of row b (rows and head entries are indexed within their block) and ``p - 1``,
  the column before the target, is in the same sequence (every prompt has a token). The rows form
  ``blocks`` equal blocks (the train step: one per device shard), each with its own sequences: every
  gather is a batched gather over the block axis, so with the blocks on different devices nothing
  crosses devices.

  Args:
    model: a ``jaxgrpo.models`` causal LM.
    tokens, positions, segment_ids: ``int32[R, L]`` packed rows (``PackedSlots`` fields, one slot's
      rows per block).
    head_index: ``int32[blocks, (R / blocks)·H]`` flat index ``r·L + c`` (r within the block) of each
      scored target; entries past a block's last target are ignored.
    unpack_index: ``int32[B, T]``: the head entry of completion token ``(b, t)`` within its block
      (rows ``[k·B/blocks, (k+1)·B/blocks)`` are block k's), -1 where there is none.
    blocks: the number of blocks (static).
    temperature: sampling temperature the log-probs refer to.
    chunk_size: head positions per chunk (of H; None: unchunked): a chunk holds ``R·chunk_size`` tokens.
    with_entropy: also return the entropy of the temperature-scaled policy (no gradient unless
      ``entropy_grad``: an entropy bonus in the loss).
    entropy_grad: differentiate the entropy too (requires ``with_entropy``).
    kv_end: ``int32[R, L]`` packed prefix trees (``jaxgrpo.step.prefix_tree``: a token attends to its ancestors,
      the model's ``kv_end``); the column before every listed target holds its parent (or a copy of it), so the
      gather above is unchanged, and several ``(b, t)`` may share one head entry (their gradients add up there).
    topk_ids: ``int[B, T, k]`` (a distillation student at its teacher's top-k ids): also the log-probs at these
      ids, from the same head rows: the ids are scattered to their head entries (``ids_head[k, unpack_index[b, t]]
      = topk_ids[b, t]``; a head entry shared by a prefix tree takes one of its ``(b, t)``'s ids, the same
      context's), :func:`chunked_topk_log_probs` over the head buffer, then gathered back like ``logp``.
    top_k: k (a distillation teacher): also the k most likely ids and their log-probs at every head entry
      (:func:`chunked_top_k`), gathered back to ``[B, T, k]``.
    dropout_key: LoRA adapter dropout (training only): ``key[B]`` one per sequence row (rows
      ``[k·B/blocks, (k+1)·B/blocks)`` are block k's), with ``row_in_slot``; each token's mask is drawn from its
      sequence's key and its position (:func:`token_dropout_keys`), the masks :func:`completion_log_probs` gives
      the same sequence unpacked. None: no dropout.
    row_in_slot: ``int[R, L]`` the row (within its block's ``B/blocks``) of the sequence that laid out each
      column (``jaxgrpo.step.packing.PackedSlots.row_in_slot``); needed with ``dropout_key``.
    keep_logits: the head's chunks keep their logits for the backward pass (as :func:`completion_log_probs`).

  Returns:
    ``(logp f32[B, T], entropy f32[B, T] or None)``, both 0 where ``unpack_index`` is -1; with ``topk_ids`` a
    third entry ``f32[B, T, k]``, with ``top_k`` a third entry ``(ids int32[B, T, k], logp f32[B, T, k])``
    (0 where ``unpack_index`` is -1).
  """
  rb, h = _check_packed_args(tokens, positions, segment_ids, head_index, unpack_index, blocks)
  r, length = tokens.shape
  tokens = tokens.astype(jnp.int32)
  tree = {} if kv_end is None else {"kv_end": kv_end}
  if dropout_key is not None:
    tree["dropout_key"] = _packed_dropout_keys(dropout_key, positions, row_in_slot, blocks, unpack_index.shape[0])
  hidden, _ = model(tokens, positions, segment_ids=segment_ids, **tree)  # [R, L, D]
  d = hidden.shape[-1]
  head_index = head_index.astype(jnp.int32)
  flat = hidden.reshape(blocks, rb * length, d)
  source = jnp.maximum(head_index - 1, 0)  # the column that predicts each target
  head = jnp.take_along_axis(flat, source[..., None], axis=1, mode="clip")  # [blocks, Rb·H, D]
  targets = jnp.take_along_axis(tokens.reshape(blocks, rb * length), head_index, axis=1, mode="clip")
  logp, ent = chunked_log_probs(
    model,
    head.reshape(blocks * rb, h, d),
    targets.reshape(blocks * rb, h),
    temperature=temperature,
    chunk_size=chunk_size,
    with_entropy=with_entropy,
    entropy_grad=entropy_grad,
    keep_logits=keep_logits,
  )
  b, t = unpack_index.shape
  index = unpack_index.astype(jnp.int32).reshape(blocks, (b // blocks) * t)
  real = index >= 0

  def unpack(x):  # [blocks·Rb, H, ...] head entries -> [B, T, ...]
    x = x.reshape((blocks, rb * h) + x.shape[2:])
    at = jnp.where(real, index, 0).reshape(index.shape + (1,) * (x.ndim - 2))
    out = jnp.take_along_axis(x, at, axis=1, mode="clip")
    return jnp.where(real.reshape(at.shape), out, jnp.zeros((), x.dtype)).reshape((b, t) + x.shape[2:])

  out = unpack(logp), None if ent is None else unpack(ent)
  kw = dict(temperature=temperature, chunk_size=chunk_size)
  if topk_ids is not None:
    ids = _to_head(topk_ids, index, real, blocks, rb * h).reshape(blocks * rb, h, -1)
    topk = chunked_topk_log_probs(model, head.reshape(blocks * rb, h, d), ids, keep_logits=keep_logits, **kw)
    return (*out, unpack(topk))
  if top_k is not None:
    return (*out, jax.tree.map(unpack, chunked_top_k(model, head.reshape(blocks * rb, h, d), top_k, **kw)))
  return out


def _packed_dropout_keys(row_keys, positions, row_in_slot, blocks: int, b: int):
  """Per-token keys ``key[R, L]`` of packed rows from the rows' keys ``key[B]``: block k's columns take the keys of
  block k's rows (a batched gather over the block axis: nothing crosses devices)."""
  if row_in_slot is None:
    raise ValueError("packed_log_probs: `dropout_key` needs `row_in_slot` (PackedSlots.row_in_slot, pack_slots)")
  if row_in_slot.shape != positions.shape:
    raise ValueError(f"`row_in_slot` shape {row_in_slot.shape} != tokens shape {positions.shape}")
  if not jax.dtypes.issubdtype(row_keys.dtype, jax.dtypes.prng_key):
    row_keys = jax.random.wrap_key_data(row_keys)
  if row_keys.shape != (b,):
    raise ValueError(f"`dropout_key` must be one key per sequence row (shape ({b},)); got shape {row_keys.shape}")
  split = lambda x: x.reshape((blocks, x.shape[0] // blocks) + x.shape[1:])
  keys = jax.vmap(token_dropout_keys)(split(row_keys), split(positions), split(row_in_slot))
  return keys.reshape(positions.shape)


def _to_head(x, index, real, blocks: int, entries: int):
  """``x`` ``[B, T, k]`` scattered to the head entries ``[blocks, entries, k]`` (``out[j, index[j, i]] =
  x_j[i]``, block j's rows flattened; entries with no token stay 0), the inverse of the packed unpack."""
  x = x.reshape((blocks, index.shape[1]) + x.shape[2:])
  at = jnp.where(real, index, entries)  # out of range: dropped
  return jnp.zeros((blocks, entries) + x.shape[2:], x.dtype).at[jnp.arange(blocks)[:, None], at].set(x, mode="drop")
