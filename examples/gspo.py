"""GSPO trained through the train step's public objective hook (no private import, no monkeypatch).

GSPO (Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071) replaces GRPO's per-token
ratio by one sequence-level ratio over the real tokens of completion i, clipped per sequence:

    s_i = exp(mean_t(log π(y_i,t) − log π_old(y_i,t)))
    L   = −mean_i min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i)        (A_i: GRPO's group advantages)

The library has GSPO built in (``jaxgrpo.preset("gspo")``, ``"gspo_token"``; ``jaxgrpo.kernels.surrogates``,
checked against TRL and verl): this script is kept as the worked example of the hook — how research
code trains its own objective without touching the library — and its objective equals the preset's.

    python examples/gspo.py --steps 30
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxgrpo


def gspo_objective(config, logp, old_logp, advantages, mask, *, token_weights=None, ref_logp=None):
  """GSPO's loss of one micro-batch as ``LossTerms`` (the signature of ``jaxgrpo.objective_terms``).

  Each token gets the ratio ``s_i`` with gradient ``s_i·∇log π(y_i,t)`` ("GSPO-token" with equal
  advantages), and ``seq-mean-token-mean`` averages them per sequence, then over sequences: the value
  and the gradient of the sequence-level loss above. The denominator (non-empty sequences) has no
  gradient, as the step requires.
  """
  sg = jax.lax.stop_gradient
  n = jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1)  # [B, 1] real tokens per sequence
  seq_log_ratio = jnp.sum(jnp.where(mask, logp - old_logp, 0.0), axis=1, keepdims=True) / n  # log s_i
  token_logp = old_logp + sg(seq_log_ratio) + logp - sg(logp)  # exp(token_logp - old_logp) = s_i
  hyper = jaxgrpo.GRPOHyper(
    clip_eps_low=config.clip_eps_low, clip_eps_high=config.clip_eps_high, aggregation="seq-mean-token-mean"
  )
  return jaxgrpo.policy_loss_terms(token_logp, old_logp, advantages, mask, hyper)


def even_fraction(prompts, completions):
  """Toy reward: the fraction of even token ids in each completion."""
  return [sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in completions]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--tokens", type=int, default=8)
  args = ap.parse_args(argv)

  cfg = jaxgrpo.models.Qwen3Config(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    tie_word_embeddings=True,
  )
  model = jaxgrpo.build_model(cfg, rngs=nnx.Rngs(0))
  mesh = jaxgrpo.make_mesh("data=1", devices=jax.devices()[:1])
  config = jaxgrpo.preset("grpo", clip_eps_low=3e-4, clip_eps_high=4e-4)  # GSPO's clip ranges
  optimizer = optax.adam(1e-2)
  graphdef, state, shardings = jaxgrpo.init_train_state(model, optimizer, mesh)
  tc = jaxgrpo.TrainConfig(group_size=args.samples, chunk_size=None)
  step = jaxgrpo.make_train_step(
    graphdef, optimizer, config, mesh=mesh, shardings=shardings, train_config=tc, objective_fn=gspo_objective
  )
  sampling = jaxgrpo.SamplingConfig(num_samples=args.samples, max_new_tokens=args.tokens)
  prompts = np.random.default_rng(0).integers(1, 64, (args.prompts, 4)).astype(np.int32)
  prompt_mask = np.ones(prompts.shape, bool)
  key = jax.random.key(0)
  for i in range(args.steps):
    key, sub = jax.random.split(key)
    out = jaxgrpo.grpo_iteration(step, state, prompts, prompt_mask, key=sub, reward_fn=even_fraction, sampling=sampling)
    state, m = out.state, out.metrics
    print(f"step {i + 1:3d}  reward {m['reward_mean']:.3f}  loss {m['loss']:+.4f}  ratio {m['ratio_mean']:.4f}")
  return m


if __name__ == "__main__":
  main()
