"""Compile every program of a run for a target and report what each needs per device: :func:`plan_run`.

Per program (``jaxgrpo.plan.programs.RunPrograms``): ``compiled.memory_analysis()``'s per-device bytes
(arguments, outputs, aliased, temporaries, generated code) plus the run's long-lived arrays the program does not
take (the optimizer moments while sampling, the reference's copy of the parameters), against the chip's HBM; the
analytic FLOPs (``jaxgrpo.plan.flops``: never ``cost_analysis()``, which counts a loop body once); a roofline time
from the datasheet peak and HBM bandwidth (``jaxgrpo.plan.targets.CHIPS``, named with their source); the
collectives of the compiled HLO by kind; the compile time; a verdict. A program that does not fit gets the
smallest change that does, found by compiling (more micro-batches first: a compile that does not fit fails in
seconds; then ``model.remat: full``), in one line.

On ``cpu-N`` (XLA:CPU) only the argument, output and alias bytes mean what they will on the accelerator: the
CPU's temporaries are not the TPU's (1.2-1.4x in a trial), so there is no fit test. A GPU target (``h100-8``) is
an estimate by formula (:func:`estimate_gpu`), nothing compiled.

One job, in over 600 lines: a run's per-program plan for a target — compiled (the bytes, FLOPs, roofline and the
fix search) or, for a GPU, the same rows by formula — and its one-line refusal and table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from typing import Callable

import numpy as np

from jaxgrpo.loop import async_rollout
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.plan import flops as fl
from jaxgrpo.plan import shapes
from jaxgrpo.plan.programs import RunPrograms, run_shape, teacher_config
from jaxgrpo.plan.targets import GiB, Target, target_devices
from jaxgrpo.run import builders
from jaxgrpo.run.spec_schema import DTYPES
from jaxgrpo.step.teacher_remote import is_served_teacher

__all__ = ["ProgramPlan", "RunPlan", "count_collectives", "estimate_gpu", "format_table", "plan_run", "sampler_fix"]

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
_OOM = ("RESOURCE_EXHAUSTED", "exceeds available", "Ran out of memory", "out of memory")


def count_collectives(hlo_text: str) -> dict[str, int]:
  """``{kind: count}`` of the collective instructions of a compiled HLO module's text (an async pair counts once,
  at its ``-start``); loops are not unrolled (a collective in a scanned layer counts once)."""
  counts = dict.fromkeys(COLLECTIVES, 0)
  for m in _COLLECTIVE.finditer(hlo_text):
    counts[m.group(1)] += 1
  return {k: v for k, v in counts.items() if v}


@dataclasses.dataclass
class ProgramPlan:
  """One program's plan (bytes per device; None where not compiled). ``verdict``: ``fits``, ``does not fit``,
  ``no fit test`` (XLA:CPU), ``estimated`` (a GPU by formula) or ``error``; ``fix``: the one-line change that fits;
  ``hint``: what would shrink it when no change was found (the sampler: :func:`sampler_hint`)."""

  name: str
  micro_batches: int
  argument_bytes: int | None = None
  output_bytes: int | None = None
  alias_bytes: int | None = None
  temp_bytes: int | None = None
  code_bytes: int | None = None
  other_resident_bytes: int = 0
  flops: float | None = None
  memory_bytes: float | None = None
  roofline_s: float | None = None
  tokens_per_s_per_device: float | None = None
  collectives: dict = dataclasses.field(default_factory=dict)
  compile_s: float | None = None
  verdict: str = ""
  error: str | None = None
  fix: str | None = None
  tried: list = dataclasses.field(default_factory=list)
  searched: bool = False
  hint: str | None = None

  @property
  def total_bytes(self) -> int | None:
    """arguments + outputs − aliased + temporaries + code + the run's other long-lived arrays."""
    if self.argument_bytes is None:
      return None
    return (
      self.argument_bytes
      + self.output_bytes
      - self.alias_bytes
      + self.temp_bytes
      + self.code_bytes
      + self.other_resident_bytes
    )


@dataclasses.dataclass
class RunPlan:
  target: Target
  model: str
  shape: dict
  mesh: dict
  programs: list
  notes: list
  own_meshes: dict = dataclasses.field(default_factory=dict)  # {program: axes} of a program on devices of its own

  def to_json(self) -> str:
    d = dataclasses.asdict(self)
    d["target"] = dataclasses.asdict(self.target) | {"describe": self.target.describe()}
    for p, plan in zip(d["programs"], self.programs):
      p["total_bytes"] = plan.total_bytes
    return json.dumps(d, indent=1, default=str)

  @property
  def refusal(self) -> str | None:
    """One line for the first program that does not fit (with its fix) or does not compile (the error), or None."""
    bad = next((p for p in self.programs if p.verdict in ("does not fit", "error")), None)
    if bad is None:
      return None
    if bad.verdict == "error":
      return f"the {bad.name} program does not compile for {self.target.name}: {_short(bad.error, 400)}"
    hbm = self.target.chip.hbm_bytes / GiB
    got = f"{bad.total_bytes / GiB:.2f} of {hbm:.2f} GiB/device" if bad.total_bytes is not None else None
    got = got or _compiler_words(bad.error)
    fix = bad.fix or _no_fix(bad)
    if bad.name == "teacher":  # a distillation teacher: its weights stay resident for the whole run
      fix = _teacher_fix(bad, fix, own=self.own_meshes.get("teacher"))
    return f"the {bad.name} program does not fit {self.target.name} ({got}); {fix}"


def _teacher_fix(p: ProgramPlan, fix: str, own: dict | None = None) -> str:
  """What a distillation teacher that does not fit can do: its weights' and the run's other long-lived bytes per
  device, then the micro-batch fix (its activations) and the ways to free room for its weights. ``own``: the axes
  of the teacher's own mesh (``devices.teacher``), where nothing else is resident: then more of them is the way."""
  weights, other = (p.argument_bytes or 0) / GiB, (p.other_resident_bytes or 0) / GiB
  if own:
    devices = math.prod(own.values())
    return (
      f"the teacher's weights take {weights:.2f} GiB/device on its own {devices} devices (`devices.teacher`); {fix}; "
      "or give it more devices (a larger `devices.teacher`), a bf16 `model.param_dtype`, or a smaller teacher"
    )
  return (
    f"the teacher's weights take {weights:.2f} GiB/device beside the run's {other:.2f} of long-lived arrays; {fix}; "
    "or give the teacher chips of its own (`devices.teacher`, docs/distillation.md), more chips (a larger fsdp "
    "axis), a bf16 `model.param_dtype`, or a smaller teacher"
  )


def _no_fix(p: ProgramPlan) -> str:
  if not p.searched:
    return "no fix searched (--no-fix; scripts/plan.py without it compiles more micro-batches until one fits)"
  return p.hint or "no change found by compiling: use more chips (a larger fsdp axis)"


def _compiler_words(msg: str | None) -> str:
  """What XLA said, shortly: ``XLA: HLO temporaries 26.93G, 15.75G of HBM available`` from its RESOURCE_EXHAUSTED
  message (else its first line)."""
  m = re.search(r"required for (.+?) \(([\d.]+\w?)\) exceeds available HBM \(([\d.]+\w?)\)", msg or "")
  if m:
    return f"XLA: {m.group(1)} {m.group(2)}, {m.group(3)} of HBM available"
  return _short(msg)


def _short(msg: str | None, n: int = 160) -> str:
  if not msg:
    return ""
  lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip()]
  line = next((ln for ln in lines if any(k in ln for k in _OOM)), lines[0] if lines else "")
  return line[:n]


def _is_oom(msg: str) -> bool:
  return any(k in msg for k in _OOM)


def _flops_and_bytes(programs: RunPrograms, name: str, plan: ProgramPlan) -> tuple[float, float]:
  """``(analytic FLOPs of the whole program, HBM bytes one device must move at least)``."""
  s, mc, cfg = programs.shape, programs.model_config, programs.cfg
  if name == "step":
    passes = getattr(cfg.objective, "num_iterations", 1) or 1
    return fl.step_flops(mc, s.rows, s.prompt_len, s.completion_len, passes), plan.argument_bytes + plan.output_bytes
  if name in ("reference", "old_logp", "teacher"):  # a log-prob pass: the policy's, or the teacher's own model
    pass_config = programs.teacher_config if name == "teacher" else mc
    return fl.forward_flops(
      pass_config, s.rows, s.prompt_len, s.completion_len
    ), plan.argument_bytes + plan.output_bytes
  if name in programs.reward_models:  # every row of a step, in calls of batch_size rows
    b, t = programs.reward_model_shape(name)
    calls = -(-s.rows // b)
    per_call = fl.forward_flops(programs.reward_models[name][3], b, t, 0)
    return calls * per_call, calls * (plan.argument_bytes + plan.output_bytes)
  compute, mesh = np.dtype(DTYPES[cfg.model.dtype]).itemsize, programs.mesh_of(name)
  tensor = dict(mesh.shape).get("tensor", 1)
  weights = fl.active_matmul_params(mc) * compute / tensor  # every device reads the (gathered) layer weights
  rows_per_dev = s.rows / shd.batch_shards(mesh, programs.step.rules)
  mem = fl.decode_hbm_bytes(mc, weights, rows_per_dev, s.prompt_len, s.new_tokens, compute)
  return fl.sampler_flops(mc, s.prompts, s.group, s.prompt_len, s.new_tokens), mem


def compile_program(programs: RunPrograms, name: str, target: Target, compile_fn=None) -> ProgramPlan:
  """Lower and compile program ``name`` of ``programs``; its :class:`ProgramPlan` (no fix search). ``compile_fn``:
  ``lowered -> compiled`` (default ``lowered.compile()``)."""
  plan = ProgramPlan(name, programs.train_config.micro_batches, other_resident_bytes=programs.other_resident(name))
  t0 = time.perf_counter()
  try:
    lowered = programs.lower(name)
    compiled = (compile_fn or (lambda low: low.compile()))(lowered)
  except Exception as e:  # noqa: BLE001 - a program that does not compile is a row of the table, not a crash
    plan.compile_s = time.perf_counter() - t0
    msg = f"{type(e).__name__}: {e}"
    plan.error = _short(msg, 400)
    plan.verdict = "does not fit" if _is_oom(msg) else "error"
    return plan
  plan.compile_s = time.perf_counter() - t0
  m = compiled.memory_analysis()
  plan.argument_bytes, plan.output_bytes = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
  plan.alias_bytes, plan.temp_bytes = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
  plan.code_bytes = int(m.generated_code_size_in_bytes)
  plan.collectives = count_collectives(compiled.as_text())
  plan.flops, plan.memory_bytes = _flops_and_bytes(programs, name, plan)
  chip, n = target.chip, programs.mesh_of(name).devices.size
  if chip is not None:
    plan.roofline_s = max(plan.flops / n / chip.peak_flops, plan.memory_bytes / chip.hbm_bw)
    s = programs.shape
    tokens = s.rows * (s.new_tokens if name == "sampler" else s.prompt_len + s.completion_len)
    if name in programs.reward_models:
      tokens = s.rows * programs.reward_model_shape(name)[1]
    plan.tokens_per_s_per_device = tokens / plan.roofline_s / n
  if not target.fit_test:
    plan.verdict = "no fit test"
  elif chip is not None and plan.total_bytes > chip.hbm_bytes:
    plan.verdict = "does not fit"
  else:
    plan.verdict = "fits"
  return plan


def _breakdown(p: ProgramPlan) -> str:
  """`` (total X GiB/device: arguments a, outputs o, aliased x, temporaries t, code c, other resident r)``."""
  if p.total_bytes is None:
    return ""
  parts = (p.argument_bytes, p.output_bytes, p.alias_bytes, p.temp_bytes, p.code_bytes, p.other_resident_bytes)
  names = ("arguments", "outputs", "aliased", "temporaries", "code", "other resident")
  unit = lambda b: _gib(b) + ("" if _gib(b).endswith("B") else " GiB")  # noqa: E731 - _gib names only MiB and KiB
  return f" (total {unit(p.total_bytes)}/device: " + ", ".join(f"{n} {unit(b)}" for n, b in zip(names, parts)) + ")"


def _micro_batch_candidates(cfg, mesh, rules) -> list[int]:
  """Micro-batch counts above the config's that divide each device's rows of one mini-batch, ascending."""
  rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
  per = rows // (shd.batch_shards(mesh, rules) * cfg.step.mini_batches)
  return [k for k in range(cfg.step.micro_batches + 1, per + 1) if per % k == 0]


def _with(cfg, **step):
  return dataclasses.replace(cfg, step=dataclasses.replace(cfg.step, **step))


def sampler_fix(cfg, model_config, mesh, *, flag: str = "--devices.mesh") -> str | None:
  """The sampler's fix when ``rollout.prompts_per_step`` does not divide the batch axes (``data × fsdp``): the run
  then passes its prompts replicated (``collect.place_prompts``), and the prefill's rows and the KV cache of all
  B·G rows are whole on every device (Qwen3-8B, 64 prompts on v5e-256: 93.86 GiB of temporaries per chip). The
  line names the numbers and the change that splits them (by this rule, not compiled); None when they divide.
  ``flag``: the option that sets ``mesh``'s axes (``--devices.rollout_mesh`` for a sampler on devices of its own)."""
  n, p = shd.batch_shards(mesh, shd.DEFAULT_RULES), cfg.rollout.prompts_per_step
  if p % n == 0:
    return None
  up = -(-p // n) * n
  fix = (
    f"rollout.prompts_per_step {p} is not a multiple of the {n} devices of the batch axes (data×fsdp), so every "
    f"device holds all {p} prompts and the KV cache of all {p * cfg.rollout.group_size} rows: "
    f"--rollout.prompts_per_step {up} (a multiple of {n})"
  )
  shared = math.gcd(p, n)
  tensor = n // shared * dict(mesh.shape).get("tensor", 1)
  heads = (model_config.num_heads, model_config.num_kv_heads)
  if shared < n and all(h % tensor == 0 for h in heads):  # the rest of the devices on the tensor axis
    fix += f" or {flag} fsdp={shared},tensor={tensor} (prompts over {shared}, heads over {tensor})"
  return fix + " splits them (not compiled)"


def sampler_hint(cfg, model_config, mesh, *, flag: str = "--devices.mesh") -> str:
  """What shrinks a sampler that does not fit although its prompts already split over the batch axes (``data ×
  fsdp``, ``n`` devices): per device it holds ``P·G/n`` rows of ``prompt + max_new_tokens`` positions of KV cache,
  ``kv_heads/tensor`` heads each, and one layer's weights over ``tensor``. A larger fsdp axis helps only while it
  divides the prompts (``P`` a multiple of ``2n``); a larger tensor axis (more devices, or the same ones with half the prompts over half the fsdp axis) or a
  shorter rollout does. One line with the numbers (by this rule, not compiled); ``flag`` as :func:`sampler_fix`'s."""
  sizes, p, g = dict(mesh.shape), cfg.rollout.prompts_per_step, cfg.rollout.group_size
  n, t, new = shd.batch_shards(mesh, shd.DEFAULT_RULES), sizes.get("tensor", 1), cfg.rollout.max_new_tokens
  data, fsdp, kv = sizes.get("data", 1), sizes.get("fsdp", 1), model_config.num_kv_heads

  def mesh_arg(f: int, tt: int) -> str:
    return f"{flag} " + (f"data={data}," if data > 1 else "") + f"fsdp={f},tensor={tt}"

  ways, devices = [], math.prod(sizes.values())
  if p % (2 * n) == 0:
    ways.append(f"a larger fsdp axis ({mesh_arg(2 * fsdp, t)} on {2 * devices} devices: {p * g // (2 * n)} rows each)")
  split = kv % (2 * t) == 0 and model_config.num_heads % (2 * t) == 0
  if split:
    ways.append(f"a larger tensor axis ({mesh_arg(fsdp, 2 * t)} on {2 * devices} devices: the KV cache's {kv} heads and the layer weights over {2 * t})")  # fmt: skip
  if p // 2 and (p // 2) % n == 0:
    ways.append(f"fewer prompts per step (--rollout.prompts_per_step {p // 2}: {p // 2 * g // n} rows per device)")
  elif split and fsdp % 2 == 0:  # half the prompts over half the fsdp axis, the other half on the tensor axis
    ways.append(f"fewer prompts per step on the same devices (--rollout.prompts_per_step {p // 2} {mesh_arg(fsdp // 2, 2 * t)}: {kv // (2 * t)} KV heads per device)")  # fmt: skip
  if new > 1:
    ways.append(f"a shorter rollout (--rollout.max_new_tokens {new // 2}: the KV cache holds prompt + new tokens)")
  stuck = "" if p % (2 * n) == 0 else ", so a larger fsdp axis would not split them further"
  return (
    f"no change found: the sampler's {p} prompts already split over the {n} devices of the batch axes (data×fsdp; "
    f"{p * g // n} rows and their KV cache per device){stuck}; " + ", or ".join(ways) + " shrinks it (not compiled)"
  )


def find_fix(
  cfg, model_config, mesh, name: str, target: Target, log: Callable, *, rollout_mesh=None, teacher_mesh=None
) -> tuple[str | None, list]:
  """The smallest change that makes program ``name`` fit, found by compiling: more micro-batches (doubling through
  the divisors: a compile that does not fit fails in seconds), then ``model.remat: full`` at the most
  micro-batches. ``(one-line fix or None, [(change, verdict, GiB/device or None)] tried)``. ``mesh``: the train
  mesh; ``rollout_mesh`` / ``teacher_mesh``: the sampler's and the teacher's own (``devices.rollout`` /
  ``devices.teacher``; None: on ``mesh``)."""
  tried, meshes = [], dict(rollout_mesh=rollout_mesh, teacher_mesh=teacher_mesh)
  if name == "sampler":
    own = rollout_mesh is not None
    return sampler_fix(cfg, model_config, rollout_mesh if own else mesh, flag=_mesh_flag(own)), tried
  if name.startswith("reward_model:"):
    return None, tried  # a reward model scores its batch_size rows at once: no knob of the step changes it
  base = RunPrograms(cfg, model_config, mesh, **meshes)
  cands = _micro_batch_candidates(cfg, base.mesh_of(name), base.step.rules)
  order, k = [], cfg.step.micro_batches
  while cands:  # doubling: 2k, 4k, ... (the next divisor at or above), then the largest
    nxt = next((c for c in cands if c >= 2 * k), cands[-1])
    order.append(nxt)
    cands = [c for c in cands if c > nxt]
    k = nxt
  trials = [(f"--step.micro_batches {k}", _with(cfg, micro_batches=k)) for k in order]
  if str(cfg.model.remat) not in ("full", "True"):
    last = order[-1] if order else cfg.step.micro_batches
    remat = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat="full"))
    trials.append((f"--model.remat full --step.micro_batches {last}", _with(remat, micro_batches=last)))
  for change, c in trials:
    p = compile_program(RunPrograms(c, model_config, mesh, **meshes), name, target)
    gib = None if p.total_bytes is None else p.total_bytes / GiB
    tried.append((change, p.verdict, gib))
    log(f"  fix search: {name} with {change}: {p.verdict} in {p.compile_s:.0f} s" + _breakdown(p))
    if p.verdict == "fits":
      return f"{change} fits ({gib:.2f} GiB/device; found by compiling)", tried
  return None, tried


def plan_run(
  cfg,
  target: Target,
  model_config=None,
  *,
  model_name: str | None = None,
  programs: tuple[str, ...] | None = None,
  fix: bool = True,
  log: Callable[[str], None] | None = print,
) -> RunPlan:
  """Compile the programs of run ``cfg`` for ``target`` from abstract inputs; a :class:`RunPlan`.

  Args:
    cfg: a ``jaxgrpo.run.specs.TrainerConfig`` (``scripts/train.py``'s config).
    target: ``jaxgrpo.plan.targets.parse_target(...)``; a GPU target returns :func:`estimate_gpu`'s plan.
    model_config: the model's ``jaxgrpo.models`` config (``jaxgrpo.plan.shapes.model_config``); None: ``cfg.model``'s.
    programs: a subset of the run's programs to compile (default: every one, the step and the sampler first).
    fix: search the smallest change for a program that does not fit (an accelerator target only).
  """
  log = log or (lambda s: None)
  if model_config is None:
    model_config = _config_of(cfg.model)
  name = model_name or (cfg.model.path or "synthetic")
  if target.kind == "estimate":
    return estimate_gpu(cfg, target, model_config, name)
  devices = target_devices(target)
  # as the run splits them: devices.teacher's last, then devices.rollout's, the train mesh over the rest (no
  # devices.mesh: FSDP over every one of them)
  mesh, rollout_mesh = async_rollout.make_meshes(cfg.devices, devices)
  meshes = dict(rollout_mesh=rollout_mesh, teacher_mesh=async_rollout.make_teacher_mesh(cfg.devices, devices))
  t0 = time.perf_counter()
  progs = RunPrograms(cfg, model_config, mesh, **meshes)
  own = _own_meshes(progs)
  log(
    f"{target.describe()}; mesh {dict(mesh.shape)}{own}; abstract model and state built in "
    f"{time.perf_counter() - t0:.1f} s"
  )
  out = []
  for p in programs or progs.names:
    if p not in progs.names:
      raise ValueError(f"program {p!r} is not one this run executes ({', '.join(progs.names)})")
    plan = compile_program(progs, p, target)
    log(f"  {p}: {plan.verdict} in {plan.compile_s:.1f} s" + (f" ({plan.error})" if plan.error else _breakdown(plan)))
    if plan.verdict == "does not fit" and fix and target.fit_test:
      plan.fix, plan.tried = find_fix(cfg, model_config, mesh, p, target, log, **meshes)
      plan.searched = True
      if plan.fix is None and p == "sampler":
        plan.hint = sampler_hint(cfg, model_config, progs.mesh_of(p), flag=_mesh_flag(rollout_mesh is not None))
    out.append(plan)
  notes = _notes(target)
  own_meshes = {p: dict(progs.mesh_of(p).shape) for p in ("sampler", "teacher") if progs.mesh_of(p) is not mesh}
  return RunPlan(target, name, dataclasses.asdict(progs.shape), dict(mesh.shape), out, notes, own_meshes)


def _mesh_flag(own: bool) -> str:
  return "--devices.rollout_mesh" if own else "--devices.mesh"


def _own_meshes(progs: RunPrograms) -> str:
  """``; sampler on its own N devices {axes}`` for each program on devices of its own (``devices.rollout`` /
  ``devices.teacher``), else ``""``."""
  return "".join(
    f"; {p} on its own {progs.mesh_of(p).devices.size} devices {dict(progs.mesh_of(p).shape)}"
    for p in ("sampler", "teacher")
    if progs.mesh_of(p) is not progs.mesh
  )


def _config_of(spec):
  """The config of ``model``: its directory's ``config.json``, or the named shape of a hub id (``Qwen/Qwen3-8B``) so
  that a pod config plans without the checkpoint on this machine."""
  if spec.path is not None and not os.path.exists(spec.path):
    try:
      return shapes.model_config(spec.path)
    except ValueError:
      pass
  return builders.model_config(spec)


def _notes(target: Target) -> list[str]:
  notes = []
  if target.chip is not None:
    c = target.chip
    notes.append(
      f"chip: {c.name}, HBM {c.hbm_bytes / GiB:.2f} GiB, dense bf16 peak {c.peak_flops / 1e12:.0f} TFLOP/s, HBM "
      f"{c.hbm_bw / 1e12:.3f} TB/s (datasheet: {c.source})"
    )
  if target.platform == "cpu":
    notes.append(
      "XLA:CPU: only the argument, output and alias bytes are meaningful; the temporaries are the CPU compiler's "
      "(1.2-1.4x the TPU's in a trial): this is not a fit test"
    )
  notes.append(
    "FLOPs: analytic model FLOPs (jaxgrpo.plan.flops; no recomputation counted), not cost_analysis(); roofline = "
    "max(FLOPs per device / peak, bytes per device / HBM bandwidth); bytes: a step's or log-prob pass's arguments + "
    "outputs, the sampler's weights read per decode step + KV cache"
  )
  notes.append("total = arguments + outputs - aliased + temporaries + code + the run's other long-lived arrays")
  return notes


def estimate_gpu(cfg, target: Target, model_config, name: str) -> RunPlan:
  """A GPU target's plan by formula (nothing compiled; every row ``estimated``), per device with FSDP over all
  ``target.devices_total`` GPUs: the train state (parameters and AdamW's two moments in ``param_dtype``, plus a
  gradient accumulator) / devices; the reference copy (β > 0); activations of one micro-batch with the model's
  remat (full: each layer's input, ``L·R·S·D`` in ``dtype``; otherwise ~``14·L·R·S·D``) plus one layer's
  attention scores ``R·H·S²`` float32 (the attention materialises them) and a logits chunk ``R·chunk·V`` float32
  (``step.head_logits: keep``: every chunk's, ``R·T·V``);
  the sampler: the weights in ``dtype`` (all of them: FSDP gathers each layer), its KV cache and ``B·V`` logits;
  a distillation teacher (``objective.distill``): :func:`_gpu_teacher`, its weights resident beside both.
  ``devices.rollout`` / ``devices.teacher`` (:func:`_gpu_split`): the sampler and the teacher over their own GPUs
  (their weights only there), the step over the rest."""
  s, mc, tc = run_shape(cfg), model_config, cfg.train_config()
  n, n_roll, n_teacher = _gpu_split(cfg.devices, target.devices_total)
  pb, cb = np.dtype(DTYPES[cfg.model.param_dtype]).itemsize, np.dtype(DTYPES[cfg.model.dtype]).itemsize
  n_params = _param_count(mc)
  param_bytes = n_params * pb / n  # one copy of the parameters, sharded
  state = 3 * param_bytes  # parameters and AdamW's two moments: the step's arguments, donated (aliased) outputs
  ref = param_bytes if cfg.objective.beta > 0 else 0
  rows = s.rows / n / tc.mini_batches / tc.micro_batches
  seq = s.prompt_len + s.completion_len
  per_layer = (1 if str(cfg.model.remat) in ("full", "True") else 14) * rows * seq * mc.hidden_size * cb
  scores = rows * mc.num_heads * seq * seq * 4
  held = s.completion_len if tc.head_logits == "keep" else (tc.chunk_size or seq)  # keep: all chunks until backward
  logits = rows * held * mc.vocab_size * 4
  acts = mc.num_layers * per_layer + scores + logits + param_bytes  # + the gradient accumulator
  step = ProgramPlan("step", tc.micro_batches, other_resident_bytes=int(ref), verdict="estimated")
  step.argument_bytes = step.output_bytes = step.alias_bytes = int(state)
  step.temp_bytes, step.code_bytes = int(acts), 0
  ns = n_roll or n  # the sampler's GPUs
  kv = s.rows / ns * (s.prompt_len + s.new_tokens) * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * cb
  beside = 0 if n_roll else int(2 * param_bytes + ref)  # the moments and the reference, on the train GPUs only
  samp = ProgramPlan("sampler", tc.micro_batches, other_resident_bytes=beside)
  samp.argument_bytes, samp.output_bytes, samp.alias_bytes = int(n_params * pb / ns), 0, 0
  samp.temp_bytes = int(n_params * cb + kv + s.rows / ns * mc.vocab_size * 4)
  samp.code_bytes, samp.verdict = 0, "estimated"
  passes = getattr(cfg.objective, "num_iterations", 1) or 1
  step.flops = fl.step_flops(mc, s.rows, s.prompt_len, s.completion_len, passes)
  samp.flops = fl.sampler_flops(mc, s.prompts, s.group, s.prompt_len, s.new_tokens)
  chip = target.chip
  step.roofline_s = max(step.flops / n / chip.peak_flops, 2 * state / chip.hbm_bw)
  mem = fl.decode_hbm_bytes(mc, fl.active_matmul_params(mc) * cb, s.rows / ns, s.prompt_len, s.new_tokens, cb)
  samp.roofline_s = max(samp.flops / ns / chip.peak_flops, mem / chip.hbm_bw)
  programs = [step, samp]
  nt = n_teacher or n
  t_rows = s.rows / nt / tc.mini_batches / tc.micro_batches
  teacher = _gpu_teacher(cfg, target, t_rows, seq, nt, other=0 if n_teacher else int(state + ref))
  if teacher is not None and not n_teacher:  # its weights resident beside every program, as the run keeps them
    step.other_resident_bytes += teacher.argument_bytes
    if not n_roll:
      samp.other_resident_bytes += teacher.argument_bytes
  if teacher is not None:
    programs.append(teacher)
  for p in programs:
    if p.total_bytes > chip.hbm_bytes:
      p.verdict = "estimated: does not fit"
  notes = _notes(target) + ["GPU: estimated by formula (jaxgrpo.plan.report.estimate_gpu), nothing compiled"]
  own = {p: {"fsdp": k} for p, k in (("sampler", n_roll), ("teacher", n_teacher if teacher else 0)) if k}
  return RunPlan(target, name, dataclasses.asdict(s), {"fsdp": n}, programs, notes, own)


def _gpu_split(devices_spec, total: int) -> tuple[int, int, int]:
  """``(train, rollout, teacher)`` GPU counts of ``total`` as the run splits them (``jaxgrpo.loop.async_rollout``):
  ``devices.teacher`` q and ``devices.rollout`` r set aside (0 when unset), the train mesh over ``devices.train`` or
  the rest. ValueError naming the fields when the train mesh would get none or they do not fit ``total``."""
  q, r = devices_spec.teacher or 0, devices_spec.rollout or 0
  t = devices_spec.train or total - q - r
  if t < 1 or t + r + q > total:
    raise ValueError(
      f"`devices.train`={devices_spec.train} + `devices.rollout`={devices_spec.rollout} + `devices.teacher`="
      f"{devices_spec.teacher} do not fit the target's {total} GPUs (each >= 1 where set, disjoint)"
    )
  return t, r, q


def _gpu_teacher(cfg, target: Target, rows: float, seq: int, n: int, *, other: int) -> ProgramPlan | None:
  """A distillation teacher's pass on a GPU target by formula (None without ``objective.distill.teacher``): its
  weights in ``param_dtype`` over its ``n`` GPUs (FSDP, as the run shards it; the argument), one micro-batch's forward
  working set of ``rows`` rows per GPU — one layer's ``14·R·S·D`` in ``dtype`` (nothing is kept for a backward), its
  attention scores ``R·H·S²`` float32 and a logits chunk ``R·chunk·V`` float32 (temporaries) — and the ``[R, T]``
  log-probs plus, for a top-k form, ``[R, T, k]`` ids and log-probs (outputs); ``other``: the policy's state and
  reference copy, resident meanwhile. FLOPs: the teacher's forward (``flops.forward_flops``)."""
  d = cfg.objective.distill
  if d is None or d.teacher is None or is_served_teacher(d.teacher):  # served outside the run: nothing resident here
    return None
  tmc, tc, s = teacher_config(d.teacher), cfg.train_config(), run_shape(cfg)
  pb, cb = np.dtype(DTYPES[cfg.model.param_dtype]).itemsize, np.dtype(DTYPES[cfg.model.dtype]).itemsize
  p = ProgramPlan("teacher", tc.micro_batches, other_resident_bytes=other, verdict="estimated")
  p.argument_bytes = int(_param_count(tmc) * pb / n)
  per_token = 4 + (0 if d.sampled else 8 * d.top_k)
  p.output_bytes, p.alias_bytes, p.code_bytes = int(s.rows / n * s.completion_len * per_token), 0, 0
  working = 14 * rows * seq * tmc.hidden_size * cb + rows * tmc.num_heads * seq * seq * 4
  p.temp_bytes = int(working + rows * (tc.chunk_size or seq) * tmc.vocab_size * 4)
  p.flops = fl.forward_flops(tmc, s.rows, s.prompt_len, s.completion_len)
  p.roofline_s = max(p.flops / n / target.chip.peak_flops, p.argument_bytes / target.chip.hbm_bw)
  return p


def _param_count(mc) -> int:
  """Every parameter of the model: the matmul weights of all experts, embeddings and head (norms left out)."""
  d, h, k, kv = mc.hidden_size, mc.num_heads, mc.head_dim, mc.num_kv_heads
  total = mc.vocab_size * d * (1 if mc.tie_word_embeddings else 2)
  for i in range(mc.num_layers):
    total += 2 * d * h * k + 2 * d * kv * k
    if hasattr(mc, "num_experts") and mc.is_moe_layer(i):
      total += 3 * d * mc.moe_intermediate_size * mc.num_experts + d * mc.num_experts
    else:
      total += 3 * d * mc.intermediate_size
  return total


def _gib(x) -> str:
  """Bytes in GiB (two decimals), or in MiB / KiB below 0.01 GiB."""
  if x is None:
    return "-"
  if abs(x) >= GiB / 100 or x == 0:
    return f"{x / GiB:.2f}"
  return f"{x / 2**20:.2f} MiB" if abs(x) >= 2**20 / 100 else f"{x / 1024:.1f} KiB"


def format_table(plan: RunPlan) -> str:
  """The plan as a Markdown table, the chip and notes under it, and the fix of each program that does not fit."""
  t = plan.target
  hbm = "-" if t.chip is None else f"{t.chip.hbm_bytes / GiB:.2f}"
  s = plan.shape
  head = [
    f"plan: {plan.model} on {t.describe()}; mesh {plan.mesh}"
    + "".join(f"; {p} on its own mesh {axes}" for p, axes in plan.own_meshes.items())
    + f"; {s['prompts']} prompts x G {s['group']} = "
    f"{s['prompts'] * s['group']} rows, prompt {s['prompt_len']} + {s['new_tokens']} new tokens (completion "
    f"bucket {s['completion_len']})",
    "",
    "| program | micro-batches | arguments | outputs | aliased | temporaries | code | other resident | total GiB/device "
    "| HBM GiB | TFLOPs (analytic) | roofline s | collectives | compile s | verdict |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  rows = []
  for p in plan.programs:
    coll = ", ".join(f"{k} {v}" for k, v in p.collectives.items()) or "-"
    tf = "-" if p.flops is None else f"{p.flops / 1e12:.1f}"
    roof = "-" if p.roofline_s is None else f"{p.roofline_s:.3g}"
    comp = "-" if p.compile_s is None else f"{p.compile_s:.1f}"
    rows.append(
      f"| {p.name} | {p.micro_batches} | {_gib(p.argument_bytes)} | {_gib(p.output_bytes)} | {_gib(p.alias_bytes)} | "
      f"{_gib(p.temp_bytes)} | {_gib(p.code_bytes)} | {_gib(p.other_resident_bytes)} | {_gib(p.total_bytes)} | {hbm} "
      f"| {tf} | {roof} | {coll} | {comp} | {p.verdict} |"
    )
  tail = [""] + [f"note: {n}" for n in plan.notes]
  for p in plan.programs:
    if p.error:
      tail.append(f"{p.name}: {p.error}")
    if p.verdict == "does not fit":
      tail.append(f"{p.name}: fix: {p.fix or _no_fix(p)}")
  return "\n".join(head + rows + tail)
