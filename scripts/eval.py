#!/usr/bin/env python
"""Evaluate a policy on a math set: mean@k and the unbiased pass@k.

The policy is a Hugging Face model directory (``--model``; e.g. ``OUT/model`` of a run with
``--run.save_model true``) or a training checkpoint (``--checkpoint``: a run directory, its
``checkpoints/`` or one step directory; the model is rebuilt from the config saved with it).

    python scripts/eval.py --checkpoint runs/demo --arithmetic -k 4 --pass-k 1 4
    python scripts/eval.py --model runs/demo/model --arithmetic -k 4 --pass-k 1 4
    python scripts/eval.py --model /ckpt/Qwen3-1.7B --dataset HuggingFaceH4/MATH-500 --split test \\
        -k 16 --pass-k 1 4 16 --temperature 1.0 --max-new-tokens 8192 --mesh fsdp=-1

``--arithmetic`` is the arithmetic task's held-out set (``jaxgrpo.tasks.arithmetic``): with
``--checkpoint`` the run's own task and seed, otherwise the ``--arithmetic-*`` sizes and ``--seed``
(the demo's defaults: the held-out set of ``scripts/configs/demo.yaml``).

Exit status: 0 done; 2 an empty or damaged checkpoint, a bad model directory or data set (one
``error:`` line naming the file and the recovery, no traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jaxgrpo.tasks import script_io  # noqa: E402

script_io.hide_torch_banner()  # before transformers is imported: jaxgrpo needs no torch

import jax
import yaml

from jaxgrpo import data
from jaxgrpo.data import rewards
from jaxgrpo.parallel import sharding
from jaxgrpo.run import builders
from jaxgrpo.run.evaluation import evaluate_policy
from jaxgrpo.run.specs import DTYPES, ModelSpec
from jaxgrpo.services.checkpoint import CheckpointError
from jaxgrpo.tasks import arithmetic


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  policy = p.add_mutually_exclusive_group(required=True)
  policy.add_argument("--model", help="HF model directory (config.json + safetensors + tokenizer) or hub id")
  policy.add_argument("--checkpoint", help="a run directory, its checkpoints/ directory or one step directory")
  p.add_argument("--step", type=int, default=None, help="with --checkpoint: the step (default: the latest complete)")
  problems = p.add_mutually_exclusive_group(required=True)
  problems.add_argument("--dataset", help="hub id or local jsonl/parquet/saved dir")
  problems.add_argument("--arithmetic", action="store_true", help="the arithmetic task's held-out problems")
  p.add_argument("--split", default="test", help="dataset split (default: test)")
  p.add_argument("--mapping", default=None, help="openrs, dapo, gsm8k, math500, or a YAML {prompt:, answer:}")
  p.add_argument("--limit", type=int, default=None, help="first N problems")
  p.add_argument("-k", "--samples", type=int, default=4, help="samples per problem (mean@k)")
  p.add_argument("--pass-k", type=int, nargs="+", default=[1], help="k values of pass@k (default: 1)")
  p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
  p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
  p.add_argument("--max-new-tokens", type=int, default=1024, help="completion length limit (default: 1024)")
  p.add_argument("--max-prompt-tokens", type=int, default=512, help="prompt length limit (default: 512)")
  p.add_argument("--batch-prompts", type=int, default=64, help="prompts sampled per batch (default: 64)")
  p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="with --model: compute and storage dtype")
  p.add_argument("--mesh", default="", help="with --model: mesh spec, e.g. fsdp=-1 (default: every device on fsdp)")
  p.add_argument("--timeout", type=float, default=10.0, help="per-answer verifier timeout (s)")
  p.add_argument("--seed", type=int, default=None, help="sampling seed and arithmetic split (default: the run's, or 0)")
  p.add_argument("--json", action="store_true", help="print one JSON object only")
  defaults = arithmetic.ArithmeticTask()
  for name in ("max_operand", "eval_size", "train_size"):
    p.add_argument(
      f"--arithmetic-{name.replace('_', '-')}",
      type=int,
      default=None,
      help=f"arithmetic task {name} (default: the checkpoint's, else {getattr(defaults, name)})",
    )
  return p.parse_args(argv)


def _policy(args):
  """``(model, tokenizer, saved config or None)`` of ``--model`` or ``--checkpoint``."""
  if args.checkpoint:
    return builders.load_policy(args.checkpoint, step=args.step)
  spec = ModelSpec(path=args.model, dtype=args.dtype, param_dtype=args.dtype)
  model, tokenizer = builders.build_policy(spec, seed=0, mesh=sharding.make_mesh(args.mesh or None))
  return model, tokenizer, None


def _problems(args, saved, seed: int):
  """The held-out examples: a dataset, or the arithmetic task's (the run's own task when known)."""
  if not args.arithmetic:
    mapping = yaml.safe_load(args.mapping) if args.mapping else None
    return data.load_math_dataset(args.dataset, split=args.split, mapping=mapping, limit=args.limit)
  task = saved.data.arithmetic if saved is not None and saved.data.arithmetic is not None else None
  task = task or arithmetic.ArithmeticTask()
  given = {n: getattr(args, f"arithmetic_{n}") for n in ("max_operand", "eval_size", "train_size")}
  task = dataclasses.replace(task, **{n: v for n, v in given.items() if v is not None})
  _, rows = arithmetic.task_split(task, seed=seed)
  return data.examples_from_rows(rows[: args.limit], "openrs")


def _bad_input(e: Exception):
  """A bad checkpoint, model directory or data set: one ``error:`` line, exit status 2."""
  print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
  sys.exit(2)


def main(argv=None):
  args = parse_args(argv)
  try:  # an empty or damaged run, a bad model directory or data set: one line, no traceback
    model, tok, saved = _policy(args)
    seed = args.seed if args.seed is not None else (saved.run.seed if saved is not None else 0)
    examples = _problems(args, saved, seed)
  except (CheckpointError, ValueError, OSError) as e:
    _bad_input(e)
  enc = data.encode_prompts(tok, examples, max_prompt_tokens=args.max_prompt_tokens)
  answers = [examples[i].answer for i in enc.kept]
  pad_id, eos_ids = builders.special_ids(tok)
  accuracy = rewards.MathAccuracy(timeout_s=args.timeout, on_error="zero")
  try:
    out = evaluate_policy(
      model,
      tok,
      enc.tokens,
      answers,
      accuracy=accuracy,
      k=args.samples,
      pass_k=[k for k in args.pass_k if k <= args.samples],
      temperature=args.temperature,
      max_new_tokens=args.max_new_tokens,
      prompt_len=builders.prompt_length(enc.tokens, args.max_prompt_tokens),
      pad_id=pad_id,
      eos_ids=eos_ids,
      batch_prompts=args.batch_prompts,
      top_p=args.top_p,
      key=jax.random.key(seed + 1),
    )
  finally:
    accuracy.close()
  out = {"problems": len(answers), "dropped_prompts": enc.num_dropped, "samples": args.samples, **out}
  if args.json:
    print(json.dumps(out))
  else:
    what = args.model or args.checkpoint
    on = args.dataset or "the arithmetic task"
    print(f"{what} on {on} ({len(answers)} problems, k={args.samples}, T={args.temperature})")
    for key, v in out.items():
      print(f"  {key}: {v:.4f}" if isinstance(v, float) else f"  {key}: {v}")
  return out


if __name__ == "__main__":
  main()
  sys.exit(0)
