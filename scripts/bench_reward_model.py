"""Reward-model scoring throughput: ``jaxgrpo.rewards.RewardModel.score`` against transformers'
``AutoModelForSequenceClassification`` on the same random checkpoint, the same batch and the same process.

A random Qwen3 sequence classifier (``--hidden``, ``--layers``, ``--vocab``; num_labels 1) is saved once as a
Hugging Face folder and loaded by both. Each round scores the same right-padded batch (``--batch`` rows of
random lengths in ``[--seq/2, --seq]``, padded to ``--seq``) with both, in alternating order
(``_bench.alternating_times``); the script prints the medians, the tokens per second (real tokens only) and the
ratio jaxgrpo / transformers, and checks that the scores agree (max |difference| printed).

  python scripts/bench_reward_model.py                    # D=256 L=4 V=4096, 16 x 256 tokens, fp32, 5 rounds
  python scripts/bench_reward_model.py --dtype bfloat16   # both in bf16
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax.numpy as jnp
import numpy as np

from jaxgrpo.rewards.reward_model import load_reward_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402


def make_checkpoint(directory: str, *, hidden: int, layers: int, vocab: int, torch_dtype, seed: int = 0):
  """A random Qwen3ForSequenceClassification saved to ``directory``; returns the torch model."""
  import torch
  import transformers

  config = transformers.AutoConfig.for_model(
    model_type="qwen3",
    vocab_size=vocab,
    hidden_size=hidden,
    intermediate_size=3 * hidden,
    num_hidden_layers=layers,
    num_attention_heads=max(1, hidden // 64),
    num_key_value_heads=max(1, hidden // 128),
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    pad_token_id=0,
    num_labels=1,
  )
  torch.manual_seed(seed)
  model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
  model.save_pretrained(directory)
  return model.to(torch_dtype)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
  args = p.parse_args(argv)

  import torch

  if args.threads:
    torch.set_num_threads(args.threads)
  torch_dtype = getattr(torch, args.dtype)
  rng = np.random.default_rng(0)
  lengths = rng.integers(args.seq // 2, args.seq + 1, args.batch)
  mask = np.arange(args.seq)[None, :] < lengths[:, None]
  tokens = np.where(mask, rng.integers(1, args.vocab, (args.batch, args.seq)), 0).astype(np.int64)
  real = int(mask.sum())
  with tempfile.TemporaryDirectory() as d:
    hf = make_checkpoint(d, hidden=args.hidden, layers=args.layers, vocab=args.vocab, torch_dtype=torch_dtype)
    rm = load_reward_model(d, dtype=jnp.dtype(args.dtype))
  t_tokens, t_mask = torch.as_tensor(tokens), torch.as_tensor(mask.astype(np.int64))

  def ours():
    return rm.score(tokens, mask)

  def theirs():
    with torch.inference_mode():
      return hf(input_ids=t_tokens, attention_mask=t_mask).logits.float().numpy()

  diff = float(np.abs(ours() - theirs()).max())
  times = _bench.alternating_times([ours, theirs], args.rounds, warmup=1)
  t_ours, t_theirs = _bench.medians(times)
  out = {
    "jaxgrpo_s": t_ours,
    "transformers_s": t_theirs,
    "jaxgrpo_tok_s": real / t_ours,
    "transformers_tok_s": real / t_theirs,
    "ratio": t_theirs / t_ours,
    "max_abs_diff": diff,
  }
  print(_bench.backend_line())
  print(
    f"Qwen3 classifier D={args.hidden} L={args.layers} V={args.vocab} {args.dtype}; {args.batch} rows x {args.seq} "
    f"({real} real tokens); torch threads {torch.get_num_threads()}; medians of {args.rounds} alternating rounds"
  )
  print(f"jaxgrpo      {t_ours * 1e3:9.1f} ms  {out['jaxgrpo_tok_s']:10.0f} tokens/s")
  print(f"transformers {t_theirs * 1e3:9.1f} ms  {out['transformers_tok_s']:10.0f} tokens/s")
  print(f"ratio (jaxgrpo tokens/s / transformers tokens/s): {out['ratio']:.2f}; max |score difference| {diff:.2e}")
  return out


if __name__ == "__main__":
  main()
