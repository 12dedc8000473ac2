"""Per-token log-probabilities without materialising the float32 [B, T, V] logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgrpo.models.base import positions_from_mask

__all__ = ["log_probs", "token_log_probs"]


def token_log_probs(
  model, hidden: jax.Array, targets: jax.Array, *, temperature: float = 1.0, chunk_size: int | None = 256
) -> jax.Array:
  """``out[b, t] = log_softmax(logits(hidden[b, t]) / temperature)[targets[b, t]]`` in float32.

  Args:
    model: a model with ``logits(hidden, out_dtype=...)``.
    hidden: [B, T, D] hidden states (compute dtype).
    targets: int [B, T] the token scored at each position.
    temperature: positive float dividing the logits.
    chunk_size: positions per chunk; the float32 logits of one chunk, [B, chunk_size, V], are the
      largest intermediate. Chunks run sequentially (``lax.map``) under ``jax.checkpoint``, so the
      backward pass recomputes each chunk's logits instead of storing all of them.
      None (or >= T) computes everything in one chunk.

  Returns:
    float32 [B, T].
  """
  if hidden.ndim != 3:
    raise ValueError(f"hidden must be [B, T, D], got shape {hidden.shape}")
  if targets.shape != hidden.shape[:2]:
    raise ValueError(f"targets shape {targets.shape} != hidden[:2] {hidden.shape[:2]}")
  if isinstance(temperature, (int, float)) and temperature <= 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  B, T, D = hidden.shape

  @jax.checkpoint
  def chunk_fn(args):
    h, tgt = args  # [B, C, D], [B, C]
    logits = model.logits(h, out_dtype=jnp.float32) / temperature  # [B, C, V] f32
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
    return picked - lse

  if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0):
    raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
  if chunk_size is None or chunk_size >= T:
    return chunk_fn((hidden, targets))
  n = -(-T // chunk_size)
  pad = n * chunk_size - T
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
  tgt = jnp.pad(targets, ((0, 0), (0, pad)))
  h = h.reshape(B, n, chunk_size, D).swapaxes(0, 1)  # [n, B, C, D]
  tgt = tgt.reshape(B, n, chunk_size).swapaxes(0, 1)
  out = jax.lax.map(chunk_fn, (h, tgt))  # [n, B, C]
  return out.swapaxes(0, 1).reshape(B, n * chunk_size)[:, :T]


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
  ``chunk_size`` positions at a time (see ``token_log_probs``).

  Args:
    model: a ``jaxgrpo.models`` causal LM.
    tokens: int [B, T].
    attention_mask: bool [B, T], True on real tokens (None: all real).
    temperature: sampling temperature the log-probs refer to.
    chunk_size: positions per chunk (None: unchunked).

  Returns:
    float32 [B, T].
  """
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
  if attention_mask is None:
    attention_mask = jnp.ones(tokens.shape, bool)
  if attention_mask.shape != tokens.shape:
    raise ValueError(f"attention_mask shape {attention_mask.shape} != tokens shape {tokens.shape}")
  attention_mask = attention_mask.astype(bool)
  positions = positions_from_mask(attention_mask)
  hidden, _ = model(tokens, positions, attention_mask=attention_mask)
  lp = token_log_probs(model, hidden[:, :-1], tokens[:, 1:], temperature=temperature, chunk_size=chunk_size)
  valid = attention_mask[:, 1:] & attention_mask[:, :-1]
  lp = jnp.where(valid, lp, 0.0)
  return jnp.concatenate([jnp.zeros((tokens.shape[0], 1), jnp.float32), lp], axis=1)
