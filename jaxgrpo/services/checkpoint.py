"""Checkpoints of a training state that resume exactly and survive crashes.

A service below the trainer: :class:`Checkpointer` saves a :class:`Snapshot` (parameters, optimizer
state, step, PRNG key, data position) with a :class:`RunMeta` (what the caller says identifies its
run) through Orbax, and restores it onto the running mesh; :func:`restore_params` and
:func:`read_meta` read parameters only (evaluation, export, ``jaxgrpo.run.builders.load_policy``). It
imports nothing of the layers above. The step directories on disk — layout, manifest, verification,
quarantine — are ``jaxgrpo.services.checkpoint_files`` (re-exported here); the noise filters for a failed save
are ``jaxgrpo.services._orbax_noise``, installed by ``scripts/train.py``.

Contract: a step is on disk completely or not at all (Orbax's rename, then a CRC32 manifest checked on
restore: :class:`CheckpointError` naming the file); a corrupt latest step is quarantined (renamed,
never deleted) or stops the run (``on_corrupt``); a non-finite state is never saved
(:class:`NonFiniteError`); a failed save is reported at once, its partial step removed, older steps
deleted only after a newer save completed (:class:`CheckpointSaveError` with ``on_save_error="stop"``);
before any array is read, the saved trees, ``RunMeta.identity`` and ``RunMeta.fingerprints`` must
match the running side, and a changed ``RunMeta.guarded`` entry is refused unless ``allow_changed``.
docs/checkpoints.md ("Crash safety", "Multi-host") and docs/failure_modes.md give the details.

One job at ~880 lines: Orbax save and restore of one run's state with the checks that make a resume
exact (tree signatures, run identity, finiteness, failed-save bookkeeping); they share the manager,
its background save and the meta item, so they stay together.

Usage (what ``scripts/train.py`` does)::

    ckpt = Checkpointer(checkpoint_dir(out), max_to_keep=3, best_metric="eval_accuracy")
    trainer = Trainer(cfg, checkpoint_fn=ckpt.checkpoint_fn, restore_fn=ckpt.restore_fn,
                      on_record=ckpt.observe)
    trainer.run(); ckpt.close()
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import threading
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from jaxgrpo.services import _orbax_noise
from jaxgrpo.services._orbax_noise import ClosedLoopNoiseFilter
from jaxgrpo.services.checkpoint_files import (
  MANIFEST,
  TMP_SUFFIX,
  CheckpointError,
  _resolve_step,
  _step_dirs,
  _write_manifest,
  checkpoint_dir,
  checkpoint_root,
  complete_steps,
  has_checkpoint,
  quarantine_incomplete_steps,
  quarantine_step,
  recovery_hint,
  verify_step,
)

__all__ = [
  "Checkpointer",
  "ClosedLoopNoiseFilter",
  "CheckpointError",
  "CheckpointSaveError",
  "NonFiniteError",
  "first_nonfinite",
  "quarantine_incomplete_steps",
  "quarantine_step",
  "Snapshot",
  "RunMeta",
  "checkpoint_dir",
  "has_checkpoint",
  "checkpoint_root",
  "complete_steps",
  "verify_step",
  "read_meta",
  "restore_params",
  "MANIFEST",
  "FORMAT",
]

#: ``Checkpointer(on_corrupt=...)``: what a corrupt latest step does when the run looks for its resume point
ON_CORRUPT = ("quarantine", "stop")
#: Version of the ``meta`` item's layout. 2: the RunMeta (identity, guarded, config) of the caller.
FORMAT = 2


class CheckpointSaveError(CheckpointError):
  """A save that failed (disk full, an I/O error, ...). The message names the step, the path and
  the OS error; the partial step was removed and the earlier checkpoints are kept.

  Attributes:
    step: the step whose save failed.
    path: the step directory it was written to.
    reason: the OS error, e.g. ``"ENOSPC (No space left on device)"``, or the library's message.
    last_complete: the latest complete step on disk after the failure (None: none).
  """

  def __init__(self, message: str, *, step: int, path: str, reason: str, last_complete: int | None):
    super().__init__(message)
    self.step, self.path, self.reason, self.last_complete = step, path, reason, last_complete


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


def _nonfinite_state(snapshot: Snapshot) -> str | None:
  return first_nonfinite(snapshot.params, "params") or first_nonfinite(snapshot.opt_state, "opt_state")


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _os_reason(exc: BaseException) -> str:
  """The OS error behind ``exc`` (its cause/context chain, or TensorStore's ``os_error_code``), e.g.
  ``"ENOSPC (No space left on device)"``; otherwise the exception's first line."""
  seen, e = set(), exc
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    code = e.errno if isinstance(e, OSError) and e.errno else None
    if code is None and (m := _OS_ERROR_CODE.search(str(e))):
      code = int(m.group(1))
    if code is not None:
      return f"{errno.errorcode.get(code, f'errno {code}')} ({os.strerror(code)})"
    e = e.__cause__ or e.__context__
  first = (str(exc).strip().splitlines() or [""])[0]
  return f"{type(exc).__name__}: {first[:300]}"


def _abstract(tree):
  """ShapeDtypeStructs with the shardings of ``tree`` (arrays or ShapeDtypeStructs)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def _signature(tree) -> dict[str, tuple[list[int], str]]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p): (list(x.shape), str(np.dtype(x.dtype))) for p, x in flat}


def _compare_signatures(
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


def _handlers():
  return {
    "params": ocp.StandardCheckpointHandler(),
    "opt_state": ocp.StandardCheckpointHandler(),
    "meta": ocp.JsonCheckpointHandler(),
  }


# ----------------------------------------------------------------------------- the manager


@dataclasses.dataclass
class _KeepBest:
  """Orbax preservation policy: keeps the checkpoint with the best finite ``metric_of(step)``
  (``mode`` ``max`` or ``min``; on a tie the latest), whatever its age. Steps without a value are
  left to the other policies (keep-last-K)."""

  metric_of: Callable[[int], float | None]
  mode: str = "max"

  def should_preserve(self, checkpoints, *, context=None) -> list[bool]:
    sign = 1.0 if self.mode == "max" else -1.0
    scored = [
      (sign * v, c.step, i)
      for i, c in enumerate(checkpoints)
      if (v := self.metric_of(c.step)) is not None and np.isfinite(v)
    ]
    best = max(scored)[2] if scored else None
    return [i == best for i in range(len(checkpoints))]


class Checkpointer:
  """Saves and restores :class:`Snapshot` s with their :class:`RunMeta`, with Orbax.

  Args:
    directory: checkpoint root (``checkpoint_dir(cfg.out)``).
    max_to_keep: K most recent complete checkpoints kept (None: all). Older ones are deleted only
      after a newer save completed.
    best_metric: a metric name (e.g. ``eval_accuracy``) seen through :meth:`observe`; the best
      checkpoint by it is kept as well as the last K, also across restarts (the value is saved in
      the step's meta item and read back), so a collapse that keeps the parameters finite cannot
      rotate the best checkpoint away. Only steps with a value compete. None: recency only.
    best_mode: ``max`` or ``min``.
    async_save: write in a background thread; ``save`` returns once the arrays are copied to the
      host, so the next step (which donates the state) can start. The next save, :meth:`wait`
      and :meth:`close` wait for it. False: ``save`` returns when the step is on disk.
    checksum: record and verify CRC32 per file (sizes are always checked). Verification reads the
      whole checkpoint on every host: turn it off for very large multi-host checkpoints.
    log: message sink (None: silent); only the first host prints. Called from a background thread
      when a background save fails.
    allow_changed: restore even when a ``RunMeta.guarded`` entry differs (the differences are logged).
    on_save_error: what a failed save (disk full, an I/O error) does after it was reported:
      ``"stop"`` — the next :meth:`observe`, :meth:`save`, :meth:`wait` or :meth:`close` raises
      :class:`CheckpointSaveError`; ``"continue"`` — nothing more (the failures are listed in
      ``failed_saves``). Either way the partial step is removed and the earlier checkpoints are kept.
    check_finite: refuse to save parameters or optimizer state holding a NaN or an infinity
      (:class:`NonFiniteError`); one reduction over the state per save.
    on_corrupt: a corrupt latest step met while looking for the step to resume from
      (:meth:`check_run`, :meth:`restore` without a step): ``"quarantine"`` renames it to
      ``<step>.corrupt-<UTC time>`` (logged as a ``WARNING:``) and takes the previous complete step;
      ``"stop"`` raises :class:`CheckpointError` naming the file and the recovery.
  """

  def __init__(
    self,
    directory: str,
    *,
    max_to_keep: int | None = 3,
    best_metric: str | None = None,
    best_mode: str = "max",
    async_save: bool = True,
    checksum: bool = True,
    log: Callable[[str], None] | None = print,
    allow_changed: bool = False,
    on_save_error: str = "stop",
    check_finite: bool = True,
    on_corrupt: str = "quarantine",
  ):
    if on_corrupt not in ON_CORRUPT:
      raise ValueError(f"`on_corrupt` must be one of {ON_CORRUPT}; got {on_corrupt!r}")
    if best_mode not in ("max", "min"):
      raise ValueError(f"`best_mode` must be 'max' or 'min'; got {best_mode!r}")
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
      raise ValueError(f"`max_to_keep` must be a positive int or None; got {max_to_keep!r}")
    if on_save_error not in ("stop", "continue"):
      raise ValueError(f"`on_save_error` must be 'stop' or 'continue'; got {on_save_error!r}")
    self.directory = os.path.abspath(os.fspath(directory))
    self.best_metric, self.best_mode, self.checksum = best_metric, best_mode, checksum
    self.async_save, self.allow_changed = async_save, allow_changed
    self.on_save_error, self.check_finite, self.on_corrupt = on_save_error, check_finite, on_corrupt
    self._verified: set[int] = set()  # steps checked against their manifest by this Checkpointer
    self._is_main = jax.process_index() == 0
    self.log = log if log is not None and self._is_main else (lambda s: None)
    self._metrics: dict[int, float] = {}
    self._saving_step: int | None = None
    self._watcher: threading.Thread | None = None
    self._failure: CheckpointSaveError | None = None  # reported, not raised yet ("stop")
    self.failed_saves: list[CheckpointSaveError] = []
    self._closed = False
    self._reload_needed = False
    self._partial_steps: set[int] = set()  # failed saves whose temporary directories are removed
    # a step without a manifest would make the resumed run's save of that step fail at every restart
    if self._is_main:
      quarantine_incomplete_steps(self.directory, log=self.log)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("jaxgrpo.services.checkpoint: incomplete steps moved aside")
    # report interrupted saves before Orbax removes their temporary directories
    complete_steps(self.directory, log=self.log)
    policies = [ocp.checkpoint_managers.LatestN(n=max_to_keep)]
    if best_metric is not None:
      policies.append(_KeepBest(self._metric_of, best_mode))
    self._saved_metrics: dict[int, float | None] = {}  # read from the steps' meta items
    # foreground saves use the same asynchronous path and wait: the manifest is then always
    # written before Orbax's rename, so no kill can leave a renamed step without it
    options = ocp.CheckpointManagerOptions(
      enable_async_checkpointing=True,
      cleanup_tmp_directories=True,
      create=True,
      preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
      async_options=ocp.AsyncOptions(post_finalization_callback=self._finalized),
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())

  def _metric_of(self, step: int) -> float | None:
    """``best_metric`` of a saved step: observed by this Checkpointer, else the value saved in the
    step's meta item (written by an earlier run: Orbax keeps metrics in memory only, so without this
    a restarted run would rotate the best checkpoint away)."""
    if step in self._metrics:
      return self._metrics[step]
    if step not in self._saved_metrics:
      try:
        with open(os.path.join(self.directory, str(step), "meta", "metadata")) as f:
          value = (json.load(f).get("metrics") or {}).get(self.best_metric)
      except (OSError, ValueError):
        value = None
      self._saved_metrics[step] = None if value is None else float(value)
    return self._saved_metrics[step]

  # ------------------------------------------------------------------ saving
  def _finalized(self) -> None:
    """Orbax callback after a save is finalized: manifest into the step directory (before the rename)."""
    step = self._saving_step
    if step is None or not self._is_main:
      return
    tmp = os.path.join(self.directory, f"{step}{TMP_SUFFIX}")
    target = tmp if os.path.isdir(tmp) else os.path.join(self.directory, str(step))
    _write_manifest(target, step, self.checksum)

  def observe(self, record: Mapping[str, Any]) -> None:
    """Feeds a metrics record (``{"step": s, ...}``); ``best_metric`` values are kept for the save of s.

    Called by the trainer after every step, it is also where a failed background save stops the
    run (``on_save_error="stop"``): it raises the :class:`CheckpointSaveError` reported earlier.
    """
    self.check()
    if self.best_metric is not None and self.best_metric in record:
      self._metrics[int(record["step"])] = float(record[self.best_metric])

  def check(self) -> None:
    """Raises the first failed save that has not been raised yet (``on_save_error="stop"``)."""
    failure, self._failure = self._failure, None
    if failure is not None:
      raise failure

  def save(self, snapshot: Snapshot, run: RunMeta | None = None, *, metrics: Mapping[str, float] | None = None) -> int:
    """Saves ``snapshot`` and ``run`` at ``snapshot.step``; returns the step.

    With ``async_save`` it returns once the arrays are copied to the host (they may be donated
    right after); the files are written in the background. It first waits for the previous save.

    Raises:
      NonFiniteError: the parameters or the optimizer state hold a NaN or an infinity (with
        ``check_finite``); nothing is written.
      CheckpointSaveError: a failed save, this one (foreground) or an earlier one, with
        ``on_save_error="stop"``.
    """
    step = int(jax.device_get(snapshot.step))
    where = _nonfinite_state(snapshot) if self.check_finite else None
    if where is not None:
      raise NonFiniteError(
        f"refusing to save step {step}: {where} holds NaN or infinite values; nothing was written and the "
        f"earlier checkpoints in {self.directory} are kept",
        step=step,
        where=where,
      )
    self._settle()  # one save at a time: the manifest callback must see the step it belongs to
    run = run or RunMeta()
    if metrics is None and step in self._metrics:
      metrics = {self.best_metric: self._metrics[step]}
    key = snapshot.key
    meta = {
      "format": FORMAT,
      "step": step,
      "key_data": np.asarray(jax.random.key_data(key)).astype(np.uint32).tolist(),
      "key_impl": str(jax.random.key_impl(key)),
      "data_position": dict(snapshot.data_position),
      "identity": dict(run.identity),
      "guarded": dict(run.guarded),
      "config": dict(run.config),
      "fingerprints": dict(run.fingerprints),
      "params_signature": _signature(snapshot.params),
      "opt_state_signature": _signature(snapshot.opt_state),
      "process_count": jax.process_count(),
      "metrics": dict(metrics) if metrics else None,
    }
    self._saving_step = step
    self._saved_metrics.pop(step, None)
    try:
      self.manager.save(
        step,
        args=ocp.args.Composite(
          params=ocp.args.StandardSave(snapshot.params),
          opt_state=ocp.args.StandardSave(snapshot.opt_state),
          meta=ocp.args.JsonSave(meta),
        ),
        metrics=dict(metrics) if metrics else None,
        force=True,
      )
    except Exception as e:  # noqa: BLE001 - reported with the step, the path and the OS error
      self._failed(step, e)
      self._resync()
    else:
      self._watch(step)
    if not self.async_save:
      self._settle()
    self.check()
    return step

  def _watch(self, step: int) -> None:
    """A thread that waits for the background write of ``step`` and reports a failure at once."""

    def wait():
      try:
        self.manager.wait_until_finished()
      except Exception as e:  # noqa: BLE001 - reported with the step, the path and the OS error
        self._failed(step, e)

    self._watcher = threading.Thread(target=wait, name=f"jaxgrpo-checkpoint-{step}", daemon=True)
    self._watcher.start()

  def _settle(self) -> None:
    """Waits for the save in flight (if any) and its watcher; raises a reported failure ("stop")."""
    if self._watcher is not None:
      self._watcher.join()
      self._watcher = None
      try:  # Orbax raises a failed save once per calling thread: the watcher reported it, this consumes it
        self.manager.wait_until_finished()
      except Exception as e:  # noqa: BLE001
        if not any(f.step == self._saving_step for f in self.failed_saves):
          self._failed(self._saving_step, e)
    self._resync()
    self.check()

  def _resync(self) -> None:
    """After a failed save: Orbax dropped the steps that save was to replace from its list before
    the write (they are still on disk); re-read the list, or they would never be deleted. Writes
    of the failed save that were still running when it was reported may have recreated parts of
    its temporary directory: remove them again."""
    if self._reload_needed:
      self._reload_needed = False
      self.manager.reload()
    for step in self._partial_steps:
      self._remove_partial(step)

  def _remove_partial(self, step: int) -> None:
    """Removes what a failed save of ``step`` left (its temporary directories; a final directory
    without a manifest is moved aside). First host only."""
    if not self._is_main:
      return
    _, tmps = _step_dirs(self.directory)
    for t in tmps:
      if os.path.basename(t).startswith(f"{step}{TMP_SUFFIX}"):
        shutil.rmtree(t, ignore_errors=True)
    final = os.path.join(self.directory, str(step))
    if os.path.isdir(final) and not os.path.exists(os.path.join(final, MANIFEST)):
      quarantine_incomplete_steps(self.directory, log=self.log)

  def _failed(self, step: int, exc: BaseException) -> None:
    """Records, reports (through ``log``, at once) and cleans up a failed save of ``step``."""
    path = os.path.join(self.directory, str(step))
    reason = _os_reason(exc)
    completed = os.path.exists(os.path.join(path, MANIFEST))
    if not completed:
      self._partial_steps.add(step)
      self._remove_partial(step)
    last = self.latest_step()
    kept = (
      f"the last complete checkpoint is step {last} ({os.path.join(self.directory, str(last))})"
      if last is not None
      else "there is no complete checkpoint yet"
    )
    if completed:
      what = f"checkpoint step {step} was written to {path}, but finishing the save failed: {reason}; {kept}."
    else:
      what = (
        f"checkpoint save of step {step} failed: {reason} while writing {path}. The partial step was removed; {kept}."
      )

    if self.on_save_error == "stop":
      resume = f"resume from step {last}" if last is not None else "start again"
      what += (
        f" Training stops: free space or fix the file system, then run the same command again to {resume}; "
        "to keep training when a save fails, pass --on-save-error continue (Checkpointer(on_save_error='continue'))."
      )
    else:
      what += " Training continues (on_save_error 'continue'); the next save will try again."
    err = CheckpointSaveError(what, step=step, path=path, reason=reason, last_complete=last)
    err.__cause__ = exc
    self._reload_needed = True
    self.failed_saves.append(err)
    if self.on_save_error == "stop" and self._failure is None:
      self._failure = err
    self.log(f"error: {what}")

  def checkpoint_fn(self, snapshot: Snapshot, run: RunMeta | None = None) -> None:
    """The trainer's ``checkpoint_fn(snapshot, run)`` hook: :meth:`save` and a log line."""
    step = self.save(snapshot, run)
    self.log(
      f"checkpoint: step {step} -> {os.path.join(self.directory, str(step))}"
      + (" (writing in the background)" if self.async_save else "")
    )

  def wait(self) -> None:
    """Blocks until the running save (if any) is on disk; raises its failure with ``on_save_error="stop"``."""
    self._settle()

  def close(self) -> None:
    """Waits for the running save, then releases the manager (also when the save failed, which it
    then raises with ``on_save_error="stop"``). A second call does nothing."""
    if self._closed:
      return
    self._closed = True
    try:
      self._settle()
    finally:
      try:
        self.manager.close()
      except Exception:  # noqa: BLE001 - a failed save was reported by _settle
        if not self.failed_saves:
          raise
      for step in self._partial_steps:
        self._remove_partial(step)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # ------------------------------------------------------------------ restoring
  def steps(self) -> list[int]:
    """Complete steps on disk, ascending (see :func:`complete_steps`)."""
    return complete_steps(self.directory, log=None)

  def latest_step(self) -> int | None:
    """The latest complete step, or None."""
    s = self.steps()
    return s[-1] if s else None

  def read_meta(self, step: int) -> dict:
    """The JSON ``meta`` item of ``step`` (step, key, data position, run meta, tree signatures)."""
    return read_meta(self.directory, step=step)

  def check_run(self, run: RunMeta, *, step: int | None = None) -> int | None:
    """Compares ``run`` with the meta of ``step`` (None: the latest complete checkpoint) without
    reading any array: the same identity and guarded-settings checks as :meth:`restore`, cheap
    enough to run before the model is built. Returns the step, or None when there is no checkpoint.

    Raises:
      CheckpointError: another meta format, a different identity, or changed guarded settings
        (unless ``allow_changed``).
    """
    if step is None:
      step = self.resume_step()
      if step is None:
        return None
    self._check(step, self.read_meta(step), None, run, report=False)
    return step

  def resume_step(self) -> int | None:
    """The latest complete step whose files match its manifest (None: none), after dealing with
    corrupt later ones by ``on_corrupt`` (see the module docstring). Each step is verified once.

    Raises:
      CheckpointError: (``on_corrupt="stop"``) the latest step is corrupt; names the file and the recovery.
    """
    for step in reversed(self.steps()):
      if step in self._verified:
        return step
      path = os.path.join(self.directory, str(step))
      try:
        verify_step(path, checksum=self.checksum)
        read_meta(path)
      except CheckpointError as e:
        if self.on_corrupt == "stop":  # one line: the file, then the recovery
          raise CheckpointError(
            f"{' '.join(str(e).split())}. {recovery_hint(self.directory, step)} (this run was started with "
            "on_corrupt 'stop', scripts/train.py --on-corrupt stop)"
          ) from None
        self._quarantine(step, e)
        continue
      self._verified.add(step)
      return step
    return None

  def _quarantine(self, step: int, error: CheckpointError) -> None:
    """Moves the corrupt ``step`` aside (first host; every host waits) and says so loudly."""
    path = os.path.join(self.directory, str(step))
    target = quarantine_step(self.directory, step) if self._is_main else f"{path}.corrupt-*"
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxgrpo.services.checkpoint: corrupt step {step} moved aside")
    self.manager.reload()  # Orbax must forget the step, or it would refuse to save it again
    earlier = [s for s in self.steps() if s < step]
    then = f"resuming from the previous complete step {earlier[-1]}" if earlier else "no earlier complete step"
    reason = " ".join(str(error).split())
    self.log(
      f"WARNING: checkpoint {path} is corrupt ({reason}); moved aside to {target} (kept, not deleted); {then}. "
      "To stop instead, pass --on-corrupt stop (Checkpointer(on_corrupt='stop'))."
    )

  def _check(self, step: int, meta: dict, template: Snapshot | None, run: RunMeta, *, report: bool = True) -> None:
    where = os.path.join(self.directory, str(step))
    if meta.get("format") != FORMAT:
      raise CheckpointError(
        f"checkpoint {where} has meta format {meta.get('format', 1)}, this jaxgrpo reads format {FORMAT} "
        "(format 1 held the earlier flat TrainerConfig): resume it with the jaxgrpo version that wrote it, "
        "or start a new run in another directory"
      )
    problems = []
    if template is not None:
      problems += _compare_signatures(meta["params_signature"], _signature(template.params), "params")
      problems += _compare_signatures(meta["opt_state_signature"], _signature(template.opt_state), "opt_state")
    identity = _differences(meta["identity"], run.identity)
    if problems or identity:
      shown = identity + problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
      raise CheckpointError(
        f"checkpoint {where} does not match the running model/config:\n  "
        + "\n  ".join(shown)
        + "\nNothing was overwritten; use another output directory or matching settings."
      )
    _check_fingerprints(where, meta, run.fingerprints)
    guarded = _differences(meta["guarded"], run.guarded)
    if guarded and not self.allow_changed:
      raise CheckpointError(
        f"checkpoint {where} was written with other settings:\n  "
        + "\n  ".join(guarded)
        + "\nA resumed run would silently change them. Restore the checkpoint's values, or allow the change "
        "explicitly (Checkpointer(allow_changed=True); scripts/train.py --allow-changed-config)."
      )
    if not report:
      return
    if guarded:
      self.log("resuming with changed settings (allowed): " + "; ".join(guarded))
    saved_cfg, cur_cfg = _flatten(meta["config"]), _flatten(_json(dict(run.config)))
    changed = [
      f"{k}: {v!r} -> {cur_cfg[k]!r}" for k, v in sorted(saved_cfg.items()) if k in cur_cfg and cur_cfg[k] != v
    ]
    if changed:
      self.log("resuming with changed settings: " + ", ".join(changed))

  def restore(self, template: Snapshot, run: RunMeta | None = None, *, step: int | None = None) -> Snapshot:
    """The snapshot saved at ``step`` (None: the latest complete one), placed like ``template``.

    Args:
      template: a snapshot of the running program (its arrays give shapes, dtypes and the target
        shardings: restoring onto a different mesh works; its values are not used).
      run: the running run's meta, compared with the saved one (see the module docstring).
      step: the step to restore (None: the latest complete one).
    Raises:
      CheckpointError: no complete checkpoint, a corrupt one (names the file), one that does not
        match the model or the run's identity, or changed guarded settings (names the entries).
        Nothing on disk is modified, except that without ``step`` a corrupt latest step is moved
        aside first under ``on_corrupt="quarantine"`` (:meth:`resume_step`).
    """
    run = run or RunMeta()
    if step is None:
      step = self.resume_step()
      if step is None:
        raise CheckpointError(f"no complete checkpoint in {self.directory}")
    elif step not in (steps := self.steps()):
      raise CheckpointError(f"step {step} is not a complete checkpoint in {self.directory}; complete steps: {steps}")
    path = os.path.join(self.directory, str(step))
    if step not in self._verified:
      try:
        verify_step(path, checksum=self.checksum)
      except CheckpointError as e:
        raise CheckpointError(f"{e}\n{recovery_hint(self.directory, step)}") from None
      self._verified.add(step)
    meta = self.read_meta(step)
    self._check(step, meta, template, run)
    restored = self.manager.restore(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(_abstract(template.params)),
        opt_state=ocp.args.StandardRestore(_abstract(template.opt_state)),
      ),
    )
    key = jax.random.wrap_key_data(np.asarray(meta["key_data"], np.uint32), impl=meta["key_impl"])
    step_arr = jax.device_put(jnp.asarray(meta["step"], template.step.dtype), template.step.sharding)
    self.log(f"resumed from checkpoint {path} (step {meta['step']})")
    return Snapshot(restored["params"], restored["opt_state"], step_arr, key, dict(meta["data_position"]))

  def restore_fn(self, run: RunMeta | None, template: Snapshot) -> Snapshot | None:
    """The trainer's ``restore_fn(run, template)`` hook: the latest complete snapshot, or None when
    there is no checkpoint yet (a fresh start)."""
    if self.resume_step() is None:
      self.log(f"no complete checkpoint in {self.directory}: starting from step 0")
      return None
    return self.restore(template, run)


def _check_fingerprints(where: str, meta: Mapping[str, Any], fingerprints: Mapping[str, str]) -> None:
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


# ----------------------------------------------------------------------------- parameters only


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
  root, step = _resolve_step(path, step)
  file = os.path.join(root, str(step), "meta", "metadata")
  try:
    with open(file) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(
      f"checkpoint {os.path.join(root, str(step))}: unreadable meta item ({e}). {recovery_hint(root, step)}"
    ) from e


def restore_params(
  path: str,
  target,
  *,
  step: int | None = None,
  verify: bool = True,
  fingerprints: Mapping[str, str] | None = None,
):
  """Parameters only (no optimizer state) from a checkpoint, for evaluation or export.

  Args:
    path: a run directory, a checkpoint root or a step directory.
    target: an ``nnx.Module`` (updated in place and returned) or a tree of arrays /
      ShapeDtypeStructs (its shapes and shardings; the restored tree is returned).
    step: None: the latest complete step (or the step of a step-directory ``path``).
    verify: check the manifest first (:func:`verify_step`).
    fingerprints: ``{name: digest}`` the checkpoint's ``RunMeta.fingerprints`` must match (checked
      before any array is read), e.g. the base weights a LoRA checkpoint's adapters were trained on.
  Raises:
    CheckpointError: no complete checkpoint, corrupt files, a parameter tree that differs from
      ``target`` (names the entries), or different fingerprints (shows both digests).
  """
  root, step = _resolve_step(path, step)
  step_path = os.path.join(root, str(step))
  if verify:
    try:
      verify_step(step_path)
    except CheckpointError as e:
      raise CheckpointError(f"{e}\n{recovery_hint(root, step)}") from None
  module = target if isinstance(target, nnx.Module) else None
  tree = nnx.state(module) if module is not None else target
  meta = read_meta(step_path)
  _check_fingerprints(step_path, meta, fingerprints or {})
  problems = _compare_signatures(meta["params_signature"], _signature(tree), "params", check_dtype=False)
  if problems:
    raise CheckpointError(f"checkpoint {step_path} does not match the model:\n  " + "\n  ".join(problems[:20]))
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    ),
    tree,
  )
  with (
    _orbax_noise.without_read_only_notice(),
    ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True), item_handlers=_handlers()) as mgr,
  ):
    params = mgr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))["params"]
  if module is not None:
    nnx.update(module, params)
    return module
  return params
