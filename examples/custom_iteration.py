"""A hand-written λ-GRPO iteration with a custom Python reward on decoded text.

The pieces of ``jaxgrpo.loop.iteration`` composed by hand — what ``grpo_iteration`` does in one call —
with a reference model (β = 0.04, k3 KL in the loss). The "tokenizer" maps token id i to a letter;
the reward asks each completion to use its prompt's target letters.

    python examples/custom_iteration.py --steps 30
"""

from __future__ import annotations

import argparse
import string

import jax
import numpy as np
import optax
from flax import nnx

import jaxgrpo

LETTERS = string.ascii_lowercase[:16]  # token id i <-> LETTERS[i]


def decode(ids):
  return "".join(LETTERS[i] for i in ids)


def letters_reward(prompts, completions, target):
  """The fraction of the prompt's target letters that the completion uses (1: all of them)."""
  return [sum(ch in c for ch in t) / len(t) for c, t in zip(completions, target)]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--samples", type=int, default=8)
  args = ap.parse_args(argv)

  cfg = jaxgrpo.models.Qwen3Config(
    vocab_size=len(LETTERS),
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    tie_word_embeddings=True,
  )
  model = jaxgrpo.build_model(cfg, rngs=nnx.Rngs(1))
  mesh = jaxgrpo.make_mesh("data=1", devices=jax.devices()[:1])
  optimizer = optax.adam(1e-2)
  graphdef, state, shardings = jaxgrpo.init_train_state(model, optimizer, mesh)
  tc = jaxgrpo.TrainConfig(group_size=args.samples, chunk_size=None)
  step = jaxgrpo.make_train_step(
    graphdef, optimizer, jaxgrpo.preset("lambda_grpo", beta=0.04), mesh=mesh, shardings=shardings, train_config=tc
  )
  reference = jaxgrpo.make_reference(step, state.params)  # once: a copy of the initial policy
  sampling = jaxgrpo.SamplingConfig(num_samples=args.samples, max_new_tokens=6)
  prompts = np.array([[0, 1, 2], [3, 4, 5]], np.int32)  # "abc", "def"
  prompt_mask = np.ones(prompts.shape, bool)
  key = jax.random.key(0)
  for i in range(args.steps):
    key, sub = jax.random.split(key)
    policy = jaxgrpo.policy_model(graphdef, state)
    # at the step's temperature: the rollout carries it, and a step at another one refuses the batch
    rollout = jaxgrpo.sample(policy, prompts, prompt_mask, sampling, key=sub, temperature=tc.temperature)
    rewards = jaxgrpo.score(letters_reward, rollout, decode=decode, columns={"target": ["abc", "def"]})
    batch = jaxgrpo.make_batch(rollout, rewards, mesh=mesh)
    batch = reference(batch)  # ref_logp for the KL term
    state, metrics = step(state, batch)
    print(
      f"step {i + 1:3d}  reward {rewards.mean():.3f}  kl {float(metrics['kl']):.4f}  "
      f"|λ| {float(metrics['tree/mean_process_set_size']):.2f}  e.g. {decode(np.asarray(rollout.completions)[0])!r}"
    )
  return {k: float(v) for k, v in metrics.items()}


if __name__ == "__main__":
  main()
