"""Matmul throughput right now (jitted float32 2048² @ 2048², median of 5): how much of the CPU a run gets.

python scripts/peers/matmul_probe.py       # the project's idle 2-core machine: ≈167 GFLOP/s
"""

import statistics
import time

import jax
import jax.numpy as jnp

a = jax.random.normal(jax.random.key(0), (2048, 2048), jnp.float32)
f = jax.jit(lambda x: x @ x)
f(a).block_until_ready()
ts = []
for _ in range(5):
  t0 = time.perf_counter()
  f(a).block_until_ready()
  ts.append(time.perf_counter() - t0)
print(f"matmul {2 * 2048**3 / statistics.median(ts) / 1e9:.1f} GFLOP/s")
