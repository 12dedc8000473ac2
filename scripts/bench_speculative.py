"""Plain vs speculative (prompt-lookup) decoding in the built-in sampler: tokens/s, acceptance, and what ``auto``
chooses, on a workload where drafting helps and one where it does not.

    python scripts/bench_speculative.py                       # defaults below; --rounds 3
    python scripts/bench_speculative.py --prompts 8 --new-tokens 64 --rounds 1   # a quick look
    python scripts/bench_speculative.py --pool --rounds 2     # the partial-rollout row pool, plain vs verify steps

Model: the random Qwen3 architecture of scripts/bench_sampler.py (vocab 32000, hidden 384, 4 layers, 8 / 4 heads,
head_dim 32, intermediate 1536, tied, fp32). Workloads (B prompts × G samples, P-token random prompts, T new tokens,
no EOS id: every row has T tokens):

- ``repetitive``: greedy decoding (temperature 0). A random model's greedy continuation falls into short loops, text
  the prompt lookup drafts well (the regime of copy tasks and of the arithmetic task's repeated digits).
- ``random``: temperature 1 over the near-uniform 32000-way distribution: drafts are almost never accepted.

Per workload: plain ``generate`` and ``generate_speculative`` timed in alternating rounds after one warm-up each
(compilation excluded), tokens/s = real completion tokens / median seconds; the acceptance is accepted / drafted
tokens. ``auto``: a fresh ``SpeculativeSwitch`` run for 5 calls (1 untimed + 1 timed of each kind, then its choice).
``--pool``: the same workloads through the partial-rollout row pool (``jaxgrpo.loop.partial.pool.RowPool``: B·G
slots, ``--refill-every`` steps per boundary, one version, every group to completion) without and with prompt-lookup
verify steps (``speculative=``), timed in alternating rounds the same way; with ``--draft-model`` also with the
draft model's verify steps (its per-slot cache beside the target's).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxgrpo.loop.partial.pool import RowPool  # noqa: E402
from jaxgrpo.models import Qwen3Config, build_model  # noqa: E402
from jaxgrpo.rollout.sampling import SamplingConfig, generate  # noqa: E402
from jaxgrpo.rollout.speculative import SpeculativeConfig, SpeculativeSwitch, generate_speculative  # noqa: E402

WORKLOADS = {"repetitive": 0.0, "random": 1.0}  # name -> temperature


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--samples", type=int, default=4)
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--draft", type=int, default=4, help="k, tokens drafted per verify step")
  ap.add_argument("--ngram", type=int, default=2)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument(
    "--draft-model", action="store_true",
    help="also time a draft model (random, same vocabulary: hidden 128, 1 layer, 4 / 2 heads, intermediate 512)",
  )  # fmt: skip
  ap.add_argument("--pool", action="store_true", help="time the partial-rollout row pool instead of generate")
  ap.add_argument("--refill-every", type=int, default=8, help="--pool: steps per boundary")
  args = ap.parse_args(argv)
  print(_bench.backend_line())
  cfg = Qwen3Config(
    vocab_size=32000, hidden_size=384, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
    intermediate_size=1536, tie_word_embeddings=True, max_position_embeddings=4096,
  )  # fmt: skip
  model = build_model(cfg, rngs=nnx.Rngs(0))
  draft = None
  if args.draft_model:
    small = dataclasses.replace(cfg, hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=512)
    draft = build_model(small, rngs=nnx.Rngs(1))
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(1, cfg.vocab_size, (args.prompts, args.prompt_len)), jnp.int32)
  mask = jnp.ones(prompts.shape, bool)
  sampling = SamplingConfig(num_samples=args.samples, max_new_tokens=args.new_tokens, pad_id=0)
  spec = SpeculativeConfig(mode="ngram", num_draft=args.draft, ngram=args.ngram)
  print(f"B={args.prompts} G={args.samples} P={args.prompt_len} T={args.new_tokens} k={args.draft} n={args.ngram}")
  for name, temperature in WORKLOADS.items():
    if args.pool:
      _pool_workload(name, temperature, model, np.asarray(prompts), sampling, spec, args, draft)
    else:
      _workload(name, temperature, model, prompts, mask, sampling, spec, args, draft)


def _pool_workload(name, temperature, model, prompts, sampling, spec, args, draft=None) -> None:
  """Times the row pool without and with verify steps (prompt lookup; and the draft model's, when ``draft``) on
  one workload; prints a line."""
  tokens, stats = [p.tolist() for p in prompts], {}

  def run(switch):
    pool = RowPool(
      sampling=sampling, temperature=temperature, prompt_len=prompts.shape[1], num_slots=len(tokens) * sampling.num_samples,
      refill_every=args.refill_every, speculative=switch,
    )  # fmt: skip
    drawn = iter([list(range(len(tokens)))])
    pool.run(model, 0, jax.random.key(1), need=len(tokens), draw=lambda: next(drawn, []), prompt_tokens=tokens)
    stats["pool"] = pool
    return jnp.asarray(0)

  plain = lambda: run(None)

  def ngram():
    out = run(SpeculativeSwitch(config=spec))
    stats["s"] = stats["pool"].sample_metrics
    return out

  def with_draft():
    out = run(SpeculativeSwitch(config=dataclasses.replace(spec, mode="draft", draft="in memory"), draft_model=draft))
    stats["d"] = stats["pool"].sample_metrics
    return out

  times = _bench.alternating_times([plain, ngram] + ([with_draft] if draft is not None else []), args.rounds)
  med = dict(zip(("plain", "ngram", "draft"), _bench.medians(times)))
  n = len(tokens) * sampling.num_samples * args.new_tokens
  line = (
    f"pool {name} (temperature {temperature}): plain {med['plain']:.2f} s {n / med['plain']:.0f} tok/s | ngram "
    f"{med['ngram']:.2f} s {n / med['ngram']:.0f} tok/s, acceptance {stats['s']['rollout/spec_acceptance']:.3f} | "
    f"speed-up {med['plain'] / med['ngram']:.2f}x"
  )
  if draft is not None:
    line += (
      f" | draft model {med['draft']:.2f} s {n / med['draft']:.0f} tok/s, acceptance "
      f"{stats['d']['rollout/spec_acceptance']:.3f}, speed-up {med['plain'] / med['draft']:.2f}x"
    )
  print(line + f" | rounds {[[round(t, 2) for t in ts] for ts in times]}")


def _workload(name, temperature, model, prompts, mask, sampling, spec, args, draft) -> None:
  """Times plain vs ngram (and draft-model) decoding on one workload, then runs ``auto`` on it; prints a line each."""
  key = jax.random.key(1)
  stats = {}

  def with_draft():
    rollout, stats["d"] = generate_speculative(
      model, prompts, mask, sampling, key=key, temperature=temperature, speculative=spec, draft_model=draft
    )
    return rollout.completions

  def plain():
    return generate(model, prompts, mask, sampling, key=key, temperature=temperature).completions

  def ngram():
    rollout, stats["s"] = generate_speculative(
      model, prompts, mask, sampling, key=key, temperature=temperature, speculative=spec
    )
    return rollout.completions

  fns = [plain, ngram] + ([with_draft] if draft is not None else [])
  times = _bench.alternating_times(fns, args.rounds)
  t_plain, t_ngram = times[:2]
  med = dict(zip(("plain", "ngram", "draft"), _bench.medians(times)))
  tokens = args.prompts * args.samples * args.new_tokens
  s = stats["s"]
  print(
    f"{name} (temperature {temperature}): plain {med['plain']:.2f} s {tokens / med['plain']:.0f} tok/s | ngram "
    f"{med['ngram']:.2f} s {tokens / med['ngram']:.0f} tok/s, acceptance {s.acceptance:.3f}, "
    f"{int(s.verify_steps)} verify steps for {args.new_tokens} tokens | speed-up {med['plain'] / med['ngram']:.2f}x"
    f" | rounds plain {[round(t, 2) for t in t_plain]} ngram {[round(t, 2) for t in t_ngram]}"
  )
  if draft is not None:
    d = stats["d"]
    print(
      f"  draft model: {med['draft']:.2f} s {tokens / med['draft']:.0f} tok/s, acceptance {d.acceptance:.3f}, "
      f"{int(d.verify_steps)} verify steps | speed-up {med['plain'] / med['draft']:.2f}x | rounds "
      f"{[round(t, 2) for t in times[2]]}"
    )
  switch = SpeculativeSwitch(config=SpeculativeConfig(mode="auto", num_draft=args.draft, ngram=args.ngram))
  for i in range(5):
    jax.block_until_ready(switch.sample(model, prompts, mask, sampling, key=jax.random.key(i), temperature=temperature))
  print(f"  auto: {switch.measured} -> {switch.mode_now()}")


if __name__ == "__main__":
  logging.basicConfig(level=logging.WARNING)
  main()
