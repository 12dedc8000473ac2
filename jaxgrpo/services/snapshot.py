"""What one checkpoint step holds, and the checks a restore makes before it reads an array.

A service below the trainer, under :mod:`jaxgrpo.services.checkpointer` and :mod:`jaxgrpo.services.checkpoint`:
the :class:`Snapshot` (parameters, optimizer state, step, PRNG key, data position) and the :class:`RunMeta` its
caller states, the JSON ``meta`` item written beside the arrays (:func:`read_meta` reads it back), and the
comparisons of that item with the running side — tree signatures, run identity, fingerprints, guarded settings —
plus the finiteness check a save makes (:func:`first_nonfinite`, :class:`NonFiniteError`). Nothing here writes a
checkpoint; ``jaxgrpo.services.checkpoint`` re-exports every public name.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxgrpo.services.checkpoint_files import CheckpointError, recovery_hint, resolve_step

__all__ = ["FORMAT", "NonFiniteError", "RunMeta", "Snapshot", "first_nonfinite", "read_meta"]

#: Version of the ``meta`` item's layout. 2: the RunMeta (identity, guarded, config) of the caller.
FORMAT = 2


class NonFiniteError(FloatingPointError):
  """Training produced a NaN or an infinity. Raised instead of saving such a state, and by the
  trainer when a step's parameters, optimizer state or loss become non-finite.

  Attributes:
    step: the step at which the values were found.
    where: what was non-finite first (a metric name, or a parameter / optimizer-state path).
  """

  def __init__(self, message: str, *, step: int, where: str):
    super().__init__(message)
    self.step, self.where = step, where


class Snapshot(NamedTuple):
  """What a checkpoint holds: everything an exact resume needs.

  Attributes:
    params: the trained parameter tree (arrays; any sharding): every parameter, or only the
      adapters of a LoRA run (its frozen base weights are not saved: see ``RunMeta.fingerprints``).
    opt_state: the optimizer state tree.
    step: ``int32[]``, the number of completed steps.
    key: the PRNG key of the next step (typed key array).
    data_position: JSON-serialisable position of the data iterator.
  """

  params: Any
  opt_state: Any
  step: jax.Array
  key: jax.Array
  data_position: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class RunMeta:
  """What the caller says about its run; stored with every checkpoint and compared on restore.

  Every value must be JSON-serialisable. Nested mappings are compared leaf by leaf and named by
  dotted keys (``{"model": {"hidden_size": 64}}`` → ``model.hidden_size``).

  Attributes:
    identity: entries that change the parameter tree or the data order (model, dataset, seed, ...):
      a difference refuses the restore.
    guarded: entries a resumed run should not silently change (e.g. learning rate, group size): a
      difference refuses the restore unless the Checkpointer was built with ``allow_changed=True``.
    config: the whole configuration (nested dicts allowed), stored for rebuilding the model;
      differences in its leaves are reported.
    fingerprints: ``{name: digest}`` of inputs the checkpoint depends on but does not hold (e.g.
      ``"base_weights"``: a LoRA run's frozen base weights, ``jaxgrpo.models.lora.base_fingerprint``).
      Every entry the running side states must equal the saved one, else the restore is refused
      showing both digests; an entry only the checkpoint has is not compared (a caller that cannot
      compute it yet, e.g. before building the model, leaves it out).
  """

  identity: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  guarded: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  fingerprints: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _json(x):
  """``x`` as it reads back from JSON (tuples → lists, ...), for comparisons with saved values."""
  return json.loads(json.dumps(x))


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    key = f"{prefix}.{k}" if prefix else str(k)
    if isinstance(v, Mapping) and v:
      out.update(_flatten(v, key))
    else:
      out[key] = v
  return out


_ABSENT = object()


def _differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
  """``"key: saved in the checkpoint, current now"`` for every leaf whose values differ (or that is
  absent on one side); nested mappings are compared leaf by leaf, named by dotted keys."""
  saved, current = _flatten(saved), _flatten(_json(dict(current)))
  out = []
  show = lambda v: "absent" if v is _ABSENT else repr(v)
  for k in sorted(set(saved) | set(current)):
    a, b = saved.get(k, _ABSENT), current.get(k, _ABSENT)
    if a != b:
      out.append(f"{k}: {show(a)} in the checkpoint, {show(b)} now")
  return out


# ----------------------------------------------------------------------------- tree checks


@jax.jit
def _finite_leaves(leaves):
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def first_nonfinite(tree, prefix: str = "") -> str | None:
  """The path (``prefix`` + ``jax.tree_util.keystr``) of the first floating-point leaf of ``tree``
  holding a NaN or an infinity, or None when every value is finite.

  One jitted reduction over the whole tree (every leaf read once, on its devices; works on
  sharded and multi-host arrays); integer and PRNG-key leaves are skipped.
  """
  flat = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if jnp.issubdtype(x.dtype, jnp.inexact)]
  if not flat:
    return None
  ok = np.asarray(jax.device_get(_finite_leaves([x for _, x in flat])))
  bad = np.flatnonzero(~ok)
  return f"{prefix}{jax.tree_util.keystr(flat[bad[0]][0])}" if bad.size else None


def nonfinite_state(snapshot: Snapshot) -> str | None:
  return first_nonfinite(snapshot.params, "params") or first_nonfinite(snapshot.opt_state, "opt_state")


def abstract_tree(tree):
  """ShapeDtypeStructs with the shardings of ``tree`` (arrays or ShapeDtypeStructs)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def tree_signature(tree) -> dict[str, tuple[list[int], str]]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p): (list(x.shape), str(np.dtype(x.dtype))) for p, x in flat}


def compare_signatures(
  saved: Mapping[str, Any], current: Mapping[str, Any], what: str, *, check_dtype: bool = True
) -> list[str]:
  problems = []
  for k in sorted(set(saved) - set(current)):
    problems.append(f"{what}{k}: in the checkpoint, not in the running model")
  for k in sorted(set(current) - set(saved)):
    problems.append(f"{what}{k}: in the running model, not in the checkpoint")
  for k in sorted(set(saved) & set(current)):
    (s_shape, s_dtype), (c_shape, c_dtype) = saved[k], current[k]
    if list(s_shape) != list(c_shape):
      problems.append(f"{what}{k}: shape {tuple(s_shape)} in the checkpoint, {tuple(c_shape)} in the model")
    elif check_dtype and s_dtype != c_dtype:
      problems.append(f"{what}{k}: dtype {s_dtype} in the checkpoint, {c_dtype} in the model")
  return problems


def checkpoint_handlers():
  return {
    "params": ocp.StandardCheckpointHandler(),
    "opt_state": ocp.StandardCheckpointHandler(),
    "meta": ocp.JsonCheckpointHandler(),
  }


# ----------------------------------------------------------------------------- the meta item


def meta_item(step: int, snapshot: Snapshot, run: RunMeta, metrics: Mapping[str, float] | None) -> dict:
  """The JSON ``meta`` item saved with ``snapshot`` at ``step`` (see :func:`read_meta` for its keys)."""
  key = snapshot.key
  return {
    "format": FORMAT,
    "step": step,
    "key_data": np.asarray(jax.random.key_data(key)).astype(np.uint32).tolist(),
    "key_impl": str(jax.random.key_impl(key)),
    "data_position": dict(snapshot.data_position),
    "identity": dict(run.identity),
    "guarded": dict(run.guarded),
    "config": dict(run.config),
    "fingerprints": dict(run.fingerprints),
    "params_signature": tree_signature(snapshot.params),
    "opt_state_signature": tree_signature(snapshot.opt_state),
    "process_count": jax.process_count(),
    "metrics": dict(metrics) if metrics else None,
  }


def check_meta(where: str, meta: dict, template: Snapshot | None, run: RunMeta, *, allow_changed: bool) -> list[str]:
  """Compares the saved ``meta`` of the step directory ``where`` with the running side, before any array is read:
  the format, the tree signatures of ``template`` (None: not compared), ``run.identity``, ``run.fingerprints``
  and ``run.guarded``. Returns the guarded differences that ``allow_changed`` lets through (to be logged).

  Raises:
    CheckpointError: another meta format, other trees or identity, other fingerprints, or changed guarded
      settings without ``allow_changed`` (each names the entries).
  """
  if meta.get("format") != FORMAT:
    raise CheckpointError(
      f"checkpoint {where} has meta format {meta.get('format', 1)}, this jaxgrpo reads format {FORMAT} "
      "(format 1 held the earlier flat TrainerConfig): resume it with the jaxgrpo version that wrote it, "
      "or start a new run in another directory"
    )
  problems = []
  if template is not None:
    problems += compare_signatures(meta["params_signature"], tree_signature(template.params), "params")
    problems += compare_signatures(meta["opt_state_signature"], tree_signature(template.opt_state), "opt_state")
  identity = _differences(meta["identity"], run.identity)
  if problems or identity:
    shown = identity + problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
    raise CheckpointError(
      f"checkpoint {where} does not match the running model/config:\n  "
      + "\n  ".join(shown)
      + "\nNothing was overwritten; use another output directory or matching settings."
    )
  check_fingerprints(where, meta, run.fingerprints)
  guarded = _differences(meta["guarded"], run.guarded)
  if guarded and not allow_changed:
    raise CheckpointError(
      f"checkpoint {where} was written with other settings:\n  "
      + "\n  ".join(guarded)
      + "\nA resumed run would silently change them. Restore the checkpoint's values, or allow the change "
      "explicitly (Checkpointer(allow_changed=True); scripts/train.py --allow-changed-config)."
    )
  return guarded


def changed_config(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
  """``"key: saved -> current"`` for every leaf of the saved config whose running value differs (a leaf only one
  side has is not listed)."""
  saved_cfg, cur_cfg = _flatten(saved), _flatten(_json(dict(current)))
  return [f"{k}: {v!r} -> {cur_cfg[k]!r}" for k, v in sorted(saved_cfg.items()) if k in cur_cfg and cur_cfg[k] != v]


def check_fingerprints(where: str, meta: Mapping[str, Any], fingerprints: Mapping[str, str]) -> None:
  """CheckpointError unless every stated fingerprint equals the saved one (both digests shown)."""
  saved = meta.get("fingerprints") or {}
  differ = [k for k in sorted(fingerprints) if saved.get(k) != fingerprints[k]]
  if differ:
    lines = [f"{k}: {saved.get(k, 'absent')} in the checkpoint, {fingerprints[k]} now" for k in differ]
    raise CheckpointError(
      f"checkpoint {where} was saved for other inputs than this run's:\n  "
      + "\n  ".join(lines)
      + "\nIts state is only valid on the inputs it was trained with (e.g. adapters on their own base "
      "weights): load the same base model, or use another output directory. Nothing was overwritten."
    )


def read_meta(path: str, *, step: int | None = None) -> dict:
  """The JSON ``meta`` item of a checkpoint: ``{"format", "step", "key_data", "key_impl",
  "data_position", "identity", "guarded", "config", "fingerprints", "params_signature",
  "opt_state_signature", "process_count", "metrics"}`` (``fingerprints`` may be absent: older saves).

  Args:
    path: a run directory, a checkpoint root or a step directory.
    step: None: the step named by ``path``, else the latest complete one.
  Raises:
    CheckpointError: no complete checkpoint, or an unreadable meta item.
  """
  root, step = resolve_step(path, step)
  file = os.path.join(root, str(step), "meta", "metadata")
  try:
    with open(file) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(
      f"checkpoint {os.path.join(root, str(step))}: unreadable meta item ({e}). {recovery_hint(root, step)}"
    ) from e
