"""The argument checks of the public functions: the one place they live.

One exception type per kind of mistake, and every message names the argument, what was expected
and what was given:

- ``TypeError``: a wrong type or dtype — an integer array where a float one belongs, a string or a
  bool where a number belongs, a float where a Python int belongs.
- ``ValueError``: a wrong shape, rank or value — mismatched shapes, a negative β, a NaN ε, a group
  id out of range, a prompt mask that is not left-padded.

Shapes, ranks and dtypes are static under ``jit``, so those checks run at trace time. Checks of the
*values* of arrays (group ids in range, mask layout) need concrete inputs: they run on direct calls
and are skipped when the input is traced by an outer ``jit``. Structural hyper-parameters (kinds,
modes, ``num_groups``, ...) are static Python values, checked on every call; numeric ones (ε, β, ...)
may be Python numbers (static) or arrays (traced; range-checked when concrete): :func:`check_scalar`.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "shape_of",
  "concrete_or_none",
  "check_rank",
  "check_int",
  "check_float",
  "check_bool",
  "check_same_shape",
  "check_dim",
  "check_choice",
  "check_python_int",
  "check_python_float",
  "check_scalar",
  "check_python_bool",
  "check_token_ids",
  "check_group_ids",
  "check_tokens_mask",
  "check_logp",
  "check_prng_key",
  "check_prompts",
  "local_rows_or_none",
]

# ----------------------------------------------------------------------------- arrays


def shape_of(x) -> tuple[int, ...]:
  return tuple(np.shape(x))


def concrete_or_none(x):
  """The NumPy value of ``x`` if it is concrete (not traced by jit) and held by this process, else None
  (an array spanning other processes' devices: see :func:`local_rows_or_none`)."""
  try:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return None
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def local_rows_or_none(x):
  """The rows of ``x`` held by this process (every row in one process), as NumPy, or None when traced:
  what a multi-process program can check without a collective."""
  x_local = concrete_or_none(x)
  if x_local is not None or not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
    return x_local
  shards = {s.index[0].start or 0: s.data for s in x.addressable_shards}  # spans other processes
  return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)])


def _dtype(x, name: str):
  try:
    return jnp.result_type(x)
  except TypeError:
    raise TypeError(f"`{name}` must be an array; got {type(x).__name__}") from None


def check_rank(x, rank: int | Sequence[int], name: str, layout: str) -> None:
  ranks = (rank,) if isinstance(rank, int) else tuple(rank)
  if np.ndim(x) not in ranks:
    raise ValueError(f"`{name}` must have rank {' or '.join(map(str, ranks))} ({layout}); got shape {shape_of(x)}")


def check_int(x, name: str, layout: str) -> None:
  dtype = _dtype(x, name)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"`{name}` must be an integer array ({layout}); got dtype {dtype}")


def check_float(x, name: str, layout: str) -> None:
  dtype = _dtype(x, name)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"`{name}` must be a floating array ({layout}); got dtype {dtype}")


def check_bool(x, name: str, layout: str) -> None:
  dtype = _dtype(x, name)
  if dtype != jnp.bool_:
    raise TypeError(f"`{name}` must be a boolean array ({layout}); got dtype {dtype}. Pass e.g. `{name}.astype(bool)`")


def check_same_shape(a, a_name: str, b, b_name: str) -> None:
  if shape_of(a) != shape_of(b):
    raise ValueError(f"`{a_name}` and `{b_name}` must have the same shape; got {shape_of(a)} and {shape_of(b)}")


def check_dim(x, axis: int, size: int, name: str, what: str) -> None:
  if shape_of(x)[axis] != size:
    raise ValueError(
      f"`{name}` has {shape_of(x)[axis]} along axis {axis}, expected {size} ({what}); got shape {shape_of(x)}"
    )


def check_group_ids(group_ids, batch: int, num_groups: int | None = None) -> None:
  """group_ids: ``int32[B]``; values in ``[0, num_groups)`` when both are known (concrete)."""
  check_rank(group_ids, 1, "group_ids", "int32[B]")
  check_int(group_ids, "group_ids", "int32[B]")
  check_dim(group_ids, 0, batch, "group_ids", "one group id per trajectory, B")
  if num_groups is not None:
    check_python_int(num_groups, "num_groups", minimum=1, hint="static number of groups")
  values = concrete_or_none(group_ids)
  if values is not None and values.size:
    upper = num_groups if num_groups is not None else np.iinfo(np.int32).max
    if values.min() < 0 or values.max() >= upper:
      raise ValueError(f"`group_ids` must lie in [0, {upper}); got values in [{values.min()}, {values.max()}]")


def check_tokens_mask(tokens, mask) -> tuple[int, int]:
  """tokens: ``int32[B, T]``, mask: ``bool[B, T]``; returns (B, T)."""
  check_rank(tokens, 2, "tokens", "int32[B, T]")
  check_int(tokens, "tokens", "int32[B, T]")
  check_rank(mask, 2, "mask", "bool[B, T]")
  check_bool(mask, "mask", "bool[B, T]")
  check_same_shape(tokens, "tokens", mask, "mask")
  return shape_of(tokens)


def check_logp(x, name: str, shape: tuple[int, ...] | None = None) -> None:
  """A ``f32[B, T]`` per-token array (log-probs, KL terms, token weights), optionally of a given shape."""
  check_float(x, name, "f32[B, T]")
  check_rank(x, 2, name, "f32[B, T]")
  if shape is not None and shape_of(x) != tuple(shape):
    raise ValueError(f"`{name}` must have shape {tuple(shape)} (B, T); got {shape_of(x)}")


def check_logp_pair(first, second, mask, names: tuple[str, str]) -> tuple[int, ...]:
  """Two ``f32[B, T]`` per-token arrays of one shape (e.g. ``logp`` and ``old_logp``, named by ``names``)
  and their ``bool[B, T]`` ``mask``; returns ``(B, T)``."""
  check_logp(first, names[0])
  shape = shape_of(first)
  check_logp(second, names[1], shape)
  check_rank(mask, 2, "mask", "bool[B, T]")
  check_bool(mask, "mask", "bool[B, T]")
  check_same_shape(mask, "mask", first, names[0])
  return shape


# ----------------------------------------------------------------------------- Python values


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_choice(value, choices: Sequence[str], name: str) -> str:
  if not isinstance(value, str):
    raise TypeError(f"`{name}` must be a string, one of {', '.join(map(repr, choices))}; got {value!r}")
  if value not in choices:
    raise ValueError(f"`{name}` must be one of {', '.join(map(repr, choices))}; got {value!r}")
  return value


def check_python_int(value, name: str, *, minimum: int | None = None, hint: str = "") -> int:
  """A Python (or NumPy) integer, not a bool, ``>= minimum``; returned as ``int``."""
  what = f" ({hint})" if hint else ""
  if not _is_int(value):
    raise TypeError(f"`{name}` must be a Python int{what}; got {value!r} ({type(value).__name__})")
  if minimum is not None and value < minimum:
    raise ValueError(f"`{name}` must be >= {minimum}{what}; got {value}")
  return int(value)


def check_python_float(
  value,
  name: str,
  *,
  at_least: float | None = None,
  above: float | None = None,
  at_most: float | None = None,
  hint: str = "",
) -> float:
  """A finite real number (Python/NumPy int or float, not a bool or a string) in the given range.

  Hyper-parameters are static: NaN and ±inf are rejected (``ValueError``), as are values outside
  ``[at_least, at_most]`` / ``(above, at_most]``. Returned as ``float``.
  """
  what = f" ({hint})" if hint else ""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise TypeError(f"`{name}` must be a Python float{what}; got {value!r} ({type(value).__name__})")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"`{name}` must be finite{what}; got {value}")
  low = f">= {at_least}" if at_least is not None else f"> {above}" if above is not None else None
  if (at_least is not None and value < at_least) or (above is not None and value <= above):
    raise ValueError(f"`{name}` must be {low}{what}; got {value}")
  if at_most is not None and value > at_most:
    raise ValueError(f"`{name}` must be <= {at_most}{what}; got {value}")
  return value


def check_scalar(
  value,
  name: str,
  *,
  at_least: float | None = None,
  above: float | None = None,
  at_most: float | None = None,
  hint: str = "",
):
  """A numeric hyper-parameter: a Python/NumPy real (returned as ``float``, checked as
  :func:`check_python_float`: static) or a real JAX/NumPy array (returned unchanged: traced), whose
  values are range-checked on the host when it is concrete (a traced value cannot be checked). Any
  shape is accepted here (a batch of values to ``vmap`` over); the kernels take scalars."""
  if not isinstance(value, (np.ndarray, jax.Array)):
    return check_python_float(value, name, at_least=at_least, above=above, at_most=at_most, hint=hint)
  what = f" ({hint})" if hint else ""
  dtype = _dtype(value, name)
  if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(f"`{name}` must be a real number or a float array{what}; got dtype {dtype}")
  x = concrete_or_none(value)
  if x is None or x.size == 0:
    return value
  x = x.astype(np.float64)
  got = f"{x.item()}" if x.size == 1 else f"values in [{x.min()}, {x.max()}]"
  if not np.isfinite(x).all():
    raise ValueError(f"`{name}` must be finite{what}; got {got}")
  low = f">= {at_least}" if at_least is not None else f"> {above}" if above is not None else None
  if (at_least is not None and x.min() < at_least) or (above is not None and x.min() <= above):
    raise ValueError(f"`{name}` must be {low}{what}; got {got}")
  if at_most is not None and x.max() > at_most:
    raise ValueError(f"`{name}` must be <= {at_most}{what}; got {got}")
  return value


def check_python_bool(value, name: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"`{name}` must be a bool; got {value!r} ({type(value).__name__})")
  return bool(value)


def check_token_ids(ids, name: str, vocab_size: int) -> tuple[int, ...]:
  """One token id or a sequence of them, each an int in ``[0, vocab_size)``; returned as a tuple."""
  if _is_int(ids):
    ids = (ids,)
  if isinstance(ids, (str, bytes)):
    raise TypeError(f"`{name}` must be a sequence of int token ids; got {ids!r}")
  try:
    ids = tuple(ids)
  except TypeError:
    raise TypeError(f"`{name}` must be a sequence of int token ids; got {ids!r}") from None
  for i in ids:
    if not _is_int(i):
      raise TypeError(f"`{name}` must hold int token ids; got {i!r} ({type(i).__name__}) in {ids!r}")
    if not 0 <= i < vocab_size:
      raise ValueError(f"`{name}` must hold ids in [0, vocab_size={vocab_size}); got {i} in {ids!r}")
  return tuple(int(i) for i in ids)


# ----------------------------------------------------------------------------- sampler inputs


def check_prng_key(key, name: str = "key") -> jax.Array:
  """A single PRNG key: typed (``jax.random.key``) or raw ``uint32[2]`` (``jax.random.PRNGKey``)."""
  key = jnp.asarray(key)
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.shape != ():
      raise ValueError(f"`{name}` must be a single PRNG key; got a key array of shape {key.shape}")
    return key
  if key.dtype != jnp.uint32:
    raise TypeError(f"`{name}` must be a jax.random.key(...) or a raw uint32[2] PRNGKey; got dtype {key.dtype}")
  if key.shape != (2,):
    raise ValueError(f"`{name}` must be a single PRNG key (raw keys are uint32[2]); got shape {key.shape}")
  return key


def check_positions(terms, limit: int, whose: str, fix: str) -> None:
  """The one length rule: a row of ``sum(n for _, n in terms)`` tokens (a prompt, its completion, ...) must fit
  the ``limit`` positions of ``whose`` (a model's ``max_position_embeddings``, an engine's ``max_model_len``).
  ``terms``: ``[(text, n), ...]``, each ``text`` naming its count as the user set it (``"prompt length 20"``).
  ValueError in one line naming the numbers and ``fix``:
  ``"prompt length 20 + max_new_tokens 200 = 220 exceeds the 128 positions of the model (max_position_embeddings):
  shorten the prompts or lower SamplingConfig.max_new_tokens"``."""
  total = sum(n for _, n in terms)
  if total > limit:
    said = " + ".join(text for text, _ in terms)
    raise ValueError(f"{said} = {total} exceeds the {limit} positions of {whose}: {fix}")


def check_prompts(prompt_tokens, prompt_mask) -> tuple[jax.Array, jax.Array]:
  """``int32[B, P]`` tokens and their ``bool[B, P]`` mask, left-padded with >= 1 real token per row.

  The layout of the mask is checked when it is concrete. Returns ``(tokens as int32, mask)``.
  """
  prompt_tokens = jnp.asarray(prompt_tokens)
  prompt_mask = jnp.asarray(prompt_mask)
  check_rank(prompt_tokens, 2, "prompt_tokens", "int32[B, P]")
  check_int(prompt_tokens, "prompt_tokens", "int32[B, P]")
  check_rank(prompt_mask, 2, "prompt_mask", "bool[B, P]")
  check_bool(prompt_mask, "prompt_mask", "bool[B, P]")
  check_same_shape(prompt_mask, "prompt_mask", prompt_tokens, "prompt_tokens")
  if 0 in prompt_tokens.shape:
    raise ValueError(f"`prompt_tokens` must be non-empty (B >= 1, P >= 1); got shape {prompt_tokens.shape}")
  mask = local_rows_or_none(prompt_mask)  # several processes: each checks its own rows
  if mask is not None:
    if not mask[:, -1].all():
      bad = np.flatnonzero(~mask[:, -1])
      raise ValueError(
        f"`prompt_mask` must be left-padded with at least one real token per row (last column True); "
        f"rows {bad.tolist()} are not"
      )
    late = (mask[:, 1:] < mask[:, :-1]).any(axis=1)
    if late.any():
      raise ValueError(
        f"`prompt_mask` must be left-padded (False...False True...True); rows {np.flatnonzero(late).tolist()} "
        "have a False after a True"
      )
  return prompt_tokens.astype(jnp.int32), prompt_mask


def load_callable(path: str, what: str, forms: str = "'package.module:callable'"):
  """The callable named by ``"package.module:attribute"`` (imported; the attribute may be dotted). ValueError
  naming the config field ``what`` and ``path`` when the string has another form (``forms`` says the accepted
  ones), the module does not import, or the name is missing or not callable."""
  module, sep, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
  if not sep or not module or not attr:
    raise ValueError(f"`{what}` must be {forms}; got {path!r}")
  try:
    obj = importlib.import_module(module)
  except ImportError as e:
    raise ValueError(f"`{what}`: {path!r}: cannot import module {module!r} ({e})") from None
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise ValueError(f"`{what}`: {path!r}: module {module!r} has no attribute {attr!r}")
    obj = getattr(obj, part)
  if not callable(obj):
    raise ValueError(f"`{what}`: {path!r} is not callable ({type(obj).__name__})")
  return obj


def names_local_path(source: str) -> bool:
  """Whether ``source`` names a local path rather than a hub id (``owner/name``, or a bare name).

  The rule: a local path starts with ``/``, ``.`` (``./``, ``../``) or ``~``; or holds more than one ``/``
  (or the platform's other separator); or its first part is a local directory (``runs/arith_rm`` where ``runs``
  exists: what the scripts write). Anything else is a hub id — ``Qwen/Qwen3-1.7B`` stays one unless a local
  ``Qwen`` directory exists, where it names ``Qwen/Qwen3-1.7B`` in it (write ``./Qwen/...`` to be explicit).
  A local path that does not exist is then an error naming it, never a hub download."""
  source = os.fspath(source)
  first, sep, _ = source.partition("/")
  return (
    source.startswith(("/", ".", "~"))
    or source.count("/") > 1
    or (os.sep != "/" and os.sep in source)
    or bool(sep and first and os.path.isdir(first))
  )
