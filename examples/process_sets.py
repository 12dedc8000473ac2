"""Process sets of one sampled group: the prefix tree λ-GRPO finds inside GRPO.

Samples G completions of one prompt from a small-vocabulary model, then shows, token by token, how
many completions share each prefix (|λ(i,t)|, ``jaxgrpo.process_set_sizes``), the process rewards and
step advantages of that tree (``process_rewards``/``process_advantages``) and the tree statistics the
λ-GRPO paper reports (``process_tree_stats``).

    python examples/process_sets.py --samples 8
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from flax import nnx

import jaxgrpo


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--tokens", type=int, default=6)
  args = ap.parse_args(argv)

  cfg = jaxgrpo.models.Qwen3Config(
    vocab_size=4,
    hidden_size=32,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    tie_word_embeddings=True,
  )
  model = jaxgrpo.build_model(cfg, rngs=nnx.Rngs(0))
  prompt, prompt_mask = np.array([[1, 2, 3]], np.int32), np.ones((1, 3), bool)
  sampling = jaxgrpo.SamplingConfig(num_samples=args.samples, max_new_tokens=args.tokens, pad_id=0)
  rollout = jaxgrpo.generate(model, prompt, prompt_mask, sampling, key=jax.random.key(0))
  tokens, mask, gids = rollout.completions, rollout.mask, rollout.group_ids
  rewards = (np.asarray(tokens) == 2).mean(axis=1).astype(np.float32)  # any outcome reward will do

  sizes = np.asarray(jaxgrpo.process_set_sizes(tokens, mask, gids))  # int32[G, T]
  step_adv = np.asarray(jaxgrpo.process_advantages(rewards, tokens, mask, gids, num_groups=1))  # f32[G, T]
  stats = jaxgrpo.process_tree_stats(tokens, mask, gids, 1, sizes=sizes)

  order = np.lexsort(np.asarray(tokens).T[::-1])  # sorted completions: shared prefixes line up
  print("completion  reward  |λ| per token          step advantage per token")
  for i in order:
    toks = " ".join(str(t) for t in np.asarray(tokens)[i])
    lam = " ".join(f"{s:2d}" for s in sizes[i])
    adv = " ".join(f"{a:+.2f}" for a in step_adv[i])
    print(f"{toks:<12}{rewards[i]:5.2f}   {lam:<22} {adv}")
  for name, value in stats.items():
    print(f"{name:28s} {float(value):.3f}")
  return sizes, {k: float(v) for k, v in stats.items()}


if __name__ == "__main__":
  main()
