"""Rollout tokens/s and the sampler/learner mismatch of quantised rollout weights (``SamplingConfig.quantize``).

The sampler's 20.5M-parameter Qwen3 (``_bench.add_model_args``; random weights, scaled by ``--weight-scale`` so the
next-token distributions are peaked rather than uniform) samples ``--prompts`` × ``--samples`` completions of
``--new-tokens`` tokens (temperature 1, no EOS) in three variants, timed alternately ``--repeats`` rounds after one
warm-up each (compilation excluded):

- ``float32``: the float32 model (the learner's own policy: its log-probs are π's);
- ``int8``: the float32 model's projections as int8 weight-only copies (``quantize="int8"``; the quantisation is
  inside the timed call, as at every push);
- ``bf16``: the model cast to bfloat16 (compute and weights).

It also prints the time of making the int8 copy alone (``lora.rollout_weights``, once per push).

For each, the mismatch between what the sampler recorded (μ) and the float32 learner's teacher-forced log-probs of
the same tokens (π): ``k3 = mean(r − log r − 1)`` with ``r = π/μ`` over the sampled tokens (the trainer's
``engine/mismatch_k3``, ``kernels.importance.mismatch_k3``) and ``max |log π − log μ|``.

    python scripts/bench_rollout_quant.py                        # BENCHMARKS.md, "Quantized rollout weights"
    python scripts/bench_rollout_quant.py --prompts 2 --samples 2 --new-tokens 4 --repeats 1 \\
        --vocab 256 --hidden 64 --layers 1 --intermediate 128   # smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo import models
from jaxgrpo.kernels.importance import mismatch_k3
from jaxgrpo.rollout.sampling import SamplingConfig, generate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402

VARIANTS = ("float32", "int8", "bf16")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--prompts", type=int, default=8, help="B, number of prompts")
  p.add_argument("--samples", type=int, default=4, help="G, samples per prompt")
  p.add_argument("--new-tokens", type=int, default=64, help="T, tokens generated per sample")
  p.add_argument("--prompt-len", type=int, default=32, help="P, tokens per prompt")
  p.add_argument("--repeats", type=int, default=3, help="timed rounds (the variants alternate)")
  p.add_argument("--weight-scale", type=float, default=4.0, help="every weight matrix times this (peaked logits)")
  _bench.add_model_args(p)
  return p.parse_args(argv)


def build(args):
  """The float32 model (weights scaled) and its bfloat16 copy."""
  cfg = _bench.qwen3_config(args, args.prompt_len + args.new_tokens)
  model = models.build_model(cfg, rngs=nnx.Rngs(args.seed))
  graphdef, state = nnx.split(model)
  state = jax.tree.map(lambda x: x * args.weight_scale if x.ndim >= 2 else x, state)
  f32 = nnx.merge(graphdef, state)
  bf16 = models.build_model(cfg, rngs=nnx.Rngs(args.seed), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  nnx.update(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))
  return f32, bf16


def mismatch(f32_model, rollout) -> tuple[float, float]:
  """``(k3, max |log π − log μ|)`` of ``rollout``'s tokens: π the float32 model's teacher-forced log-probs."""
  p = rollout.prompt_tokens.shape[1]
  tokens = jnp.concatenate([rollout.prompt_tokens, rollout.completions], axis=1)
  mask = jnp.concatenate([rollout.prompt_mask, rollout.mask], axis=1)
  old = models.log_probs(f32_model, tokens, mask, temperature=1.0)[:, p:]
  k3, gap = mismatch_k3(old, rollout.log_probs, rollout.mask)
  return float(k3), float(gap)


def main(argv=None) -> None:
  args = parse_args(argv)
  f32, bf16 = build(args)
  rng = np.random.default_rng(args.seed)
  prompts = rng.integers(1, args.vocab, (args.prompts, args.prompt_len)).astype(np.int32)
  mask = np.ones(prompts.shape, bool)
  plain = SamplingConfig(num_samples=args.samples, max_new_tokens=args.new_tokens, suppress_ids=())
  int8 = SamplingConfig(num_samples=args.samples, max_new_tokens=args.new_tokens, suppress_ids=(), quantize="int8")
  key = jax.random.key(args.seed + 1)
  calls = {
    "float32": lambda: generate(f32, prompts, mask, plain, key=key),
    "int8": lambda: generate(f32, prompts, mask, int8, key=key),
    "bf16": lambda: generate(bf16, prompts, mask, plain, key=key),
  }
  times = _bench.medians(_bench.alternating_times([calls[v] for v in VARIANTS], args.repeats))
  tokens = args.prompts * args.samples * args.new_tokens
  params = sum(x.size for x in jax.tree.leaves(nnx.state(f32)))
  print(
    f"{_bench.backend_line()}; {platform.processor() or platform.machine()}; {params / 1e6:.1f}M parameters, "
    f"B={args.prompts} G={args.samples} P={args.prompt_len} T={args.new_tokens}, weights x{args.weight_scale}, "
    f"{args.repeats} alternating rounds"
  )
  print(f"{'sampler':>8} {'tokens/s':>10} {'vs float32':>10} {'k3 vs f32 π':>12} {'max |Δlogp|':>12}")
  for v, t in zip(VARIANTS, times):
    k3, gap = mismatch(f32, calls[v]())
    print(f"{v:>8} {tokens / t:>10.0f} {times[0] / t:>9.2f}x {k3:>12.2e} {gap:>12.3f}")
  push = _bench.median_time(lambda: nnx.state(int8.model_to_sample(f32)), args.repeats)
  print(f"the int8 copy alone (lora.rollout_weights, once per push; inside the int8 row's time): {push:.3f} s")


if __name__ == "__main__":
  main()
