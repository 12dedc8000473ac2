"""The distillation demo's table and plot (docs/distillation.md, "The demo"): held-out accuracy (mean@4) of each run
at each evaluation, against steps and against training seconds (the sum of the steps' ``step_time`` in
``metrics.jsonl``: sampling, teacher, update; the warm-up and the evaluations, the same for every run, left out).

    python scripts/distill_demo_table.py --run "RL + distillation" runs/distill_demo --run "RL alone" runs/distill_rl \
      --plot docs/distillation_demo.png
"""

from __future__ import annotations

import argparse
import json
import os


def evaluations(run_dir: str) -> list[tuple[int, float, float]]:
  """``[(step, training seconds so far, eval_accuracy)]`` of one run directory's ``metrics.jsonl``."""
  seconds, out = 0.0, []
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      seconds += r.get("step_time", 0.0)
      if "eval_accuracy" in r:
        out.append((int(r["step"]), seconds, float(r["eval_accuracy"])))
  return out


def table(runs: dict[str, list]) -> str:
  """A Markdown table: one row per evaluation step, one column per run, ``accuracy (training s)``."""
  names = list(runs)
  rows = [f"| step | {' | '.join(names)} |", "|---|" + "---|" * len(names)]
  for i, (step, _, _) in enumerate(runs[names[0]]):
    cells = [f"{runs[n][i][2]:.3f} ({runs[n][i][1]:.0f} s)" if i < len(runs[n]) else "" for n in names]
    rows.append(f"| {step} | {' | '.join(cells)} |")
  return "\n".join(rows)


def plot(runs: dict[str, list], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
  for name, ev in runs.items():
    axes[0].plot([e[0] for e in ev], [e[2] for e in ev], "o-", label=name)
    axes[1].plot([e[1] for e in ev], [e[2] for e in ev], "o-", label=name)
  axes[0].set_xlabel("step")
  axes[1].set_xlabel("training seconds (sum of step_time)")
  for ax in axes:
    ax.set_ylabel("held-out accuracy (mean@4)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
    "--run", nargs=2, action="append", metavar=("NAME", "DIR"), required=True, help="a run and its directory"
  )
  p.add_argument("--plot", help="write the plot here (PNG)")
  args = p.parse_args(argv)
  runs = {name: evaluations(d) for name, d in args.run}
  print(table(runs))
  if args.plot:
    plot(runs, args.plot)


if __name__ == "__main__":
  main()
