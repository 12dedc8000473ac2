"""The training loop: rollout → reward → update, with evaluation, metrics and checkpoint hooks.

One step, through the rollout source (``jaxgrpo.loop.source``) and the step::

    prompt indices   = PromptIterator.next(prompts_per_step)             (every process: the same B)
    rollout          = collect.sample(policy_model(...), place_prompts(this process's prompts))
                                                                          (jitted, on the global mesh)
    mine             = distributed.process_rows(rollout)                  (this process's G·B/P rows)
    rewards          = RewardSet(prompts, completions, columns)           (host: this process's rows)
    [dynamic sampling: every process gathers the rewards (one small all-gather), drops the same
     groups with equal rewards, samples again, refills: collect.select_groups]
    batch            = feed.place(Batch(...), process_local=True)    (each process feeds its rows)
    batch            = reference(batch)                                   (make_reference; β > 0 only)
    state, metrics   = train_step(state, batch)                           (jitted, sharded)
    log → OUT/metrics.jsonl; every eval.every steps: pass@k / mean@k on the held-out set;
    every checkpoint.every steps (and at every evaluation when checkpoint.best_metric is set, so the
    best evaluated state is on disk): checkpoint_fn(snapshot, run_meta)

Several processes (docs/train.md, "Running on a pod / a cluster"): every process draws the same
prompt indices, decodes, scores and feeds only its own rows; what they must agree on (dynamic
sampling's rewards, metrics, evaluation counts) comes from small all-gathers, so the result equals a
one-process run on the same mesh. With ``rollout.max_staleness`` >= 1 or ``devices.rollout``,
``train_step`` is the learner's step of ``jaxgrpo.loop.async_rollout.AsyncRollouts`` (docs/trainer.md).

The run is a :class:`~jaxgrpo.run.specs.TrainerConfig`; the model and prompts are built by
``jaxgrpo.run.builders``, evaluation is ``jaxgrpo.run.evaluation.evaluate_policy``. Everything a resume needs
is explicit in :class:`TrainerState`: trained parameters, optimizer state and step
(``jaxgrpo.step.train.TrainState``), the PRNG key, the data-iterator position. Checkpoints go through
``jaxgrpo.services.checkpoint.Checkpointer``'s hooks with :func:`run_meta` (what identifies the run; a LoRA
run's base-weights fingerprint included). Failures and what each keeps: docs/failure_modes.md.

The loop only: the parts are built by ``jaxgrpo.run.assemble`` (checks, engine, data, rewards, optimizer),
the batch of a step comes from the rollout source (``jaxgrpo.loop.source.RolloutSource``: sampler ×
single- or multi-turn × dynamic sampling × engine correction) or the asynchronous producer
(``jaxgrpo.loop.async_rollout``), and signals, stop requests and finite checks are the run-control
service (``jaxgrpo.run.control``).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Mapping, NamedTuple

import jax
from flax import nnx

from jaxgrpo import data as data_lib
from jaxgrpo.loop import async_rollout
from jaxgrpo.loop.schedule import Learner, Synchronous
from jaxgrpo.models import lora
from jaxgrpo.parallel import distributed
from jaxgrpo.rollout.environments.rollout import RolloutInterrupted
from jaxgrpo.run import assemble, builders, teacher_remote
from jaxgrpo.run import teacher as teacher_lib
from jaxgrpo.run.collapse import (
  DEFAULT_GUARD,
  CollapseGuard,
  CollapseWatch,
  NoLearningSignal,
  PolicyCollapsed,
  SignalWatch,
)
from jaxgrpo.run.control import RunControl, TrainingAborted, TrainingInterrupted
from jaxgrpo.run.evaluation import evaluate_run
from jaxgrpo.run.specs import TrainerConfig
from jaxgrpo.services import runlock
from jaxgrpo.services.checkpoint import NonFiniteError, RunMeta, Snapshot, move_aside
from jaxgrpo.services.metrics import MetricsWriteError, append_record, truncate_jsonl
from jaxgrpo.step import feed
from jaxgrpo.step import train as train_lib

__all__ = [
  "Trainer",
  "TrainerState",
  "TrainingInterrupted",
  "TrainingAborted",
  "run_meta",
  "dropout_key",
  "IDENTITY_FIELDS",
  "GUARDED_FIELDS",
]

#: Config fields that change the parameter tree or the training prompts and their order: a
#: checkpoint written with other values is refused.
IDENTITY_FIELDS = (
  "model.path",
  "model.synthetic",
  "model.param_dtype",
  "lora",
  "data.dataset",
  "data.dataset_config",
  "data.split",
  "data.mapping",
  "data.arithmetic.max_operand",
  "data.arithmetic.train_size",
  "data.arithmetic.eval_size",
  "data.max_prompt_tokens",
  "data.instruction",
  "run.seed",
  "env.factory",
)
#: Config fields a resumed run must not change silently: refused unless explicitly allowed
#: (``Checkpointer(allow_changed=True)``, ``scripts/train.py --allow-changed-config``).
GUARDED_FIELDS = ("optim.learning_rate", "rollout.group_size")


def _get(d: Mapping[str, Any], path: str):
  for part in path.split("."):
    d = d.get(part) if isinstance(d, Mapping) else None
  return d


def run_meta(config: TrainerConfig, *, base_fingerprint: str | None = None) -> RunMeta:
  """What identifies a run for its checkpoints: :data:`IDENTITY_FIELDS`, :data:`GUARDED_FIELDS`,
  the whole config (``to_dict()``), which ``jaxgrpo.run.builders.load_policy`` rebuilds the model from,
  and, for a LoRA run, ``base_fingerprint`` (``models.lora.base_fingerprint`` of the frozen base
  weights, known once the model is built) as the ``builders.BASE_WEIGHTS`` fingerprint."""
  d = config.to_dict()
  return RunMeta(
    identity={p: _get(d, p) for p in IDENTITY_FIELDS},
    guarded={p: _get(d, p) for p in GUARDED_FIELDS},
    config=d,
    fingerprints={} if base_fingerprint is None else {builders.BASE_WEIGHTS: base_fingerprint},
  )


class TrainerState(NamedTuple):
  """The full resumable state: ``train`` (params, opt_state, step; and the frozen base weights of a
  LoRA run, which are not part of a snapshot), ``key`` (PRNG key of the next step) and
  ``data_position`` (``PromptIterator.state()``)."""

  train: train_lib.TrainState
  key: jax.Array
  data_position: dict

  def snapshot(self) -> Snapshot:
    """The state as a ``jaxgrpo.services.checkpoint.Snapshot`` (the same arrays, not copies; the trained
    parameters only: ``train.frozen`` is rebuilt, not saved)."""
    t = self.train
    return Snapshot(t.params, t.opt_state, t.step, self.key, self.data_position)

  @classmethod
  def from_snapshot(cls, snap: Snapshot, frozen=None) -> TrainerState:
    """The state held by a snapshot (e.g. a restored checkpoint), with the run's ``frozen`` variables."""
    train = train_lib.TrainState(snap.params, snap.opt_state, snap.step, frozen)
    return cls(train, snap.key, dict(snap.data_position))


class Trainer:
  """Builds the model, data, rewards, mesh and jitted steps from a :class:`~jaxgrpo.run.specs.TrainerConfig`;
  ``run()`` trains, logging to ``OUT/metrics.jsonl``.

  One job at ~310 lines: the loop's run control (build, step, evaluate, save, stop); what it builds is
  ``jaxgrpo.run.builders`` / ``assemble``, the rollout is ``jaxgrpo.loop.source``'s.

  Args:
    config: the run.
    checkpoint_fn: called as ``checkpoint_fn(snapshot: jaxgrpo.services.checkpoint.Snapshot, run: RunMeta)``
      every ``checkpoint.every`` steps and after the last step. The snapshot's arrays are donated to
      the next train step: the function must save or copy them before it returns.
    restore_fn: ``restore_fn(run: RunMeta, template: Snapshot) -> Snapshot | None``, called once at
      construction: the snapshot to resume from, or None to start fresh. ``template`` is the freshly
      built state (shapes, dtypes, shardings of this mesh).
    on_record: called with every metrics record (steps and evaluations), e.g. a
      ``jaxgrpo.services.metrics.MetricsLogger`` or ``Checkpointer.observe`` (best checkpoint by eval metric).
    reward_fns: extra/replacement reward functions ``{name: (fn, weight)}`` (plain callables
      ``(prompts, completions, **columns) -> list[float]``); None: ``config.reward.weights``.
    log: print function for progress lines (None: silent).
    progress: a tqdm bar with an ETA for the supervised warm-up instead of its ``log`` lines.
    stop_on_nonfinite_loss: stop (``NonFiniteError``) when a step's loss is NaN or infinite, even
      if the parameters are still finite. A non-finite parameter or optimizer state always stops.
    collapse_guard: ``jaxgrpo.run.collapse.CollapseGuard``: a policy that collapses with finite values
      (entropy near ln V, or a zero reward for N steps) stops the run
      (``jaxgrpo.run.collapse.PolicyCollapsed``, before the step is evaluated or saved) or logs a warning.
      Default: stop when the entropy reaches 95% of ln V. None: off.
  """

  def __init__(
    self,
    config: TrainerConfig,
    *,
    checkpoint_fn: Callable[[Snapshot, RunMeta], None] | None = None,
    restore_fn: Callable[[RunMeta, Snapshot], Snapshot | None] | None = None,
    reward_fns: Mapping[str, tuple] | None = None,
    log: Callable[[str], None] | None = print,
    progress: bool = False,
    on_record: Callable[[dict], None] | None = None,
    stop_on_nonfinite_loss: bool = True,
    collapse_guard: CollapseGuard | None = DEFAULT_GUARD,
  ):
    if not isinstance(config, TrainerConfig):
      raise TypeError(f"`config` must be a jaxgrpo.run.specs.TrainerConfig; got {type(config).__name__}")
    self.config = cfg = config
    assemble.check_before_build(cfg)  # the processes, the combination of options, vLLM's install
    self.objective = cfg.objective
    self.checkpoint_fn = checkpoint_fn
    self.on_record = on_record
    self.log = log or (lambda s: None)
    self.progress = progress
    self.collapse_guard = collapse_guard
    self.control = RunControl(log=self.log, stop_on_nonfinite_loss=stop_on_nonfinite_loss, checkpoint_fn=checkpoint_fn)
    self.mesh, self.rollout_mesh = async_rollout.make_meshes(cfg.devices)  # rollout_mesh: None colocated
    assemble.check_mesh_fits(cfg, self.mesh)
    self.teacher_mesh = async_rollout.make_teacher_mesh(cfg.devices)  # None: the teacher on the train mesh
    teacher_lib.check_teacher_devices(cfg, self.mesh, self.teacher_mesh, log=self.log)
    # the base model (HF weights, or the synthetic model after its warm-up), then the run's adapters
    # a run with checkpoints keeps the synthetic model's warmed-up base beside them: a resumed run reads it
    # instead of re-running the warm-up, and so do load_policy / export of a LoRA run
    checkpointed = checkpoint_fn is not None or restore_fn is not None
    base = builders.run_base_dir(cfg.run.out) if checkpointed else None
    self.model, self.tokenizer = builders.build_run_policy(
      cfg, mesh=self.mesh, log=self.log, base_dir=base, progress=progress
    )
    self.pad_id, self.eos_ids = builders.special_ids(self.tokenizer)
    self.data = assemble.build_data(cfg, self.tokenizer, self.model.config)
    fingerprint = None if cfg.lora is None else lora.base_fingerprint(self.model)
    self.run_meta = run_meta(cfg, base_fingerprint=fingerprint)
    self.accuracy, self.reward_set = assemble.build_rewards(cfg, reward_fns, mesh=self.mesh)  # RMs beside the policy
    self.optimizer = assemble.optimizer(cfg)
    trainable = nnx.Param if cfg.lora is None else nnx.LoRAParam  # LoRA: the adapters only
    self.graphdef, train_state, self.shardings = train_lib.init_train_state(
      self.model, self.optimizer, self.mesh, trainable=trainable
    )
    self.train_config = cfg.train_config()
    self.step_fn = train_lib.make_train_step(
      self.graphdef,
      self.optimizer,
      self.objective,
      mesh=self.mesh,
      shardings=self.shardings,
      train_config=self.train_config,
      dropout_key=None if cfg.lora is None else dropout_key(cfg.run.seed),
    )
    # the frozen reference, only when β > 0: a copy (the step donates the policy's parameters); LoRA: the
    # frozen base itself, no copy
    self.reference = feed.make_reference(self.step_fn, train_state) if self.step_fn.reads_ref_logp else None
    self.sampling = assemble.sampling_config(cfg, self.model, pad_id=self.pad_id, eos_ids=self.eos_ids)
    self.log(assemble.attention_line(cfg, self.mesh, self.data.prompt_len))
    if (line := assemble.precision_line(cfg, self.mesh)) is not None:
      self.log(line)
    engine = assemble.start_engine(cfg, self.model, prompt_len=self.data.prompt_len)
    # env: multi-turn rollouts in the environments of env.factory (jaxgrpo.loop.episodes)
    self.make_env = None if cfg.env is None else cfg.env.make_env()
    self.iterator = data_lib.PromptIterator(len(self.data.examples), seed=cfg.run.seed)
    # a distillation teacher (objective.distill): loaded, its tokenizer checked, placed on the train mesh or on
    # its own devices (devices.teacher); or served outside the run (a teacher server, vLLM: run.teacher_remote)
    self.teacher = None
    d = cfg.objective.distill
    if d is not None and d.teacher is not None and teacher_lib.teacher_source(d.teacher) in ("remote", "vllm"):
      self.teacher = teacher_remote.connect(
        cfg, self.tokenizer, student_vocab=self.model.config.vocab_size, train_config=self.train_config, log=self.log
      )
    elif d is not None:
      teacher_model = teacher_lib.build_teacher(cfg, self.tokenizer, log=self.log)
      self.teacher = feed.make_teacher(
        self.step_fn, teacher_model, student_vocab=self.model.config.vocab_size, mesh=self.teacher_mesh
      )
    self.source = assemble.rollout_source(
      cfg,
      policy=self.policy,
      sampling=self.sampling,
      mesh=self.mesh,
      iterator=self.iterator,
      data=self.data,
      tokenizer=self.tokenizer,
      reward_set=self.reward_set,
      pad_id=self.pad_id,
      engine=engine,
      make_env=self.make_env,
      should_stop=self.control.stop_requested,
      teacher=self.teacher,
    )
    self.learner = Learner(
      self.step_fn, self.reference, mesh=self.mesh, train_config=self.train_config, teacher=self.teacher
    )
    self.state = TrainerState(train_state, jax.random.key(cfg.run.seed), self.iterator.state())
    self.resumed = False
    if restore_fn is not None:
      restored = restore_fn(self.run_meta, self.state.snapshot())
      if restored is not None:
        self.state = TrainerState.from_snapshot(restored, train_state.frozen)
        self.iterator.restore(self.state.data_position)
        self.resumed = True
    #: how a step meets the source: synchronous, or bounded staleness with rollout.max_staleness >= 1 or
    #: devices.rollout (jaxgrpo.loop.schedule, jaxgrpo.loop.async_rollout)
    self.schedule = assemble.schedule(
      cfg, self.source, self.learner, self.state, rollout_mesh=self.rollout_mesh, resumed=self.resumed
    )

  # ------------------------------------------------------------------ what the parts hold
  prompts = property(lambda self: self.data.prompts, doc="The encoded training prompts (None for episodes).")
  examples = property(lambda self: self.data.examples, doc="The training rows.")
  eval_prompts = property(lambda self: self.data.eval_prompts, doc="The encoded held-out prompts.")
  eval_examples = property(lambda self: self.data.eval_examples, doc="The held-out rows (None: no evaluation).")
  prompt_len = property(lambda self: self.data.prompt_len, doc="The padded prompt length.")
  engine = property(lambda self: self.source.engine, doc="The rollout engine (the built-in one by default).")
  rollouts = property(
    lambda self: None if isinstance(self.schedule, Synchronous) else self.schedule,
    doc="The bounded-staleness schedule (``async_rollout.AsyncRollouts``), None when synchronous.",
  )

  @property
  def stop_signal(self) -> int | None:
    """The SIGTERM/SIGINT that asked the run to stop (None: none; ``RunControl.stop_signal``)."""
    return self.control.stop_signal

  @stop_signal.setter
  def stop_signal(self, signum: int | None) -> None:
    self.control.stop_signal = signum

  def close(self) -> None:
    """Shut the rollout engine down (``engine.close()``; the built-in one drops its reference to the policy)."""
    self.source.close()

  def policy(self) -> nnx.Module:
    """The current policy: the model with the state's parameters (and frozen base weights; no copy)."""
    return feed.policy_model(self.graphdef, self.state.train)

  def sampling_policy(self) -> nnx.Module:
    """What sampling and evaluation run: :meth:`policy`, or its ``models.lora.merge_lora`` with
    ``rollout.merge_lora`` (a plain model; a merged copy of the adapted weights while it lives)."""
    return self.source.sampling_policy()

  def handle_signals(self):
    """SIGTERM/SIGINT stop the run at the next step boundary (``RunControl.handle_signals``)."""
    return self.control.handle_signals()

  def _stop_if_requested(self, step: int, *, saved: bool, trained: bool = True) -> None:
    self.control.stop_if_requested(step, self.state.snapshot, self.run_meta, saved=saved, trained=trained)

  # ------------------------------------------------------------------ evaluation
  def evaluate(self, key=None) -> dict[str, float]:
    """mean@k (``eval_accuracy``) and ``eval_pass@k`` on the held-out set with k = eval_samples; with
    several processes each scores its share of the problems and the counts are gathered."""
    if self.eval_examples is None:
      return {}
    return evaluate_run(
      self.config,
      self.sampling_policy(),
      self.tokenizer,
      self.data,
      accuracy=self.accuracy,
      sampling=self.sampling,
      make_env=self.make_env,
      pad_id=self.pad_id,
      eos_ids=self.eos_ids,
      mesh=self.mesh,
      key=key,
      should_stop=self.control.stop_requested,
    )

  def save_model(self, out_dir: str) -> list[str]:
    """Writes the current policy as a Hugging Face directory (``builders.save_policy``); a LoRA run
    writes the merged model there and its adapters as a PEFT directory, ``<out_dir>-peft`` (on the
    synthetic model: with its base in ``<out_dir>-base``, which the PEFT directory names). With
    several processes every process must call it (they all take part in gathering parameters that
    span processes) and process 0 writes. Returns the directories written (none on other processes)."""
    return builders.save_run_model(self.config, self.graphdef, self.state.train, self.tokenizer, out_dir)

  # ------------------------------------------------------------------ the loop
  def train_step(self) -> dict[str, Any]:
    """One rollout → reward → update step of the run's schedule (:attr:`schedule`); returns its metrics
    (the same on every process)."""
    out = self.schedule.step(self.state)
    self.state = TrainerState(out.train, out.key, out.data_position)
    return out.metrics

  def run(self, *, handle_signals: bool = True) -> list[dict]:
    """Trains for ``run.steps`` steps; writes ``OUT/metrics.jsonl`` and ``OUT/config.json``;
    returns the logged records. A resumed run first cuts ``metrics.jsonl`` back to its step.

    Args:
      handle_signals: turn SIGTERM/SIGINT into a stop at the next step boundary
        (:meth:`handle_signals`; main thread only).
    Raises:
      jaxgrpo.services.runlock.RunDirLocked: another process runs in ``run.out`` (process 0 holds the
        directory's lock while it runs; re-entrant within one process).
      NonFiniteError: a step made the parameters or optimizer state (or the loss) non-finite.
      jaxgrpo.run.collapse.PolicyCollapsed: the policy collapsed with finite values (``collapse_guard``).
      jaxgrpo.run.collapse.NoLearningSignal: every advantage was 0, or no reward finite, for
        ``run.max_zero_advantage_steps`` consecutive steps (raised before that step is evaluated or saved).
      jaxgrpo.services.metrics.MetricsWriteError: writing ``metrics.jsonl`` (or ``on_record``) failed, e.g. a
        full disk; a checkpoint of the current step was attempted first (the message says how it went).
      TrainingInterrupted: SIGTERM/SIGINT; the step it stopped at was checkpointed. The signal
        waits for the current step to finish (rollout, update, and the evaluation when one is due).

    With several processes the run is watched (``jaxgrpo.parallel.distributed.watch_hosts`` with
    ``devices.host_timeout_s``): when another process dies or raises, this one prints a message
    naming it and exits (``os._exit``, status ``jaxgrpo.parallel.distributed.EXIT_HOST_FAILED``); an exception
    of this process is reported to the others before it propagates. ``NonFiniteError``,
    ``PolicyCollapsed`` and ``TrainingInterrupted`` are raised by every process at the same step and
    are not reported.
    """
    watch = distributed.watch_hosts(
      self.config.devices.host_timeout_s,
      collective=(NonFiniteError, PolicyCollapsed, NoLearningSignal, TrainingInterrupted),
    )
    with self.handle_signals() if handle_signals else contextlib.nullcontext(), watch:
      return self._run()

  def _run(self) -> list[dict]:
    cfg, run = self.config, self.config.run
    is_main = jax.process_index() == 0
    lock = runlock.RunLock(run.out).acquire() if is_main else None  # one run per directory (jaxgrpo.services.runlock)
    records: list[dict] = []
    path = os.path.join(run.out, "metrics.jsonl")
    start = last_saved = int(self.state.train.step)
    f = _open_outputs(cfg, start, resumed=self.resumed, log=self.log, lock=lock) if is_main else None

    def emit(rec):
      records.append(rec)
      try:
        if self.on_record is not None:
          self.on_record(rec)
      except OSError as e:  # e.g. TensorBoard files on a full disk
        raise MetricsWriteError.of(e, path=os.path.join(run.out, "(on_record)"), step=rec["step"]) from e
      if f is not None:
        append_record(f, rec, path=path)

    every = lambda n, step: (n and step % n == 0) or step == run.steps
    guard = self.collapse_guard
    collapse = CollapseWatch(guard, self.model.config.vocab_size) if guard and guard.action != "off" else None
    learning = SignalWatch(run.max_zero_advantage_steps)  # a run that cannot learn stops (jaxgrpo.run.collapse)
    try:
      if self.eval_examples is not None and start == 0:
        try:
          ev = self.evaluate()
        except RolloutInterrupted:  # a signal while an environment call of the evaluation hung
          self._stop_if_requested(start, saved=False, trained=False)
          raise
        emit({"step": 0, **ev})
        self.log(f"step 0 eval {_fmt(ev)}")
      self._stop_if_requested(start, saved=False, trained=False)  # a signal during the first evaluation
      for _ in range(start, run.steps):
        try:
          m = self.train_step()
        except RolloutInterrupted:  # a signal while an environment call hung: the step is abandoned
          done = int(self.state.train.step)
          self._stop_if_requested(done, saved=done == last_saved, trained=done > start)
          raise
        emit(m)
        step = m["step"]
        if every(run.log_every, step):
          self.log(
            f"step {step} loss {m['loss']:.4f} reward {m['reward_mean']:.3f} kl {m['kl']:.4f} "
            f"len {m['completion_length']:.1f} {m['tokens_per_sec']:.0f} tok/s"
          )
        self.control.check_finite(m, self.state.train)  # before anything of this step is evaluated or saved
        if collapse is not None:
          collapse.check(m, self.log)  # a collapse with finite values (jaxgrpo.run.collapse)
        learning.check(m)
        evaluated = self.eval_examples is not None and every(cfg.eval.every, step)
        if evaluated:
          try:
            ev = self.evaluate()
          except RolloutInterrupted:  # the step is trained: checkpoint it, then stop
            self._stop_if_requested(step, saved=False)
            raise
          emit({"step": step, **ev})
          self.log(f"step {step} eval {_fmt(ev)}")
        # an evaluated step is also saved when the best checkpoint by an eval metric is kept
        best = evaluated and cfg.checkpoint.best_metric is not None
        saved = self.checkpoint_fn is not None and bool(every(cfg.checkpoint.every, step) or best)
        if saved:
          self.checkpoint_fn(self.state.snapshot(), self.run_meta)
          last_saved = step
        self._stop_if_requested(step, saved=saved)
      if run.save_model:
        self.save_model(os.path.join(run.out, "model"))
    except MetricsWriteError as e:  # disk full: try to keep the steps done, then stop
      raise self.control.checkpoint_after_write_error(
        e, last_saved, self.state.train, self.state.snapshot, self.run_meta
      ) from e.__cause__
    finally:
      self.schedule.close()
      if f is not None:
        f.close()
      self.accuracy.close()
      if lock is not None:
        lock.release()
    return records


def _open_outputs(cfg: TrainerConfig, start: int, *, resumed: bool, log, lock) -> Any:
  """Process 0's outputs: ``metrics.jsonl`` opened unbuffered (a failed write leaves nothing behind; a resumed
  run first drops the records after its step and a cut last line; a run from step 0 moves an earlier run's
  records aside to ``metrics.jsonl.earlier-<UTC time>``, never truncating them) and ``config.json`` written. A full disk
  here is one ``MetricsWriteError`` line (the run lock released), not a traceback."""
  path = os.path.join(cfg.run.out, "metrics.jsonl")
  f = None
  try:
    if resumed:  # drop records of steps after the restored checkpoint, and a cut last line
      dropped = truncate_jsonl(path, start)
      if dropped:
        log(f"{path}: dropped {dropped} line(s) after step {start} or cut short (resuming from step {start})")
    if not resumed and os.path.isfile(path) and os.path.getsize(path):  # an earlier run's: never truncated
      log(
        f"{path}: the records of an earlier run were moved aside to {move_aside(path, 'earlier')} (starting from "
        f"step {start})"
      )
    f = open(path, "ab" if resumed else "wb", buffering=0)
    with open(os.path.join(cfg.run.out, "config.json"), "w") as cf:
      json.dump(cfg.to_dict(), cf, indent=1)
  except OSError as e:  # a full disk at the start: one line, not a traceback
    if f is not None:
      f.close()
    lock.release()
    raise MetricsWriteError.of(e, path=path, step=start) from e
  return f


def dropout_key(seed: int) -> jax.Array:
  """The run's LoRA adapter-dropout key: ``fold_in(key(seed), "drop")``, a stream of its own (the
  step folds in the step, pass and row, ``jaxgrpo.step.train.make_train_step``), so a resumed run
  draws the same masks."""
  return jax.random.fold_in(jax.random.key(seed), _DROPOUT_STREAM)


_DROPOUT_STREAM = 0x64726F70  # "drop"


def _fmt(d: Mapping[str, float]) -> str:
  return " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items())
