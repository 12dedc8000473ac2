"""The vLLM teacher (``jaxgrpo.rollout.engines.vllm_teacher``) against the Flax teacher of the same weights: parts of
the one vLLM child of tests/test_engine_vllm.py (``tests/vllm_trainer.py all`` runs them after the engine's checks,
as ``teacher_temperature``, ``teacher_scores``, ``teacher_run``: one vLLM import and one JAX start-up for both);
alone, ``.venv-vllm/bin/python tests/vllm_teacher_checks.py OUT.json [PART ...]``. Every number written here is
asserted on by the tests.

``scores``: a tiny random Qwen3 (tests/vllm_checks.py's, V = 256; its mean output entropy reported, so a
near-deterministic model cannot make the comparison trivial), 4 rows of 30–40 prompt tokens and ragged
completions of up to 24 tokens: ``feed.make_teacher``'s log-probs and top-8 vs ``VLLMTeacher.scores``' (max |Δ|
over the real positions; the ids compared where the Flax teacher's 8th and 9th log-probs differ by > 1e-4).
``temperature``: the one-line refusal (``refusal``) of a step temperature other than 1, and how long it took (no vLLM start).
``run``: two steps of distillation alone on the arithmetic task, teacher ``vllm:synthetic:128x1`` and then the
in-process ``synthetic:128x1`` (the same weights, seed run.seed + 1): their losses, grad norms and reverse KL.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

import jax
import numpy as np
import optax
from vllm_checks import config, random_model

from jaxgrpo.kernels import distill
from jaxgrpo.kernels.config import preset
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.engines.vllm_teacher import VLLMTeacher, check_engine_temperature
from jaxgrpo.step import feed, train
from jaxgrpo.step.batch import Batch

K = 8


def _batch(v: int, seed: int = 0, b: int = 4, p: int = 40, t: int = 24) -> Batch:
  rng = np.random.default_rng(seed)
  plen = rng.integers(30, p + 1, b)
  pmask = np.arange(p)[None] >= (p - plen)[:, None]
  prompt = np.where(pmask, rng.integers(3, v, (b, p)), 0).astype(np.int32)
  clen = np.array([t, 17, 9, 1])[:b]
  mask = np.arange(t)[None] < clen[:, None]
  comp = np.where(mask, rng.integers(3, v, (b, t)), 0).astype(np.int32)
  zeros = np.zeros((b, t), np.float32)
  return Batch(prompt, pmask, comp, mask, zeros, np.arange(b, dtype=np.int32), np.zeros(b, np.float32))


def scores() -> dict:
  model = random_model(config("qwen3", True), 0)
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(0.1)
  student = random_model(config("qwen3", True), 1)
  graphdef, _, shardings = train.init_train_state(student, opt, mesh)
  cfg = preset("grpo", distill=distill.DistillConfig(kind="jsd", top_k=K))
  step = train.make_train_step(
    graphdef, opt, cfg, mesh=mesh, shardings=shardings, train_config=train.TrainConfig(group_size=1, chunk_size=16)
  )
  batch = _batch(model.config.vocab_size)
  want = feed.make_teacher(step, model)(batch)
  t0 = time.perf_counter()
  engine = VLLMTeacher(model, top_k=K)
  start_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  logp, ids, top = engine.scores(batch.prompt_tokens, batch.prompt_mask, batch.completions, batch.mask)
  score_s = time.perf_counter() - t0
  engine.close()
  m = np.asarray(batch.mask)
  w_logp, w_ids, w_top = (np.asarray(x) for x in (want.teacher_logp, want.teacher_topk_ids, want.teacher_topk_logp))
  # the Flax teacher's full log-softmax: its entropy, and the gap between its K-th and (K+1)-th entries
  full = np.asarray(_full_log_softmax(model, batch))[m]
  srt = full  # already sorted, descending
  clear = (srt[:, K - 1] - srt[:, K]) > 1e-4
  return {
    "positions": int(m.sum()),
    "entropy": float(-(np.exp(full) * full).sum(-1).mean()),
    "logp_max_abs_diff": float(np.abs(logp[m] - w_logp[m]).max()),
    "topk_logp_max_abs_diff": float(np.abs(top[m] - w_top[m]).max()),
    "ids_equal_clear": int((ids[m][clear] == w_ids[m][clear]).all(-1).sum()),
    "clear_positions": int(clear.sum()),
    "sampled_in_entry": bool(np.isfinite(logp[m]).all()),
    "start_s": start_s,
    "score_s": score_s,
  }


def _full_log_softmax(model, batch):
  """``f32[B, T, V]`` the Flax teacher's whole log-softmax at each completion position, sorted (its top-V)."""
  from jaxgrpo.models.log_probs import completion_log_probs

  v = model.config.vocab_size
  fields = (batch.prompt_tokens, batch.prompt_mask, batch.completions, batch.mask)
  return completion_log_probs(model, *fields, top_k=v)[2][1]


def temperature() -> dict:
  t0 = time.perf_counter()
  try:
    check_engine_temperature(0.7)
    err = None
  except ValueError as e:
    err = str(e)
  return {"refusal": err, "seconds": time.perf_counter() - t0}


def run(out_dir: str | None = None) -> dict:
  from jaxgrpo.run.specs import load_config
  from jaxgrpo.run.trainer import Trainer

  # tests/test_trainer.py's TINY run (that module imports pytest, absent from vLLM's venv)
  tiny = {
    "model.synthetic": {"hidden_size": 32, "num_layers": 1},
    "data.arithmetic": {"train_size": 64, "eval_size": 8, "sft_steps": 0},
    "data.max_prompt_tokens": 64,
    "rollout.group_size": 4,
    "rollout.prompts_per_step": 2,
    "rollout.max_new_tokens": 8,
    "step.chunk_size": None,
    "reward.timeout_s": None,
    "eval.every": 0,
    "run.log_every": 1,
    "devices.mesh": "",
  }
  out_dir = out_dir or tempfile.mkdtemp()
  out = {}
  for name, teacher in (("vllm", "vllm:synthetic:128x1"), ("flax", "synthetic:128x1")):
    cfg = load_config(
      None,
      {
        **tiny,
        "objective.distill": {"teacher": teacher, "weight": 0.5, "clip": 5.0},
        "reward.weights": {"accuracy": 0.0},
        "run.steps": 2,
        "run.out": os.path.join(out_dir, f"run_{name}"),
        "checkpoint.every": 0,
        "optim.learning_rate": 3e-2,
      },
    )
    recs = [r for r in Trainer(cfg, log=None).run(handle_signals=False) if "loss" in r]
    out[name] = [{k: r[k] for k in ("step", "loss", "grad_norm", "distill/reverse_kl")} for r in recs]
  return out


def main(argv):
  parts = argv[2:] or ("temperature", "scores", "run")
  results = {}
  for name, fn in ((n, globals()[n]) for n in parts):
    try:
      results[name] = fn()
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
      results[name] = {"error": traceback.format_exc()}
  with open(argv[1], "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main(sys.argv)
