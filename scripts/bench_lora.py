"""Full fine-tuning vs LoRA vs QLoRA: peak memory and step time, and decode with adapters vs merged.

One run measures, on a Qwen3-architecture model (default: vocab 151936, hidden 1024, 8 layers,
16 heads / 8 kv heads, head_dim 128, intermediate 3072, tied embeddings: 281M parameters; bf16
parameters and compute, f32 adapters and Adam moments):

- ``full``: gradients and AdamW state for every parameter;
- ``lora``: rank 16 (α 32) on q, k, v, o, gate, up, down; gradients and AdamW state for the
  adapters only, the base weights a frozen, non-donated argument;
- ``qlora``: the same adapters on NF4 base weights (``--quantize`` to change the format).

For each mode: the parameter and optimizer-state bytes, the compiled step's ``memory_analysis()``
(arguments + outputs − aliased + temporaries: its footprint on any backend), the device's
``peak_bytes_in_use`` after the step and a generate call when the backend reports it (GPU/TPU; each
mode then runs in its own process so that peaks do not mix), and the median step time. Then decode
throughput of ``sampling.generate`` on the LoRA model with adapter matmuls vs on ``merge_lora`` of
it (the merge's own time reported separately). The issue-16 goals: LoRA optimizer state ≤ 5% of
full, iteration peak memory ≤ 60% of full.

The step is a minimal one of this script (``make_step``: value_and_grad of the mean completion NLL
over the trainable filter, then optax.adamw), standing in for ``jaxgrpo.train``'s step until it
takes a trainable filter; swap ``make_step`` for it then. Timing figures are only meaningful on a
quiet machine.

  python scripts/bench_lora.py                      # the documented configuration (an accelerator)
  python scripts/bench_lora.py --tiny --in-process  # smoke test, seconds on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxgrpo import models, sampling
from jaxgrpo.models import lora

MODES = ("full", "lora", "qlora")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--hidden", type=int, default=1024)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--intermediate", type=int, default=3072)
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="params and compute")
  p.add_argument("--batch", type=int, default=16, help="sequences per step")
  p.add_argument("--prompt-len", type=int, default=64)
  p.add_argument("--completion-len", type=int, default=448)
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--alpha", type=float, default=32.0)
  p.add_argument("--quantize", default="nf4", choices=("int8", "int4", "nf4"))
  p.add_argument("--group-size", type=int, default=64)
  p.add_argument("--remat", action="store_true", help="per-layer activation checkpointing")
  p.add_argument("--steps", type=int, default=5, help="timed steps (and decode calls) per mode, after 2 warm-ups")
  p.add_argument("--decode-prompts", type=int, default=8)
  p.add_argument("--decode-samples", type=int, default=8)
  p.add_argument("--decode-tokens", type=int, default=128)
  p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
  p.add_argument("--tiny", action="store_true", help="a tiny model and batch (smoke test)")
  p.add_argument("--in-process", action="store_true", help="run every mode in this process (peaks mix)")
  p.add_argument("--only", default=None, help=argparse.SUPPRESS)  # internal: one mode, JSON on stdout
  args = p.parse_args(argv)
  if args.tiny:
    args.vocab, args.hidden, args.layers, args.heads, args.kv_heads = 512, 64, 2, 4, 2
    args.head_dim, args.intermediate, args.batch, args.prompt_len, args.completion_len = 16, 128, 2, 8, 24
    args.rank, args.group_size, args.steps = 4, 16, 3
    args.decode_prompts, args.decode_samples, args.decode_tokens = 2, 2, 4
  args.modes = tuple(m for m in args.modes.split(",") if m)
  unknown = set(args.modes) - set(MODES)
  if unknown:
    p.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
  return args


def build(args, mode: str):
  """The model of ``mode``: plain (full), with adapters (lora), or adapters on quantised weights (qlora)."""
  cfg = models.Qwen3Config(
    vocab_size=args.vocab,
    hidden_size=args.hidden,
    num_layers=args.layers,
    num_heads=args.heads,
    num_kv_heads=args.kv_heads,
    head_dim=args.head_dim,
    intermediate_size=args.intermediate,
    tie_word_embeddings=True,
    max_position_embeddings=args.prompt_len + max(args.completion_len, args.decode_tokens),
  )
  dtype = jnp.dtype(args.dtype)
  model = models.build_model(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype, remat=args.remat)
  if mode != "full":
    lcfg = lora.LoRAConfig(
      rank=args.rank,
      alpha=args.alpha,
      quantize=args.quantize if mode == "qlora" else None,
      group_size=args.group_size,
    )
    lora.apply_lora(model, lcfg, key=jax.random.key(1))
    # trained-like adapters, so that the decode comparison multiplies real numbers
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
      if path[-1] == "b":
        v.set_value(0.01 * jax.random.normal(jax.random.key(len(path)), v.shape, v.get_value().dtype))
  return model


def make_step(graphdef, optimizer, *, chunk_size: int = 256):
  """``step(trainable, opt_state, frozen, batch) -> (trainable, opt_state, loss)``, jitted.

  ``loss`` = mean negative log-likelihood of the completion tokens (``models.log_probs``, chunked
  head). Gradients and optimizer updates cover ``trainable`` only; ``frozen`` (the base weights
  under LoRA, empty for full fine-tuning) is an ordinary, non-donated argument, so it is never
  copied. Phase 2 of issue 16 replaces this with ``jaxgrpo.train``'s step given a trainable filter.
  """

  def loss_fn(trainable, frozen, tokens, mask, loss_mask):
    model = nnx.merge(graphdef, trainable, frozen)
    lp = models.log_probs(model, tokens, mask, chunk_size=chunk_size)
    n = jnp.maximum(jnp.sum(loss_mask), 1)
    return -jnp.sum(jnp.where(loss_mask, lp, 0.0)) / n

  def step(trainable, opt_state, frozen, batch):
    tokens, mask, loss_mask = batch
    loss, grads = jax.value_and_grad(loss_fn)(trainable, frozen, tokens, mask, loss_mask)
    updates, opt_state = optimizer.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def _bytes(tree) -> int:
  return int(sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")))


def _peak_bytes():
  stats = jax.devices()[0].memory_stats()
  return None if not stats else stats.get("peak_bytes_in_use")


def _median_time(fn, n: int, warmup: int = 2) -> float:
  """Median wall time of ``n`` calls after ``warmup`` untimed ones (the first calls after compiling
  still pay one-off costs: buffer allocation, thread pools)."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def run_mode(args, mode: str) -> dict:
  """Build, compile and time one mode; decode comparison for ``lora``."""
  model = build(args, mode)
  counts = lora.count_params(model)
  trainable_filter = nnx.Param if mode == "full" else nnx.LoRAParam
  graphdef, trainable, frozen = nnx.split(model, trainable_filter, ...)
  optimizer = optax.adamw(1e-5, mu_dtype=jnp.float32)
  opt_state = optimizer.init(trainable)
  rng = np.random.default_rng(0)
  B, P, T = args.batch, args.prompt_len, args.completion_len
  tokens = jnp.asarray(rng.integers(1, args.vocab, (B, P + T)), jnp.int32)
  mask = jnp.ones((B, P + T), bool)
  loss_mask = jnp.asarray(np.arange(P + T)[None, :] >= P).repeat(B, 0)
  batch = (tokens, mask, loss_mask)
  step = make_step(graphdef, optimizer)
  t0 = time.perf_counter()
  compiled = step.lower(trainable, opt_state, frozen, batch).compile()
  compile_s = time.perf_counter() - t0
  ma = compiled.memory_analysis()
  footprint = None
  if ma is not None:
    footprint = int(
      ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    )
  res = dict(
    mode=mode,
    base_params=counts.base,
    adapter_params=counts.adapter,
    param_bytes=counts.base_bytes + counts.adapter_bytes,
    opt_state_bytes=_bytes(opt_state),
    step_footprint_bytes=footprint,
    step_temp_bytes=None if ma is None else int(ma.temp_size_in_bytes),
    compile_s=compile_s,
  )
  state = {"trainable": trainable, "opt": opt_state}

  def one_step():
    state["trainable"], state["opt"], loss = compiled(state["trainable"], state["opt"], frozen, batch)
    return loss

  res["step_s"] = _median_time(one_step, args.steps)
  model = nnx.merge(graphdef, state["trainable"], frozen)

  prompts = jnp.asarray(rng.integers(1, args.vocab, (args.decode_prompts, P)), jnp.int32)
  pmask = jnp.ones(prompts.shape, bool)
  kw = dict(num_samples=args.decode_samples, max_new_tokens=args.decode_tokens, pad_id=0, temperature=1.0)
  n_tokens = args.decode_prompts * args.decode_samples * args.decode_tokens

  def decode(m, i=[0]):  # noqa: B006 - a fresh key per call
    i[0] += 1
    return sampling.generate(m, prompts, pmask, key=jax.random.key(i[0]), **kw).completions

  res["decode_tokens_per_s"] = n_tokens / _median_time(lambda: decode(model), args.steps)
  if mode != "full":
    t0 = time.perf_counter()
    merged = jax.block_until_ready(lora.merge_lora(model))
    res["merge_s"] = time.perf_counter() - t0
    res["decode_merged_tokens_per_s"] = n_tokens / _median_time(lambda: decode(merged), args.steps)
    del merged
  res["device_peak_bytes"] = _peak_bytes()
  return res


def _in_subprocess(argv, mode: str) -> dict:
  out = subprocess.run([sys.executable, __file__, *argv, "--only", mode], capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"mode {mode} failed:\n{out.stderr[-4000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def _fmt(n) -> str:
  return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def main(argv=None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.only is not None:
    print(json.dumps(run_mode(args, args.only)))
    return {}
  separate = not args.in_process and jax.devices()[0].memory_stats() is not None
  results = {}
  for mode in args.modes:
    results[mode] = _in_subprocess(argv, mode) if separate else run_mode(args, mode)
    print(json.dumps(results[mode]), flush=True)
  print(f"\nbackend {jax.default_backend()}, {args.dtype}, batch {args.batch}×{args.prompt_len + args.completion_len}")
  print(
    f"{'mode':6} {'params':>12} {'adapters':>10} {'opt state':>12} {'step footprint':>15} {'device peak':>13} "
    f"{'step s':>8} {'decode tok/s':>13} {'merged tok/s':>13}"
  )
  for m, r in results.items():
    merged = r.get("decode_merged_tokens_per_s")
    print(
      f"{m:6} {_fmt(r['param_bytes']):>12} {r['adapter_params']:>10,} {_fmt(r['opt_state_bytes']):>12} "
      f"{_fmt(r['step_footprint_bytes']):>15} {_fmt(r['device_peak_bytes']):>13} {r['step_s']:>8.3f} "
      f"{r['decode_tokens_per_s']:>13,.0f} {'-' if merged is None else f'{merged:,.0f}':>13}"
    )
  if "full" in results:
    full = results["full"]
    for m in ("lora", "qlora"):
      if m in results:
        r = results[m]
        ratios = [f"opt state {r['opt_state_bytes'] / full['opt_state_bytes']:.2%} of full (goal ≤ 5%)"]
        for key in ("step_footprint_bytes", "device_peak_bytes"):
          if r[key] and full[key]:
            ratios.append(f"{key.replace('_bytes', '')} {r[key] / full[key]:.1%} of full (goal ≤ 60%)")
        print(f"{m}: " + "; ".join(ratios))
  return results


if __name__ == "__main__":
  main()
