"""Prefix-shared training (``TrainConfig.prefix_sharing``) against row-wise packing, measured in one run: the
train step's time per call, its compile time and compiled memory, and the analytic FLOPs of each layout.

Workloads (``--workload``):

- ``peers``: the shapes of ``scripts/peers``' 20m workload — a random Qwen3 of D 384, 4 layers, 8/4 heads of 32,
  SwiGLU 1536, vocabulary 32000; 16 prompts × 32 tokens, 8 samples each, 128 new tokens, micro-batches of 64 rows
  (K = 2: with sharing the step's split keeps each group's 8 rows in one micro-batch).
- ``long``: a 1k-token prompt, 256 new tokens, G = 16 in one micro-batch, a small model (D 256, 2 layers, V 8192).
- ``tiny``: a smoke test of the same code.
- ``multiturn``: the multi-turn calculator demo (``scripts/multiturn_demo.py`` with
  ``scripts/configs/multiturn/calculator.yaml``: a tiny Qwen3 of D 64, 2 layers, its calculator tokenizer; the
  demo's warm-up, ``--warmup-steps`` of it; then one real multi-turn rollout of 8 prompts × G 8 trajectories,
  ≤ 3 turns, ≤ 64 trajectory tokens, tool results and the assistant headers as observation tokens), trained with
  the demo's step (``lambda_grpo``, one micro-batch). The layout ``rows`` is the demo's own step (unpacked rows
  ``[P + T]``); the rollout is timed too (its second call, compiled), so that the iteration
  (rollout + step) is printed per layout.

Completion lengths are uniform in ``[T/2, T]`` with random tokens (no shared completion prefix: ``tree`` then
shares what ``prompt`` shares). Every layout runs the same GRPO step (``jaxgrpo.step.train``) from the same
parameters; ``none`` packs each sequence whole into rows of ``P + T`` tokens, the sharing layouts pack each
micro-batch's trees into rows that hold a whole tree (``--row-length``: other rows; the compiled step runs on
every token slot of its rows, padding included, so rows that the trees fill well matter as much as the sharing). The layouts' first losses are printed with their difference
(equal values, the point of the method), then the median of ``--repeats`` alternating timed calls.

FLOPs (analytic, forward + backward = 3 × forward): ``6·N·tokens`` for the trunk's matmuls (N its matmul
parameters; tokens: those in the forward — every sequence's for ``none``, the trees' for sharing, copies of branch
points included), ``6·V·D·C`` for the LM head (C completion tokens, alike in all layouts) and ``12·layers·H·K`` per
attended (query, key) pair actually needed (row-wise: ``n(n+1)/2`` per sequence; a tree: each token's depth + 1).

  python scripts/bench_prefix_tree.py --workload long
  python scripts/bench_prefix_tree.py --workload peers
  python scripts/bench_prefix_tree.py --workload tiny      # smoke test
  python scripts/bench_prefix_tree.py --workload multiturn --layouts rows,none,prompt,tree
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import types

import jax
import numpy as np
import optax
import yaml
from flax import nnx

from jaxgrpo import models
from jaxgrpo.kernels.config import preset
from jaxgrpo.loop.iteration import SamplingConfig
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.environments import MultiTurnConfig, sample_multiturn
from jaxgrpo.step import train
from jaxgrpo.tasks import arithmetic, calculator

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "multiturn", "calculator.yaml")

WORKLOADS = {  # model (D, layers, heads, kv heads, head dim, I, V), prompts, P, G, T, micro-batches
  "peers": dict(model=(384, 4, 8, 4, 32, 1536, 32000), prompts=16, prompt_len=32, group=8, new=128, micro=2),
  "long": dict(model=(256, 2, 4, 2, 64, 1024, 8192), prompts=1, prompt_len=1024, group=16, new=256, micro=1),
  "tiny": dict(model=(32, 2, 4, 2, 8, 64, 256), prompts=4, prompt_len=24, group=4, new=16, micro=2),
  "multiturn": dict(prompts=8, group=8, micro=1, preset="lambda_grpo"),  # the demo's (DEMO) model and rollout
}


def multiturn_rollout(w: dict, warmup_steps: int | None, seed: int):
  """``(model config, model, host Batch, rollout seconds)``: the calculator demo's model after its warm-up
  (``warmup_steps``; None: the config's ``sft_steps``) and one multi-turn rollout of the demo's shape (timed on its
  second call: the first compiles)."""
  with open(DEMO) as f:
    demo = yaml.safe_load(f)
  task, env, roll = demo["task"], demo["env"], demo["rollout"]
  w.update(prompts=roll["prompts_per_step"], group=roll["group_size"], preset=demo["objective"]["preset"])
  tok = calculator.build_tokenizer()
  cfg = arithmetic.tiny_model_config(len(tok), **demo["model"], max_position_embeddings=512)
  model = models.build_model(cfg, rngs=nnx.Rngs(seed))
  train_rows, _ = calculator.calculator_split(task["train_size"], task["eval_size"], seed=seed)
  calculator.warm_up(
    model, tok, train_rows, steps=task["sft_steps"] if warmup_steps is None else warmup_steps, guess=task["sft_guess"],
    operand=task["sft_operand"], batch_size=task["sft_batch_size"], learning_rate=task["sft_learning_rate"], seed=seed,
    log=lambda *a: None,
  )  # fmt: skip
  eos = tok.convert_tokens_to_ids("<|im_end|>")
  sampling = SamplingConfig(num_samples=w["group"], max_new_tokens=1, eos_ids=(eos,), pad_id=tok.pad_token_id)
  rows = [train_rows[i] for i in np.random.default_rng(seed).integers(0, len(train_rows), w["prompts"])]
  sample = lambda: sample_multiturn(
    model, rows, calculator.make_env, tok, sampling, MultiTurnConfig(**env), key=jax.random.key(seed)
  )
  sample()  # compiles
  t0 = time.perf_counter()
  out = sample()
  rollout_s = time.perf_counter() - t0
  return cfg, model, train.Batch.from_rollout(out, out.rewards), rollout_s


def rollout(rng, w: dict, vocab: int) -> train.Batch:
  """Full prompts of ``prompt_len`` tokens (one per group), completions of lengths uniform in ``[T/2, T]``."""
  b, g, p, t = w["prompts"] * w["group"], w["group"], w["prompt_len"], w["new"]
  prompts = np.repeat(rng.integers(1, vocab, (w["prompts"], p)), g, axis=0).astype(np.int32)
  lengths = rng.integers(t // 2, t + 1, b)
  mask = np.arange(t)[None] < lengths[:, None]
  completions = np.where(mask, rng.integers(1, vocab, (b, t)), 0).astype(np.int32)
  old = np.where(mask, -np.log(vocab) + 0.1 * rng.standard_normal((b, t)), 0).astype(np.float32)
  rewards = rng.integers(0, 2, b).astype(np.float32)
  groups = np.repeat(np.arange(w["prompts"]), g).astype(np.int32)
  return train.Batch(prompts, np.ones((b, p), bool), completions, mask, old, groups, rewards)


def analytic_flops(cfg, packed, completion_tokens: int) -> dict:
  """Tokens in the forward, needed attention pairs and the FLOPs (module docstring) of a packed batch."""
  d, layers = cfg.hidden_size, cfg.num_layers
  hk, kvk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  trunk = layers * (2 * d * hk + 2 * d * kvk + 3 * d * cfg.intermediate_size)
  real = packed.segment_ids > 0
  tokens = int(real.sum())  # the trunk runs on every slot of the rows (packed.tokens.size), padding included
  pairs = int((packed.positions[real] + 1).sum())  # each token attends to its depth + 1 keys
  flops = 6 * trunk * tokens + 6 * cfg.vocab_size * d * completion_tokens + 12 * layers * hk * pairs
  return dict(tokens=tokens, pairs=pairs, flops=flops)


def build(cfg, w, mesh, sharing: str, row_length: int | None, model=None):
  """The step of one layout (``sharing``; ``row_length`` None: unpacked rows) and its state, from ``model``'s
  parameters (default: a fresh random model)."""
  model = models.build_model(cfg, rngs=nnx.Rngs(0)) if model is None else nnx.clone(model)
  opt = optax.sgd(1e-4)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  tc = train.TrainConfig(
    micro_batches=w["micro"], chunk_size=128, group_size=w["group"], packing=row_length, prefix_sharing=sharing
  )
  config = preset(w.get("preset", "grpo"))
  return train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc), state


def rowwise_stats(cfg, batch) -> dict:
  """:func:`analytic_flops` of the unpacked rows: every ``[P + T]`` slot in the forward (padding included), the
  attention over the real tokens only."""
  p, t = np.shape(batch.prompt_tokens)[1], np.shape(batch.completions)[1]
  real = np.concatenate([np.asarray(batch.prompt_mask), np.asarray(batch.mask)], axis=1)
  positions = np.maximum(np.cumsum(real, axis=1) - 1, 0)
  fake = types.SimpleNamespace(segment_ids=real.astype(np.int32), positions=positions)  # what analytic_flops reads
  stats = analytic_flops(cfg, fake, int(np.asarray(batch.mask).sum()))
  stats["slots"] = real.shape[0] * (p + t)
  return stats


def timed(step, state, batch):
  t0 = time.perf_counter()
  state, metrics = step(state, batch)
  jax.block_until_ready(state)
  return state, metrics, time.perf_counter() - t0


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workload", choices=sorted(WORKLOADS), default="long")
  ap.add_argument("--layouts", default="none,prompt,tree", help="comma-separated: rows (unpacked), none, prompt, tree")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--row-length", type=int, default=None, help="the trees' row length (default: a group's tree)")
  ap.add_argument("--warmup-steps", type=int, default=None, help="multiturn: the demo's warm-up steps (its config's)")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  w = dict(WORKLOADS[args.workload])
  model, rollout_s = None, None
  if args.workload == "multiturn":
    cfg, model, batch, rollout_s = multiturn_rollout(w, args.warmup_steps, args.seed)
  else:
    d, layers, heads, kv_heads, head_dim, inter, vocab = w["model"]
    cfg = models.Qwen3Config(
      vocab_size=vocab, hidden_size=d, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
      intermediate_size=inter, tie_word_embeddings=True,
    )  # fmt: skip
    batch = rollout(np.random.default_rng(args.seed), w, vocab)
  batch = train.pad_to_bucket(batch)
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  p, t = np.shape(batch.prompt_tokens)[1], batch.completions.shape[1]
  branches = w["group"]  # with sharing the step's split keeps a group's rows in one micro-batch (G divides B/K)
  tree_length = args.row_length or -(-(p + branches * (t + 1)) // 128) * 128  # a group's tree in a micro-batch
  completion_tokens = int(np.asarray(batch.mask).sum())
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); workload {args.workload}: {w}")
  if rollout_s is not None:
    obs = int((np.asarray(batch.mask) & ~np.asarray(batch.policy_mask)).sum())
    print(
      f"rollout {rollout_s:.2f} s: {batch.completions.shape[0]} trajectories, prompts [B, {p}], trajectories "
      f"[B, {t}]: {completion_tokens} tokens ({completion_tokens - obs} policy, {obs} observation), reward mean "
      f"{float(np.nanmean(np.asarray(batch.rewards))):.3f}"
    )

  steps, states, batches, stats = {}, {}, {}, {}
  for sharing in args.layouts.split(","):
    row_length = None if sharing == "rows" else p + t if sharing == "none" else tree_length
    steps[sharing], states[sharing] = build(cfg, w, mesh, "none" if sharing == "rows" else sharing, row_length, model)
    t0 = time.perf_counter()
    host = steps[sharing].pack(batch)
    pack_ms = 1e3 * (time.perf_counter() - t0)
    batches[sharing] = steps[sharing].place_batch(host)
    if sharing == "rows":
      stats[sharing] = rowwise_stats(cfg, host)
      stats[sharing]["rows"] = (host.completions.shape[0], p + t)
    else:
      stats[sharing] = analytic_flops(cfg, host.packed, completion_tokens)
      stats[sharing]["rows"] = host.packed.tokens.shape
    t0 = time.perf_counter()
    analysis = steps[sharing].lower(states[sharing], batches[sharing]).compile().memory_analysis()
    stats[sharing]["compile_s"] = time.perf_counter() - t0  # tracing, lowering and compiling the step
    stats[sharing]["temp_gib"] = (analysis.temp_size_in_bytes if analysis else 0) / 2**30
    stats[sharing].update(pack_ms=pack_ms)

  first, times = {}, {name: [] for name in steps}
  for name in steps:  # the first call compiles the step again (the ahead-of-time compile is not jit's cache)
    states[name], metrics, _ = timed(steps[name], states[name], batches[name])
    first[name] = float(metrics["loss"]), float(metrics["grad_norm"])
  for _ in range(args.repeats):  # alternating, so that machine noise hits every layout alike
    for name in steps:
      states[name], _, sec = timed(steps[name], states[name], batches[name])
      times[name].append(sec)
  base = next(b for b in ("rows", "none", *steps) if b in steps)
  iteration = "" if rollout_s is None else f" {'iter s':>7} {'speed-up':>8}"
  print(
    f"{'layout':<7} {'rows':>12} {'tokens':>8} {'attn pairs':>11} {'GFLOP':>8} {'FLOP ratio':>10} "
    f"{'step s':>7} {'speed-up':>8}{iteration} {'compile s':>10} {'temp MiB':>8} {'pack ms':>8} {'loss':>12} "
    f"{'grad norm':>10}"
  )
  for name in steps:
    s, med = stats[name], statistics.median(times[name])
    it = ""
    if rollout_s is not None:  # the iteration: the rollout, then the step
      it = f" {rollout_s + med:>7.3f} {(rollout_s + statistics.median(times[base])) / (rollout_s + med):>7.2f}×"
    print(
      f"{name:<7} {str(list(s['rows'])):>12} {s['tokens']:>8} {s['pairs']:>11} {s['flops'] / 1e9:>8.3f} "
      f"{stats[base]['flops'] / s['flops']:>9.2f}× {med:>7.3f} {statistics.median(times[base]) / med:>7.2f}×{it} "
      f"{s['compile_s']:>10.1f} {s['temp_gib'] * 1024:>8.1f} {s['pack_ms']:>8.1f} {first[name][0]:>+12.8f} "
      f"{first[name][1]:>10.4e}"
    )
  worst = max(abs(first[n][0] - first[base][0]) for n in steps)
  print(f"largest |loss - loss({base})| over the layouts: {worst:.2e}")


if __name__ == "__main__":
  main()
