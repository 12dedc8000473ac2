"""The matmul floor at the workload's own shapes: what the model's matmuls cost when each runs alone.

    python scripts/peers/shape_floor.py                    # 20m workload
    python scripts/peers/shape_floor.py --workload 150m
    python scripts/peers/shape_floor.py --json             # one RESULT line

`bench_peers.py` reports every phase against the floor at one rate, the GFLOP/s of a 2048² matmul
(`matmul_probe.py`). The model's own matmuls are smaller: a decode step multiplies R = prompts ×
samples rows (128 for 20m) by D × out weights, and attention is a batch of tiny products. This
times every distinct matmul of one iteration alone — jitted float32 products of the same shapes,
median of ``--repeats`` runs — and sums them with their counts:

- rollout: the shared prefill (prompts × P rows) and, for each of the T − 1 decode steps, the trunk
  weights at R rows and attention of one query over the step's cache; the head for each of the T
  sampled tokens (R rows);
- forward (the reference pass): per micro-batch of m rows and S = P + T positions, the trunk weights
  at m·S rows, causal attention [m, H, S, K] × [m, H, K, S] and back, the head on the T completion
  positions in chunks of ``CHUNK`` positions;
- train step: the forward, plus two matmuls of each forward matmul's size in the backward (dX and
  dW), plus the head recompute.

The result ("own-shape floor") says what a phase costs in matmuls alone at these shapes. It is not a
strict bound: isolated calls pay dispatch and cannot overlap, so a fused program can beat the sum
(run E's jaxgrpo reference pass and train step take 0.83× and 0.93× of it). Compared with the 2048²
floor (``of probe``) it shows how much of a phase's distance from that floor is the shapes
themselves. Everything besides the matmuls (softmax over the vocabulary, norms, sampling, data
movement) comes on top of it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matmul_probe  # noqa: E402

_CACHE: dict[tuple, float] = {}


def _time(spec: tuple, repeats: int) -> float:
  """Median seconds of one jitted float32 product described by ``spec`` (memoised by shape)."""
  if spec in _CACHE:
    return _CACHE[spec]
  kind, *dims = spec
  key = jax.random.key(0)
  if kind == "mm":  # [M, K] @ [K, N]
    m, k, n = dims
    a, b = jax.random.normal(key, (m, k)), jax.random.normal(key, (k, n))
    f = jax.jit(lambda x, y: x @ y)
  else:  # batched [B, M, K] @ [B, K, N]
    bt, m, k, n = dims
    a, b = jax.random.normal(key, (bt, m, k)), jax.random.normal(key, (bt, k, n))
    f = jax.jit(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y))
  _CACHE[spec] = statistics.median(matmul_probe.run_times(f, a, b, repeats=repeats))
  return _CACHE[spec]


def _flops(spec: tuple) -> int:
  kind, *dims = spec
  if kind == "mm":
    m, k, n = dims
    return 2 * m * k * n
  bt, m, k, n = dims
  return 2 * bt * m * k * n


def trunk_weights(shape: common.ModelShape) -> list[tuple[int, int]]:
  """(in, out) of every trunk weight matmul of one layer: q, k, v, o, gate, up, down."""
  d, hk, kvk, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
  return [(d, hk), (d, kvk), (d, kvk), (hk, d), (d, i), (d, i), (i, d)]


def phase_specs(w: common.Workload) -> dict[str, list[tuple[tuple, int]]]:
  """Per phase, the (matmul spec, count) list of one iteration of workload ``w``."""
  m = w.model
  p, t, r, s = w.prompt_len, w.new_tokens, w.rows, w.prompt_len + w.new_tokens
  heads, k = m.heads, m.head_dim
  rollout: list[tuple[tuple, int]] = []
  for din, dout in trunk_weights(m):  # prefill of each prompt once, then T - 1 decode steps
    rollout.append((("mm", w.prompts * p, din, dout), m.layers))
    rollout.append((("mm", r, din, dout), m.layers * (t - 1)))
  rollout.append((("bmm", w.prompts * heads, p, k, p), 2 * m.layers))  # prefill attention (q·kᵀ, p·v)
  mid = p + t // 2  # decode attention: one query over the mean cache length, as q·kᵀ and p·v
  rollout.append((("bmm", r * heads, 1, k, mid), m.layers * (t - 1)))
  rollout.append((("bmm", r * heads, 1, mid, k), m.layers * (t - 1)))
  rollout.append((("mm", r, m.hidden, m.vocab), t))  # the head for each sampled token
  micro_batches = -(-r // w.micro)
  rows = w.micro * s
  forward: list[tuple[tuple, int]] = []
  for din, dout in trunk_weights(m):
    forward.append((("mm", rows, din, dout), m.layers * micro_batches))
  forward.append((("bmm", w.micro * heads, s, k, s), 2 * m.layers * micro_batches))  # causal, full square
  chunks = -(-t // w.chunk)
  forward.append((("mm", w.micro * w.chunk, m.hidden, m.vocab), chunks * micro_batches))
  backward: list[tuple[tuple, int]] = []
  for (kind, *dims), count in forward:
    if kind == "mm":  # dX = dY @ Wᵀ and dW = Xᵀ @ dY
      mm, kk, nn = dims
      backward += [(("mm", mm, nn, kk), count), (("mm", kk, mm, nn), count)]
    else:
      backward.append((("bmm", *dims), 2 * count))
  recompute = [spec for spec in forward if spec[0][0] == "mm" and spec[0][3] == m.vocab]
  return {"rollout": rollout, "reference": forward, "train": forward + backward + recompute}


def measure(w: common.Workload, repeats: int) -> dict:
  """Per phase: model FLOPs of the listed matmuls, their summed time alone, the rate they reach."""
  out = {}
  for phase, specs in phase_specs(w).items():
    secs = sum(_time(spec, repeats) * count for spec, count in specs)
    flops = sum(_flops(spec) * count for spec, count in specs)
    out[phase] = {"flops": flops, "seconds": secs, "gflops": flops / secs / 1e9}
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workload", choices=sorted(common.WORKLOADS), default=common.WORKLOAD.name)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--json", action="store_true", help="print a RESULT JSON line")
  args = ap.parse_args(argv)
  w = common.get_workload(args.workload)
  before, _ = matmul_probe.gflops()
  res = measure(w, args.repeats)
  after, _ = matmul_probe.gflops()
  probe = max(before, after)
  if args.json:
    print("RESULT " + json.dumps({"kind": "shape_floor", "workload": w.name, "probe_gflops": probe, "phases": res}))
    return res
  print(f"workload {w.name}; 2048² probe {probe:.0f} GFLOP/s (before {before:.0f}, after {after:.0f})")
  print(
    f"{'phase':<10} {'matmul GFLOP':>12} {'probe floor s':>14} {'own-shape floor s':>18} {'GFLOP/s':>8} {'of probe':>9}"
  )
  for phase, r in res.items():
    probe_s = r["flops"] / probe / 1e9
    print(
      f"{phase:<10} {r['flops'] / 1e9:>12.1f} {probe_s:>14.2f} {r['seconds']:>18.2f} {r['gflops']:>8.0f}"
      f" {probe_s / r['seconds']:>8.0%}"
    )
  return res


if __name__ == "__main__":
  main()
