"""Benchmark: direct (notebook-style) calls of the public kernels vs the same call inside ``jax.jit``.

Every public kernel is a thin Python wrapper (argument checks) around a module-level jitted
implementation with its static arguments declared, so after a warm-up call with the same shapes a
direct call should cost about what the call costs inside jit: one dispatch plus the checks
(target: < 5 ms at 16 x 12). Each line prints the medians over ``--repeats`` alternating rounds of
both (``scripts/_bench.py``), and their ratio, measured in the same run.

    python scripts/bench_direct_calls.py                 # 16 trajectories x 12 tokens
    python scripts/bench_direct_calls.py --quick         # a small smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxgrpo as jg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402


def make_batch(batch: int, length: int, group_size: int, seed: int = 0) -> dict:
  """A realistic rollout batch: shared prefixes within groups, ragged lengths, binary rewards."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, 50, size=(batch, length)).astype(np.int32)
  for i in range(batch):
    if i % group_size:
      cut = int(rng.integers(0, length))
      tokens[i, :cut] = tokens[i - 1, :cut]
  mask = np.arange(length)[None, :] < rng.integers(length // 2, length + 1, size=(batch, 1))
  logp = -np.abs(rng.normal(size=(batch, length))).astype(np.float32)
  return dict(
    rewards=jnp.asarray(rng.integers(0, 2, size=batch).astype(np.float32)),
    group_ids=jnp.asarray(np.arange(batch, dtype=np.int32) // group_size),
    num_groups=-(-batch // group_size),
    tokens=jnp.asarray(tokens),
    mask=jnp.asarray(mask),
    logp=jnp.asarray(logp),
    old_logp=jnp.asarray(logp + 0.01),
    ref_logp=jnp.asarray(logp - 0.02),
  )


def calls(d: dict) -> dict:
  """name -> (function of the arrays, the arrays): the same function is called directly and jitted."""
  ng = d["num_groups"]
  adv = jg.group_advantages(d["rewards"], d["group_ids"], ng)
  lp, old, ref, mask = d["logp"], d["old_logp"], d["ref_logp"], d["mask"]
  out = {
    "group_advantages": (lambda r, g: jg.group_advantages(r, g, ng), (d["rewards"], d["group_ids"])),
    "kl_penalty(k3)": (lambda a, b: jg.kl_penalty(a, b, "k3"), (lp, ref)),
    "future_kl(k1)": (lambda a, b, m: jg.future_kl(a, b, m), (old, ref, mask)),
    "frpo_advantages": (lambda a, o, r, m: jg.frpo_advantages(a, o, r, m, beta=0.01), (adv, old, ref, mask)),
    "policy_loss": (
      lambda a, o, x, m: jg.policy_loss(a, o, x, m, jg.GRPOHyper(beta=0.04), kl=jg.kl_penalty(a, ref, mask=m)),
      (lp, old, adv, mask),
    ),
    "policy_loss_terms": (lambda a, o, x, m: jg.policy_loss_terms(a, o, x, m), (lp, old, adv, mask)),
  }
  for name in ("grpo", "lambda_grpo", "frpo"):
    cfg = jg.preset(name)
    out[f"rollout_advantages({name})"] = (
      lambda r, t, m, g, o, rf, cfg=cfg: jg.rollout_advantages(cfg, r, t, m, g, ng, old_logp=o, ref_logp=rf),
      (d["rewards"], d["tokens"], mask, d["group_ids"], old, ref),
    )
  cfg = jg.preset("grpo", beta=0.04)
  out["objective_terms(grpo, beta=0.04)"] = (
    lambda a, o, x, m, rf: jg.objective_terms(cfg, a, o, x, m, ref_logp=rf),
    (lp, old, adv, mask, ref),
  )
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch", type=int, default=16, help="trajectories B")
  ap.add_argument("--length", type=int, default=12, help="completion tokens T")
  ap.add_argument("--group-size", type=int, default=4)
  ap.add_argument("--repeats", type=int, default=50)
  ap.add_argument("--quick", action="store_true", help="a small smoke run (B=4, T=3, 3 repeats)")
  args = ap.parse_args(argv)
  if args.quick:
    args.batch, args.length, args.group_size, args.repeats = 4, 3, 2, 3
  d = make_batch(args.batch, args.length, args.group_size)
  print(f"{_bench.backend_line()}; B={args.batch}, T={args.length}, G={args.group_size}, {args.repeats} rounds")
  print(f"{'kernel':36s} {'direct ms':>10s} {'in jit ms':>10s} {'ratio':>7s}")
  results = {}
  for name, (fn, arrays) in calls(d).items():
    jitted = jax.jit(fn)
    # alternating rounds: machine noise hits both variants alike
    variants = [lambda fn=fn, a=arrays: fn(*a), lambda fn=jitted, a=arrays: fn(*a)]
    times = _bench.alternating_times(variants, args.repeats)
    direct_ms, jit_ms = (1e3 * t for t in _bench.medians(times))
    results[name] = (direct_ms, jit_ms)
    print(f"{name:36s} {direct_ms:10.3f} {jit_ms:10.3f} {direct_ms / jit_ms:7.2f}")
  return results


if __name__ == "__main__":
  main()
