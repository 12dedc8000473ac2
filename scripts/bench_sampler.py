"""Benchmark `jaxgrpo.rollout.sampling.generate` against transformers' `generate` (CPU torch), same weights.

A random Qwen3-architecture model (defaults: vocab 32000, hidden 384, 4 layers, 8 heads / 4 kv
heads, head_dim 32, intermediate 1536, tied embeddings, fp32: ~20.5M parameters) is built with
transformers, saved, and loaded with `jaxgrpo.models.load_hf`. Both samplers draw
`--samples` completions of exactly `--new-tokens` tokens (temperature 1, no top-k/top-p, no EOS
stop) for `--prompts` random prompts of `--prompt-len` tokens; the two are timed alternately
`--repeats` times after one warm-up each (compilation excluded), and the median tokens/s of each
and their ratio are printed.

It also measures the memory bandwidth (a jitted sum over a 256 MiB float32 array) and prints the
bandwidth floor of one decode step, (parameter bytes + KV-cache bytes read per step) / bandwidth,
and the matmul-throughput floor (FLOPs per decode step / measured matmul FLOP/s), against the
measured time per generated token position.

    python scripts/bench_sampler.py                      # the full benchmark (BENCHMARKS.md)
    python scripts/bench_sampler.py --prompts 2 --samples 2 --new-tokens 4 --repeats 1 \
        --vocab 256 --hidden 64 --layers 1 --intermediate 128   # smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo import models
from jaxgrpo.rollout.sampling import SamplingConfig, generate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--prompts", type=int, default=16, help="B, number of prompts")
  p.add_argument("--samples", type=int, default=8, help="G, samples per prompt")
  p.add_argument("--new-tokens", type=int, default=128, help="T, tokens generated per sample")
  p.add_argument("--prompt-len", type=int, default=32, help="P, tokens per prompt")
  p.add_argument("--repeats", type=int, default=3, help="timed runs of each sampler (alternating)")
  _bench.add_model_args(p)
  p.add_argument("--skip-hf", action="store_true", help="time only jaxgrpo's sampler")
  return p.parse_args(argv)


def _torch():
  """torch and transformers (the baseline; optional extras)."""
  try:
    import torch
    import transformers
  except ImportError as e:
    raise ImportError("bench_sampler's baseline needs torch and transformers: pip install 'jaxgrpo[test]'") from e
  return torch, transformers


def build_hf_model(args):
  torch, transformers = _torch()

  torch.manual_seed(args.seed)
  cfg = transformers.Qwen3Config(
    vocab_size=args.vocab,
    hidden_size=args.hidden,
    num_hidden_layers=args.layers,
    num_attention_heads=args.heads,
    num_key_value_heads=args.kv_heads,
    head_dim=args.head_dim,
    intermediate_size=args.intermediate,
    tie_word_embeddings=True,
    max_position_embeddings=max(512, args.prompt_len + args.new_tokens),
    torch_dtype="float32",
  )
  model = transformers.Qwen3ForCausalLM(cfg).eval()
  return model


def main(argv=None) -> dict:
  args = parse_args(argv)
  torch, _ = _torch()

  B, G, T, P = args.prompts, args.samples, args.new_tokens, args.prompt_len
  hf_model = build_hf_model(args)
  with tempfile.TemporaryDirectory() as d:
    hf_model.save_pretrained(d)
    model = models.load_hf(d)
  n_params = sum(int(np.prod(p.shape)) for p in hf_model.parameters())

  rng = np.random.default_rng(args.seed)
  prompts = rng.integers(1, args.vocab, size=(B, P)).astype(np.int32)
  prompt_mask = np.ones((B, P), bool)
  jax_prompts, jax_mask = jnp.asarray(prompts), jnp.asarray(prompt_mask)
  torch_prompts = torch.from_numpy(prompts.astype(np.int64))
  torch_mask = torch.ones_like(torch_prompts)

  calls = {"n": 0}
  settings = SamplingConfig(num_samples=G, max_new_tokens=T, top_p=1.0, top_k=0, eos_ids=(), pad_id=0)

  def run_ours():
    calls["n"] += 1
    out = generate(model, jax_prompts, jax_mask, settings, key=jax.random.key(calls["n"]), temperature=1.0)
    jax.block_until_ready(out)
    return out

  def run_hf():
    with torch.inference_mode():
      out = hf_model.generate(
        input_ids=torch_prompts,
        attention_mask=torch_mask,
        do_sample=True,
        temperature=1.0,
        top_k=None,
        top_p=1.0,
        num_return_sequences=G,
        max_new_tokens=T,
        min_new_tokens=T,
        eos_token_id=None,
        pad_token_id=0,
      )
    return out

  t0 = time.perf_counter()
  out = run_ours()
  compile_s = time.perf_counter() - t0
  assert out.completions.shape == (B * G, T) and bool(out.mask.all()), "expected full-length rows"
  if not args.skip_hf:
    hf_out = run_hf()
    assert hf_out.shape == (B * G, P + T), hf_out.shape

  fns = [run_ours] if args.skip_hf else [run_ours, run_hf]
  report = lambda r, t: print(
    f"repeat {r}: jaxgrpo {t[0]:.2f}s" + (f", transformers {t[1]:.2f}s" if len(t) > 1 else ""), flush=True
  )
  times = _bench.alternating_times(fns, args.repeats, warmup=0, rotate=False, on_round=report)  # warm above
  ours, hf = times[0], (times[1] if len(times) > 1 else [])

  tokens = B * G * T
  ours_tps = tokens / statistics.median(ours)
  hf_tps = tokens / statistics.median(hf) if hf else float("nan")

  # Floors for one decode step (N = B*G rows, one token each; static cache of P + T - 1 slots).
  bandwidth = _bench.read_bandwidth()
  matmul_flops = _bench.matmul_flops(128, 1024, 4096)  # decode-like: [rows, D] @ [D, 4D]
  cfg = model.config
  n_rows, cache_len = B * G, P + T - 1
  param_bytes = 4 * n_params
  kv_bytes = 4 * n_rows * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * cache_len
  step_floor_bw = (param_bytes + kv_bytes) / bandwidth
  # FLOPs: 2 per weight per row (the tied embedding counted once, as the output head; the
  # input lookup is a gather) + scores and values over the static cache.
  flops = 2 * n_rows * n_params + 4 * n_rows * cfg.num_layers * cfg.num_heads * cfg.head_dim * cache_len
  step_floor_flops = flops / matmul_flops
  step_measured = statistics.median(ours) / T

  res = dict(
    params=n_params,
    tokens=tokens,
    ours_tps=ours_tps,
    hf_tps=hf_tps,
    ratio=ours_tps / hf_tps,
    ours_s=ours,
    hf_s=hf,
    compile_s=compile_s,
    bandwidth_gbs=bandwidth / 1e9,
    matmul_gflops=matmul_flops / 1e9,
    step_ms=1e3 * step_measured,
    step_floor_bw_ms=1e3 * step_floor_bw,
    step_floor_flops_ms=1e3 * step_floor_flops,
  )
  print(
    f"model: Qwen3-arch random, {n_params / 1e6:.2f}M params, vocab {cfg.vocab_size}, "
    f"hidden {cfg.hidden_size}, {cfg.num_layers} layers, fp32; jax {jax.__version__}, "
    f"torch {torch.__version__}, devices {jax.devices()}"
  )
  print(
    f"workload: {B} prompts x {P} tokens, {G} samples, {T} new tokens = {tokens} tokens; "
    f"{args.repeats} alternating repeats (first call incl. compile: {compile_s:.1f}s)"
  )
  print(
    f"jaxgrpo generate : median {statistics.median(ours):.3f}s  {ours_tps:9.1f} tok/s  "
    f"runs {[round(t, 3) for t in ours]}"
  )
  if hf:
    print(
      f"transformers     : median {statistics.median(hf):.3f}s  {hf_tps:9.1f} tok/s  runs {[round(t, 3) for t in hf]}"
    )
    print(f"ratio (ours / transformers): {ours_tps / hf_tps:.2f}x")
  print(f"bandwidth {bandwidth / 1e9:.1f} GB/s; matmul {matmul_flops / 1e9:.1f} GFLOP/s")
  print(
    f"decode step (N={n_rows} rows): measured {1e3 * step_measured:.2f} ms per token position "
    f"(total / T, prefill included)"
  )
  print(
    f"  bandwidth floor: ({param_bytes / 1e6:.1f} MB params + {kv_bytes / 1e6:.1f} MB KV) / bw "
    f"= {1e3 * step_floor_bw:.2f} ms -> at {step_floor_bw / step_measured:.0%} of it"
  )
  print(
    f"  matmul floor: {flops / 1e9:.2f} GFLOP / matmul rate = {1e3 * step_floor_flops:.2f} ms "
    f"-> at {step_floor_flops / step_measured:.0%} of it"
  )
  return res


if __name__ == "__main__":
  main(sys.argv[1:])
