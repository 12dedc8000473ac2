"""Prefix hashes against structured near-collisions (issue 14, item 1).

The former hash fed ``tok·φ + (pos+1)·c (mod 2**32)`` (plus a per-word seed) to one mixer for both
words, so two sequences that swap the pre-images of two positions collide in both words at once. The
tests below rebuild that construction from the old constants (checking, with a NumPy copy of the old
scheme, that it really collides there), and check that the public functions now tell the sequences
apart, word by word, over several structured families.
"""

import jax
import numpy as np

import jaxgrpo as jg

_OLD_PHI, _OLD_C = 0x9E3779B1, 0x85EBCA77
_OLD_SEEDS = (0x2545F491, 0x6C8E9CF5)


def _old_fmix32(h):
  h = h.astype(np.uint64) & 0xFFFFFFFF
  h ^= h >> 16
  h = (h * 0x85EBCA6B) & 0xFFFFFFFF
  h ^= h >> 13
  h = (h * 0xC2B2AE35) & 0xFFFFFFFF
  return h ^ (h >> 16)


def _old_words(tok, pos):
  """The former per-(token, position) words: fmix32(tok·φ + (pos+1)·c + seed), one per seed."""
  pre = (np.asarray(tok, np.uint64) * _OLD_PHI + (np.asarray(pos, np.uint64) + 1) * _OLD_C) & 0xFFFFFFFF
  return [_old_fmix32((pre + s) & 0xFFFFFFFF) for s in _OLD_SEEDS]


def _issue_pair():
  rng = np.random.default_rng(0)
  x = rng.integers(1, 1000, size=40_000).astype(np.int32)
  a, b = x.copy(), x.copy()
  a[10], a[19576] = 100, 50000
  b[10], b[19576] = 20242, 29858
  return np.stack([a, b])


def test_issue_construction_collided_before_and_not_now():
  tokens = _issue_pair()
  pos = np.array([10, 19576])
  old_a, old_b = _old_words(tokens[0, pos], pos), _old_words(tokens[1, pos], pos)
  for w in range(2):  # the old scheme: the same multiset of words, in both words
    assert sorted(old_a[w]) == sorted(old_b[w])
  mask = np.ones_like(tokens, bool)
  gid = np.zeros(2, np.int32)
  want = np.where(np.arange(40_000) < 10, 2, 1)
  for kwargs in ({}, {"method": "pairwise"}, {"method": "sort"}):
    got = np.asarray(jg.process_set_sizes(tokens, mask, gid, **kwargs))
    np.testing.assert_array_equal(got, np.stack([want, want]), err_msg=str(kwargs))
  rewards = np.array([1.0, 0.0], np.float32)
  adv = np.asarray(jg.process_advantages(rewards, tokens, mask, gid, 1))
  np.testing.assert_allclose(adv[:, 10:], np.array([[1.0], [-1.0]]) * np.ones((1, 40_000 - 10)), atol=1e-5)
  h = np.asarray(jg.prefix_hashes(tokens, mask))
  assert np.all(h[0, 10:] != h[1, 10:])  # each word differs at every position past the change


def _old_linear_family(t: int, vocab: int, per_solution: int, rng):
  """Pairs of rows that collide under the old scheme: all (d, k) with k·φ ≡ d·c, 0 < d < t, |k| < vocab."""
  inv = pow(_OLD_PHI, -1, 2**32)
  pairs = []
  for d in range(1, t):
    k = (d * _OLD_C * inv) % 2**32
    k = k - 2**32 if k >= 2**31 else k
    if abs(k) >= vocab:
      continue
    for _ in range(per_solution):
      p = int(rng.integers(0, t - d))
      q = p + d
      row = rng.integers(0, vocab, size=t).astype(np.int64)
      a = int(rng.integers(max(0, k), vocab + min(0, k)))  # a and b' = a - k in [0, vocab)
      b = int(rng.integers(max(0, -k), vocab + min(0, -k)))  # b and a' = b + k in [0, vocab)
      x, y = row.copy(), row.copy()
      x[p], x[q] = a, b
      y[p], y[q] = b + k, a - k
      pairs.append((x, y))
  return pairs


def test_old_linear_family_no_longer_collides():
  rng = np.random.default_rng(1)
  t, vocab = 40_000, 1 << 20
  pairs = _old_linear_family(t, vocab, per_solution=2, rng=rng)
  assert len(pairs) >= 30  # 18 (d, k) solutions below 40,000 tokens and a 2**20 vocabulary
  for x, y in pairs:  # the construction is right: the old scheme collides on every pair
    diff = np.flatnonzero(x != y)
    ox, oy = _old_words(x[diff], diff), _old_words(y[diff], diff)
    assert all(sorted(ox[w]) == sorted(oy[w]) for w in range(2))
  tokens = np.stack([r for pair in pairs for r in pair]).astype(np.int32)
  h = np.asarray(jg.prefix_hashes(tokens, np.ones_like(tokens, bool)))[:, -1]  # [2N, 2]
  assert np.all(h[0::2] != h[1::2]), "a pair collides in at least one word"


def _structured_pairs(rng, t: int, vocab: int):
  """Families of near-identical rows whose differences follow simple rules (each yields (x, y) pairs)."""
  base = rng.integers(0, vocab, size=t)
  out = []
  # 1. two-position differences with the token sum preserved, over a grid of distances d and offsets k
  for d in (1, 2, 3, 7, 16, 64, 100, t // 2, t - 1):
    for k in (1, 2, 3, 5, 64, 1000, 2**16, vocab // 3):
      p = int(rng.integers(0, t - d))
      x = base.copy()
      x[p], x[p + d] = vocab // 2, vocab // 2
      y = x.copy()
      y[p], y[p + d] = vocab // 2 + k, vocab // 2 - k
      out.append((x, y))
  # 2. swaps of two tokens at two positions
  for _ in range(200):
    p, q = sorted(rng.choice(t, 2, replace=False))
    x = base.copy()
    x[p], x[q] = rng.integers(0, vocab, 2)
    y = x.copy()
    y[p], y[q] = x[q], x[p]
    if not np.array_equal(x, y):
      out.append((x, y))
  # 3. tokens along an arithmetic progression of positions and values, in forward vs reverse order
  for d in (1, 2, 5, 17):
    for k in (1, 3, 1000):
      m = min(8, (t - 1) // d)
      pos = np.arange(m) * d + int(rng.integers(0, t - (m - 1) * d))
      x, y = base.copy(), base.copy()
      x[pos] = 10 + np.arange(m) * k
      y[pos] = 10 + np.arange(m)[::-1] * k
      out.append((x, y))
  # 4. the same row shifted by one position (different token at every position, same multiset)
  for s in (1, 2, 3):
    x = np.arange(t) % 7
    out.append((x, np.roll(x, s)))
  # 5. a token difference k at position p against -k at position p + d, with k·(large odd) ≡ d·(odd)
  #    for several other multipliers: the old attack, with other constants in place of φ and c
  for phi, c in ((0x01000193, 0x27D4EB2F), (0x7FEB352D, 0x846CA68B)):
    inv = pow(phi, -1, 2**32)
    for d in range(1, t):
      k = (d * c * inv) % 2**32
      k = k - 2**32 if k >= 2**31 else k
      if abs(k) < vocab // 2:
        p = int(rng.integers(0, t - d))
        x = base.copy()
        x[p], x[p + d] = vocab // 2, vocab // 2
        y = x.copy()
        y[p], y[p + d] = vocab // 2 - k, vocab // 2 + k
        out.append((x, y))
  return out


def test_structured_families_never_collide_in_either_word():
  rng = np.random.default_rng(2)
  t, vocab = 512, 151_936
  pairs = _structured_pairs(rng, t, vocab)
  assert len(pairs) > 250
  tokens = np.stack([r for pair in pairs for r in pair]).astype(np.int32)
  mask = np.ones_like(tokens, bool)
  h = np.asarray(jax.jit(jg.prefix_hashes)(tokens, mask))  # [2N, T, 2]
  x, y = h[0::2], h[1::2]
  first = np.argmax(tokens[0::2] != tokens[1::2], axis=1)  # first differing position of each pair
  after = np.arange(t)[None, :] >= first[:, None]
  for w in range(2):  # each 32-bit word alone: N·T comparisons, ~N·T·2**-32 expected by chance
    assert not np.any((x[..., w] == y[..., w]) & after), f"word {w} collides"
  np.testing.assert_array_equal(x[~after], y[~after])  # and equal prefixes still hash equal


def test_single_position_difference_always_differs():
  # certain, not probabilistic: each word is a bijection of the token at a fixed position
  t = 64
  tokens = np.zeros((2 * 1000, t), np.int32)
  rng = np.random.default_rng(3)
  for n in range(1000):
    p = int(rng.integers(0, t))
    a, b = rng.choice(151_936, 2, replace=False)
    tokens[2 * n, p], tokens[2 * n + 1, p] = a, b
  h = np.asarray(jg.prefix_hashes(tokens, np.ones_like(tokens, bool)))[:, -1]
  assert np.all(h[0::2] != h[1::2])
