"""Speed and memory of jaxgrpo vs Tunix vs TRL on the same model, prompts and settings.

    python scripts/peers/bench_peers.py --rounds 3            # after scripts/peers/setup_envs.sh
    PEERS_SMOKE=1 python scripts/peers/bench_peers.py --rounds 1   # seconds-scale check of the plumbing

Each measurement is its own process (so its peak resident memory, `ru_maxrss`, is its own):
`worker_jaxgrpo.py` in this environment, `worker_tunix.py` in `.peers/tunix`, `worker_trl.py` in
`.peers/trl`. Per round every implementation runs each task once, in an order rotated from round
to round (alternation: machine noise hits all alike); each process does its warm-up (compile)
first, then `--repeats` timed repetitions. Medians over all timed repetitions are reported.

Tasks (workload: the saved random Qwen3 of 20.5M parameters, 16 prompts × 32 tokens, 8 samples
each, 128 new tokens, temperature 1.0, no EOS stop):
  sample: rollout throughput, generated tokens per second;
  iter:   one full GRPO iteration (rollout + reward + reference pass + one AdamW update, β=0.04,
          micro-batches of 64 rows) per second; "train-step tokens/s" is completion tokens over
          the update part (measured for jaxgrpo; for the peers it is estimated as the iteration
          minus the same implementation's median sampler time).
Writes a markdown table (and the raw JSON lines next to it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
IMPLS = {
  "jaxgrpo": (sys.executable, "worker_jaxgrpo.py"),
  "tunix": (os.path.join(ROOT, ".peers/tunix/bin/python"), "worker_tunix.py"),
  "trl": (os.path.join(ROOT, ".peers/trl/bin/python"), "worker_trl.py"),
}


def run_one(impl, task, repeats, model_dir, timeout):
  py, script = IMPLS[impl]
  cmd = [py, os.path.join(HERE, script), model_dir, task, str(repeats)]
  load0 = os.getloadavg()[0]
  t0 = time.perf_counter()
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    out, err, rc = p.stdout, p.stderr, p.returncode
  except subprocess.TimeoutExpired as e:
    out, err, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout", -1
  wall = time.perf_counter() - t0
  res = None
  for line in out.splitlines():
    if line.startswith("RESULT "):
      res = json.loads(line[7:])
  if res is None:
    res = {"impl": impl, "task": task, "error": (err or out)[-2000:], "rc": rc}
  res.update(wall_s=wall, load_before=load0, load_after=os.getloadavg()[0])
  return res


def summarise(results):
  by = {}
  for r in results:
    if "times" in r and r["times"]:
      by.setdefault((r["impl"], r["task"]), []).append(r)
  s = {}
  for (impl, task), rs in by.items():
    times = [t for r in rs for t in r["times"]]
    med = statistics.median(times)
    entry = {
      "median_s": med,
      "times": times,
      "tokens": rs[0]["tokens"],
      "rss": max(r["peak_rss_gb"] for r in rs),
      "warmup_s": statistics.median(r["warmup_s"] for r in rs),
    }
    if "update_s" in rs[0]:
      entry["update_s"] = statistics.median(t for r in rs for t in r["update_s"])
      entry["rollout_s"] = statistics.median(t for r in rs for t in r["rollout_s"])
    s[(impl, task)] = entry
  for impl in IMPLS:
    it, sa = s.get((impl, "iter")), s.get((impl, "sample"))
    if it and "update_s" not in it and sa:
      it["update_s_est"] = max(it["median_s"] - sa["median_s"], 1e-9)
  return s


def table(s, loads):
  def get(impl, task, key):
    e = s.get((impl, task))
    return None if e is None else e.get(key)

  def fmt(x, f="{:.1f}"):
    return "—" if x is None else f.format(x)

  lines = [
    "| | jaxgrpo | Tunix | TRL | jaxgrpo / Tunix | jaxgrpo / TRL |",
    "| --- | ---: | ---: | ---: | ---: | ---: |",
  ]

  def row(name, vals, higher_better=True, f="{:.1f}"):
    o, t, h = vals
    r1 = None if o is None or t is None else (o / t)
    r2 = None if o is None or h is None else (o / h)
    lines.append(f"| {name} | {fmt(o, f)} | {fmt(t, f)} | {fmt(h, f)} | {fmt(r1, '{:.2f}×')} | {fmt(r2, '{:.2f}×')} |")

  tps = [
    None if get(i, "sample", "median_s") is None else get(i, "sample", "tokens") / get(i, "sample", "median_s")
    for i in IMPLS
  ]
  row("rollout tokens/s (median)", tps)
  row("sampler run, s (median)", [get(i, "sample", "median_s") for i in IMPLS], f="{:.1f}")
  row("sampler warm-up (compile), s", [get(i, "sample", "warmup_s") for i in IMPLS], f="{:.1f}")
  row("GRPO iteration, s (median)", [get(i, "iter", "median_s") for i in IMPLS], f="{:.1f}")
  row(
    "GRPO iterations/s",
    [None if get(i, "iter", "median_s") is None else 1 / get(i, "iter", "median_s") for i in IMPLS],
    f="{:.4f}",
  )
  upd = [get(i, "iter", "update_s") or get(i, "iter", "update_s_est") for i in IMPLS]
  row(
    "train-step tokens/s (update part)",
    [None if u is None else get(i, "iter", "tokens") / u for i, u in zip(IMPLS, upd)],
  )
  row("peak RSS, sampler process, GB", [get(i, "sample", "rss") for i in IMPLS], f="{:.2f}")
  row("peak RSS, iteration process, GB", [get(i, "iter", "rss") for i in IMPLS], f="{:.2f}")
  lines.append("")
  lines.append(
    "Ratios are jaxgrpo / peer: above 1 is better for jaxgrpo in the throughput rows, below 1 in the "
    "time and memory rows. Train-step tokens/s of Tunix and TRL is estimated as completion tokens / "
    "(iteration − median sampler run)."
  )
  lines.append(
    f"Load average (1 min) at the start of the runs: {min(loads):.1f}–{max(loads):.1f} on {os.cpu_count()} cores."
  )
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--repeats", type=int, default=1, help="timed repetitions per process")
  ap.add_argument("--tasks", default="sample,iter")
  ap.add_argument("--impls", default="jaxgrpo,tunix,trl")
  ap.add_argument("--model", default=os.path.join(ROOT, ".peers/model"))
  ap.add_argument("--timeout", type=float, default=3600)
  ap.add_argument("--out", default=os.path.join(ROOT, ".peers/out/peers_bench.md"))
  ap.add_argument(
    "--parallel",
    action="store_true",
    help="run the implementations of a task at the same time (on a machine shared with other "
    "jobs, they then see the same load; the first to finish frees CPU for the others)",
  )
  ap.add_argument("--summarise", nargs="*", metavar="JSONL", help="only tabulate earlier raw results")
  args = ap.parse_args(argv)
  impls = args.impls.split(",")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  raw = os.path.splitext(args.out)[0] + ".jsonl"
  results = []
  if args.summarise:
    for path in args.summarise:
      with open(path) as f:
        results += [json.loads(line) for line in f if line.strip()]
  for r in range(0 if args.summarise else args.rounds):
    order = impls[r % len(impls) :] + impls[: r % len(impls)]
    for task in args.tasks.split(","):
      if args.parallel:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(order)) as pool:
          batch = list(pool.map(lambda i, task=task: run_one(i, task, args.repeats, args.model, args.timeout), order))
      else:
        batch = (run_one(impl, task, args.repeats, args.model, args.timeout) for impl in order)
      for impl, res in zip(order, batch):
        res["round"], res["parallel"] = r, args.parallel
        results.append(res)
        with open(raw, "a") as f:
          f.write(json.dumps(res) + "\n")
        msg = (
          res.get("error", "")[-300:]
          if "error" in res
          else f"times {[round(t, 1) for t in res['times']]} s, warm-up {res['warmup_s']:.1f} s, RSS {res['peak_rss_gb']:.2f} GB"
        )
        print(f"[round {r}] {impl:8s} {task:6s} {msg} (load {res['load_before']:.1f})", flush=True)
  s = summarise(results)
  text = table(s, [r["load_before"] for r in results if "load_before" in r])
  print("\n" + text)
  with open(args.out, "w") as f:
    f.write(text + "\n")
  print(f"\nwrote {args.out} and {raw}")


if __name__ == "__main__":
  main()
