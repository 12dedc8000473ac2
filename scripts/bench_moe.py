"""Mixture of experts: the GRPO train step of a MoE model vs a dense model with the same active
parameters; grouped (ragged) dispatch vs the one-hot baseline; compiled memory; and the
sampler-vs-train-step log-prob mismatch in bfloat16 with and without routing replay.

Models (random weights, Qwen3 attention, ``--layers`` layers of width D):

- ``moe``: E experts of width Fe, top-k (``jaxgrpo.models.moe``, the default tiled grouped dispatch);
- ``moe-ragged``: the same model with ``jax.lax.ragged_dot`` (native on TPU; a dense masked
  expansion on XLA:CPU);
- ``moe-onehot``: the same model with the one-hot dispatch (every expert on every token);
- ``dense``: a SwiGLU of width k·Fe per layer: the same active parameters per token.

Each variant runs ``jaxgrpo.step.train`` 's step (preset grpo, β = 0) on the same rollout batch; medians
of ``--repeats`` calls after one warm-up, the variants alternating. Memory: XLA's
``memory_analysis()`` of each compiled step (arguments, outputs, temporaries).

Mismatch: a bf16 copy of the MoE model samples with ``record_routing=True``; the train step's
log-probs are recomputed with and without ``batch.routing``; reported: the mean over real tokens of
k3 = ``(r − 1) − log r`` with ``r = π_train / π_sampler`` (Schulman's estimator of
KL(sampler ‖ train)), max |log r|, and the share of tokens whose experts differ in any layer.

  python scripts/bench_moe.py
  python scripts/bench_moe.py --repeats 3 --rows 8      # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxgrpo.kernels.config import preset
from jaxgrpo.models import Qwen3Config, Qwen3MoeConfig, build_model, moe
from jaxgrpo.models.log_probs import completion_log_probs
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.sampling import SamplingConfig, generate
from jaxgrpo.step import train

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402


def configs(args):
  common = dict(
    vocab_size=args.vocab,
    hidden_size=args.width,
    num_layers=args.layers,
    num_heads=4,
    num_kv_heads=2,
    head_dim=args.width // 4,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
  )
  moe_cfg = Qwen3MoeConfig(
    **common,
    intermediate_size=args.experts_per_tok * args.expert_width,
    num_experts=args.experts,
    num_experts_per_tok=args.experts_per_tok,
    moe_intermediate_size=args.expert_width,
    norm_topk_prob=True,
  )
  dense_cfg = Qwen3Config(**common, intermediate_size=args.experts_per_tok * args.expert_width)
  return moe_cfg, dense_cfg


def scale_router(model, factor):
  for path, var in nnx.to_flat_state(nnx.state(model)):
    if path[-1] == "router":
      var.set_value(var.get_value() * factor)


def rollout_batch(model, args, *, record=False, dtype_model=None):
  rng = np.random.default_rng(0)
  groups = args.rows // args.group
  prompts = rng.integers(1, args.vocab, (groups, args.prompt)).astype(np.int32)
  pmask = np.ones_like(prompts, bool)
  sampling = SamplingConfig(
    num_samples=args.group, max_new_tokens=args.new, pad_id=0, suppress_ids=(), record_routing=record
  )
  r = generate(dtype_model or model, jnp.asarray(prompts), jnp.asarray(pmask), sampling, key=jax.random.key(0))
  r = jax.tree.map(np.asarray, r)
  return train.Batch.from_rollout(r, rng.random(args.rows).astype(np.float32))


def make_step(model, batch):
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.adamw(1e-5)
  graphdef, state, sh = train.init_train_state(model, opt, mesh)
  step = train.make_train_step(
    graphdef, opt, preset("grpo"), mesh=mesh, shardings=sh, train_config=train.TrainConfig(chunk_size=64)
  )
  holder = {"state": state}

  def run():
    holder["state"], metrics = step(holder["state"], batch)
    return metrics

  mem = step.lower(holder["state"], batch).compile().memory_analysis()
  memory = {
    "argument_mb": mem.argument_size_in_bytes / 2**20,
    "temp_mb": mem.temp_size_in_bytes / 2**20,
    "output_mb": mem.output_size_in_bytes / 2**20,
  }
  return run, memory


def active_params(model) -> int:
  """Parameters a token uses: everything, with only k of the E experts of each sparse layer."""
  total = 0
  for path, var in nnx.to_flat_state(nnx.state(model)):
    n = int(np.prod(var.shape))
    if path[-1] in ("gate", "up", "down") and var.ndim == 3:  # stacked experts [E, ...]
      n = n // var.shape[0] * model.config.num_experts_per_tok
    total += n
  return total


def mismatch(model, args):
  """k3 between the bf16 sampler's log-probs and the bf16 train forward's, with and without replay
  (float32 parameters, bfloat16 compute: the usual RL setting)."""
  bf16_model = build_model(model.config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  nnx.update(bf16_model, nnx.state(model))
  batch = rollout_batch(bf16_model, args, record=True)
  real = np.asarray(batch.mask)
  logp_fn = jax.jit(_logp)
  out = {}
  for name, routing in (("replay", batch.routing), ("none", None)):
    logp, experts = logp_fn(bf16_model, batch._replace(routing=None), routing)
    log_r = np.where(real, np.asarray(logp) - np.asarray(batch.old_logp), 0.0)
    k3 = np.expm1(log_r) - log_r
    out[name] = {"k3": float(k3[real].mean()), "max_abs_log_ratio": float(np.abs(log_r[real]).max())}
    if routing is None:
      cols = np.concatenate([np.asarray(batch.prompt_mask), real], axis=1)
      cols[:, -1] = False  # the last completion token is never fed to the sampler
      recorded = np.sort(np.asarray(batch.routing), -1)
      differ = np.any(np.sort(np.asarray(experts), -1) != recorded, axis=(2, 3))
      out["tokens_routed_differently_without_replay"] = float(differ[cols].mean())
  return out


def _logp(m, b, routing):
  with moe.routing_scope(replay=routing) as scope:
    logp = completion_log_probs(m, b.prompt_tokens, b.prompt_mask, b.completions, b.mask)[0]
  return logp, scope.stacked().experts


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rows", type=int, default=16)
  p.add_argument("--group", type=int, default=4)
  p.add_argument("--prompt", type=int, default=16)
  p.add_argument("--new", type=int, default=48)
  p.add_argument("--width", type=int, default=256)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--experts", type=int, default=8)
  p.add_argument("--experts-per-tok", type=int, default=2)
  p.add_argument("--expert-width", type=int, default=256)
  p.add_argument("--vocab", type=int, default=512)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--skip-mismatch", action="store_true")
  args = p.parse_args(argv)
  print(_bench.backend_line(), flush=True)
  moe_cfg, dense_cfg = configs(args)
  moe_model = build_model(moe_cfg, rngs=nnx.Rngs(0))
  scale_router(moe_model, 30.0)  # routing far from uniform, as in a trained model
  dense_model = build_model(dense_cfg, rngs=nnx.Rngs(0))
  batch = rollout_batch(moe_model, args)._replace(ref_logp=None)
  g, s = nnx.split(moe_model)
  onehot_model, ragged_model = nnx.merge(g, s), nnx.merge(g, s)
  moe.set_dispatch(moe_model, "tiled")
  moe.set_dispatch(onehot_model, "dense")
  moe.set_dispatch(ragged_model, "ragged")
  variants = {"moe": moe_model, "moe-ragged": ragged_model, "moe-onehot": onehot_model, "dense": dense_model}
  runs, memory = {}, {}
  for name, model in variants.items():
    runs[name], memory[name] = make_step(model, batch)
  times = _bench.medians(_bench.alternating_times(list(runs.values()), args.repeats))
  result = {
    "shape": vars(args),
    "active_params": {k: active_params(m) for k, m in variants.items() if k in ("moe", "dense")},
    "step_seconds": dict(zip(runs, times)),
    "memory": memory,
    "ratios": {
      "moe / dense": times[0] / times[3],
      "ragged_dot / tiled": times[1] / times[0],
      "onehot / tiled": times[2] / times[0],
    },
  }
  if not args.skip_mismatch:
    result["bf16_mismatch"] = mismatch(moe_model, args)
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
