"""The accelerator rows at the sizes users train: a Qwen3-0.6B- and a Qwen3-1.7B-shaped random model in bf16.

For each shape, in one process (``scripts/gpu_check.sh`` runs it on a lent GPU; ``--dry`` runs the same code
on the CPU at toy sizes, which the test suite does):

- **train step**: compile + first step (seconds), then the median step time of a GRPO step (B completions of
  T tokens after P prompt tokens, bf16 parameters and activations, ``scan_layers``); **MFU against the chip's
  bf16 peak** from its datasheet (:data:`CHIPS`; never a self-measured matmul rate), with the PaLM-style model
  FLOPs ``6·N_dense·B·(P+T) + 6·D·V·B·T + 6·L·H·K·(P+T)²·B``;
- **decode**: tokens/s of the built-in sampler (``rollout.sampling.generate``) against the **HBM roofline**: every
  decode step reads the weights once and each row's KV cache so far, ``bytes = params·2 + rows·L·2·KV·K·2·(P + t)``
  summed over the T steps; roofline tokens/s = rows·T / (bytes / HBM bandwidth);
- **GRPO iteration**: one ``loop.iteration.grpo_iteration`` (sample, score, update) end to end.

Results go to ``OUT/accel_<shape>.json`` (and stdout). On a chip not in :data:`CHIPS` (or the CPU) MFU and the
roofline are left out (None) rather than computed against a guessed peak.

  python scripts/bench_accel.py --out runs/accel                  # on a GPU: 0.6b and 1.7b
  python scripts/bench_accel.py --dry --out /tmp/accel            # CPU: toy shapes, the same code
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
from jaxgrpo.loop.iteration import grpo_iteration
from jaxgrpo.models import Qwen3Config, build_model
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.plan import step_flops
from jaxgrpo.rollout.sampling import SamplingConfig, generate
from jaxgrpo.step import feed, train

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402

#: Qwen3 shapes (hidden, layers, heads, kv heads, head_dim, intermediate, vocab); "toy" is the --dry shape.
SHAPES = {
  "0.6b": dict(
    hidden_size=1024,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
  ),
  "1.7b": dict(
    hidden_size=2048,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=6144,
    vocab_size=151936,
  ),
  "toy": dict(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=512
  ),
}
#: datasheet dense bf16 peak (FLOP/s) and HBM bandwidth (B/s), matched against ``device.device_kind``
CHIPS = {
  "H200": (989e12, 4.8e12),
  "H100": (989e12, 3.35e12),  # SXM; the PCIe card is lower (756 TFLOP/s, 2.0 TB/s): see device_kind
  "A100": (312e12, 2.039e12),
  "TPU v5 lite": (197e12, 0.819e12),
  "TPU v5p": (459e12, 2.765e12),
  "TPU v4": (275e12, 1.2e12),
}


def chip(device) -> tuple[str, float | None, float | None]:
  """``(device_kind, bf16 peak FLOP/s, HBM B/s)``; None where the chip is not in :data:`CHIPS` or is a PCIe H100."""
  kind = getattr(device, "device_kind", str(device))
  if "H100" in kind and "PCIe" in kind:
    return kind, 756e12, 2.0e12
  for name, (peak, bw) in CHIPS.items():
    if name in kind:
      return kind, peak, bw
  return kind, None, None


def model_flops(cfg, b, p, t) -> float:
  """Model FLOPs of one train step (forward + backward, no recomputation counted): ``jaxgrpo.plan.step_flops``."""
  return step_flops(cfg, b, p, t)


def decode_bytes(cfg, n_params, rows, p, t) -> float:
  """HBM bytes the T decode steps read at least: the bf16 weights once per step and each row's bf16 KV so far."""
  kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
  return t * n_params * 2 + rows * kv_per_token * sum(p + i for i in range(t))


def run_shape(name: str, args) -> dict:
  cfg = Qwen3Config(**SHAPES[name], tie_word_embeddings=True, max_position_embeddings=4096)
  model = build_model(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, scan_layers=True)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
  kind, peak, bw = chip(jax.devices()[0])
  b, g, p, t = args.batch, args.group, args.prompt, args.length
  mesh = shd.make_mesh("", devices=jax.devices()[:1])
  opt = optax.adamw(1e-6)
  config = dataclasses.replace(preset("grpo"), beta=0.0)
  tc = train.TrainConfig(micro_batches=args.micro_batches, chunk_size=args.chunk_size, group_size=g)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
  rng = np.random.default_rng(0)
  batch = train.Batch(
    rng.integers(10, cfg.vocab_size, (b, p)).astype(np.int32),
    np.ones((b, p), bool),
    rng.integers(10, cfg.vocab_size, (b, t)).astype(np.int32),
    np.ones((b, t), bool),
    np.full((b, t), -2.0, np.float32),
    np.repeat(np.arange(b // g), g).astype(np.int32),
    rng.integers(0, 2, b).astype(np.float32),
  )
  placed = shd.place_batch(batch, mesh)
  t0 = time.perf_counter()
  state, _ = step(state, placed)
  jax.block_until_ready(state)
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(args.repeats):
    t1 = time.perf_counter()
    state, metrics = step(state, placed)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t1)
  step_s = statistics.median(times)
  flops = model_flops(cfg, b, p, t)
  out = {
    "shape": name,
    "device_kind": kind,
    "params": int(n_params),
    "batch": [b, p, t],
    "compile_and_first_step_s": compile_s,
    "step_s": step_s,
    "step_tflops": flops / step_s / 1e12,
    "mfu_bf16_peak": None if peak is None else flops / step_s / peak,
  }
  # decode: the sampler on the trained parameters, B rows of T new tokens (no EOS: every row runs T steps)
  policy = feed.policy_model(graphdef, state)
  sampling = SamplingConfig(num_samples=1, max_new_tokens=t, eos_ids=(), pad_id=0)
  prompts, pmask = batch.prompt_tokens, batch.prompt_mask
  gen = lambda: generate(policy, prompts, pmask, sampling, key=jax.random.key(1)).completions  # noqa: E731
  t2 = time.perf_counter()
  jax.block_until_ready(gen())
  decode_compile_s = time.perf_counter() - t2
  decode_s = _bench.median_time(gen, args.repeats, warmup=0)
  tokens = b * t
  roof = None if bw is None else tokens / (decode_bytes(cfg, n_params, b, p, t) / bw)
  out.update(
    decode_compile_s=decode_compile_s,
    decode_s=decode_s,
    decode_tokens_per_s=tokens / decode_s,
    decode_roofline_tokens_per_s=roof,
    decode_frac_of_roofline=None if roof is None else tokens / decode_s / roof,
  )
  # the whole GRPO iteration: sample G per prompt, score (a cheap length reward), update
  it_sampling = SamplingConfig(num_samples=g, max_new_tokens=t, eos_ids=(), pad_id=0)
  reward = lambda prompts, completions, **_: [float(len(c) % 3) for c in completions]  # noqa: E731
  it_prompts, it_mask = prompts[: b // g], pmask[: b // g]
  res = grpo_iteration(step, state, it_prompts, it_mask, key=jax.random.key(2), reward_fn=reward, sampling=it_sampling)
  state = res.state
  t3 = time.perf_counter()
  res = grpo_iteration(step, state, it_prompts, it_mask, key=jax.random.key(3), reward_fn=reward, sampling=it_sampling)
  jax.block_until_ready(res.state)
  out.update(
    iteration_s=time.perf_counter() - t3, iteration_phases={k: v for k, v in res.metrics.items() if k.endswith("_s")}
  )
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shapes", default="0.6b,1.7b", help="comma-separated: 0.6b, 1.7b, toy")
  ap.add_argument("--dry", action="store_true", help="the CPU path at the toy shape and a small batch")
  ap.add_argument("--batch", type=int, default=64, help="completions per step (B = prompts x group)")
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=128)
  ap.add_argument("--length", type=int, default=512)
  ap.add_argument("--micro-batches", type=int, default=4)
  ap.add_argument("--chunk-size", type=int, default=512)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", default=None, help="directory for accel_<shape>.json")
  args = ap.parse_args(argv)
  if args.dry:
    args.shapes, args.batch, args.group, args.prompt, args.length = "toy", 8, 4, 8, 16
    args.micro_batches, args.chunk_size, args.repeats = 2, None, 1
  print(_bench.backend_line(), flush=True)
  results = []
  for name in args.shapes.split(","):
    if name not in SHAPES:
      raise SystemExit(f"--shapes: unknown shape {name!r}; choose from {sorted(SHAPES)}")
    r = run_shape(name, args)
    results.append(r)
    print(json.dumps(r), flush=True)
    if args.out:
      os.makedirs(args.out, exist_ok=True)
      with open(os.path.join(args.out, f"accel_{name}.json"), "w") as f:
        json.dump(r, f, indent=1)
  return results


if __name__ == "__main__":
  main()
