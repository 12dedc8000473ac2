"""Self-attention by the implementation of the platform a program is built for: the fused kernel of each platform,
blockwise attention everywhere else. Memory linear in the sequence length on every path.

``attention(q, k, v, segment_ids, implementation="auto")`` with ``implementation``:

- ``"auto"``: chosen by the *target* platform (:func:`jaxgrpo.parallel.target.current_platform`, read at trace
  time: the devices the program compiles for, not the host), :func:`choose_implementation`;
- ``"splash"`` (TPU): the Pallas splash-attention kernel that JAX ships
  (``jax.experimental.pallas.ops.tpu.splash_attention``, its multi-query form per key/value head, so grouped heads
  are never repeated), with its segment ids; in a program partitioned over several devices (a context mesh of
  more than one device) it runs inside ``jax.shard_map`` (:func:`splash_partition`): XLA cannot partition a Mosaic
  call by itself, so each device runs the kernel on its own rows (batch over ``data × fsdp``) and heads (over
  ``tensor``);
- ``"cudnn"`` (NVIDIA GPU): ``jax.nn.dot_product_attention(implementation="cudnn")`` (cuDNN's fused attention)
  with the same-segment mask as a ``[B, 1, S, S]`` boolean (one byte per pair and row, no head or float32 factor);
- ``"blockwise"`` (CPU, and any platform on request): :func:`jaxgrpo.kernels.attention.blockwise_attention`,
  FlashAttention-2 in plain JAX, with the platform's block sizes (:data:`BLOCKS`, overridable).

Query row ``i`` attends key row ``j`` iff ``segment_ids[i] == segment_ids[j] > 0`` and ``j <= i``; rows with segment
0 (padding) give zeros on every path (the fused kernels compute something there, which is then zeroed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import PartitionSpec as P

from jaxgrpo._checks import check_choice, check_python_int, shape_of
from jaxgrpo.kernels.attention import blockwise_attention
from jaxgrpo.parallel.sharding import DEFAULT_RULES
from jaxgrpo.parallel.target import current_platform

__all__ = [
  "BLOCKS",
  "FUSED",
  "IMPLEMENTATIONS",
  "UNPARTITIONED",
  "attention",
  "choose_implementation",
  "default_blocks",
  "partitioned_over",
  "splash_partition",
]

IMPLEMENTATIONS = ("auto", "blockwise", "splash", "cudnn")
# (block_q, block_kv) of the blockwise path per target platform. CPU: the fastest pair of a sweep of the gradient
# at 4k tokens, 4 heads of 16 (128/256: 0.32 s; 128/128: 0.35–0.55 s; 512/512: 2.8 s — larger blocks leave the
# cache); accelerators: tiles that fill a TPU MXU (512) / a GPU's shared memory (128).
BLOCKS = {"cpu": (128, 256), "gpu": (128, 128), "tpu": (512, 512)}
FUSED = {"tpu": "splash", "gpu": "cudnn"}  # the fused kernel of each platform (the others: blockwise)
SPLASH_BLOCK = 512  # the splash kernel's tile (rows of q and of k/v), clipped to the sequence padded to 128


def default_blocks(platform: str | None = None) -> tuple[int, int]:
  """``(block_q, block_kv)`` of the blockwise path for ``platform`` (default: the target platform)."""
  return BLOCKS.get(platform or current_platform(), BLOCKS["cpu"])


#: kernels XLA cannot partition by itself ("Mosaic kernels cannot be automatically partitioned"): inside a program
#: partitioned over several devices they run in a ``jax.shard_map`` wrapper (:func:`splash_partition`)
UNPARTITIONED = ("splash",)


def partitioned_over() -> int:
  """The number of devices of the context mesh the program is traced under (``jax.set_mesh``; 0 without one)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 0 if mesh.empty else int(mesh.size)


def choose_implementation(implementation: str = "auto", platform: str | None = None) -> str:
  """The implementation ``"auto"`` resolves to on ``platform`` (default: the target platform): ``"splash"`` on
  TPU (one chip or partitioned: :func:`splash_partition`), ``"cudnn"`` on GPU, ``"blockwise"`` elsewhere; any
  other choice is returned as given."""
  check_choice(implementation, IMPLEMENTATIONS, "implementation")
  if implementation != "auto":
    return implementation
  return FUSED.get(platform or current_platform(), "blockwise")


def _dividing_axes(axes, size: int, mesh) -> tuple[str, ...]:
  """The longest prefix of the mesh ``axes`` (those of ``mesh`` of size > 1) whose product divides ``size``."""
  taken, product = [], 1
  for axis in (a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1):
    if size % (product * mesh.shape[axis]):
      break
    taken.append(axis)
    product *= mesh.shape[axis]
  return tuple(taken)


def splash_partition(batch: int, kv_heads: int, mesh=None) -> tuple[P, P, P]:
  """The ``shard_map`` specs ``(q, k/v, segment_ids)`` of the splash kernel on ``mesh`` (default: the context
  mesh): rows over the batch axes of :data:`~jaxgrpo.parallel.sharding.DEFAULT_RULES` (``data``, ``fsdp``) and
  heads over its ``kv_heads`` axis (``tensor``), each only where its size divides ``batch`` / ``kv_heads`` (else
  that dim is whole on every device of the axis: the same values, repeated work). Key/value head ``n`` serves
  query heads ``[n·G, (n+1)·G)``, so splitting N and H over the same axis keeps each device's groups together.
  The sequence and head dims are whole on each device (the kernel's tiles run along the sequence)."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  rows = _dividing_axes(_axes(DEFAULT_RULES["batch"]), batch, mesh) or None
  heads = _dividing_axes(_axes(DEFAULT_RULES["kv_heads"]), kv_heads, mesh) or None
  return P(rows, None, heads, None), P(rows, None, heads, None), P(rows, None)


def _axes(rule) -> tuple[str, ...]:
  return () if rule is None else (rule,) if isinstance(rule, str) else tuple(rule)


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array | None = None,
  *,
  causal: bool = True,
  scale: float | None = None,
  implementation: str = "auto",
  block_q: int | None = None,
  block_kv: int | None = None,
  interpret: bool = False,
) -> jax.Array:
  """Causal self-attention within segments, ``softmax(q·kᵀ·scale + mask)·v``.

  Args:
    q: ``[B, S, H, K]``; k, v: ``[B, S, N, K]`` with ``H % N == 0`` (grouped / multi-query heads).
    segment_ids: ``int[B, S]``, 0 = padding, ``k >= 1`` = the k-th packed sequence (``step/packing.py``); a
      left-padded batch passes its 0/1 mask. Default: all 1.
    causal: mask ``j > i``.
    scale: score scale, default ``K**-0.5``.
    implementation: ``"auto"`` (by the target platform), ``"blockwise"``, ``"splash"`` (TPU), ``"cudnn"`` (GPU).
    block_q, block_kv: the blockwise path's blocks (default :func:`default_blocks`); ``block_q`` is also the
      splash tile when given.
    interpret: run the splash kernel in Pallas interpret mode (any platform; for tests).

  Returns: ``[B, S, H, K]`` in ``q``'s dtype, zeros on padding rows. Differentiable in q, k, v on every path.
  """
  impl = choose_implementation(implementation)
  B, S, H, K = _check(q, k, v, segment_ids)
  seg = jnp.ones((B, S), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  scale = float(K**-0.5 if scale is None else scale)
  if impl == "blockwise":
    bq, bk = default_blocks()
    bq = bq if block_q is None else check_python_int(block_q, "block_q", minimum=1)
    bk = bk if block_kv is None else check_python_int(block_kv, "block_kv", minimum=1)
    dot = jnp.float32 if current_platform() == "cpu" else None  # XLA:CPU: no bf16 × bf16 → f32 batched dot
    return blockwise_attention(
      q, k, v, q_segment_ids=seg, kv_segment_ids=seg, causal=causal, scale=scale, block_q=bq, block_kv=bk,
      dot_dtype=dot,
    )  # fmt: skip
  if impl == "splash":
    out = _splash_sharded(q, k, v, seg, causal, scale, block_q or SPLASH_BLOCK, interpret)
  else:
    out = gpu_fused(q, k, v, seg, causal, scale, "cudnn")
  return jnp.where((seg > 0)[:, :, None, None], out, 0).astype(q.dtype)


def _check(q, k, v, segment_ids):
  if np.ndim(q) != 4 or np.ndim(k) != 4 or shape_of(k) != shape_of(v):
    raise ValueError(
      f"attention: `q` must be [B, S, H, K] and `k`, `v` [B, S, N, K] of one shape; got q {shape_of(q)}, "
      f"k {shape_of(k)}, v {shape_of(v)}"
    )
  (B, S, H, K), (Bk, T, N, Kk) = q.shape, k.shape
  if (Bk, T, Kk) != (B, S, K) or H % N:
    raise ValueError(f"attention: self-attention needs k [B, S, N, K] with N dividing H; got q {q.shape}, k {k.shape}")
  if segment_ids is not None and shape_of(segment_ids) != (B, S):
    raise ValueError(f"attention: `segment_ids` must have shape {(B, S)} [B, S]; got {shape_of(segment_ids)}")
  return B, S, H, K


def _pad_to(x: jax.Array, rows: int) -> jax.Array:
  return jnp.pad(x, [(0, 0), (0, rows - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _splash_sharded(q, k, v, seg, causal, scale, block, interpret):
  """:func:`_splash` on one device, or per device inside ``jax.shard_map`` in a partitioned program (the kernel
  is built inside the body, for the local shapes; ``check_vma=False``: a Pallas call has no replication rule)."""
  if partitioned_over() <= 1:
    return _splash(q, k, v, seg, causal, scale, block, interpret)
  q_spec, kv_spec, seg_spec = splash_partition(q.shape[0], k.shape[2])
  body = lambda q, k, v, seg: _splash(q, k, v, seg, causal, scale, block, interpret)
  return jax.shard_map(body, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec, check_vma=False)(
    q, k, v, seg
  )


def _splash(q, k, v, seg, causal, scale, block, interpret):
  """The splash kernel per batch row and key/value head: multi-query over the G query heads of each kv head.
  The sequence is padded to a multiple of the tile (padding rows get segment 0: never seen by real rows)."""
  B, S, H, K = q.shape
  N = k.shape[2]
  G = H // N
  tile = min(check_python_int(block, "block_q", minimum=8), -(-S // 128) * 128)
  Sp = -(-S // tile) * tile
  per_head = sa.CausalMask((Sp, Sp)) if causal else sa.FullMask((Sp, Sp))
  sizes = sa.BlockSizes(
    block_q=tile, block_kv=tile, block_kv_compute=tile, block_q_dkv=tile, block_kv_dkv=tile,
    block_kv_dkv_compute=tile, block_q_dq=tile, block_kv_dq=tile,
  )  # fmt: skip
  kernel = sa.make_splash_mqa_single_device(sa.MultiHeadMask([per_head] * G), block_sizes=sizes, interpret=interpret)
  qn = jnp.transpose(_pad_to(q * jnp.asarray(scale, q.dtype), Sp).reshape(B, Sp, N, G, K), (0, 2, 3, 1, 4))
  kn, vn = (jnp.transpose(_pad_to(x, Sp), (0, 2, 1, 3)) for x in (k, v))  # [B, N, Sp, K]
  segp = _pad_to(seg, Sp)

  def one(qh, kh, vh, s):  # [G, Sp, K], [Sp, K], [Sp, K], [Sp]
    return kernel(qh, kh, vh, segment_ids=sa.SegmentIds(q=s, kv=s))

  out = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(qn, kn, vn, segp)  # [B, N, G, Sp, K]
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, Sp, H, K)[:, :S]


def gpu_fused(q, k, v, seg, causal, scale, implementation="cudnn"):
  """``jax.nn.dot_product_attention`` with the same-segment mask (padding rows see the padding keys, so no row
  is empty; they are zeroed by :func:`attention`). ``implementation="xla"`` runs the same call on any platform
  (how the tests check this mapping on the CPU)."""
  mask = seg[:, None, :, None] == seg[:, None, None, :]  # [B, 1, S, S]
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, scale=scale, implementation=implementation)
