"""Matmul throughput right now (jitted float32 2048² @ 2048², median of 5): how much of the CPU a run gets.

    python scripts/peers/matmul_probe.py          # the project's idle 2-core machine: ≈167 GFLOP/s
    python scripts/peers/matmul_probe.py --json   # one RESULT line (bench_peers.py runs it around every round)

`bench_peers.py` divides each iteration's model FLOPs (`common.model_flops`) by this number,
measured in the same run, to get the iteration's matmul floor.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

N = 2048


def run_times(f, *args, repeats: int = 5) -> list[float]:
  """Seconds of ``repeats`` calls of the jitted ``f(*args)``, after one warm-up (compile) call."""
  f(*args).block_until_ready()
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(*args).block_until_ready()
    ts.append(time.perf_counter() - t0)
  return ts


def gflops(repeats: int = 5) -> tuple[float, list[float]]:
  """(GFLOP/s of the median run, the run times in s) of a jitted f32 [N, N] @ [N, N] product."""
  a = jax.random.normal(jax.random.key(0), (N, N), jnp.float32)
  ts = run_times(jax.jit(lambda x: x @ x), a, repeats=repeats)
  return 2 * N**3 / statistics.median(ts) / 1e9, ts


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--json", action="store_true", help="print a RESULT JSON line")
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args(argv)
  g, ts = gflops(args.repeats)
  if args.json:
    print("RESULT " + json.dumps({"kind": "matmul_probe", "gflops": g, "times": ts, "n": N}), flush=True)
  else:
    print(f"matmul {g:.1f} GFLOP/s")


if __name__ == "__main__":
  main()
