"""The field checker of the run specs (``jaxgrpo.run.specs``): a value against its dataclass annotation.

:func:`_convert` checks ``value`` against the annotation ``hint`` of the field at dotted ``path`` and
converts where the annotation says so (a mapping → the section's dataclass, a list → a tuple, an int
→ a float; ``nan``/``inf`` spellings → floats, refused as non-finite); a wrong type is one TypeError
naming the field, the expected type and the value. :func:`check_fields` applies it to every field of
a constructed spec (``TrainerConfig.__post_init__``); :func:`build_spec` constructs a dataclass from a
mapping (``objective: {preset: NAME, ...}`` → ``jaxgrpo.kernels.config.preset``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from jaxgrpo.kernels.config import GRPOConfig, preset

__all__: list[str] = []


#: ``{token: float}``: the spellings of NaN and ±inf read as floats on the command line (plain YAML
#: reads ``nan``/``inf`` as strings), so that the field check refuses them as non-finite numbers
NONFINITE = {t: float(t.replace(".", "")) for t in ("nan", ".nan", "inf", ".inf", "infinity")}
NONFINITE.update({sign + t: float(sign + t.replace(".", "")) for t in ("inf", ".inf", "infinity") for sign in "+-"})


def _type_name(hint) -> str:
  if hint is type(None):
    return "null"
  if isinstance(hint, type):
    return hint.__name__
  return str(hint).replace("typing.", "").replace("collections.abc.", "")


def _type_error(path: str, hint, value) -> TypeError:
  return TypeError(f"config field `{path}`: expected {_type_name(hint)}; got {value!r} ({type(value).__name__})")


def join_path(path: str, key) -> str:
  return f"{path}.{key}" if path else str(key)


def _convert(value, hint, path: str):
  """``value`` checked against the annotation ``hint``; mappings become dataclasses, lists tuples and
  ints floats where the annotation says so. Raises TypeError naming ``path``."""
  if hint is Any:
    return value
  origin = typing.get_origin(hint)
  if origin in (types.UnionType, typing.Union):
    args = typing.get_args(hint)
    if value is None:
      if type(None) in args:
        return None
      raise _type_error(path, hint, value)
    specs = [a for a in args if dataclasses.is_dataclass(a)]
    if isinstance(value, Mapping) and len(specs) == 1:  # a section: its own field errors, not the union's
      return _convert(value, specs[0], path)
    for arg in args:
      if arg is type(None):
        continue
      try:
        return _convert(value, arg, path)
      except TypeError:
        continue
    raise _type_error(path, hint, value)
  if hint is bool:
    if isinstance(value, bool):
      return value
    raise _type_error(path, hint, value)
  if hint is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    raise _type_error(path, hint, value)
  if hint is float:
    if isinstance(value, str) and value.strip().lower() in NONFINITE:  # YAML reads `inf`, `nan` as strings
      value = NONFINITE[value.strip().lower()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      if not math.isfinite(value):
        raise ValueError(f"config field `{path}`: expected a finite number; got {value}")
      return float(value)
    raise _type_error(path, hint, value)
  if hint is str:
    if isinstance(value, str):
      return value
    raise _type_error(path, hint, value)
  if origin is typing.Literal:
    if value in typing.get_args(hint):
      return value
    raise _type_error(path, hint, value)
  if origin in (tuple, Sequence):
    (item, *_) = typing.get_args(hint) or (Any,)
    if isinstance(value, (list, tuple)):
      return tuple(_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    raise _type_error(path, hint, value)
  if origin in (Mapping, dict, typing.Mapping):
    key_hint, value_hint = typing.get_args(hint)
    if isinstance(value, Mapping):
      return {_convert(k, key_hint, path): _convert(v, value_hint, join_path(path, k)) for k, v in value.items()}
    raise _type_error(path, hint, value)
  if dataclasses.is_dataclass(hint):
    if isinstance(value, hint):
      check_fields(value, path)
      return value
    if isinstance(value, Mapping):
      return build_spec(hint, value, path)
    raise _type_error(path, hint, value)
  if isinstance(hint, type):
    if isinstance(value, hint):
      return value
    raise _type_error(path, hint, value)
  return value  # e.g. a Callable field of a library config: not written in YAML; its class checks it


def check_fields(spec, path: str) -> None:
  """Type-checks every field of a constructed spec (recursively); TypeError naming the field."""
  hints = typing.get_type_hints(type(spec))
  for f in dataclasses.fields(spec):
    _convert(getattr(spec, f.name), hints[f.name], join_path(path, f.name))


def did_you_mean(key: str, valid) -> list[str]:
  """The entries of ``valid`` closest to the mistyped ``key`` (``presett`` → ``preset``, ``group_sise`` →
  ``group_size``; at most two, most similar first; none when nothing is close)."""
  return difflib.get_close_matches(str(key), [str(v) for v in valid], n=2, cutoff=0.6)


def _unknown_keys(unknown: list[str], valid: list[str], path: str) -> ValueError:
  """The error for keys of a section that are not its fields, each with its likely spelling."""
  hints = []
  for k in unknown:
    close = did_you_mean(k, valid)
    if close:
      hints.append(f"`{join_path(path, k)}`: did you mean {' or '.join(f'`{join_path(path, c)}`' for c in close)}?")
  hint = f" ({'; '.join(hints)})" if hints else ""
  return ValueError(f"unknown key(s) {unknown} in `{path or 'config'}`{hint}; valid keys: {valid}")


def build_spec(cls, d: Mapping[str, Any], path: str):
  if cls is GRPOConfig and "preset" in d:
    return _build_preset(d, path)
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls) if f.init]
  unknown = sorted(str(k) for k in set(d) - set(names))
  if unknown:
    raise _unknown_keys(unknown, names + (["preset"] if cls is GRPOConfig else []), path)
  kwargs = {k: _convert(v, hints[k], join_path(path, k)) for k, v in d.items()}
  if not path:  # the whole config (TrainerConfig): its messages name whole paths already
    return cls(**kwargs)
  try:
    return cls(**kwargs)
  except ValueError as e:
    raise ValueError(f"in `{path}`: {e}") from None


def _build_preset(d: Mapping[str, Any], path: str) -> GRPOConfig:
  """``objective: {preset: NAME, <GRPOConfig field>: value, ...}`` → ``preset(NAME, **fields)``."""
  rest = {k: v for k, v in d.items() if k != "preset"}
  name = _convert(d["preset"], str, join_path(path, "preset"))
  if "name" in rest:
    raise ValueError(f"`{path}`: give `preset` (a preset and overrides) or `name` (a custom config), not both")
  hints = typing.get_type_hints(GRPOConfig)
  unknown = sorted(set(rest) - set(hints))
  if unknown:
    raise _unknown_keys(unknown, ["preset", *sorted(hints)], path)
  try:
    return preset(name, **{k: _convert(v, hints[k], join_path(path, k)) for k, v in rest.items()})
  except ValueError as e:
    raise ValueError(f"in `{path}`: {e}") from None
