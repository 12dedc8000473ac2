#!/usr/bin/env python
"""Compile every program of a run ahead of time for a target and print what each needs per device.

    python scripts/plan.py --config scripts/configs/pod_grpo.yaml --model qwen3-8b --topology v5p-64
    python scripts/plan.py --config scripts/configs/pod_grpo.yaml --model qwen3-8b --topology v5e-16   # + the fix
    python scripts/plan.py --config scripts/configs/demo.yaml --topology cpu-8 --json
    python scripts/plan.py --config scripts/configs/pod_grpo.yaml --model qwen3-8b --topology h100-8  # estimated
    python scripts/plan.py --config scripts/configs/demo.yaml --devices           # this machine's devices

The run config is ``scripts/train.py``'s (``--config`` YAML and ``--section.field value`` overrides). ``--model``:
a named shape (``qwen3-0.6b``, ``qwen3-1.7b``, ``qwen3-4b``, ``qwen3-8b``, ``qwen3-14b``, ``qwen3-32b``,
``qwen3-30b-a3b``: the published config.json values) or a ``config.json`` path / model directory; default: the
config's ``model``. ``--topology``: a Cloud TPU name (``v5p-64``, ``v5e-16``, ``v5e-256``, ``v6e-64``, ``v4-8``),
a topology string (``v5e:4x4``), ``cpu-N`` (N host devices: XLA:CPU, no fit test), or ``h100-N`` / ``h200-N`` /
``a100-N`` (estimated by formula); ``--slices N`` for multi-slice. A TPU target needs libtpu: without it the
script re-runs itself with ``.venv-tpu/bin/python`` (``bash scripts/setup_tpu_venv.sh`` builds it).

Exit status: 0 every program fits (or no fit test), 1 a program does not fit (its fix printed), 2 bad input (one
``error:`` line). ``jaxgrpo.plan`` is the API (docs/scale.md, "What fits where").
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
    allow_abbrev=False,
    epilog="Any other --section.key VALUE overrides the config, as for scripts/train.py (e.g. --step.micro_batches "
    "4, --devices.rollout 2).",
  )
  p.add_argument("--config", help="the run's YAML config (scripts/train.py's)")
  p.add_argument("--model", help="a named shape (qwen3-8b, ...) or a config.json path / model directory")
  where = p.add_mutually_exclusive_group(required=True)
  where.add_argument("--topology", help="v5p-64 | v5e-16 | v6e-64 | v4-8 | v5e:4x4 | cpu-N | h100-8 | ...")
  where.add_argument("--devices", action="store_true", help="this machine's devices")
  p.add_argument("--slices", type=int, default=1, help="TPU slices (multi-slice)")
  p.add_argument(
    "--programs",
    help="comma-separated subset: step,sampler,reference,old_logp,reward_model:NAME,teacher (default: all)",
  )
  p.add_argument("--no-fix", action="store_true", help="do not search a fix for a program that does not fit")
  p.add_argument("--json", action="store_true", help="the plan as JSON on stdout (the log on stderr)")
  return p


def _before_jax(argv) -> None:
  """``cpu-N``: XLA_FLAGS before jax is imported; a TPU topology without libtpu: re-run with ``.venv-tpu``."""
  topo = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--topology"), None)
  topo = topo or next((a.partition("=")[2] for a in argv if a.startswith("--topology=")), None)
  if topo is None:
    return
  if m := re.fullmatch(r"cpu-(\d+)", topo.strip().lower()):
    flag = f"--xla_force_host_platform_device_count={int(m.group(1))}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  elif re.match(r"(v4|v5p|v5e|v5litepod|v6e)[-:]|v5:", topo.strip().lower()):
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several compiling processes share libtpu's lock file
    if importlib.util.find_spec("libtpu") is None:
      venv = os.path.join(os.path.dirname(HERE), ".venv-tpu", "bin", "python")
      if not os.path.exists(venv):
        sys.exit(
          f"error: --topology {topo}: compiling for a TPU needs libtpu: bash scripts/setup_tpu_venv.sh builds "
          ".venv-tpu/ (the tpu-aot extra), then run this command again"
        )
      os.execv(venv, [venv, os.path.abspath(__file__), *argv])
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server here: libtpu's probe is skipped


if __name__ == "__main__":
  _parser().parse_known_args()  # --help and a bad flag answer here, before jax and the library are imported
  _before_jax(sys.argv[1:])

sys.path.insert(0, HERE)
import train as train_script  # noqa: E402 - scripts/train.py: its config loader and override syntax

from jaxgrpo import plan as plan_lib  # noqa: E402
from jaxgrpo.run import specs  # noqa: E402


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  p = _parser()
  args, rest = p.parse_known_args(argv)
  overrides = train_script.parse_overrides(p, rest)
  log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
  try:
    cfg = specs.load_config(args.config, overrides)
    target = plan_lib.parse_target("devices" if args.devices else args.topology, args.slices)
    model_config = None if args.model is None else plan_lib.model_config(args.model)
    programs = None if args.programs is None else tuple(x.strip() for x in args.programs.split(","))
    plan = plan_lib.plan_run(
      cfg, target, model_config, model_name=args.model, programs=programs, fix=not args.no_fix, log=log
    )
  except (ValueError, TypeError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(plan.to_json() if args.json else plan_lib.format_table(plan), flush=True)
  if plan.refusal:
    print(f"refused: {plan.refusal}", file=sys.stderr, flush=True)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
