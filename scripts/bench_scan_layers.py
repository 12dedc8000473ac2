"""Compile time and run time of the layer stack as a Python loop vs one ``jax.lax.scan`` (``scan_layers``).

A narrow 28-layer Qwen3 (Qwen3-0.6B's depth; width 64, so compute is negligible and what is measured
is compilation) is built twice from the same seed: ``scan_layers=False`` (the loop: every layer
traced and compiled on its own) and ``scan_layers=True`` (one scanned layer). For each completion
bucket (``--buckets``, by default the part of ``jaxgrpo.step.train.DEFAULT_BUCKETS`` this machine runs;
``--buckets all`` for every one) it compiles the four programs a run compiles per bucket:

- ``sample``: ``sampling.generate`` (prefill of the prompts, then the decode loop; one program),
  ``max_new_tokens`` = the bucket: ``jit.lower().compile()``, nothing run;
- ``step``: the GRPO train step (``TrainStep.lower(state, batch).compile()``), completions of the bucket;
- ``reference``: ``train.make_reference_fn``'s log-prob pass on the same batch: first call after
  ``jax.clear_caches()`` minus the median of the following calls (trace + compile);

every compile after ``jax.clear_caches()`` (no in-memory cache; the persistent cache is off), after
one untimed warm-up compile of each. Rounds
alternate the order loop/scan (``_bench.alternating_times``-style), and each program's line prints
the medians over the rounds of the seconds summed over the buckets, and the ratio scan/loop, both
measured in this run. Then the steady state: the train step, the reference pass and ``generate``
(64 new tokens) at the first bucket, timed in alternation after a warm-up (medians, ratio scan/loop).
The load average is printed before and after.

    python scripts/bench_scan_layers.py                       # the BENCHMARKS.md run
    python scripts/bench_scan_layers.py --rounds 1 --buckets 32,64 --layers 8   # a quick look
    python scripts/bench_scan_layers.py --rounds 0 --hidden 512 --buckets 32    # run time at a wider D
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
from jaxgrpo.models import Qwen3Config, build_model
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout import sampling
from jaxgrpo.step import train

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402

VARIANTS = ("loop", "scan")
PROGRAMS = ("sample", "step", "reference")


def load() -> str:
  return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Variant:
  """One model (loop or scan) with its train step, reference pass and sampler arguments."""

  def __init__(self, cfg, *, scan: bool, args, mesh):
    model = build_model(cfg, rngs=nnx.Rngs(0), scan_layers=scan, remat=args.remat)
    opt = optax.sgd(1e-3)
    self.graphdef, self.state, shardings = train.init_train_state(model, opt, mesh)
    tc = train.TrainConfig(micro_batches=1, group_size=args.group)
    self.step = train.make_train_step(
      self.graphdef, opt, preset("grpo"), mesh=mesh, shardings=shardings, train_config=tc
    )
    self.ref_params = jax.tree.map(jnp.copy, self.state.params)  # the step donates its own
    self.reference = train.make_reference_fn(
      self.graphdef, mesh=mesh, param_shardings=shardings.params, train_config=tc
    )
    self.sample_model = nnx.merge(self.graphdef, self.ref_params)
    self.args = args

  def sample_args(self, new_tokens: int):
    a = self.args
    rng = np.random.default_rng(1)
    prompts = jnp.asarray(rng.integers(1, a.vocab, (a.batch // a.group, a.prompt)), jnp.int32)
    config = sampling.SamplingConfig(num_samples=a.group, max_new_tokens=new_tokens, pad_id=0, suppress_ids=())
    return (self.sample_model, prompts, jnp.ones(prompts.shape, bool), config), dict(key=jax.random.key(0))

  def compile_seconds(self, program: str, batch: train.Batch, bucket: int) -> float:
    jax.clear_caches()
    if program == "sample":
      (model, prompts, mask, config), kw = self.sample_args(bucket)
      policy = sampling.SamplingPolicy.from_config(config, temperature=1.0, vocab_size=model.config.vocab_size)
      return _bench.timed(lambda: sampling.lower_generate(model, prompts, mask, policy, **kw).compile() and 0)
    if program == "step":
      return _bench.timed(lambda: self.step.lower(self.state, batch).compile() and 0)
    first = _bench.timed(lambda: self.reference(self.ref_params, batch))
    run = statistics.median(_bench.timed(lambda: self.reference(self.ref_params, batch)) for _ in range(3))
    return first - run


def print_compile_summary(totals) -> None:
  print("compile time, summed over the buckets (median over rounds):")
  all_loop = all_scan = 0.0
  for program in PROGRAMS:
    lo, sc = (statistics.median(totals[v, program]) for v in VARIANTS)
    all_loop, all_scan = all_loop + lo, all_scan + sc
    print(f"  {program:9s}  loop {lo:7.2f} s   scan {sc:7.2f} s   scan/loop {sc / lo:.3f}")
  print(f"  {'all':9s}  loop {all_loop:7.2f} s   scan {all_scan:7.2f} s   scan/loop {all_scan / all_loop:.3f}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--layers", type=int, default=28)
  ap.add_argument("--hidden", type=int, default=64)
  ap.add_argument("--vocab", type=int, default=512)
  ap.add_argument("--batch", type=int, default=4, help="rows of the train batch (prompts x group)")
  ap.add_argument("--group", type=int, default=2)
  ap.add_argument("--prompt", type=int, default=16)
  ap.add_argument("--buckets", default="32,64,128,256,512,1024", help="completion buckets, or 'all' (DEFAULT_BUCKETS)")
  ap.add_argument("--rounds", type=int, default=3, help="compile-time rounds (0: steady state only)")
  ap.add_argument("--run-repeats", type=int, default=15, help="timed calls per variant in the steady state")
  ap.add_argument("--remat", default="none")
  args = ap.parse_args(argv)
  jax.config.update("jax_enable_compilation_cache", False)
  buckets = train.DEFAULT_BUCKETS if args.buckets == "all" else tuple(int(b) for b in args.buckets.split(","))
  cfg = Qwen3Config(
    vocab_size=args.vocab,
    hidden_size=args.hidden,
    intermediate_size=2 * args.hidden,
    num_layers=args.layers,
    num_heads=4,
    num_kv_heads=2,
    head_dim=args.hidden // 4,
    max_position_embeddings=args.prompt + max(*buckets, 64) + 1,  # 64: the steady-state sample
    tie_word_embeddings=True,
  )
  print(_bench.backend_line())
  print(
    f"Qwen3 L={args.layers} D={args.hidden} V={args.vocab}; batch {args.batch} rows (groups of {args.group}), "
    f"prompt {args.prompt}; buckets {list(buckets)}; remat {args.remat}; {args.rounds} rounds"
  )
  print(f"load average at start: {load()}")
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  variants = {name: Variant(cfg, scan=name == "scan", args=args, mesh=mesh) for name in VARIANTS}
  rng = np.random.default_rng(0)
  batches = {t: _bench.grpo_batch(rng, args.batch, args.group, args.prompt, t, args.vocab) for t in buckets}
  # compile time: per round, every program over every bucket, loop and scan in alternating order
  totals = {(v, p): [] for v in VARIANTS for p in PROGRAMS}
  for program in PROGRAMS if args.rounds else ():  # warm-up (untimed): the first compiles pay one-off costs
    for v in VARIANTS:
      variants[v].compile_seconds(program, batches[buckets[0]], buckets[0])
  for r in range(args.rounds):
    order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
    for program in PROGRAMS:
      for v in order:
        secs = [variants[v].compile_seconds(program, batches[t], t) for t in buckets]
        totals[v, program].append(sum(secs))
        print(f"  round {r} {program:9s} {v}: {sum(secs):7.2f} s  (per bucket {[round(s, 2) for s in secs]})")
    print(f"  load average after round {r}: {load()}")
  if not args.rounds:
    print("compile time: not measured (--rounds 0)")
  else:
    print_compile_summary(totals)

  # steady state at the first bucket
  t0 = buckets[0]
  batch = batches[t0]
  fns = {}
  for v in VARIANTS:
    var = variants[v]
    holder = {"state": var.state}

    def step(var=var, holder=holder):
      holder["state"], m = var.step(holder["state"], batch)
      return m["loss"]

    pos, kw = var.sample_args(64)
    fns[v, "step"] = step
    fns[v, "reference"] = lambda var=var: var.reference(var.ref_params, batch)
    fns[v, "sample"] = lambda pos=pos, kw=kw: sampling.generate(*pos, **kw).completions
  print(f"steady state (bucket {t0}; sample: 64 new tokens), median of {args.run_repeats} alternating calls:")
  for program in ("step", "reference", "sample"):
    times = _bench.alternating_times([fns[v, program] for v in VARIANTS], args.run_repeats, warmup=2)
    lo, sc = _bench.medians(times)
    print(f"  {program:9s}  loop {lo * 1e3:8.2f} ms   scan {sc * 1e3:8.2f} ms   scan/loop {sc / lo:.3f}")
  print(f"load average at end: {load()}")
  return totals


if __name__ == "__main__":
  t = time.perf_counter()
  main()
  print(f"total {time.perf_counter() - t:.0f} s")
