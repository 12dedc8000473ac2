#!/usr/bin/env python
"""Fit the arithmetic demo's reward model and save it where a run config's reward model source reads it.

    python scripts/train_reward_model.py --config scripts/configs/demo_rm.yaml
    python scripts/train.py --config scripts/configs/demo_rm.yaml

A tiny ``Qwen3ForSequenceClassification`` (``jaxgrpo.tasks.arithmetic_rm``) is fitted with a Bradley-Terry
loss to score a correct answer ``"a+b=c. \\boxed{c}"`` above wrong ones (the boxed value off, a consistent
wrong result, no box, a random string) on the training problems of the config's ``data.arithmetic`` (the
run's split: ``run.seed``), rendered as the trainer's reward model sees them (the config's
``data.instruction``). It is written as a Hugging Face folder (weights, ``config.json``, the tokenizer) to
the ``path`` of the config's first ``reward.sources`` entry of kind ``reward_model`` (``--out`` overrides),
with ``rm_metrics.json``: the held-out pair accuracy per rejected kind (problems never trained on) and the
fit's losses and seconds. The fit shows a progress bar (``reward model``: ``compiling`` until its program is
compiled, then the loss and an ETA that does not count the compile; ``--no-progress``: none). Exit status 2 on
a bad config (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", required=True, help="a run config with data.arithmetic and a reward_model source")
  ap.add_argument("--out", default=None, help="the folder to write (default: the reward_model source's path)")
  ap.add_argument("--steps", type=int, default=3000, help="AdamW steps of the fit")
  ap.add_argument("--batch-size", type=int, default=32, help="preference pairs per step")
  ap.add_argument("--learning-rate", type=float, default=1e-2, help="AdamW's peak learning rate (cosine decay)")
  ap.add_argument("--hidden-size", type=int, default=64, help="the classifier's width (the demo policy's)")
  ap.add_argument("--num-layers", type=int, default=2, help="the classifier's decoder layers")
  ap.add_argument("--seed", type=int, default=0, help="the initialisation, pairs and batches")
  ap.add_argument("--no-progress", action="store_true", help="no progress bar (the fit prints its result only)")
  return ap


if __name__ == "__main__":
  _parser().parse_args()  # --help and a bad flag answer here, before jax and the library are imported


from jaxgrpo.tasks import script_io  # noqa: E402

script_io.hide_torch_banner()  # before transformers is imported: the fit needs no torch

from jaxgrpo.rewards.reward_model import parameter_bytes, save_reward_model  # noqa: E402
from jaxgrpo.run.specs import load_config  # noqa: E402
from jaxgrpo.tasks import arithmetic, arithmetic_rm  # noqa: E402


def main(argv=None) -> int:
  args = _parser().parse_args(argv)

  try:
    cfg = load_config(args.config)
    task = cfg.data.arithmetic
    if task is None:
      raise ValueError(f"{args.config}: the reward model is fitted on `data.arithmetic` problems; the config has none")
    out = args.out
    if out is None:
      paths = [s.path for s in cfg.reward.sources if s.kind == "reward_model"]
      if not paths:
        raise ValueError(f"{args.config}: no `reward.sources` entry of kind reward_model (its path is the output)")
      out = paths[0]
  except (ValueError, TypeError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  tokenizer = arithmetic.build_tokenizer()
  train_rows, held_rows = arithmetic.task_split(task, seed=cfg.run.seed)
  print(f"fitting the reward model on the preference pairs of {len(train_rows)} training problems", flush=True)
  res = arithmetic_rm.train_reward_model(
    tokenizer,
    train_rows,
    steps=args.steps,
    batch_size=args.batch_size,
    learning_rate=args.learning_rate,
    hidden_size=args.hidden_size,
    num_layers=args.num_layers,
    seed=args.seed,
    instruction=cfg.data.instruction,
    progress=not args.no_progress,
  )
  held = arithmetic_rm.preference_pairs(held_rows, seed=args.seed + 1)
  accuracy = arithmetic_rm.pair_accuracy(res.model, tokenizer, held, instruction=cfg.data.instruction)
  total, _ = parameter_bytes(res.model)
  save_reward_model(res.model, out, tokenizer)
  report = {
    "held_out_pair_accuracy": accuracy,
    "held_out_pairs": len(held),
    "losses": res.losses,
    "seconds": res.seconds,
    "parameter_bytes": total,
    "steps": args.steps,
  }
  with open(os.path.join(out, "rm_metrics.json"), "w") as f:
    json.dump(report, f, indent=2)
  print(
    f"reward model: {args.steps} steps in {res.seconds:.1f} s, final loss {res.losses[-1]:.3f}, {total} parameter bytes"
  )
  print("held-out pair accuracy (chosen above rejected): " + ", ".join(f"{k} {v:.3f}" for k, v in accuracy.items()))
  print(f"saved to {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
