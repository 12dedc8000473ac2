"""A checkpoint's step directories on disk: layout, manifest, verification, quarantine.

``OUT/checkpoints/<step>/`` is one Orbax step (``params/``, ``opt_state/``, ``meta/``) plus
``jaxgrpo_manifest.json`` (:data:`MANIFEST`: size and CRC32 of every file of the three items, written
before Orbax renames ``<step>.orbax-checkpoint-tmp`` to ``<step>``). A step is *complete* when it is
renamed and carries the manifest (:func:`complete_steps`), *intact* when every file matches it
(:func:`verify_step`, else :class:`CheckpointError` naming the file). Steps without a manifest are
moved aside to ``<step>.incomplete-<UTC time>``, corrupt ones to ``<step>.corrupt-<UTC time>``;
nothing is deleted. Plain files and ``os`` calls only; ``jaxgrpo.services.checkpoint`` re-exports every name.
docs/checkpoints.md, "Crash safety".
"""

from __future__ import annotations

import json
import os
import time
import zlib
from typing import Callable

from jaxgrpo.services._orbax_noise import ORBAX_TMP_SUFFIX

__all__ = [
  "MANIFEST",
  "CheckpointError",
  "checkpoint_dir",
  "checkpoint_root",
  "complete_steps",
  "has_checkpoint",
  "move_aside",
  "quarantine_incomplete_steps",
  "quarantine_step",
  "recovery_hint",
  "step_problems",
  "verify_step",
  "write_files_manifest",
]

MANIFEST = "jaxgrpo_manifest.json"
TMP_SUFFIX = ORBAX_TMP_SUFFIX


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used: corrupt, incomplete, or not matching the running model."""


def checkpoint_dir(out: str) -> str:
  """Where a run writing to ``out`` keeps its checkpoints: ``out/checkpoints``."""
  return os.path.join(os.fspath(out), "checkpoints")


def step_dirs(root: str) -> tuple[dict[int, str], list[str]]:
  """``({step: path}, [temporary dirs])`` of a checkpoint root (no validation)."""
  steps, tmps = {}, []
  if not os.path.isdir(root):
    return steps, tmps
  for name in os.listdir(root):
    path = os.path.join(root, name)
    if not os.path.isdir(path):
      continue
    if TMP_SUFFIX in name:
      tmps.append(path)
    elif name.isdigit():
      steps[int(name)] = path
  return steps, sorted(tmps)


def _crc32(path: str) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(1 << 22):
      crc = zlib.crc32(chunk, crc)
  return crc


def _file_table(step_path: str, checksum: bool, *, top_level: bool = False) -> dict[str, dict]:
  table = {}
  for dirpath, _, files in os.walk(step_path):
    for name in files:
      full = os.path.join(dirpath, name)
      rel = os.path.relpath(full, step_path)
      if rel == MANIFEST or rel.startswith(MANIFEST):
        continue
      if os.sep not in rel and not top_level:
        # Orbax's own step files (_CHECKPOINT_METADATA, commit_success.txt) are rewritten
        # after the callback that writes this manifest: only the item directories are covered
        continue
      entry = {"size": os.path.getsize(full)}
      if checksum:
        entry["crc32"] = _crc32(full)
      table[rel] = entry
  return dict(sorted(table.items()))


def write_manifest(step_path: str, step: int | None, checksum: bool, *, top_level: bool = False) -> None:
  files = _file_table(step_path, checksum, top_level=top_level)
  manifest = {"step": None if step is None else int(step), "files": files}
  tmp = os.path.join(step_path, MANIFEST + ".partial")
  with open(tmp, "w") as f:
    json.dump(manifest, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(step_path, MANIFEST))


def write_files_manifest(directory: str) -> None:
  """Writes :data:`MANIFEST` (size and CRC32 of every file, the top-level ones included) into ``directory``,
  e.g. the warm-up model a run keeps beside its checkpoints (``OUT/checkpoints/base``), so that
  :func:`verify_step` checks it like a step."""
  write_manifest(directory, None, True, top_level=True)


def verify_step(step_path: str, *, checksum: bool = True) -> None:
  """Checks every file of a step directory against its manifest (sizes; CRC32 too when ``checksum``
  and recorded: every host reads every file, so large multi-host runs may prefer sizes only).

  Raises:
    CheckpointError: no manifest (an incomplete save), or a file missing, of the wrong size
      (truncated) or with a different CRC32; the message names the file.
  """
  mpath = os.path.join(step_path, MANIFEST)
  if not os.path.exists(mpath):
    raise CheckpointError(f"checkpoint {step_path} has no {MANIFEST}: its save did not complete")
  try:
    with open(mpath) as f:
      manifest = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"checkpoint {step_path}: unreadable {MANIFEST} ({e})") from e
  problems = []
  for rel, want in manifest["files"].items():
    full = os.path.join(step_path, rel)
    if not os.path.exists(full):
      problems.append(f"{rel}: missing")
      continue
    size = os.path.getsize(full)
    if size != want["size"]:
      problems.append(f"{rel}: {size} bytes, expected {want['size']} (truncated or overwritten)")
    elif checksum and "crc32" in want and _crc32(full) != want["crc32"]:
      problems.append(f"{rel}: CRC32 differs from the one recorded at save time (corrupt)")
  if problems:
    raise CheckpointError(f"checkpoint {step_path} is corrupt:\n  " + "\n  ".join(problems))


def complete_steps(root: str, log: Callable[[str], None] | None = print) -> list[int]:
  """Steps under ``root`` whose save completed (renamed by Orbax and carrying a manifest), ascending.

  Temporary directories (a save interrupted before its rename) and steps without a manifest are
  reported through ``log`` and left out. File contents are checked later, by :func:`verify_step`.
  """
  log = log or (lambda s: None)
  steps, tmps = step_dirs(root)
  for t in tmps:
    log(f"ignoring incomplete checkpoint save {t} (interrupted before it was finalized)")
  done = []
  for step in sorted(steps):
    if os.path.exists(os.path.join(steps[step], MANIFEST)):
      done.append(step)
    else:
      log(f"ignoring checkpoint {steps[step]}: no {MANIFEST} (its save did not complete)")
  return done


def quarantine_incomplete_steps(root: str, log: Callable[[str], None] | None = print) -> list[str]:
  """Moves every step directory of ``root`` that has no manifest to ``<step>.incomplete-<UTC time>``.

  Such a directory is not a usable checkpoint, but Orbax still counts it as a step: a run resumed
  from the step before would fail to save that step again (``StepAlreadyExistsError``) at every
  restart. Moved aside, it is kept for inspection and neither Orbax nor :func:`complete_steps`
  sees it. Returns the new paths (each one reported through ``log``).
  """
  log = log or (lambda s: None)
  steps, _ = step_dirs(root)
  moved = []
  for step in sorted(steps):
    path = steps[step]
    if os.path.exists(os.path.join(path, MANIFEST)):
      continue
    target = _aside(path, "incomplete")
    os.rename(path, target)
    log(
      f"checkpoint {path} has no {MANIFEST} (its save did not complete): moved aside to {target}; "
      f"step {step} will be saved again"
    )
    moved.append(target)
  return moved


def move_aside(path: str, what: str) -> str:
  """Renames ``path`` to a free name ``<path>.<what>-<UTC time>[-n]`` beside it (nothing is deleted);
  returns the new path."""
  target = _aside(os.path.normpath(os.fspath(path)), what)
  os.rename(path, target)
  return target


def _aside(path: str, what: str) -> str:
  """A free name ``<path>.<what>-<UTC time>[-n]`` beside ``path``."""
  stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
  target, n = f"{path}.{what}-{stamp}", 1
  while os.path.exists(target):
    n += 1
    target = f"{path}.{what}-{stamp}-{n}"
  return target


def quarantine_step(root: str, step: int) -> str:
  """Renames the step directory ``root/<step>`` to ``<step>.corrupt-<UTC time>`` (nothing is
  deleted; neither Orbax nor :func:`complete_steps` sees it any more). Returns the new path."""
  path = os.path.join(root, str(step))
  target = _aside(path, "corrupt")
  os.rename(path, target)
  return target


def step_problems(root: str, *, checksum: bool = True) -> dict[int, str | None]:
  """``{step: None if intact, else what is wrong (one line)}`` for every complete step of ``root``
  (:func:`verify_step` of each: every file is read when ``checksum``)."""
  problems = {}
  for step in complete_steps(root, log=None):
    try:
      verify_step(os.path.join(root, str(step)), checksum=checksum)
      problems[step] = None
    except CheckpointError as e:
      problems[step] = " ".join(str(e).split())
  return problems


def recovery_hint(root: str, step: int) -> str:
  """How to get past a corrupt ``root/<step>``: the earlier intact steps (each verified: a corrupt one is never
  recommended) and what to run."""
  path = os.path.join(root, str(step))
  problems = {s: p for s, p in step_problems(root).items() if s < step}
  earlier = [s for s, p in problems.items() if p is None]
  move = f"move it aside (`mv {path} {path}.corrupt`)"
  if not earlier and problems:
    return (
      f"Recovery: there is no earlier intact checkpoint (steps {sorted(problems)} are corrupt too): {move} and "
      "start again (scripts/train.py --no-resume moves every corrupt step aside and starts from step 0)."
    )
  if earlier:
    return (
      f"Recovery: {move}, or use an earlier complete step ({earlier}; e.g. --step {earlier[-1]}); "
      f"scripts/train.py does this itself with --on-corrupt quarantine (the default) and resumes from step "
      f"{earlier[-1]}."
    )
  return (
    f"Recovery: there is no earlier complete checkpoint: {move} and start again (scripts/train.py with "
    "--on-corrupt quarantine, the default, does so itself)."
  )


def has_checkpoint(out: str) -> bool:
  """True when the run directory ``out`` holds at least one complete checkpoint."""
  return bool(complete_steps(checkpoint_dir(out), log=None))


def _resolve_root(path: str) -> tuple[str, int | None]:
  """A run dir, a checkpoint root or a step dir → ``(checkpoint root, step or None)``."""
  path = os.path.abspath(os.fspath(path))
  if os.path.exists(os.path.join(path, MANIFEST)) or (
    os.path.basename(path).isdigit() and os.path.isdir(os.path.join(path, "params"))
  ):
    return os.path.dirname(path), int(os.path.basename(path))
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return os.path.join(path, "checkpoints"), None
  return path, None


def checkpoint_root(path: str) -> str:
  """The checkpoint root (``OUT/checkpoints``) of a run directory, a checkpoint root or a step directory."""
  return _resolve_root(path)[0]


def resolve_step(path: str, step: int | None) -> tuple[str, int]:
  """``(checkpoint root, step)``: ``step``, else the step named by ``path``, else the latest complete."""
  root, path_step = _resolve_root(path)
  step = path_step if step is None else step
  if step is None:
    steps = complete_steps(root, log=None)
    if not steps:
      raise CheckpointError(f"no complete checkpoint in {root}")
    step = steps[-1]
  elif not os.path.isdir(os.path.join(root, str(step))):  # not saved (or deleted): nothing to recover
    steps = complete_steps(root, log=None)
    which = f"the complete steps are {steps} (e.g. --step {steps[-1]})" if steps else "it holds no complete step"
    raise CheckpointError(f"no step {step} in {root}: {which}")
  return root, step
