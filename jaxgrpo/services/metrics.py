"""Metrics sinks for training runs: progress bar, TensorBoard, Weights & Biases, and metrics.jsonl upkeep.

The trainer emits one record per step (``{"step", "loss", "reward_mean", "kl", "tokens_per_sec", ...}``)
and one per evaluation (``{"step", "eval_accuracy", ...}``) and writes them to ``OUT/metrics.jsonl``.
:class:`MetricsLogger` fans each record out to the optional sinks; pass it as the trainer's
``on_record``. Only the first host (``jax.process_index() == 0``) writes anything.

* progress bar (tqdm): step / total, ETA, reward mean, KL, tokens/s;
* TensorBoard event files in ``OUT/tensorboard`` (``tensorboardX``, extra ``jaxgrpo[logging]``); on
  resume, events at or after the resumed step are purged so the curves do not fold back;
* Weights & Biases (``wandb``, only when installed *and* a project is given).

:func:`truncate_jsonl` drops records written after the checkpoint a run resumes from, and repairs
what a crash or a full disk left at the end (a line cut short, a last line without its newline,
bytes that are not text), so a resumed ``metrics.jsonl`` reads like an uninterrupted run.
:func:`append_record` writes one record whole or raises :class:`MetricsWriteError` (one line: the
file, the step, the OS error) instead of a raw traceback.
"""

from __future__ import annotations

import errno
import json
import math
import numbers
import os
import sys
import uuid
from typing import Any, Mapping

import jax

from jaxgrpo.services import progress as progress_lib

__all__ = ["MetricsLogger", "MetricsWriteError", "append_record", "truncate_jsonl", "read_jsonl"]

_BAR_FIELDS = (("reward_mean", "reward"), ("kl", "kl"), ("tokens_per_sec", "tok/s"))


def read_jsonl(path: str) -> list[dict]:
  """Records of a metrics.jsonl; a final line cut short by a crash is skipped."""
  out = []
  if not os.path.exists(path):
    return out
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except ValueError:
        break
  return out


def truncate_jsonl(path: str, last_step: int) -> int:
  """Keeps the records of ``path`` with ``step <= last_step``, drops every line that is not a JSON
  object (a line cut short by a crash or a full disk, undecodable bytes), and ends the file with a
  newline (a whole last record without one is kept), so that appending goes on cleanly. Rewrites
  the file atomically when anything changes. Returns the number of lines dropped."""
  if not os.path.exists(path):
    return 0
  with open(path, "rb") as f:
    raw = f.read()
  keep, dropped = [], 0
  for line in raw.split(b"\n"):
    if not line.strip():
      continue
    try:
      rec = json.loads(line.decode())
      step = int(rec["step"]) if isinstance(rec, dict) else None
    except (ValueError, KeyError, TypeError):
      step = None
    if step is None or step > last_step:
      dropped += 1
    else:
      keep.append(line + b"\n")
  repaired = b"".join(keep)
  if repaired != raw:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
      f.write(repaired)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  return dropped


class MetricsWriteError(RuntimeError):
  """Writing a metrics record failed (a full disk, an I/O error); one line: file, step, OS error.

  Attributes:
    path: the file being written.
    step: the step of the record.
    reason: the OS error, e.g. ``"ENOSPC (No space left on device)"``.
  """

  def __init__(self, message: str, *, path: str, step: int, reason: str):
    super().__init__(message)
    self.path, self.step, self.reason = path, step, reason

  @classmethod
  def of(cls, error: OSError, *, path: str, step: int) -> MetricsWriteError:
    """The error for an ``OSError`` raised while writing the record of ``step`` to ``path``."""
    path = error.filename or path
    reason = (
      f"{errno.errorcode.get(error.errno, error.errno)} ({error.strerror or os.strerror(error.errno)})"
      if error.errno
      else f"{type(error).__name__}: {error}"
    )
    return cls(f"writing the metrics of step {step} to {path} failed: {reason}", path=path, step=step, reason=reason)


def append_record(f, record: Mapping[str, Any], *, path: str | None = None) -> None:
  """Appends ``record`` as one JSON line to ``f``, an unbuffered binary file (``open(p, "ab",
  buffering=0)``): a short write is continued until the line is whole, so nothing stays buffered
  to fail again at close.

  Raises:
    MetricsWriteError: the write failed (the file may end with a partial line, which
      :func:`truncate_jsonl` drops on resume).
  """
  data = memoryview((json.dumps(dict(record)) + "\n").encode())
  try:
    while data:
      data = data[f.write(data) :]
  except OSError as e:
    raise MetricsWriteError.of(e, path=path or f.name, step=int(record.get("step", 0))) from e


def _scalars(record: Mapping[str, Any]) -> dict[str, float]:
  return {
    k: float(v)
    for k, v in record.items()
    if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))
  }


def _summary_writer_class():
  """tensorboardX's ``SummaryWriter``, imported without loading torch when torch is not loaded yet.

  tensorboardX imports torch (~1.2 s of CPU) at import only to accept torch tensors as values; this logger
  gives it Python floats and text. ``sys.modules["torch"] = None`` makes that one ``import torch`` fail the way
  tensorboardX expects when torch is absent; the entry is removed right after, so a later ``import torch``
  works as usual. (The import runs in the constructor, before a run starts its threads.)"""
  try:
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
      from tensorboardX import SummaryWriter
    else:
      sys.modules["torch"] = None
      try:
        from tensorboardX import SummaryWriter
      finally:
        del sys.modules["torch"]
  except ImportError as e:
    raise ImportError("TensorBoard logging needs tensorboardX: pip install 'jaxgrpo[logging]'") from e
  return SummaryWriter


class MetricsLogger:
  """Fans trainer records out to a progress bar, TensorBoard and (optionally) Weights & Biases.

  Args:
    out: run directory (TensorBoard files go to ``out/tensorboard``).
    total_steps: the run's ``steps`` (progress bar total).
    start_step: the step the run starts or resumes from.
    progress: show a tqdm progress bar.
    tensorboard: write TensorBoard event files (needs ``tensorboardX``; ImportError with the
      install hint when asked for and missing).
    wandb_project: a W&B project name to log to (None: no W&B). Needs ``wandb``.
    config: the run config (dict) recorded by W&B / TensorBoard.
    is_main: log on this host (default: ``jax.process_index() == 0``).
  """

  def __init__(
    self,
    out: str,
    *,
    total_steps: int,
    start_step: int = 0,
    progress: bool = True,
    tensorboard: bool = True,
    wandb_project: str | None = None,
    config: Mapping[str, Any] | None = None,
    is_main: bool | None = None,
  ):
    if is_main is None:
      is_main = jax.process_index() == 0
    self.is_main = is_main
    self.bar = self.tb = self.wandb_run = None
    if not is_main:
      return
    if progress:
      # "compiling" until the first step's record: its clock (rate, ETA) restarts there, so the first step's
      # compile (and the warm-up, the first evaluation before it) is not taken as the time of a step
      self.bar = progress_lib.step_bar(total_steps, "train", initial=start_step, dynamic_ncols=True)
    self._clock_started = False
    if tensorboard:
      SummaryWriter = _summary_writer_class()
      # purge_step: events from a crashed run's steps after the resumed checkpoint are dropped
      self.tb = SummaryWriter(os.path.join(out, "tensorboard"), purge_step=start_step + 1 if start_step else None)
      if config is not None:
        self.tb.add_text("config", "```\n" + json.dumps(dict(config), indent=1) + "\n```", 0)
    if wandb_project:
      try:
        import wandb
      except ImportError as e:
        raise ImportError("Weights & Biases logging needs wandb: pip install 'jaxgrpo[logging]'") from e
      self.wandb_run = wandb.init(
        project=wandb_project, config=dict(config or {}), dir=out, resume="allow", id=_wandb_id(out)
      )

  def write(self, message: str) -> None:
    """A text line that does not break the progress bar."""
    if not self.is_main:
      return
    if self.bar is not None:
      self.bar.write(message)
    else:
      print(message, flush=True)

  def __call__(self, record: Mapping[str, Any]) -> None:
    if not self.is_main:
      return
    step = int(record.get("step", 0))
    scalars = _scalars(record)
    if self.tb is not None:
      for k, v in scalars.items():
        self.tb.add_scalar(k, v, step)
      self.tb.flush()
    if self.wandb_run is not None:
      self.wandb_run.log(scalars, step=step)
    if self.bar is not None and "loss" in record:  # a training step (eval records carry no loss)
      self.bar.n = step
      if not self._clock_started:  # the first step of this process compiled: time the ETA from its end
        progress_lib.start_clock(self.bar)
        self._clock_started = True
      self.bar.set_postfix({name: f"{record[k]:.3g}" for k, name in _BAR_FIELDS if k in record}, refresh=False)
      self.bar.refresh()

  def close(self) -> None:
    """Closes the progress bar and flushes/finishes TensorBoard and W&B."""
    if self.bar is not None:
      self.bar.close()
    if self.tb is not None:
      self.tb.close()
    if self.wandb_run is not None:
      self.wandb_run.finish()
    self.bar = self.tb = self.wandb_run = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _wandb_id(out: str) -> str:
  """A stable W&B run id per output directory, so a resumed run continues the same W&B run."""
  path = os.path.join(out, "wandb_run_id")
  if os.path.exists(path):
    with open(path) as f:
      return f.read().strip()
  rid = uuid.uuid4().hex[:12]
  os.makedirs(out, exist_ok=True)
  with open(path, "w") as f:
    f.write(rid)
  return rid
