"""The host-side packer (``jaxgrpo.step.packing``): layout, index maps, first-fit decreasing, errors.

References are written independently here: the sequences are rebuilt from the packed rows, positions
from the runs of segment ids, gathers by explicit loops, the optimal number of bins by brute force.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxgrpo.step import packing


def rollout(prompt_lens, completion_lens, P, T, seed=0):
  """Left-padded prompts and right-padded completions with the given real lengths."""
  rng = np.random.default_rng(seed)
  prompt_lens, completion_lens = np.asarray(prompt_lens), np.asarray(completion_lens)
  B = len(prompt_lens)
  pm = np.arange(P)[None] >= P - prompt_lens[:, None]
  cm = np.arange(T)[None] < completion_lens[:, None]
  pt = np.where(pm, rng.integers(1, 1000, (B, P)), 0).astype(np.int32)
  ct = np.where(cm, rng.integers(1, 1000, (B, T)), 0).astype(np.int32)
  return pt, pm, ct, cm


def test_hand_example():
  # sequence lengths 3+2=5, 1+1=2, 2+4=6, 2+0 (no completion: left out); L=8
  pt = np.array([[0, 11, 12, 13], [0, 0, 0, 21], [0, 0, 31, 32], [0, 0, 41, 42]], np.int32)
  pm = pt > 0
  ct = np.array([[14, 15, 0, 0], [22, 0, 0, 0], [33, 34, 35, 36], [0, 0, 0, 0]], np.int32)
  cm = ct > 0
  pk = packing.pack(pt, pm, ct, cm, row_length=8, row_multiple=4)
  # FFD order: seq 2 (6) → row 0; seq 0 (5) → row 1; seq 1 (2) → row 0 (6+2 = 8 fits)
  np.testing.assert_array_equal(pk.row, [1, 0, 0, -1])
  np.testing.assert_array_equal(pk.offset, [0, 6, 0, -1])
  np.testing.assert_array_equal(
    pk.tokens,
    [[31, 32, 33, 34, 35, 36, 21, 22], [11, 12, 13, 14, 15, 0, 0, 0], [0] * 8, [0] * 8],
  )
  np.testing.assert_array_equal(pk.segment_ids[:2], [[1, 1, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(pk.positions[:2], [[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 3, 4, 0, 0, 0]])
  np.testing.assert_array_equal(
    pk.completion_mask[:2].astype(int), [[0, 0, 1, 1, 1, 1, 0, 1], [0, 0, 0, 1, 1, 0, 0, 0]]
  )
  assert pk.tokens.shape == (4, 8) and not pk.segment_ids[2:].any()  # rounded up to row_multiple
  np.testing.assert_array_equal(pk.unpack_index[0], [8 + 3, 8 + 4, -1, -1])
  np.testing.assert_array_equal(pk.unpack_index[2], [2, 3, 4, 5])
  np.testing.assert_array_equal(pk.unpack_index[3], [-1] * 4)
  assert pk.pack_index[0, 7] == 1 * 4 + 0 and pk.pack_index[0, 6] == -1
  for name, x in pk._asdict().items():
    assert isinstance(x, np.ndarray), name
    assert x.dtype == (np.bool_ if name == "completion_mask" else np.int32), name


def positions_of_runs(seg):
  """0, 1, ... from the start of each run of equal non-zero ids; 0 on padding (loops, no NumPy tricks)."""
  out = np.zeros_like(seg)
  for r in range(seg.shape[0]):
    for c in range(seg.shape[1]):
      if seg[r, c] and c and seg[r, c - 1] == seg[r, c]:
        out[r, c] = out[r, c - 1] + 1
  return out


def replay_first_fit_decreasing(lengths, capacity):
  """FFD straight from its definition, in plain Python lists."""
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  fill, bins, offsets = [], [0] * len(lengths), [0] * len(lengths)
  for i in order:
    for j, f in enumerate(fill):
      if f + lengths[i] <= capacity:
        bins[i], offsets[i] = j, f
        fill[j] += lengths[i]
        break
    else:
      bins[i], offsets[i] = len(fill), 0
      fill.append(lengths[i])
  return bins, offsets


def optimal_bins(lengths, capacity):
  """Fewest bins (brute force over assignments, symmetric bins pruned); for a handful of items."""
  best = len(lengths)

  def place(i, fill):
    nonlocal best
    if len(fill) >= best:
      return
    if i == len(lengths):
      best = len(fill)
      return
    for j in range(len(fill)):
      if fill[j] + lengths[i] <= capacity:
        fill[j] += lengths[i]
        place(i + 1, fill)
        fill[j] -= lengths[i]
    place(i + 1, fill + [lengths[i]])

  place(0, [])
  return best


@st.composite
def rollouts(draw):
  P, T = draw(st.integers(1, 6)), draw(st.integers(1, 10))
  B = draw(st.integers(1, 12))
  plen = draw(st.lists(st.integers(1, P), min_size=B, max_size=B))
  clen = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
  L = draw(st.integers(P + T, P + T + 6))
  multiple = draw(st.sampled_from([1, 2, 4]))
  return plen, clen, P, T, L, multiple


@settings(max_examples=60, deadline=None)
@given(rollouts())
def test_layout_and_index_maps(case):
  plen, clen, P, T, L, multiple = case
  pt, pm, ct, cm = rollout(plen, clen, P, T)
  pk = packing.pack(pt, pm, ct, cm, row_length=L, row_multiple=multiple)
  R = pk.tokens.shape[0]
  assert pk.tokens.shape == pk.segment_ids.shape == pk.positions.shape == (R, L) and R % multiple == 0
  seqs = [b for b in range(len(plen)) if clen[b] > 0]
  # every sequence whole in its row, at its offset, with its own segment id and positions 0..n-1
  covered = np.zeros((R, L), bool)
  for b in seqs:
    r, o, n = pk.row[b], pk.offset[b], plen[b] + clen[b]
    expect = np.concatenate([pt[b, P - plen[b] :], ct[b, : clen[b]]])
    np.testing.assert_array_equal(pk.tokens[r, o : o + n], expect)
    assert len(set(pk.segment_ids[r, o : o + n])) == 1 and pk.segment_ids[r, o] > 0
    np.testing.assert_array_equal(pk.positions[r, o : o + n], np.arange(n))
    assert not covered[r, o : o + n].any()
    covered[r, o : o + n] = True
    np.testing.assert_array_equal(pk.completion_mask[r, o : o + n], np.arange(n) >= plen[b])
  assert all(pk.row[b] == -1 and pk.offset[b] == -1 for b in range(len(plen)) if clen[b] == 0)
  np.testing.assert_array_equal(pk.segment_ids > 0, covered)
  np.testing.assert_array_equal(pk.tokens[~covered], 0)
  np.testing.assert_array_equal(pk.positions, positions_of_runs(pk.segment_ids))
  for r in range(R):  # segment ids 1, 2, ... left to right
    runs = [k for k, _ in itertools.groupby(pk.segment_ids[r]) if k]
    assert runs == list(range(1, len(runs) + 1))
  # placement is FFD, and FFD's row count is the smallest multiple that holds it
  lengths = [plen[b] + clen[b] for b in seqs]
  bins, offsets = replay_first_fit_decreasing(lengths, L)
  np.testing.assert_array_equal(pk.row[seqs], bins)
  np.testing.assert_array_equal(pk.offset[seqs], offsets)
  used = max(bins, default=-1) + 1
  assert R == max(multiple, -(-used // multiple) * multiple)
  # index maps against explicit loops
  x = np.random.default_rng(1).standard_normal(cm.shape).astype(np.float32)
  packed_ref = np.zeros((R, L), np.float32)
  for b in seqs:
    for t in range(clen[b]):
      packed_ref[pk.row[b], pk.offset[b] + plen[b] + t] = x[b, t]
  np.testing.assert_array_equal(np.asarray(packing.pack_values(x, pk.pack_index)), packed_ref)
  np.testing.assert_array_equal(np.asarray(packing.unpack(packed_ref, pk.unpack_index)), np.where(cm, x, 0))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 10), min_size=1, max_size=7), st.integers(10, 14))
def test_ffd_matches_definition_and_bound(lengths, capacity):
  bins, offsets = packing.first_fit_decreasing(np.asarray(lengths), capacity)
  ref_bins, ref_offsets = replay_first_fit_decreasing(lengths, capacity)
  np.testing.assert_array_equal(bins, ref_bins)
  np.testing.assert_array_equal(offsets, ref_offsets)
  assert bins.max() + 1 <= 11 / 9 * optimal_bins(sorted(lengths, reverse=True), capacity) + 6 / 9


@pytest.mark.parametrize("micro,mini", [(1, 1), (2, 1), (2, 3), (4, 2)])
def test_micro_batch_view_and_strided_unpack(micro, mini):
  rng = np.random.default_rng(micro * 10 + mini)
  B, P, T, L = 24, 4, 12, 16
  pt, pm, ct, cm = rollout(rng.integers(1, P + 1, B), rng.integers(0, T + 1, B), P, T)
  K, M = micro, mini
  pk = packing.pack(pt, pm, ct, cm, row_length=L, row_multiple=K * M * 2)
  slot = packing.micro_batch_of(pk.row, micro_batches=K, mini_batches=M)
  R = pk.tokens.shape[0]
  x = np.where(cm, rng.standard_normal(cm.shape), 0).astype(np.float32)
  packed = np.asarray(packing.pack_values(x, pk.pack_index))
  total = np.zeros_like(x)
  unpack_slot = jax.jit(packing.unpack, static_argnames="row_stride")
  for m in range(M):
    for k in range(K):
      rows = np.arange(R)[m * K + k :: K * M]  # the train step's row split: i·(M·K) + m·K + k
      part = np.asarray(unpack_slot(packed[rows], pk.unpack_index, row_stride=K * M, row_offset=m * K + k))
      here = (slot == m * K + k)[:, None] & cm
      np.testing.assert_array_equal(part, np.where(here, x, 0))  # exactly the completions of that slot
      total += part
  np.testing.assert_array_equal(total, x)  # each completion in exactly one micro-batch
  np.testing.assert_array_equal(slot == -1, cm.sum(1) == 0)


def test_fixed_num_rows_and_determinism():
  rng = np.random.default_rng(3)
  args = rollout(rng.integers(1, 5, 20), rng.integers(0, 13, 20), 4, 12)
  a = packing.pack(*args, row_length=16, num_rows=16, row_multiple=4)
  b = packing.pack(*(np.copy(x) for x in args), row_length=16, num_rows=16, row_multiple=4)
  assert a.tokens.shape == (16, 16)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


def test_single_sequence_filling_a_row_exactly():
  pt, pm, ct, cm = rollout([3, 2], [13, 14], 3, 14)
  pk = packing.pack(pt, pm, ct, cm, row_length=16)
  assert pk.tokens.shape == (2, 16) and (pk.segment_ids == 1).all()
  np.testing.assert_array_equal(pk.positions, np.tile(np.arange(16), (2, 1)))


def test_errors_name_the_problem():
  pt, pm, ct, cm = rollout([2, 3], [5, 1], 3, 6)
  with pytest.raises(ValueError, match=r"sequence 0 has 7 tokens \(2 prompt \+ 5 completion\), more than row_length=6"):
    packing.pack(pt, pm, ct, cm, row_length=6)
  with pytest.raises(ValueError, match="need 2 rows of 7 tokens, more than num_rows=1"):
    packing.pack(pt, pm, ct, cm, row_length=7, num_rows=1)
  with pytest.raises(ValueError, match="not a multiple of `row_multiple`"):
    packing.pack(pt, pm, ct, cm, row_length=8, num_rows=3, row_multiple=2)
  with pytest.raises(ValueError, match="row_length"):
    packing.pack(pt, pm, ct, cm, row_length=0)
  with pytest.raises(TypeError, match="`prompt_mask` must be a bool"):
    packing.pack(pt, pm.astype(int), ct, cm, row_length=8)
  with pytest.raises(TypeError, match="`completions` must be an integer"):
    packing.pack(pt, pm, ct.astype(np.float32), cm, row_length=8)
  with pytest.raises(ValueError, match="`mask` must have shape"):
    packing.pack(pt, pm, ct, cm[:, :3], row_length=8)
  with pytest.raises(ValueError, match="has 1 rows"):
    packing.pack(pt, pm, ct[:1], cm[:1], row_length=8)
  with pytest.raises(ValueError, match="right padding.*row 1"):
    packing.pack(pt, pm, ct, _set(cm, (1, 3), True), row_length=8)  # a hole after the first token
  with pytest.raises(ValueError, match="left padding.*row 0"):
    packing.pack(pt, _set(pm, (0, 2), False), ct, cm, row_length=8)  # [F, T, T] -> [F, T, F]

  with pytest.raises(ValueError, match="sequence 1 has completion tokens but an empty prompt"):
    packing.pack(pt, pm & (np.arange(2) == 0)[:, None], ct, cm, row_length=8)
  with pytest.raises(ValueError, match=r"lengths must be in \[1, capacity=4\]; item 1 has length 5"):
    packing.first_fit_decreasing(np.array([2, 5]), 4)
  with pytest.raises(ValueError, match="row_stride"):
    packing.unpack(np.zeros((2, 4)), np.zeros((2, 3), np.int32), row_stride=0)
  with pytest.raises(ValueError, match="`values` must be"):
    packing.pack_values(np.zeros(3), np.zeros((2, 3), np.int32))
  with pytest.raises(ValueError, match="micro_batches"):
    packing.micro_batch_of(np.zeros(3, np.int32), micro_batches=0)


def _set(m, idx, value):
  m = np.array(m)
  m[idx] = value
  return m


# ----------------------------------------------------------------------------- pack_slots (the train step's layout)


@settings(max_examples=40, deadline=None)
@given(rollouts(), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_pack_slots_layout_head_buffer_and_buckets(case, num_slots, seed):
  plen, clen, P, T, L, _ = case
  pt, pm, ct, cm = rollout(plen, clen, P, T)
  B = len(plen)
  slot = np.random.default_rng(seed).integers(0, num_slots, B)
  pk = packing.pack_slots(pt, pm, ct, cm, slot, num_slots=num_slots, row_length=L)
  rs = pk.rows_per_slot
  assert pk.tokens.shape == (num_slots * rs, L) and pk.row_length == L
  np.testing.assert_array_equal(pk.slot, slot)
  # every slot is first-fit decreasing of its own sequences in its own rows; Rs the power-of-two bucket
  need = 0
  for s in range(num_slots):
    seqs = [b for b in range(B) if slot[b] == s and clen[b] > 0]
    bins, _ = replay_first_fit_decreasing([plen[b] + clen[b] for b in seqs], L)
    need = max(need, max(bins, default=-1) + 1)
    rows = pk.tokens[s * rs : (s + 1) * rs]
    want = sorted(tuple(np.concatenate([pt[b, P - plen[b] :], ct[b, : clen[b]]])) for b in seqs)
    got = []
    for r in range(rs):  # the sequences found in the slot's rows, by their runs of segment ids
      seg = pk.segment_ids[s * rs + r]
      for k in set(seg[seg > 0].tolist()):
        got.append(tuple(rows[r][seg == k]))
    assert sorted(got) == want
  assert rs == max(1, 1 << (need - 1).bit_length()) if need else rs == 1
  # head buffer: slot s's completion tokens in row-major order, H the smallest eighth of L that holds them
  h = pk.head_index.shape[1] // rs
  most = max((sum(clen[b] for b in range(B) if slot[b] == s) for s in range(num_slots)), default=0)
  assert h == min(x for x in (-(-j * L // 8) for j in range(1, 9)) if rs * x >= most)
  for b in range(B):
    s = slot[b]
    for t in range(T):
      j = pk.unpack_index[b, t]
      assert (j >= 0) == cm[b, t]
      if j >= 0:
        r, c = divmod(int(pk.head_index[s, j]), L)
        assert pk.tokens[s * rs + r, c] == ct[b, t] and pk.positions[s * rs + r, c] == plen[b] + t
  for s in range(num_slots):
    real = np.sort(pk.unpack_index[slot == s][cm[slot == s]])
    np.testing.assert_array_equal(real, np.arange(real.size))  # entries 0..n-1, each once
    flat = pk.head_index[s, : real.size]
    assert np.all(np.diff(flat) > 0) and not pk.head_index[s, real.size :].any()  # row-major, then zeros


def test_pack_slots_fixed_shapes_and_errors():
  pt, pm, ct, cm = rollout([2, 3, 1, 2], [5, 1, 0, 6], 3, 6)
  slot = np.array([0, 1, 0, 1])
  pk = packing.pack_slots(pt, pm, ct, cm, slot, num_slots=2, row_length=8, rows=3, head_length=5)
  assert pk.tokens.shape == (6, 8) and pk.head_index.shape == (2, 15)
  # slot 1: 3+1 and 2+6 tokens: FFD puts 8 in row 0, 4 in row 1
  np.testing.assert_array_equal(pk.segment_ids[3], [1] * 8)
  np.testing.assert_array_equal(pk.segment_ids[4], [1] * 4 + [0] * 4)
  with pytest.raises(ValueError, match="slot 1 needs 2 rows of 8 tokens, more than rows=1"):
    packing.pack_slots(pt, pm, ct, cm, slot, num_slots=2, row_length=8, rows=1)
  with pytest.raises(ValueError, match=r"slot 1 has 7 completion tokens, more than rows·head_length = 2·3"):
    packing.pack_slots(pt, pm, ct, cm, slot, num_slots=2, row_length=8, rows=2, head_length=3)
  with pytest.raises(ValueError, match=r"`slot` values must be in \[0, num_slots=2\)"):
    packing.pack_slots(pt, pm, ct, cm, slot + 1, num_slots=2, row_length=8)
  with pytest.raises(ValueError, match=r"`slot` must be an int array of shape \(4,\)"):
    packing.pack_slots(pt, pm, ct, cm, slot[:3], num_slots=2, row_length=8)
  with pytest.raises(ValueError, match=r"sequence 3 has 8 tokens .* more than row_length=7"):
    packing.pack_slots(pt, pm, ct, cm, slot, num_slots=2, row_length=7)
  empty = packing.pack_slots(pt, pm, ct, np.zeros_like(cm), slot, num_slots=2, row_length=8)
  assert empty.tokens.shape == (2, 8) and not empty.segment_ids.any() and (empty.unpack_index == -1).all()
