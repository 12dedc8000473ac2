"""Weight quantisation for QLoRA base weights and the sampler's rollout weights: pure array functions, no model
code.

A projection weight ``w [*C, *O]`` contracts its first ``contract`` dims (``C``) with the input.
Four formats, all symmetric (no zero point):

- ``"int8"``: one scale per output channel, ``s[o] = max_c |w[c, o]| · (1/127)``,
  ``q = clip(round(w / s), -127, 127)``, int8 codes of the weight's shape; scales
  ``f32[1, ..., 1, *O]`` (a 1 per contracted dim). ``ŵ = q · s``; ``|w - ŵ| ≤ s / 2``.
- ``"int4"``: one scale per group of ``group_size`` consecutive elements along the last contracted
  dim (axis ``contract - 1``), ``s = max_group |w| · (1/7)``, ``q = clip(round(w / s), -7, 7)``;
  ``ŵ = q · s``; ``|w - ŵ| ≤ s / 2``.
- ``"fp8"``: one scale per output channel, ``s[o] = max_c |w[c, o]| · (1/448)``, ``q = fp8_e4m3fn(w / s)``
  (round to nearest even; 448 is e4m3's largest finite value), codes ``float8_e4m3fn`` of the weight's shape,
  scales as int8's. ``ŵ = q · s``; ``|w - ŵ| ≤ 16 · s`` (half the spacing 32 of e4m3's top binade [256, 448];
  relative to ``|w|`` the error is at most 2⁻⁴). A rollout-weight format (``ROLLOUT_KINDS``), not a QLoRA one.
- ``"nf4"``: QLoRA's 4-bit NormalFloat (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of
  Quantized LLMs", §3): ``s = max_group |w|`` (block-wise absmax, blocks of ``group_size``),
  ``q = argmin_j |w / s - NF4[j]|`` over the 16 NF4 levels; ``ŵ = NF4[q] · s``;
  ``|w - ŵ| ≤ s · max_j (NF4[j+1] - NF4[j]) / 2``.

4-bit codes (``int4`` stores ``q + 8`` in 1..15, ``nf4`` stores ``q`` in 0..15) are packed two
per byte along the grouped axis: byte ``i`` holds element ``2i`` in its low nibble and ``2i + 1``
in its high nibble, so a 4-bit weight takes half a byte per element plus one f32 scale per group
(4.5 bits per element at ``group_size=64``). 4-bit scales have the weight's shape with the grouped
axis divided by ``group_size``; codes have it divided by 2. Every other dim keeps its size, so the
weight's logical sharding axes apply unchanged to codes and scales.

A group (or channel) of zeros has scale 0 and dequantises to exact zeros (guarded division).
``1/127`` and ``1/7`` are float32 constants multiplied in (XLA rewrites a division by a constant
that way anyway); ``w / s`` is a float32 division, which XLA:CPU does not round exactly as IEEE
(1 ulp), so a value within an ulp of a rounding boundary may get either neighbouring code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "QUANT_KINDS",
  "ROLLOUT_KINDS",
  "PER_CHANNEL_KINDS",
  "NF4_LEVELS",
  "quantize",
  "dequantize",
  "quantized_shapes",
  "max_abs_error",
]

QUANT_KINDS = ("int8", "int4", "nf4")  # QLoRA's base-weight formats (``models.lora.LoRAConfig.quantize``)
ROLLOUT_KINDS = ("int8", "fp8")  # the sampler's weight formats (``rollout.sampling.SamplingConfig.quantize``)
PER_CHANNEL_KINDS = ("int8", "fp8")  # one scale per output channel: ``x·ŵ = (x·q)·s``
_KINDS = QUANT_KINDS + ("fp8",)
_FP8_MAX = 448.0  # float8_e4m3fn's largest finite value

# The 16 NormalFloat-4 levels of QLoRA (bitsandbytes' NF4 table): quantiles of N(0, 1) normalised
# to [-1, 1], with an exact 0 (8 levels above 0, 7 below).
NF4_LEVELS = np.array(
  [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
  ],
  np.float32,
)
_NF4_MIDPOINTS = ((NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2).astype(np.float32)  # [15]


def _check_kind(kind: str) -> None:
  if kind not in _KINDS:
    raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")


def _check(shape: tuple[int, ...], kind: str, contract: int, group_size: int) -> None:
  _check_kind(kind)
  if not isinstance(contract, int) or isinstance(contract, bool) or not 1 <= contract < len(shape):
    raise ValueError(
      f"contract must be an int in [1, {len(shape) - 1}] for a weight of shape {shape}, got {contract!r}"
    )
  if kind not in PER_CHANNEL_KINDS:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2 or group_size % 2:
      raise ValueError(f"group_size must be an even int >= 2, got {group_size!r}")
    n = shape[contract - 1]
    if n % group_size:
      raise ValueError(
        f"{kind}: the grouped dim (axis {contract - 1}, size {n}) of weight {shape} is not divisible by "
        f"group_size={group_size}; choose a group_size that divides it"
      )


def quantized_shapes(
  shape: tuple[int, ...], *, kind: str, contract: int, group_size: int = 64
) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """``(codes shape, scales shape)`` of a ``kind``-quantised weight of ``shape`` (see the module doc)."""
  shape = tuple(shape)
  _check(shape, kind, contract, group_size)
  if kind in PER_CHANNEL_KINDS:
    return shape, (1,) * contract + shape[contract:]
  a = contract - 1
  codes = shape[:a] + (shape[a] // 2,) + shape[a + 1 :]
  scales = shape[:a] + (shape[a] // group_size,) + shape[a + 1 :]
  return codes, scales


def _grouped(w: jax.Array, axis: int, group_size: int) -> jax.Array:
  """``[..., n, ...] → [..., n / g, g, ...]`` (the group members on axis ``axis + 1``)."""
  return w.reshape(w.shape[:axis] + (w.shape[axis] // group_size, group_size) + w.shape[axis + 1 :])


def _safe_divide(x: jax.Array, s: jax.Array) -> jax.Array:
  """``x / s`` where ``s > 0``, else 0 (the double where: no inf/NaN for all-zero groups)."""
  positive = s > 0
  return jnp.where(positive, x / jnp.where(positive, s, 1.0), 0.0)


def _pack(codes: jax.Array, axis: int) -> jax.Array:
  """uint8 codes in 0..15 ``[..., n, ...]`` → bytes ``[..., n / 2, ...]`` (even index in the low nibble)."""
  pairs = codes.reshape(codes.shape[:axis] + (codes.shape[axis] // 2, 2) + codes.shape[axis + 1 :])
  lo = jnp.take(pairs, 0, axis=axis + 1)
  hi = jnp.take(pairs, 1, axis=axis + 1)
  return (lo | (hi << 4)).astype(jnp.uint8)


def _unpack(packed: jax.Array, axis: int) -> jax.Array:
  """Inverse of ``_pack``: bytes ``[..., n / 2, ...]`` → codes uint8 ``[..., n, ...]``."""
  lo = packed & 0xF
  hi = packed >> 4
  pairs = jnp.stack([lo, hi], axis=axis + 1)
  return pairs.reshape(packed.shape[:axis] + (packed.shape[axis] * 2,) + packed.shape[axis + 1 :])


def quantize(w: jax.Array, *, kind: str, contract: int, group_size: int = 64) -> tuple[jax.Array, jax.Array]:
  """Quantise a projection weight.

  Args:
    w: ``f32[*C, *O]`` (any float dtype; computed in float32), contracting its first ``contract`` dims.
    kind: ``"int8"`` or ``"fp8"`` (per output channel), ``"int4"`` or ``"nf4"`` (per group of ``group_size``
      along axis ``contract - 1``). Formulas in the module docstring.
    contract: number of leading (contracted) dims, ``1 <= contract < w.ndim``.
    group_size: 4-bit group (block) size; even, dividing ``w.shape[contract - 1]``.

  Returns:
    ``(codes, scales)``: ``int8[*C, *O]`` (``float8_e4m3fn`` for fp8) and ``f32[1.., *O]`` for int8/fp8; packed ``uint8`` codes and
    ``f32`` group scales for int4/nf4 (shapes from ``quantized_shapes``).
  """
  shape = tuple(w.shape)
  _check(shape, kind, contract, group_size)
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"w must be a float array, got {w.dtype}")
  w = w.astype(jnp.float32)
  if kind == "int8":
    s = jnp.max(jnp.abs(w), axis=tuple(range(contract)), keepdims=True) * jnp.float32(1 / 127)
    q = jnp.clip(jnp.round(_safe_divide(w, s)), -127, 127).astype(jnp.int8)
    return q, s
  if kind == "fp8":
    s = jnp.max(jnp.abs(w), axis=tuple(range(contract)), keepdims=True) * jnp.float32(1 / _FP8_MAX)
    return jnp.clip(_safe_divide(w, s), -_FP8_MAX, _FP8_MAX).astype(jnp.float8_e4m3fn), s
  a = contract - 1
  g = _grouped(w, a, group_size)  # [..., n/g, g, ...]
  absmax = jnp.max(jnp.abs(g), axis=a + 1, keepdims=True)
  if kind == "int4":
    s = absmax * jnp.float32(1 / 7)
    q = jnp.clip(jnp.round(_safe_divide(g, s)), -7, 7)
    codes = (q + 8).astype(jnp.uint8)
  else:  # nf4
    s = absmax
    x = _safe_divide(g, s)
    codes = jnp.sum(x[..., None] > jnp.asarray(_NF4_MIDPOINTS), axis=-1).astype(jnp.uint8)
  codes = codes.reshape(shape)
  return _pack(codes, a), jnp.squeeze(s, axis=a + 1)


def dequantize(
  codes: jax.Array, scales: jax.Array, *, kind: str, contract: int, group_size: int = 64, dtype=jnp.float32
) -> jax.Array:
  """``ŵ [*C, *O]`` in ``dtype`` from ``quantize``'s ``(codes, scales)`` (computed in float32)."""
  _check_kind(kind)
  if kind in PER_CHANNEL_KINDS:
    return (codes.astype(jnp.float32) * scales).astype(dtype)
  a = contract - 1
  c = _unpack(codes, a)
  shape = c.shape
  c = _grouped(c, a, group_size)
  if kind == "int4":
    values = c.astype(jnp.float32) - 8.0
  else:
    values = jnp.take(jnp.asarray(NF4_LEVELS), c.astype(jnp.int32), axis=0)
  return (values * jnp.expand_dims(scales, a + 1)).reshape(shape).astype(dtype)


def max_abs_error(kind: str) -> float:
  """The worst-case ``|w - ŵ| / s`` of ``kind`` (scale units): 0.5 for int8/int4, half the largest NF4 gap,
  16 for fp8 (half e4m3's spacing in [256, 448])."""
  _check_kind(kind)
  if kind == "fp8":
    return 16.0
  if kind == "nf4":
    return float(np.max(np.diff(NF4_LEVELS)) / 2)
  return 0.5
