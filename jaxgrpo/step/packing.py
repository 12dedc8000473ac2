"""Sequence packing: a rollout's (prompt, completion) sequences placed back to back in rows of a fixed
token budget, and the index maps between the packed rows and the rollout's ``[B, T]`` completion layout.

A rollout (``jaxgrpo.rollout.sampling.Rollout``) holds ``B`` left-padded prompts ``int32[B, P]`` and
right-padded completions ``int32[B, T]``; with long, ragged completions most of ``[B, P + T]`` is
padding. :func:`pack` keeps only the real tokens of each sequence (its prompt tokens, then its
completion tokens, no padding inside) and places the sequences into ``R`` rows of ``L`` tokens by
first-fit decreasing (:func:`first_fit_decreasing`). The models take the packed rows with
``segment_ids`` and per-segment ``positions`` (``CausalLM.__call__``), so attention never crosses
sequences and each sequence's hidden states equal those of the sequence alone.

Only the forward/backward pass needs the packed layout: per-token values computed on the packed rows
(log-probs, entropies) go back to ``[B, T]`` with :func:`unpack`, a gather with static shapes that
runs inside ``jit``; :func:`pack_values` is the opposite gather. Both take the index maps of
:class:`PackedBatch` as data, so a new layout (a new rollout) never recompiles a program: only
``R`` and ``L`` are shapes.

The train step packs slot by slot (:func:`pack_slots`, :class:`PackedSlots`): one FFD per slot
(device shard × mini-batch × micro-batch, ``jaxgrpo.step.train.batch_slots``), so that every micro-batch
holds exactly the sequences of the unpacked one, with a head buffer listing each slot's completion
tokens (the only positions that go through the LM head, ``jaxgrpo.models.packed_log_probs``).

With ``sharing`` (``TrainConfig.prefix_sharing``), :func:`pack_slots` packs prefix trees instead of sequences
(``jaxgrpo.step.prefix_tree``: the tokens that sequences of a slot share are laid out once, with each key's subtree
end ``kv_end`` for the attention mask); the head buffer and the index maps keep their meaning.

The packers (:func:`pack`, :func:`pack_slots`, :func:`first_fit_decreasing`) are host-side NumPy.

One job at ~600 lines: the packed layout of a rollout's sequences and its index maps (the packers, their checks
and the gathers between the two layouts).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo.step.prefix_tree import SHARING, build_trees

__all__ = [
  "HEAD_FRACTIONS",
  "PackedBatch",
  "PackedSlots",
  "check_routing_array",
  "first_fit_decreasing",
  "micro_batch_of",
  "pack",
  "pack_slots",
  "pack_values",
  "unpack",
]


class PackedBatch(NamedTuple):
  """Packed rows and the index maps back to the rollout (R rows of L tokens; B sequences, T completion
  slots). Every field is a NumPy array.

  Attributes:
    tokens: ``int32[R, L]`` token ids; 0 on padding.
    segment_ids: ``int32[R, L]``: 0 on padding, ``k >= 1`` on the row's k-th sequence (in placement
      order, left to right).
    positions: ``int32[R, L]``: 0, 1, ... from each sequence's first prompt token; 0 on padding
      (``jaxgrpo.models.positions_from_segments(segment_ids)``).
    completion_mask: ``bool[R, L]``: True on columns holding a real completion token, i.e. the targets
      whose log-probs are scored (predicted from the hidden state one column to the left, which is in
      the same sequence because every prompt has at least one token).
    unpack_index: ``int32[B, T]``: flat index ``r·L + c`` of completion token ``(b, t)`` in the packed
      rows; -1 where ``mask[b, t]`` is False.
    pack_index: ``int32[R, L]``: flat index ``b·T + t`` of the completion token at ``(r, c)``; -1 where
      ``completion_mask`` is False.
    row: ``int32[B]``: the row holding sequence b; -1 when b has no completion token (such sequences
      are not packed: nothing of theirs is scored).
    offset: ``int32[B]``: the column of sequence b's first prompt token; -1 likewise.
  """

  tokens: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  completion_mask: np.ndarray
  unpack_index: np.ndarray
  pack_index: np.ndarray
  row: np.ndarray
  offset: np.ndarray


def first_fit_decreasing(lengths, capacity: int) -> tuple[np.ndarray, np.ndarray]:
  """Place items of ``lengths`` into bins of ``capacity`` by first-fit decreasing (FFD).

  The items are taken longest first (ties: lower index first, a stable sort); each goes into the
  lowest-numbered bin with room for it, at that bin's first free column, or opens a new bin.
  Johnson (1973) showed FFD is within 11/9 of optimal; the tight bound is
  ``FFD(I) <= 11/9 · OPT(I) + 6/9`` bins (Dósa, 2007), where OPT is the fewest bins any placement
  needs (at least ``ceil(sum(lengths) / capacity)``).

  Deterministic: only integer comparisons in a fixed order (stable sort, bins scanned from 0), no
  randomness, no hashing; the same lengths give the same placement on every host and every run, so
  processes of a multi-host job agree on the layout without communicating.

  Args:
    lengths: ``int[n]`` item sizes, each in ``[1, capacity]``.
    capacity: bin size (the packed row length L).

  Returns:
    ``(bins int32[n], offsets int32[n])``: the bin of each item (bins are numbered 0, 1, ... in the
    order they were opened) and the first column it occupies there.
  """
  lengths = np.asarray(lengths)
  if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(f"lengths must be a 1-D integer array, got shape {lengths.shape} dtype {lengths.dtype}")
  if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool) or capacity < 1:
    raise ValueError(f"capacity must be a positive int, got {capacity!r}")
  if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
    bad = int(np.flatnonzero((lengths < 1) | (lengths > capacity))[0])
    raise ValueError(f"lengths must be in [1, capacity={capacity}]; item {bad} has length {int(lengths[bad])}")
  n = lengths.size
  bins = np.empty(n, np.int32)
  offsets = np.empty(n, np.int32)
  free = np.empty(n, np.int64)  # free[j]: room left in bin j (at most n bins)
  opened = 0
  for i in np.argsort(-lengths, kind="stable"):
    fits = np.flatnonzero(free[:opened] >= lengths[i])
    if fits.size:
      j = int(fits[0])
    else:
      j = opened
      free[j] = capacity
      opened += 1
    bins[i], offsets[i] = j, capacity - free[j]
    free[j] -= lengths[i]
  return bins, offsets


def _check_int_2d(name: str, x) -> np.ndarray:
  x = np.asarray(x)
  if x.ndim != 2:
    raise ValueError(f"`{name}` must be a 2-D array [B, ...], got shape {x.shape}")
  if not np.issubdtype(x.dtype, np.integer):
    raise TypeError(f"`{name}` must be an integer array, got dtype {x.dtype}")
  return x


def _check_mask(name: str, m, shape) -> np.ndarray:
  m = np.asarray(m)
  if m.dtype != np.bool_:
    raise TypeError(f"`{name}` must be a bool array, got dtype {m.dtype}")
  if m.shape != shape:
    raise ValueError(f"`{name}` must have shape {shape}, got {m.shape}")
  return m


def _positive_int(name: str, value) -> int:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
    raise ValueError(f"`{name}` must be a positive int, got {value!r}")
  return int(value)


def pack(
  prompt_tokens,
  prompt_mask,
  completions,
  mask,
  *,
  row_length: int,
  num_rows: int | None = None,
  row_multiple: int = 1,
) -> PackedBatch:
  """Pack a rollout's sequences (real prompt tokens, then real completion tokens) into rows of
  ``row_length`` tokens by first-fit decreasing.

  Sequence ``b`` is ``prompt_tokens[b][prompt_mask[b]] ‖ completions[b][mask[b]]``, of length
  ``n_b = p_b + c_b``; it is placed whole in one row (a sequence never spans two rows) at the column
  :func:`first_fit_decreasing` gives it. Sequences with no completion token (``c_b = 0``) have nothing
  to score and are left out. The number of rows R is ``num_rows`` when given (a fixed shape: no
  recompilation from one rollout to the next), else the smallest multiple of ``row_multiple`` that
  holds the rows FFD opened (e.g. ``row_multiple = data × fsdp × mini_batches × micro_batches``, so
  the rows split evenly over devices and micro-batches). Rows FFD did not use are padding.

  Args:
    prompt_tokens: ``int[B, P]`` left-padded prompts (``Rollout.prompt_tokens``).
    prompt_mask: ``bool[B, P]`` real prompt tokens: a suffix of each row, at least one token for every
      sequence with a completion token.
    completions: ``int[B, T]`` right-padded completions.
    mask: ``bool[B, T]`` real completion tokens: a prefix of each row.
    row_length: L, tokens per packed row; every sequence must fit (``n_b <= L``).
    num_rows: R, or None to size it from ``row_multiple``. Must be a multiple of ``row_multiple``.
    row_multiple: R is a multiple of this.

  Returns:
    A :class:`PackedBatch`.

  Raises:
    ValueError: a sequence longer than ``row_length`` (naming it), more rows needed than
      ``num_rows``, masks that are not left/right padding, bad shapes. TypeError: wrong dtypes.
  """
  L = _positive_int("row_length", row_length)
  multiple = _positive_int("row_multiple", row_multiple)
  if num_rows is not None:
    num_rows = _positive_int("num_rows", num_rows)
    if num_rows % multiple:
      raise ValueError(f"`num_rows` {num_rows} is not a multiple of `row_multiple` {multiple}")
  prompt_tokens, completions, p_len, c_len, seqs = _check_rollout(prompt_tokens, prompt_mask, completions, mask, L)
  n = p_len + c_len
  bins, offs = first_fit_decreasing(n[seqs], L)
  used = int(bins.max()) + 1 if bins.size else 0
  if num_rows is None:
    R = max(multiple, -(-used // multiple) * multiple)
  elif used > num_rows:
    raise ValueError(
      f"the {seqs.size} sequences ({int(n[seqs].sum())} tokens) need {used} rows of {L} tokens, more than "
      f"num_rows={num_rows}; raise num_rows or row_length"
    )
  else:
    R = num_rows
  return _fill_rows(prompt_tokens, completions, p_len, c_len, seqs, bins, offs, R, L)


def _check_rollout(prompt_tokens, prompt_mask, completions, mask, L: int):
  """Shapes, dtypes and padding of a rollout; ``(prompt_tokens, completions, p_len, c_len, seqs)`` with
  ``seqs`` the sequences that have a completion token (each fits a row of ``L`` tokens)."""
  prompt_tokens = _check_int_2d("prompt_tokens", prompt_tokens)
  completions = _check_int_2d("completions", completions)
  B, P = prompt_tokens.shape
  T = completions.shape[1]
  if completions.shape[0] != B:
    raise ValueError(f"`completions` has {completions.shape[0]} rows but `prompt_tokens` has {B}")
  prompt_mask = _check_mask("prompt_mask", prompt_mask, (B, P))
  mask = _check_mask("mask", mask, (B, T))
  p_len = prompt_mask.sum(1)
  c_len = mask.sum(1)
  not_suffix = np.flatnonzero((prompt_mask != (np.arange(P)[None] >= P - p_len[:, None])).any(1))
  if not_suffix.size:
    raise ValueError(f"`prompt_mask` must be left padding (a suffix of True); row {int(not_suffix[0])} is not")
  not_prefix = np.flatnonzero((mask != (np.arange(T)[None] < c_len[:, None])).any(1))
  if not_prefix.size:
    raise ValueError(f"`mask` must be right padding (a prefix of True); row {int(not_prefix[0])} is not")
  seqs = np.flatnonzero(c_len > 0)
  empty_prompt = seqs[p_len[seqs] == 0]
  if empty_prompt.size:
    raise ValueError(
      f"sequence {int(empty_prompt[0])} has completion tokens but an empty prompt: its first completion "
      "token would have no token to be predicted from"
    )
  n = p_len + c_len
  too_long = seqs[n[seqs] > L]
  if too_long.size:
    b = int(too_long[0])
    raise ValueError(
      f"sequence {b} has {int(n[b])} tokens ({int(p_len[b])} prompt + {int(c_len[b])} completion), more than "
      f"row_length={L}; raise row_length (or truncate the rollout): a sequence is never split across rows"
    )
  return prompt_tokens, completions, p_len, c_len, seqs


def _fill_rows(prompt_tokens, completions, p_len, c_len, seqs, rows, offsets, R: int, L: int) -> PackedBatch:
  """The :class:`PackedBatch` with sequence ``seqs[i]`` in row ``rows[i]`` from column ``offsets[i]``."""
  B, P = prompt_tokens.shape
  T = completions.shape[1]
  tokens = np.zeros((R, L), np.int32)
  segment_ids = np.zeros((R, L), np.int32)
  positions = np.zeros((R, L), np.int32)
  unpack_index = np.full((B, T), -1, np.int32)
  pack_index = np.full((R, L), -1, np.int32)
  row = np.full(B, -1, np.int32)
  offset = np.full(B, -1, np.int32)
  row[seqs], offset[seqs] = rows, offsets
  segments_in_row = np.zeros(R, np.int32)
  for b in seqs[np.lexsort((offsets, rows))]:  # row by row, left to right: segment ids 1, 2, ...
    r, o, p, c = int(row[b]), int(offset[b]), int(p_len[b]), int(c_len[b])
    segments_in_row[r] += 1
    tokens[r, o : o + p] = prompt_tokens[b, P - p :]
    tokens[r, o + p : o + p + c] = completions[b, :c]
    segment_ids[r, o : o + p + c] = segments_in_row[r]
    positions[r, o : o + p + c] = np.arange(p + c)
    cols = o + p + np.arange(c)
    unpack_index[b, :c] = r * L + cols
    pack_index[r, cols] = b * T + np.arange(c)
  return PackedBatch(
    tokens=tokens,
    segment_ids=segment_ids,
    positions=positions,
    completion_mask=pack_index >= 0,
    unpack_index=unpack_index,
    pack_index=pack_index,
    row=row,
    offset=offset,
  )


class PackedSlots(NamedTuple):
  """A rollout packed slot by slot: the train step's and the reference pass's packed layout.

  Each sequence b belongs to one slot ``slot[b]`` of S (the train step's slots: one per device shard ×
  mini-batch × micro-batch, ``jaxgrpo.step.train.batch_slots``); the sequences of a slot are packed by
  first-fit decreasing into that slot's own ``Rs`` rows of ``L`` tokens, so the model call of one
  micro-batch on one device sees exactly the sequences of that micro-batch on that device. Every slot
  lists its completion tokens in a *head buffer* of ``C = Rs·H`` entries (row-major order of the
  packed rows): only those positions go through the LM head, never a prompt or padding position
  (beyond the buffer's unused tail). All index maps are local to their slot. Every field is NumPy.

  Attributes:
    tokens: ``int32[S·Rs, L]``: slot s in rows ``[s·Rs, (s+1)·Rs)``; 0 on padding.
    segment_ids: ``int32[S·Rs, L]``: 0 on padding, ``k >= 1`` on the row's k-th sequence.
    positions: ``int32[S·Rs, L]``: 0, 1, ... from each sequence's first prompt token; 0 on padding.
    head_index: ``int32[S, Rs·H]``: ``head_index[s, j] = r·L + c``, the column c of row r (counted
      within the slot) holding the slot's j-th completion token (its log-prob comes from the hidden
      state at ``r·L + c - 1``, the same sequence: every prompt has a token); 0 after the last one.
    unpack_index: ``int32[B, T]``: the entry j of ``head_index[slot[b]]`` holding completion token
      ``(b, t)``; -1 where ``mask[b, t]`` is False.
    slot: ``int32[B]``: the slot of each sequence (as given to :func:`pack_slots`).
    kv_end: None, or with prefix sharing ``int32[S·Rs, L]``: the end (exclusive column) of each key's subtree
      in its row, the mask's bound (query c sees key j of its segment iff ``j <= c < kv_end[j]``); positions are
      then depths, and ``(b, t)`` of sequences sharing a completion token share its head entry.
    routing: None, or a mixture of experts' recorded routing in the packed layout, ``int[S·Rs, L, M, k]`` (the
      dtype given to :func:`pack_slots`): the experts each sparse layer used for the token at each column when it
      was sampled (``Rollout.routing`` moved with its token; expert 0 on padding), replayed by the packed forward.
      A token that prefix sharing lays out once for several sequences takes the routing of the sequence that laid
      it out (the same token in the same context: the same experts, up to ties).
    row_in_slot: ``int32[S·Rs, L]`` (filled by :func:`pack_slots`; None in a layout built by hand): for each column,
      the rank of the sequence that laid it out among its slot's rows in increasing row order — its row in the
      micro-batch's rows of its device shard, as ``jaxgrpo.step.terms.split_micro`` lays out the step's row
      fields — 0 on padding. The packed forward takes each token's LoRA dropout key from that row
      (``jaxgrpo.models.log_probs.token_dropout_keys``).
  """

  tokens: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  head_index: np.ndarray
  unpack_index: np.ndarray
  slot: np.ndarray
  kv_end: np.ndarray | None = None
  routing: np.ndarray | None = None
  row_in_slot: np.ndarray | None = None

  @property
  def rows_per_slot(self) -> int:
    """Rs."""
    return self.tokens.shape[0] // self.head_index.shape[0]

  def map_arrays(self, fn) -> "PackedSlots":
    """``fn(x, dtype)`` over the arrays (None fields stay None), ``dtype`` each one's dtype in the step: ``int32``
    for the index maps, the routing's own compact dtype (``jaxgrpo.models.moe.replay_dtype``) for ``routing``.
    How the step's placement and abstract inputs are made from a layout."""
    out = jax.tree.map(lambda x: fn(x, jnp.int32), self._replace(routing=None))
    return out if self.routing is None else out._replace(routing=fn(self.routing, self.routing.dtype))

  @property
  def row_length(self) -> int:
    """L."""
    return self.tokens.shape[1]


HEAD_FRACTIONS = 8  # the head length H is one of ceil(j·L / 8), j = 1..8: a few compiled shapes


def pack_slots(
  prompt_tokens,
  prompt_mask,
  completions,
  mask,
  slot,
  *,
  num_slots: int,
  row_length: int,
  rows: int | None = None,
  head_length: int | None = None,
  sharing: str = "none",
  routing=None,
) -> PackedSlots:
  """Pack each slot's sequences (real prompt tokens, then real completion tokens) into its own rows of
  ``row_length`` tokens by first-fit decreasing (:func:`first_fit_decreasing`, per slot).

  Shapes are static per run up to a few buckets: every slot gets the same number of rows ``Rs`` and
  head entries ``Rs·H``. ``Rs`` is ``rows`` when given (one shape; more rows needed is a ValueError),
  else the smallest power of two holding the fullest slot. ``H`` is ``head_length`` when given, else
  the smallest ``ceil(j·L / 8)`` (j = 1..8) with ``Rs·H`` at least the most completion tokens of any
  slot. Sequences with no completion token are left out (nothing of theirs is scored).

  Args:
    prompt_tokens, prompt_mask, completions, mask: the rollout, as for :func:`pack`.
    slot: ``int[B]`` the slot of each sequence, in ``[0, num_slots)``.
    num_slots: S.
    row_length: L; every sequence must fit a row.
    rows: Rs, rows per slot (None: the power-of-two bucket of the need).
    head_length: H (None: the bucket of the need, see above); ``rows · head_length`` must hold every
      slot's completion tokens.
    sharing: ``"none"`` (each sequence whole), ``"prompt"`` or ``"tree"``: each slot's sequences as prefix
      trees (``jaxgrpo.step.prefix_tree.build_trees``; a tree is placed whole, like a sequence, and fills
      ``kv_end``).
    routing: None, or ``int[B, P + T, M, k]`` the experts recorded for every token of ``[prompt ‖ completion]``
      (``Rollout.routing``, routing replay): moved with the tokens into :attr:`PackedSlots.routing`.

  Returns:
    A :class:`PackedSlots`.

  Raises:
    ValueError: what :func:`pack` raises, a slot out of range, more rows or head entries needed than
      ``rows`` / ``rows·head_length`` (naming the slot), ``routing`` of another shape. TypeError: wrong dtypes.
  """
  L = _positive_int("row_length", row_length)
  S = _positive_int("num_slots", num_slots)
  prompt_tokens, completions, p_len, c_len, seqs = _check_rollout(prompt_tokens, prompt_mask, completions, mask, L)
  B = prompt_tokens.shape[0]
  slot = np.asarray(slot)
  if slot.shape != (B,) or not np.issubdtype(slot.dtype, np.integer):
    raise ValueError(f"`slot` must be an int array of shape ({B},), got {slot.dtype}{list(slot.shape)}")
  if B and (slot.min() < 0 or slot.max() >= S):
    raise ValueError(f"`slot` values must be in [0, num_slots={S}); got values in [{slot.min()}, {slot.max()}]")
  if sharing not in SHARING:
    raise ValueError(f"`sharing` must be one of {SHARING}; got {sharing!r}")
  if routing is not None:
    routing = np.asarray(routing)
    check_routing_array(routing, *prompt_tokens.shape, completions.shape[1], "`routing`")
  rank = np.zeros(B, np.int64)  # each row's rank among its slot's rows (increasing row order)
  for s in range(S):
    mine = np.flatnonzero(slot == s)
    rank[mine] = np.arange(mine.size)
  width = prompt_tokens.shape[1] + completions.shape[1]
  if sharing != "none":
    packed, source = _pack_tree_slots(
      prompt_tokens, completions, p_len, c_len, seqs, slot, S, L, rows, head_length, sharing
    )
    return _with_sources(packed, source, width, rank, routing)
  n = p_len + c_len
  bins = np.zeros(seqs.size, np.int64)
  offs = np.zeros(seqs.size, np.int64)
  used = np.zeros(S, np.int64)
  for s in range(S):
    mine = np.flatnonzero(slot[seqs] == s)
    bins[mine], offs[mine] = first_fit_decreasing(n[seqs[mine]], L)
    used[s] = bins[mine].max() + 1 if mine.size else 0
  Rs = _slot_rows(rows, used, L)
  packed = _fill_rows(prompt_tokens, completions, p_len, c_len, seqs, slot[seqs] * Rs + bins, offs, S * Rs, L)
  slots = _with_head_buffer(
    packed.tokens, packed.segment_ids, packed.positions, packed.unpack_index, slot, S, head_length
  )
  source = np.full(packed.tokens.shape, -1, np.int64)
  for b in seqs:  # sequence b's n_b tokens from (row[b], offset[b]): its columns P - p_b, ..., P + c_b - 1
    r, o, n_b = int(packed.row[b]), int(packed.offset[b]), int(n[b])
    source[r, o : o + n_b] = b * width + prompt_tokens.shape[1] - p_len[b] + np.arange(n_b)
  return _with_sources(slots, source, width, rank, routing)


def _with_sources(slots: PackedSlots, source: np.ndarray, width: int, rank: np.ndarray, routing) -> PackedSlots:
  """``slots`` with the data of the sequence token each column holds (``source``: flat ``b·width + j`` into the
  rollout's ``[B, P + T]``, -1 on padding): ``row_in_slot`` (``rank[b]``) and, with ``routing``, the packed routing."""
  row_in_slot = np.where(source >= 0, rank[np.maximum(source, 0) // width], 0).astype(np.int32)
  return slots._replace(routing=_packed_routing(routing, source), row_in_slot=row_in_slot)


def check_routing_array(routing, b: int, p: int, t: int, name: str) -> None:
  """ValueError/TypeError naming ``name`` unless ``routing`` (NumPy, a ``jax.Array`` or a ``ShapeDtypeStruct``: only
  its shape and dtype are read) is ``int[B, P + T, M, k]``, a mixture of experts' recorded routing."""
  shape = np.shape(routing)
  if len(shape) != 4 or shape[:2] != (b, p + t):
    raise ValueError(f"{name} must be int[B, P + T, M, k] = [{b}, {p + t}, M, k]; got shape {shape}")
  if not np.issubdtype(np.dtype(routing.dtype), np.integer):
    raise TypeError(f"{name} must hold integer expert ids; got dtype {routing.dtype}")


def _packed_routing(routing, source: np.ndarray):
  """``routing[B, P + T, M, k]`` gathered to the packed columns ``source int[R, L]`` (flat ``b·(P + T) + j``, -1 on
  padding: expert 0 there); None without routing."""
  if routing is None:
    return None
  flat = routing.reshape((-1,) + routing.shape[2:])
  return np.where((source >= 0)[..., None, None], flat[np.maximum(source, 0)], 0).astype(routing.dtype)


def _with_head_buffer(tokens, segment_ids, positions, targets, slot, S: int, head_length, kv_end=None) -> PackedSlots:
  """The :class:`PackedSlots` of packed rows ``[S·Rs, L]`` whose completion token ``(b, t)`` is scored at the flat
  column ``targets[b, t]`` (-1: none; several ``(b, t)`` may share one): the head buffer lists each slot's scored
  columns in row-major order (entry j of slot s ↔ its j-th one)."""
  L = tokens.shape[1]
  Rs = tokens.shape[0] // S
  real = targets >= 0  # [B, T]
  completion = np.zeros(S * Rs * L, bool)
  completion[targets[real]] = True
  completion = completion.reshape(S, Rs * L)
  H = _head_length(head_length, completion.sum(1), Rs, L)
  rank = np.cumsum(completion, axis=1, dtype=np.int64) - 1  # [S, Rs·L]: j at each completion column
  head_index = np.zeros((S, Rs * H), np.int32)
  where_s, where_c = np.nonzero(completion)
  head_index[where_s, rank[where_s, where_c]] = where_c
  local = targets - (slot * Rs * L)[:, None]  # flat index within the slot's rows
  unpack_index = np.where(real, rank[np.broadcast_to(slot[:, None], real.shape), np.where(real, local, 0)], -1)
  return PackedSlots(
    tokens=tokens,
    segment_ids=segment_ids,
    positions=positions,
    head_index=head_index,
    unpack_index=unpack_index.astype(np.int32),
    slot=slot.astype(np.int32),
    kv_end=kv_end,
  )


def _pack_tree_slots(prompt_tokens, completions, p_len, c_len, seqs, slot, S, L, rows, head_length, sharing):
  """:func:`pack_slots` with ``sharing``: each slot's sequences as prefix trees, the trees placed by FFD."""
  B, P = prompt_tokens.shape
  T = completions.shape[1]
  per_slot, used = [], np.zeros(S, np.int64)
  for s in range(S):
    mine = seqs[slot[seqs] == s]
    sequences = [np.concatenate([prompt_tokens[b, P - p_len[b] :], completions[b, : c_len[b]]]) for b in mine]
    trees = build_trees(sequences, p_len[mine], sharing, L)
    bins, offs = first_fit_decreasing(np.asarray([t.tokens.size for t in trees], np.int64), L)
    per_slot.append((mine, trees, bins, offs))
    used[s] = bins.max() + 1 if bins.size else 0
  Rs = _slot_rows(rows, used, L)
  tokens, segment_ids, positions, kv_end = (np.zeros((S * Rs, L), np.int32) for _ in range(4))
  targets = np.full((B, T), -1, np.int64)
  source = np.full((S * Rs, L), -1, np.int64)  # flat b·(P + T) + j of the sequence token each column holds
  for s, (mine, trees, bins, offs) in enumerate(per_slot):
    for i in np.lexsort((offs, bins)):  # row by row, left to right: segment ids 1, 2, ...
      tree, r, o = trees[i], s * Rs + int(bins[i]), int(offs[i])
      cols = slice(o, o + tree.tokens.size)
      tokens[r, cols], positions[r, cols], kv_end[r, cols] = tree.tokens, tree.depth, o + tree.end
      segment_ids[r, cols] = segment_ids[r].max() + 1
      owner = mine[tree.owner]
      source[r, cols] = owner * (P + T) + P - p_len[owner] + tree.depth
      for k, target in zip(tree.members, tree.targets):
        targets[mine[k], : target.size] = r * L + o + target
  return _with_head_buffer(tokens, segment_ids, positions, targets, slot, S, head_length, kv_end), source


def _slot_rows(rows: int | None, used: np.ndarray, L: int) -> int:
  """Rs: ``rows`` (checked against the need), else the power-of-two bucket of the fullest slot."""
  need = int(used.max()) if used.size else 0
  if rows is None:
    return 1 << max(need - 1, 0).bit_length()
  rows = _positive_int("rows", rows)
  if need > rows:
    s = int(used.argmax())
    raise ValueError(
      f"slot {s} needs {need} rows of {L} tokens, more than rows={rows}; raise the rows per slot "
      "(TrainConfig.packing_rows) or the row length, or leave the rows to the packer (None)"
    )
  return rows


def _head_length(head_length: int | None, heads: np.ndarray, Rs: int, L: int) -> int:
  """H: ``head_length`` (checked), else the smallest ``ceil(j·L / 8)`` with ``Rs·H`` >= the most
  completion tokens of a slot (``H = L`` always suffices: a slot's rows hold at most ``Rs·L`` tokens)."""
  need = int(heads.max()) if heads.size else 0
  if head_length is None:
    for j in range(1, HEAD_FRACTIONS + 1):
      h = -(-j * L // HEAD_FRACTIONS)
      if Rs * h >= need:
        return h
    raise AssertionError("unreachable: Rs·L holds every slot")
  head_length = _positive_int("head_length", head_length)
  if Rs * head_length < need:
    s = int(heads.argmax())
    raise ValueError(
      f"slot {s} has {need} completion tokens, more than rows·head_length = {Rs}·{head_length}; raise "
      "head_length or leave it to the packer (None)"
    )
  return head_length


def unpack(packed: jax.Array, unpack_index: jax.Array, *, row_stride: int = 1, row_offset=0) -> jax.Array:
  """Per-token values of packed rows back in the rollout's completion layout: a gather, static shapes.

  ``out[b, t] = packed[r // row_stride, c]`` where ``unpack_index[b, t] = r·L + c``, if that index is
  not -1 and ``r % row_stride == row_offset``; else 0. ``packed`` is indexed by the column of the
  completion token a value belongs to (for log-probs: the target's column, not the column of the
  hidden state that predicts it).

  With the defaults, ``packed`` holds all R rows. A micro-batch of the train step holds rows
  ``i·(M·K) + m·K + k`` (mini-batch m, micro-batch k): pass its ``[R / (M·K), L]`` rows with
  ``row_stride = M·K`` and ``row_offset = m·K + k`` (a traced int is fine, e.g. a ``lax.scan``
  index); completions in other micro-batches get 0 (see :func:`micro_batch_of` for which is where).

  Args:
    packed: ``[R', L]`` values (any dtype), R' = R / row_stride.
    unpack_index: ``int32[B, T]`` (:attr:`PackedBatch.unpack_index`).
    row_stride: static positive int. row_offset: int in ``[0, row_stride)``, static or traced.

  Returns:
    ``[B, T]`` array of ``packed``'s dtype.
  """
  packed = jnp.asarray(packed)
  unpack_index = jnp.asarray(unpack_index)
  if packed.ndim != 2:
    raise ValueError(f"`packed` must be [R, L], got shape {packed.shape}")
  if unpack_index.ndim != 2 or not jnp.issubdtype(unpack_index.dtype, jnp.integer):
    raise ValueError(f"`unpack_index` must be an int array [B, T], got {unpack_index.dtype}{list(unpack_index.shape)}")
  stride = _positive_int("row_stride", row_stride)
  L = packed.shape[1]
  r, c = unpack_index // L, unpack_index % L
  here = (unpack_index >= 0) & (r % stride == row_offset)
  local = jnp.where(here, (r // stride) * L + c, 0)
  return jnp.where(here, packed.reshape(-1)[local], jnp.zeros((), packed.dtype))


def pack_values(values: jax.Array, pack_index: jax.Array) -> jax.Array:
  """Per-token values of the rollout's completion layout in the packed layout (the inverse gather).

  ``out[r, c] = values[b, t]`` where ``pack_index[r, c] = b·T + t``, 0 where it is -1.

  Args:
    values: ``[B, T]`` (e.g. ``f32[B, T]`` rollout log-probs or advantages).
    pack_index: ``int32[R, L]`` (:attr:`PackedBatch.pack_index`).

  Returns:
    ``[R, L]`` array of ``values``' dtype.
  """
  values = jnp.asarray(values)
  pack_index = jnp.asarray(pack_index)
  if values.ndim != 2:
    raise ValueError(f"`values` must be [B, T], got shape {values.shape}")
  if pack_index.ndim != 2 or not jnp.issubdtype(pack_index.dtype, jnp.integer):
    raise ValueError(f"`pack_index` must be an int array [R, L], got {pack_index.dtype}{list(pack_index.shape)}")
  here = pack_index >= 0
  return jnp.where(here, values.reshape(-1)[jnp.where(here, pack_index, 0)], jnp.zeros((), values.dtype))


def micro_batch_of(row, *, micro_batches: int, mini_batches: int = 1) -> np.ndarray:
  """Which update slot each sequence's completion lives in when the R rows are split as the train step
  splits them (row ``i·(M·K) + m·K + k`` → mini-batch m, micro-batch k).

  A completion lives in exactly one row (a sequence is never split), hence in exactly one micro-batch:
  ``slot = row mod (M·K) = m·K + k`` (mini-batch ``slot // K``, micro-batch ``slot % K``).

  Args:
    row: ``int[B]`` (:attr:`PackedBatch.row`; -1 for sequences that were not packed).
    micro_batches: K. mini_batches: M.

  Returns:
    ``int32[B]``: ``m·K + k``, or -1 for sequences that were not packed.
  """
  row = np.asarray(row)
  if row.ndim != 1 or not np.issubdtype(row.dtype, np.integer):
    raise ValueError(f"`row` must be a 1-D int array, got shape {row.shape} dtype {row.dtype}")
  slots = _positive_int("micro_batches", micro_batches) * _positive_int("mini_batches", mini_batches)
  return np.where(row >= 0, row % slots, -1).astype(np.int32)
