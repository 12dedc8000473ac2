#!/usr/bin/env python
"""Evaluate a Hugging Face model directory (or a checkpoint written as one, e.g. ``OUT/model`` of a
run with ``--save_model true``) on a math set: mean@k and the unbiased pass@k.

    python scripts/eval.py --model runs/demo/model --dataset demo -k 4 --pass-k 1 4
    python scripts/eval.py --model /ckpt/Qwen3-1.7B --dataset HuggingFaceH4/MATH-500 --split test \\
        -k 16 --pass-k 1 4 16 --temperature 1.0 --max-new-tokens 8192 --mesh fsdp=-1

``--dataset demo`` is the demo's held-out arithmetic set (same seed as the training config).
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", required=True, help="HF model directory (config.json + safetensors + tokenizer)")
  p.add_argument("--dataset", required=True, help="hub id, local jsonl/parquet/saved dir, or 'demo'")
  p.add_argument("--split", default="test")
  p.add_argument("--mapping", default=None, help="openrs, dapo, gsm8k, math500, or a YAML {prompt:, answer:}")
  p.add_argument("--limit", type=int, default=None, help="first N problems")
  p.add_argument("-k", "--samples", type=int, default=4, help="samples per problem (mean@k)")
  p.add_argument("--pass-k", type=int, nargs="+", default=[1])
  p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--max-new-tokens", type=int, default=1024)
  p.add_argument("--max-prompt-tokens", type=int, default=512)
  p.add_argument("--batch-prompts", type=int, default=64)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--mesh", default="", help="mesh spec, e.g. fsdp=-1 (default: every device on fsdp)")
  p.add_argument("--timeout", type=float, default=10.0, help="per-answer verifier timeout (s)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--demo-max-operand", type=int, default=19)
  p.add_argument("--demo-eval-size", type=int, default=128)
  p.add_argument("--demo-train-size", type=int, default=4000)
  p.add_argument("--json", action="store_true", help="print one JSON object only")
  args = p.parse_args(argv)

  import jax
  import yaml

  from jaxgrpo import data, models, rewards, sharding, train, trainer

  mesh = sharding.make_mesh(args.mesh or None)
  dtype = trainer.DTYPES[args.dtype]
  model = models.load_hf(args.model, dtype=dtype, param_dtype=dtype, mesh=mesh)
  tok = models.load_tokenizer(args.model)
  if args.dataset == "demo":
    from jaxgrpo import demo

    _, rows = demo.arithmetic_split(
      args.demo_train_size, args.demo_eval_size, seed=args.seed, max_operand=args.demo_max_operand
    )
    examples = data.examples_from_rows(rows, "openrs")
  else:
    mapping = yaml.safe_load(args.mapping) if args.mapping else None
    examples = data.load_math_dataset(args.dataset, split=args.split, mapping=mapping, limit=args.limit)
  enc = data.encode_prompts(tok, examples, max_prompt_tokens=args.max_prompt_tokens)
  answers = [examples[i].answer for i in enc.kept]
  longest = max(len(t) for t in enc.tokens)
  prompt_len = train.bucket_length(longest, tuple(range(16, args.max_prompt_tokens + 16, 16)))
  pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
  eos = tok.eos_token_id
  eos_ids = tuple(sorted({int(e) for e in ([eos] if isinstance(eos, int) else eos or [])}))
  accuracy = rewards.MathAccuracy(timeout_s=args.timeout)
  try:
    out = trainer.evaluate_policy(
      model,
      tok,
      enc.tokens,
      answers,
      accuracy=accuracy,
      k=args.samples,
      pass_k=[k for k in args.pass_k if k <= args.samples],
      temperature=args.temperature,
      max_new_tokens=args.max_new_tokens,
      prompt_len=prompt_len,
      pad_id=pad_id,
      eos_ids=eos_ids,
      batch_prompts=args.batch_prompts,
      top_p=args.top_p,
      key=jax.random.key(args.seed + 1),
    )
  finally:
    accuracy.close()
  out = {"problems": len(answers), "dropped_prompts": enc.num_dropped, "samples": args.samples, **out}
  if args.json:
    print(json.dumps(out))
  else:
    print(f"{args.model} on {args.dataset} ({len(answers)} problems, k={args.samples}, T={args.temperature})")
    for key, v in out.items():
      print(f"  {key}: {v:.4f}" if isinstance(v, float) else f"  {key}: {v}")
  return out


if __name__ == "__main__":
  main()
  sys.exit(0)
