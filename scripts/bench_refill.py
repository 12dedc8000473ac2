"""Benchmark slot refill (`jaxgrpo.rollout.refill.generate_refill`) against static batches of
`jaxgrpo.rollout.sampling.generate` on a long-tailed length distribution.

Model: the 20.5M-parameter workload of scripts/bench_sampler.py (a random Qwen3-architecture model: vocab
32000, hidden 384, 4 layers, 8 heads / 4 kv heads, head_dim 32, intermediate 1536, tied embeddings, fp32),
built directly with jaxgrpo (no transformers needed). N = `--prompts` x `--samples` rows of `--prompt-len`
random prompt tokens; each row's length is drawn from a log-normal with the median at `--new-tokens` / 10
(sigma `--sigma`), rounded and clipped to [1, T], and enforced as the row's budget (no EOS id).

- static: `generate` over consecutive batches of `--slots` rows (`--slots / --samples` prompts each), each
  with max_new_tokens = the longest budget of its batch — what a static batch of that size costs: it decodes
  until its longest row ends (the shorter rows are the same tokens cut at their budgets).
- refill: `generate_refill(num_slots=--slots, refill_every=--refill-every, budgets=...)`: the same rows in
  the same number of slots (the same KV-cache rows), a finished row's slot refilled at the next boundary.

Both produce the same tokens (checked on the warm-up outputs); tokens/s counts the real tokens (the sum of
the budgets). The two are timed alternately `--repeats` times after a warm-up each (compilation excluded),
and the median tokens/s of each and their ratio are printed.

    python scripts/bench_refill.py                       # the full benchmark (BENCHMARKS.md)
    python scripts/bench_refill.py --prompts 4 --samples 2 --slots 4 --new-tokens 16 --prompt-len 4 \
        --repeats 1 --vocab 256 --hidden 64 --layers 1 --intermediate 128   # smoke run
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
from flax import nnx

from jaxgrpo import models
from jaxgrpo.rollout.refill import generate_refill
from jaxgrpo.rollout.sampling import SamplingConfig, generate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--prompts", type=int, default=64, help="B, number of prompts")
  p.add_argument("--samples", type=int, default=8, help="G, samples per prompt")
  p.add_argument("--slots", type=int, default=128, help="S, rows decoded at once (a multiple of G)")
  p.add_argument("--refill-every", type=int, default=4, help="K, decode steps between refill boundaries")
  p.add_argument("--new-tokens", type=int, default=128, help="T, the longest completion")
  p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the lengths (median T/10)")
  p.add_argument("--prompt-len", type=int, default=32, help="P, tokens per prompt")
  p.add_argument("--repeats", type=int, default=3, help="timed runs of each sampler (alternating)")
  _bench.add_model_args(p)
  return p.parse_args(argv)


def build_model(args):
  hf = dict(
    model_type="qwen3",
    vocab_size=args.vocab,
    hidden_size=args.hidden,
    num_hidden_layers=args.layers,
    num_attention_heads=args.heads,
    num_key_value_heads=args.kv_heads,
    head_dim=args.head_dim,
    intermediate_size=args.intermediate,
    tie_word_embeddings=True,
    max_position_embeddings=max(512, args.prompt_len + args.new_tokens),
    rms_norm_eps=1e-6,
    rope_theta=1e6,
  )
  return models.build_model(models.config_from_hf(hf), rngs=nnx.Rngs(args.seed))


def lognormal_lengths(rng, n: int, t_max: int, sigma: float) -> np.ndarray:
  """int32[n] lengths: round(exp(N(log(T/10), sigma))) clipped to [1, T]."""
  x = np.exp(rng.normal(np.log(t_max / 10), sigma, n))
  return np.clip(np.rint(x), 1, t_max).astype(np.int32)


def main(argv=None) -> dict:
  args = parse_args(argv)
  B, G, T, P, S, K = args.prompts, args.samples, args.new_tokens, args.prompt_len, args.slots, args.refill_every
  if S % G or S > B * G:
    raise SystemExit(f"--slots must be a multiple of --samples ({G}) and at most prompts x samples ({B * G}); got {S}")
  model = build_model(args)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  rng = np.random.default_rng(args.seed)
  prompts = rng.integers(1, args.vocab, size=(B, P)).astype(np.int32)
  mask = np.ones((B, P), bool)
  budgets = lognormal_lengths(rng, B * G, T, args.sigma)
  tokens = int(budgets.sum())
  per_batch = S // G  # prompts per static batch
  batches = [(b, b + per_batch, int(budgets[b * G : (b + per_batch) * G].max())) for b in range(0, B, per_batch)]
  calls = {"n": 0}

  def run_static(key=None):
    calls["n"] += 1
    key = jax.random.key(calls["n"]) if key is None else key
    outs = []
    for lo, hi, t_b in batches:  # each batch decodes until its longest row ends
      sp = SamplingConfig(num_samples=G, max_new_tokens=t_b, pad_id=0)
      outs.append(generate(model, jnp.asarray(prompts[lo:hi]), jnp.asarray(mask[lo:hi]), sp, key=key))
    jax.block_until_ready(outs)
    return outs

  info: dict = {}

  def run_refill(key=None):
    calls["n"] += 1
    key = jax.random.key(calls["n"]) if key is None else key
    sp = SamplingConfig(num_samples=G, max_new_tokens=T, pad_id=0)
    out = generate_refill(model, prompts, mask, sp, key=key, num_slots=S, refill_every=K, budgets=budgets, info=info)
    return jax.block_until_ready(out)

  t0 = time.perf_counter()
  static_out = run_static(jax.random.key(0))
  static_compile = time.perf_counter() - t0
  t0 = time.perf_counter()
  refill_out = run_refill(jax.random.key(0))
  refill_compile = time.perf_counter() - t0
  # Same rows: the first static batch holds global rows 0..S-1 at their own indices, and the first S uniforms of
  # a draw of N are those of a draw of S (jax_threefry_partitionable), so its rows must equal refill's. (The
  # other batches index their rows from 0: other draws, by construction.)
  lo, hi, t_b = batches[0]
  m = np.arange(t_b)[None] < budgets[:S][:, None]
  ref_ids, ref_lps = np.asarray(static_out[0].completions), np.asarray(static_out[0].log_probs)
  ids, lps = np.asarray(refill_out.completions)[:S, :t_b], np.asarray(refill_out.log_probs)[:S, :t_b]
  differs = np.where(m, ref_ids != ids, False)
  same = int(np.sum(~differs.any(axis=1)))
  first = np.where(differs.any(axis=1), differs.argmax(axis=1), t_b)  # each row's first differing token
  before = np.arange(t_b)[None] < np.minimum(first, budgets[:S])[:, None]  # the common prefix of each row
  worst = float(np.max(np.abs(np.where(before, ref_lps - lps, 0))))
  print(
    f"check: first static batch vs refill rows 0..{S - 1}: identical ids in {same}/{S} rows (first differing "
    f"token of the others: {sorted(first[first < t_b].tolist())}); max |dlogp| on the common prefixes {worst:.2e}"
  )

  report = lambda r, t: print(f"round {r}: static {t[0]:.2f}s, refill {t[1]:.2f}s", flush=True)
  times = _bench.alternating_times([run_static, run_refill], args.repeats, warmup=0, on_round=report)
  static_s, refill_s = statistics.median(times[0]), statistics.median(times[1])
  static_tps, refill_tps = tokens / static_s, tokens / refill_s
  static_steps = sum(t_b - 1 for *_, t_b in batches)  # decode steps after the prefill's token 0
  print(
    f"model: Qwen3-arch random, {n_params / 1e6:.2f}M params, vocab {args.vocab}, hidden {args.hidden}, "
    f"{args.layers} layers, fp32; jax {jax.__version__}, devices {jax.devices()}"
  )
  print(
    f"workload: {B} prompts x {G} samples = {B * G} rows, prompt {P}, T = {T}; lengths log-normal median T/10 "
    f"sigma {args.sigma}: mean {budgets.mean():.1f}, median {np.median(budgets):.0f}, max {budgets.max()}, "
    f"{tokens} tokens; {S} slots, refill every {K} steps"
  )
  print(
    f"static : {len(batches)} batches of {S} rows, {static_steps} decode steps (longest row of each batch) "
    f"= {(tokens - B * G) / max(1, static_steps * S):.0%} of slot-steps used; first call incl. compile {static_compile:.1f}s"
  )
  print(
    f"refill : {info['boundaries']} boundaries, {info['decode_steps']} decode steps, {info['slot_steps_used'] / max(1, info['decode_steps'] * S):.0%} of slot-steps used; first call "
    f"incl. compile {refill_compile:.1f}s"
  )
  print(f"static generate : median {static_s:.3f}s  {static_tps:9.1f} tok/s  runs {[round(t, 3) for t in times[0]]}")
  print(f"generate_refill : median {refill_s:.3f}s  {refill_tps:9.1f} tok/s  runs {[round(t, 3) for t in times[1]]}")
  print(f"ratio (refill / static tokens/s): {refill_tps / static_tps:.2f}x")
  return dict(static_s=times[0], refill_s=times[1], ratio=refill_tps / static_tps, info=dict(info))


if __name__ == "__main__":
  main(sys.argv[1:])
