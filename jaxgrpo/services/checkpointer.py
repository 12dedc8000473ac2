"""The :class:`Checkpointer`: one Orbax ``CheckpointManager``'s lifecycle for one run's checkpoints.

One job — saves (asynchronous by default), keep-last-K and keep-best, the corrupt-step quarantine, restore onto
the running mesh — re-exported by ``jaxgrpo.services.checkpoint``, whose docstring (and docs/checkpoints.md) gives
the contract. Its self-contained parts are module-level: :class:`_KeepBest` (the keep-best policy and its metric
memory across restarts), :class:`_Saves` (the save in flight, the watcher that reports a failed save at once, the
cleanup of what it left) and :func:`_set_aside` (a corrupt latest step moved aside). What a step holds and the
checks before a restore reads an array are :mod:`jaxgrpo.services.snapshot`; the step directories on disk,
:mod:`jaxgrpo.services.checkpoint_files`.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxgrpo.services.checkpoint_files import (
  MANIFEST,
  TMP_SUFFIX,
  CheckpointError,
  complete_steps,
  move_aside,
  quarantine_incomplete_steps,
  quarantine_step,
  recovery_hint,
  step_dirs,
  step_problems,
  verify_step,
  write_manifest,
)
from jaxgrpo.services.snapshot import (
  NonFiniteError,
  RunMeta,
  Snapshot,
  abstract_tree,
  changed_config,
  check_meta,
  checkpoint_handlers,
  meta_item,
  nonfinite_state,
  read_meta,
)

__all__ = ["ON_CORRUPT", "CheckpointSaveError", "Checkpointer"]

#: ``Checkpointer(on_corrupt=...)``: what a corrupt latest step does when the run looks for its resume point
ON_CORRUPT = ("quarantine", "stop")


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


def _latest(directory: str) -> int | None:
  steps = complete_steps(directory, log=None)
  return steps[-1] if steps else None


# ----------------------------------------------------------------------------- keep-best


class _KeepBest:
  """Orbax preservation policy: keeps the checkpoint with the best finite value of ``metric`` (``mode`` ``max`` or
  ``min``; on a tie the latest), whatever its age. Steps without a value are left to the other policies
  (keep-last-K). A step's value is the one :meth:`observe` saw in this run, else the one saved in the step's meta
  item by an earlier run (Orbax keeps metrics in memory only: without it a restarted run would rotate the best
  checkpoint away)."""

  def __init__(self, directory: str, metric: str, mode: str):
    self.directory, self.metric, self.mode = directory, metric, mode
    self.observed: dict[int, float] = {}
    self._saved: dict[int, float | None] = {}  # read from the steps' meta items

  def observe(self, record: Mapping[str, Any]) -> None:
    if self.metric in record:
      self.observed[int(record["step"])] = float(record[self.metric])

  def saving(self, step: int) -> dict[str, float] | None:
    """The metrics to save with ``step`` (None: no value observed); its value is read again from the new save."""
    self._saved.pop(step, None)
    return {self.metric: self.observed[step]} if step in self.observed else None

  def value(self, step: int) -> float | None:
    """``metric`` of a saved step: observed by this run, else the value saved in the step's meta item."""
    if step in self.observed:
      return self.observed[step]
    if step not in self._saved:
      try:
        with open(os.path.join(self.directory, str(step), "meta", "metadata")) as f:
          value = (json.load(f).get("metrics") or {}).get(self.metric)
      except (OSError, ValueError):
        value = None
      self._saved[step] = None if value is None else float(value)
    return self._saved[step]

  def should_preserve(self, checkpoints, *, context=None) -> list[bool]:
    sign = 1.0 if self.mode == "max" else -1.0
    scored = [
      (sign * v, c.step, i)
      for i, c in enumerate(checkpoints)
      if (v := self.value(c.step)) is not None and np.isfinite(v)
    ]
    best = max(scored)[2] if scored else None
    return [i == best for i in range(len(checkpoints))]


# ----------------------------------------------------------------------------- saves in flight and failed


class _Saves:
  """The background save in flight and the failed saves of one :class:`Checkpointer`: a watcher thread per write
  that reports a failure at once (through ``log``, as a :class:`CheckpointSaveError` naming the step, the path and
  the OS error), the cleanup of what a failed save left, and the failure still to raise (``on_save_error="stop"``).
  """

  def __init__(self, manager, directory: str, *, on_save_error: str, is_main: bool, log: Callable[[str], None]):
    self.manager, self.directory, self.on_save_error = manager, directory, on_save_error
    self.is_main, self.log = is_main, log
    self.step: int | None = None  # the step being saved: the manifest callback's
    self.watcher: threading.Thread | None = None
    self.failure: CheckpointSaveError | None = None  # reported, not raised yet ("stop")
    self.failed: list[CheckpointSaveError] = []
    self.reload_needed = False
    self.partial_steps: set[int] = set()  # failed saves whose temporary directories are removed

  def check(self) -> None:
    """Raises the first failed save that has not been raised yet (``on_save_error="stop"``)."""
    failure, self.failure = self.failure, None
    if failure is not None:
      raise failure

  def watch(self, step: int) -> None:
    """A thread that waits for the background write of ``step`` and reports a failure at once."""

    def wait():
      try:
        self.manager.wait_until_finished()
      except Exception as e:  # noqa: BLE001 - reported with the step, the path and the OS error
        self.fail(step, e)

    self.watcher = threading.Thread(target=wait, name=f"jaxgrpo-checkpoint-{step}", daemon=True)
    self.watcher.start()

  def settle(self) -> None:
    """Waits for the save in flight (if any) and its watcher; raises a reported failure ("stop")."""
    if self.watcher is not None:
      self.watcher.join()
      self.watcher = None
      try:  # Orbax raises a failed save once per calling thread: the watcher reported it, this consumes it
        self.manager.wait_until_finished()
      except Exception as e:  # noqa: BLE001
        if not any(f.step == self.step for f in self.failed):
          self.fail(self.step, e)
    self.resync()
    self.check()

  def resync(self) -> None:
    """After a failed save: Orbax dropped the steps that save was to replace from its list before
    the write (they are still on disk); re-read the list, or they would never be deleted. Writes
    of the failed save that were still running when it was reported may have recreated parts of
    its temporary directory: remove them again."""
    if self.reload_needed:
      self.reload_needed = False
      self.manager.reload()
    for step in self.partial_steps:
      self.remove_partial(step)

  def remove_partial(self, step: int) -> None:
    """Removes what a failed save of ``step`` left (its temporary directories; a final directory
    without a manifest is moved aside). First host only."""
    if not self.is_main:
      return
    _, tmps = step_dirs(self.directory)
    for t in tmps:
      if os.path.basename(t).startswith(f"{step}{TMP_SUFFIX}"):
        shutil.rmtree(t, ignore_errors=True)
    final = os.path.join(self.directory, str(step))
    if os.path.isdir(final) and not os.path.exists(os.path.join(final, MANIFEST)):
      quarantine_incomplete_steps(self.directory, log=self.log)

  def remove_partial_until_quiet(self, quiet_s: float = 1.0, limit_s: float = 30.0) -> None:
    """The last cleanup of failed saves (at close): Orbax reports the first failed write of a save while its
    other writes may still run in its threads, and a write creates its parent directories again — so the
    temporary directories of a failed step can reappear after :meth:`remove_partial`. Removes them until none
    reappeared for ``quiet_s`` seconds (at most ``limit_s``). No cost when no save failed."""
    if not self.partial_steps or not self.is_main:
      return
    deadline = time.monotonic() + limit_s
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
      _, tmps = step_dirs(self.directory)
      left = [t for t in tmps if any(os.path.basename(t).startswith(f"{s}{TMP_SUFFIX}") for s in self.partial_steps)]
      if left:
        for step in self.partial_steps:
          self.remove_partial(step)
        quiet_since = time.monotonic()
      elif time.monotonic() - quiet_since >= quiet_s:
        return
      time.sleep(0.05)

  def fail(self, step: int, exc: BaseException) -> None:
    """Records, reports (through ``log``, at once) and cleans up a failed save of ``step``."""
    path = os.path.join(self.directory, str(step))
    reason = _os_reason(exc)
    completed = os.path.exists(os.path.join(path, MANIFEST))
    if not completed:
      self.partial_steps.add(step)
      self.remove_partial(step)
    last = _latest(self.directory)
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
    self.reload_needed = True
    self.failed.append(err)
    if self.on_save_error == "stop" and self.failure is None:
      self.failure = err
    self.log(f"error: {what}")


def _set_aside(manager, directory: str, step: int, error: CheckpointError, *, is_main: bool, log) -> None:
  """Moves the corrupt ``step`` aside (first host; every host waits), makes ``manager`` forget it and says so
  loudly through ``log``."""
  path = os.path.join(directory, str(step))
  target = quarantine_step(directory, step) if is_main else f"{path}.corrupt-*"
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"jaxgrpo.services.checkpoint: corrupt step {step} moved aside")
  manager.reload()  # Orbax must forget the step, or it would refuse to save it again
  earlier = [s for s in complete_steps(directory, log=None) if s < step]
  then = f"resuming from the previous complete step {earlier[-1]}" if earlier else "no earlier complete step"
  reason = " ".join(str(error).split())
  log(
    f"WARNING: checkpoint {path} is corrupt ({reason}); moved aside to {target} (kept, not deleted); {then}. "
    "To stop instead, pass --on-corrupt stop (Checkpointer(on_corrupt='stop'))."
  )


def _check_options(on_corrupt: str, best_mode: str, max_to_keep: int | None, on_save_error: str) -> None:
  """ValueError naming the first :class:`Checkpointer` argument outside its range."""
  if on_corrupt not in ON_CORRUPT:
    raise ValueError(f"`on_corrupt` must be one of {ON_CORRUPT}; got {on_corrupt!r}")
  if best_mode not in ("max", "min"):
    raise ValueError(f"`best_mode` must be 'max' or 'min'; got {best_mode!r}")
  if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
    raise ValueError(f"`max_to_keep` must be a positive int or None; got {max_to_keep!r}")
  if on_save_error not in ("stop", "continue"):
    raise ValueError(f"`on_save_error` must be 'stop' or 'continue'; got {on_save_error!r}")


def _restore_arrays(manager, step: int, meta: Mapping[str, Any], template: Snapshot) -> Snapshot:
  """The arrays of ``step`` placed like ``template`` (shapes, dtypes, shardings), with the key and the step of its
  ``meta`` item."""
  restored = manager.restore(
    step,
    args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract_tree(template.params)),
      opt_state=ocp.args.StandardRestore(abstract_tree(template.opt_state)),
    ),
  )
  key = jax.random.wrap_key_data(np.asarray(meta["key_data"], np.uint32), impl=meta["key_impl"])
  step_arr = jax.device_put(jnp.asarray(meta["step"], template.step.dtype), template.step.sharding)
  return Snapshot(restored["params"], restored["opt_state"], step_arr, key, dict(meta["data_position"]))


# ----------------------------------------------------------------------------- the manager


class Checkpointer:
  """Saves and restores :class:`Snapshot` s with their :class:`RunMeta`, with Orbax.

  One job at ~340 lines: one ``CheckpointManager``'s lifecycle (save, keep, quarantine, restore); its
  self-contained parts are the module-level helpers (module docstring).

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
    _check_options(on_corrupt, best_mode, max_to_keep, on_save_error)
    self.directory = os.path.abspath(os.fspath(directory))
    self.best_metric, self.best_mode, self.checksum = best_metric, best_mode, checksum
    self.async_save, self.allow_changed = async_save, allow_changed
    self.on_save_error, self.check_finite, self.on_corrupt = on_save_error, check_finite, on_corrupt
    self._verified: set[int] = set()  # steps checked against their manifest by this Checkpointer
    self._is_main = jax.process_index() == 0
    self.log = log if log is not None and self._is_main else (lambda s: None)
    self._closed = False
    # a step without a manifest would make the resumed run's save of that step fail at every restart
    if self._is_main:
      quarantine_incomplete_steps(self.directory, log=self.log)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("jaxgrpo.services.checkpoint: incomplete steps moved aside")
    # report interrupted saves before Orbax removes their temporary directories
    complete_steps(self.directory, log=self.log)
    self._best = _KeepBest(self.directory, best_metric, best_mode) if best_metric is not None else None
    policies = [ocp.checkpoint_managers.LatestN(n=max_to_keep), *([self._best] if self._best is not None else [])]
    # foreground saves use the same asynchronous path and wait: the manifest is then always
    # written before Orbax's rename, so no kill can leave a renamed step without it
    options = ocp.CheckpointManagerOptions(
      enable_async_checkpointing=True,
      cleanup_tmp_directories=True,
      create=True,
      preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
      async_options=ocp.AsyncOptions(post_finalization_callback=self._finalized),
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=checkpoint_handlers())
    # `log` is looked up at each call: scripts/train.py replaces it after construction
    self._saves = _Saves(
      self.manager, self.directory, on_save_error=on_save_error, is_main=self._is_main, log=lambda s: self.log(s)
    )

  @property
  def failed_saves(self) -> list[CheckpointSaveError]:
    """Every save that failed so far (reported at once through ``log``), oldest first."""
    return self._saves.failed

  # ------------------------------------------------------------------ saving
  def _finalized(self) -> None:
    """Orbax callback after a save is finalized: manifest into the step directory (before the rename)."""
    step = self._saves.step
    if step is None or not self._is_main:
      return
    tmp = os.path.join(self.directory, f"{step}{TMP_SUFFIX}")
    target = tmp if os.path.isdir(tmp) else os.path.join(self.directory, str(step))
    write_manifest(target, step, self.checksum)

  def observe(self, record: Mapping[str, Any]) -> None:
    """Feeds a metrics record (``{"step": s, ...}``); ``best_metric`` values are kept for the save of s.

    Called by the trainer after every step, it is also where a failed background save stops the
    run (``on_save_error="stop"``): it raises the :class:`CheckpointSaveError` reported earlier.
    """
    self.check()
    if self._best is not None:
      self._best.observe(record)

  def check(self) -> None:
    """Raises the first failed save that has not been raised yet (``on_save_error="stop"``)."""
    self._saves.check()

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
    where = nonfinite_state(snapshot) if self.check_finite else None
    if where is not None:
      raise NonFiniteError(
        f"refusing to save step {step}: {where} holds NaN or infinite values; nothing was written and the "
        f"earlier checkpoints in {self.directory} are kept",
        step=step,
        where=where,
      )
    self._saves.settle()  # one save at a time: the manifest callback must see the step it belongs to
    best = self._best.saving(step) if self._best is not None else None
    metrics = best if metrics is None else metrics
    meta = meta_item(step, snapshot, run or RunMeta(), metrics)
    self._saves.step = step
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
      self._saves.fail(step, e)
      self._saves.resync()
    else:
      self._saves.watch(step)
    if not self.async_save:
      self._saves.settle()
    self.check()
    return step

  def checkpoint_fn(self, snapshot: Snapshot, run: RunMeta | None = None) -> None:
    """The trainer's ``checkpoint_fn(snapshot, run)`` hook: :meth:`save` and a log line."""
    step = self.save(snapshot, run)
    self.log(
      f"checkpoint: step {step} -> {os.path.join(self.directory, str(step))}"
      + (" (writing in the background)" if self.async_save else "")
    )

  @property
  def writing(self) -> bool:
    """Whether a background save is still being written (what an abort abandons)."""
    watcher = self._saves.watcher
    return watcher is not None and watcher.is_alive()

  def wait(self) -> None:
    """Blocks until the running save (if any) is on disk; raises its failure with ``on_save_error="stop"``."""
    self._saves.settle()

  def close(self) -> None:
    """Waits for the running save, then releases the manager (also when the save failed, which it
    then raises with ``on_save_error="stop"``). A second call does nothing."""
    if self._closed:
      return
    self._closed = True
    try:
      self._saves.settle()
    finally:
      try:
        self.manager.close()
      except Exception:  # noqa: BLE001 - a failed save was reported by settle
        if not self.failed_saves:
          raise
      self._saves.remove_partial_until_quiet()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def set_aside(self, step: int, what: str, reason: str) -> str | None:
    """Moves the complete checkpoint ``step`` aside to ``<step>.<what>-<UTC time>`` (first host; nothing is
    deleted), after the save in flight, e.g. the step whose policy the collapse guard condemned
    (``jaxgrpo.run.collapse.PolicyCollapsed.condemned``): the next run resumes from an earlier one. Logged
    with ``reason``. Returns the new path, or None when ``step`` is not a complete checkpoint."""
    self._saves.settle()
    if step not in self.steps():
      return None
    path = os.path.join(self.directory, str(step))
    target = move_aside(path, what) if self._is_main else f"{path}.{what}-*"
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxgrpo.services.checkpoint: step {step} set aside")
    self.manager.reload()  # Orbax must forget the step, or it would refuse to save it again
    self._verified.discard(step)
    self.log(f"WARNING: checkpoint {path} {reason}: moved aside to {target} (kept, not deleted)")
    return target

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
    where = os.path.join(self.directory, str(step))
    check_meta(where, self.read_meta(step), None, run, allow_changed=self.allow_changed)
    return step

  def resume_step(self) -> int | None:
    """The latest complete step whose files match its manifest (None: none), after dealing with
    corrupt later ones by ``on_corrupt`` (see the module docstring). Each step is verified once.

    Raises:
      CheckpointError: (``on_corrupt="stop"``) the latest step is corrupt; names the file and the recovery.
    """
    corrupt: dict[int, CheckpointError] = {}  # newest first; moved aside once an intact earlier step is found
    for step in reversed(self.steps()):
      if step in self._verified:
        return self._set_aside_later(corrupt, step)
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
        corrupt[step] = e
        continue
      self._verified.add(step)
      return self._set_aside_later(corrupt, step)
    if corrupt:  # starting over must be explicit: nothing is moved, the run is refused
      listed = "; ".join(f"step {s}: {' '.join(str(e).split())}" for s, e in corrupt.items())
      raise CheckpointError(
        f"every checkpoint in {self.directory} is corrupt ({listed}); nothing to resume from, nothing was moved. "
        "To start over from step 0: scripts/train.py --no-resume (moves them aside to <step>.corrupt-<UTC time> "
        "and keeps metrics.jsonl, moved aside too); from Python, Checkpointer.set_aside_corrupt() first"
      )
    return None

  def _set_aside_later(self, corrupt: Mapping[int, CheckpointError], step: int) -> int:
    """Moves the corrupt steps after the intact ``step`` aside (``on_corrupt="quarantine"``); returns ``step``."""
    for bad, error in sorted(corrupt.items()):  # oldest first: each message names the step resumed from
      _set_aside(self.manager, self.directory, bad, error, is_main=self._is_main, log=self.log)
    return step

  def set_aside_corrupt(self) -> list[str]:
    """Moves every corrupt complete step aside to ``<step>.corrupt-<UTC time>`` (logged; nothing is deleted), e.g.
    to start over explicitly when every checkpoint is corrupt (``scripts/train.py --no-resume``). Returns the
    new paths."""
    self._saves.settle()
    moved = []
    for step, problem in step_problems(self.directory, checksum=self.checksum).items():
      if problem is not None:
        moved.append(self.set_aside(step, "corrupt", f"is corrupt ({problem})"))
    return moved

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
    self.wait()  # a save still being written in the background is part of what is on disk
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
    guarded = check_meta(path, meta, template, run, allow_changed=self.allow_changed)
    if guarded:
      self.log("resuming with changed settings (allowed): " + "; ".join(guarded))
    if changed := changed_config(meta["config"], run.config):
      self.log("resuming with changed settings: " + ", ".join(changed))
    snapshot = _restore_arrays(self.manager, step, meta, template)
    self.log(f"resumed from checkpoint {path} (step {meta['step']})")
    return snapshot

  def restore_fn(self, run: RunMeta | None, template: Snapshot) -> Snapshot | None:
    """The trainer's ``restore_fn(run, template)`` hook: the latest complete snapshot, or None when
    there is no checkpoint yet (a fresh start)."""
    if self.resume_step() is None:
      self.log(f"no complete checkpoint in {self.directory}: starting from step 0")
      return None
    return self.restore(template, run)
