#!/usr/bin/env python
"""The offline multi-turn demo: multiplication with a calculator tool (``jaxgrpo.tasks.calculator``).

    python scripts/multiturn_demo.py --config scripts/configs/multiturn/calculator.yaml [--out runs/calculator]
    python scripts/multiturn_demo.py --config scripts/configs/multiturn/calculator.yaml --no-tool   # the baseline

A tiny Qwen3-architecture model and a locally built tokenizer with a Qwen2.5-style tool template; a
supervised warm-up on imperfect demonstrations (some answer without the tool, some miscopy an operand),
then RL with ``jaxgrpo.loop.iteration.multiturn_iteration``: the policy calls ``multiply`` in the
``<tool_call>`` format, reads the result in the tool role, boxes it. Held-out accuracy
(``mean@k`` at temperature 1, multi-turn, reward = the right boxed product) before and after RL, every ``eval_every`` steps.
``--no-tool``: the same model, warm-up on direct answers (right products, no tool in the prompt) and
the same RL — what the model does without the tool. Writes ``OUT/metrics.jsonl`` and prints a summary
line ``RESULT {...}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", required=True, help="the demo's YAML (scripts/configs/multiturn/calculator.yaml)")
  ap.add_argument(
    "--out", default=None, help="output directory for metrics.jsonl (default: the config's run.out, + _no_tool)"
  )
  ap.add_argument("--no-tool", action="store_true", help="the baseline: no tool, warm-up on direct answers")
  ap.add_argument(
    "--steps", type=int, default=None, help="RL steps (default: the config's run.steps; fewer for a quick look)"
  )
  ap.add_argument("--no-progress", action="store_true", help="no progress bars (plain log lines instead)")
  ap.add_argument(
    "--engine",
    choices=("jax", "vllm"),
    default="jax",
    help="what samples the RL turns: the built-in sampler (its KV cache kept across turns) or vLLM (in the "
    "vLLM venv, scripts/setup_vllm_venv.sh; its prefix cache serves each turn's re-sent conversation). "
    "Evaluation always runs the built-in sampler",
  )
  ap.add_argument("--hidden", type=int, default=None, help="model width (default: the config's model.hidden_size)")
  ap.add_argument(
    "--heads",
    type=int,
    default=4,
    help="attention heads (kv heads: half; head_dim = width / heads). vLLM's CPU attention needs head_dim >= 32: "
    "--heads 2 at the default width 64",
  )
  return ap


if __name__ == "__main__":
  _parser().parse_args()  # --help and a bad flag answer here, before jax and the library are imported


from jaxgrpo.tasks import script_io  # noqa: E402

script_io.hide_torch_banner()  # before transformers is imported: jaxgrpo needs no torch

import jax
import numpy as np
import optax
import yaml
from flax import nnx

from jaxgrpo.kernels.config import preset
from jaxgrpo.loop import iteration
from jaxgrpo.models import build_model
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.engines.vllm import VLLMEngine
from jaxgrpo.rollout.environments import MultiTurnConfig, sample_multiturn
from jaxgrpo.step import train
from jaxgrpo.tasks import arithmetic, calculator


def evaluate(model, tok, rows, make_env, env_config, sampling, seed, samples) -> dict:
  """mean@k multi-turn accuracy on ``rows`` (k = ``samples`` trajectories each, at temperature 1 — the
  step's —, a fixed key) and the tool-use rates."""
  k_samples = dataclasses.replace(sampling, num_samples=samples)
  out = sample_multiturn(model, rows, make_env, tok, k_samples, env_config, key=jax.random.key(seed + 1))
  return {
    "eval_accuracy": float(out.rewards.mean()),
    "eval_tool_call_rate": float((out.metrics["tool_calls"] > 0).mean()),
    "eval_tool_errors": float(out.metrics["tool_errors"].mean()),
    "eval_turns": float(out.turns.mean()),
  }


def main(argv=None):
  args = _parser().parse_args(argv)
  with open(args.config) as f:
    cfg = yaml.safe_load(f)
  m, task, env, roll, run = cfg["model"], cfg["task"], cfg["env"], cfg["rollout"], cfg["run"]
  steps = run["steps"] if args.steps is None else args.steps
  out_dir = args.out or run["out"] + ("_no_tool" if args.no_tool else "")
  os.makedirs(out_dir, exist_ok=True)
  seed = run["seed"]
  t_start = time.perf_counter()

  tok = calculator.build_tokenizer()
  model_cfg = arithmetic.tiny_model_config(
    len(tok),
    hidden_size=m["hidden_size"] if args.hidden is None else args.hidden,
    num_layers=m["num_layers"],
    max_position_embeddings=512,
  )
  if args.heads != model_cfg.num_heads:
    if model_cfg.hidden_size % args.heads:
      raise SystemExit(f"--heads {args.heads} must divide the width {model_cfg.hidden_size}")
    model_cfg = dataclasses.replace(
      model_cfg,
      num_heads=args.heads,
      num_kv_heads=max(1, args.heads // 2),
      head_dim=model_cfg.hidden_size // args.heads,
    )
  engine = None
  if args.engine == "vllm":  # checked before the warm-up: head_dim, the install
    engine = VLLMEngine(model_cfg, max_model_len=512, seed=seed, kv_cache_bytes=128 * 2**20)
  model = build_model(model_cfg, rngs=nnx.Rngs(seed))
  train_rows, eval_rows = calculator.calculator_split(task["train_size"], task["eval_size"], seed=seed)
  make_env = calculator.make_env_without_tool if args.no_tool else calculator.make_env
  t0 = time.perf_counter()
  losses = calculator.warm_up(
    model,
    tok,
    train_rows,
    steps=task["sft_steps"],
    guess=task["sft_guess"],
    operand=task["sft_operand"],
    without_tool=args.no_tool,
    batch_size=task["sft_batch_size"],
    learning_rate=task["sft_learning_rate"],
    seed=seed,
    progress=not args.no_progress,
  )
  sft_s = time.perf_counter() - t0

  env_config = MultiTurnConfig(**env)
  config = preset(cfg["objective"]["preset"], **{k: v for k, v in cfg["objective"].items() if k != "preset"})
  eos = tok.convert_tokens_to_ids("<|im_end|>")
  sampling = iteration.SamplingConfig(
    num_samples=roll["group_size"], max_new_tokens=1, eos_ids=(eos,), pad_id=tok.pad_token_id
  )
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.adamw(cfg["optim"]["learning_rate"], weight_decay=0.0)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  tc = train.TrainConfig(group_size=roll["group_size"], max_grad_norm=1.0, chunk_size=None)
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
  reference = iteration.make_reference(step, state) if step.reads_ref_logp else None

  records = []
  log = open(os.path.join(out_dir, "metrics.jsonl"), "w")

  bar = script_io.step_bar(steps, "RL", disable=args.no_progress)

  def emit(rec, show=True):
    records.append(rec)
    log.write(json.dumps(rec) + "\n")
    log.flush()
    if show:  # above the bar
      bar.write(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()))

  t0 = time.perf_counter()
  before = evaluate(
    iteration.policy_model(graphdef, state), tok, eval_rows, make_env, env_config, sampling, seed, run["eval_samples"]
  )
  emit({"step": 0, **before, "eval_s": time.perf_counter() - t0})
  rng = np.random.default_rng([seed, 6])
  key = jax.random.key(seed)
  t_rl = time.perf_counter()
  turns_done, rollout_s = 0.0, 0.0
  for s in range(1, steps + 1):
    rows = [train_rows[int(i)] for i in rng.integers(0, len(train_rows), roll["prompts_per_step"])]
    key, sub = jax.random.split(key)
    res = iteration.multiturn_iteration(
      step,
      state,
      rows,
      key=sub,
      make_env=make_env,
      tokenizer=tok,
      sampling=sampling,
      env_config=env_config,
      reference=reference,
      engine=engine,
    )
    state = res.state
    turns_done += res.metrics["env/turns"] * len(rows) * roll["group_size"]
    rollout_s += res.metrics["rollout_s"] if s > 1 else 0.0  # the first step compiles
    turns_done = turns_done if s > 1 else 0.0
    keep = (
      "loss",
      "reward_mean",
      "env/turns",
      "env/tool_calls",
      "env/tool_errors",
      "env/tool_s",
      "rollout_s",
      "iteration_s",
    )
    emit({"step": s, **{k: res.metrics[k] for k in keep if k in res.metrics}}, show=args.no_progress)
    bar.update(1)
    if s == 1:  # the first step compiled: the ETA counts the steps after it
      script_io.start_clock(bar)
    bar.set_postfix(reward=f"{res.metrics['reward_mean']:.3f}", loss=f"{res.metrics.get('loss', float('nan')):.3f}")
    if s % run["eval_every"] == 0 or s == steps:
      ev = evaluate(
        iteration.policy_model(graphdef, state),
        tok,
        eval_rows,
        make_env,
        env_config,
        sampling,
        seed,
        run["eval_samples"],
      )
      emit({"step": s, **ev})
  bar.close()
  rl_s = time.perf_counter() - t_rl
  after = records[-1]
  result = {
    "no_tool": args.no_tool,
    "warmup_accuracy": before["eval_accuracy"],
    "rl_accuracy": after["eval_accuracy"],
    "gain_points": 100 * (after["eval_accuracy"] - before["eval_accuracy"]),
    "warmup_tool_call_rate": before["eval_tool_call_rate"],
    "rl_tool_call_rate": after["eval_tool_call_rate"],
    "sft_s": sft_s,
    "rl_s": rl_s,
    "total_s": time.perf_counter() - t_start,
    "sft_final_loss": losses[-1] if losses else None,
    "steps": steps,
    "engine": args.engine,
    "hidden_size": model_cfg.hidden_size,
    "heads": model_cfg.num_heads,
    "turns_per_s": turns_done / rollout_s if rollout_s else None,  # RL rollouts after the first (compiling) step
  }
  if engine is not None:
    engine.close()
  log.write(json.dumps({"result": result}) + "\n")
  log.close()
  print("RESULT " + json.dumps(result), flush=True)
  return result


if __name__ == "__main__":
  main()
