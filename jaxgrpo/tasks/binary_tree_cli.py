"""λ-GRPO's binary-tree task (Table 1), every algorithm, many seeds, on the CPU in minutes.

The command line of ``scripts/binary_tree.py`` (also ``python -m jaxgrpo.tasks.binary_tree_cli``)::

    python scripts/binary_tree.py                       # transformer policy, 20 seeds, the paper's 6 cells
    python scripts/binary_tree.py --policy tabular --optimizer sgd --lr 1.0
    python scripts/binary_tree.py --seeds 5 --steps 100 --algorithms grpo,lambda_grpo --out /tmp/bt
    python scripts/binary_tree.py --algorithms grpo --grid beta=0,0.01,0.04   # a vmapped β grid

Writes ``OUT/results.json`` (per-seed target frequencies, means, 95% CIs), ``OUT/table.md`` (the
paper's Table 1 beside ours), ``OUT/curves.png`` (P(target) vs step) and ``OUT/curves.npz``
(every per-step metric, ``[cells, seeds, steps]`` per algorithm), and prints the table.

One jitted function per algorithm trains every (cell, seed) at once (``lax.scan`` over steps, ``vmap``
over cells and seeds); see ``jaxgrpo.tasks.binary_tree``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo.tasks import binary_tree as bt
from jaxgrpo.tasks import script_io

__all__ = [
  "main",
  "build_parser",
  "resolve",
  "run",
  "summarize",
  "table_md",
  "plot",
  "parse_cells",
  "parse_grid",
  "label",
  "FlagError",
]

ALGO_LABELS = {
  "grpo": "GRPO",
  "lambda_grpo": "λ-GRPO",
  "frpo": "FRPO",
  "lambda_frpo": "λ-FRPO",
  "dr_grpo": "Dr.GRPO",
  "gspo": "GSPO",
  "gspo_token": "GSPO-token",
  "cispo": "CISPO",
  "sapo": "SAPO",
  "gmpo": "GMPO",
}
#: Defaults per policy, chosen by the study in docs/binary_tree.md (optimizer, learning rate).
#: gpt2-small's (Adam 1e-5) is the paper's, for a pretrained model: from random init it does not learn the
#: task in 250 steps (H200 run, docs/binary_tree.md).
POLICY_DEFAULTS = {"gpt2": ("sgd", 0.02), "gpt2-small": ("adam", 1e-5), "tabular": ("sgd", 1.0)}
EARLY_STEPS = 20
DEFAULT_ALGORITHMS = "grpo,lambda_grpo,frpo,lambda_frpo"


class FlagError(Exception):
  pass


def parse_cells(text: str) -> list[tuple[int, float]]:
  cells = []
  for item in text.split(","):
    try:
      n, r = item.split(":")
      cells.append((int(n), float(r)))
    except ValueError:
      raise FlagError(f"--cells must look like '1:-0.5,2:-1.0' (n:r_neg pairs); got {text!r}") from None
  return cells


class _DefaultsOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Appends ``(default: X)`` only to a help text that does not already say its default, and not for an
  on/off flag or a default of None (nothing to say)."""

  def _get_help_string(self, action):
    text = action.help or ""
    if "default" in text or action.default is None or action.default is False:
      return text
    return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="binary_tree.py", description=__doc__.split("\n\n")[0], formatter_class=_DefaultsOnceFormatter
  )
  p.add_argument("--seeds", type=int, default=20, help="seeds per cell")
  p.add_argument("--seed-offset", type=int, default=0, help="first seed")
  p.add_argument("--steps", type=int, default=250, help="training steps (one group per step)")
  p.add_argument("--group-size", type=int, default=16, help="G, trajectories per group")
  p.add_argument("--policy", default="gpt2", help=f"one of {', '.join(bt.POLICIES)}")
  p.add_argument("--optimizer", default=None, help="adam or sgd (default: per policy, see POLICY_DEFAULTS)")
  p.add_argument("--lr", type=float, default=None, help="learning rate (default: per policy)")
  p.add_argument("--algorithms", default=DEFAULT_ALGORITHMS, help=f"comma list of {', '.join(bt.ALGORITHMS)}")
  p.add_argument("--cells", default=",".join(f"{n}:{r}" for n, r in bt.PAPER_CELLS), help="comma list of n:r_neg cells")
  p.add_argument("--depth", type=int, default=4, help="tree depth: actions per trajectory (leaves = 2^depth)")
  p.add_argument("--target", default=None, help="target path (default LLRL, cut/extended to --depth)")
  p.add_argument(
    "--other-reward",
    type=float,
    default=0.7,
    help="reward of a path off the target's n-prefix (the cells set the reward on it)",
  )
  p.add_argument("--window", type=int, default=50, help="target frequency over the last WINDOW steps")
  p.add_argument("--hidden-size", type=int, default=None, help="transformer width (policy default)")
  p.add_argument("--layers", type=int, default=None, help="transformer layers (policy default)")
  p.add_argument("--heads", type=int, default=None, help="transformer heads (policy default)")
  p.add_argument("--out", default="runs/binary_tree", help="output directory")
  p.add_argument("--no-plot", action="store_true", help="skip curves.png")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  p.add_argument(
    "--grid",
    default=None,
    help=f"NAME=v1,v2,...: a vmapped grid over one of {', '.join(bt.GRID_FIELDS)} (traced; one compilation); "
    "each (algorithm, value) is a row of the table, e.g. 'grpo@beta=0.01'",
  )
  return p


def parse_grid(text: str | None) -> dict | None:
  """``"beta=0,0.01"`` -> ``{"beta": (0.0, 0.01)}`` (None stays None)."""
  if text is None:
    return None
  name, _, values = text.partition("=")
  try:
    grid = {name.strip(): tuple(float(v) for v in values.split(","))}
    return bt.check_grid(grid)
  except ValueError as e:
    raise FlagError(f"--grid must look like 'beta=0,0.01,0.04' (one of {', '.join(bt.GRID_FIELDS)}): {e}") from None


def label(algorithm: str, grid: dict | None, h: int) -> str:
  """The row of ``algorithm`` at grid value ``h``: ``"grpo"`` without a grid, ``"grpo@beta=0.01"`` with."""
  if grid is None:
    return algorithm
  return algorithm + "@" + ",".join(f"{n}={v[h]:g}" for n, v in grid.items())


def _name(label: str) -> str:
  """The algorithm of a row label (``"grpo@beta=0.01"`` -> ``"grpo"``)."""
  return label.partition("@")[0]


def _display(label: str) -> str:
  algo, _, suffix = label.partition("@")
  return ALGO_LABELS[algo] + (f" [{suffix}]" if suffix else "")


def resolve(args) -> dict:
  """Validate the flags; return the run's configuration (raises FlagError with a one-line message)."""
  if args.seeds < 1:
    raise FlagError(f"--seeds must be >= 1; got {args.seeds}")
  if args.steps < 1:
    raise FlagError(f"--steps must be >= 1; got {args.steps}")
  if args.group_size < 2:
    raise FlagError(f"group size must be >= 2 (GRPO needs a group); got --group-size {args.group_size}")
  if args.window < 1:
    raise FlagError(f"--window must be >= 1; got {args.window}")
  if args.policy not in bt.POLICIES:
    raise FlagError(f"unknown policy {args.policy!r}; expected one of {', '.join(bt.POLICIES)}")
  algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
  bad = [a for a in algorithms if a not in bt.ALGORITHMS]
  if bad or not algorithms:
    raise FlagError(f"unknown algorithm {', '.join(bad) or '(none)'}; expected some of {', '.join(bt.ALGORITHMS)}")
  cells = parse_cells(args.cells)
  if args.target is None:
    args.target = ("LLRL" * args.depth)[: args.depth]
  optimizer, lr = POLICY_DEFAULTS[args.policy]
  optimizer = args.optimizer or optimizer
  lr = args.lr if args.lr is not None else lr
  if optimizer not in bt.OPTIMIZERS:
    raise FlagError(f"unknown optimizer {optimizer!r}; expected one of {', '.join(bt.OPTIMIZERS)}")
  if not lr > 0:
    raise FlagError(f"--lr must be > 0; got {lr}")
  overrides = {}
  if args.policy != "tabular":
    for flag, field in (("hidden_size", "hidden_size"), ("layers", "num_layers"), ("heads", "num_heads")):
      if getattr(args, flag) is not None:
        overrides[field] = getattr(args, flag)
  try:
    for n, r in cells:
      bt.TreeTask(depth=args.depth, target=args.target, prefix_len=n, neg_reward=r, other_reward=args.other_reward)
    policy = bt.make_policy(args.policy, args.depth, **overrides)
    if args.policy != "tabular":
      _ = policy.model_config  # validates width/heads
  except (ValueError, TypeError) as e:
    raise FlagError(str(e).splitlines()[0]) from None
  grid = parse_grid(args.grid)
  if grid is not None:
    for a in algorithms:  # the structure the grid needs (e.g. a dual clip) must be valid for each preset
      try:
        bt.switch_on(bt.preset(a), grid)
      except (ValueError, TypeError) as e:
        raise FlagError(f"--grid with {a}: {str(e).splitlines()[0]}") from None
  h = 1 if grid is None else len(next(iter(grid.values())))
  return dict(
    grid=grid,
    labels=[label(a, grid, i) for a in algorithms for i in range(h)],
    policy=policy,
    policy_name=args.policy,
    optimizer=optimizer,
    lr=lr,
    algorithms=algorithms,
    cells=cells,
    seeds=list(range(args.seed_offset, args.seed_offset + args.seeds)),
  )


def run(args, cfg) -> dict:
  policy, cells, seeds = cfg["policy"], cfg["cells"], cfg["seeds"]
  tasks = [
    bt.TreeTask(depth=args.depth, target=args.target, prefix_len=n, neg_reward=r, other_reward=args.other_reward)
    for n, r in cells
  ]
  rewards = jnp.asarray(np.stack([t.rewards() for t in tasks]))
  seeds_arr = jnp.asarray(np.asarray(seeds, np.int32))
  bar = None
  if not args.quiet:
    bar = script_io.step_bar(
      args.steps, f"binary tree ({len(cfg['algorithms'])} algorithms × {len(cells)} cells × {len(seeds)} seeds)"
    )

  def progress(_):
    bar.update(1)

  # One compilation for every algorithm (see make_sweep): outputs are [A, C, S, steps].
  sweep = bt.make_sweep(
    cfg["algorithms"],
    policy,
    bt.make_optimizer(cfg["optimizer"], cfg["lr"]),
    depth=args.depth,
    target_leaf=tasks[0].target_leaf,
    group_size=args.group_size,
    steps=args.steps,
    progress=progress if bar is not None else None,
    grid=cfg["grid"],
  )
  if bar is not None:
    bar.set_postfix_str("compiling")
  t0 = time.perf_counter()
  compiled = sweep.lower(seeds_arr, rewards).compile()
  t1 = time.perf_counter()
  if bar is not None:  # the ETA counts the steps from here: the compile above is not a step
    script_io.start_clock(bar)
    bar.set_postfix_str("training")
  out = jax.block_until_ready(compiled(seeds_arr, rewards))
  out = jax.device_get(out)
  t2 = time.perf_counter()
  if bar is not None:
    bar.close()
  grid = cfg["grid"]
  curves = {}
  for i, a in enumerate(cfg["algorithms"]):
    for h in range(1 if grid is None else len(next(iter(grid.values())))):
      curves[label(a, grid, h)] = {k: np.asarray(v[i] if grid is None else v[i, h]) for k, v in out.items()}
  return dict(curves=curves, timing={"compile_s": round(t1 - t0, 2), "run_s": round(t2 - t1, 2)})


def summarize(args, cfg, res) -> dict:
  w = min(args.window, args.steps)
  cells_out = []
  for c, (n, r) in enumerate(cfg["cells"]):
    for algo in cfg["labels"]:
      tf = res["curves"][algo]["target_freq"][c]  # [S, steps]
      per_seed = tf[:, -w:].mean(-1)
      mean, (lo, hi) = bt.summarize_cell(per_seed)
      early = tf[:, : min(EARLY_STEPS, args.steps)]  # [S, early]
      cells_out.append(
        {
          "prefix_len": n,
          "neg_reward": r,
          "algorithm": algo,
          "target_freq": [round(float(x), 5) for x in per_seed],
          "mean": round(mean, 5),
          "ci95": [round(lo, 5), round(hi, 5)],
          "frac_seeds_below_0.1": round(float(np.mean(per_seed < 0.1)), 4),
          "early_target_freq": round(float(early.mean()), 5),
          "frac_seeds_sampling_target_early": round(float(np.mean(early.max(-1) > 0)), 4),
          "peak_target_prob": round(float(res["curves"][algo]["target_prob"][c].max(-1).mean()), 5),
        }
      )
  p = cfg["policy"]
  policy_cfg = {k: getattr(p, k) for k in getattr(p, "__dataclass_fields__", {})}
  if cfg["policy_name"] != "tabular":
    policy_cfg["num_params"] = p.num_params()
  total_run, total_compile = res["timing"]["run_s"], res["timing"]["compile_s"]
  config = {
    "policy": cfg["policy_name"],
    "policy_config": policy_cfg,
    "optimizer": cfg["optimizer"],
    "lr": cfg["lr"],
    "algorithms": cfg["labels"],
    "cells": [list(c) for c in cfg["cells"]],
    "seeds": cfg["seeds"],
    "steps": args.steps,
    "group_size": args.group_size,
    "depth": args.depth,
    "target": args.target,
    "other_reward": args.other_reward,
    "window": w,
    "temperature": 1.0,
    "updates_per_batch": 1,
    "compile_s": total_compile,
    "run_s": total_run,
    "runs": len(cfg["labels"]) * len(cfg["cells"]) * len(cfg["seeds"]),
    "run_ms_per_step": round(1e3 * total_run / args.steps, 3),
  }
  config["backend"] = jax.default_backend()
  if cfg["grid"] is not None:
    config["grid"] = {n: list(v) for n, v in cfg["grid"].items()}
  return {"config": config, "cells": cells_out}


def fmt(cell) -> str:
  lo, hi = cell["ci95"]
  return f"{cell['mean']:.3f} [{lo:.2f}, {hi:.2f}]"


def table_md(summary) -> str:
  cfg = summary["config"]
  algos = cfg["algorithms"]
  by = {(c["prefix_len"], c["neg_reward"], c["algorithm"]): c for c in summary["cells"]}
  cells = [tuple(c) for c in cfg["cells"]]
  head = ["n", "r_neg"]
  show_paper = all(c in bt.PAPER_TABLE1 for c in cells) and cfg["depth"] == 4 and "grid" not in cfg
  for a in algos:
    if show_paper and a in ("grpo", "lambda_grpo"):
      head.append(f"{ALGO_LABELS[a]} (paper)")
    head.append(f"{_display(a)} (ours)")
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for n, r in cells:
    row = [str(n), f"{r:g}"]
    for a in algos:
      if show_paper and a in ("grpo", "lambda_grpo"):
        row.append(f"{bt.PAPER_TABLE1[(n, r)][a == 'lambda_grpo']:.4f}")
      row.append(fmt(by[(n, r, a)]))
    lines.append("| " + " | ".join(row) + " |")
  pc = cfg["policy_config"]
  size = (
    f", D={pc['hidden_size']}, {pc['num_layers']} layers, {pc['num_heads']} heads, {pc['num_params']:,} params"
    if cfg["policy"] != "tabular"
    else ""
  )
  seeds = cfg["seeds"]
  lines += [
    "",
    f"Target frequency over the last {cfg['window']} of {cfg['steps']} steps: mean over "
    f"{len(seeds)} seeds ({seeds[0]}–{seeds[-1]}) [Student-t 95% CI]. Policy {cfg['policy']}{size}; "
    f"{cfg['optimizer']} lr {cfg['lr']:g}; group size {cfg['group_size']}; target {cfg['target']}. "
    "Paper: GPT-2-small (pretrained), lr 1e-5, 5 seeds.",
  ]
  if "grpo" in algos and "lambda_grpo" in algos:
    wins = sep = 0
    for n, r in cells:
      g, l = by[(n, r, "grpo")], by[(n, r, "lambda_grpo")]
      wins += l["mean"] > g["mean"]
      sep += l["ci95"][0] > g["ci95"][1]
    lines.append(f"λ-GRPO above GRPO in {wins}/{len(cells)} cells; 95% CIs disjoint in {sep}/{len(cells)}.")
  return "\n".join(lines) + "\n"


def plot(summary, res, path):
  """P(target) vs step per cell (mean over seeds, 95% CI band) → ``path`` (needs matplotlib)."""
  try:
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
  except ImportError as e:
    raise ImportError("curves.png needs matplotlib: pip install 'jaxgrpo[plot]' (or pass --no-plot)") from e

  cfg = summary["config"]
  cells = [tuple(c) for c in cfg["cells"]]
  ns = sorted({n for n, _ in cells})
  rs = sorted({r for _, r in cells}, reverse=True)
  fig = Figure(figsize=(3.6 * len(rs), 2.8 * len(ns)))
  axes = fig.subplots(len(ns), len(rs), squeeze=False, sharex=True, sharey=True)
  steps = np.arange(1, cfg["steps"] + 1)
  colors = {"grpo": "C3", "lambda_grpo": "C0", "frpo": "C1", "lambda_frpo": "C2", "dr_grpo": "C4", "gspo": "C5"}
  colors.update(gspo_token="C6", cispo="C7", sapo="C8", gmpo="C9")
  for ax in axes.flat:
    ax.set_visible(False)
  for c, (n, r) in enumerate(cells):
    ax = axes[ns.index(n), rs.index(r)]
    ax.set_visible(True)
    for a in cfg["algorithms"]:
      y = res["curves"][a]["target_prob"][c]  # [S, steps]
      m = y.mean(0)
      half = (
        bt.t_quantile_975(y.shape[0] - 1) * y.std(0, ddof=1) / np.sqrt(y.shape[0])
        if y.shape[0] > 1
        else np.zeros_like(m)
      )
      color = colors.get(a)  # one color per algorithm without a grid; matplotlib's cycle with one
      ax.plot(steps, m, color=color, label=_display(a), lw=1.5, ls="--" if "frpo" in _name(a) else "-")
      ax.fill_between(steps, np.clip(m - half, 0, 1), np.clip(m + half, 0, 1), color=color, alpha=0.18, lw=0)
    ax.set_title(f"n={n}, r_neg={r:g}", fontsize=10)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
  for ax in axes[-1]:
    ax.set_xlabel("step")
  for ax in axes[:, 0]:
    ax.set_ylabel("P(target)")
  handles, labels = next(ax for ax in axes.flat if ax.get_visible()).get_legend_handles_labels()
  fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False)
  fig.suptitle(
    f"{cfg['policy']}, {cfg['optimizer']} lr {cfg['lr']:g}, {len(cfg['seeds'])} seeds (mean, 95% CI band)",
    y=0.005,
    va="bottom",
    fontsize=9,
  )
  fig.tight_layout(rect=(0, 0.03, 1, 0.93))
  fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
  """Run the sweep of ``argv`` (default ``sys.argv[1:]``); returns the ``results.json`` dict.

  Bad flags exit with status 2 and a one-line message (no traceback)."""
  args = build_parser().parse_args(argv)
  try:
    cfg = resolve(args)
  except FlagError as e:
    print(f"binary_tree.py: error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  res = run(args, cfg)
  summary = summarize(args, cfg, res)
  summary["config"]["wall_s"] = round(time.perf_counter() - t0, 2)
  (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
  np.savez_compressed(out / "curves.npz", **{f"{a}/{k}": v for a, d in res["curves"].items() for k, v in d.items()})
  table = table_md(summary)
  (out / "table.md").write_text(table)
  if not args.no_plot:
    plot(summary, res, out / "curves.png")
  print(table)
  c = summary["config"]
  print(
    f"wall {c['wall_s']:.1f}s (compile {c['compile_s']:.1f}s, run {c['run_s']:.1f}s = "
    f"{c['run_ms_per_step']:.1f} ms per training step of all {c['runs']} runs at once); "
    f"wrote {out}/results.json, table.md, curves.npz" + ("" if args.no_plot else ", curves.png")
  )
  return summary


if __name__ == "__main__":
  main()
