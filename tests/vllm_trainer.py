"""Trainer runs with ``rollout.engine: vllm``, in vLLM's own venv (see tests/test_engine_vllm.py).

``learn OUT.json``: the arithmetic demo (synthetic model after a short warm-up, TIS on) through vLLM;
reports its records (held-out accuracy before / after, every step's engine metrics).
``resume OUT.json``: 3 steps straight vs 2 steps, checkpoint, a new Trainer (a new engine) resuming to 3;
reports both runs' records.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from jaxgrpo.checkpoint import Checkpointer, checkpoint_dir
from jaxgrpo.specs import load_config
from jaxgrpo.trainer import Trainer

BASE = {
  # 4 heads of 32: vLLM's CPU attention takes head sizes 32, 64, 80, ...
  "model.synthetic": {"hidden_size": 128, "num_layers": 1},
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


def cfg(out, **changes):
  return load_config(None, {**BASE, "run.out": str(out), **changes})


def learn(path):
  out = tempfile.mkdtemp()
  c = cfg(
    out,
    **{
      "model.synthetic": {"hidden_size": 128, "num_layers": 2},
      "data.arithmetic": {"train_size": 1000, "eval_size": 32, "sft_steps": 300, "sft_noise": 0.7, "max_operand": 9},
      "rollout.group_size": 8,
      "rollout.prompts_per_step": 16,
      "rollout.max_new_tokens": 16,
      "optim.learning_rate": 2e-4,
      "run.steps": 20,
      "eval.every": 20,
      "eval.samples": 4,
      "eval.pass_k": [1],
    },
  )
  trainer = Trainer(c, log=lambda s: print(s, file=sys.stderr, flush=True))
  records = trainer.run()
  trainer.close()
  return records


def resume(path):
  changes = {
    "data.arithmetic": {"train_size": 200, "eval_size": 8, "sft_steps": 200, "sft_noise": 0.7, "max_operand": 9},
    "rollout.group_size": 4,
    "rollout.prompts_per_step": 4,
    "rollout.max_new_tokens": 12,
    "optim.learning_rate": 1e-3,
    "eval.every": 0,
    "checkpoint.every": 1,
  }

  def run(out, steps, restore):
    c = cfg(out, **changes, **{"run.steps": steps})
    ck = Checkpointer(checkpoint_dir(str(out)), async_save=False, log=None)
    trainer = Trainer(c, log=None, checkpoint_fn=ck.checkpoint_fn, restore_fn=ck.restore_fn if restore else None)
    records = trainer.run()
    trainer.close()
    ck.close()
    return records

  root = tempfile.mkdtemp()
  straight = run(os.path.join(root, "straight"), 3, False)
  first = run(os.path.join(root, "resumed"), 2, False)
  second = run(os.path.join(root, "resumed"), 3, True)
  return {"straight": straight, "first": first, "resumed": second}


if __name__ == "__main__":
  check, path = sys.argv[1], sys.argv[2]
  result = {"learn": learn, "resume": resume}[check](path)
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
