"""Plan a run before renting the machine: compile every program a GRPO run executes ahead of time, from abstract
inputs, for a target (a TPU topology from this CPU, ``cpu-N``, this machine's devices; a GPU estimated by formula),
and say per program what it needs per device, whether it fits, and the smallest change that does.

    from jaxgrpo.plan import model_config, parse_target, plan_run, format_table
    plan = plan_run(cfg, parse_target("v5p-64"), model_config("qwen3-8b"))
    print(format_table(plan)); plan.refusal  # None, or one line naming the fix

``scripts/plan.py`` is the command line (docs/scale.md, "What fits where"); ``scripts/train.py --plan-only`` prints
the same table for its config. The layer above ``run/`` (it reads the run config as the ``Trainer`` does).
"""

from jaxgrpo.plan.flops import active_matmul_params, forward_flops, sampler_flops, step_flops
from jaxgrpo.plan.programs import RunPrograms, RunShape, per_device_bytes, run_shape
from jaxgrpo.plan.report import (
  ProgramPlan,
  RunPlan,
  compile_program,
  count_collectives,
  estimate_gpu,
  find_fix,
  format_table,
  plan_run,
  sampler_fix,
  sampler_hint,
)
from jaxgrpo.plan.shapes import NAMED_SHAPES, model_config
from jaxgrpo.plan.targets import CHIPS, Chip, Target, chip_of_kind, parse_target, target_devices

__all__ = [
  "CHIPS",
  "NAMED_SHAPES",
  "Chip",
  "ProgramPlan",
  "RunPlan",
  "RunPrograms",
  "RunShape",
  "Target",
  "active_matmul_params",
  "chip_of_kind",
  "compile_program",
  "count_collectives",
  "estimate_gpu",
  "find_fix",
  "format_table",
  "forward_flops",
  "model_config",
  "parse_target",
  "per_device_bytes",
  "plan_run",
  "run_shape",
  "sampler_fix",
  "sampler_hint",
  "sampler_flops",
  "step_flops",
  "target_devices",
]
