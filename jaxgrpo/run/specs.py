"""What a training run is, read from YAML and dotted overrides into the nested specs of ``jaxgrpo.run.spec_schema``.

A :class:`TrainerConfig` is a few sections (``model``, ``lora``, ``data``, ``objective``, ``rollout``,
``step``, ``optim``, ``reward``, ``eval``, ``checkpoint``, ``run``, ``devices``, ``env``; the table is
``jaxgrpo.run.spec_schema``'s docstring); YAML mirrors it (``scripts/configs/*.yaml``)::

    model: {path: Qwen/Qwen3-1.7B-Base, dtype: bfloat16}
    lora: {rank: 64, alpha: 128, dropout: 0.05}  # optional: train adapters only (quantize: nf4 = QLoRA)
    data: {dataset: BytedTsinghua-SIA/DAPO-Math-17k, mapping: dapo}
    objective: {preset: frpo, beta: 0.01}       # a preset name plus GRPOConfig fields
    rollout: {group_size: 5, prompts_per_step: 256, max_new_tokens: 8192}
    step: {mini_batches: 4, micro_batches: 8, temperature: 1.0}
    optim: {learning_rate: 1.0e-6}

:func:`load_config` reads a file, applies ``overrides`` (dotted keys, ``{"rollout.group_size": 8}``)
on top of it — or on top of the defaults without a file — and checks every field's type and value,
naming the field, the expected type and the value, before anything is built. Numbers such as
``1e-4`` are floats (YAML 1.1 would read them as strings); NaN and ±inf are refused. Keys are the
section names and dotted paths only: a key of the earlier flat config (``group_size``,
``demo_layers``, ...) is an unknown key, and its error names the dotted key to write.

The field type checker is ``jaxgrpo.run._spec_fields``; this module re-exports every name of the schema.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import os
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from jaxgrpo.data import looks_local
from jaxgrpo.kernels.config import GRPOConfig
from jaxgrpo.run._spec_fields import NONFINITE, build_spec, did_you_mean, join_path
from jaxgrpo.run.spec_schema import (
  DTYPES,
  ENGINES,
  REWARD_FUNCTIONS,
  CheckpointSpec,
  DataSpec,
  DevicesSpec,
  EvalSpec,
  ModelSpec,
  OptimSpec,
  PartialSpec,
  RewardSpec,
  RolloutSpec,
  RunSpec,
  TrainerConfig,
  VLLMSpec,
)
from jaxgrpo.run.task_specs import ArithmeticTask

__all__ = [
  "DTYPES",
  "REWARD_FUNCTIONS",
  "ModelSpec",
  "DataSpec",
  "RolloutSpec",
  "VLLMSpec",
  "PartialSpec",
  "ENGINES",
  "OptimSpec",
  "RewardSpec",
  "EvalSpec",
  "CheckpointSpec",
  "RunSpec",
  "DevicesSpec",
  "TrainerConfig",
  "config_from_dict",
  "load_config",
  "read_yaml",
  "parse_value",
  "parse_override",
  "field_type",
]


# ----------------------------------------------------------------------------- keys


SECTIONS = tuple(f.name for f in dataclasses.fields(TrainerConfig))
# sections that may be null (absent): `lora`
_OPTIONAL_SECTIONS = tuple(
  name for name, hint in typing.get_type_hints(TrainerConfig).items() if type(None) in typing.get_args(hint)
)


def field_type(path: str):
  """The annotation of the config field at dotted ``path`` (``"rollout.group_size"`` → ``int``).

  ``objective.preset`` is a string; a path that continues into a mapping field
  (``reward.weights.format``) names one of its entries. Raises ValueError for an unknown path,
  listing the valid keys at the point where it goes wrong.
  """
  cls, walked = TrainerConfig, ""
  parts = path.split(".")
  for i, part in enumerate(parts):
    if cls is GRPOConfig and part == "preset" and i == len(parts) - 1:
      return str
    hints = typing.get_type_hints(cls)
    if part not in hints:
      valid = sorted(hints) + (["preset"] if cls is GRPOConfig else [])
      close = [join_path(walked, c) for c in did_you_mean(part, valid)]
      if not close and walked:  # a field of another section (`--rollout.learning_rate`)
        close = [p for p in _leaf_paths() if p.rsplit(".", 1)[-1] == part]
      hint = f" (did you mean {' or '.join(f'`{c}`' for c in close)}?)" if close else ""
      raise ValueError(
        f"unknown config key `{path}`{hint}: `{walked or 'config'}` has no `{part}`; valid keys: {valid}"
      )
    hint, walked = hints[part], join_path(walked, part)
    if i == len(parts) - 1:
      return hint
    union = typing.get_origin(hint) in (types.UnionType, typing.Union)
    inner = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
    spec = [a for a in inner if dataclasses.is_dataclass(a)]
    maps = [a for a in inner if typing.get_origin(a) in (Mapping, dict, typing.Mapping)]
    if spec:
      cls = spec[0]
    elif maps and i == len(parts) - 2:
      return typing.get_args(maps[0])[1]
    else:
      raise ValueError(f"unknown config key `{path}`: `{walked}` is a value, not a section")
  raise AssertionError("unreachable")


def _leaf_paths(cls=None, prefix: str = "") -> list[str]:
  """Every dotted field path of the config (``rollout.group_size``, ``model.synthetic.num_layers``, ...)."""
  cls = TrainerConfig if cls is None else cls
  out = []
  for name, hint in typing.get_type_hints(cls).items():
    path = join_path(prefix, name)
    union = typing.get_origin(hint) in (types.UnionType, typing.Union)
    inner = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
    sub = [a for a in inner if dataclasses.is_dataclass(a)]
    out += _leaf_paths(sub[0], path) if sub else [path]
  if cls is GRPOConfig:
    out.append(join_path(prefix, "preset"))
  return out


#: the papers' symbols and abbreviations in key names → the words of the field names (error hints only)
_WORDS = {"epsilon": "clip_eps", "mu": "num_iterations", "lr": "learning_rate"}


def _unknown_key(key: str) -> ValueError:
  """The error for a key that is neither a section nor a dotted path, naming the dotted key(s) it most
  likely means: a field of that name (``group_size`` → ``rollout.group_size``), a section prefix
  (``eval_every`` → ``eval.every``), a field name it begins (``demo_sft_batch`` → ``...sft_batch_size``),
  the papers' symbols spelled out (``mu`` → ``objective.num_iterations``), else the closest spellings."""
  paths = _leaf_paths()
  leaf: dict[str, list[str]] = {}
  for path in paths:
    leaf.setdefault(path.rsplit(".", 1)[-1], []).append(path)

  def matches(name: str) -> list[str]:
    found = list(leaf.get(name, []))
    found += [f"{sec}.{name.removeprefix(sec + '_')}" for sec in SECTIONS if name.startswith(sec + "_")]
    found += [p for w in leaf if w.startswith(name + "_") for p in leaf[w]]
    return [p for p in found if p in paths]

  spelled = "_".join(_WORDS.get(w, w) for w in key.split("_"))
  close = []
  for name in (key, spelled, spelled.partition("_")[2]):
    close = close or (matches(name) if name else [])
  if not close:
    words = difflib.get_close_matches(key, list(leaf), n=3, cutoff=0.7)
    close = [p for w in words for p in leaf[w]] + difflib.get_close_matches(key, paths + list(SECTIONS), n=2)
  close = list(dict.fromkeys(close))[:4]
  if key == "resume":
    hint = " (resuming is a command-line choice: scripts/train.py --resume / --no-resume)"
  else:
    hint = f" (did you mean {' or '.join(f'`{c}`' for c in close)}?)" if close else ""
  return ValueError(
    f"unknown config key `{key}`{hint}: use a section ({', '.join(SECTIONS)}) or a dotted key such as "
    "`rollout.group_size`"
  )


def _check_key(key: str) -> str:
  """``key`` if it is a section or a dotted field path, else ValueError naming the likely dotted key."""
  if key in SECTIONS:
    return key
  if "." in key:
    field_type(key)
    return key
  raise _unknown_key(key)


def parse_override(key: str, text: str):
  """A command-line value for the dotted ``key``: the raw text for string fields (``null``: None),
  YAML otherwise (``1e-4`` → float, ``[1, 4]`` → list, ``{accuracy: 1.0}`` → dict; ``nan``, ``inf``,
  ``-inf`` → floats, refused later as non-finite)."""
  path = _check_key(key)
  hint = field_type(path) if path not in SECTIONS else dict
  args = set(typing.get_args(hint)) or {hint}
  if args <= {str, type(None)}:
    return None if text in ("null", "~") and type(None) in args else text
  if float in args and text.strip().lower() in NONFINITE:
    return NONFINITE[text.strip().lower()]
  value = parse_value(text)
  if path in SECTIONS and not isinstance(value, Mapping) and not (value is None and path in _OPTIONAL_SECTIONS):
    raise ValueError(
      f"--{path} sets a whole section: give a mapping such as '{{field: value}}' or a dotted key such as "
      f"--{path}.<field>; got {text!r}"
    )
  return value


def _assign(nested: dict, path: str, value) -> None:
  parts = path.split(".")
  node = nested
  for i, part in enumerate(parts[:-1]):
    child = node.get(part)
    if child is None:
      child = node[part] = {}
    elif not isinstance(child, dict):
      raise ValueError(f"cannot set `{path}`: `{'.'.join(parts[: i + 1])}` is {child!r}, not a section")
    node = child
  node[parts[-1]] = value


def _nest(d: Mapping[str, Any], where: str) -> dict:
  """A copy of a config mapping, checked to be sections (``model: {...}``, ``lora: null``)."""
  if not isinstance(d, Mapping):
    raise TypeError(f"{where}: a config must be a mapping of sections; got {type(d).__name__}")
  out: dict = {}
  for key, value in d.items():
    if not isinstance(key, str):
      raise TypeError(f"{where}: config keys must be strings; got {key!r}")
    if key not in SECTIONS:
      raise ValueError(f"{where}: {_unknown_key(key)}")
    if isinstance(value, Mapping):
      out[key] = copy.deepcopy(dict(value))
    elif key in _OPTIONAL_SECTIONS and value is None:  # e.g. `lora: null`: no adapters
      out[key] = None
    else:
      raise TypeError(f"{where}: config section `{key}` must be a mapping of fields; got {value!r}")
  return out


#: sections whose default is one of two exclusive sources, ``{section: (default source, sources)}``:
#: an override into such a section that the file does not give starts from the default source
_DEFAULT_SOURCE = {"model": ("synthetic", ("path", "synthetic")), "data": ("arithmetic", ("dataset", "arithmetic"))}


def _with_default_sources(nested: dict, overrides: Mapping[str, Any]) -> dict:
  """``nested`` with the default source (``model.synthetic``, ``data.arithmetic``) added to each section
  that neither the file nor the overrides give a source for, but that an override sets a field of:
  ``--data.max_prompt_tokens 64`` alone keeps the arithmetic task, ``--model.dtype bfloat16`` the
  synthetic model, as they would be without the override."""
  for section, (default, sources) in _DEFAULT_SOURCE.items():
    if section in nested:
      continue
    touched = [k for k in overrides if k == section or k.startswith(section + ".")]
    given = any(k == section or k.split(".")[1] in sources for k in touched)
    if touched and not given:
      nested[section] = {default: {}}
  return nested


def _cli_given(overrides: Mapping[str, Any], path: str) -> bool:
  return any(k == path or k.startswith(path + ".") for k in overrides)


def _missing_local(fixed: dict) -> list[str]:
  """``model.path`` / ``data.dataset`` of ``fixed`` that name a local path that does not exist (the CLI's rule)."""
  fields = (
    ("model.path", (fixed.get("model") or {}).get("path")),
    ("data.dataset", (fixed.get("data") or {}).get("dataset")),
  )
  return [
    f"and `{field}`: no such file or directory: {src}"
    for field, src in fields
    if isinstance(src, str) and looks_local(src) and not os.path.exists(os.path.expanduser(src))
  ]


def _check_sources(nested: dict, overrides: Mapping[str, Any]) -> None:
  """One error with the whole fix when a source given on the command line meets the file's other source
  (``--model.path DIR`` on a file with ``model.synthetic``; ``--data.dataset X`` on ``data.arithmetic``): the
  flags that null the other source, zero the synthetic model's warm-up when the model is no longer synthetic,
  and whatever else the config so fixed still gets wrong (a missing local path included) — instead of one
  error per try."""
  fixes: dict[str, Any] = {}
  said = []
  for section, (_, sources) in _DEFAULT_SOURCE.items():
    sec = nested.get(section)
    given = [s for s in sources if isinstance(sec, dict) and sec.get(s) is not None]
    cli = [s for s in given if _cli_given(overrides, f"{section}.{s}")]
    if len(given) == 2 and len(cli) == 1:
      other = next(s for s in given if s != cli[0])
      fixes[f"{section}.{other}"] = None
      said.append(f"`{section}.{cli[0]}` given on the command line and `{section}.{other}` in the file (one of them)")
  if not fixes:
    return
  fixed = copy.deepcopy(nested)
  for key, value in fixes.items():
    _assign(fixed, key, value)
  arith = (fixed.get("data") or {}).get("arithmetic")
  if (fixed.get("model") or {}).get("path") is not None and isinstance(arith, dict):
    if arith.get("sft_steps", ArithmeticTask().sft_steps):
      fixes["data.arithmetic.sft_steps"] = 0
      _assign(fixed, "data.arithmetic.sft_steps", 0)
      said.append("the warm-up (`data.arithmetic.sft_steps`) trains the synthetic model only")
  flags = " ".join(f"--{k} {'null' if v is None else v}" for k, v in fixes.items())
  rest = []
  try:
    build_spec(TrainerConfig, fixed, "")
  except (ValueError, TypeError) as e:
    rest.append(f"and then: {e}")
  rest += _missing_local(fixed)
  raise ValueError(f"{'; '.join(said)}: add {flags}" + "".join(f"; {r}" for r in rest))


# ----------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
  """YAML 1.1 with the YAML 1.2 float rule: ``1e-4`` and ``3E5`` are floats, not strings."""


_Loader.add_implicit_resolver(
  "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def parse_value(text: str):
  """A command-line value parsed as YAML (``1e-4`` → float, ``null`` → None, ``[1, 4]`` → list)."""
  try:
    return yaml.load(text, Loader=_Loader)
  except yaml.YAMLError as e:
    raise ValueError(f"cannot parse {text!r} as a YAML value: {e}") from None


def read_yaml(path: str) -> dict:
  """The mapping in a YAML file; a file that is not valid YAML or not a mapping gives one ValueError
  naming the file and the position."""
  try:
    with open(path) as f:
      d = yaml.load(f, Loader=_Loader)
  except OSError as e:
    raise ValueError(f"cannot read config file {path}: {e.strerror}") from None
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e)
    raise ValueError(f"config file {path} is not valid YAML{at}: {problem}") from None
  if d is None:
    return {}
  if not isinstance(d, dict):
    raise ValueError(f"config file {path} must hold a mapping of sections; got {type(d).__name__}")
  return d


def config_from_dict(d: Mapping[str, Any], *, where: str = "config") -> TrainerConfig:
  """A :class:`TrainerConfig` from its nested dict form (YAML, ``to_dict()``). Unknown keys are errors
  naming the valid ones (for a key of the earlier flat config: its dotted form)."""
  nested = _nest(d, where)
  import_run_modules(nested)
  return build_spec(TrainerConfig, nested, "")


def import_run_modules(nested: Mapping[str, Any]) -> None:
  """Imports the modules of ``run.imports`` (a list of dotted module names) before the config is built, so the
  names they register (a surrogate, a model family, an engine) are known to the checks of the other sections.

  Raises:
    TypeError: ``run.imports`` not a list of str (the field and the value named).
    ValueError: a module that cannot be imported (its index, its name and Python's reason).
  """
  run = nested.get("run")
  names = run.get("imports", ()) if isinstance(run, Mapping) else ()
  if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
    raise TypeError(f"config field `run.imports`: expected a list of module names (str); got {names!r}")
  for i, name in enumerate(names):
    try:
      importlib.import_module(name)
    except ImportError as e:
      raise ValueError(
        f"config field `run.imports[{i}]`: cannot import {name!r} ({e}); it must be importable from the Python "
        "path (installed, or on PYTHONPATH)"
      ) from None


def load_config(path: str | None, overrides: Mapping[str, Any] | None = None) -> TrainerConfig:
  """A YAML file (None: the defaults) with ``overrides`` on top: ``{dotted key or section: value}``,
  e.g. ``{"rollout.group_size": 8, "model.synthetic.hidden_size": 32, "objective.beta": 0.04}``.

  A section the file does not give keeps its default; an override of a field of the default model
  or data set keeps that source (``{"data.max_prompt_tokens": 64}`` alone: the arithmetic task with
  64 prompt tokens).

  Raises:
    ValueError: unreadable or malformed file (named), unknown keys, invalid or non-finite values.
    TypeError: a value of the wrong type (the field, the expected type and the value named).
  """
  where = f"config file {path}" if path else "config"
  overrides = {_check_key(k): v for k, v in (overrides or {}).items()}
  nested = _with_default_sources(_nest(read_yaml(path) if path else {}, where), overrides)
  for key, value in overrides.items():
    _assign(nested, key, copy.deepcopy(value))
  _check_sources(nested, overrides)
  import_run_modules(nested)
  return build_spec(TrainerConfig, nested, "")
