#!/usr/bin/env python
"""Train a policy with GRPO / λ-GRPO / FRPO / λ-FRPO on a math set.

    python scripts/train.py --config scripts/configs/demo.yaml                 # offline CPU demo
    python scripts/train.py --config scripts/configs/lambda_grpo_openrs.yaml --devices.mesh fsdp=-1 --run.out runs/x

Every field of ``jaxgrpo.run.specs.TrainerConfig`` can be overridden on the command line as
``--section.field value`` (or ``--section.field=value``; dashes and underscores are interchangeable),
e.g. ``--rollout.group_size 8 --objective.beta 0.04 --model.synthetic.hidden_size 32``, on top of
``--config`` or, without it, of the defaults (the arithmetic demo). A key of the earlier flat config
(``--steps``, ``--out``, ``--beta``, ...) is an error naming its dotted form (``--run.steps``). Values are
parsed as YAML, so ``--reward.weights '{accuracy: 1.0, format: 0.1}'``, ``--optim.learning_rate 1e-6``
and ``--eval.dataset null`` work (``nan``/``inf`` are numbers, refused as non-finite). Every value is
checked before anything is built. The resolved config is printed at start and
written to ``OUT/config.json``; metrics go to ``OUT/metrics.jsonl`` (one JSON object per step and per
evaluation) and ``OUT/curves.png``.

Several processes (``docs/train.md``, "Running on a pod / a cluster"): ``--processes N`` starts N
processes on this machine (gloo CPU collectives, ``--cpu-devices D`` each; ``scripts/_launch.py``); on a
pod or cluster every host runs the same command with ``--devices.distributed true`` and
``jax.distributed.initialize()`` reads the cluster's settings (TPU, Slurm, MPI, or ``JAX_*`` variables /
``--devices.coordinator_address``, ``--devices.num_processes``, ``--devices.process_id``).

Exit status (``docs/failure_modes.md``): 0 done; 1 training stopped by non-finite values, a collapsed
policy (``--on-collapse``; the checkpoint holding the collapsed policy is moved aside), a run that cannot learn
(``run.max_zero_advantage_steps``), a failed
checkpoint save or a failed metrics write (a full disk: the current step is checkpointed first); 2 a bad config, file, mesh or checkpoint, or ``OUT`` in use by another run (its lock,
``jaxgrpo.services.runlock``, names the holder's pid and host) (one ``error:`` line, no traceback;
``--traceback`` shows it); 3 (several processes) another process died or failed: this one was stopped,
naming it; 128 + signal number after SIGTERM (143) or SIGINT (130): the step in progress was finished
and checkpointed, or, after a second signal, abandoned.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import signal
import sys
import time
import traceback


def _simulated_cpu_devices(argv) -> None:
  """``--cpu-devices N`` sets XLA_FLAGS, which JAX reads when it is imported: before the imports below."""
  for i, tok in enumerate(argv):
    n = tok.partition("=")[2] if tok.startswith("--cpu-devices=") else None
    if tok == "--cpu-devices" and i + 1 < len(argv):
      n = argv[i + 1]
    if n:
      flag = f"--xla_force_host_platform_device_count={int(n)}"
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
      os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":
  if any(a == "--processes" or a.startswith("--processes=") for a in sys.argv[1:]):
    import _launch  # scripts/_launch.py: N processes of this script; jax is never imported here

    sys.exit(_launch.launch(os.path.abspath(__file__), *_launch.split_args(sys.argv[1:])))
  _simulated_cpu_devices(sys.argv[1:])

from jaxgrpo.tasks import script_io  # noqa: E402

script_io.hide_torch_banner()  # before transformers is imported: jaxgrpo needs no torch

import jax  # after XLA_FLAGS

from jaxgrpo import data as data_lib
from jaxgrpo import plan as plan_lib
from jaxgrpo.parallel import distributed
from jaxgrpo.rollout.environments import EnvironmentFailed
from jaxgrpo.run import collapse, specs
from jaxgrpo.run.collapse import NoLearningSignal, PolicyCollapsed
from jaxgrpo.run.trainer import Trainer, TrainingAborted, TrainingInterrupted, run_meta
from jaxgrpo.services import _orbax_noise, checkpoint, metrics, runlock
from jaxgrpo.services.checkpoint import CheckpointSaveError, NonFiniteError
from jaxgrpo.services.metrics import MetricsWriteError
from jaxgrpo.step.teacher_remote import TeacherProtocolError, TeacherUnavailable


class _Parser(argparse.ArgumentParser):
  """Usage errors in one line (``train.py: error: ...``), without the usage block first: the message names
  the flag and its fix; ``--help`` shows the usage."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def parse_args(argv=None):
  """``(args, overrides)``: the script's own flags, and ``{dotted config key: value}`` for every
  ``--key value`` (checked against the config; a key that is not a field is an error naming the
  dotted key it most likely means)."""
  p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
  p.add_argument("--config", help="YAML config file (sections of jaxgrpo.run.specs.TrainerConfig)")
  p.add_argument(
    "--resume",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="resume from the latest complete checkpoint in OUT/checkpoints (default: on when there is one)",
  )
  p.add_argument(
    "--allow-changed-config",
    action="store_true",
    help="resume even when the learning rate or group size differ from the checkpoint's",
  )
  p.add_argument(
    "--tensorboard",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="TensorBoard event files in OUT/tensorboard (default: on when tensorboardX is installed)",
  )
  p.add_argument("--wandb", default=None, metavar="PROJECT", help="log to this Weights & Biases project")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument(
    "--cpu-devices",
    type=int,
    default=None,
    help="simulate N CPU devices (sets XLA_FLAGS before jax is imported; on the command line only)",
  )
  p.add_argument("--no-plot", action="store_true", help="do not write OUT/curves.png")
  p.add_argument(
    "--plan-only",
    action="store_true",
    help="compile the run's programs for this machine's devices from abstract inputs (no weight or data read), "
    "print what each needs per device (jaxgrpo.plan; scripts/plan.py for other targets) and exit: 0 every program "
    "fits, 1 one does not (its fix printed)",
  )
  p.add_argument(
    "--no-plan-check",
    action="store_true",
    help="on an accelerator, skip compiling the train step and the sampler ahead of time before anything is loaded "
    "(the check that refuses a program that cannot fit, in one line naming the fix)",
  )
  p.add_argument(
    "--processes",
    type=int,
    default=None,
    help="start N processes of this command on this machine (gloo CPU collectives, --cpu-devices each); "
    "on the command line only",
  )
  p.add_argument(
    "--on-save-error",
    choices=("stop", "continue"),
    default="stop",
    help="a failed checkpoint save (disk full, I/O error) is reported at once; then stop (default, exit 1) "
    "or keep training and try again at the next save",
  )
  p.add_argument(
    "--on-corrupt",
    choices=checkpoint.ON_CORRUPT,
    default="quarantine",
    help="a corrupt latest checkpoint (a file missing or altered): move it aside to <step>.corrupt-<time> and "
    "resume from the previous complete one (default), or stop (exit 2)",
  )
  p.add_argument(
    "--on-nonfinite-loss",
    choices=("stop", "continue"),
    default="stop",
    help="stop (default, exit 1) or go on when a step's loss is NaN/inf while the parameters are still finite "
    "(non-finite parameters or optimizer state always stop; they are never saved)",
  )
  p.add_argument(
    "--on-collapse",
    choices=collapse.ACTIONS,
    default="stop",
    help="a policy that collapses with finite values (entropy near ln V, see --collapse-entropy-frac and "
    "--collapse-zero-reward-steps): stop before the step is saved (default, exit 1), warn, or off",
  )
  p.add_argument(
    "--collapse-entropy-frac",
    type=float,
    default=0.95,
    help="collapsed when the entropy reaches this fraction of ln V after it was at most ln V / 2 (default 0.95)",
  )
  p.add_argument(
    "--collapse-zero-reward-steps",
    type=int,
    default=0,
    help="collapsed after N consecutive steps of zero mean reward that follow a non-zero one (default 0: off)",
  )
  p.add_argument(
    "--traceback",
    action="store_true",
    help="show Python tracebacks and the libraries' own error logs instead of one 'error:' line",
  )
  args, rest = p.parse_known_args(argv)
  if args.processes is not None:
    p.error("--processes starts the processes: give it on the command line of scripts/train.py")
  if args.cpu_devices and f"device_count={args.cpu_devices}" not in os.environ.get("XLA_FLAGS", ""):
    p.error("--cpu-devices is read before jax is imported: give it on the command line of scripts/train.py")
  return args, parse_overrides(p, rest)


def parse_overrides(p: argparse.ArgumentParser, rest) -> dict:
  """``{dotted config key: value}`` of the ``--section.field value`` tokens ``rest`` (``p.error`` for a token that
  is not one, or a key that is not a field); ``scripts/plan.py`` reads its overrides with it too."""
  overrides = {}
  i = 0
  while i < len(rest):
    tok = rest[i]
    if not tok.startswith("--"):
      p.error(f"unexpected argument {tok!r}")
    key, eq, text = tok[2:].partition("=")
    key = key.replace("-", "_")
    if not eq:
      if i + 1 >= len(rest):
        p.error(f"--{key} needs a value")
      text = rest[i + 1]
      i += 1
    try:
      overrides[key] = specs.parse_override(key, text)
    except ValueError as e:
      p.error(str(e))
    i += 1
  return overrides


def plot_curves(metrics_path: str, png_path: str) -> bool:
  """Reward (per step) and held-out accuracy (per evaluation) curves; False without matplotlib."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed (pip install 'jaxgrpo[plot]'): no curves.png")
    return False
  recs = metrics.read_jsonl(metrics_path)
  steps = [r for r in recs if "reward_mean" in r]
  held = "eval_env_reward" if any("eval_env_reward" in r for r in recs) else "eval_accuracy"
  evals = [r for r in recs if held in r]
  fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
  ax[0].plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], lw=1)
  ax[0].set(xlabel="step", ylabel="mean reward", title="training reward")
  keys = {k for r in evals for k in r if k.startswith("eval_pass@") or k == held}
  for key in sorted(keys - {"eval_pass@1"}):  # pass@1 equals mean@k
    ax[1].plot(
      [r["step"] for r in evals if key in r],
      [r[key] for r in evals if key in r],
      "o-",
      label="mean@k" if key == held else key[5:],
    )
  if held == "eval_accuracy":
    ax[1].set(xlabel="step", ylabel="held-out accuracy", title="evaluation", ylim=(0, 1))
  else:  # an env run: the mean environment reward, whose range is the environment's
    ax[1].set(xlabel="step", ylabel="held-out environment reward", title="evaluation")
  ax[1].legend()
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
  return True


class CliExit(SystemExit):
  """Exit status ``code`` after the message was printed to stderr; ``str()`` is the message."""

  def __init__(self, code: int, message: str):
    super().__init__(code)
    self.message = message

  def __str__(self) -> str:
    return self.message


def _check_local_files(cfg) -> None:
  """Exit 2 with one line when ``data.dataset``, ``eval.dataset``, ``model.path`` or a ``reward.sources`` path
  names a local path (a path, not a hub id: ``jaxgrpo.data``'s rule) that does not exist — checked before
  anything is printed or built; what the files hold is checked where they are read."""

  model_path = cfg.model.path
  for field, source in (
    ("data.dataset", cfg.data.dataset),
    ("eval.dataset", cfg.eval.dataset),
    ("model.path", model_path),
    *((f"reward.sources[{s.name!r}].path", s.path) for s in cfg.reward.sources if s.path),
  ):
    if source and data_lib.looks_local(source) and not os.path.exists(os.path.expanduser(source)):
      _fail(2, f"error: config field `{field}`: no such file or directory: {source}")


def _check_steps_left(at: int | None, steps: int, directory: str, say) -> None:
  """A resumed run whose checkpoint (step ``at``) is already past ``run.steps`` would train nothing and exit 0:
  refused (ValueError: exit 2, one line). At exactly ``run.steps`` the run is complete: said, and it ends."""
  if at is None:
    return
  if at > steps:
    raise ValueError(
      f"`run.steps`={steps} but the checkpoint in {directory} is at step {at}: nothing would be trained. To "
      f"train further, give --run.steps above {at}; to start over with {steps} steps, use another --run.out"
    )
  if at == steps:
    say(
      f"the checkpoint in {directory} is at step {at} = run.steps: the run is complete, nothing to train "
      f"(give --run.steps above {at} to train further)"
    )


def _fail(code: int, message: str):
  print(message, file=sys.stderr, flush=True)
  raise CliExit(code, message)


#: what a bad config, file, mesh or checkpoint raises while the run is set up (exit 2, one line)
_INPUT_ERRORS = (checkpoint.CheckpointError, ValueError, TypeError, OSError, ImportError)


@contextlib.contextmanager
def _input_errors(args, *cleanup):
  """Turns the errors of bad inputs into one ``error:`` line and exit status 2 (``--traceback``:
  the Python traceback). ``cleanup`` runs first (e.g. closing the checkpointer, so that no
  background thread outlives the error)."""
  try:
    yield
  except _INPUT_ERRORS as e:
    for c in cleanup:
      _quietly(c)
    if args.traceback:
      raise
    _fail(2, f"error: {e}")


def _quietly(close) -> BaseException | None:
  """Runs ``close()``; returns what it raised (Exception only) instead of raising it."""
  try:
    close()
  except Exception as e:  # noqa: BLE001 - returned to the caller, which reports it
    return e
  return None


def _latest(ckpt) -> str:
  steps = ckpt.steps()
  if not steps:
    return f"there is no complete checkpoint in {ckpt.directory}"
  return f"the last complete checkpoint is step {steps[-1]} ({os.path.join(ckpt.directory, str(steps[-1]))})"


def _save_traceback(out: str, error: BaseException) -> str:
  """Appends ``error``'s traceback (its causes included) to ``OUT/error.log``; returns the path."""
  path = os.path.join(out, "error.log")
  with open(path, "a") as f:
    f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
    f.write("".join(traceback.format_exception(error)))
  return path


#: what stops a run early with one ``error:`` line (or the signal's line), after the checkpointer was closed
#: (the traceback in OUT/error.log for an environment's)
_STOPS = (
  TrainingInterrupted,
  NonFiniteError,
  PolicyCollapsed,
  NoLearningSignal,
  CheckpointSaveError,
  MetricsWriteError,
  EnvironmentFailed,
  TeacherUnavailable,
  TeacherProtocolError,
)


def _set_aside_condemned(ckpt, error: PolicyCollapsed) -> None:
  """The checkpoint of the step whose policy the collapse guard condemned (``error.condemned``: the metrics of
  ``error.step`` measure it) moved aside, so that neither the message nor the next run takes it as good."""
  try:
    error.set_aside = ckpt.set_aside(
      error.condemned, "collapsed", f"holds the policy that collapsed at step {error.step}"
    )
  except Exception:  # noqa: BLE001 - a failed save of that step: it is not complete, nothing to move
    error.set_aside = None


def _after_collapse(ckpt, error: PolicyCollapsed) -> str:
  """What the message of a collapse adds: the condemned checkpoint moved aside, the last good one (or none)."""
  moved = getattr(error, "set_aside", None)
  what = f"the checkpoint of step {error.condemned} was moved aside to {moved}; " if moved else ""
  steps = ckpt.steps()
  if not steps:
    return (
      what + f"there is no checkpoint from before the collapse in {ckpt.directory}: start again with other settings"
    )
  good = os.path.join(ckpt.directory, str(steps[-1]))
  return (
    what + f"the last good checkpoint is step {steps[-1]} ({good}): run again with other settings to resume from it"
  )


def _report(error: BaseException, ckpt) -> CliExit:
  """Exit status and final message of a run that stopped early (after the checkpointer was closed)."""
  if isinstance(error, TrainingInterrupted):
    name = signal.Signals(error.signum).name
    done = error.step in ckpt.steps()
    what = (
      f"checkpoint of step {error.step} complete in {ckpt.directory}: run the same command again to resume"
      if done
      else _latest(ckpt)
    )
    msg = f"stopped by {name} after step {error.step}; {what}"
    print(msg, file=sys.stderr, flush=True)
    return CliExit(128 + error.signum, msg)
  if isinstance(error, PolicyCollapsed):
    msg = f"error: {error} ({_after_collapse(ckpt, error)})"
  elif isinstance(error, (NonFiniteError, NoLearningSignal, TeacherUnavailable, TeacherProtocolError)):
    msg = f"error: {error} ({_latest(ckpt)})"
  elif isinstance(error, EnvironmentFailed):  # the user's environment raised: its traceback goes to a file
    log_path = _save_traceback(os.path.dirname(ckpt.directory), error)
    msg = f"error: {error}; training stopped ({_latest(ckpt)}); the traceback is in {log_path} (--traceback shows it)"
  elif isinstance(error, MetricsWriteError):  # a full disk: say whether the steps done were kept
    kept = (
      f"checkpoint of step {error.step} complete in {ckpt.directory}" if error.step in ckpt.steps() else _latest(ckpt)
    )
    msg = (
      f"error: {error}. {kept}: free space (df -h {os.path.dirname(error.path)}), then run the same command "
      "again to resume (a line cut short at the end of metrics.jsonl is dropped then)"
    )
  else:  # CheckpointSaveError: its message says what is kept
    msg = f"error: {error}"
  print(msg, file=sys.stderr, flush=True)
  return CliExit(1, msg)


def _peak_rss_mib() -> float:
  """This process's peak resident memory so far (``ru_maxrss``: KiB on Linux), in MiB."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None):
  t_wall, t_cpu = time.perf_counter(), time.process_time()
  args, overrides = parse_args(argv)
  if not args.traceback:  # Orbax logs each failed write with its traceback; the checkpointer reports it in one line
    _orbax_noise.hide_failed_save_tracebacks()  # absl at CRITICAL, TensorStore's noise off stderr
  with _input_errors(args):
    cfg = specs.load_config(args.config, overrides)
  dev = cfg.devices
  if dev.distributed:  # before any JAX computation; arguments, then JAX_* variables, then TPU/Slurm/MPI
    heartbeat = max(10, int(2 * dev.host_timeout_s))  # JAX's own timeout after the watchdog's named stop
    distributed.initialize(dev.coordinator_address, dev.num_processes, dev.process_id, heartbeat_timeout=heartbeat)
  # another process's death or error stops this one with a message naming it (exit status 3)
  if args.plan_only:
    return _plan_only(args, cfg)
  with distributed.watch_hosts(
    dev.host_timeout_s, collective=(TrainingInterrupted, NonFiniteError, PolicyCollapsed, NoLearningSignal)
  ):
    return _train(args, cfg, t_wall, t_cpu)


def _plan_only(args, cfg):
  """``--plan-only``: the plan's table for this machine's devices; exit 1 (the one-line fix) when a program does
  not fit."""
  say = (lambda s: print(s, flush=True)) if jax.process_index() == 0 else (lambda s: None)
  with _input_errors(args):
    plan = plan_lib.plan_run(cfg, plan_lib.parse_target("devices"), log=say)
  say(plan_lib.format_table(plan))
  if plan.refusal:
    _fail(1, f"error: {plan.refusal}")
  return []


def _check_fits(args, cfg, say) -> None:
  """On an accelerator: compile the train step and the sampler for the run's mesh from abstract inputs before any
  weight or datum is loaded (``jaxgrpo.plan``); one that cannot fit stops the run (exit 2) in one line naming the
  change that fits, found by compiling, instead of an out-of-memory error after minutes of loading."""
  if args.no_plan_check or jax.default_backend() == "cpu":
    return
  with _input_errors(args):
    plan = plan_lib.plan_run(cfg, plan_lib.parse_target("devices"), programs=("step", "sampler"), log=say)
  if plan.refusal:
    _fail(2, f"error: {plan.refusal} (--no-plan-check skips this check)")


def _train(args, cfg, t_wall: float, t_cpu: float):
  """The run, holding ``run.out``'s lock (process 0) until it ends: a second run into the same directory is refused
  (exit 2) while this one runs, and a later one — another process, or ``main`` called again in this one — may
  resume from it once it returned or raised (a process that dies releases the lock with it)."""
  out = cfg.run.out
  lock = None
  if jax.process_index() == 0:
    try:
      lock = runlock.RunLock(out).acquire()
    except runlock.RunDirLocked as e:
      _fail(2, f"error: {e}")
    except OSError as e:  # a file of that name, no permission, a read-only file system: one line
      what = "is a file, not a directory" if os.path.isfile(out) else f"cannot be created ({e.strerror})"
      _fail(2, f"error: config field `run.out`: {out} {what}: name a directory (created when missing)")
  try:
    return _train_locked(args, cfg, t_wall, t_cpu)
  finally:
    if lock is not None:
      lock.release()


def _train_locked(args, cfg, t_wall: float, t_cpu: float):
  out = cfg.run.out
  has_checkpoint = checkpoint.has_checkpoint(out)
  resume = has_checkpoint if args.resume is None else args.resume  # on by default when OUT has one
  start_over = not resume and has_checkpoint  # allowed when every checkpoint is corrupt: they are moved aside
  if start_over and any(p is None for p in checkpoint.step_problems(checkpoint.checkpoint_dir(out)).values()):
    _fail(
      2,
      f"error: {checkpoint.checkpoint_dir(out)} holds checkpoints of an earlier run and --no-resume "
      f"was given: use another --run.out, or delete them to start over (nothing was overwritten)",
    )
  is_main = jax.process_index() == 0
  say = (lambda s: print(s, flush=True)) if is_main else (lambda s: None)
  _check_local_files(cfg)  # a config error before the resolved-config dump, not after it
  say("resolved config:\n" + json.dumps(cfg.to_dict(), indent=1))
  say(f"objective: {cfg.objective}")
  say(f"devices: {jax.device_count()} ({jax.devices()[0].platform}), processes: {jax.process_count()}")
  _check_fits(args, cfg, say)  # an accelerator: a program that cannot fit is refused before anything is loaded
  ck = cfg.checkpoint
  global _CHECKPOINTS
  _CHECKPOINTS = checkpoint.checkpoint_dir(out)
  with _input_errors(args):
    ckpt = checkpoint.Checkpointer(
      checkpoint.checkpoint_dir(out),
      max_to_keep=ck.keep,
      best_metric=ck.best_metric,
      async_save=ck.async_save,
      log=say,
      allow_changed=args.allow_changed_config,
      on_save_error=args.on_save_error,
      on_corrupt=args.on_corrupt,
    )
  global _CHECKPOINTER
  _CHECKPOINTER = ckpt
  _orbax_noise.hide_unretrieved_writes(ckpt.directory)  # asyncio's records of a failed save's sibling writes
  if start_over:  # --no-resume and every checkpoint corrupt: moved aside (kept), the run starts from step 0
    with _input_errors(args, ckpt.close):
      ckpt.set_aside_corrupt()
  with _input_errors(args, ckpt.close):  # bad files, a mesh that does not fit, a checkpoint that does not match
    guard = collapse.CollapseGuard(
      action=args.on_collapse,
      entropy_frac=args.collapse_entropy_frac,
      zero_reward_steps=args.collapse_zero_reward_steps,
    )
    if resume:  # refuse a mismatching checkpoint before the model is built
      _check_steps_left(ckpt.check_run(run_meta(cfg)), cfg.run.steps, ckpt.directory, say)
    trainer = Trainer(
      cfg,
      log=say,
      progress=is_main and not args.no_progress,
      checkpoint_fn=ckpt.checkpoint_fn,
      restore_fn=ckpt.restore_fn if resume else None,
      stop_on_nonfinite_loss=args.on_nonfinite_loss == "stop",
      collapse_guard=guard,
    )
  tensorboard = args.tensorboard
  if tensorboard is None:
    tensorboard = importlib.util.find_spec("tensorboardX") is not None
  with _input_errors(args, ckpt.close):
    logger = metrics.MetricsLogger(
      out,
      total_steps=cfg.run.steps,
      start_step=int(trainer.state.train.step),
      progress=not args.no_progress,
      tensorboard=tensorboard,
      wandb_project=args.wandb,
      config=cfg.to_dict(),
    )
  trainer.on_record = lambda rec: (ckpt.observe(rec), logger(rec))
  if not args.no_progress:
    trainer.log = ckpt.log = logger.write if is_main else (lambda s: None)  # above the progress bar
  stopped = None
  with trainer.handle_signals():  # also while the last checkpoint is written
    try:
      records = trainer.run()
    except _STOPS as e:
      stopped = e
      if isinstance(e, PolicyCollapsed):
        _set_aside_condemned(ckpt, e)
    except KeyboardInterrupt:  # a second signal: exit at once, without waiting for the save in flight
      raise
    except BaseException:  # a bug or a reward error: its traceback, after the save in flight is on disk
      _quietly(ckpt.close)
      _quietly(logger.close)
      raise
    # wait for the save in flight, also after a stop: no background thread outlives main
    closing = [e for e in (_quietly(ckpt.close), _quietly(logger.close)) if e is not None]
  if stopped is None and closing:
    stopped = closing[0]
  if stopped is not None:
    if args.traceback or not isinstance(stopped, _STOPS):
      raise stopped
    raise _report(stopped, ckpt)
  if trainer.stop_signal is not None:
    say(f"{signal.Signals(trainer.stop_signal).name} received after the last step: the run is complete")
  if is_main:
    failed = ckpt.failed_saves
    if failed:
      print(
        f"warning: {len(failed)} checkpoint save(s) failed (steps {[f.step for f in failed]}; "
        f"--on-save-error continue); {_latest(ckpt)}",
        file=sys.stderr,
      )
    held = "eval_accuracy" if cfg.env is None else "eval_env_reward"
    evals = [r for r in records if held in r]
    if len(evals) >= 2:
      what = "" if cfg.env is None else " environment reward"
      print(
        f"held-out{what} mean@{cfg.eval.samples}: {evals[0][held]:.3f} (step {evals[0]['step']}) "
        f"-> {evals[-1][held]:.3f} (step {evals[-1]['step']})"
      )
    if not args.no_plot:
      png = os.path.join(out, "curves.png")
      if plot_curves(os.path.join(out, "metrics.jsonl"), png):
        print(f"wrote {png}")
    print(
      f"total: {time.perf_counter() - t_wall:.0f} s wall, {time.process_time() - t_cpu:.0f} s CPU "
      f"(all threads of this process), peak RSS {_peak_rss_mib():.0f} MiB"
    )
  return records


#: the run's checkpoint directory once known, and its checkpointer once built (what _abort reports)
_CHECKPOINTS: str | None = None
_CHECKPOINTER = None


def _abort(signum: int) -> None:
  """After a second signal (or Ctrl-C before training started): exit at once, without waiting for
  a save in flight (its temporary directory is ignored and removed by the next run). Says which
  checkpoint is complete on disk at this moment, the one the next run resumes from."""
  name = signal.Signals(signum).name
  if _CHECKPOINTS is None:
    where = "nothing was saved yet"
  else:
    steps = checkpoint.complete_steps(_CHECKPOINTS, log=None)
    where = (
      f"the latest complete checkpoint is step {steps[-1]} ({os.path.join(_CHECKPOINTS, str(steps[-1]))}): "
      "the next run resumes from it"
      if steps
      else f"there is no complete checkpoint in {_CHECKPOINTS}: the next run starts from step 0"
    )
  writing = _CHECKPOINTER is not None and _CHECKPOINTER.writing  # before: said so always (also in the warm-up)
  abandoned = "the checkpoint being written is abandoned; " if writing else ""
  print(f"\naborted by {name}: {abandoned}{where}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(128 + signum)


def _exit_multiprocess(code: int) -> None:
  """Several processes: exit now with ``code``. A normal exit would wait in JAX's shutdown barrier for
  processes that already stopped (the watchdog told them about this one's failure)."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


if __name__ == "__main__":
  # Ctrl-C before the run installs its own handlers (loading, the warm-up): exit from the handler itself. Raised as a
  # KeyboardInterrupt it was lost when it landed in a finalizer (Python ignores an exception in ``__del__``; seen
  # in regex's ``Group.__del__`` during the tokenizer's build), and the run went on.
  signal.signal(signal.SIGINT, lambda signum, frame: _abort(signum))
  try:
    result = main()
  except TrainingAborted as e:
    _abort(e.signum)
  except KeyboardInterrupt:
    _abort(signal.SIGINT)
  except SystemExit as e:
    if jax.distributed.is_initialized() and e.code not in (None, 0):
      _exit_multiprocess(e.code if isinstance(e.code, int) else 1)
    raise
  except BaseException:
    if not jax.distributed.is_initialized():
      raise
    traceback.print_exc()
    _exit_multiprocess(1)
  sys.exit(0 if result is not None else 1)
