"""Numeric hyper-parameters that are compile-time constants or traced inputs, as the caller chooses.

A number given as a Python (or NumPy) scalar is *static*: it is part of the compiled program (one
program per value, XLA folds it), and a static 0 switches its term off (e.g. ``beta=0.0``: no KL
term at all). A number given as a JAX/NumPy array is *traced*: one program serves every value, so
it can be scheduled (a function of the step), ``vmap``-ped over (a β or ε grid) or passed through an
outer ``jit``. Structural choices (a loss kind, an aggregation mode, ``max_tokens``) are always static.

:func:`split` / :func:`merge` carry a dict of such numbers through ``jax.jit`` (static part as a
hashable static argument, traced part as a pytree argument); :func:`register` makes a frozen
dataclass a pytree with the same rule per field.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["is_static", "is_static_zero", "split", "merge", "scalar", "register"]


def is_static(x) -> bool:
  """Whether ``x`` is a static number (a Python/NumPy scalar, not a bool) or None."""
  if x is None:
    return True
  return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_, np.ndarray, jax.Array))


def is_static_zero(x) -> bool:
  """Whether ``x`` is a static number equal to 0 (its term is left out of the program)."""
  return x is not None and is_static(x) and x == 0


def split(values: dict) -> tuple[tuple, dict]:
  """``(static, traced)``: a hashable tuple of the static ``(name, value)`` pairs and a dict of the rest."""
  static = tuple(sorted((k, v) for k, v in values.items() if is_static(v)))
  return static, {k: v for k, v in values.items() if not is_static(v)}


def merge(static: tuple, traced: dict) -> dict:
  """The numbers again, inside the jitted function: traced ones as ``f32[]`` (checked to be scalars)."""
  return {**dict(static), **{k: scalar(v, k) for k, v in traced.items()}}


def scalar(x, name: str):
  """A traced hyper-parameter as ``f32[]`` (ValueError naming it when it is not a scalar)."""
  if np.ndim(x) != 0:
    raise ValueError(
      f"`{name}` must be a scalar f32[] inside the kernel; got shape {np.shape(x)} (vmap over a batch of values)"
    )
  return jnp.asarray(x, jnp.float32)


def register(cls, *, numbers: tuple[str, ...]):
  """Register the frozen dataclass ``cls`` as a pytree: the fields in ``numbers`` that hold arrays are
  its leaves; every other field (structure, static numbers, None) is static auxiliary data.

  Unflattening bypasses ``__init__`` (no validation of tracers)."""
  names = tuple(f.name for f in dataclasses.fields(cls))

  def flatten(obj):
    leaves = tuple(n for n in numbers if not is_static(getattr(obj, n)))
    aux = (tuple((n, getattr(obj, n)) for n in names if n not in leaves), leaves)
    return tuple(getattr(obj, n) for n in leaves), aux

  def unflatten(aux, children):
    static, leaves = aux
    obj = object.__new__(cls)
    for n, v in (*static, *zip(leaves, children)):
      object.__setattr__(obj, n, v)
    return obj

  jax.tree_util.register_pytree_node(cls, flatten, unflatten)
  return cls
