"""Per-token log-probabilities (and entropies) without materialising the float32 ``[B, T, V]`` logits.

One kernel, :func:`chunked_log_probs`, computes ``log_softmax(logits / temperature)[target]`` and,
optionally, the entropy of that distribution, one chunk of positions at a time under
``jax.checkpoint``. Everything else here calls it: :func:`token_log_probs` (hidden states in),
:func:`log_probs` (a token sequence in) and :func:`completion_log_probs` (prompts and completions in:
the train step's and the reference pass's path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgrpo.models.base import positions_from_mask

__all__ = ["chunked_log_probs", "completion_log_probs", "log_probs", "token_log_probs"]


def _check_chunk_size(chunk_size) -> None:
  if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0):
    raise ValueError(f"`chunk_size` must be a positive int or None; got {chunk_size!r}")


def chunked_log_probs(
  model,
  hidden: jax.Array,
  targets: jax.Array,
  *,
  temperature: float = 1.0,
  chunk_size: int | None = 256,
  with_entropy: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
  """Log-probs of ``targets`` and (optionally) the policy entropy, chunked over positions.

  With ``z = logits(hidden[b, t]) / temperature`` in float32::

      logp[b, t]    = z[targets[b, t]] - logsumexp(z)
      entropy[b, t] = logsumexp(z) - Σ_v softmax(z)_v · z_v          (no gradient)

  The float32 logits of one chunk, ``f32[B, chunk_size, V]``, are the largest intermediate. Chunks
  run sequentially (``lax.map``) under ``jax.checkpoint``, so the backward pass recomputes each
  chunk's logits instead of storing all of them; the entropy is computed from the same chunk with
  ``stop_gradient`` (a metric, never differentiated).

  Args:
    model: a model with ``logits(hidden, out_dtype=...)``.
    hidden: ``[B, T, D]`` hidden states (compute dtype).
    targets: ``int32[B, T]`` the token scored at each position.
    temperature: positive float dividing the logits.
    chunk_size: positions per chunk; None (or >= T) computes everything in one chunk.
    with_entropy: also return the entropy.

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
  b, t, d = hidden.shape
  targets = targets.astype(jnp.int32)

  @jax.checkpoint
  def chunk(args):
    h, tgt = args  # [B, C, D], [B, C]
    logits = model.logits(h, out_dtype=jnp.float32) / temperature  # [B, C, V] f32
    lse = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0] - lse
    if not with_entropy:
      return logp, None
    sl, slse = jax.lax.stop_gradient(logits), jax.lax.stop_gradient(lse)
    ent = slse - jnp.sum(jnp.exp(sl - slse[..., None]) * sl, axis=-1)  # H = lse - Σ p·z
    return logp, ent

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


def token_log_probs(
  model, hidden: jax.Array, targets: jax.Array, *, temperature: float = 1.0, chunk_size: int | None = 256
) -> jax.Array:
  """``out[b, t] = log_softmax(logits(hidden[b, t]) / temperature)[targets[b, t]]`` in float32.

  :func:`chunked_log_probs` without the entropy.

  Args:
    model: a model with ``logits(hidden, out_dtype=...)``.
    hidden: ``[B, T, D]`` hidden states (compute dtype).
    targets: ``int32[B, T]`` the token scored at each position.
    temperature: positive float dividing the logits.
    chunk_size: positions per chunk (see :func:`chunked_log_probs`); None: one chunk.

  Returns:
    ``f32[B, T]``.
  """
  return chunked_log_probs(model, hidden, targets, temperature=temperature, chunk_size=chunk_size)[0]


def log_probs(
  model,
  tokens: jax.Array,
  attention_mask: jax.Array | None = None,
  *,
  temperature: float = 1.0,
  chunk_size: int | None = 256,
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
  hidden, _ = model(tokens, positions, attention_mask=attention_mask)
  lp = token_log_probs(model, hidden[:, :-1], tokens[:, 1:], temperature=temperature, chunk_size=chunk_size)
  valid = attention_mask[:, 1:] & attention_mask[:, :-1]
  lp = jnp.where(valid, lp, 0.0)
  return jnp.concatenate([jnp.zeros((tokens.shape[0], 1), jnp.float32), lp], axis=1)


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
  dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
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
    with_entropy: also return the entropy of the temperature-scaled policy (no gradient).
    dropout_key: LoRA adapter dropout (training only; the model's ``dropout_key``): one key, or one
      key per row (``key[B]`` typed, or raw ``uint32[B, 2]``). None: no dropout.

  Returns:
    ``(logp f32[B, T], entropy f32[B, T] or None)``, both 0 where ``mask`` is False.
  """
  if prompt_tokens.ndim != 2 or prompt_tokens.shape[1] < 1:
    raise ValueError(f"`prompt_tokens` must be [B, P] with P >= 1; got shape {prompt_tokens.shape}")
  p = prompt_tokens.shape[1]
  tokens = jnp.concatenate([prompt_tokens, completions], axis=1).astype(jnp.int32)  # [B, P+T]
  attn = jnp.concatenate([prompt_mask, mask], axis=1).astype(bool)
  hidden, _ = model(tokens, positions_from_mask(attn), attention_mask=attn, dropout_key=dropout_key)
  h = hidden[:, p - 1 : -1]  # position p-1+t predicts completions[:, t]
  logp, ent = chunked_log_probs(
    model, h, completions, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy
  )
  logp = jnp.where(mask, logp, 0.0)
  ent = None if ent is None else jnp.where(mask, ent, 0.0)
  return logp, ent
