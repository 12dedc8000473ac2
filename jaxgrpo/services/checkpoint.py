"""Checkpoints of a training state that resume exactly and survive crashes.

A service below the trainer, and its public entry point: :class:`Checkpointer` saves a :class:`Snapshot`
(parameters, optimizer state, step, PRNG key, data position) with a :class:`RunMeta` (what the caller says
identifies its run) through Orbax, and restores it onto the running mesh; :func:`restore_params` (defined here) and
:func:`read_meta` read parameters only (evaluation, export, ``jaxgrpo.run.builders.load_policy``). It imports
nothing of the layers above. Every name is importable from here; the code is in four modules, each one job:

* ``jaxgrpo.services.checkpointer``: the :class:`Checkpointer` (one Orbax manager's lifecycle: saves in flight,
  failed saves, keep-last-K and keep-best, the corrupt-step quarantine, restore);
* ``jaxgrpo.services.snapshot``: what a step holds (:class:`Snapshot`, :class:`RunMeta`, the ``meta`` item) and
  the checks made before a restore reads an array (tree signatures, identity, fingerprints, finiteness);
* ``jaxgrpo.services.checkpoint_files``: the step directories on disk (layout, manifest, verification, quarantine);
* ``jaxgrpo.services._orbax_noise``: the noise filters for a failed save, installed by ``scripts/train.py``.

Contract: a step is on disk completely or not at all (Orbax's rename, then a CRC32 manifest checked on
restore: :class:`CheckpointError` naming the file); a corrupt latest step is quarantined (renamed,
never deleted) or stops the run (``on_corrupt``); a non-finite state is never saved
(:class:`NonFiniteError`); a failed save is reported at once, its partial step removed, older steps
deleted only after a newer save completed (:class:`CheckpointSaveError` with ``on_save_error="stop"``);
before any array is read, the saved trees, ``RunMeta.identity`` and ``RunMeta.fingerprints`` must
match the running side, and a changed ``RunMeta.guarded`` entry is refused unless ``allow_changed``.
docs/checkpoints.md ("Crash safety", "Multi-host") and docs/failure_modes.md give the details.

Usage (what ``scripts/train.py`` does)::

    ckpt = Checkpointer(checkpoint_dir(out), max_to_keep=3, best_metric="eval_accuracy")
    trainer = Trainer(cfg, checkpoint_fn=ckpt.checkpoint_fn, restore_fn=ckpt.restore_fn,
                      on_record=ckpt.observe)
    trainer.run(); ckpt.close()
"""

from __future__ import annotations

import os
from typing import Mapping

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxgrpo.services import _orbax_noise
from jaxgrpo.services._orbax_noise import ClosedLoopNoiseFilter
from jaxgrpo.services.checkpoint_files import (
  MANIFEST,
  CheckpointError,
  checkpoint_dir,
  checkpoint_root,
  complete_steps,
  has_checkpoint,
  move_aside,
  quarantine_incomplete_steps,
  quarantine_step,
  recovery_hint,
  resolve_step,
  step_problems,
  verify_step,
  write_files_manifest,
)
from jaxgrpo.services.checkpoint_files import TMP_SUFFIX as TMP_SUFFIX
from jaxgrpo.services.checkpoint_files import step_dirs as step_dirs
from jaxgrpo.services.checkpoint_files import write_manifest as write_manifest
from jaxgrpo.services.checkpointer import ON_CORRUPT as ON_CORRUPT
from jaxgrpo.services.checkpointer import Checkpointer, CheckpointSaveError
from jaxgrpo.services.snapshot import (
  FORMAT,
  NonFiniteError,
  RunMeta,
  Snapshot,
  check_fingerprints,
  checkpoint_handlers,
  compare_signatures,
  first_nonfinite,
  read_meta,
  tree_signature,
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
  "write_files_manifest",
  "move_aside",
  "step_problems",
  "read_meta",
  "restore_params",
  "MANIFEST",
  "FORMAT",
]


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
  root, step = resolve_step(path, step)
  step_path = os.path.join(root, str(step))
  if verify:
    try:
      verify_step(step_path)
    except CheckpointError as e:
      raise CheckpointError(f"{e}\n{recovery_hint(root, step)}") from None
  module = target if isinstance(target, nnx.Module) else None
  tree = nnx.state(module) if module is not None else target
  meta = read_meta(step_path)
  check_fingerprints(step_path, meta, fingerprints or {})
  problems = compare_signatures(meta["params_signature"], tree_signature(tree), "params", check_dtype=False)
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
    ocp.CheckpointManager(
      root, options=ocp.CheckpointManagerOptions(read_only=True), item_handlers=checkpoint_handlers()
    ) as mgr,
  ):
    params = mgr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))["params"]
  if module is not None:
    nnx.update(module, params)
    return module
  return params
