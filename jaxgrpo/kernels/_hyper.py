"""Numeric hyper-parameters that are compile-time constants or traced inputs, as the caller chooses.

A number given as a Python (or NumPy) scalar is *static*: it is part of the compiled program (one
program per value, XLA folds it), and a static 0 switches its term off (e.g. ``beta=0.0``: no KL
term at all). A number given as a JAX/NumPy array is *traced*: one program serves every value, so
it can be scheduled (a function of the step), ``vmap``-ped over (a β or ε grid) or passed through an
outer ``jit``. Structural choices (a loss kind, an aggregation mode, ``max_tokens``) are always static.

:func:`jit` applies the rule to a kernel's keyword numbers (``max_delta``, ``cap``, ``clip_eps_low``, ...):
the kernel body takes plain keywords, and the split into a hashable static part and a traced pytree
part happens here, around ``jax.jit``. :func:`register` makes a frozen dataclass a pytree with the same
rule per field (:class:`~jaxgrpo.kernels.hyper.GRPOHyper`).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["is_static", "is_static_zero", "jit", "scalar", "register"]


def is_static(x) -> bool:
  """Whether ``x`` is a static number (a Python/NumPy scalar, not a bool) or None."""
  if x is None:
    return True
  return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_, np.ndarray, jax.Array))


def is_static_zero(x) -> bool:
  """Whether ``x`` is a static number equal to 0 (its term is left out of the program)."""
  return x is not None and is_static(x) and x == 0


def _split(values: dict) -> tuple[tuple, dict]:
  """``(static, traced)``: a hashable tuple of the static ``(name, value)`` pairs and a dict of the rest."""
  static = tuple(sorted((k, v) for k, v in values.items() if is_static(v)))
  return static, {k: v for k, v in values.items() if not is_static(v)}


def _merge(static: tuple, traced: dict) -> dict:
  """The numbers again, inside the jitted function: traced ones as ``f32[]`` (checked to be scalars)."""
  return {**dict(static), **{k: scalar(v, k) for k, v in traced.items()}}


def scalar(x, name: str):
  """A traced hyper-parameter as ``f32[]`` (ValueError naming it when it is not a scalar)."""
  if np.ndim(x) != 0:
    raise ValueError(
      f"`{name}` must be a scalar f32[] inside the kernel; got shape {np.shape(x)} (vmap over a batch of values)"
    )
  return jnp.asarray(x, jnp.float32)


def jit(fun, *, numbers: tuple[str, ...], static_argnames: tuple[str, ...] = ()):
  """``jax.jit`` of ``fun`` in which the keyword arguments named in ``numbers`` follow the module's rule.

  A number given as a Python/NumPy scalar or None is static (part of the compiled program and of its
  cache key); one given as an array is traced and reaches ``fun`` as ``f32[]`` (:func:`scalar`;
  ValueError naming it when it is not a scalar). ``static_argnames`` are static as in ``jax.jit``;
  every other argument is traced. The compiled function is named ``<fun's name>_jit``::

      scale = jit(lambda x, *, c: x * c, numbers=("c",))
      scale(x, c=2.0)               # c static: a constant of the program (one program per value)
      scale(x, c=jnp.float32(2.0))  # c traced: one program for every value
  """

  def traced_fun(*args, _static_numbers, _traced_numbers, **kwargs):
    return fun(*args, **kwargs, **_merge(_static_numbers, _traced_numbers))

  traced_fun.__name__ = traced_fun.__qualname__ = f"{fun.__name__}_jit"
  jitted = jax.jit(traced_fun, static_argnames=(*static_argnames, "_static_numbers"))

  @functools.wraps(fun)
  def call(*args, **kwargs):
    static, traced = _split({n: kwargs.pop(n) for n in numbers if n in kwargs})
    return jitted(*args, _static_numbers=static, _traced_numbers=traced, **kwargs)

  return call


def register(cls, *, numbers: tuple[str, ...]):
  """Register the frozen dataclass ``cls`` as a pytree: the fields in ``numbers`` that hold arrays are
  its leaves, keyed by their field names (``jax.tree_util.GetAttrKey``: ``hyper.beta`` in key paths and
  in the compiled program's parameter names, as for a NamedTuple); every other field (structure, static
  numbers, None) is static auxiliary data.

  Unflattening bypasses ``__init__`` (no validation of tracers)."""
  names = tuple(f.name for f in dataclasses.fields(cls))

  def flatten_with_keys(obj):
    leaves = tuple(n for n in numbers if not is_static(getattr(obj, n)))
    aux = (tuple((n, getattr(obj, n)) for n in names if n not in leaves), leaves)
    return tuple((jax.tree_util.GetAttrKey(n), getattr(obj, n)) for n in leaves), aux

  def flatten(obj):
    children, aux = flatten_with_keys(obj)
    return tuple(v for _, v in children), aux

  def unflatten(aux, children):
    static, leaves = aux
    obj = object.__new__(cls)
    for n, v in (*static, *zip(leaves, children)):
      object.__setattr__(obj, n, v)
    return obj

  jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
  return cls
