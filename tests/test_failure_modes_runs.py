"""Failure modes of real training runs (``python scripts/train.py`` in child processes; the tiny
arithmetic run of test_checkpoint_resume.py, whose two reference runs are shared; the signal runs
have the verifier in its worker process):

* a NaN: the run stops (exit 1) naming the step and the first non-finite metric, nothing
  non-finite is saved and the last good checkpoint is kept (before: exit 0, NaN checkpoints, the
  good ones deleted by keep-last-K);
* a step directory without its manifest: two scheduler restarts both succeed and the result equals
  the uninterrupted run (before: StepAlreadyExistsError at every restart);
* disk full (a small tmpfs, where mounting is allowed) and an injected write error (a file-size
  limit set on the running child with prlimit): reported at once with the step, path and OS
  error, a few lines instead of Orbax's tracebacks; stop (exit 1) or, with --on-save-error
  continue, go on; the last good checkpoint is kept;
* SIGTERM during a background save and SIGINT mid-run: the step is finished and checkpointed, the
  run exits 128 + signal, and resuming gives exactly the uninterrupted run; a second SIGINT aborts
  at once; no verifier worker outlives the trainer (one run stopped by each in turn, resumed after
  each stop);
* bad inputs (truncated or garbage safetensors, a mesh that fits neither the devices nor the model
  nor the batch): exit 2 with one ``error:`` line, no traceback, no stray "cannot schedule new
  futures after interpreter shutdown";
* a collapse with finite values (learning rate 1e6: entropy → ln V): the run stops naming the step,
  the good checkpoints are kept (before: exit 0, keep-last-K deleted them);
* a second run into the same ``--out``: refused in one line naming the first one's pid and host
  (before: both exit 0, overwriting each other); a SIGKILLed holder releases the lock;
* a full disk while writing ``metrics.jsonl``: one line, a checkpoint of the current step, and a
  resumed run that drops the line cut short (before: a raw traceback, no checkpoint);
* a corrupt newest step: quarantined and the previous one resumed (``--on-corrupt stop``: one line
  naming the recovery) (before: exit 2 at every restart);
* ``scripts/eval.py --checkpoint`` on an empty or damaged run: one ``error:`` line, exit 2.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import RUN_XLA_FLAGS, cli_env, script_main_here
from test_checkpoint_resume import (
  ARGS,
  ROOT,
  TRAIN,
  _assert_same_records,
  _params,
  _records,
  reference_runs,
  stored_warm_up,
)

from jaxgrpo.run.builders import export_hf
from jaxgrpo.services import checkpoint as ck
from jaxgrpo.services import runlock

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import eval as eval_cli  # noqa: E402  (scripts/eval.py)
import train as train_cli  # noqa: E402  (scripts/train.py)

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]
EVAL = os.path.join(ROOT, "scripts", "eval.py")

# the runs of test_checkpoint_resume.py (its reference runs are shared), without TensorBoard (as those)
RUN_ARGS = [*ARGS, "--no-tensorboard"]
# the signal runs: the verifier in its worker process (reward.timeout_s set), whose lifetime they check,
# and TensorBoard on: every sink of a real run is open when the signal comes
SIGNAL_ARGS = [("10" if i and ARGS[i - 1] == "--reward.timeout-s" else a) for i, a in enumerate(ARGS)]
assert SIGNAL_ARGS != ARGS


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  return cli_env(tmp_path_factory.mktemp("xla_cache"), xla_flags=RUN_XLA_FLAGS)  # one configuration, ~25 runs


def _cmd(out, steps, *extra, args=RUN_ARGS):
  return [sys.executable, TRAIN, *args, "--run.out", str(out), "--run.steps", str(steps), *extra]


def _run(env, out, steps, *extra, expect=0):
  r = subprocess.run(_cmd(out, steps, *extra), env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert r.returncode == expect, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
  return r


@pytest.fixture(scope="module")
def runs(env, tmp_path_factory):
  """The uninterrupted 6-step run (``straight``), and a separate run stopped after 3 steps (``three``,
  checkpoints 1-3): test_checkpoint_resume.py's, built once per session. Copy before changing."""
  return reference_runs(env, tmp_path_factory)


def _complete(out):
  return ck.complete_steps(str(out / "checkpoints"), log=None)


def _no_temporary_dirs(out):
  return not [n for n in os.listdir(out / "checkpoints") if ck.TMP_SUFFIX in n]


def _assert_same_as_straight(runs, out, extra_evals=()):
  """Bit-identical parameters and metrics; ``extra_evals``: steps where an intermediate run ended
  (every run evaluates after its last step; the uninterrupted one did not there)."""
  want, got = _params(runs / "straight"), _params(out)
  assert want.keys() == got.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  records = [r for r in _records(out) if not ("eval_accuracy" in r and r["step"] in extra_evals)]
  _assert_same_records(records, _records(runs / "straight"))


def _clean_failure(stderr: str):
  assert "Traceback" not in stderr, stderr[-3000:]
  assert "cannot schedule new futures" not in stderr, stderr[-3000:]
  assert len(stderr.strip().splitlines()) <= 4, stderr[-3000:]


# ----------------------------------------------------------------------------- NaN


def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(runs, env, tmp_path):
  """Resumed with an absurd learning rate (allowed explicitly): the parameters become NaN a step or
  two later. Before: exit 0, checkpoints 7 and 8 full of NaN, the good ones deleted (keep 2)."""
  out = tmp_path / "run"
  shutil.copytree(runs / "three", out)
  r = _run(env, out, 8, "--optim.learning-rate", "1e30", "--allow-changed-config", "--checkpoint.keep", "2", expect=1)
  m = re.search(
    r"error: training stopped at step (\d+): non-finite values; first non-finite metric: (\S+) = ([-a-z]+)", r.stderr
  )
  assert m, r.stderr[-3000:]
  bad, metric = int(m.group(1)), m.group(2)
  assert bad >= 4 and m.group(3) in ("nan", "inf", "-inf")
  assert "Nothing of step" in r.stderr and f"the last complete checkpoint is step {bad - 1}" in r.stderr
  _clean_failure(r.stderr)
  done = _complete(out)
  assert done and done[-1] == bad - 1 and all(s < bad for s in done), done
  for s in done:
    ck.verify_step(str(out / "checkpoints" / str(s)))
  params = _params(out)  # the latest complete checkpoint: finite
  assert all(np.isfinite(v).all() for v in params.values())
  last = _records(out)[-1]  # the bad step's record was written, with the non-finite value
  assert last["step"] == bad and not np.isfinite(last[metric])


# ----------------------------------------------------------------------------- manifest-less step


def test_step_without_manifest_restarts_twice_and_finishes(runs, env, tmp_path):
  """What a kill between Orbax's rename and the manifest write left with --checkpoint.async_save false (older
  versions): step 3 without its manifest. Before: resume from 2, StepAlreadyExistsError on saving
  3, at every restart."""
  out = tmp_path / "run"
  shutil.copytree(runs / "three", out)
  os.remove(out / "checkpoints" / "3" / ck.MANIFEST)
  r = _run(env, out, 5, "--checkpoint.async-save", "false")
  assert re.search(r"checkpoints/3 has no jaxgrpo_manifest.json .*moved aside to \S+/3\.incomplete-", r.stdout)
  assert re.search(r"resumed from checkpoint \S+ \(step 2\)", r.stdout)
  r = _run(env, out, 6, "--checkpoint.async-save", "false")  # the second restart
  assert re.search(r"resumed from checkpoint \S+ \(step 5\)", r.stdout)
  assert _complete(out) == [4, 5, 6]
  assert [n for n in os.listdir(out / "checkpoints") if ".incomplete-" in n]  # kept for inspection
  _assert_same_as_straight(runs, out, extra_evals=(5,))


# ----------------------------------------------------------------------------- failed saves


def _step_bytes(step_dir) -> int:
  """Disk usage of a checkpoint step (allocated blocks, as a tmpfs counts them)."""
  return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(step_dir) for f in fs)


def test_disk_full_on_a_small_tmpfs(runs, env, tmp_path):
  """OUT/checkpoints on a tmpfs that holds the stored warm-up and two checkpoints but not a third (keep 2: the
  third save needs room next to both). Before: silent, then ~480 lines of Orbax traceback at the next save."""
  out = tmp_path / "run"
  mnt = out / "checkpoints"
  mnt.mkdir(parents=True)
  # the warm-up's base, two steps and half of a third: halfway between what keep 2 holds after step 2 and what the
  # third save needs next to both; a tmpfs counts ~5% more than ext4's blocks (measured: a step 315 KiB vs 299 KiB)
  ref = runs / "three" / "checkpoints"
  step_bytes = max(_step_bytes(ref / str(s)) for s in (1, 2, 3))
  size = -(-(_step_bytes(ref / "base") + int(2.5 * 1.1 * step_bytes)) // 4096) * 4096
  m = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True)
  if m.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here: {m.stderr.strip()}")
  try:
    stored_warm_up(runs, out)  # on the tmpfs, where a fresh run writes it
    r = _run(env, out, 6, "--checkpoint.keep", "2", expect=1)
    failed = re.search(r"error: checkpoint save of step (\d+) failed: ENOSPC \(No space left on device\)", r.stdout)
    assert failed, r.stdout[-3000:]  # reported at once, in the log
    step = int(failed.group(1))
    assert step == 3, r.stdout[-3000:]  # steps 1 and 2 fit next to the base
    assert f"checkpoint save of step {step} failed: ENOSPC" in r.stderr and "Training stops" in r.stderr
    assert f"while writing {mnt}/{step}" in r.stderr
    _clean_failure(r.stderr)
    assert "ERROR:absl" not in r.stdout + r.stderr  # Orbax's own tracebacks are not shown
    done = _complete(out)
    assert done == [step - 2, step - 1] and _no_temporary_dirs(out), (done, sorted(os.listdir(mnt)))
    for s in done:
      ck.verify_step(str(mnt / str(s)))
  finally:
    subprocess.run(["umount", str(mnt)], check=False)


def test_injected_write_error_with_on_save_error_continue(runs, env, tmp_path):
  """A file-size limit put on the running child (prlimit; no mount rights needed) makes its next
  checkpoint write fail with EFBIG; lifted again once the failure was reported. With
  --on-save-error continue the run goes on, the next saves succeed and it exits 0 with a warning."""
  out = tmp_path / "run"
  stored_warm_up(runs, out)
  proc = subprocess.Popen(
    _cmd(out, 6, "--checkpoint.keep", "2", "--on-save-error", "continue"),
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    cwd=ROOT,
  )
  lines, limited, reported = [], False, None
  for line in proc.stdout:
    lines.append(line)
    if line.startswith("step 3 loss") and not limited:
      resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (16 * 1024, resource.RLIM_INFINITY))
      limited = True
    if line.startswith("error: checkpoint save of step") and reported is None:
      reported = line
      resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
  stderr = proc.stderr.read()
  proc.wait(timeout=600)
  assert proc.returncode == 0, "".join(lines[-30:]) + stderr[-3000:]
  assert reported and "EFBIG (File too large)" in reported and "Training continues" in reported, reported
  step = int(re.search(r"save of step (\d+)", reported).group(1))
  assert step in (2, 3)  # the limit landed during or after step 2's background write
  assert re.search(rf"warning: 1 checkpoint save\(s\) failed \(steps \[{step}\]", stderr), stderr
  assert _complete(out) == [5, 6] and _no_temporary_dirs(out)
  _assert_same_as_straight(runs, out)  # a failed save changes nothing in training


# ----------------------------------------------------------------------------- signals


def _descendants(pid: int) -> list[int]:
  """Every process below ``pid`` (from /proc)."""
  parent = {}
  for d in os.listdir("/proc"):
    if d.isdigit():
      try:
        with open(f"/proc/{d}/stat") as f:
          parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
      except OSError:
        continue
  out, todo = [], [pid]
  while todo:
    p = todo.pop()
    kids = [c for c, pp in parent.items() if pp == p]
    out += kids
    todo += kids
  return out


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _signal_run(env, out, *extra, after: str, signals: list[int], gap: float = 0.05):
  """Starts (or resumes) a 6-step run with the verifier worker, sends ``signals`` (``gap`` s apart) once
  a stdout line starts with ``after``; returns (exit status, stdout, stderr, the trainer's child
  processes, seconds to exit, whether a save was being written when the first signal was sent)."""
  proc = subprocess.Popen(
    _cmd(out, 6, *extra, args=SIGNAL_ARGS), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
  )
  lines, children, t0, mid_save = [], [], time.monotonic(), None
  for line in proc.stdout:
    lines.append(line)
    if line.startswith(after):
      children = _descendants(proc.pid)
      t0 = time.monotonic()
      for i, s in enumerate(signals):
        if i:
          time.sleep(gap)
        os.kill(proc.pid, s)
      mid_save = not _no_temporary_dirs(out)
      break
  rest, stderr = proc.communicate(timeout=600)
  assert mid_save is not None, f"no line starting with {after!r}:\n{''.join(lines)[-3000:]}\n{stderr[-3000:]}"
  return proc.returncode, "".join(lines) + rest, stderr, children, time.monotonic() - t0, mid_save


def _assert_no_child_left(children):
  assert children, "the verifier worker was not running"
  t0 = time.monotonic()
  while any(_alive(c) for c in children) and time.monotonic() - t0 < 20:
    time.sleep(0.1)
  assert not [c for c in children if _alive(c)], "processes outlived the trainer"


def test_signals_stop_cleanly_and_every_resume_is_exact(runs, env, tmp_path):
  """One run stopped by each signal scenario in turn, resumed after each stop, then finished; every
  stop must leave no verifier worker behind, and the finished run must equal the uninterrupted one bit
  for bit (so every resume was exact; each one also says which step it resumed from).

  1. SIGTERM right after step 2's background save started (usually while it is written). Before: exit
     by the signal (-15 here), the save abandoned, nothing said.
  2. Resumed with no periodic checkpoints (checkpoint.every 0), SIGINT once the next step is logged:
     the step is finished and checkpointed. Before: SIGINT lost every step done since the resume.
  3. Resumed, two SIGINTs 50 ms apart once a checkpoint was started: abort at once. The first one's
     stop (finish the step, checkpoint it) can complete inside those 50 ms when the step was nearly
     done: then the second signal finds no process and the run is a plain first-signal stop. That
     attempt says nothing about the second signal, so it is repeated (at most three times, each from
     a fresh copy of the directory that scenario 2 left).
  4. Resumed to the end."""
  out = tmp_path / "run"
  # 1. SIGTERM during a background save (a fresh run with its warm-up: the verifier worker starts meanwhile; without
  # it, step 0's evaluation met a worker still starting at load 22 and recorded a timeout the reference run has not)
  code, stdout, stderr, children, _, mid_save = _signal_run(
    env, out, after="checkpoint: step 2 ", signals=[signal.SIGTERM]
  )
  print(f"SIGTERM sent while step 2 was being written: {mid_save}")
  assert code == 128 + signal.SIGTERM, f"{code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
  m = re.search(r"stopped by SIGTERM after step (\d+); checkpoint of step \1 complete", stderr)
  assert m and "SIGTERM received: finishing the current step" in stderr, stderr
  term = int(m.group(1))
  assert term >= 2 and f"SIGTERM: stopping after step {term} (checkpoint of step {term} started;" in stdout
  assert _complete(out)[-2:] == [term - 1, term] and _no_temporary_dirs(out)  # the save in flight was finished
  for s in _complete(out):
    ck.verify_step(str(out / "checkpoints" / str(s)))
  _assert_no_child_left(children)

  # 2. SIGINT mid-run without periodic checkpoints
  code, stdout, stderr, children, _, _ = _signal_run(
    env, out, "--checkpoint.every", "0", after=f"step {term + 1} loss", signals=[signal.SIGINT]
  )
  assert code == 128 + signal.SIGINT, f"{code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
  assert re.search(rf"resumed from checkpoint \S+ \(step {term}\)", stdout)
  m = re.search(r"stopped by SIGINT after step (\d+); checkpoint of step \1 complete", stderr)
  assert m, stderr
  stop = int(m.group(1))
  # the one checkpoint since the resume is the signal's
  assert stop > term and [s for s in _complete(out) if s > term] == [stop] and "Traceback" not in stderr
  _assert_no_child_left(children)

  # 3. a second SIGINT aborts at once
  before = tmp_path / "before_second_sigint"
  shutil.copytree(out, before)
  for attempt in range(3):
    run = tmp_path / f"run{attempt}"
    shutil.copytree(before, run)
    code, stdout, stderr, children, seconds, _ = _signal_run(
      env, run, after=f"checkpoint: step {stop + 1} ", signals=[signal.SIGINT, signal.SIGINT]
    )
    if "stopped by SIGINT" not in stderr:
      break
    print(f"attempt {attempt}: the first SIGINT's stop finished before the second signal; again")
  assert code == 128 + signal.SIGINT, f"{code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
  assert re.search(rf"resumed from checkpoint \S+ \(step {stop}\)", stdout)
  # "the checkpoint being written is abandoned" only while a save is in flight (it may have finished by now)
  assert re.search(r"aborted by SIGINT: (the checkpoint being written is abandoned; )?the latest", stderr)
  assert "Traceback" not in stderr
  assert "stopped by SIGINT" not in stderr  # it did not wait for the step and its checkpoint
  print(f"second SIGINT: exited {seconds:.2f} s after the first signal")
  _assert_no_child_left(children)
  done = _complete(run)
  # what is said is true (before: "SIGINT: stopped after step 2 (checkpoint of step 2 written)" with
  # step 2's background write abandoned by the second signal)
  claimed = [int(n) for n in re.findall(r"checkpoint of step (\d+) (?:written|complete)", stdout + stderr)]
  assert set(claimed) <= set(done), (claimed, done, stdout[-2000:])
  assert (
    f"the latest complete checkpoint is step {done[-1]} ({run}/checkpoints/{done[-1]}): the next run resumes" in stderr
  )

  # 4. an abandoned save is ignored; the run resumes from the latest complete step and ends as the
  # uninterrupted run did
  r = _run(env, run, 6)
  assert re.search(rf"resumed from checkpoint \S+ \(step {done[-1]}\)", r.stdout)
  _assert_same_as_straight(runs, run)


# ----------------------------------------------------------------------------- bad inputs


@pytest.fixture(scope="module")
def hf_dir(runs, tmp_path_factory):
  """An HF directory (weights + tokenizer) exported from the 3-step run."""
  out = tmp_path_factory.mktemp("hf") / "model"
  export_hf(str(runs / "three"), str(out))
  return out


def _bad_run(env, out, *extra, here=False):
  """``scripts/train.py`` with bad inputs: exit 2, one ``error:`` line (returned), nothing heavy run. ``here``:
  through its ``main`` in this process (the same code path and output, without a child's start-up), for the
  cases of a family whose other case runs in a child."""
  argv = [*RUN_ARGS, "--run.out", str(out), "--run.steps", "2", *extra]
  if here:
    code, stdout, stderr = script_main_here(train_cli.main, argv)
  else:
    r = subprocess.run([sys.executable, TRAIN, *argv], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    code, stdout, stderr = r.returncode, r.stdout, r.stderr
  assert code == 2, f"exit {code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
  _clean_failure(stderr)
  (line,) = [x for x in stderr.splitlines() if x.startswith("error:")]
  assert "supervised warm-up" not in stdout  # refused before anything heavy
  return line


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_bad_safetensors_one_clear_line(hf_dir, env, tmp_path, damage):
  model = tmp_path / "model"
  shutil.copytree(hf_dir, model)
  path = model / "model.safetensors"
  if damage == "truncated":
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) * 2 // 3)
    want = r"tensor '\S+' in \S+model.safetensors: its bytes \[\d+, \d+\) run past the end .* the file is truncated"
  else:
    path.write_bytes(os.urandom(4096))
    want = r"\S+model.safetensors is not a valid safetensors file"
  hf_args = ["--model.synthetic", "null", "--model.path", str(model), "--data.arithmetic.sft_steps", "0"]
  # the truncated file in a child (exit status, stderr, interpreter shutdown), the garbage one through main here
  assert re.search(want, _bad_run(env, tmp_path / "out", *hf_args, here=damage == "garbage"))


def test_mesh_that_does_not_fit_one_clear_line(env, tmp_path):
  line = _bad_run(env, tmp_path / "a", "--devices.mesh", "tensor=3", here=True)  # this process: 1 device
  assert "mesh spec 'tensor=3' has 3 devices" in line and "there are 1 devices" in line
  line = _bad_run(env, tmp_path / "b", "--devices.mesh", "fsdp=-1", "--cpu-devices", "3")  # width 32 over 3
  assert re.search(r"devices.mesh 'fsdp=-1' \(3 devices\) does not fit: \S+: dim \d \('embed', size 32\)", line)
  assert "mesh data=1 × fsdp=3 × tensor=1 over 3 devices" in line
  line = _bad_run(env, tmp_path / "c", "--devices.mesh", "data=3", "--cpu-devices", "3")  # 2 prompts × 4 = 8 rows
  assert "devices.mesh 'data=3' (3 devices) does not fit: the rollout batch" in line and "size 8" in line


# ----------------------------------------------------------------------------- collapse without NaN


def _policy_entropy(step_dir) -> float:
  """The mean next-token entropy (nats) of the policy saved in ``step_dir`` on a few token sequences, from its
  logits with NumPy (H = -Σ p log p; the run's own entropy metric is not used)."""
  from jaxgrpo.run.builders import load_policy

  model, _, _ = load_policy(str(step_dir))
  tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (4, 12)).astype(np.int32)
  hidden, _ = model(tokens, np.broadcast_to(np.arange(12), (4, 12)))
  z = np.asarray(model.logits(hidden), np.float64)
  logp = z - z.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  return float(-(np.exp(logp) * logp).sum(-1).mean())


def test_collapse_without_nan_stops_and_keeps_the_good_checkpoints(runs, env, tmp_path):
  """Resumed with a learning rate of 1e6: the parameters stay finite but the policy becomes uniform
  (entropy = ln 128, reward 0). The guard trips at step N, whose metrics measure the policy step N - 1 left:
  that checkpoint is moved aside and the message names step N - 2, checked good from its own logits. Before:
  exit 0, and keep-last-2 deleted steps 3 and 4 in favour of collapsed ones; then (issue 46) checkpoint
  N - 1, as collapsed as step N, was kept and named "the last complete checkpoint"."""
  out = tmp_path / "run"
  shutil.copytree(runs / "three", out)
  r = _run(env, out, 8, "--optim.learning-rate", "1e6", "--allow-changed-config", "--checkpoint.keep", "2", expect=1)
  m = re.search(r"error: training stopped at step (\d+): the policy collapsed \(entropy (\S+) nats is", r.stderr)
  assert m, r.stderr[-3000:]
  bad = int(m.group(1))
  assert bad >= 5 and float(m.group(2)) >= 0.95 * np.log(128)
  assert f"Nothing of step {bad} was saved" in r.stderr
  assert re.search(rf"the checkpoint of step {bad - 1} was moved aside to \S+/{bad - 1}\.collapsed-", r.stderr)
  assert f"the last good checkpoint is step {bad - 2} ({out}/checkpoints/{bad - 2})" in r.stderr
  _clean_failure(r.stderr)
  assert _complete(out) == [bad - 2]
  (aside,) = [n for n in os.listdir(out / "checkpoints") if n.startswith(f"{bad - 1}.collapsed-")]
  condemned = tmp_path / "condemned" / "checkpoints" / str(bad - 1)  # a step directory again, to load it
  shutil.copytree(out / "checkpoints" / aside, condemned)
  assert _policy_entropy(condemned) >= 0.95 * np.log(128)  # the moved-aside policy is the collapsed one
  assert _policy_entropy(out / "checkpoints" / str(bad - 2)) < 0.5 * np.log(128)  # the named one is good


# ----------------------------------------------------------------------------- one run per directory


def test_second_run_into_the_same_out_is_refused(runs, env, tmp_path):
  """Two real runs into one --out. Before: both exit 0, the newest checkpoint holds the second run's
  tensors and metrics.jsonl interleaves both. The lock goes with a SIGKILLed holder. The first run is
  suspended (SIGSTOP, as by Ctrl-Z) once step 1 is logged: it keeps its lock, and it neither spends
  the CPU the second run's start-up needs nor finishes while the second one starts."""
  out = tmp_path / "run"
  stored_warm_up(runs, out)
  # 500 steps: still running while the second run starts (it is killed below)
  first = subprocess.Popen(_cmd(out, 500), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
  try:
    for line in first.stdout:
      if line.startswith("step 1 loss"):
        os.kill(first.pid, signal.SIGSTOP)
        break
    metrics_before = (out / "metrics.jsonl").read_bytes()
    r = _run(env, out, 6, expect=2)
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert f"error: {out} is in use by another run: pid {first.pid} on host {socket.gethostname()}" in line
    assert "use another --run.out" in line and "resolved config" not in r.stdout  # refused before anything ran
    _clean_failure(r.stderr)
    assert (out / "metrics.jsonl").read_bytes() == metrics_before  # the holder is stopped: any change is the second's
  finally:
    first.kill()  # SIGKILL: no handler, no finally
    first.communicate(timeout=60)
  with runlock.RunLock(out) as lock:  # the kernel released the lock with the process
    assert lock.held


# ----------------------------------------------------------------------------- disk full: metrics


def _fill(path) -> None:
  """Writes ``path`` until its file system has no byte left."""
  with open(path, "wb", buffering=0) as f:
    for chunk in (1 << 16, 4096, 1):
      try:
        while True:
          f.write(b"\0" * chunk)
      except OSError:
        pass


def test_disk_full_while_writing_metrics(runs, env, tmp_path):
  """OUT on a small tmpfs (its checkpoints on a roomy one), filled up after step 1: the records go
  on into the last page of metrics.jsonl until it is full (usually step 3 or 4), then one is cut.
  Before: a raw traceback, a line cut at the page boundary, no checkpoint of that step."""
  out = tmp_path / "run"
  out.mkdir()
  m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out)], capture_output=True, text=True)
  if m.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here: {m.stderr.strip()}")
  mounts = [out]
  try:
    (out / "checkpoints").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(out / "checkpoints")], check=True)
    mounts.append(out / "checkpoints")
    stored_warm_up(runs, out)
    proc = subprocess.Popen(
      _cmd(out, 6, "--no-tensorboard"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    lines = []
    for line in proc.stdout:
      lines.append(line)
      if line.startswith("step 1 loss"):
        _fill(out / "filler")
        break
    rest, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1, "".join(lines[-20:]) + rest[-2000:] + stderr[-3000:]
    m = re.search(
      rf"error: writing the metrics of step (\d) to {out}/metrics.jsonl failed: ENOSPC \(No space left on device\); "
      r"training stopped after step \1 \(a checkpoint of step \1 was started\)\. checkpoint of step \1 complete in ",
      stderr,
    )
    assert m, stderr[-3000:]
    full = int(m.group(1))
    assert 2 <= full <= 6
    _clean_failure(stderr)
    assert _complete(out)[-1] == full
    cut = not (out / "metrics.jsonl").read_bytes().endswith(b"\n")
    print(f"the disk filled at step {full}; metrics.jsonl ended with a cut line: {cut}")
    os.remove(out / "filler")
    r = _run(env, out, 6, "--no-tensorboard")
    assert re.search(rf"resumed from checkpoint \S+ \(step {full}\)", r.stdout)
    lines = (out / "metrics.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b""
    records = [json.loads(x) for x in lines[:-1]]  # every line whole: a cut one was dropped
    steps = [x["step"] for x in records if "loss" in x]
    assert steps == [s for s in range(1, 7) if s != full]  # the record that did not fit was never written
    want, got = _params(runs / "straight"), _params(out)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  finally:
    for mnt in reversed(mounts):
      subprocess.run(["umount", str(mnt)], check=False)


# ----------------------------------------------------------------------------- corrupt newest step


def test_corrupt_newest_step_is_quarantined_and_the_run_resumes(runs, env, tmp_path):
  """Step 3 without its meta item. Before: exit 2 at every restart, with no recovery hint."""
  out = tmp_path / "run"
  shutil.copytree(runs / "three", out)
  os.remove(out / "checkpoints" / "3" / "meta" / "metadata")
  r = _run(env, out, 4, "--on-corrupt", "stop", expect=2)
  (line,) = [x for x in r.stderr.splitlines() if x.strip()]  # one line
  assert line.startswith(f"error: checkpoint {out}/checkpoints/3 is corrupt: meta/metadata: missing. Recovery: ")
  assert "move it aside" in line and "e.g. --step 2" in line and "--on-corrupt quarantine" in line
  _clean_failure(r.stderr)
  assert "supervised warm-up" not in r.stdout and _complete(out) == [1, 2, 3]  # refused before any work
  r = _run(env, out, 4)
  assert re.search(rf"WARNING: checkpoint {out}/checkpoints/3 is corrupt \(.*meta/metadata: missing", r.stdout)
  assert re.search(
    r"moved aside to \S+/3\.corrupt-\S+ \(kept, not deleted\); resuming from the previous complete step 2", r.stdout
  )
  assert re.search(r"resumed from checkpoint \S+ \(step 2\)", r.stdout)
  assert _complete(out) == [2, 3, 4]
  (aside,) = [n for n in os.listdir(out / "checkpoints") if n.startswith("3.corrupt-")]
  assert (out / "checkpoints" / aside / "params").is_dir()  # nothing deleted


# ----------------------------------------------------------------------------- eval.py


@pytest.mark.parametrize("damage", ["empty", "meta/metadata", "params/_METADATA"])
def test_eval_on_an_empty_or_damaged_run_one_clear_line(runs, env, tmp_path, damage):
  out = tmp_path / "run"
  if damage == "empty":
    out.mkdir()
  else:
    shutil.copytree(runs / "three", out)
    os.remove(out / "checkpoints" / "3" / damage)
  argv = ["--checkpoint", str(out), "--arithmetic"]
  if damage == "empty":  # in a child: exit status, stderr, interpreter shutdown
    r = subprocess.run([sys.executable, EVAL, *argv], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    code, stdout, stderr = r.returncode, r.stdout, r.stderr
  else:  # the damaged runs through scripts/eval.py's main in this process: the same code path and output
    code, stdout, stderr = script_main_here(eval_cli.main, argv)
  assert code == 2, f"exit {code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
  _clean_failure(stderr)
  (line,) = [x for x in stderr.splitlines() if x.strip()]
  if damage == "empty":
    assert line == f"error: no complete checkpoint in {out}"
  else:
    assert "checkpoints/3" in line and "Recovery: move it aside" in line and "e.g. --step 2" in line
