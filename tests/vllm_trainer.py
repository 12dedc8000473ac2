"""Trainer runs with ``rollout.engine: vllm``, in vLLM's own venv (see tests/test_engine_vllm.py).

``learn OUT.json``: the arithmetic demo (synthetic model after a short warm-up, TIS on) through vLLM, saving a
checkpoint at step 2 (a real ``Checkpointer``); then a new Trainer (a new engine, the same config) restores
that step and runs step 3. Reports the learning run's records (held-out accuracy before / after, every step's
engine metrics) and the resumed run's, whose step 3 must equal the learning run's step 3.
``all OUT.json``: ``tests/vllm_checks.py``'s families, the trainer runs, then ``tests/vllm_teacher_checks.py``'s
vLLM-teacher checks (``teacher_*``), in this one process (one vLLM import, one JAX start-up); each part's result,
or its traceback, under its name.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

from jaxgrpo.run.specs import load_config
from jaxgrpo.run.trainer import Trainer
from jaxgrpo.services.checkpoint import Checkpointer, checkpoint_dir

BASE = {
  # 4 heads of 32: vLLM's CPU attention takes head sizes 32, 64, 80, ...
  "model.synthetic": {"hidden_size": 128, "num_layers": 2},
  "data.max_prompt_tokens": 64,
  "rollout.engine": "vllm",
  "rollout.vllm.kv_cache_bytes": 64 * 2**20,
  "step.chunk_size": None,
  "reward.timeout_s": None,
  "reward.weights": {"accuracy": 1.0},
  "objective.importance_correction": "tis",
  "run.log_every": 1,
  "devices.mesh": "",
}
LEARN = {
  "data.arithmetic": {"train_size": 1000, "eval_size": 32, "sft_steps": 300, "sft_noise": 0.7, "max_operand": 9},
  "rollout.group_size": 8,
  "rollout.prompts_per_step": 16,
  "rollout.max_new_tokens": 16,
  "optim.learning_rate": 2e-4,
  "eval.every": 12,
  "eval.samples": 4,
  "eval.pass_k": [1],
}
STEPS, SAVED = 12, 2  # the learning run's steps; the step it saves and the resumed run restores


def cfg(out, **changes):
  return load_config(None, {**BASE, "run.out": str(out), **changes})


def learn(path=None):
  """The learning run (``STEPS`` steps, a checkpoint of step ``SAVED`` only), then a new Trainer on the same
  config restoring that step and running step ``SAVED + 1``."""
  out = tempfile.mkdtemp()
  log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
  ck = Checkpointer(checkpoint_dir(out), async_save=False, max_to_keep=None, log=None)

  def save_step_2(snapshot, run):  # the trainer calls this after every step (checkpoint.every 1)
    if int(snapshot.step) == SAVED:
      ck.checkpoint_fn(snapshot, run)

  trainer = Trainer(
    cfg(out, **LEARN, **{"run.steps": STEPS, "checkpoint.every": 1}), log=log, checkpoint_fn=save_step_2
  )
  records = trainer.run()
  trainer.close()
  assert ck.steps() == [SAVED], ck.steps()
  # resume: the same config, run.steps = SAVED + 1 (the learning rate has no schedule over run.steps)
  restore = lambda run, template: ck.restore(template, run, step=SAVED)  # noqa: E731
  trainer = Trainer(cfg(out, **LEARN, **{"run.steps": SAVED + 1, "checkpoint.every": 1}), log=log, restore_fn=restore)
  assert trainer.resumed
  resumed = trainer.run()
  trainer.close()
  ck.close()
  return {"learn": records, "resumed": resumed}


MOE = {  # a Qwen3-MoE synthetic model (4 experts, top-2, width 128) through vLLM, TIS on
  "model.synthetic": {"hidden_size": 128, "num_layers": 2, "num_experts": 4, "experts_per_tok": 2},
  # no warm-up: an entropy bonus makes step 1's update non-zero whatever the rewards (the push after it must
  # send changed experts)
  "data.arithmetic": {"train_size": 200, "eval_size": 8, "sft_steps": 0, "max_operand": 9},
  "objective.entropy_coef": 0.01,
  "rollout.group_size": 8,
  "rollout.prompts_per_step": 4,
  "rollout.max_new_tokens": 16,
  "optim.learning_rate": 2e-4,
  "eval.samples": 1,
  "run.steps": 2,
}


def moe(path=None):
  """Issue 35 item 6: a MoE policy trained two steps through vLLM with ``rollout.routing_replay: none``
  (every step's engine metrics), and the one-line refusal of ``routing_replay: rollout`` (the default) with
  vLLM, raised before any weight is read."""
  out = tempfile.mkdtemp()
  log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
  try:
    Trainer(cfg(out, **MOE), log=log)
    refusal = None
  except ValueError as e:
    refusal = str(e)
  trainer = Trainer(cfg(out, **MOE, **{"rollout.routing_replay": "none"}), log=log)
  records = trainer.run()
  trainer.close()
  return {"records": records, "refusal": refusal}


def compose(path=None):
  """Issue 35.8: an environment through vLLM, one step off, with dynamic sampling (every turn's ids to the engine,
  the producer's published version pushed; ``envs_for_tests.SecondChance`` at width 128): two steps with a
  checkpoint of step 1 in memory, then a new Trainer (a new engine) restoring it and running step 2 — the
  ledgers must agree (every prompt once, in order)."""
  import jax
  import jax.numpy as jnp

  out = tempfile.mkdtemp()
  log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
  changes = {
    **{"env.factory": "envs_for_tests:make_env", "env.max_turns": 2, "env.max_tokens": 40, "env.turn_tokens": 12},
    "data.arithmetic": {"train_size": 64, "eval_size": 8, "sft_steps": 0},
    "rollout.group_size": 4,
    "rollout.prompts_per_step": 2,
    "rollout.max_staleness": 1,
    "objective.dynamic_sampling": True,
    "rollout.dynamic_sampling_max_rounds": 2,
    "optim.learning_rate": 3e-2,
    "checkpoint.every": 1,
    "run.steps": 2,
  }
  saved = {}

  def save(snap, run):
    saved[int(snap.step)] = jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, snap)

  trainer = Trainer(cfg(out + "/a", **changes), log=log, checkpoint_fn=save)
  records = trainer.run(handle_signals=False)
  trainer.close()
  trainer = Trainer(cfg(out + "/b", **changes), log=log, restore_fn=lambda run, template: saved[1])
  resumed = trainer.run(handle_signals=False)
  trainer.close()
  ledger = lambda d: [json.loads(x) for x in open(os.path.join(d, "rollouts.jsonl"))]  # noqa: E731
  return {"records": records, "resumed": resumed, "ledger": ledger(out + "/a"), "resumed_ledger": ledger(out + "/b")}


def run_all(path=None):
  import vllm_checks
  import vllm_teacher_checks

  result = {}
  parts = (
    ("families", vllm_checks.families),
    ("engine_api", vllm_checks.engine_api),
    ("partial", vllm_checks.partial),
    ("lora_sync", vllm_checks.lora_sync),
    ("moe", moe),
    ("compose", compose),
    ("learn", learn),
    ("teacher_temperature", vllm_teacher_checks.temperature),
    ("teacher_scores", vllm_teacher_checks.scores),
    ("teacher_run", vllm_teacher_checks.run),
  )
  seconds = result["seconds"] = {}  # wall seconds of each part (where the module's time goes; not asserted)
  cpu = result["cpu_seconds"] = {}  # and the process's CPU seconds (all its threads)
  for name, part in parts:
    t0, c0 = time.perf_counter(), time.process_time()
    try:
      result[name] = part()
    except Exception:  # the other part still runs; its test reports this traceback
      result[name] = {"error": traceback.format_exc()}
      print(result[name]["error"], file=sys.stderr, flush=True)
    seconds[name] = round(time.perf_counter() - t0, 1)
    cpu[name] = round(time.process_time() - c0, 1)
    print(f"vllm_trainer: part {name} {seconds[name]} s {cpu[name]} CPU-s", file=sys.stderr, flush=True)
  return result


if __name__ == "__main__":
  check, path = sys.argv[1], sys.argv[2]
  result = {"learn": learn, "moe": moe, "compose": compose, "all": run_all}[check](path)
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
