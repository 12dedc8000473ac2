"""Train-step throughput of grpo, lambda_grpo, frpo and lambda_frpo, and the model-FLOPs utilisation.

A ~20M-parameter Qwen3-architecture model (vocab 32000, hidden 384, 4 layers, 8 heads / 4 kv heads,
head_dim 32, intermediate 1536, tied embeddings), a batch of 64 completions (8 prompts × 8) of 256
tokens after a 16-token prompt, float32. The presets are timed in alternation (round-robin, after one
warm-up call each) and the median step time is reported, so that machine noise hits all alike. The
matmul throughput of this machine is measured in the same run (a large float32 matmul, median) and
used as the peak for the MFU.

Model FLOPs per step (PaLM-style, no recomputation counted): ``6·N_layers·S_all`` for the decoder
weights over every position, ``6·D·V·S_completion`` for the tied LM head (the step only projects the
completion positions), and ``6·L·H·K·S²·B`` for attention scores and values (causal, half of the
dense ``12·L·H·K·S`` per token), with ``S_all = B·(P+T)`` and ``S_completion = B·T``.

  python scripts/bench_train_step.py                    # the documented configuration
  python scripts/bench_train_step.py --rounds 3 --layers 2 --batch 16   # quicker
  python scripts/bench_train_step.py --overhead-only    # the presets' once-per-batch work alone
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxgrpo.kernels.config import preset
from jaxgrpo.kernels.objective import rollout_advantages
from jaxgrpo.kernels.process_sets import process_tree_stats
from jaxgrpo.models import Qwen3Config, build_model
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import train

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402

PRESETS = ("grpo", "lambda_grpo", "frpo", "lambda_frpo")


def make_batch(rng, b, g, p, t, vocab):
  """Groups whose completions share a random-length prefix (so λ sets are non-trivial), ragged lengths."""
  groups = b // g
  prompts = np.repeat(rng.integers(10, vocab, (groups, p)), g, axis=0).astype(np.int32)
  base = np.repeat(rng.integers(10, vocab, (groups, t)), g, axis=0)
  fresh = rng.integers(10, vocab, (b, t))
  split = rng.integers(0, t // 2, b)
  comp = np.where(np.arange(t)[None] < split[:, None], base, fresh).astype(np.int32)
  lens = rng.integers(t // 4, t + 1, b)
  lens[::g] = t  # one full-length completion per group: the bucket is T
  mask = np.arange(t)[None] < lens[:, None]
  comp = np.where(mask, comp, 0)
  old = np.where(mask, -2.0 + 0.5 * rng.standard_normal((b, t)), 0).astype(np.float32)
  ref = np.where(mask, old + 0.1 * rng.standard_normal((b, t)), 0).astype(np.float32)
  return train.Batch(
    prompts,
    np.ones((b, p), bool),
    comp,
    mask,
    old,
    np.repeat(np.arange(groups), g).astype(np.int32),
    rng.integers(0, 2, b).astype(np.float32),
    ref,
  )


def model_flops(cfg, b, p, t):
  d, v, l = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
  h, k, n_kv, f = cfg.num_heads, cfg.head_dim, cfg.num_kv_heads, cfg.intermediate_size
  per_layer = d * h * k * 2 + d * n_kv * k * 2 + 3 * d * f  # q, o, k, v, gate/up/down
  s = p + t
  dense = 6 * l * per_layer * b * s
  head = 6 * d * v * b * t
  attention = 6 * l * h * k * s * s * b  # causal: half of 12·L·H·K·S per token
  return dense + head + attention


def rollout_overhead(batch, group, reps=20):
  """Median seconds of each preset's once-per-batch work (advantages, future-KL, λ weights, tree stats)
  at this batch, jitted alone: the only computation in which the presets' steps differ (besides
  per-token vs per-sequence advantages in the loss)."""
  b = batch.completions.shape[0]
  out = {}
  for name in PRESETS:
    config = preset(name)

    def fn(bt, config=config):
      adv, w = rollout_advantages(
        config,
        bt.rewards,
        bt.completions,
        bt.mask,
        bt.group_ids,
        b // group,
        old_logp=bt.old_logp,
        ref_logp=bt.ref_logp,
        max_group_size=group,
      )
      stats = {}
      if w is not None:
        sizes = jnp.where(w > 0, jnp.round(1.0 / jnp.where(w > 0, w, 1.0)), 0).astype(jnp.int32)
        stats = process_tree_stats(bt.completions, bt.mask, bt.group_ids, b // group, sizes=sizes)
      return adv, w, stats

    f = jax.jit(fn)
    bt = jax.device_put(batch)
    out[name] = _bench.median_time(lambda f=f, bt=bt: f(bt), reps)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--hidden", type=int, default=384)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=16)
  ap.add_argument("--length", type=int, default=256)
  ap.add_argument("--micro-batches", type=int, default=4)
  ap.add_argument("--chunk-size", type=int, default=128)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--mesh", default="data=1", help="mesh spec over the first devices (default: one device)")
  ap.add_argument(
    "--overhead-only",
    action="store_true",
    help="only time each preset's once-per-batch work (advantages, λ weights, future-KL)",
  )
  args = ap.parse_args(argv)

  cfg = Qwen3Config(
    vocab_size=args.vocab,
    hidden_size=args.hidden,
    num_layers=args.layers,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    intermediate_size=4 * args.hidden,
    tie_word_embeddings=True,
  )
  model = build_model(cfg, rngs=nnx.Rngs(0))
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
  spec = shd.parse_mesh_spec(args.mesh)
  ndev = int(np.prod(list(spec.values())))
  mesh = shd.make_mesh(args.mesh, devices=jax.devices()[:ndev])
  opt = optax.adamw(1e-6)
  tc = train.TrainConfig(micro_batches=args.micro_batches, chunk_size=args.chunk_size, group_size=args.group)
  batch = make_batch(np.random.default_rng(0), args.batch, args.group, args.prompt, args.length, args.vocab)
  if args.overhead_only:
    print(f"once-per-batch work at {args.batch}×{args.length} (G={args.group}), jitted alone, median of 20:")
    for name, sec in rollout_overhead(batch, args.group).items():
      print(f"  {name:<12} {1e3 * sec:8.2f} ms")
    return
  print(f"{_bench.backend_line()}; {ndev} used, mesh {args.mesh}")
  print(
    f"model: {n_params / 1e6:.2f}M params; batch {args.batch}×({args.prompt}+{args.length}) tokens, "
    f"{int(batch.mask.sum())} real completion tokens; K={args.micro_batches} micro-batches, "
    f"chunk {args.chunk_size}"
  )

  steps, states, batches = {}, {}, {}
  for name in PRESETS:
    config = preset(name)
    graphdef, state, shardings = train.init_train_state(model, opt, mesh)
    steps[name] = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
    b = batch if config.needs_reference else batch._replace(ref_logp=None)
    batches[name] = shd.place_batch(b, mesh)
    t0 = time.perf_counter()
    state, metrics = steps[name](state, batches[name])
    jax.block_until_ready(state)
    print(f"{name:<12} compile + first step {time.perf_counter() - t0:6.1f} s  loss {float(metrics['loss']):+.4f}")
    states[name] = state
  ref_fn = train.make_reference_fn(graphdef, mesh=mesh, param_shardings=shardings.params, train_config=tc)
  ref_params = train.init_train_state(model, optax.identity(), mesh)[1].params  # the frozen reference
  jax.block_until_ready(ref_fn(ref_params, batches["frpo"]))

  peak_before = _bench.matmul_flops()

  def step_of(name):
    def run():
      states[name], _ = steps[name](states[name], batches[name])
      return states[name]

    return run

  # the presets and the reference pass round-robin, the order rotated every round
  fns = [step_of(name) for name in PRESETS] + [lambda: ref_fn(ref_params, batches["frpo"])]
  all_times = _bench.alternating_times(fns, args.rounds, warmup=0)  # each compiled and run once above
  times, ref_times = dict(zip(PRESETS, all_times)), all_times[-1]
  peak_after = _bench.matmul_flops()
  peak = max(peak_before, peak_after)
  assert all(s.traces == 1 for s in steps.values()), "a step was retraced"

  flops = model_flops(cfg, args.batch, args.prompt, args.length)
  completion_tokens = args.batch * args.length
  base = statistics.median(times["grpo"])
  print(
    f"\nmatmul throughput (f32 2048², median, max of before/after): {peak / 1e9:.1f} GFLOP/s "
    f"(before {peak_before / 1e9:.1f}, after {peak_after / 1e9:.1f})"
  )
  print(f"model FLOPs per step: {flops / 1e12:.3f} TFLOP\n")
  print(f"| preset | step time (median of {args.rounds}) | vs grpo | completion tokens/s | MFU |")
  print("|---|---|---|---|---|")
  for name in PRESETS:
    med = statistics.median(times[name])
    print(
      f"| {name} | {med:.3f} s (min {min(times[name]):.3f}) | {100 * (med / base - 1):+.1f}% | "
      f"{completion_tokens / med:,.0f} | {100 * flops / med / peak:.1f}% |"
    )
  print(
    f"\nreference log-prob pass (frpo and any β>0 preset, once per rollout batch): "
    f"{statistics.median(ref_times):.3f} s median"
  )


if __name__ == "__main__":
  main()
