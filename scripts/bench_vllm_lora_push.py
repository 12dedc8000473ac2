"""Adapter-only LoRA sync into vLLM against the merged push (issue 35 item 7), on the peers' random Qwen3 models.

Run it with vLLM's venv (``bash scripts/setup_vllm_venv.sh``)::

    .venv-vllm/bin/python scripts/bench_vllm_lora_push.py --workloads 20m,150m

For each workload of ``scripts/peers/common.py`` (the model only), a LoRA policy (``--rank``, every attention and
MLP projection, random A and B) in ONE ``VLLMEngine(lora_rank=r)`` (float32):

1. push seconds (``engine.push_seconds``), median of ``--repeats`` pushes of the same policy, alternating:
   **merged** (``push_weights`` with the engine's ``lora_rank`` unset: ``lora.merge_lora`` then every weight
   through ``reload_weights``) and **adapter** (``lora.base_fingerprint`` of the base, unchanged, so no base push;
   ``lora.save_peft`` into a directory and vLLM's ``add_lora`` of a new ``LoRARequest``); and the first adapter
   push, which sends the base too;
2. the rollouts after each path: ``--prompts`` × ``--samples`` × ``--new-tokens`` at temperature 1 with the same
   seeds, their generate seconds (median of ``--gen-repeats`` alternating rounds after a warm-up round: vLLM's
   LoRA adds the adapter matmuls to every decoded token), the share of identical tokens and max |Δ log-prob| over the positions before a
   row's first differing token (the two paths sample the same policy).

Numbers depend on the machine's load: say so when recording them (BENCHMARKS.md, "Engines").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

from jaxgrpo.models import build_model, lora
from jaxgrpo.rollout.engines.vllm import VLLMEngine
from jaxgrpo.rollout.sampling import SamplingConfig

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "peers"))  # scripts/peers/common.py
import _bench  # noqa: E402  (scripts/_bench.py: this script's directory is on sys.path)
import common  # noqa: E402


def policy(shape, rank: int, seed: int = 0):
  """The workload's random Qwen3 (tied, float32) with rank-``rank`` adapters on every projection, B random."""
  cfg = _bench.qwen3_config(shape, 512)
  model = build_model(cfg, rngs=nnx.Rngs(seed))
  lora.apply_lora(model, lora.LoRAConfig(rank=rank, alpha=2.0 * rank), key=jax.random.key(seed + 1))
  for i, (_path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))):
    var.set_value(0.02 * jax.random.normal(jax.random.key(1000 + i), var.get_value().shape))
  return cfg, model


def one(name: str, args) -> dict:
  shape = common.get_workload(name).model
  cfg, model = policy(shape, args.rank)
  engine = VLLMEngine(cfg, lora_rank=args.rank, kv_cache_bytes=256 * 2**20)
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, shape.vocab, (args.prompts, 32)).astype(np.int32)
  mask = np.ones_like(tokens, bool)
  settings = SamplingConfig(num_samples=args.samples, max_new_tokens=args.new_tokens, eos_ids=(), pad_id=0)
  out = {"workload": name, "params": shape.n_params, "rank": args.rank}
  engine.push_weights(model)
  out["first_adapter_push_s"] = engine.push_seconds
  merged_s, adapter_s = [], []
  for _ in range(args.repeats):
    engine.lora_rank = None  # the merged path
    engine.push_weights(model)
    merged_s.append(engine.push_seconds)
    engine.lora_rank = args.rank
    engine.push_weights(model)  # base unchanged: adapters only (after the merged push, the base is re-sent once)
    engine.push_weights(model)
    adapter_s.append(engine.push_seconds)
  out["merged_push_s"] = statistics.median(merged_s)
  out["adapter_push_s"] = statistics.median(adapter_s)
  rollouts, gen_s = {}, {"adapter": [], "merged": []}
  for round_ in range(args.gen_repeats + 1):  # alternating rounds; the first is a warm-up
    for path in ("adapter", "merged"):
      engine.lora_rank = args.rank if path == "adapter" else None
      engine.push_weights(model)
      t0 = time.perf_counter()
      rollouts[path] = engine.generate(tokens, mask, settings, key=jax.random.key(7)).rollout
      if round_:
        gen_s[path].append(time.perf_counter() - t0)
  for path, times in gen_s.items():
    out[f"{path}_generate_s"] = statistics.median(times)
  a, m = rollouts["adapter"], rollouts["merged"]
  same = np.asarray(a.completions) == np.asarray(m.completions)
  before = np.cumprod(same, axis=1).astype(bool)
  out["same_tokens"] = float(same.mean())
  out["max_abs_logp"] = float(np.abs(np.asarray(a.log_probs) - np.asarray(m.log_probs))[before].max())
  out["compared_positions"] = int(before.sum())
  engine.close()
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workloads", default="20m,150m")
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--gen-repeats", type=int, default=3, help="timed generate rounds per path (alternating)")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--samples", type=int, default=4)
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--out", default=None, help="write the results here (JSON)")
  args = p.parse_args(argv)
  results = [one(w, args) for w in args.workloads.split(",")]
  for r in results:
    print(
      f"{r['workload']} ({r['params'] / 1e6:.1f}M, r={r['rank']}): push merged {r['merged_push_s']:.3f} s, "
      f"adapter {r['adapter_push_s']:.3f} s (first, with the base: {r['first_adapter_push_s']:.3f} s); "
      f"generate merged {r['merged_generate_s']:.2f} s, adapter {r['adapter_generate_s']:.2f} s; "
      f"same tokens {r['same_tokens']:.3f}, max |Δ log-prob| {r['max_abs_logp']:.2e} over {r['compared_positions']}"
    )
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
