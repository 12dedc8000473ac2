"""Long rollouts: the decode loop reading only the KV cache's filled slots (``attention="auto"``, blocks of
``jaxgrpo.models.attention.decode_block``) against reading the whole cache at every step (``attention="dense"``).

A random Qwen3-architecture model (``_bench.add_model_args``; default here a small one, so that at these lengths the
attention is a real share of a decode step, as it is for large models at 8k-32k tokens) samples ``--samples``
completions of exactly ``--new-tokens`` tokens (temperature 1, no stop id) for ``--prompts`` random prompts of
``--prompt-len`` tokens, through ``jaxgrpo.rollout.sampling.generate``, once per implementation and the same key, so
that both draw the same tokens. The two are timed alternately, ``--rounds`` rounds after one warm-up each
(compilation excluded); printed: each round's seconds, the medians, tokens/s and the speed-up, the largest log-prob
difference between the two rollouts (over each row's tokens before its first differing one: a draw within ~1e-6 of a boundary of the
cumulative distribution may go either way, after which the rows differ), and the cache slots read per step (analytic: the whole cache against the
filled blocks, averaged over the rollout).

    python scripts/bench_decode_attention.py                          # BENCHMARKS.md, "Decode attention ..."
    python scripts/bench_decode_attention.py --new-tokens 1024 --rounds 1 --prompts 1 --samples 2   # quick
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import jax
import numpy as np
from flax import nnx

from jaxgrpo import models
from jaxgrpo.models import attention
from jaxgrpo.rollout.sampling import SamplingConfig, generate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--prompts", type=int, default=2)
  p.add_argument("--samples", type=int, default=4)
  p.add_argument("--prompt-len", type=int, default=64)
  p.add_argument("--new-tokens", type=int, default=4096)
  p.add_argument("--rounds", type=int, default=3)
  _bench.add_model_args(p)
  p.set_defaults(vocab=4096, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=256)
  return p.parse_args(argv)


def slots_read(prompt_len: int, new_tokens: int, block: int) -> tuple[int, float]:
  """Cache slots per decode step: the whole cache (``P + T - 1``), and the filled blocks averaged over the T - 1
  decode steps (step t reads ``ceil((P + t) / C)`` blocks of C, at most the cache)."""
  total = prompt_len + new_tokens - 1
  if not block:
    return total, float(total)
  per_step = [min(-(-(prompt_len + t) // block) * block, total) for t in range(1, new_tokens)]
  return total, statistics.fmean(per_step)


def main(argv=None) -> dict:
  args = parse_args(argv)
  total = args.prompt_len + args.new_tokens
  cfg = models.Qwen3Config(
    vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
    num_kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate_size=args.intermediate,
    tie_word_embeddings=True, max_position_embeddings=max(512, total),
  )  # fmt: skip
  base = nnx.split(models.build_model(cfg, rngs=nnx.Rngs(args.seed)))
  rng = np.random.default_rng(args.seed)
  prompts = rng.integers(1, args.vocab, (args.prompts, args.prompt_len)).astype(np.int32)
  mask = np.ones(prompts.shape, bool)
  sampling = SamplingConfig(num_samples=args.samples, max_new_tokens=args.new_tokens, pad_id=0)
  impls = ("dense", "auto")
  mods = {i: models.set_attention(nnx.merge(*base), i) for i in impls}
  outs = {}

  def run(impl):
    outs[impl] = generate(mods[impl], prompts, mask, sampling, key=jax.random.key(1))
    return outs[impl].completions

  print(f"{_bench.backend_line()}; {platform.processor() or platform.machine()}")
  block = attention.decode_block("auto", total - 1)
  print(
    f"model: D {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads of {args.head_dim}, V {args.vocab}; "
    f"{args.prompts} prompts x {args.samples} samples, {args.prompt_len} + {args.new_tokens} tokens; cache "
    f"{total - 1} slots, decode block {block or 'none (whole cache)'}"
  )
  times = _bench.alternating_times(
    [lambda i=i: run(i) for i in impls], args.rounds,
    on_round=lambda r, t: print(f"round {r}: " + ", ".join(f"{i} {s:.2f} s" for i, s in zip(impls, t)), flush=True),
  )  # fmt: skip
  med = dict(zip(impls, _bench.medians(times)))
  tokens = args.prompts * args.samples * args.new_tokens
  a, d = np.asarray(outs["auto"].completions), np.asarray(outs["dense"].completions)
  prefix = np.cumprod(a == d, axis=1).astype(bool)  # before each row's first differing token
  same = float(prefix.mean())  # a draw within ~1e-6 of a boundary of the CDF may go either way, then rows diverge
  delta = np.abs(np.asarray(outs["auto"].log_probs) - np.asarray(outs["dense"].log_probs))
  diff = float(delta[prefix].max())
  whole, filled = slots_read(args.prompt_len, args.new_tokens, block)
  for i in impls:
    print(f"{i:>6}: median {med[i]:.2f} s, {tokens / med[i]:.0f} tokens/s")
  print(
    f"speed-up auto / dense: {med['dense'] / med['auto']:.2f}x; slots read per step {filled:.0f} of {whole} "
    f"({whole / filled:.2f}x fewer); tokens before a row's first difference: {same:.1%}, where max |log-prob "
    f"difference| {diff:.1e}"
  )
  return {"medians": med, "speedup": med["dense"] / med["auto"], "same_tokens": same, "max_logp_diff": diff}


if __name__ == "__main__":
  main()
