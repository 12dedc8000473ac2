"""The train step on a long-tailed rollout: packed vs bucket-padded tokens/s, and the remat policies'
memory and time — all measured in one run.

The workload is the real step (``jaxgrpo.step.train.make_train_step``: advantages, the clipped objective,
micro-batch accumulation, clipping and the optimizer update) on a rollout of ``--batch`` sequences in
groups of ``--group``:

- **padded**: ``train.pad_to_bucket`` (the completion axis at the power-of-two bucket of the longest
  completion), one ``[prompt ‖ completion]`` row per sequence;
- **packed**: ``TrainConfig(packing=L)`` with L = P + the same bucket (``--row-length``): the step's
  slots (device shard × mini-batch × micro-batch) each packed by first-fit decreasing into rows of L
  tokens, the LM head run on the completion tokens only (``train.pack_batch``, done once on the host
  before the timed calls; its time is printed separately).

Completion lengths are lognormal (σ = ``--sigma``) with median ``--median`` × ``--max-length``, clipped to
``[1, max_length]``; the first sequence is set to ``max_length`` (a completion that hit the limit, so the
bucket is the maximum: the case packing is for). Prompt lengths are uniform in ``[P/2, P]``. Both layouts
start from the same parameters; their first-call losses and updates are printed with their difference.

Reported: real tokens per second (prompt + completion tokens, not padding) of each layout, median of
``--repeats`` alternating timed calls after a warm-up, and their ratio (goal: ≥ 1.5× at equal loss);
then for every remat policy (``model.remat``) on the packed workload the compiled program's temporary
and peak memory (``memory_analysis()``: the compiler's buffer assignment, on every backend; the peak is
0 where a backend does not report it), the median step time and both relative to ``none``. (The
device's ``memory_stats()`` peak is not used: it never resets within a process, so it could not tell the
policies apart.)

  python scripts/bench_packing.py                 # the documented configuration (run on a quiet machine)
  python scripts/bench_packing.py --tiny          # smoke test: a tiny model and rollout
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

from jaxgrpo import models
from jaxgrpo.kernels.config import preset
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import train


def lognormal_rollout(rng, b, group, prompt, max_length, median, sigma, vocab) -> train.Batch:
  """A host :class:`~jaxgrpo.step.train.Batch`: left-padded prompts ``[b, prompt]`` (one per group),
  right-padded completions ``[b, max_length]`` of lognormal lengths, rollout log-probs and rewards."""
  groups = b // group
  plen = np.repeat(rng.integers(max(1, prompt // 2), prompt + 1, groups), group)
  clen = np.exp(rng.normal(np.log(median * max_length), sigma, b))
  clen = np.clip(np.round(clen), 1, max_length).astype(np.int64)
  clen[0] = max_length
  pm = np.arange(prompt)[None] >= prompt - plen[:, None]
  cm = np.arange(max_length)[None] < clen[:, None]
  pt = np.where(pm, np.repeat(rng.integers(1, vocab, (groups, prompt)), group, axis=0), 0).astype(np.int32)
  ct = np.where(cm, rng.integers(1, vocab, (b, max_length)), 0).astype(np.int32)
  old = np.where(cm, np.log(1.0 / vocab) + 0.1 * rng.standard_normal((b, max_length)), 0).astype(np.float32)
  rewards = rng.integers(0, 2, b).astype(np.float32)
  gids = np.repeat(np.arange(groups), group).astype(np.int32)
  return train.Batch(pt, pm, ct, cm, old, gids, rewards)


def build_step(cfg, args, mesh, *, packing, remat="none"):
  """``(step, state)`` for the grpo preset on ``mesh``: SGD (the update is not what is measured)."""
  model = models.build_model(cfg, rngs=nnx.Rngs(args.seed), remat=remat)
  opt = optax.sgd(1e-4)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  tc = train.TrainConfig(
    micro_batches=args.micro_batches,
    chunk_size=args.chunk_size,
    group_size=args.group,
    packing=packing,
    packing_rows=args.rows if packing else None,
  )
  return train.make_train_step(graphdef, opt, preset("grpo"), mesh=mesh, shardings=shardings, train_config=tc), state


def timed_call(step, state, batch):
  t0 = time.perf_counter()
  state, metrics = step(state, batch)
  jax.block_until_ready(state)
  return state, metrics, time.perf_counter() - t0


def memory(step, state, batch):
  """``(temp bytes, peak bytes)`` of the compiled step (None where the backend does not say)."""
  analysis = step.lower(state, batch).compile().memory_analysis()  # lowered under the step's mesh
  if analysis is None:
    return None, None
  return analysis.temp_size_in_bytes, analysis.peak_memory_in_bytes


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--hidden", type=int, default=384)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--batch", type=int, default=64, help="sequences in the rollout")
  ap.add_argument("--group", type=int, default=8, help="group size G")
  ap.add_argument("--prompt", type=int, default=64, help="prompt slots P (lengths uniform in [P/2, P])")
  ap.add_argument("--max-length", type=int, default=2048, help="completion slots T (the generation limit)")
  ap.add_argument("--median", type=float, default=0.1, help="median completion length / max-length")
  ap.add_argument("--sigma", type=float, default=1.0, help="lognormal σ of the completion lengths")
  ap.add_argument("--row-length", type=int, default=None, help="packed row length L (default P + T_bucket)")
  ap.add_argument("--rows", type=int, default=None, help="packed rows per micro-batch (default: the packer's bucket)")
  ap.add_argument("--micro-batches", type=int, default=4)
  ap.add_argument("--chunk-size", type=int, default=128)
  ap.add_argument("--mesh", default="data=1", help="mesh spec (default: one device)")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--policies", default="none,full,dots,dots_no_batch", help="remat policies to measure")
  ap.add_argument("--tiny", action="store_true", help="a tiny model and rollout (smoke test)")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  if args.tiny:
    args.vocab, args.hidden, args.layers, args.batch, args.group = 256, 32, 2, 8, 4
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
  mesh = shd.make_mesh(args.mesh, devices=jax.devices()[:1] if args.mesh == "data=1" else None)
  rng = np.random.default_rng(args.seed)
  rollout = lognormal_rollout(
    rng, args.batch, args.group, args.prompt, args.max_length, args.median, args.sigma, args.vocab
  )
  padded = train.pad_to_bucket(rollout)
  t_bucket = padded.completions.shape[1]
  row_length = args.row_length or args.prompt + t_bucket
  cm, pm = rollout.mask, rollout.prompt_mask
  real = int(pm.sum() + cm.sum())
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), mesh {dict(mesh.shape)}")
  print(
    f"rollout: {args.batch} sequences in groups of {args.group}, completion lengths lognormal median "
    f"{args.median:g}×{args.max_length}, σ={args.sigma:g}: mean {cm.sum(1).mean():.0f}, max {cm.sum(1).max()}; "
    f"{real} real tokens"
  )

  steps, states, batches = {}, {}, {}
  steps["padded"], states["padded"] = build_step(cfg, args, mesh, packing=None)
  steps["packed"], states["packed"] = build_step(cfg, args, mesh, packing=row_length)
  t0 = time.perf_counter()
  packed_host = steps["packed"].pack(padded)
  pack_ms = 1e3 * (time.perf_counter() - t0)
  batches = {name: steps[name].place_batch(b) for name, b in (("padded", padded), ("packed", packed_host))}
  pk = packed_host.packed
  slots = pk.head_index.shape[0]
  padded_slots = args.batch * (args.prompt + t_bucket)
  print(
    f"padded: {args.batch}×{args.prompt + t_bucket} = {padded_slots} token slots ({real / padded_slots:.0%} real); "
    f"packed: {slots} micro-batch slots × {pk.rows_per_slot} rows × L={row_length} = {pk.tokens.size} token slots "
    f"({real / pk.tokens.size:.0%} real), LM head on {pk.head_index.size} positions "
    f"(padded: {args.batch * t_bucket}); host packing {pack_ms:.1f} ms"
  )
  n_params = sum(x.size for x in jax.tree.leaves(states["padded"].params))
  print(
    f"model: {n_params / 1e6:.2f}M params, {args.layers} layers; K={args.micro_batches} micro-batches, "
    f"chunk {args.chunk_size}"
  )

  first, times = {}, {name: [] for name in steps}
  for name in steps:
    t0 = time.perf_counter()
    states[name], metrics, _ = timed_call(steps[name], states[name], batches[name])
    first[name] = {k: float(v) for k, v in metrics.items()}
    print(f"{name:<7} compile + first call {time.perf_counter() - t0:7.2f} s   loss {first[name]['loss']:+.7f}")
  dloss = abs(first["packed"]["loss"] - first["padded"]["loss"])
  dgrad = abs(first["packed"]["grad_norm"] - first["padded"]["grad_norm"])
  print(
    f"|loss packed - loss padded| = {dloss:.2e}, |Δ grad_norm| = {dgrad:.2e} (grad_norm {first['padded']['grad_norm']:.3e})"
  )
  for _ in range(args.repeats):  # alternate, so that machine noise hits both alike
    for name in steps:
      states[name], _, sec = timed_call(steps[name], states[name], batches[name])
      times[name].append(sec)
  med = {name: statistics.median(ts) for name, ts in times.items()}
  for name in steps:
    print(f"{name:<7} {1e3 * med[name]:9.1f} ms   {real / med[name]:12.0f} real tokens/s")
  speedup = med["padded"] / med["packed"]
  print(f"packed / padded train-step throughput: {speedup:.2f}× (goal ≥ 1.5× at equal loss)")

  policies = {}
  print("remat policies (model.remat) on the packed workload: compiled temp / peak memory, median step time")
  for name in args.policies.split(","):
    policy = models.RematPolicy.parse(name).value
    step, state = build_step(cfg, args, mesh, packing=row_length, remat=policy)
    batch = step.place_batch(packed_host)
    temp, peak = memory(step, state, batch)
    state, _, _ = timed_call(step, state, batch)
    secs = []
    for _ in range(args.repeats):
      state, _, sec = timed_call(step, state, batch)
      secs.append(sec)
    policies[policy] = {"temp_bytes": temp, "peak_bytes": peak, "seconds": statistics.median(secs)}
  base = policies.get("none")
  mib = lambda x: "n/a" if x is None else f"{x / 2**20:.1f} MiB"
  ratio = lambda a, b: "" if not (a and b) else f" ({a / b:.2f}×)"
  for policy, r in policies.items():
    rel = base if base is not None else r
    print(
      f"  {policy:<14} temp {mib(r['temp_bytes']):>12}{ratio(r['temp_bytes'], rel['temp_bytes']):<9} "
      f"peak {mib(r['peak_bytes']):>12}{ratio(r['peak_bytes'], rel['peak_bytes']):<9} "
      f"{1e3 * r['seconds']:9.1f} ms{ratio(r['seconds'], rel['seconds'])}"
    )
  return {
    "losses": {name: first[name]["loss"] for name in first},
    "loss_diff": dloss,
    "grad_norms": {name: first[name]["grad_norm"] for name in first},
    "seconds": med,
    "speedup": speedup,
    "policies": policies,
    "real_tokens": real,
    "pack_ms": pack_ms,
  }


if __name__ == "__main__":
  main()
