"""Environments under faults, in process with a real (tiny) policy: a step that hangs past ``env.step_timeout``
ends its trajectory and counts in ``env_timeouts``; a reset that hangs raises a TimeoutError naming the bound; an
exception is logged once per type and place with the user's frame and counted per type; ``fail_fast`` re-raises
it; ``should_stop`` interrupts a rollout waiting on a hung environment within a fraction of a second."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from helpers import tiny_chat_policy

from jaxgrpo.rollout.environments import (
  MultiTurnConfig,
  RolloutInterrupted,
  StepResult,
  rollout_metrics,
  sample_multiturn,
)

RELEASE = threading.Event()  # set at teardown: the abandoned threads finish


class Faulty:
  """Turn 1 pays 1.0; then, per row: ``hang`` (the step blocks until RELEASE), ``raise`` (a ValueError from line
  BUG_LINE), ``key`` (a KeyError), ``reset_hang`` (reset blocks); else a second turn pays 2.0 and ends."""

  tools = ()

  def reset(self, row):
    self.mode, self.k = row["mode"], 0
    if self.mode == "reset_hang":
      RELEASE.wait(60)
    return [{"role": "user", "content": self.mode}]

  def step(self, text):
    self.k += 1
    if self.k == 1:
      return StepResult([{"role": "tool", "content": "again"}], 1.0, False, {})
    if self.mode == "hang":
      RELEASE.wait(60)
    if self.mode == "raise":
      raise ValueError("the user's bug")  # BUG_LINE
    if self.mode == "key":
      raise KeyError("missing")
    return StepResult((), 2.0, True, {})


BUG_LINE = next(i for i, line in enumerate(open(__file__), 1) if line.rstrip().endswith("# BUG_LINE"))


@pytest.fixture(scope="module")
def setup():
  tok, model, sampling, _ = tiny_chat_policy(max_positions=256)
  yield tok, model, sampling
  RELEASE.set()


def _run(setup, modes, **cfg):
  tok, model, sampling = setup
  config = MultiTurnConfig(max_turns=2, max_tokens=40, turn_tokens=6, **cfg)
  rows = [{"mode": m} for m in modes]
  return sample_multiturn(model, rows, lambda row: Faulty(), tok, sampling, config, key=jax.random.key(0))


def test_a_hanging_step_times_out_and_an_exception_is_logged_once_and_counted_per_type(setup, caplog):
  t0 = time.monotonic()
  with caplog.at_level(logging.WARNING, logger="jaxgrpo.rollout.environments"):
    out = _run(setup, ["ok", "hang", "raise", "key"], step_timeout=0.5)
  # both trajectories of the hanging row waited once each (0.5 s), not the 60 s of the hang
  assert time.monotonic() - t0 < 30
  np.testing.assert_array_equal(out.rewards, [3, 3, 1, 1, 1, 1, 1, 1])  # the rewards so far stand
  np.testing.assert_array_equal(out.metrics["env_timeouts"], [0, 0, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(out.metrics["env_errors"], [0, 0, 0, 0, 1, 1, 1, 1])
  np.testing.assert_array_equal(out.metrics["env_errors/ValueError"], [0, 0, 0, 0, 1, 1, 0, 0])
  np.testing.assert_array_equal(out.metrics["env_errors/KeyError"], [0, 0, 0, 0, 0, 0, 1, 1])
  m = rollout_metrics(out)
  assert m["env/env_timeouts"] == 0.25 and m["env/env_errors/ValueError"] == 0.25
  # each distinct exception logged once (two trajectories raised each), naming the user's file:line
  msgs = [r.getMessage() for r in caplog.records]
  bug = [x for x in msgs if "ValueError: the user's bug" in x]
  assert len(bug) == 1 and f"test_env_faults.py:{BUG_LINE}" in bug[0], msgs
  assert len([x for x in msgs if "KeyError" in x]) == 1
  # logged once per process: the same bug in the next rollout is counted, not logged again
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="jaxgrpo.rollout.environments"):
    again = _run(setup, ["raise"], step_timeout=None)
  assert again.metrics["env_errors/ValueError"].tolist() == [1, 1] and not caplog.records


def test_fail_fast_reraises_the_environments_exception(setup):
  with pytest.raises(KeyError, match="missing"):
    _run(setup, ["ok", "key"], fail_fast=True)


def test_a_hanging_reset_raises_a_timeout_naming_the_bound(setup):
  with pytest.raises(TimeoutError, match=r"Faulty.reset did not return within env.step_timeout=0.3 s"):
    _run(setup, ["reset_hang"], step_timeout=0.3)


def test_should_stop_interrupts_a_rollout_waiting_on_a_hung_environment(setup):
  tok, model, sampling = setup
  config = MultiTurnConfig(max_turns=2, max_tokens=40, turn_tokens=6, step_timeout=None)
  stop_at = time.monotonic() + 1.0
  t0 = time.monotonic()
  with pytest.raises(RolloutInterrupted):
    sample_multiturn(
      model,
      [{"mode": "hang"}],
      lambda row: Faulty(),
      tok,
      sampling,
      config,
      key=jax.random.key(0),
      should_stop=lambda: time.monotonic() > stop_at,
    )
  assert time.monotonic() - t0 < 20  # not the 60 s of the hang


class Slow:
  """A real slow environment: ``reset`` returns at once; ``step`` sleeps ``row["sleep"]`` seconds (a real
  ``time.sleep``), then ends the trajectory with reward 1."""

  tools = ()

  def reset(self, row):
    self.sleep = row["sleep"]
    return [{"role": "user", "content": "slow"}]

  def step(self, text):
    time.sleep(self.sleep)
    return StepResult((), 1.0, True, {})


def _env_threads() -> int:
  return sum(t.name == "jaxgrpo-env-call" and t.is_alive() for t in threading.enumerate())


def _slow_rollout(setup, sleep: float, rows: int, **cfg):
  tok, model, sampling = setup
  config = MultiTurnConfig(max_turns=1, max_tokens=6, **cfg)
  data = [{"sleep": sleep, "row": r} for r in range(rows)]
  return sample_multiturn(model, data, lambda row: Slow(), tok, sampling, config, key=jax.random.key(1))


def test_a_turn_of_slow_steps_waits_one_timeout_in_all_and_logs_the_first_naming_its_row(setup, caplog):
  """32 trajectories whose ``step`` sleeps 4 s, ``env.step_timeout`` 0.5 s: the calls of the turn run at once, so
  the turn waits ~0.5 s in all (before: one call after the other, 32 x 0.5 = 16 s); the first timeout is logged
  once, naming the environment, the trajectory and its row (before: only the ``env_timeouts`` count)."""
  _slow_rollout(setup, 0.0, 16, step_timeout=5.0)  # compile the sampler's shapes outside the timing
  t0 = time.monotonic()
  with caplog.at_level(logging.WARNING, logger="jaxgrpo.rollout.environments"):
    out = _slow_rollout(setup, 4.0, 16, step_timeout=0.5)
  took = time.monotonic() - t0
  assert took < 6.0, took  # one 0.5 s bound for the whole turn (plus sampling), not 16 s
  np.testing.assert_array_equal(out.metrics["env_timeouts"], np.ones(32))
  np.testing.assert_array_equal(out.rewards, np.zeros(32))
  lines = [r.getMessage() for r in caplog.records if "did not return within" in r.getMessage()]
  assert len(lines) == 1, lines  # the first time only
  assert lines[0].startswith("Slow.step of trajectory 0 of group 0 (row {'sleep': 4.0, 'row': 0})"), lines
  assert "env.step_timeout=0.5 s" in lines[0] and "env/env_timeouts" in lines[0]


def test_timed_out_calls_keep_at_most_workers_threads_and_a_turn_is_bounded_as_a_whole(setup):
  """Steps that sleep 6 s, ``env.step_timeout`` 0.4 s, 16 trajectories, ``env.workers`` = 4 more than the
  environment threads already alive (the hung calls of the tests above count: the bound is the process's):
  4 calls start and time out, the 12 others find no free thread and time out when the turn's time is up, 0.4 s x
  ceil(16 / workers) — never more than ``workers`` environment threads (before: one abandoned thread per
  timed-out call, 16 more per rollout, and 16 x 0.4 s in a row). The next rollout, whose resets find every
  thread still held, stops with a TimeoutError saying so. When the sleeps end, so do their threads."""
  time.sleep(4.5)  # the previous test's abandoned calls (4 s sleeps) have returned
  base = _env_threads()
  workers = base + 4
  _slow_rollout(setup, 0.0, 8, step_timeout=5.0, workers=workers)  # compile
  assert _env_threads() == base
  t0 = time.monotonic()
  out = _slow_rollout(setup, 6.0, 8, step_timeout=0.4, workers=workers)
  took = time.monotonic() - t0
  assert _env_threads() <= workers, (_env_threads(), workers)
  assert took < 0.4 * -(-16 // workers) + 2.5, took  # the bound plus sampling
  np.testing.assert_array_equal(out.metrics["env_timeouts"], np.ones(16))
  with pytest.raises(
    TimeoutError, match=rf"Slow.reset did not run within .*it never started: all env.workers={workers} environment"
  ):
    _slow_rollout(setup, 6.0, 8, step_timeout=0.4, workers=workers)
  assert _env_threads() <= workers
  time.sleep(6.5)
  assert _env_threads() == base  # the abandoned calls returned and their threads ended


def test_a_turn_of_steps_within_the_bound_gets_every_reward(setup):
  """Concurrency changes nothing for calls within the bound: 16 steps of 0.2 s on 4 free threads, bound 1 s (a
  turn may take 1 s x ceil(16 / 4)): every reward counts, no timeout."""
  out = _slow_rollout(setup, 0.2, 8, step_timeout=1.0, workers=_env_threads() + 4)
  np.testing.assert_array_equal(out.rewards, np.ones(16))
  np.testing.assert_array_equal(out.metrics["env_timeouts"], np.zeros(16))


def test_bad_fault_settings_name_the_field():
  with pytest.raises(ValueError, match="env.step_timeout"):
    MultiTurnConfig(step_timeout=0)
  with pytest.raises(ValueError, match="env.fail_fast"):
    MultiTurnConfig(fail_fast="yes")
  with pytest.raises(ValueError, match="env.workers"):
    MultiTurnConfig(workers=0)


def make_hanging_env(row):
  """``env.factory`` of the child run below: one turn, reward 0.1 × the share of digits, until the file
  ``$JAXGRPO_TEST_HANG`` exists; then every step writes ``<that file>.hung`` and blocks forever."""
  return _HangWhenTold()


class _HangWhenTold:
  tools = ()

  def reset(self, row):
    return [{"role": "user", "content": row["problem"]}]

  def step(self, text):
    flag = os.environ["JAXGRPO_TEST_HANG"]
    if os.path.exists(flag):
      open(flag + ".hung", "w").close()
      while True:
        time.sleep(1)
    return StepResult((), 0.1 * sum(c.isdigit() for c in text) / max(len(text), 1), True)


def make_broken_env(row):
  """``env.factory`` of the child run below: raises, as a factory with a bug does."""
  raise KeyError(f"no level for {row['answer']!r}")


class _BrokenReset:
  tools = ()

  def reset(self, row):
    return [{"role": "user", "content": row["no such column"]}]


def make_broken_reset_env(row):
  return _BrokenReset()


def _train_cmd(tmp_path, factory: str, *extra, steps: int = 2) -> tuple[list, dict]:
  """A real ``scripts/train.py`` run of demo_env.yaml's tiny form with ``env.factory`` = ``factory`` (one turn of
  8 tokens, 2 groups of 2) into ``tmp_path/run``; ``(command, environment)``."""
  from helpers import ROOT, cli_env

  env = {**cli_env(tmp_path / "xla"), "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
  cmd = [
    sys.executable,
    os.path.join(ROOT, "scripts", "train.py"),
    "--config",
    os.path.join(ROOT, "scripts", "configs", "demo_env.yaml"),
    "--model.synthetic",
    "{hidden_size: 32, num_layers: 1}",
    "--data.arithmetic",
    "{train_size: 32, eval_size: 4, sft_steps: 0}",
    "--rollout.group-size",
    "2",
    "--rollout.prompts-per-step",
    "2",
    "--env.factory",
    factory,
    "--env.max-turns",
    "1",
    "--env.max-tokens",
    "8",
    "--env.turn-tokens",
    "8",
    "--eval.every",
    "1000",
    "--run.steps",
    str(steps),
    "--run.out",
    str(tmp_path / "run"),
    "--no-plot",
    "--no-progress",
    *extra,
  ]
  return cmd, env


def test_a_mistyped_env_factory_is_refused_when_the_config_loads():
  """As ``rollout.engine``'s: imported when the config loads (before: after the warm-up, 55 s into the demo)."""
  from jaxgrpo.run import specs

  with pytest.raises(ValueError, match=r"`env.factory`: 'jaxgrpo.tasks.calculatr:make_env': cannot import module"):
    specs.load_config("scripts/configs/demo_env.yaml", {"env.factory": "jaxgrpo.tasks.calculatr:make_env"})
  with pytest.raises(ValueError, match=r"`env.factory`: .* has no attribute 'make_enw'"):
    specs.load_config("scripts/configs/demo_env.yaml", {"env.factory": "jaxgrpo.tasks.calculator:make_enw"})


@pytest.mark.subprocess
@pytest.mark.parametrize(
  "factory, said",
  [
    ("test_env_faults:make_broken_env", 'the environment factory make_broken_env(row) raised KeyError: "no level for'),
    ("test_env_faults:make_broken_reset_env", "_BrokenReset.reset raised KeyError: 'no such column' (row {"),
  ],
)
def test_an_environment_whose_factory_or_reset_raises_stops_the_run_in_one_line(tmp_path, factory, said):
  """A real ``scripts/train.py`` run whose environment factory (or ``reset``) raises: exit 1 with one ``error:``
  line naming the call, the exception and the row, and the traceback in ``OUT/error.log`` (before: a 43-54-line
  traceback on the console)."""
  cmd, env = _train_cmd(tmp_path, factory)
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1, proc.stderr[-3000:]
  err = proc.stderr.strip().splitlines()
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert err[-1].startswith("error: " + said), err[-3:]
  log_path = str(tmp_path / "run" / "error.log")
  assert f"the traceback is in {log_path}" in err[-1]
  text = open(log_path).read()
  assert "Traceback" in text and "KeyError" in text and "test_env_faults.py" in text


@pytest.mark.subprocess
def test_the_first_sigterm_stops_a_run_whose_environment_hangs(tmp_path):
  """A real ``scripts/train.py`` run: after step 1 the environment hangs in ``step``; the first SIGTERM stops the
  run within seconds (not after env.step_timeout = 30 s, never before the change), exit status 128 + 15, and the
  last complete checkpoint is the last trained step."""
  from helpers import ROOT

  from jaxgrpo.services import checkpoint as ck

  flag, out = tmp_path / "hang", tmp_path / "run"
  extra = ["--eval.samples", "1", "--eval.pass-k", "[1]", "--checkpoint.every", "1"]
  cmd, env = _train_cmd(tmp_path, "test_env_faults:make_hanging_env", *extra, steps=1000)
  env["JAXGRPO_TEST_HANG"] = str(flag)
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
  lines = []
  try:
    for line in proc.stdout:
      lines.append(line)
      if line.startswith("step 1 "):
        flag.touch()  # the next rollout's environment hangs
        break
    t0 = time.monotonic()
    while not os.path.exists(str(flag) + ".hung") and time.monotonic() - t0 < 120 and proc.poll() is None:
      time.sleep(0.05)
    assert os.path.exists(str(flag) + ".hung"), "".join(lines)[-3000:]
    time.sleep(0.5)  # inside the hung call
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  took = time.monotonic() - t0
  text = "".join(lines) + rest
  assert proc.returncode == 128 + signal.SIGTERM, f"exit {proc.returncode}\n{text[-3000:]}\n{err[-3000:]}"
  assert took < 15, took  # the hung call is abandoned, not waited for (env.step_timeout is 30 s)
  stopped = int(re.search(r"stopping after step (\d+)", text + err).group(1))
  assert stopped >= 1 and ck.complete_steps(str(out / "checkpoints"), log=None)[-1] == stopped
