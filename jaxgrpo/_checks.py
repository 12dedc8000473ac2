"""Trace-time argument checks shared by the public functions.

Shapes, ranks and dtypes are static under ``jit``, so every check here runs at trace time and raises a
``ValueError``/``TypeError`` that names the argument, what was expected and what was given. Value
checks (e.g. group ids in range) can only run on concrete arrays; under ``jit`` they are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def shape_of(x) -> tuple[int, ...]:
  return tuple(np.shape(x))


def check_rank(x, rank: int | Sequence[int], name: str, layout: str) -> None:
  ranks = (rank,) if isinstance(rank, int) else tuple(rank)
  if np.ndim(x) not in ranks:
    raise ValueError(f"`{name}` must have rank {' or '.join(map(str, ranks))} ({layout}); got shape {shape_of(x)}")


def check_int(x, name: str, layout: str) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
    raise TypeError(f"`{name}` must be an integer array ({layout}); got dtype {jnp.result_type(x)}")


def check_float(x, name: str, layout: str) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(f"`{name}` must be a floating array ({layout}); got dtype {jnp.result_type(x)}")


def check_bool(x, name: str, layout: str) -> None:
  if jnp.result_type(x) != jnp.bool_:
    raise TypeError(
      f"`{name}` must be a boolean array ({layout}); got dtype {jnp.result_type(x)}. Pass e.g. `{name}.astype(bool)`"
    )


def check_same_shape(a, a_name: str, b, b_name: str) -> None:
  if shape_of(a) != shape_of(b):
    raise ValueError(f"`{a_name}` and `{b_name}` must have the same shape; got {shape_of(a)} and {shape_of(b)}")


def check_dim(x, axis: int, size: int, name: str, what: str) -> None:
  if shape_of(x)[axis] != size:
    raise ValueError(
      f"`{name}` has {shape_of(x)[axis]} along axis {axis}, expected {size} ({what}); got shape {shape_of(x)}"
    )


def check_choice(value, choices: Sequence[str], name: str) -> None:
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {', '.join(map(repr, choices))}; got {value!r}")


def concrete_or_none(x):
  """The NumPy value of ``x`` if it is concrete (not traced by jit), else None."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def check_group_ids(group_ids, batch: int, num_groups: int | None = None) -> None:
  """group_ids: int32[B]; values in [0, num_groups) when both are known."""
  check_rank(group_ids, 1, "group_ids", "int32[B]")
  check_int(group_ids, "group_ids", "int32[B]")
  check_dim(group_ids, 0, batch, "group_ids", "one group id per trajectory, B")
  if num_groups is not None:
    if not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
      raise ValueError(f"`num_groups` must be a positive Python int (static); got {num_groups!r}")
  values = concrete_or_none(group_ids)
  if values is not None and values.size:
    upper = num_groups if num_groups is not None else np.iinfo(np.int32).max
    if values.min() < 0 or values.max() >= upper:
      raise ValueError(f"`group_ids` must lie in [0, {upper}); got values in [{values.min()}, {values.max()}]")


def check_tokens_mask(tokens, mask) -> tuple[int, int]:
  """tokens: int[B, T], mask: bool[B, T]; returns (B, T)."""
  check_rank(tokens, 2, "tokens", "int32[B, T]")
  check_int(tokens, "tokens", "int32[B, T]")
  check_rank(mask, 2, "mask", "bool[B, T]")
  check_bool(mask, "mask", "bool[B, T]")
  check_same_shape(tokens, "tokens", mask, "mask")
  return shape_of(tokens)


def check_logp(x, name: str, shape: tuple[int, ...] | None = None) -> None:
  check_float(x, name, "float32[B, T]")
  check_rank(x, 2, name, "float32[B, T]")
  if shape is not None and shape_of(x) != tuple(shape):
    raise ValueError(f"`{name}` must have shape {tuple(shape)} (B, T); got {shape_of(x)}")
