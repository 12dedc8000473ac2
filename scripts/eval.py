#!/usr/bin/env python
"""Evaluate a policy on a math set: mean@k and the unbiased pass@k.

The policy is a Hugging Face model directory (``--model``; e.g. ``OUT/model`` of a run with
``--run.save_model true``) or a training checkpoint (``--checkpoint``: a run directory, its
``checkpoints/`` or one step directory; the model is rebuilt from the config saved with it).

    python scripts/eval.py --checkpoint runs/demo --arithmetic -k 4 --pass-k 1 4
    python scripts/eval.py --model runs/demo/model --arithmetic -k 4 --pass-k 1 4
    python scripts/eval.py --model /ckpt/Qwen3-1.7B --dataset HuggingFaceH4/MATH-500 --split test \\
        -k 16 --pass-k 1 4 16 --temperature 1.0 --max-new-tokens 8192 --mesh fsdp=-1

``--checkpoint`` without ``--dataset`` runs the trainer's own held-out evaluation of that step
(``jaxgrpo.run.evaluation.evaluate_checkpoint``): the run's held-out rows, prompts, padded prompt length,
verifier, sampling settings (``eval.samples``, ``eval.pass_k``, ``eval.temperature``, ``rollout.max_new_tokens``,
``top_p``/``top_k``, ``eval.batch_prompts``), environment and key, so it prints the numbers of that step's eval
record in ``OUT/metrics.jsonl``; each option given overrides its setting. With ``--model`` (or ``--dataset``)
the options default to the checkpoint's settings where there is one, else to the values in their help.

``--arithmetic`` is the arithmetic task's held-out set (``jaxgrpo.tasks.arithmetic``): with
``--checkpoint`` the run's own task and seed, otherwise the ``--arithmetic-*`` sizes and ``--seed``
(the demo's defaults: the held-out set of ``scripts/configs/demo.yaml``).

Exit status: 0 done; 2 bad input: an option out of range, a missing step, an empty or damaged checkpoint,
a bad model directory or data set (one ``error:`` line naming the option or file and the fix, no traceback,
before any weight is read).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import warnings

from jaxgrpo.tasks import script_io  # noqa: E402

script_io.hide_torch_banner()  # before transformers is imported: jaxgrpo needs no torch

import jax
import yaml

from jaxgrpo import data
from jaxgrpo.parallel import sharding
from jaxgrpo.rewards import reward_set as rewards
from jaxgrpo.run import assemble, builders
from jaxgrpo.run.evaluation import eval_settings, evaluate_checkpoint, evaluate_policy
from jaxgrpo.run.specs import DTYPES, ModelSpec, config_from_dict
from jaxgrpo.services import checkpoint
from jaxgrpo.services.checkpoint import CheckpointError
from jaxgrpo.tasks import arithmetic

# the options' values without a checkpoint (with one: its run's settings)
DEFAULTS = {
  "samples": 4,
  "pass_k": (1,),
  "temperature": 1.0,
  "top_p": 1.0,
  "max_new_tokens": 1024,
  "max_prompt_tokens": 512,
  "batch_prompts": 64,
  "timeout": 10.0,
}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  policy = p.add_mutually_exclusive_group(required=True)
  policy.add_argument("--model", help="HF model directory (config.json + safetensors + tokenizer) or hub id")
  policy.add_argument("--checkpoint", help="a run directory, its checkpoints/ directory or one step directory")
  p.add_argument("--step", type=int, default=None, help="with --checkpoint: the step (default: the latest complete)")
  problems = p.add_mutually_exclusive_group()
  problems.add_argument("--dataset", help="hub id or local jsonl/parquet/saved dir")
  problems.add_argument(
    "--arithmetic", action="store_true", help="the arithmetic task's held-out problems (with --checkpoint: the run's)"
  )
  p.add_argument("--split", default="test", help="dataset split (default: test)")
  p.add_argument("--mapping", default=None, help="openrs, dapo, gsm8k, math500, or a YAML {prompt:, answer:}")
  p.add_argument("--limit", type=int, default=None, help="first N problems")
  d = lambda name, what: f"{what} (default: the checkpoint's, else {DEFAULTS[name]})"
  p.add_argument("-k", "--samples", type=int, default=None, help=d("samples", "samples per problem (mean@k)"))
  p.add_argument("--pass-k", type=int, nargs="+", default=None, help=d("pass_k", "k values of pass@k, each <= -k"))
  p.add_argument("--temperature", type=float, default=None, help=d("temperature", "sampling temperature, 0 = greedy"))
  p.add_argument("--top-p", type=float, default=None, help=d("top_p", "nucleus sampling mass in (0, 1]"))
  p.add_argument("--max-new-tokens", type=int, default=None, help=d("max_new_tokens", "completion length limit"))
  p.add_argument("--max-prompt-tokens", type=int, default=None, help=d("max_prompt_tokens", "prompt length limit"))
  p.add_argument("--batch-prompts", type=int, default=None, help=d("batch_prompts", "prompts sampled per batch"))
  p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="with --model: compute and storage dtype")
  p.add_argument("--mesh", default="", help="with --model: mesh spec, e.g. fsdp=-1 (default: every device on fsdp)")
  p.add_argument("--timeout", type=float, default=None, help=d("timeout", "per-answer verifier timeout (s)"))
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
  args = p.parse_args(argv)
  if args.model is not None and not (args.dataset or args.arithmetic):
    _bad_input("--model needs the problems: --dataset SET or --arithmetic")
  return args


# (option, its attribute, the smallest value allowed, what it is): checked before anything is read
_AT_LEAST = (
  ("-k", "samples", 1, "the samples per problem"),
  ("--max-new-tokens", "max_new_tokens", 1, "the completion length limit in tokens"),
  ("--max-prompt-tokens", "max_prompt_tokens", 1, "the prompt length limit in tokens"),
  ("--batch-prompts", "batch_prompts", 1, "the prompts per sampling call"),
  ("--limit", "limit", 1, "the number of problems"),
  ("--step", "step", 0, "a saved step (ls OUT/checkpoints)"),
  ("--arithmetic-max-operand", "arithmetic_max_operand", 1, "the largest operand"),
  ("--arithmetic-eval-size", "arithmetic_eval_size", 1, "the held-out problems"),
  ("--arithmetic-train-size", "arithmetic_train_size", 1, "the training problems"),
)


def check_args(args) -> None:
  """Every option in its range, and every local path present: one ``error:`` line (exit 2) naming the
  option, before anything is read."""
  for flag, name, low, what in _AT_LEAST:
    v = getattr(args, name)
    if v is not None and v < low:
      _bad_input(f"{flag} is {what}: expected an int >= {low}; got {v}")
  t = args.temperature
  if t is not None and not (math.isfinite(t) and t >= 0):
    _bad_input(f"--temperature: expected a finite number >= 0 (0 = greedy); got {t}")
  if args.top_p is not None and not 0 < args.top_p <= 1:
    _bad_input(f"--top-p: expected a nucleus mass in (0, 1] (1 = off); got {args.top_p}")
  if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
    _bad_input(f"--timeout: expected seconds > 0; got {args.timeout}")
  bad = [k for k in args.pass_k or () if k < 1]
  if bad:
    _bad_input(f"--pass-k: expected ints >= 1; got {bad}")
  for flag, path in (("--model", args.model), ("--checkpoint", args.checkpoint), ("--dataset", args.dataset)):
    if path and data.looks_local(path) and not os.path.exists(os.path.expanduser(path)):
      _bad_input(f"{flag} {path}: no such file or directory (a local path; a hub id has the form owner/name)")


def saved_config(args):
  """The config saved with ``--checkpoint`` (its meta item only: no weight is read), else None."""
  if not args.checkpoint:
    return None
  meta = checkpoint.read_meta(args.checkpoint, step=args.step)
  return config_from_dict(meta["config"], where=f"config saved in {args.checkpoint}") if meta.get("config") else None


def settings(args, saved) -> dict:
  """The evaluation's settings: each option given, else the checkpoint run's (``eval_settings``), else
  :data:`DEFAULTS`. ``--pass-k`` above ``-k`` is refused; a run's own pass@j above a smaller ``-k`` is
  dropped with a note on stderr."""
  run = {"top_k": 0, **DEFAULTS}
  if saved is not None:
    own = eval_settings(saved)
    run.update({n: own[n] for n in ("temperature", "top_p", "top_k", "max_new_tokens", "batch_prompts")})
    run.update(samples=own["k"], pass_k=own["pass_k"], timeout=saved.reward.timeout_s)
    run.update(max_prompt_tokens=saved.data.max_prompt_tokens)
  out = {**run, **{n: getattr(args, n) for n in DEFAULTS if getattr(args, n) is not None}}
  k = out["samples"]
  if args.pass_k is not None and max(args.pass_k) > k:
    _bad_input(
      f"--pass-k {' '.join(map(str, args.pass_k))}: pass@j needs j <= -k (the samples per problem, {k}); "
      f"raise -k to {max(args.pass_k)} or drop {[j for j in args.pass_k if j > k]}"
    )
  dropped = [j for j in out["pass_k"] if j > k]
  if dropped:
    print(f"note: the run's pass@{dropped} not reported: -k {k} samples per problem", file=sys.stderr)
  out["pass_k"] = tuple(j for j in out["pass_k"] if j <= k)
  return out


def _task_with_options(args, task):
  """The arithmetic task with the ``--arithmetic-*`` sizes given."""
  given = {n: getattr(args, f"arithmetic_{n}") for n in ("max_operand", "eval_size", "train_size")}
  return dataclasses.replace(task, **{n: v for n, v in given.items() if v is not None})


def run_config(args, saved, s: dict):
  """``saved`` (a checkpoint's ``TrainerConfig``) with the settings ``s`` and the options given applied."""
  r = dataclasses.replace
  task = saved.data.arithmetic
  if task is not None:
    task = _task_with_options(args, task)
  ev = r(
    saved.eval,
    samples=s["samples"],
    pass_k=s["pass_k"],
    temperature=s["temperature"],
    batch_prompts=s["batch_prompts"],
    limit=saved.eval.limit if args.limit is None else args.limit,
  )
  return r(
    saved,
    eval=ev,
    rollout=r(saved.rollout, max_new_tokens=s["max_new_tokens"], top_p=s["top_p"]),
    data=r(saved.data, max_prompt_tokens=s["max_prompt_tokens"], arithmetic=task),
    reward=r(saved.reward, timeout_s=s["timeout"]),
    run=r(saved.run, seed=saved.run.seed if args.seed is None else args.seed),
  )


def _policy(args):
  """``(model, tokenizer)`` of ``--model`` or ``--checkpoint``: the weights read."""
  if args.checkpoint:
    model, tokenizer, _ = builders.load_policy(args.checkpoint, step=args.step)
    return model, tokenizer
  spec = ModelSpec(path=args.model, dtype=args.dtype, param_dtype=args.dtype)
  return builders.build_policy(spec, seed=0, mesh=sharding.make_mesh(args.mesh or None))


def _light_policy(args, saved):
  """``(tokenizer, model config)`` of ``--model`` or the checkpoint's model: the tokenizer and ``config.json``
  only (no weight is read), so a bad directory or a prompt limit nothing fits is reported first."""
  spec = saved.model if saved is not None else ModelSpec(path=args.model, dtype=args.dtype, param_dtype=args.dtype)
  tokenizer = builders.build_tokenizer(spec)
  return tokenizer, builders.model_config(spec, tokenizer)


def _problems(args, saved, seed: int):
  """The held-out examples: a dataset, or the arithmetic task's (the run's own task when known)."""
  if not args.arithmetic:
    mapping = yaml.safe_load(args.mapping) if args.mapping else None
    return data.load_math_dataset(args.dataset, split=args.split, mapping=mapping, limit=args.limit)
  task = saved.data.arithmetic if saved is not None and saved.data.arithmetic is not None else None
  task = _task_with_options(args, task or arithmetic.ArithmeticTask())
  _, rows = arithmetic.task_split(task, seed=seed)
  return data.examples_from_rows(rows[: args.limit], "openrs")


def _bad_input(e):
  """A bad option, checkpoint, model directory or data set: one ``error:`` line, exit status 2."""
  print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
  sys.exit(2)


def own_heldout(args, saved) -> bool:
  """True when the checkpoint's run is evaluated as its trainer did (no other problems asked for)."""
  return saved is not None and not args.dataset and (not args.arithmetic or saved.data.arithmetic is not None)


def _prepare_own(args, saved, s, tok, config):
  """The run's held-out rows under the overridden run config: ``(run config, assemble.DataParts)``."""
  cfg = run_config(args, saved, s)
  episodes = cfg.env is not None and cfg.env.episodes is not None
  if not (cfg.data.arithmetic or cfg.eval.dataset or (episodes and cfg.env.eval_episodes)):
    raise ValueError(f"the run in {args.checkpoint} has no held-out set (eval.dataset): pass --dataset SET")
  parts = assemble.build_data(cfg, tok, config)
  if parts.eval_prompts is not None and not parts.eval_prompts.tokens:
    raise ValueError(f"every held-out prompt is longer than --max-prompt-tokens {s['max_prompt_tokens']}: raise it")
  return cfg, parts


def _evaluate_own(prepared, s, model, tok) -> dict:
  """The trainer's evaluation of the checkpoint (``evaluate_checkpoint``)."""
  cfg, parts = prepared
  out = evaluate_checkpoint(cfg, model, tok, data=parts)
  dropped = parts.eval_prompts.num_dropped if parts.eval_prompts is not None else 0
  return {"problems": len(parts.eval_examples or ()), "dropped_prompts": dropped, "samples": s["samples"], **out}


def _prepare_given(args, saved, s, tok, config):
  """``--dataset`` or the arithmetic task's held-out set, encoded: ``(encoded prompts, answers, seed)``."""
  seed = args.seed if args.seed is not None else (saved.run.seed if saved is not None else 0)
  examples = _problems(args, saved, seed)
  instruction = saved.data.instruction if saved is not None else data.INSTRUCTION
  enc = data.encode_prompts(tok, examples, max_prompt_tokens=s["max_prompt_tokens"], instruction=instruction)
  return enc, [examples[i].answer for i in enc.kept], seed


def _evaluate_given(prepared, s, model, tok, saved) -> dict:
  """``evaluate_policy`` on the prepared prompts."""
  enc, answers, seed = prepared
  pad_id, eos_ids = builders.special_ids(tok)
  on_error = saved.reward.on_error if saved is not None else "zero"
  accuracy = rewards.MathAccuracy(timeout_s=s["timeout"], on_error=on_error)
  try:
    out = evaluate_policy(
      model,
      tok,
      enc.tokens,
      answers,
      accuracy=accuracy,
      k=s["samples"],
      pass_k=s["pass_k"],
      temperature=s["temperature"],
      max_new_tokens=s["max_new_tokens"],
      prompt_len=builders.prompt_length(enc.tokens, s["max_prompt_tokens"]),
      pad_id=pad_id,
      eos_ids=eos_ids,
      batch_prompts=s["batch_prompts"],
      top_p=s["top_p"],
      top_k=s["top_k"],
      key=jax.random.key(seed + 1),
    )
  finally:
    accuracy.close()
  return {"problems": len(answers), "dropped_prompts": enc.num_dropped, "samples": s["samples"], **out}


def _prepare(args, saved, s):
  """Everything before the weights: the tokenizer, ``config.json``, the prompts (a warning about dropped prompts
  is shown only when some prompt is left: else the one ``error:`` line says it). Returns ``(tokenizer, prepared)``."""
  tok, config = _light_policy(args, saved)
  prepare = _prepare_own if own_heldout(args, saved) else _prepare_given
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      prepared = prepare(args, saved, s, tok, config)
    except ValueError as e:
      if "max_prompt_tokens" in str(e) and "--max-prompt-tokens" not in str(e):
        raise ValueError(f"{e} (--max-prompt-tokens {s['max_prompt_tokens']}): raise it") from None
      raise
  for w in caught:
    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
  return tok, prepared


def main(argv=None):
  args = parse_args(argv)
  check_args(args)
  try:  # an empty or damaged run, a bad model directory or data set: one line, no traceback
    saved = saved_config(args)
    s = settings(args, saved)
    tok, prepared = _prepare(args, saved, s)
    model, tok = _policy(args)
    if own_heldout(args, saved):
      out = _evaluate_own(prepared, s, model, tok)
    else:
      out = _evaluate_given(prepared, s, model, tok, saved)
  except (CheckpointError, ValueError, OSError) as e:
    _bad_input(e)
  if args.json:
    print(json.dumps(out))
  else:
    what = args.model or args.checkpoint
    on = args.dataset or ("the run's held-out set" if own_heldout(args, saved) else "the arithmetic task")
    print(f"{what} on {on} ({out['problems']} problems, k={s['samples']}, T={s['temperature']})")
    for key, v in out.items():
      print(f"  {key}: {v:.4f}" if isinstance(v, float) else f"  {key}: {v}")
  return out


if __name__ == "__main__":
  main()
  sys.exit(0)
