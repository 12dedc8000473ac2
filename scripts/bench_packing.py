"""Packed vs bucket-padded forward+backward on a long-tailed rollout, and the remat policies' memory and time.

The workload stands in for the train step (phase 2 of issue 17 points this script at the real step):
the gradient of ``Σ w·log p(completion tokens)`` over a rollout of ``--batch`` sequences, accumulated
over ``--micro-batches`` micro-batches of rows (``lax.scan``), with the LM head in float32 chunks.

- **padded**: rows ``[prompt ‖ completion]`` of ``P + T_bucket`` tokens, ``T_bucket`` the smallest
  power of two holding the longest completion (what ``train.pad_to_bucket`` does); the LM head runs on
  the completion positions only.
- **packed**: ``jaxgrpo.packing.pack`` puts the real tokens of every sequence back to back in rows of
  ``--row-length`` tokens (default: the padded row length), first-fit decreasing; the rows are
  ``segment_ids``/``positions`` inputs to the model; the LM head runs on every position and the
  completion log-probs are gathered back with ``packing.unpack``.

Completion lengths are lognormal (σ = ``--sigma``) with median ``--median`` × ``--max-length``, clipped
to ``[1, max_length]``; the first sequence is set to ``max_length`` (a completion that hit the limit,
so the bucket is the maximum: the case packing is for). Prompt lengths are uniform in
``[prompt/2, prompt]``. Both layouts compute the same loss (printed with its difference).

Reported: real tokens per second (prompt + completion tokens, not padding) of each layout, median of
``--repeats`` alternating timed calls after a warm-up; then, for every remat policy on the packed
workload, the compiled program's temporary memory and peak memory (``memory_analysis()``: the
compiler's buffer assignment, on every backend; the peak is 0 where a backend does not report it)
and the median step time. (The device's ``memory_stats()`` peak is not used: it never resets within
a process, so it could not tell the policies apart.)

  python scripts/bench_packing.py                 # the documented configuration (run on a quiet machine)
  python scripts/bench_packing.py --tiny          # smoke test: a tiny model and rollout
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxgrpo import models, packing


def lognormal_rollout(rng, b, prompt, max_length, median, sigma, vocab):
  """Left-padded prompts ``[b, prompt]`` and right-padded completions ``[b, max_length]`` with masks."""
  plen = rng.integers(max(1, prompt // 2), prompt + 1, b)
  clen = np.exp(rng.normal(np.log(median * max_length), sigma, b))
  clen = np.clip(np.round(clen), 1, max_length).astype(np.int64)
  clen[0] = max_length
  pm = np.arange(prompt)[None] >= prompt - plen[:, None]
  cm = np.arange(max_length)[None] < clen[:, None]
  pt = np.where(pm, rng.integers(1, vocab, (b, prompt)), 0).astype(np.int32)
  ct = np.where(cm, rng.integers(1, vocab, (b, max_length)), 0).astype(np.int32)
  return pt, pm, ct, cm


def bucket(n: int) -> int:
  """The smallest power of two >= n (at least 32), the train step's default buckets."""
  return max(32, 1 << (int(n) - 1).bit_length())


def split_rows(x, k):
  """``[R, ...] -> [k, R/k, ...]`` with row ``i·k + j`` in micro-batch j (the train step's split)."""
  return x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)


def make_grad_fn(graphdef, micro_batches, chunk_size, packed: bool):
  """jit of ``state, inputs -> (loss, grads)``, accumulated over ``micro_batches`` micro-batches."""

  def micro_loss(state, mb):
    model = nnx.merge(graphdef, state)
    if packed:
      tokens, positions, seg, w = mb
      hidden, _ = model(tokens, positions, segment_ids=seg)
      lp = models.token_log_probs(model, hidden[:, :-1], tokens[:, 1:], chunk_size=chunk_size)
      return jnp.sum(jnp.where(w[:, 1:] != 0, lp * w[:, 1:], 0.0))
    tokens, mask, w = mb  # w: [rows, T] over the completion positions
    hidden, _ = model(tokens, models.positions_from_mask(mask), attention_mask=mask)
    t = w.shape[1]
    lp = models.token_log_probs(model, hidden[:, -t - 1 : -1], tokens[:, -t:], chunk_size=chunk_size)
    return jnp.sum(jnp.where(w != 0, lp * w, 0.0))

  def fn(state, inputs):
    mbs = jax.tree.map(lambda x: split_rows(x, micro_batches), inputs)

    def body(carry, mb):
      loss, grads = carry
      l, g = jax.value_and_grad(micro_loss)(state, mb)
      return (loss + l, jax.tree.map(jnp.add, grads, g)), None

    zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state))
    (loss, grads), _ = jax.lax.scan(body, zero, mbs)
    return loss, grads

  return jax.jit(fn)


def timed(fn, *args, repeats):
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return times


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--hidden", type=int, default=384)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--batch", type=int, default=64, help="sequences in the rollout")
  ap.add_argument("--prompt", type=int, default=64, help="prompt slots P (lengths uniform in [P/2, P])")
  ap.add_argument("--max-length", type=int, default=2048, help="completion slots T (the generation limit)")
  ap.add_argument("--median", type=float, default=0.1, help="median completion length / max-length")
  ap.add_argument("--sigma", type=float, default=1.0, help="lognormal σ of the completion lengths")
  ap.add_argument("--row-length", type=int, default=None, help="packed row length L (default P + T_bucket)")
  ap.add_argument("--micro-batches", type=int, default=4)
  ap.add_argument("--chunk-size", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--policies", default="none,full,dots,dots_no_batch", help="remat policies to measure")
  ap.add_argument("--tiny", action="store_true", help="a tiny model and rollout (smoke test)")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  if args.tiny:
    args.vocab, args.hidden, args.layers, args.batch = 256, 32, 2, 8
    args.prompt, args.max_length, args.micro_batches, args.chunk_size, args.repeats = 8, 64, 2, 16, 1

  cfg = models.Qwen3Config(
    vocab_size=args.vocab,
    hidden_size=args.hidden,
    num_layers=args.layers,
    num_heads=8 if args.hidden >= 256 else 4,
    num_kv_heads=4 if args.hidden >= 256 else 2,
    head_dim=32 if args.hidden >= 256 else 8,
    intermediate_size=4 * args.hidden,
    tie_word_embeddings=True,
  )
  rng = np.random.default_rng(args.seed)
  pt, pm, ct, cm = lognormal_rollout(rng, args.batch, args.prompt, args.max_length, args.median, args.sigma, args.vocab)
  weights = np.where(cm, rng.standard_normal(cm.shape), 0).astype(np.float32) / cm.sum()
  k = args.micro_batches
  t_bucket = bucket(cm.sum(1).max())
  row_length = args.row_length or args.prompt + t_bucket
  pk = packing.pack(pt, pm, ct, cm, row_length=row_length, row_multiple=k)
  real = int(pm.sum() + cm.sum())
  padded_tokens = args.batch * (args.prompt + t_bucket)
  packed_tokens = pk.tokens.size
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind})")
  print(
    f"rollout: {args.batch} sequences, completion lengths lognormal median {args.median:g}×{args.max_length}, "
    f"σ={args.sigma:g}: mean {cm.sum(1).mean():.0f}, max {cm.sum(1).max()}; {real} real tokens"
  )
  print(
    f"padded: {args.batch}×{args.prompt + t_bucket} = {padded_tokens} slots ({real / padded_tokens:.0%} real); "
    f"packed: {pk.tokens.shape[0]}×{row_length} = {packed_tokens} slots ({real / packed_tokens:.0%} real)"
  )

  model = models.build_model(cfg, rngs=nnx.Rngs(args.seed))
  graphdef, state = nnx.split(model)
  n_params = sum(x.size for x in jax.tree.leaves(state))
  print(f"model: {n_params / 1e6:.2f}M params, {args.layers} layers; K={k} micro-batches, chunk {args.chunk_size}")

  tokens = np.concatenate([pt, ct[:, :t_bucket]], 1)
  mask = np.concatenate([pm, cm[:, :t_bucket]], 1)
  padded_in = (jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(weights[:, :t_bucket]))
  packed_w = packing.pack_values(weights, pk.pack_index)
  packed_in = tuple(jnp.asarray(x) for x in (pk.tokens, pk.positions, pk.segment_ids)) + (packed_w,)
  runs = {
    "padded": (make_grad_fn(graphdef, k, args.chunk_size, packed=False), padded_in),
    "packed": (make_grad_fn(graphdef, k, args.chunk_size, packed=True), packed_in),
  }
  losses, grads, times = {}, {}, {name: [] for name in runs}
  for name, (fn, inputs) in runs.items():
    t0 = time.perf_counter()
    loss, grads[name] = jax.block_until_ready(fn(state, inputs))
    losses[name] = float(loss)
    print(f"{name:<7} compile + first call {time.perf_counter() - t0:7.2f} s   loss {losses[name]:+.6f}")
  grad_diff = max(
    float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(grads["packed"]), jax.tree.leaves(grads["padded"]))
  )
  grad_scale = max(float(jnp.abs(a).max()) for a in jax.tree.leaves(grads["padded"]))
  for _ in range(args.repeats):  # alternate, so that machine noise hits both alike
    for name, (fn, inputs) in runs.items():
      times[name] += timed(fn, state, inputs, repeats=1)
  med = {name: statistics.median(ts) for name, ts in times.items()}
  print(
    f"|loss packed - loss padded| = {abs(losses['packed'] - losses['padded']):.2e}, "
    f"max |Δgrad| = {grad_diff:.2e} (max |grad| {grad_scale:.2e})"
  )
  for name in runs:
    print(f"{name:<7} {1e3 * med[name]:9.1f} ms   {real / med[name]:12.0f} real tokens/s")
  speedup = med["padded"] / med["packed"]
  print(f"packed / padded throughput: {speedup:.2f}×")

  policies = {}
  print("remat policies (packed workload): compiled temp and peak memory, median time")
  for name in args.policies.split(","):
    policy = models.RematPolicy.parse(name)
    gd, st = nnx.split(models.build_model(cfg, rngs=nnx.Rngs(args.seed), remat=policy))
    fn = make_grad_fn(gd, k, args.chunk_size, packed=True)
    analysis = fn.lower(st, packed_in).compile().memory_analysis()
    temp = None if analysis is None else analysis.temp_size_in_bytes
    peak = None if analysis is None else analysis.peak_memory_in_bytes
    jax.block_until_ready(fn(st, packed_in))
    sec = statistics.median(timed(fn, st, packed_in, repeats=args.repeats))
    policies[policy.value] = {"temp_bytes": temp, "peak_bytes": peak, "seconds": sec}
    mib = lambda x: "n/a" if x is None else f"{x / 2**20:.1f} MiB"
    print(f"  {policy.value:<14} temp {mib(temp):>12}   peak {mib(peak):>12}   {1e3 * sec:9.1f} ms")
  return {
    "losses": losses,
    "grad_diff": grad_diff,
    "grad_scale": grad_scale,
    "seconds": med,
    "speedup": speedup,
    "policies": policies,
    "real_tokens": real,
  }


if __name__ == "__main__":
  main()
