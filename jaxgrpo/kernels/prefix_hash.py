"""64-bit hashes of completion prefixes, the primitive both process-set methods compare rows with.

Every (token, position) pair is mixed to two 32-bit words by two *different* non-linear mixers
(word 0: ``F(F(tok ^ s0) + L(pos ^ q0))``, word 1: ``L(L(tok ^ s1) ^ F(pos ^ q1))`` with ``F``
MurmurHash3's finaliser and ``L`` the "lowbias32" finaliser, both bijections of uint32); summing
each word along ``t`` modulo 2**32 gives a 64-bit hash of every prefix (:func:`prefix_hashes`,
``uint32[B, T, 2]``; ``block_hashes``: the same at the end of every block of tokens).

- *Certain:* equal prefixes of equal length hash equal; two prefixes of equal length that differ in
  exactly one position hash differently in *both* words (each word is a bijection of the token at a
  fixed position).
- *Probabilistic:* if the per-(token, position) words were uniformly random and independent, two
  prefixes that differ anywhere would collide with probability exactly 2**-64 — over the choice of
  the hash function, for inputs chosen independently of it (~5e-8 for 1e12 compared pairs). The
  mixers are fixed pseudo-random functions, so this is a heuristic for them: the words are not
  linear in token or position, and neither word is a function of the other, so structured inputs
  (token differences tied to position differences, arithmetic progressions, swaps, shifts) collide
  no more often than random ones (tests check such families word by word).
- *Not guaranteed:* the hash is not cryptographic. Someone who knows the constants can build a
  collision with about 2**32 work (a birthday search). For adversarial token sequences use the
  process-set functions' ``exact=True``.

Re-exported by ``jaxgrpo.kernels.process_sets``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo import _checks

__all__ = ["prefix_hashes"]

_WORD_SEEDS = (np.uint32(0x2545F491), np.uint32(0x6C8E9CF5))  # token seeds s0, s1
_POS_SEEDS = (np.uint32(0x9E3779B9), np.uint32(0x7F4A7C15))  # position seeds q0, q1


def _fmix32(h):
  """MurmurHash3's 32-bit finaliser: a bijective avalanche mix of uint32 words."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _lowbias32(h):
  """C. Wellons' "lowbias32" finaliser (hash-prospector): another bijective uint32 mix, other constants."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x846CA68B)
  return h ^ (h >> 16)


def _token_words(tokens, pos):
  """The two uint32 words of every (token, position) pair; ``pos`` broadcasts against ``tokens``.

  Word 0 adds a mixed token to a mixed position and mixes again with MurmurHash3's finaliser; word 1
  XORs differently seeded mixes and finishes with lowbias32. Both are bijective in the token at a fixed
  position and non-linear in both inputs.
  """
  tok = tokens.astype(jnp.uint32)
  pos = pos.astype(jnp.uint32)
  w0 = _fmix32(_fmix32(tok ^ _WORD_SEEDS[0]) + _lowbias32(pos ^ _POS_SEEDS[0]))
  w1 = _lowbias32(_lowbias32(tok ^ _WORD_SEEDS[1]) ^ _fmix32(pos ^ _POS_SEEDS[1]))
  return w0, w1


@jax.jit
def _prefix_hashes(tokens):
  w0, w1 = _token_words(tokens, jnp.arange(tokens.shape[1])[None, :])
  return jnp.stack([jnp.cumsum(w, axis=1, dtype=jnp.uint32) for w in (w0, w1)], axis=-1)


def prefix_hashes(tokens, mask):
  """64-bit hash of every completion prefix ``tokens[i, 0..t]``, as two uint32 words.

  ``H_w(i,t) = sum_{s<=t} h_w(tokens[i,s], s)  (mod 2**32)`` for the two words ``w``, with ``h_0`` and
  ``h_1`` two different non-linear mixes of (token, position) (module docstring: what is certain, what
  is probabilistic). Positions where ``mask`` is False still get a hash (callers combine it with the
  mask).

  Args:
    tokens: ``int32[B, T]`` completion tokens.
    mask: ``bool[B, T]`` true on real tokens.

  Returns:
    ``uint32[B, T, 2]``.
  """
  b, t = _checks.check_tokens_mask(tokens, mask)
  if b == 0 or t == 0:
    return jnp.zeros((b, t, 2), jnp.uint32)
  return _prefix_hashes(tokens)


def block_hashes(tokens, block: int):
  """``(tok int32[B, nb·block], block_hash uint32[B, nb, 2])``: tokens zero-padded to whole blocks and the
  64-bit prefix hash at the end of every block of ``block`` tokens."""
  b, t = tokens.shape
  nb = -(-t // block)
  tok = jnp.pad(tokens, ((0, 0), (0, nb * block - t))) if nb * block > t else tokens
  words = _token_words(tok, jnp.arange(nb * block)[None, :])
  block_sums = [w.reshape(b, nb, block).sum(axis=-1, dtype=jnp.uint32) for w in words]
  return tok, jnp.stack([jnp.cumsum(w, axis=1, dtype=jnp.uint32) for w in block_sums], -1)
