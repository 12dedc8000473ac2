"""A :class:`~jaxgrpo.step.batch.Batch` fitted to the train step's compiled shapes (host side, NumPy).

Bucketing: :func:`pad_to_bucket` trims or pads the completion axis T to the smallest bucket
(:data:`DEFAULT_BUCKETS`, :func:`bucket_length`) that holds the longest real completion, so a few
lengths mean a few compiled programs. Packing: :func:`pack_batch` packs the batch's sequences slot
by slot (``jaxgrpo.step.packing.pack_slots``; slot of row b: :func:`batch_slots`, the step's
device shard × mini-batch × micro-batch), so every micro-batch holds exactly the sequences of the
unpacked step. ``check_packing`` tells whether a packed batch fits a step. The ``[B, T]`` fields
are never changed by packing; only the model's forward reads ``Batch.packed``.

Re-exported from ``jaxgrpo.step.train`` (``train.pad_to_bucket``, ``train.pack_batch``, ...).
"""

from __future__ import annotations

import numpy as np

from jaxgrpo import _checks
from jaxgrpo.step.batch import Batch, host_values
from jaxgrpo.step.packing import PackedSlots, pack_slots

__all__ = ["DEFAULT_BUCKETS", "batch_slots", "bucket_length", "pack_batch", "pad_to_bucket"]

DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


# ----------------------------------------------------------------------------- packing


def batch_slots(
  batch_size: int, *, shards: int, mini_batches: int = 1, micro_batches: int = 1, contiguous: bool = False
) -> np.ndarray:
  """The train step's slot of each row (``jaxgrpo.step.terms.split_micro``): ``d·(M·K) + m·K + k`` for the row
  of index ``c = i·(M·K) + m·K + k`` in device shard ``d = b // n`` (``n = B / shards`` rows per shard: the rows
  over ``data × fsdp``), m its mini-batch and k its micro-batch:

  - interleaved (the default): ``k = c mod K``, row ``b`` in slot ``d·(M·K) + (b mod M·K)``;
  - ``contiguous`` (the step's split with prefix sharing): ``k = (i·K + c mod K) // R``, ``R = n / (M·K)``: each
    micro-batch one run of R consecutive rows of its mini-batch, so that G consecutive rows (a group) fall in one
    micro-batch of each mini-batch when ``G / M`` divides R (M = 1: G divides ``n / K``).

  Packing each slot alone (:func:`pack_batch`) keeps every micro-batch's sequences — and so its loss terms —
  exactly those of the unpacked step, and each device's packed rows its own sequences.

  Returns:
    ``int32[batch_size]`` in ``[0, shards·M·K)``.

  Raises:
    ValueError: ``batch_size`` not divisible by ``shards · M · K``.
  """
  splits = mini_batches * micro_batches
  if batch_size % (shards * splits):
    raise ValueError(
      f"batch size {batch_size} is not divisible by shards × mini_batches × micro_batches = {shards} × "
      f"{mini_batches} × {micro_batches}"
    )
  b = np.arange(batch_size)
  n = batch_size // shards
  shard, c = b // n, b % n
  if not contiguous:
    return (shard * splits + c % splits).astype(np.int32)
  rank = (c // splits) * micro_batches + c % micro_batches
  micro = rank // (n // splits)
  return (shard * splits + (c % splits) // micro_batches * micro_batches + micro).astype(np.int32)


def pack_batch(
  batch: Batch,
  *,
  row_length: int,
  shards: int = 1,
  mini_batches: int = 1,
  micro_batches: int = 1,
  rows: int | None = None,
  head_length: int | None = None,
  sharing: str = "none",
) -> Batch:
  """``batch`` with ``packed``: its sequences packed slot by slot for the train step
  (``jaxgrpo.step.packing.pack_slots`` with the slots of :func:`batch_slots`), host side.

  Every ``[B, ...]`` field stays as it is: advantages, λ process sets, FRPO's future-KL and the loss's
  aggregation are computed on them exactly as without packing; only the model's forward/backward
  reads the packed rows, and its log-probs come back in the ``[B, T]`` layout. The one exception is
  ``routing`` (a mixture of experts' routing replay), which only the forward reads: it moves into the
  packed layout (``packed.routing``, each token's experts with its token) and ``batch.routing`` becomes None.

  Args:
    batch: a :class:`Batch` whose values are on this host (NumPy, or fully addressable arrays).
    row_length: L, tokens per packed row (``TrainConfig.packing``).
    shards: the device shards the batch rows are split over (``data × fsdp``; with process-local rows,
      this process's shards).
    mini_batches, micro_batches: M and K of the step.
    rows: rows per slot (``TrainConfig.packing_rows``; None: a power-of-two bucket of the need).
    head_length: LM-head entries per packed row (None: a bucket of the need, see ``pack_slots``).
    sharing: ``TrainConfig.prefix_sharing``: ``"none"``, or each slot's sequences packed as prefix trees
      (``"prompt"``, ``"tree"``; ``jaxgrpo.step.prefix_tree``).
  """
  if not isinstance(batch, Batch):
    raise TypeError(f"batch must be a jaxgrpo.step.train.Batch; got {type(batch).__name__}")
  fields = [host_values(x) for x in (batch.prompt_tokens, batch.prompt_mask, batch.completions, batch.mask)]
  if any(x is None for x in fields):
    raise ValueError("pack_batch packs on the host: the batch's tokens and masks must be NumPy or fully addressable")
  routing = None if batch.routing is None else host_values(batch.routing)
  if batch.routing is not None and routing is None:
    raise ValueError("pack_batch packs on the host: batch.routing must be NumPy or fully addressable")
  b = fields[2].shape[0] if fields[2].ndim == 2 else 0
  contiguous = sharing != "none"  # the step's split with prefix sharing (jaxgrpo.step.terms.contiguous_split)
  slot = batch_slots(b, shards=shards, mini_batches=mini_batches, micro_batches=micro_batches, contiguous=contiguous)
  packed = pack_slots(
    *fields,
    slot,
    num_slots=shards * mini_batches * micro_batches,
    row_length=row_length,
    rows=rows,
    head_length=head_length,
    sharing=sharing,
    routing=routing,
  )
  return batch._replace(packed=packed, routing=None)


def check_packing(batch: Batch, tc, shards: int, splits: int) -> None:
  """ValueError unless ``batch.packed`` is what ``tc`` asks for: absent without packing; with it, a
  ``PackedSlots`` of row length ``tc.packing`` (and ``tc.packing_rows`` rows per slot) over
  ``shards × splits`` slots for this batch — and, for NumPy fields, its slots those of
  :func:`batch_slots` and its index map covering exactly ``batch.mask``."""
  packed = batch.packed
  if packed is None:
    return
  if tc.packing is None:
    raise ValueError(
      "batch.packed is set but TrainConfig.packing is None: set TrainConfig(packing=L) or pass the batch "
      "without `packed`"
    )
  if not isinstance(packed, PackedSlots):
    raise TypeError(
      f"batch.packed must be a jaxgrpo.step.packing.PackedSlots (pack_batch); got {type(packed).__name__}"
    )
  b, t = np.shape(batch.completions)
  num_slots = shards * splits
  shapes = {name: np.shape(x) for name, x in packed._asdict().items()}
  rows_total, length = shapes["tokens"] if len(shapes["tokens"]) == 2 else (0, 0)
  rs = rows_total // num_slots if rows_total % num_slots == 0 else 0
  heads = shapes["head_index"]
  tree = getattr(tc, "prefix_sharing", "none") != "none"
  ok = (
    rs > 0
    and length == tc.packing
    and (tc.packing_rows is None or rs == tc.packing_rows)
    and shapes["segment_ids"] == shapes["positions"] == (rows_total, length)
    and len(heads) == 2
    and heads[0] == num_slots
    and heads[1] % rs == 0
    and shapes["unpack_index"] == (b, t)
    and shapes["slot"] == (b,)
    and shapes["kv_end"] == ((rows_total, length) if tree else ())
    and (packed.routing is None or shapes["routing"][:2] == (rows_total, length) and len(shapes["routing"]) == 4)
    and shapes["row_in_slot"] in ((), (rows_total, length))
  )
  if not ok:
    rows_wanted = "Rs" if tc.packing_rows is None else tc.packing_rows
    raise ValueError(
      f"batch.packed does not fit this step: expected {num_slots} slots (data×fsdp {shards} × M·K {splits}) of "
      f"{rows_wanted} rows of L={tc.packing} tokens, i.e. tokens/segment_ids/positions [{num_slots}·{rows_wanted}, "
      f"{tc.packing}], head_index [{num_slots}, {rows_wanted}·H], unpack_index [{b}, {t}], slot [{b}], kv_end "
      f"{'as tokens' if tree else 'None'} (prefix_sharing={getattr(tc, 'prefix_sharing', 'none')!r}), routing None or "
      f"[{num_slots}·{rows_wanted}, {tc.packing}, M, k], row_in_slot None or as tokens; got {shapes}. "
      "Pack the batch with step.pack (or train.pack_batch with the step's settings), after bucketing"
    )
  names = ("tokens", "segment_ids", "positions", "head_index", "unpack_index", "slot") + ("kv_end",) * tree
  for name in names + ("row_in_slot",) * (packed.row_in_slot is not None):
    _checks.check_int(getattr(packed, name), f"batch.packed.{name}", "int32")
  if packed.routing is not None and not np.issubdtype(np.dtype(packed.routing.dtype), np.integer):
    raise TypeError(f"batch.packed.routing must hold integer expert ids; got dtype {packed.routing.dtype}")
  # host arrays only (a placed batch was packed by pack_batch, not re-read from the devices every step)
  slot, index, mask = (x if isinstance(x, np.ndarray) else None for x in (packed.slot, packed.unpack_index, batch.mask))
  split = dict(mini_batches=tc.mini_batches, micro_batches=tc.micro_batches, contiguous=tree)  # splits = M·K
  if slot is not None and not np.array_equal(slot, batch_slots(b, shards=shards, **split)):
    raise ValueError(
      "batch.packed.slot is not the step's slot of each row (train.batch_slots): the batch was packed for "
      "another mesh or split; pack it with step.pack"
    )
  if index is not None and mask is not None and not np.array_equal(index >= 0, mask):
    raise ValueError(
      "batch.packed.unpack_index does not cover exactly batch.mask's tokens: the batch changed after it "
      "was packed (pad_to_bucket before packing, not after changing the mask)"
    )


# ----------------------------------------------------------------------------- bucketing


def bucket_length(length: int, buckets=DEFAULT_BUCKETS) -> int:
  """The smallest bucket >= ``length`` (``length`` itself when it exceeds every bucket)."""
  fits = [b for b in sorted(buckets) if b >= length]
  return fits[0] if fits else int(length)


def pad_to_bucket(batch: Batch, buckets=DEFAULT_BUCKETS, *, length: int | None = None) -> Batch:
  """Trim or pad the completion axis to the bucket of the longest real completion (host side).

  Completion columns past the longest real completion are padding in every row, so trimming them
  changes no loss; padding adds masked columns. A few bucket lengths mean a few compiled programs.

  Args:
    batch: a :class:`Batch` (its ``[B, T]`` fields, ``f32[B, T]`` advantages, a packed batch's
      ``unpack_index`` and the completion columns of ``routing`` included, are fitted).
    buckets: the allowed completion lengths.
    length: the longest real completion to fit (default: from ``batch.mask``). Processes that each
      pad their own rows pass the maximum over all processes, so that every process picks the same
      bucket.
  """
  mask = np.asarray(batch.mask)
  longest = int(mask.any(axis=0).nonzero()[0].max() + 1) if mask.any() else 1
  if length is None:
    length = longest
  elif length < longest:
    raise ValueError(f"`length` {length} is shorter than the longest real completion of the batch ({longest})")
  target = bucket_length(length, buckets)
  t = mask.shape[1]

  def fit(x, fill):
    if x is None or np.ndim(x) < 2:
      return x
    x = np.asarray(x)
    if target <= t:
      return x[:, :target]
    return np.pad(x, ((0, 0), (0, target - t)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)

  packed = batch.packed
  if packed is not None:  # the completion slots' head entries: -1 on the columns added
    packed = packed._replace(unpack_index=fit(packed.unpack_index, -1))
  routing = batch.routing
  if routing is not None:  # [B, P + T, M, k]: its completion columns fitted likewise (expert 0 on padding)
    routing, p = np.asarray(routing), np.shape(batch.prompt_tokens)[1]
    pad = ((0, 0), (0, max(0, target - t)), (0, 0), (0, 0))
    routing = routing[:, : p + target] if target <= t else np.pad(routing, pad)
  return batch._replace(
    completions=fit(batch.completions, 0),
    mask=fit(batch.mask, False),
    old_logp=fit(batch.old_logp, 0.0),
    ref_logp=fit(batch.ref_logp, 0.0),
    advantages=fit(batch.advantages, 0.0),
    token_weights=fit(batch.token_weights, 0.0),
    behavior_logp=fit(batch.behavior_logp, 0.0),
    packed=packed,
    policy_mask=fit(batch.policy_mask, False),
    routing=routing,
    teacher_logp=fit(batch.teacher_logp, 0.0),
    teacher_topk_ids=fit(batch.teacher_topk_ids, 0),
    teacher_topk_logp=fit(batch.teacher_topk_logp, 0.0),
  )
