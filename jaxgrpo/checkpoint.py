"""Checkpoints of the whole training state that resume exactly and survive crashes; HF export.

Layout (``OUT/checkpoints``, one Orbax ``CheckpointManager`` step directory per saved step)::

    OUT/checkpoints/<step>/params/      parameters          (Orbax standard item; each host writes its shards)
                          /opt_state/   optimizer state     (Orbax standard item)
                          /meta/        JSON: step, PRNG key data + impl, data-iterator position,
                                        resolved TrainerConfig, parameter shapes, jaxgrpo version
                          /jaxgrpo_manifest.json   size and CRC32 of every file above

Crash safety, in two layers:

1. Orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it to ``<step>`` when every
   host has finished (``tests/test_checkpoint.py`` checks that this version really does so). A
   ``kill -9`` during a save leaves only the temporary directory: it is reported and ignored, and the
   previous step is used.
2. The manifest is written into the temporary directory after Orbax finalizes it and before the
   rename (``AsyncOptions.post_finalization_callback``), so every renamed step carries it. On
   restore every file is checked against it: a step with a truncated or altered file raises
   :class:`CheckpointError` naming the file; a step without a manifest counts as incomplete
   (skipped with a message). Nothing on disk is changed by a failed restore.

A restore also checks the parameter and optimizer-state tree against the running model (missing,
unexpected and mis-shaped entries are named) before reading any array, and restores onto the
running mesh: the target shardings come from the freshly built state, so a run saved on one mesh
shape resumes on another.

Usage (what ``scripts/train.py`` does)::

    ckpt = Checkpointer(os.path.join(cfg.out, "checkpoints"), max_to_keep=3, best_metric="eval_accuracy")
    trainer = Trainer(cfg, checkpoint_fn=ckpt.checkpoint_fn, restore_fn=ckpt.restore_fn,
                      on_record=ckpt.observe)
    trainer.run(); ckpt.close()

Parameters only (evaluation, export): :func:`restore_params`, :func:`load_policy`, :func:`export_hf`.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

__all__ = [
  "Checkpointer",
  "CheckpointError",
  "checkpoint_dir",
  "has_checkpoint",
  "complete_steps",
  "verify_step",
  "restore_params",
  "load_policy",
  "export_hf",
  "MANIFEST",
]

MANIFEST = "jaxgrpo_manifest.json"
TMP_SUFFIX = ".orbax-checkpoint-tmp"
_ITEMS = ("params", "opt_state", "meta")
# config fields that change the parameter tree or the data order: a differing value is an error
_IDENTITY_FIELDS = (
  "model",
  "param_dtype",
  "dataset",
  "split",
  "seed",
  "demo_hidden_size",
  "demo_layers",
  "demo_train_size",
  "demo_max_operand",
  "max_prompt_tokens",
  "instruction",
)


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used: corrupt, incomplete, or not matching the running model."""


# ----------------------------------------------------------------------------- files and manifests


def checkpoint_dir(out: str) -> str:
  """Where a run writing to ``out`` keeps its checkpoints: ``out/checkpoints``."""
  return os.path.join(os.fspath(out), "checkpoints")


def _step_dirs(root: str) -> tuple[dict[int, str], list[str]]:
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


def _file_table(step_path: str, checksum: bool) -> dict[str, dict]:
  table = {}
  for dirpath, _, files in os.walk(step_path):
    for name in files:
      full = os.path.join(dirpath, name)
      rel = os.path.relpath(full, step_path)
      if rel == MANIFEST or rel.startswith(MANIFEST):
        continue
      if os.sep not in rel:
        # Orbax's own step files (_CHECKPOINT_METADATA, commit_success.txt) are rewritten
        # after the callback that writes this manifest: only the item directories are covered
        continue
      entry = {"size": os.path.getsize(full)}
      if checksum:
        entry["crc32"] = _crc32(full)
      table[rel] = entry
  return dict(sorted(table.items()))


def _write_manifest(step_path: str, step: int, checksum: bool) -> None:
  manifest = {"step": int(step), "files": _file_table(step_path, checksum)}
  tmp = os.path.join(step_path, MANIFEST + ".partial")
  with open(tmp, "w") as f:
    json.dump(manifest, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(step_path, MANIFEST))


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
  steps, tmps = _step_dirs(root)
  for t in tmps:
    log(f"ignoring incomplete checkpoint save {t} (interrupted before it was finalized)")
  done = []
  for step in sorted(steps):
    if os.path.exists(os.path.join(steps[step], MANIFEST)):
      done.append(step)
    else:
      log(f"ignoring checkpoint {steps[step]}: no {MANIFEST} (its save did not complete)")
  return done


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


def _resolve_step(path: str, step: int | None) -> tuple[str, int]:
  """``(checkpoint root, step)``: ``step``, else the step named by ``path``, else the latest complete."""
  root, path_step = _resolve_root(path)
  step = path_step if step is None else step
  if step is None:
    steps = complete_steps(root, log=None)
    if not steps:
      raise CheckpointError(f"no complete checkpoint in {root}")
    step = steps[-1]
  return root, step


# ----------------------------------------------------------------------------- tree checks


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


class Checkpointer:
  """Saves and restores :class:`jaxgrpo.trainer.TrainerState` + the resolved config with Orbax.

  Args:
    directory: checkpoint root (``checkpoint_dir(cfg.out)``).
    max_to_keep: K most recent complete checkpoints kept (None: all).
    best_metric: a metric name (e.g. ``eval_accuracy``) seen through :meth:`observe`; the best
      checkpoint by it is kept as well as the last K. None: recency only.
    best_mode: ``max`` or ``min``.
    async_save: write in a background thread; ``save`` returns once the arrays are copied to the
      host, so the next step (which donates the state) can start. The next save, :meth:`wait`
      and :meth:`close` wait for it.
    checksum: record and verify CRC32 per file (sizes are always checked). Verification reads the
      whole checkpoint on every host: turn it off for very large multi-host checkpoints.
    log: message sink (None: silent); only the first host prints.
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
  ):
    if best_mode not in ("max", "min"):
      raise ValueError(f"`best_mode` must be 'max' or 'min'; got {best_mode!r}")
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
      raise ValueError(f"`max_to_keep` must be a positive int or None; got {max_to_keep!r}")
    self.directory = os.path.abspath(os.fspath(directory))
    self.best_metric, self.best_mode, self.checksum = best_metric, best_mode, checksum
    self.async_save = async_save
    self._is_main = jax.process_index() == 0
    self.log = log if log is not None and self._is_main else (lambda s: None)
    self._metrics: dict[int, float] = {}
    self._saving_step: int | None = None
    # report interrupted saves before Orbax removes their temporary directories
    complete_steps(self.directory, log=self.log)
    policies = [ocp.checkpoint_managers.LatestN(n=max_to_keep)]
    if best_metric is not None:
      policies.append(
        ocp.checkpoint_managers.BestN(
          get_metric_fn=lambda m: m[best_metric],
          reverse=best_mode == "min",
          n=1,
          keep_checkpoints_without_metrics=False,
        )
      )
    options = ocp.CheckpointManagerOptions(
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=True,
      create=True,
      preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
      async_options=ocp.AsyncOptions(post_finalization_callback=self._finalized) if async_save else None,
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())

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
    """Feeds a metrics record (``{"step": s, ...}``); ``best_metric`` values are kept for the save of s."""
    if self.best_metric is not None and self.best_metric in record:
      self._metrics[int(record["step"])] = float(record[self.best_metric])

  def save(self, state, config=None, *, metrics: Mapping[str, float] | None = None) -> int:
    """Saves ``state`` (a TrainerState) and ``config`` (a TrainerConfig or dict) at ``state.train.step``."""
    step = int(jax.device_get(state.train.step))
    if metrics is None and step in self._metrics:
      metrics = {self.best_metric: self._metrics[step]}
    cfg_dict = config.to_dict() if hasattr(config, "to_dict") else (dict(config) if config else None)
    key = state.key
    meta = {
      "step": step,
      "key_data": np.asarray(jax.random.key_data(key)).astype(np.uint32).tolist(),
      "key_impl": str(jax.random.key_impl(key)),
      "data_position": dict(state.data_position),
      "config": cfg_dict,
      "params_signature": _signature(state.train.params),
      "opt_state_signature": _signature(state.train.opt_state),
      "process_count": jax.process_count(),
      "metrics": dict(metrics) if metrics else None,
    }
    # one save at a time: the manifest callback must see the step it belongs to
    self.manager.wait_until_finished()
    self._saving_step = step
    self.manager.save(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(state.train.params),
        opt_state=ocp.args.StandardSave(state.train.opt_state),
        meta=ocp.args.JsonSave(meta),
      ),
      metrics=dict(metrics) if metrics else None,
      force=True,
    )
    if not self.async_save:
      self.manager.wait_until_finished()
      if self._is_main:
        _write_manifest(os.path.join(self.directory, str(step)), step, self.checksum)
    return step

  def checkpoint_fn(self, state, config) -> None:
    """The trainer's ``checkpoint_fn(state, config)`` hook."""
    step = self.save(state, config)
    self.log(
      f"checkpoint: step {step} -> {os.path.join(self.directory, str(step))}"
      + (" (writing in the background)" if self.async_save else "")
    )

  def wait(self) -> None:
    """Blocks until the running save (if any) is on disk."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the running save, then releases the manager."""
    self.manager.wait_until_finished()
    self.manager.close()

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
    """The JSON ``meta`` item of ``step`` (step, key, data position, config, tree signatures)."""
    path = os.path.join(self.directory, str(step), "meta", "metadata")
    with open(path) as f:
      return json.load(f)

  def _check(self, step: int, meta: dict, template, config) -> None:
    problems = _compare_signatures(meta["params_signature"], _signature(template.train.params), "params")
    problems += _compare_signatures(meta["opt_state_signature"], _signature(template.train.opt_state), "opt_state")
    saved_cfg = meta.get("config") or {}
    cur_cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    bad_cfg = [
      f"config.{k}: {saved_cfg[k]!r} in the checkpoint, {cur_cfg[k]!r} now"
      for k in _IDENTITY_FIELDS
      if k in saved_cfg and k in cur_cfg and saved_cfg[k] != cur_cfg[k]
    ]
    if problems or bad_cfg:
      shown = bad_cfg + problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
      raise CheckpointError(
        f"checkpoint {os.path.join(self.directory, str(step))} does not match the running model/config:\n  "
        + "\n  ".join(shown)
        + "\nNothing was overwritten; use another --out or matching settings."
      )
    changed = [
      f"{k}: {saved_cfg[k]!r} -> {cur_cfg[k]!r}"
      for k in sorted(saved_cfg)
      if k in cur_cfg and saved_cfg[k] != cur_cfg[k] and k != "resume"
    ]
    if changed:
      self.log("resuming with changed settings: " + ", ".join(changed))

  def restore(self, template, config=None, *, step: int | None = None):
    """The TrainerState saved at ``step`` (None: the latest complete one), placed like ``template``.

    Args:
      template: a TrainerState of the running trainer (its arrays give shapes, dtypes and the
        target shardings: restoring onto a different mesh works).
      config: the running TrainerConfig (identity fields are compared; others reported).
    Raises:
      CheckpointError: no complete checkpoint, a corrupt one (names the file), or one that does
        not match the model (names the entries). Nothing on disk is modified.
    """
    from jaxgrpo.train import TrainState
    from jaxgrpo.trainer import TrainerState

    steps = self.steps()
    if step is None:
      if not steps:
        raise CheckpointError(f"no complete checkpoint in {self.directory}")
      step = steps[-1]
    elif step not in steps:
      raise CheckpointError(f"step {step} is not a complete checkpoint in {self.directory}; complete steps: {steps}")
    path = os.path.join(self.directory, str(step))
    try:
      verify_step(path, checksum=self.checksum)
    except CheckpointError as e:
      earlier = [s for s in steps if s < step]
      hint = (
        f"\nEarlier complete checkpoints: {earlier}. To resume from step {earlier[-1]}, move {path} "
        f"aside (e.g. `mv {path} {path}.corrupt`) or pass step={earlier[-1]}."
        if earlier
        else "\nThere is no earlier complete checkpoint."
      )
      raise CheckpointError(str(e) + hint) from None
    meta = self.read_meta(step)
    self._check(step, meta, template, config)
    restored = self.manager.restore(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(_abstract(template.train.params)),
        opt_state=ocp.args.StandardRestore(_abstract(template.train.opt_state)),
      ),
    )
    key = jax.random.wrap_key_data(np.asarray(meta["key_data"], np.uint32), impl=meta["key_impl"])
    step_arr = jax.device_put(jnp.asarray(meta["step"], template.train.step.dtype), template.train.step.sharding)
    self.log(f"resumed from checkpoint {path} (step {meta['step']})")
    return TrainerState(
      TrainState(restored["params"], restored["opt_state"], step_arr), key, dict(meta["data_position"])
    )

  def restore_fn(self, config, template=None):
    """The trainer's ``restore_fn(config, template)`` hook: the latest complete state, or None
    when there is no checkpoint yet (a fresh start)."""
    if template is None:
      raise ValueError("restore_fn needs the trainer's freshly built state as `template`")
    if not self.steps():
      self.log(f"no complete checkpoint in {self.directory}: starting from step 0")
      return None
    return self.restore(template, config)


# ----------------------------------------------------------------------------- parameters only


def restore_params(path: str, target, *, step: int | None = None, verify: bool = True):
  """Parameters only (no optimizer state) from a checkpoint, for evaluation or export.

  Args:
    path: a run directory, a checkpoint root or a step directory.
    target: an ``nnx.Module`` (updated in place and returned) or a tree of arrays /
      ShapeDtypeStructs (its shapes and shardings; the restored tree is returned).
    step: None: the latest complete step (or the step of a step-directory ``path``).
    verify: check the manifest first (:func:`verify_step`).
  Raises:
    CheckpointError: no complete checkpoint, corrupt files, or a parameter tree that differs
      from ``target`` (names the entries).
  """
  root, step = _resolve_step(path, step)
  step_path = os.path.join(root, str(step))
  if verify:
    verify_step(step_path)
  module = target if isinstance(target, nnx.Module) else None
  tree = nnx.state(module) if module is not None else target
  with open(os.path.join(step_path, "meta", "metadata")) as f:
    meta = json.load(f)
  problems = _compare_signatures(meta["params_signature"], _signature(tree), "params", check_dtype=False)
  if problems:
    raise CheckpointError(f"checkpoint {step_path} does not match the model:\n  " + "\n  ".join(problems[:20]))
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    ),
    tree,
  )
  with ocp.CheckpointManager(
    root, options=ocp.CheckpointManagerOptions(read_only=True), item_handlers=_handlers()
  ) as mgr:
    params = mgr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))["params"]
  if module is not None:
    nnx.update(module, params)
    return module
  return params


def load_policy(path: str, *, step: int | None = None):
  """``(model, tokenizer, config_dict)``: the policy of a checkpoint, rebuilt from its saved config.

  The model skeleton comes from the config (``demo`` → the demo tiny model; otherwise
  ``config.json`` of the run's ``model`` directory), then the parameters are restored into it.
  """
  from jaxgrpo import models
  from jaxgrpo.trainer import DTYPES

  root, step = _resolve_step(path, step)
  with open(os.path.join(root, str(step), "meta", "metadata")) as f:
    cfg = json.load(f)["config"]
  if cfg is None:
    raise CheckpointError(f"checkpoint {root}/{step} holds no config: cannot rebuild the model")
  dtype, param_dtype = DTYPES[cfg["dtype"]], DTYPES[cfg["param_dtype"]]
  if cfg["model"] == "demo":
    from jaxgrpo import demo

    tokenizer = demo.build_tokenizer()
    mcfg = demo.tiny_model_config(len(tokenizer), hidden_size=cfg["demo_hidden_size"], num_layers=cfg["demo_layers"])
  else:
    tokenizer = models.load_tokenizer(cfg["model"])
    mcfg = models.config_from_hf(cfg["model"])
  model = nnx.eval_shape(lambda: models.build_model(mcfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype))
  graphdef, abstract = nnx.split(model)
  params = restore_params(root, abstract, step=step)
  return nnx.merge(graphdef, params), tokenizer, cfg


def export_hf(checkpoint_dir: str, out_dir: str, *, step: int | None = None) -> str:
  """Writes the policy of a checkpoint (default: the latest complete one) as a Hugging Face
  directory (``save_hf`` + the tokenizer) that ``transformers`` loads; returns ``out_dir``."""
  from jaxgrpo import models

  model, tokenizer, _ = load_policy(checkpoint_dir, step=step)
  models.save_hf(model, out_dir)
  tokenizer.save_pretrained(out_dir)
  return out_dir
