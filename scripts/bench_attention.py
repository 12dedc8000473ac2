"""Peak memory and time of the gradient of one attention layer: today's dense ``attention.Attention`` vs blockwise.

Each (implementation, length) runs in a fresh child process (``--child``) on one row of ``L`` tokens: the
layer's projections (D = 64, 4 heads of 16, no RoPE), attention, the output projection, and the gradient of a
linear read-out ``⟨y, w⟩`` with respect to the input and the four weights. ``dense`` calls
``jaxgrpo.models.attention.Attention`` as the model does today (scores ``[B, N, G, L, L]`` in float32); ``blockwise``
applies the same weights around ``jaxgrpo.parallel.attention.attention(implementation="blockwise")`` (the CPU's
default blocks). The child compiles the gradient, resets its peak RSS (``/proc/self/clear_refs``), runs it once and
``--repeats`` times more, and reports the peak RSS (``VmHWM``) over the RSS before the first run (the program's
temporaries and outputs, not the compiler's) and the median time of the repeats. The parent watches each child's RSS and stops one that passes ``--cap-gib``
(the machine is shared: a dense row at 16k tokens would take ~10 GiB); such a row reads "over the cap"; one that XLA
refuses to allocate (RESOURCE_EXHAUSTED) reads "out of memory" with XLA's line.
Ends with the memory slope: the ratio of the peak over the baseline from each length to the next (linear: 2×
per doubling, quadratic: 4×).

    python scripts/bench_attention.py                       # 2k, 4k, 8k, 16k tokens, cap 8 GiB
    python scripts/bench_attention.py --lengths 4096 8192 16384 32768 --impls blockwise
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo.models.attention import Attention
from jaxgrpo.parallel.attention import attention

GIB = 2**30
D, H, N, K = 64, 4, 4, 16


def _rss(pid: int | str = "self", field: str = "VmRSS") -> int:
  """Resident bytes of a process (Linux ``/proc/PID/status``: ``VmRSS`` now, ``VmHWM`` its peak); 0 once it is
  gone."""
  try:
    with open(f"/proc/{pid}/status") as f:
      return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))
  except (OSError, StopIteration):
    return 0


def _reset_peak() -> None:
  """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux: ``5`` into ``/proc/self/clear_refs``)."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def _child(impl: str, length: int, repeats: int) -> dict:
  layer = Attention(
    hidden_size=D, num_heads=H, num_kv_heads=N, head_dim=K, qkv_bias=False, o_bias=False, qk_norm_eps=None,
    inv_freq=None, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0),
  )  # fmt: skip
  graphdef, weights = nnx.split(layer)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(1, length, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(1, length, D)), jnp.float32)
  seg = jnp.ones((1, length), jnp.int32)
  positions = jnp.zeros((1, length), jnp.int32)

  def dense(p, x):
    return nnx.merge(graphdef, p)(x, positions, seg, None, None, None)[0]

  def blockwise(p, x):
    m = nnx.merge(graphdef, p)
    q, k, v = (jnp.einsum("bsd,dhk->bshk", x, w[...]) for w in (m.q, m.k, m.v))
    o = attention(q, k, v, seg, implementation="blockwise")
    return jnp.einsum("bshk,hkd->bsd", o, m.o[...])

  fn = {"dense": dense, "blockwise": blockwise}[impl]
  grad = jax.jit(jax.grad(lambda p, x: jnp.vdot(fn(p, x), w), argnums=(0, 1)))
  compiled = grad.lower(weights, x).compile()
  _reset_peak()  # the compiler's own peak is not the program's
  base = _rss()
  jax.block_until_ready(compiled(weights, x))  # the first run: fresh pages for every buffer
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(compiled(weights, x))
    times.append(time.perf_counter() - t)
  peak = _rss(field="VmHWM")
  return {"impl": impl, "length": length, "peak_over_base": peak - base, "seconds": sorted(times)[len(times) // 2]}


def _run(impl: str, length: int, repeats: int, cap: float) -> dict:
  """One child; stopped (and reported over the cap) when its RSS passes ``cap`` bytes."""
  cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, str(length), "--repeats", str(repeats)]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  top = 0
  while proc.poll() is None:
    top = max(top, _rss(proc.pid))
    if top > cap:
      proc.kill()
      proc.wait()
      return {"impl": impl, "length": length, "over_cap": top}
    time.sleep(0.05)
  out, err = proc.communicate()
  if proc.returncode and "RESOURCE_EXHAUSTED" in err:  # XLA refused the program's buffers before RSS grew
    return {"impl": impl, "length": length, "out_of_memory": err.strip().splitlines()[-1][:160]}
  if proc.returncode:
    raise SystemExit(f"bench_attention: the {impl} child at {length} tokens exited {proc.returncode}:\n{err[-3000:]}")
  return json.loads(out.strip().splitlines()[-1])


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or "unknown CPU"


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
  p.add_argument("--impls", nargs="+", choices=["dense", "blockwise"], default=["dense", "blockwise"])
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--cap-gib", type=float, default=8.0, help="stop a child whose RSS passes this (GiB)")
  p.add_argument("--child", nargs=2, metavar=("IMPL", "LENGTH"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    print(json.dumps(_child(args.child[0], int(args.child[1]), args.repeats)))
    return []
  if args.repeats < 1 or args.cap_gib <= 0 or min(args.lengths) < 1:
    raise SystemExit(f"bench_attention: --repeats, --cap-gib and --lengths must be positive; got {vars(args)}")
  print(f"# {_cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; D={D}, {H} heads of {K}")
  print("| tokens | implementation | peak RSS over baseline | time of one gradient |")
  print("| ---: | --- | ---: | ---: |")
  rows = []
  for impl in args.impls:
    for length in sorted(args.lengths):
      r = _run(impl, length, args.repeats, args.cap_gib * GIB)
      rows.append(r)
      if "out_of_memory" in r:
        print(f"| {length:,} | {impl} | out of memory: {r['out_of_memory']} | — |")
      elif "over_cap" in r:
        print(f"| {length:,} | {impl} | over the {args.cap_gib:g} GiB cap (stopped at {r['over_cap'] / GIB:.2f}) | — |")
      else:
        print(f"| {length:,} | {impl} | {r['peak_over_base'] / 2**20:,.1f} MiB | {r['seconds']:.3f} s |", flush=True)
  for impl in args.impls:  # lengths whose peak is under 1 MiB (allocator noise) give no ratio
    done = [r for r in rows if r["impl"] == impl and r.get("peak_over_base", 0) >= 2**20]
    slopes = [f"{b['length']}/{a['length']} ×{b['peak_over_base'] / a['peak_over_base']:.2f}"
              for a, b in zip(done, done[1:])]  # fmt: skip
    print(f"# memory slope, {impl}: {', '.join(slopes) or '—'}")
  return rows


if __name__ == "__main__":
  main()
