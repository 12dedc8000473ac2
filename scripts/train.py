#!/usr/bin/env python
"""Train a policy with GRPO / λ-GRPO / FRPO / λ-FRPO on a math set.

    python scripts/train.py --config scripts/configs/demo.yaml                 # offline CPU demo
    python scripts/train.py --config scripts/configs/lambda_grpo_openrs.yaml --mesh fsdp=-1 --out runs/x

Every field of ``jaxgrpo.trainer.TrainerConfig`` can be overridden on the command line as
``--field value`` (or ``--field=value``; dashes and underscores are interchangeable; values are
parsed as YAML, so ``--rewards '{accuracy: 1.0, format: 0.1}'`` and ``--beta null`` work).
The resolved config is printed at start and written to ``OUT/config.json``; metrics go to
``OUT/metrics.jsonl`` (one JSON object per step and per evaluation) and ``OUT/curves.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing


def _field_types():
  # imported lazily: XLA_FLAGS must be set before jax is imported
  from jaxgrpo.trainer import TrainerConfig

  hints = typing.get_type_hints(TrainerConfig)
  return {f.name: hints[f.name] for f in dataclasses.fields(TrainerConfig)}


def _convert(name: str, raw: str, hint):
  import yaml

  value = yaml.safe_load(raw)
  text = str(hint)
  if value is None:
    return None
  if hint is bool:
    if not isinstance(value, bool):
      raise SystemExit(f"--{name}: expected true/false; got {raw!r}")
    return value
  if "float" in text and isinstance(value, (str, int)) and not isinstance(value, bool):
    try:
      return float(value)
    except ValueError:
      raise SystemExit(f"--{name}: expected a number; got {raw!r}") from None
  if hint is int or text in ("int", "int | None", "typing.Optional[int]"):
    if not isinstance(value, int):
      raise SystemExit(f"--{name}: expected an integer; got {raw!r}")
  if "str" in text and "Mapping" not in text and not isinstance(value, str):
    return str(raw)
  return value


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", help="YAML config file (fields of TrainerConfig)")
  p.add_argument("--out", help="output directory (metrics.jsonl, config.json, curves.png)")
  p.add_argument("--steps", help="number of RL steps")
  p.add_argument("--mesh", help="mesh spec, e.g. data=2,fsdp=2,tensor=2 (default: every device on fsdp)")
  p.add_argument("--preset", help="grpo, dr_grpo, dapo, lambda_grpo, frpo, lambda_frpo")
  p.add_argument(
    "--resume",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="resume from the latest complete checkpoint in OUT/checkpoints (default: on when there is one)",
  )
  p.add_argument("--keep-checkpoints", type=int, default=3, help="keep the last K checkpoints (default 3)")
  p.add_argument(
    "--best-metric",
    default="eval_accuracy",
    help="also keep the best checkpoint by this eval metric ('' : none; default eval_accuracy)",
  )
  p.add_argument("--sync-checkpoints", action="store_true", help="write checkpoints in the foreground")
  p.add_argument(
    "--tensorboard",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="TensorBoard event files in OUT/tensorboard (default: on when tensorboardX is installed)",
  )
  p.add_argument("--wandb", default=None, metavar="PROJECT", help="log to this Weights & Biases project")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument(
    "--cpu-devices",
    type=int,
    default=None,
    help="simulate N CPU devices (sets XLA_FLAGS before jax is imported; for testing)",
  )
  p.add_argument("--no-plot", action="store_true", help="do not write OUT/curves.png")
  args, rest = p.parse_known_args(argv)
  if args.cpu_devices:
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.cpu_devices}"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  types = _field_types()
  overrides = {}
  for name in ("out", "steps", "mesh", "preset"):
    if getattr(args, name) is not None:
      overrides[name] = _convert(name, getattr(args, name), types[name])
  if args.resume is not None:
    overrides["resume"] = args.resume
  i = 0
  while i < len(rest):
    tok = rest[i]
    if not tok.startswith("--"):
      p.error(f"unexpected argument {tok!r}")
    key, _, val = tok[2:].partition("=")
    key = key.replace("-", "_")
    if key not in types:
      p.error(f"unknown option --{key}; config fields: {', '.join(sorted(types))}")
    if not _:
      if i + 1 >= len(rest):
        p.error(f"--{key} needs a value")
      val = rest[i + 1]
      i += 1
    overrides[key] = _convert(key, val, types[key])
    i += 1
  return args, overrides


def plot_curves(metrics_path: str, png_path: str) -> bool:
  """Reward (per step) and held-out accuracy (per evaluation) curves; False without matplotlib."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed (pip install 'jaxgrpo[plot]'): no curves.png")
    return False
  recs = [json.loads(line) for line in open(metrics_path)]
  steps = [r for r in recs if "reward_mean" in r]
  evals = [r for r in recs if "eval_accuracy" in r]
  fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
  ax[0].plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], lw=1)
  ax[0].set(xlabel="step", ylabel="mean reward", title="training reward")
  keys = {k for r in evals for k in r if k.startswith("eval_pass@") or k == "eval_accuracy"}
  for key in sorted(keys - {"eval_pass@1"}):  # pass@1 equals mean@k
    ax[1].plot(
      [r["step"] for r in evals if key in r],
      [r[key] for r in evals if key in r],
      "o-",
      label="mean@k" if key == "eval_accuracy" else key[5:],
    )
  ax[1].set(xlabel="step", ylabel="held-out accuracy", title="evaluation", ylim=(0, 1))
  ax[1].legend()
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
  return True


def main(argv=None):
  import time

  t_wall, t_cpu = time.perf_counter(), time.process_time()
  args, overrides = parse_args(argv)
  from jaxgrpo.trainer import Trainer, load_config

  cfg = load_config(args.config, overrides)
  if cfg.distributed:  # before any JAX computation; arguments, then JAX_* variables, then TPU/Slurm/MPI
    from jaxgrpo import distributed

    distributed.initialize(cfg.coordinator_address, cfg.num_processes, cfg.process_id)
  import jax

  from jaxgrpo import checkpoint, metrics

  if args.resume is None and not cfg.resume and checkpoint.has_checkpoint(cfg.out):
    cfg = dataclasses.replace(cfg, resume=True)  # --resume is on by default when OUT has a checkpoint
  if not cfg.resume and checkpoint.has_checkpoint(cfg.out):
    raise SystemExit(
      f"{checkpoint.checkpoint_dir(cfg.out)} holds checkpoints of an earlier run and --no-resume "
      f"was given: use another --out, or delete them to start over (nothing was overwritten)"
    )
  if jax.process_index() == 0:
    print("resolved config:\n" + json.dumps(cfg.to_dict(), indent=1))
    print(f"objective: {cfg.objective()}")
    print(f"devices: {jax.device_count()} ({jax.devices()[0].platform}), processes: {jax.process_count()}", flush=True)
  is_main = jax.process_index() == 0
  ckpt = checkpoint.Checkpointer(
    checkpoint.checkpoint_dir(cfg.out),
    max_to_keep=args.keep_checkpoints,
    best_metric=args.best_metric or None,
    async_save=not args.sync_checkpoints,
    log=lambda s: print(s, flush=True) if is_main else None,
  )
  trainer = Trainer(
    cfg,
    log=lambda s: print(s, flush=True) if is_main else None,
    checkpoint_fn=ckpt.checkpoint_fn,
    restore_fn=ckpt.restore_fn,
  )
  tensorboard = args.tensorboard
  if tensorboard is None:
    import importlib.util

    tensorboard = importlib.util.find_spec("tensorboardX") is not None
  logger = metrics.MetricsLogger(
    cfg.out,
    total_steps=cfg.steps,
    start_step=int(trainer.state.train.step),
    progress=not args.no_progress,
    tensorboard=tensorboard,
    wandb_project=args.wandb,
    config=cfg.to_dict(),
  )
  trainer.on_record = lambda rec: (ckpt.observe(rec), logger(rec))
  if not args.no_progress:
    trainer.log = ckpt.log = logger.write if is_main else (lambda s: None)  # above the progress bar
  try:
    records = trainer.run()
  finally:
    ckpt.close()  # waits for the last (asynchronous) save
    logger.close()
  if jax.process_index() == 0:
    evals = [r for r in records if "eval_accuracy" in r]
    if len(evals) >= 2:
      print(
        f"held-out mean@{cfg.eval_samples}: {evals[0]['eval_accuracy']:.3f} (step {evals[0]['step']}) "
        f"-> {evals[-1]['eval_accuracy']:.3f} (step {evals[-1]['step']})"
      )
    if not args.no_plot:
      png = os.path.join(cfg.out, "curves.png")
      if plot_curves(os.path.join(cfg.out, "metrics.jsonl"), png):
        print(f"wrote {png}")
    print(
      f"total: {time.perf_counter() - t_wall:.0f} s wall, {time.process_time() - t_cpu:.0f} s CPU "
      "(all threads of this process)"
    )
  return records


if __name__ == "__main__":
  sys.exit(0 if main() is not None else 1)
