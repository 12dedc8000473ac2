"""QLoRA weight quantisation (jaxgrpo.models.quant) against a NumPy reference written from the formulas."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxgrpo.models import quant

# The NF4 levels as printed in the QLoRA paper's appendix / bitsandbytes' table (independent copy).
_NF4 = np.array(
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


def _np_reference(w: np.ndarray, kind: str, contract: int, group: int):
  """(ŵ, s per element) by the formulas, one group at a time, in float32 (exact IEEE division)."""
  w = w.astype(np.float32)
  if kind == "int8":
    s = np.max(np.abs(w), axis=tuple(range(contract)), keepdims=True) * np.float32(1 / 127)
    s = np.broadcast_to(s, w.shape)
    with np.errstate(invalid="ignore", divide="ignore"):
      q = np.where(s > 0, np.clip(np.round(w / s), -127, 127), 0).astype(np.float32)
    return q * s, s
  axis = contract - 1
  moved = np.moveaxis(w, axis, -1)  # grouped axis last
  rows = moved.reshape(-1, moved.shape[-1] // group, group)  # [rows, groups, g]
  w_hat = np.empty_like(rows)
  scale = np.empty_like(rows)
  for i in range(rows.shape[0]):
    for j in range(rows.shape[1]):
      x = rows[i, j]
      absmax = np.max(np.abs(x))
      if kind == "int4":
        s = absmax * np.float32(1 / 7)
        q = np.clip(np.round(x / s), -7, 7) if s > 0 else np.zeros_like(x)
        w_hat[i, j] = q.astype(np.float32) * s
      else:
        s = absmax
        y = x / s if s > 0 else np.zeros_like(x)
        idx = np.argmin(np.abs(y[:, None] - _NF4[None, :]), axis=1)
        w_hat[i, j] = _NF4[idx] * s
      scale[i, j] = s
  back = lambda a: np.moveaxis(a.reshape(moved.shape), -1, axis)
  return back(w_hat), back(scale)


def _assert_matches_reference(w, w_hat, ref_hat, ref_scale, kind):
  """ŵ equals the reference except where w / s lies within 1e-5 of a rounding boundary (XLA:CPU's
  float32 division is not IEEE-exact there), and those are rare."""
  differ = w_hat != ref_hat
  x = np.abs(np.where(ref_scale > 0, w / np.where(ref_scale > 0, ref_scale, 1), 0))
  if kind == "nf4":
    mids = (_NF4[1:] + _NF4[:-1]) / 2
    near = np.min(np.abs(np.sign(w)[..., None] * x[..., None] - mids), axis=-1) < 1e-5
  else:
    near = np.abs(x - np.floor(x) - 0.5) < 1e-5
  assert np.all(near[differ]), np.argwhere(differ & ~near)[:5]
  assert differ.mean() < 1e-3, differ.mean()


# Realistic projection shapes: q [D, H, K], o [H, K, D], gate [D, F], down [F, D].
_CASES = [((512, 8, 64), 1), ((8, 64, 512), 2), ((512, 1536), 1), ((1536, 512), 1)]


@pytest.mark.parametrize("kind", quant.QUANT_KINDS)
@pytest.mark.parametrize("shape,contract", _CASES, ids=["q", "o", "gate", "down"])
def test_quantize_matches_numpy_reference_and_error_bound(kind, shape, contract):
  rng = np.random.default_rng(0)
  w = (0.02 * rng.standard_normal(shape) * rng.uniform(0.2, 3.0, size=shape[-1:])).astype(np.float32)
  codes, scales = quant.quantize(jnp.asarray(w), kind=kind, contract=contract, group_size=64)
  assert (tuple(codes.shape), tuple(scales.shape)) == quant.quantized_shapes(
    shape, kind=kind, contract=contract, group_size=64
  )
  assert codes.dtype == (jnp.int8 if kind == "int8" else jnp.uint8)
  assert codes.nbytes == (w.size if kind == "int8" else w.size // 2)
  w_hat = np.asarray(quant.dequantize(codes, scales, kind=kind, contract=contract, group_size=64))
  ref_hat, ref_scale = _np_reference(w, kind, contract, 64)
  _assert_matches_reference(w, w_hat, ref_hat, ref_scale, kind)
  err = np.abs(w - w_hat)
  bound = quant.max_abs_error(kind) * ref_scale + 4 * np.spacing(np.abs(w))  # + float32 rounding of w - ŵ
  assert np.all(err <= bound), float(np.max(err / np.maximum(bound, 1e-30)))
  # the bound is tight-ish: the error uses most of it somewhere, and the relative Frobenius error is small
  assert np.max(err / np.maximum(ref_scale, 1e-30)) > 0.3 * quant.max_abs_error(kind)
  assert np.linalg.norm(err) / np.linalg.norm(w) < {"int8": 0.01, "int4": 0.2, "nf4": 0.15}[kind]


@pytest.mark.parametrize("kind", quant.QUANT_KINDS)
def test_zero_groups_dequantise_to_zero_without_nan(kind):
  w = np.zeros((64, 4), np.float32)
  w[:, 0] = np.linspace(-1, 1, 64)  # one non-zero output channel (int8) / column
  codes, scales = quant.quantize(jnp.asarray(w), kind=kind, contract=1, group_size=32)
  w_hat = np.asarray(quant.dequantize(codes, scales, kind=kind, contract=1, group_size=32))
  assert np.all(np.isfinite(w_hat))
  np.testing.assert_array_equal(w_hat[:, 1:], 0.0)
  assert abs(w_hat[0, 0] + 1) < 1e-6 and abs(w_hat[-1, 0] - 1) < 1e-6  # ±absmax are exact levels


def test_four_bit_packing_uses_both_nibbles():
  w = np.tile(np.linspace(-1, 1, 16, dtype=np.float32), 4)[:, None]  # 64 × 1, every level once per 16
  for kind in ("int4", "nf4"):
    codes, scales = quant.quantize(jnp.asarray(w), kind=kind, contract=1, group_size=16)
    c = np.asarray(codes)
    lo, hi = c & 0xF, c >> 4
    assert c.shape == (32, 1)
    np.testing.assert_array_equal(lo[:8, 0], lo[8:16, 0])  # groups repeat
    assert set(np.concatenate([lo, hi]).ravel()) >= ({0, 15} if kind == "nf4" else {1, 15})


def test_bad_arguments_raise_naming_them():
  w = jnp.ones((96, 8))
  with pytest.raises(ValueError, match="group_size=64"):
    quant.quantize(w, kind="nf4", contract=1, group_size=64)  # 96 % 64
  with pytest.raises(ValueError, match="group_size must be an even"):
    quant.quantize(w, kind="int4", contract=1, group_size=3)
  with pytest.raises(ValueError, match="kind must be one of"):
    quant.quantize(w, kind="fp4", contract=1)
  with pytest.raises(ValueError, match="contract"):
    quant.quantize(w, kind="int8", contract=2)
  with pytest.raises(TypeError, match="float"):
    quant.quantize(jnp.ones((64, 8), jnp.int32), kind="int8", contract=1)


@settings(max_examples=15, deadline=None)
@given(
  kind=st.sampled_from(quant.QUANT_KINDS),
  groups=st.integers(1, 4),
  group=st.sampled_from([2, 8, 16]),
  lead=st.integers(1, 3),
  out=st.integers(1, 5),
  contract=st.sampled_from([1, 2]),
  seed=st.integers(0, 2**31 - 1),
)
def test_roundtrip_bound_any_shape(kind, groups, group, lead, out, contract, seed):
  shape = (groups * group, out) if contract == 1 else (lead, groups * group, out)
  w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  codes, scales = quant.quantize(jnp.asarray(w), kind=kind, contract=contract, group_size=group)
  w_hat = np.asarray(quant.dequantize(codes, scales, kind=kind, contract=contract, group_size=group))
  ref_hat, ref_scale = _np_reference(w, kind, contract, group)
  _assert_matches_reference(w, w_hat, ref_hat, ref_scale, kind)
  assert np.all(np.abs(w - w_hat) <= quant.max_abs_error(kind) * ref_scale + 4 * np.spacing(np.abs(w)))
