"""Full fine-tuning vs LoRA vs QLoRA: peak memory and step time, and decode with adapters vs merged.

One run measures, on a Qwen3-architecture model (default: vocab 151936, hidden 1024, 8 layers,
16 heads / 8 kv heads, head_dim 128, intermediate 3072, tied embeddings: 281M parameters; bf16
parameters and compute, f32 adapters and Adam moments):

- ``full``: gradients and AdamW state for every parameter, and the reference policy (β > 0) a copy
  of the initial parameters;
- ``lora``: rank 16 (α 32) on q, k, v, o, gate, up, down; gradients and AdamW state for the
  adapters only, the base weights a frozen, non-donated argument, and the reference the base model
  on those same arrays (no copy);
- ``qlora``: the same adapters on NF4 base weights (``--quantize`` to change the format).

Each mode runs the library's own iteration pieces: ``jaxgrpo.step.train.init_train_state`` (``trainable``
= ``nnx.Param`` or ``nnx.LoRAParam``), ``make_train_step`` with the GRPO preset at β = 0.04 (k3 KL
in the loss) and ``jaxgrpo.step.feed.make_reference``, on a random rollout batch of ``--batch``
sequences (groups of 4). Reported: the parameter, optimizer-state and reference bytes, the compiled
step's ``memory_analysis()`` (arguments + outputs − aliased + temporaries: its footprint on any
backend), the device's ``peak_bytes_in_use`` after the reference pass, the steps and a generate call
when the backend reports it (GPU/TPU; each mode then runs in its own process so that peaks do not
mix: the iteration's peak), and the median step time (reference pass + update). Then decode
throughput of ``sampling.generate`` on the LoRA model with adapter matmuls vs on ``merge_lora`` of
it (the merge's own time reported separately). The issue-16 goals: LoRA optimizer state ≤ 5% of
full, iteration peak memory ≤ 60% of full. Timing figures are only meaningful on a quiet machine.

  python scripts/bench_lora.py                      # the documented configuration (an accelerator)
  python scripts/bench_lora.py --tiny --in-process  # smoke test, seconds on a CPU
  python scripts/bench_lora.py --tiny --layers 1    # --tiny's sizes are defaults: other flags override them
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

from jaxgrpo import models
from jaxgrpo.kernels.config import preset
from jaxgrpo.loop import iteration
from jaxgrpo.models import lora
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout import sampling
from jaxgrpo.step import train

MODES = ("full", "lora", "qlora")
GROUP = 4  # samples per prompt in the benchmark's rollout batch
# --tiny: a 2-layer model and a small batch (a smoke test, seconds on a CPU); other flags override these
TINY = dict(
  vocab=512,
  hidden=64,
  layers=2,
  heads=4,
  kv_heads=2,
  head_dim=16,
  intermediate=128,
  batch=4,
  prompt_len=8,
  completion_len=24,
  rank=4,
  group_size=16,
  steps=3,
  decode_prompts=2,
  decode_samples=2,
  decode_tokens=4,
)


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
  if p.parse_known_args(argv)[0].tiny:  # the tiny sizes as defaults: flags given with --tiny still win
    p.set_defaults(**TINY)
  args = p.parse_args(argv)
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


def make_batch(args, rng) -> train.Batch:
  """A random rollout batch: ``--batch`` rows in groups of 4, full-length prompts and completions
  (the step's worst case), rewards with spread inside every group."""
  b, p, t = args.batch, args.prompt_len, args.completion_len
  return train.Batch(
    prompt_tokens=rng.integers(1, args.vocab, (b, p)).astype(np.int32),
    prompt_mask=np.ones((b, p), bool),
    completions=rng.integers(1, args.vocab, (b, t)).astype(np.int32),
    mask=np.ones((b, t), bool),
    old_logp=np.full((b, t), -np.log(args.vocab), np.float32),
    group_ids=np.repeat(np.arange(-(-b // GROUP)), GROUP)[:b].astype(np.int32),
    rewards=rng.standard_normal(b).astype(np.float32),
  )


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
  """Build, compile and time one mode (``jaxgrpo.step.train``'s step and reference pass); decode
  comparison for the adapter modes."""
  model = build(args, mode)
  counts = lora.count_params(model)
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  optimizer = optax.adamw(1e-5, mu_dtype=jnp.float32)
  trainable = nnx.Param if mode == "full" else nnx.LoRAParam
  graphdef, state, shardings = train.init_train_state(model, optimizer, mesh, trainable=trainable)
  del model  # the state holds the arrays (LoRA: state.frozen is the model's own base weights)
  fast = {"xla_backend_optimization_level": 0} if args.tiny else None  # a smoke test compiles quickly
  tc = train.TrainConfig(group_size=GROUP, chunk_size=256, max_grad_norm=1.0, compiler_options=fast)
  step = train.make_train_step(
    graphdef, optimizer, preset("grpo", beta=0.04), mesh=mesh, shardings=shardings, train_config=tc
  )
  reference = iteration.make_reference(step, state)
  rng = np.random.default_rng(0)
  batch = reference(make_batch(args, rng))
  holder = {"state": state}
  del state

  def one_step():
    holder["state"], metrics = step(holder["state"], reference(batch))
    return metrics["loss"]

  t0 = time.perf_counter()
  jax.block_until_ready(one_step())
  compile_s = time.perf_counter() - t0  # the first call: tracing, compiling and one step
  # the program the calls run (the jit cache's own executable, not a second compile)
  ma = step.lower(holder["state"], batch).compile().memory_analysis()
  footprint = None
  if ma is not None:
    footprint = int(
      ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    )
  ref_copy = 0 if mode != "full" else _bytes(reference.params)  # LoRA: the frozen arrays themselves
  res = dict(
    mode=mode,
    base_params=counts.base,
    adapter_params=counts.adapter,
    param_bytes=counts.base_bytes + counts.adapter_bytes,
    opt_state_bytes=_bytes(holder["state"].opt_state),
    reference_copy_bytes=ref_copy,
    step_footprint_bytes=footprint,
    step_temp_bytes=None if ma is None else int(ma.temp_size_in_bytes),
    first_step_s=compile_s,
  )
  res["step_s"] = _median_time(one_step, args.steps)
  model = iteration.policy_model(graphdef, holder["state"])
  P = args.prompt_len

  prompts = jnp.asarray(rng.integers(1, args.vocab, (args.decode_prompts, P)), jnp.int32)
  pmask = jnp.ones(prompts.shape, bool)
  settings = sampling.SamplingConfig(num_samples=args.decode_samples, max_new_tokens=args.decode_tokens, pad_id=0)
  n_tokens = args.decode_prompts * args.decode_samples * args.decode_tokens

  def decode(m, i=[0]):  # noqa: B006 - a fresh key per call
    i[0] += 1
    return sampling.generate(m, prompts, pmask, settings, key=jax.random.key(i[0]), temperature=1.0).completions

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
    f"{'mode':6} {'params':>12} {'adapters':>10} {'opt state':>12} {'ref copy':>12} {'step footprint':>15} "
    f"{'device peak':>13} "
    f"{'step s':>8} {'decode tok/s':>13} {'merged tok/s':>13}"
  )
  for m, r in results.items():
    merged = r.get("decode_merged_tokens_per_s")
    print(
      f"{m:6} {_fmt(r['param_bytes']):>12} {r['adapter_params']:>10,} {_fmt(r['opt_state_bytes']):>12} "
      f"{_fmt(r['reference_copy_bytes']):>12} {_fmt(r['step_footprint_bytes']):>15} {_fmt(r['device_peak_bytes']):>13} {r['step_s']:>8.3f} "
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
