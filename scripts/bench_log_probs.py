"""Compiled memory of chunked vs unchunked ``jaxgrpo.models.log_probs`` at a large vocabulary.

Nothing is allocated: parameters and inputs are abstract (``jax.ShapeDtypeStruct``); each variant is
lowered and compiled and ``compiled.memory_analysis()`` is printed, for the forward pass and for the
gradient w.r.t. the parameters (the train-step case), with the ratio unchunked / chunked of the
temporary buffers.

  python scripts/bench_log_probs.py                       # V=151936, D=256, 2 layers, B×T = 8×1024
  python scripts/bench_log_probs.py --dtype bfloat16 --chunk-size 256
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgrpo import models

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402

MIB = 2**20


def _compile(fn, *abstract_args):
  return jax.jit(fn).lower(*abstract_args).compile()


def _describe(label: str, compiled) -> int:
  m = compiled.memory_analysis()
  if m is None:
    print(f"{label:<28} memory_analysis() unavailable on {jax.default_backend()}")
    return 0
  print(
    f"{label:<28} temp {m.temp_size_in_bytes / MIB:10.1f} MiB | args {m.argument_size_in_bytes / MIB:8.1f} MiB"
    f" | out {m.output_size_in_bytes / MIB:8.1f} MiB"
  )
  return m.temp_size_in_bytes


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--vocab", type=int, default=151936)
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--length", type=int, default=1024)
  ap.add_argument("--chunk-size", type=int, default=128)
  ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
  args = ap.parse_args(argv)

  dtype = jnp.dtype(args.dtype)
  cfg = models.Qwen3Config(
    vocab_size=args.vocab,
    hidden_size=args.hidden,
    num_layers=args.layers,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=2 * args.hidden,
    tie_word_embeddings=True,
  )
  abstract = nnx.eval_shape(lambda: models.build_model(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype))
  graphdef, state = nnx.split(abstract)
  tokens = jax.ShapeDtypeStruct((args.batch, args.length), jnp.int32)
  mask = jax.ShapeDtypeStruct((args.batch, args.length), jnp.bool_)
  full = args.batch * args.length * args.vocab * 4
  print(
    f"{_bench.backend_line()}; V={args.vocab} D={args.hidden} L={args.layers} "
    f"B×T={args.batch}×{args.length} dtype={args.dtype}; fp32 [B,T,V] logits = {full / MIB:.1f} MiB"
  )

  results = {}
  for name, chunk in (("unchunked", None), (f"chunked({args.chunk_size})", args.chunk_size)):

    def fwd(st, t, m, chunk=chunk):
      return models.log_probs(nnx.merge(graphdef, st), t, m, chunk_size=chunk)

    def grad(st, t, m, chunk=chunk):
      return jax.grad(lambda s: models.log_probs(nnx.merge(graphdef, s), t, m, chunk_size=chunk).sum())(st)

    results[name, "fwd"] = _describe(f"{name} forward", _compile(fwd, state, tokens, mask))
    results[name, "grad"] = _describe(f"{name} grad", _compile(grad, state, tokens, mask))
  chunked = f"chunked({args.chunk_size})"
  for kind in ("fwd", "grad"):
    if results[chunked, kind]:
      print(f"temp ratio unchunked/chunked ({kind}): {results['unchunked', kind] / results[chunked, kind]:.1f}x")


if __name__ == "__main__":
  main()
