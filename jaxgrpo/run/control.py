"""Run control: what stops a run, and how it stops cleanly.

:class:`RunControl` is the service the loop (``jaxgrpo.run.trainer.Trainer``) asks at every step boundary:

- **signals** (:meth:`RunControl.handle_signals`): the first SIGTERM/SIGINT sets ``stop_signal``; the loop
  finishes the step, hands it to ``checkpoint_fn`` and raises :class:`TrainingInterrupted`; a second one
  raises :class:`TrainingAborted` at once. Several processes agree on the stop (one tiny all-gather).
- **non-finite values** (:meth:`RunControl.check_finite`, :func:`nonfinite_error`): a non-finite parameter
  or optimizer state always stops (``NonFiniteError``) before the step is saved; a non-finite loss stops
  unless ``stop_on_nonfinite_loss`` is off.
- **a failed metrics write** (:meth:`RunControl.checkpoint_after_write_error`): one checkpoint attempt of
  the current step, its outcome in the error's message.

It holds no model and no data: the current state and the checkpoint function are passed in.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxgrpo.services.checkpoint import NonFiniteError, first_nonfinite
from jaxgrpo.services.metrics import MetricsWriteError

__all__ = ["RunControl", "TrainingInterrupted", "TrainingAborted", "nonfinite_error"]


class TrainingInterrupted(Exception):
  """``run()`` stopped on SIGTERM/SIGINT at a step boundary, after handing that step to
  ``checkpoint_fn`` (a background save may still be in flight: wait for it, e.g. ``Checkpointer.close``).

  Attributes:
    signum: the signal (``signal.SIGTERM`` or ``signal.SIGINT``); a command line exits with
      ``128 + signum``.
    step: the last completed (and checkpointed) step.
  """

  def __init__(self, message: str, *, signum: int, step: int):
    super().__init__(message)
    self.signum, self.step = signum, step


class TrainingAborted(KeyboardInterrupt):
  """A second SIGTERM/SIGINT during ``run()``: raised at once, without finishing the step or the
  save in flight (a ``KeyboardInterrupt``, so code that handles Ctrl-C handles it too).

  Attributes:
    signum: the second signal.
  """

  def __init__(self, signum: int):
    super().__init__(f"aborted by a second {signal.Signals(signum).name}")
    self.signum = signum


def nonfinite_error(
  step: int, metrics: Mapping[str, Any], state_where: str | None, *, stop_on_loss: bool
) -> NonFiniteError | None:
  """The error that stops the run after ``step``, or None to go on.

  ``state_where`` is the first non-finite parameter / optimizer-state entry (None: all finite). A
  non-finite state always stops; a non-finite ``loss`` stops when ``stop_on_loss``.
  """
  bad = _nonfinite_metrics(metrics)
  loss_bad = "loss" in bad
  if state_where is None and not (loss_bad and stop_on_loss):
    return None
  parts = []
  if bad:
    parts.append(
      f"first non-finite metric: {bad[0]} = {metrics[bad[0]]}" + (f" (all: {', '.join(bad)})" if len(bad) > 1 else "")
    )
  if state_where is not None:
    parts.append(f"first non-finite entry of the updated state: {state_where}")
  else:
    parts.append(
      "the parameters are still finite (--on-nonfinite-loss continue, Trainer(stop_on_nonfinite_loss=False), "
      "would go on)"
    )
  return NonFiniteError(
    f"training stopped at step {step}: non-finite values; " + "; ".join(parts) + f". Nothing of step {step} was "
    "saved and the earlier checkpoints are kept. Usual causes: a learning rate too large, no gradient "
    "clipping (step.max_grad_norm), an extreme reward. Resume from the last checkpoint with other settings "
    "(a changed learning rate needs --allow-changed-config).",
    step=step,
    where=bad[0] if bad else state_where,
  )


def _nonfinite_metrics(metrics: Mapping[str, Any]) -> list[str]:
  """The non-finite metrics, leaving out the reward statistics that are NaN because no reward was finite
  (``rewards.reward_set.finite_reward_stats``: missing samples, said in a line of their own)."""
  return [
    k
    for k, v in metrics.items()
    if isinstance(v, float)
    and not math.isfinite(v)
    and not (math.isnan(v) and (k in ("reward_mean", "reward_std") or k.startswith("reward/")))
  ]


def _first_nonfinite_state(train_state) -> str | None:
  return first_nonfinite(train_state.params, "params") or first_nonfinite(train_state.opt_state, "opt_state")


class RunControl:
  """Signals, stop requests, finite checks and the metrics-write-error checkpoint of one run.

  Args:
    log: print function for progress lines.
    stop_on_nonfinite_loss: a non-finite loss stops the run even with finite parameters.
    checkpoint_fn: ``checkpoint_fn(snapshot, run_meta)`` (None: nothing is saved), as the loop's.

  ``stop_signal`` is the signal that asked to stop (None: none); tests and the env rollout read it
  through :meth:`stop_requested`.
  """

  def __init__(
    self,
    *,
    log: Callable[[str], None],
    stop_on_nonfinite_loss: bool = True,
    checkpoint_fn: Callable | None = None,
  ):
    self.log = log
    self.stop_on_nonfinite_loss = stop_on_nonfinite_loss
    self.checkpoint_fn = checkpoint_fn
    self.stop_signal: int | None = None

  @contextlib.contextmanager
  def handle_signals(self) -> Iterator[None]:
    """SIGTERM/SIGINT → ``self.stop_signal``: the run finishes the current step, checkpoints it and
    raises :class:`TrainingInterrupted`. A second signal raises :class:`TrainingAborted` (a
    ``KeyboardInterrupt``) at once: a save in flight is abandoned, and its temporary directory is
    ignored and removed by the next run. Installed only in the main thread; the previous handlers
    are restored on exit. Re-entrant (``scripts/train.py`` also holds it while the last save is
    written)."""
    if threading.current_thread() is not threading.main_thread():
      yield
      return

    def handler(signum, frame):
      if self.stop_signal is not None:
        raise TrainingAborted(signum)
      self.stop_signal = signum
      # no print() here: the main thread may be inside one (reentrant call)
      msg = (
        f"\n{signal.Signals(signum).name} received: finishing the current step (or abandoning it while an "
        "environment call hangs), then writing a checkpoint and stopping; send it again to abort at once\n"
      )
      os.write(2, msg.encode())

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
      yield
    finally:
      for s, h in previous.items():
        signal.signal(s, h)

  def stop_requested(self) -> bool:
    """Whether SIGTERM/SIGINT asked to stop (this process; the env rollout polls it while an environment call
    runs, so a hung environment does not hold the signal back)."""
    return self.stop_signal is not None

  def requested_stop(self) -> int:
    """The signal that asks to stop (0: none), agreed by every process (a multi-host run stops at
    the same step everywhere: one tiny all-gather per step)."""
    signum = self.stop_signal or 0
    if jax.process_count() > 1:
      signum = int(np.max(multihost_utils.process_allgather(np.int32(signum))))
    return signum

  def stop_if_requested(self, step: int, snapshot: Callable, run_meta, *, saved: bool, trained: bool = True) -> None:
    """At a step boundary: after SIGTERM/SIGINT, checkpoint ``step`` (``snapshot()``, unless ``saved`` already,
    or nothing was ``trained`` since the run started) and raise :class:`TrainingInterrupted`. The
    checkpoint is handed to ``checkpoint_fn``, which may still be writing it: the message says
    "started", never "written" (``scripts/train.py`` waits for it and reports what is on disk)."""
    signum = self.requested_stop()
    if not signum:
      return
    name = signal.Signals(signum).name
    if not trained:
      what = "no step was trained since the start: nothing new to save"
    elif self.checkpoint_fn is None:
      what = "no checkpoint_fn: nothing saved"
    else:
      if not saved:
        self.checkpoint_fn(snapshot(), run_meta)
      # checkpoint_fn may write in the background: whether it completed is for its owner to say
      what = f"checkpoint of step {step} started; it is complete once it is written"
    self.log(f"{name}: stopping after step {step} ({what})")
    raise TrainingInterrupted(f"stopped by {name} after step {step} ({what})", signum=signum, step=step)

  def check_finite(self, metrics: Mapping[str, Any], train_state) -> None:
    """After a step: NonFiniteError when the updated state (or, with ``stop_on_nonfinite_loss``, the
    loss) is not finite — before ``checkpoint_fn`` could save it; a log line for other non-finite metrics."""
    step = int(metrics["step"])
    err = nonfinite_error(step, metrics, _first_nonfinite_state(train_state), stop_on_loss=self.stop_on_nonfinite_loss)
    if err is not None:
      raise err
    reward = metrics.get("reward_mean")
    if isinstance(reward, float) and math.isnan(reward):
      self.log(
        f"warning: step {step}: no finite reward in the batch (every reward NaN/inf: missing samples, nothing "
        "in the loss; reward_mean is NaN)"
      )
    bad = _nonfinite_metrics(metrics)
    if bad:
      self.log(
        f"warning: step {step}: non-finite metrics {', '.join(bad)}; the parameters are finite, training goes on"
      )

  def checkpoint_after_write_error(
    self, error: MetricsWriteError, last_saved: int, train_state, snapshot: Callable, run_meta
  ) -> MetricsWriteError:
    """After a failed metrics write (a full disk): a checkpoint attempt of the current step, unless it
    was saved already or its state is not finite. Returns ``error`` with the outcome in its message."""
    step = int(train_state.step)
    bad = _first_nonfinite_state(train_state) if jax.process_count() == 1 else None
    if self.checkpoint_fn is None:
      what = "no checkpoint_fn: nothing saved"
    elif step <= last_saved:
      what = f"step {step} was checkpointed already"
    elif jax.process_count() > 1:  # a save is collective; only process 0 writes the metrics
      what = f"step {step} not checkpointed: with several processes a save needs all of them"
    elif bad is not None:
      what = f"step {step} not checkpointed: {bad} is not finite"
    else:
      try:
        self.checkpoint_fn(snapshot(), run_meta)
        what = f"a checkpoint of step {step} was started"
      except Exception as ce:  # noqa: BLE001 - reported in the message; the write error stays the cause
        what = f"the checkpoint attempt of step {step} failed too: {' '.join(str(ce).split())[:500]}"
    return MetricsWriteError(
      f"{error}; training stopped after step {step} ({what})", path=error.path, step=step, reason=error.reason
    )
