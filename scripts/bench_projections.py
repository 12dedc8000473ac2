"""Two XLA:CPU layout effects behind `jaxgrpo.models.layers` and `jaxgrpo.models.attention`, each against its baseline in the same run.

1. SwiGLU forward+backward: ``einsum("bsd,df->bsf")`` (the weight gradient contracts two dims,
   b and s, and XLA:CPU materialises a transposed copy of the activation gradient) vs
   ``layers.dense`` (token dims flattened: one 2-D matmul, one contracting dim).
2. One decode step of attention over a KV cache: the earlier [B, T, N, K] cache with a batched
   einsum vs the [B, N, K, T] / [B, N, T, K] cache with the multiply-and-reduce that
   ``attention.Attention`` uses for S·G <= 8 query rows per kv head.

Defaults are the peers workload (64 rows × 160 tokens, D=384, F=1536; decode at 128 rows, 160
cache slots, 8 heads / 4 kv heads, head_dim 32). Medians over ``--repeats`` after one warm-up,
the two variants alternating.

  python scripts/bench_projections.py
  python scripts/bench_projections.py --repeats 3 --rows 8      # quicker
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

from jaxgrpo.models.layers import dense

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402


def swiglu_einsum(x, wg, wu, wd):
  g, u = jnp.einsum("bsd,df->bsf", x, wg), jnp.einsum("bsd,df->bsf", x, wu)
  return jnp.einsum("bsf,fd->bsd", jax.nn.silu(g) * u, wd)


def swiglu_dense(x, wg, wu, wd):
  return dense(jax.nn.silu(dense(x, wg)) * dense(x, wu), wd)


def decode_einsum(q, k_btnk, v_btnk):
  """q [B,1,N,G,K]; cache [B,T,N,K] (the earlier layout): batched dots."""
  s = jnp.einsum("bsngk,btnk->bngst", q, k_btnk, preferred_element_type=jnp.float32)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bngst,btnk->bsngk", p, v_btnk)


def decode_reduce(q, k_bnkt, v_bntk):
  """q [B,1,N,G,K]; keys [B,N,K,T], values [B,N,T,K]: multiply-and-reduce (as attention.Attention)."""
  qt = jnp.transpose(q, (0, 2, 3, 1, 4))  # [B,N,G,S,K]
  s = jnp.sum(qt[..., None] * k_bnkt[:, :, None, None], axis=-2)  # [B,N,G,S,T]
  p = jax.nn.softmax(s, axis=-1)
  out = jnp.sum(p[..., None] * v_bntk[:, :, None, None], axis=-2)  # [B,N,G,S,K]
  return jnp.transpose(out, (0, 3, 1, 2, 4))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", type=int, default=64, help="training rows (SwiGLU)")
  ap.add_argument("--tokens", type=int, default=160)
  ap.add_argument("--hidden", type=int, default=384)
  ap.add_argument("--intermediate", type=int, default=1536)
  ap.add_argument("--decode-rows", type=int, default=128)
  ap.add_argument("--slots", type=int, default=160)
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--kv-heads", type=int, default=4)
  ap.add_argument("--head-dim", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=7)
  args = ap.parse_args(argv)
  ks = jax.random.split(jax.random.key(0), 8)
  d, f = args.hidden, args.intermediate
  x = jax.random.normal(ks[0], (args.rows, args.tokens, d))
  ws = [0.05 * jax.random.normal(k, s) for k, s in zip(ks[1:4], [(d, f), (d, f), (f, d)])]
  grad = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2, 3)))
  mlp_fns = [grad(swiglu_einsum), grad(swiglu_dense)]
  mlp = _bench.medians(_bench.alternating_times([lambda f=f: f(x, *ws) for f in mlp_fns], args.repeats, rotate=False))

  b, t, n, k = args.decode_rows, args.slots, args.kv_heads, args.head_dim
  g = args.heads // n
  q = jax.random.normal(ks[4], (b, 1, n, g, k))
  kc, vc = jax.random.normal(ks[5], (b, t, n, k)), jax.random.normal(ks[6], (b, t, n, k))
  base = jax.jit(decode_einsum)
  new = jax.jit(lambda q, kc, vc: decode_reduce(q, jnp.transpose(kc, (0, 2, 3, 1)), jnp.transpose(vc, (0, 2, 1, 3))))
  # the transposes of `new` are outside the timed program: pass the cache already in its layout
  new_t = jax.jit(decode_reduce)
  kt, vt = jnp.transpose(kc, (0, 2, 3, 1)), jnp.transpose(vc, (0, 2, 1, 3))
  err = float(jnp.max(jnp.abs(base(q, kc, vc) - new(q, kc, vc))))
  t_base = _bench.median_time(lambda: base(q, kc, vc), args.repeats)
  t_new = _bench.median_time(lambda: new_t(q, kt, vt), args.repeats)

  print(f"{_bench.backend_line()}; medians of {args.repeats}")
  print("| | baseline, ms | jaxgrpo, ms | baseline / jaxgrpo |")
  print("|---|---:|---:|---:|")
  print(
    f"| SwiGLU fwd+bwd [{args.rows}×{args.tokens}, {d}→{f}]: einsum vs dense | {1e3 * mlp[0]:.1f} | "
    f"{1e3 * mlp[1]:.1f} | {mlp[0] / mlp[1]:.2f}× |"
  )
  print(
    f"| decode attention, one layer [{b} rows, {t} slots]: [B,T,N,K] einsum vs [B,N,K,T] reduce | "
    f"{1e3 * t_base:.2f} | {1e3 * t_new:.2f} | {t_base / t_new:.2f}× |"
  )
  print(f"(max |difference| of the two decode attentions: {err:.1e})")
  return {"mlp": mlp, "decode": (t_base, t_new), "decode_err": err}


if __name__ == "__main__":
  main()
