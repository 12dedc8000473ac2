#!/usr/bin/env python
"""Fill docs/scale.md's "What fits where" table: run ``scripts/plan.py --json`` row by row, one compile at a time.

    python scripts/plan_table.py run                      # every row not saved yet, in priority order
    python scripts/plan_table.py run --only qwen3-8b      # the rows whose name contains a word
    python scripts/plan_table.py table                    # the Markdown rows of every saved plan

``run`` starts each row's program (the step, the sampler) as its own ``nice -n 10 python scripts/plan.py ...
--programs P --json`` process (sequentially: a TPU compile takes one core and minutes) and saves its JSON as
``runs/plan_table/<config>__<model>__<topology>__<program>.json`` and its log (the per-program lines and the fix
search) as ``.log``; a row whose JSON exists is skipped, so the command
resumes where it stopped. A row that runs past ``--timeout`` seconds is stopped and left unsaved (its log stays).
The child writes its JSON to ``<row>.json.part``: a runner stopped mid-compile leaves the child running, and the
next ``run`` adopts a finished ``.part`` instead of compiling the row again.
``table`` prints one Markdown row per saved plan: the step's and the sampler's GiB per chip (the step's
micro-batch count: the config's, or the one the fix search compiled), the analytic roofline and the compile
seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.get("PLAN_TABLE_OUT", os.path.join(ROOT, "runs", "plan_table"))
GiB = 2**30
TOPOLOGIES = ("v5e-16", "v5e-64", "v5e-256", "v5p-64", "v5p-128", "v6e-64", "v6e-256")
MODELS = ("qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "qwen3-1.7b", "qwen3-0.6b")  # the order rows are compiled in
EXTRA: dict[str, tuple[str, ...]] = {}  # per-model extra flags (none: every model scans its layers, the MoE too)


def rows() -> list[tuple[str, str, str, str]]:
  """``(config, model, topology, program)`` in priority order: the 8B at 1,024 new tokens; the 8B at 8,192 on three
  slices (first what the compiler says at one micro-batch, no fix search, then the most micro-batches); then the
  other models. Each program is its own process (a row that runs out of time loses one program)."""
  k8 = ("v5p-64", "v5p-128", "v6e-256")
  first = [("pod_grpo", "qwen3-8b", "v5p-128", "sampler")]
  first += [("pod_grpo_8k", "qwen3-8b", t, "step:no-fix") for t in k8]
  first += [("pod_grpo", "qwen3-8b", "v5e-256", "sampler")]  # 64 prompts over 256 chips: the sampler as the run has it
  first += [("pod_grpo", "qwen3-8b", "v6e-256", p) for p in ("step", "sampler")]
  first += [("pod_grpo_8k", "qwen3-8b", t, p) for p in ("step:most-micro-batches", "sampler") for t in k8]
  rest = [("pod_grpo", m, t) for m in MODELS[1:] for t in TOPOLOGIES] + [
    ("pod_grpo", "qwen3-8b", t) for t in TOPOLOGIES
  ]
  rest = sorted(rest, key=lambda r: r in DONE)  # the rows compiled before this script last
  rest = [r + (p,) for r in rest for p in ("step", "sampler")]
  rest = [r for r in rest if r not in first and r not in LOGGED] + sorted(LOGGED)
  return first + rest


#: compiled by this script's first version, whose row (step and sampler in one process) ran out of time after the
#: step: its numbers are in that log (docs/scale.md)
LOGGED = {("pod_grpo", "qwen3-8b", "v5p-128", "step")}
#: rows compiled by hand before this script (docs/scale.md has their numbers): run last
DONE = {("pod_grpo", "qwen3-8b", t) for t in ("v5e-16", "v5e-64", "v5e-256", "v5p-64", "v6e-64")} | {
  ("pod_grpo", "qwen3-32b", "v5p-128"),
  ("pod_grpo", "qwen3-1.7b", "v5e-16"),
  ("pod_grpo", "qwen3-0.6b", "v5e-16"),
}
#: the chips of each topology name (for the most micro-batches: one row per chip)
CHIPS = {"v5e-16": 16, "v5e-64": 64, "v5e-256": 256, "v5p-64": 32, "v5p-128": 64, "v6e-64": 64, "v6e-256": 256}


def row_name(config: str, model: str, topology: str, program: str) -> str:
  return f"{config}__{model}__{topology}__{program.replace(':', '_')}"


def _program_args(config: str, topology: str, program: str) -> tuple[str, ...]:
  """``step`` / ``sampler``; ``step:no-fix`` (what the compiler says at the config's micro-batches, no search);
  ``step:most-micro-batches`` (one row per chip: 512 rows / chips micro-batches, no search)."""
  name, _, variant = program.partition(":")
  args = ("--programs", name)
  if variant == "no-fix":
    args += ("--no-fix",)
  elif variant == "most-micro-batches":
    args += ("--no-fix", "--step.micro_batches", str(512 // CHIPS[topology]))
  return args


def command(config: str, model: str, topology: str, program: str | None = None) -> list[str]:
  """The row's ``scripts/plan.py`` command (the one docs/scale.md prints, with ``--json``)."""
  return [
    "scripts/plan.py",
    "--config",
    f"scripts/configs/{config}.yaml",
    "--model",
    model,
    "--topology",
    topology,
    *EXTRA.get(model, ()),
    *((*_program_args(config, topology, program), "--json") if program else ()),
  ]


def run(only: str | None, timeout: float, python: str) -> None:
  os.makedirs(OUT, exist_ok=True)
  env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  for row in rows():
    name = row_name(*row)
    path, part = (os.path.join(OUT, name + ext) for ext in (".json", ".json.part"))
    if (only and only not in name) or os.path.exists(path) or _adopt(part, path):
      continue
    cmd = ["nice", "-n", "10", python, *command(*row)]
    print(f"{time.strftime('%H:%M:%S')} {name}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    # the child writes its JSON to a file, not to a pipe: if this runner is stopped, the compile still finishes and
    # the next ``run`` adopts its result
    with open(os.path.join(OUT, name + ".log"), "w") as log, open(part, "w") as out:
      try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=log, timeout=timeout)
      except subprocess.TimeoutExpired:
        print(f"  stopped after {timeout:.0f} s (not saved)", flush=True)
        continue
    wall = time.time() - t0
    _adopt(part, path, wall_s=wall, exit=res.returncode)
    print(f"  exit {res.returncode} in {wall:.0f} s", flush=True)


def _adopt(part: str, path: str, **extra) -> bool:
  """Move a child's finished JSON (``part``) to ``path`` with ``extra`` fields added; False (nothing moved) when
  ``part`` is missing, empty or not a whole JSON object (the child was stopped or is still compiling)."""
  try:
    with open(part) as f:
      plan = json.load(f)
  except (OSError, ValueError):
    return False
  if not isinstance(plan, dict):
    return False
  plan.update(extra)
  with open(path, "w") as f:
    json.dump(plan, f, indent=1)
  os.remove(part)
  return True


def _gib(x) -> str:
  return "-" if x is None else f"{x / GiB:.2f}"


def _compiler(p: dict) -> str:
  """What the compiler said of a program that did not compile: ``XLA: HLO temporaries 269.65G of 95.74G``."""
  m = re.search(r"required for (.+?) \(([\d.]+\w?)\) exceeds available HBM \(([\d.]+\w?)\)", p.get("error") or "")
  return f"XLA: {m.group(1)} {m.group(2)} of {m.group(3)}" if m else (p.get("error") or "")[:120]


def _step_cell(p: dict) -> str:
  """``12.19 (1)``, the fix: ``9.18 (2; at 1: 17.15, does not fit)``, or the compiler's refusal."""
  if p["verdict"] == "fits":
    return f"{_gib(p['total_bytes'])} ({p['micro_batches']})"
  said = _gib(p["total_bytes"]) if p["total_bytes"] else _compiler(p)
  at = f"at {p['micro_batches']}: {said}, {p['verdict']}"
  good = next((t for t in p.get("tried", []) if t[1] == "fits"), None)
  if good is not None:
    return f"{good[2]:.2f} ({good[0].split()[-1]}; {at})"
  tried = ", ".join(t[0].split()[-1] for t in p.get("tried", []))
  return f"does not fit ({at}" + (f"; tried {tried}" if tried else "") + ")"


def _sampler_cell(p: dict | None) -> str:
  if p is None:
    return "not compiled yet"
  if p["verdict"] == "error":
    return f"does not compile: {p['error'][:120]}"
  if p["verdict"] == "fits":
    return _gib(p["total_bytes"])
  return f"{_gib(p['total_bytes']) if p['total_bytes'] else _compiler(p)}: {p['verdict']}"


def _load(row) -> dict | None:
  path = os.path.join(OUT, row_name(*row) + ".json")
  return json.load(open(path)) if os.path.exists(path) else None


def table() -> None:
  """One Markdown row per (config, model, topology) with a saved plan, in the order of :func:`rows`."""
  seen = []
  for row in rows():
    if row[:3] not in seen:
      seen.append(row[:3])
  for config, model, topo in seen:
    names = [r[3] for r in rows() if r[:3] == (config, model, topo)]
    plans = {p: _load((config, model, topo, p)) for p in names}
    if not any(plans.values()):
      continue
    steps = [(p, plans[p]["programs"][0], plans[p]["wall_s"]) for p in names if p.startswith("step") and plans[p]]
    samp = plans["sampler"]["programs"][0] if plans.get("sampler") else None
    chips = next(p for p in plans.values() if p)["target"]["chips"]
    cells = [_step_cell(st) for _, st, _ in steps] or ["not compiled yet"]
    comp = "; ".join(f"{st['compile_s']:.0f}" + (f" (fix search: {w:.0f} in all)" if st.get("searched") else "")
                     for _, st, w in steps) or "-"  # fmt: skip
    comp += f", {samp['compile_s']:.0f}" if samp and samp["compile_s"] is not None else ", -"
    step = next((st for _, st, _ in steps if st["roofline_s"] is not None), None)
    roof = "-" if step is None else f"{step['roofline_s']:.2f}"
    tok = "-" if step is None else f"{step['tokens_per_s_per_device']:,.0f}"
    cmd = "python " + " ".join(command(config, model, topo))
    print(
      f"| {model}{' (8k)' if config.endswith('8k') else ''} | {topo} | {chips} | {'; '.join(cells)} | "
      f"{_sampler_cell(samp)} | {roof} | {tok} | {comp} | `{cmd}` |"
    )


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("what", choices=("run", "table"))
  p.add_argument("--only", help="the rows whose name (config__model__topology) contains this")
  p.add_argument("--timeout", type=float, default=1800.0, help="seconds per row before it is stopped")
  p.add_argument("--python", default=os.path.join(ROOT, ".venv-tpu", "bin", "python"), help="the libtpu Python")
  args = p.parse_args(argv)
  if args.what == "run":
    run(args.only, args.timeout, args.python)
  else:
    table()
  return 0


if __name__ == "__main__":
  sys.exit(main())
