"""Speed and memory of jaxgrpo vs Tunix vs TRL on the same model, prompts and settings.

    python scripts/peers/bench_peers.py --workload 20m --rounds 3     # after scripts/peers/setup_envs.sh
    python scripts/peers/bench_peers.py --workload 150m --rounds 3    # the 158.6M-parameter workload
    PEERS_SMOKE=1 python scripts/peers/bench_peers.py --rounds 1      # seconds-scale check of the plumbing
    python scripts/peers/bench_peers.py --summarise A.jsonl B.jsonl   # tabulate earlier raw results
    python scripts/peers/bench_peers.py --precision bf16 --tasks sample,iter --impls jaxgrpo,tunix  # mixed precision

Each measurement is its own process (so its peak resident memory, `ru_maxrss`, is its own):
`worker_jaxgrpo.py` in this environment, `worker_tunix.py` in the Tunix venv, `worker_trl.py` in
the TRL venv (venvs under ``$PEERS_ROOT``, default ``<repo>/.peers``). Per round every
implementation runs each task once, in an order rotated from round to round (alternation: machine
noise hits all alike); each process does its warm-up (compile) first, then `--repeats` timed
repetitions. Medians over all timed repetitions are reported, and every ratio is also computed
round by round (consecutive processes, the same machine state).

Implementations (``--impls``): ``jaxgrpo`` (preset grpo), ``jaxgrpo:lambda_grpo``,
``jaxgrpo:frpo`` (the worker's 4th argument, see `common.jaxgrpo_preset`; iteration only: their
sampler is jaxgrpo's), ``tunix``, ``trl`` (the fair configuration: fp32, no gradient checkpointing,
torch threads = usable cores) and, on request, ``trl:defaults`` (TRL's own bf16 autocast and
gradient checkpointing; iteration only).

Workloads (``--workload``, passed to every worker as ``PEERS_WORKLOAD``; see `common.WORKLOADS`):
``20m`` — the random Qwen3 of 20.5M parameters, 16 prompts × 32 tokens, 8 samples each, 128 new
tokens; ``150m`` — a Qwen3 of 158.6M parameters, 8 prompts × 4 samples × 64 new tokens. Temperature
1.0, no EOS stop.

Precision (``--precision``, passed to every worker as ``PEERS_PRECISION``): ``fp32`` (the default; the
workloads are defined in float32) or ``bf16``, each library in its own mixed-precision mode at otherwise the
same settings: jaxgrpo ``load_hf(dtype=bfloat16, param_dtype=float32)``, Tunix ``ModelConfig(dtype=bfloat16,
param_dtype=float32)``, TRL ``bf16=True`` (autocast; its sampler under ``torch.autocast``). Results go to
``peers_bench_<workload>_bf16.md``.

Tasks:
  sample: rollout throughput, generated tokens per second;
  iter:   one full GRPO iteration (rollout + reward + reference pass + one AdamW update, β=0.04,
          two micro-batches).

The matmul floor of the same run: `matmul_probe.py` runs before every round and after the last;
a round's GFLOP/s is the larger of the probes around it, and its floor is the workload's model
FLOPs (`common.model_flops`) at that rate. Every iteration and sampler time is reported as a
fraction of its round's floor. Writes a markdown table and the raw JSON lines next to it.
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
sys.path.insert(0, HERE)
import common  # noqa: E402

ROOT = common.REPO_ROOT
DEFAULT_IMPLS = "jaxgrpo,jaxgrpo:lambda_grpo,jaxgrpo:frpo,tunix,trl"
PEER_NAMES = {
  "tunix": "Tunix",
  "trl": "TRL",
  "trl:defaults": "TRL with its defaults (bf16 autocast, grad. checkpointing)",
}
ITER_ONLY = ("jaxgrpo:", "trl:")  # variants whose sampler is their base implementation's


def command(impl: str, task: str, repeats: int, model_dir: str) -> tuple[list[str], dict]:
  """The worker command line and extra environment of one measurement."""
  base, _, variant = impl.partition(":")
  args = [model_dir, task, str(repeats)]
  if base == "jaxgrpo":
    preset = variant or "grpo"
    if preset not in common.JAXGRPO_PRESETS:
      raise ValueError(f"unknown jaxgrpo preset in {impl!r}; expected one of {common.JAXGRPO_PRESETS}")
    return [sys.executable, os.path.join(HERE, "worker_jaxgrpo.py"), *args] + ([preset] if variant else []), {}
  if base == "tunix" and not variant:
    return [common.venv_python("tunix"), os.path.join(HERE, "worker_tunix.py"), *args], {}
  if base == "trl":
    return [common.venv_python("trl"), os.path.join(HERE, "worker_trl.py"), *args], {
      "PEERS_TRL_VARIANT": variant or "fair"
    }
  raise ValueError(f"unknown implementation {impl!r}; expected jaxgrpo[:preset], tunix, trl or trl:defaults")


def run_process(cmd: list[str], env: dict, timeout: float) -> tuple[dict | None, str, int]:
  """Run one worker; its parsed RESULT line (or None), the tail of its output, its return code."""
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    out, err, rc = p.stdout, p.stderr, p.returncode
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    err, rc = "timeout", -1
  res = None
  for line in out.splitlines():
    if line.startswith("RESULT "):
      res = json.loads(line[7:])
  return res, (err or out)[-3000:], rc


def run_one(impl, task, repeats, model_dir, timeout, workload):
  cmd, extra = command(impl, task, repeats, model_dir)
  env = dict(os.environ, PEERS_WORKLOAD=workload, **extra)
  load0 = os.getloadavg()[0]
  t0 = time.perf_counter()
  res, tail, rc = run_process(cmd, env, timeout)
  wall = time.perf_counter() - t0
  if res is None:
    res = {"impl": impl, "task": task, "error": tail, "rc": rc}
  if impl.startswith("jaxgrpo") and "error" not in res:
    want, got = impl.partition(":")[2] or "grpo", res.get("preset", "grpo")  # a worker that reports none runs grpo
    if got != want:
      res["error"] = (
        f"worker_jaxgrpo.py ran preset {got!r}, not {want!r}: it must take its preset from "
        "`common.jaxgrpo_preset()` (the 4th argument) and so report it"
      )
  res.update(impl=impl, workload=workload, wall_s=wall, load_before=load0, load_after=os.getloadavg()[0])
  return res


def matmul_probe(timeout: float = 600) -> dict:
  res, tail, rc = run_process(
    [sys.executable, os.path.join(HERE, "matmul_probe.py"), "--json"], dict(os.environ), timeout
  )
  return res if res is not None else {"kind": "matmul_probe", "error": tail, "rc": rc}


# ----------------------------------------------------------------------------- summary


def _median(xs):
  xs = [x for x in xs if x is not None]
  return statistics.median(xs) if xs else None


def round_gflops(probes: list[dict], rounds) -> dict[int, float]:
  """Per round, the larger of the matmul probes before it (position r) and after it (position r + 1)."""
  at = {p["position"]: p["gflops"] for p in probes if "gflops" in p}
  out = {}
  for r in rounds:
    around = [at[k] for k in (r, r + 1) if k in at]
    if around:
      out[r] = max(around)
  return out


SPLITS = ("rollout_s", "reward_s", "reference_s", "reward_and_ref_s", "update_s", "step_s")


def phase_splits(record: dict) -> dict[str, list[float]]:
  """A jaxgrpo record's phase times per repetition. Its ``update_s`` is everything after the rollout
  (reward + reference pass + train step); ``step_s``, the train step alone, is derived from it."""
  out = {k: record[k] for k in SPLITS if k in record}
  if "update_s" in record and "reward_and_ref_s" in record:
    out.setdefault("step_s", [u - a for u, a in zip(record["update_s"], record["reward_and_ref_s"])])
  return out


def summarise(results: list[dict]) -> dict:
  """Medians and per-round values per (impl, task) of one workload's results."""
  by = {}
  for r in results:
    if r.get("times") and "error" not in r:  # a rejected run (e.g. the wrong preset) never counts
      by.setdefault((r["impl"], r["task"]), []).append(r)
  s = {}
  for (impl, task), rs in by.items():
    entry = {
      "median_s": statistics.median(t for r in rs for t in r["times"]),
      "per_round": {r["round"]: statistics.median(r["times"]) for r in rs},
      "tokens": rs[0]["tokens"],
      "rss": max(r["peak_rss_gb"] for r in rs),
      "warmup_s": _median(r.get("warmup_s") for r in rs),
    }
    splits = [phase_splits(r) for r in rs]
    for key in SPLITS:
      if key in splits[0]:
        entry[key] = statistics.median(t for sp in splits for t in sp[key])
    s[(impl, task)] = entry
  return s


def _fmt(x, f="{:.1f}"):
  return "—" if x is None else f.format(x)


def _pct(x):
  return "—" if x is None else f"{100 * x:.0f}%"


def per_round_ratio(a: dict | None, b: dict | None) -> tuple[float | None, list[float]]:
  """Median and list of b_r / a_r over the rounds both ran (a, b: summary entries)."""
  if a is None or b is None:
    return None, []
  rs = sorted(set(a["per_round"]) & set(b["per_round"]))
  vals = [b["per_round"][r] / a["per_round"][r] for r in rs]
  return (statistics.median(vals) if vals else None), vals


def floor_fraction(entry: dict | None, floor_flops: float, gflops: dict[int, float]) -> float | None:
  """Median over rounds of (floor time at the round's probe) / (measured time)."""
  if entry is None:
    return None
  vals = [floor_flops / (gflops[r] * 1e9) / t for r, t in entry["per_round"].items() if r in gflops]
  return statistics.median(vals) if vals else None


def table(workload: str, smoke: bool, results: list[dict], probes: list[dict], impls: list[str]) -> str:
  w = common.get_workload(workload, smoke)
  flops = common.model_flops(w)
  gf = round_gflops(probes, sorted({r["round"] for r in results if "round" in r}))
  s = summarise(results)
  get = s.get
  floor_s = {r: flops["total"] / (g * 1e9) for r, g in gf.items()}
  m = w.model
  precision = sorted({r.get("precision", "fp32") for r in results})
  mixed = (
    " in bf16 mixed precision (each library's own: bf16 compute, float32 parameters)" if "bf16" in precision else ""
  )
  lines = [
    f"### Workload {workload}{mixed}{' (PEERS_SMOKE: not a measurement)' if smoke else ''}: {m.n_params:,}-parameter Qwen3 "
    f"(D {m.hidden}, {m.layers} layers, {m.heads}/{m.kv_heads} heads of {m.head_dim}, I {m.intermediate}, "
    f"V {m.vocab}), {w.prompts} prompts × {w.samples} samples × {w.new_tokens} new tokens, micro-batches of "
    f"{w.micro} rows",
    "",
    f"Model FLOPs per iteration (`common.model_flops`): rollout {flops['rollout'] / 1e12:.3f} + reference "
    f"{flops['reference'] / 1e12:.3f} + train step {flops['train'] / 1e12:.3f} + head recompute "
    f"{flops['head_recompute'] / 1e12:.3f} = {flops['total'] / 1e12:.3f} TFLOP. Matmul probe per round "
    f"(GFLOP/s, larger of before/after): "
    + (", ".join(f"r{r} {g:.0f}" for r, g in sorted(gf.items())) or "none")
    + (f"; iteration floor {_fmt(_median(floor_s.values()))} s (median)." if floor_s else "."),
    "",
    "| implementation | GRPO iteration, s (median) | per round | of floor | time ÷ jaxgrpo grpo's | peak RSS, GB | "
    "sampler run, s | rollout tokens/s | sampler of floor | sampler RSS, GB |",
    "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  grpo_it = get(("jaxgrpo", "iter"))
  for impl in impls:
    it, sa = get((impl, "iter")), get((impl, "sample"))
    if it is None and sa is None:
      continue
    rounds = "—" if it is None else ", ".join(f"{it['per_round'][r]:.1f}" for r in sorted(it["per_round"]))
    rel, _ = per_round_ratio(grpo_it, it) if impl != "jaxgrpo" else (None, [])
    cells = [
      impl,
      _fmt(None if it is None else it["median_s"]),
      rounds,
      _pct(floor_fraction(it, flops["total"], gf)),
      "—" if rel is None else f"{rel:.3f}×",
      _fmt(None if it is None else it["rss"], "{:.2f}"),
      _fmt(None if sa is None else sa["median_s"]),
      _fmt(None if sa is None else sa["tokens"] / sa["median_s"], "{:.0f}"),
      _pct(floor_fraction(sa, flops["rollout"], gf)),
      _fmt(None if sa is None else sa["rss"], "{:.2f}"),
    ]
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "Ratios, round by round (consecutive processes, the same machine state); median (per round):"]
  jx_sa = get(("jaxgrpo", "sample"))
  for peer in [i for i in impls if not i.startswith("jaxgrpo")]:
    name = PEER_NAMES.get(peer, peer)
    it_ratio, it_vals = per_round_ratio(grpo_it, get((peer, "iter")))
    sa_ratio, sa_vals = per_round_ratio(jx_sa, get((peer, "sample")))
    rss = None if grpo_it is None or get((peer, "iter")) is None else grpo_it["rss"] / get((peer, "iter"))["rss"]
    parts = []
    if it_ratio is not None:
      parts.append(f"GRPO iteration {it_ratio:.2f}× faster ({', '.join(f'{v:.2f}' for v in it_vals)})")
    if sa_ratio is not None:
      parts.append(f"rollout tokens/s {sa_ratio:.2f}× ({', '.join(f'{v:.2f}' for v in sa_vals)})")
    if rss is not None:
      parts.append(f"peak RSS of the iteration {rss:.2f}× the peer's")
    if parts:
      lines.append(f"- jaxgrpo vs {name}: " + "; ".join(parts) + ".")
  for impl in [i for i in impls if i.startswith("jaxgrpo:")]:
    rel, vals = per_round_ratio(grpo_it, get((impl, "iter")))
    lines.append(
      f"- {impl.partition(':')[2]} vs grpo (same workload, no peer has it): iteration "
      + ("—" if rel is None else f"{100 * (rel - 1):+.1f}% ({', '.join(f'{100 * (v - 1):+.1f}%' for v in vals)})")
    )
  if grpo_it is not None and gf:
    g = statistics.median(gf.values()) * 1e9
    parts = [
      ("rollout", "rollout_s", flops["rollout"]),
      ("reward + reference", "reward_and_ref_s", flops["reference"]),
      ("train step", "step_s", flops["train"] + flops["head_recompute"]),
    ]
    split = "; ".join(
      f"{name} {grpo_it[k]:.1f} s ({_pct(f / g / grpo_it[k])} of its floor)" for name, k, f in parts if k in grpo_it
    )
    lines.append(f"- jaxgrpo grpo iteration, medians: {split} (floors at the median probe).")
  lines += ["", environment_notes(results)]
  return "\n".join(lines)


def environment_notes(results: list[dict]) -> str:
  """One line on the machine and a warning for every process whose torch threads exceeded its usable cores."""
  ok = [r for r in results if "env_end" in r]
  if not ok:
    return "No environment records (the workers predate common.environment)." + "".join(
      f"\nFAILED: {r['impl']} {r['task']} round {r.get('round')}: {r['error'][-300:]}" for r in results if "error" in r
    )
  e = ok[0]["env_end"]
  loads = [r["load_before"] for r in results if "load_before" in r]
  busy = [r["env_summary"]["machine_busy_frac"] for r in ok]
  steal = [r["env_summary"]["machine_steal_frac"] for r in ok]
  text = (
    f"Machine: {e['cpu']['model']} ({' '.join(e['cpu']['flags'])}), {e['cpu_count']} CPUs, affinity {e['affinity']}, "
    f"cgroup CPU quota {e['cgroup_cpu']['cores'] or 'none'} → usable cores {e['usable_cores']}; load average "
    f"(1 min) before each process {min(loads):.1f}–{max(loads):.1f}; machine busy {min(busy):.0%}–{max(busy):.0%}, "
    f"steal ≤ {max(steal):.1%} during the processes."
  )
  busy = [f"{r['impl']} {r['task']} r{r.get('round')} ({common.others_cores(r):.1f})" for r in ok]
  busy = [b for b, r in zip(busy, ok) if common.others_cores(r) > 0.25]
  if busy:
    text += (
      "\nUNRELIABLE: other processes used > 0.25 core while these ran (cores in brackets): "
      + ", ".join(busy)
      + "; rerun on a quiet machine."
    )
  for r in results:
    if "error" in r:
      text += f"\nFAILED: {r['impl']} {r['task']} round {r.get('round')}: {r['error'][-300:]}"
  for r in ok:
    t = r["env_end"].get("torch")
    if t and t["threads"] > r["env_end"]["usable_cores"]:
      text += (
        f"\nWARNING: {r['impl']} {r['task']} (round {r.get('round')}) ran {t['threads']} torch threads on "
        f"{r['env_end']['usable_cores']} usable cores (oversubscribed; see trl_probe.py)."
      )
  return text


def git_commit() -> str:
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    return head.strip() + ("+uncommitted" if dirty.stdout.strip() else "")
  except OSError:
    return "unknown"


def report(records: list[dict], impls: list[str]) -> str:
  """One section per workload found in ``records`` (results and matmul probes)."""
  for r in records:
    r.setdefault("workload", "20m")  # records of the runs before the 150m workload existed
  sections = []
  for workload in sorted({r["workload"] for r in records}):
    rs = [r for r in records if r["workload"] == workload]
    smoke = any(r.get("smoke") for r in rs)
    results = [r for r in rs if r.get("kind") != "matmul_probe"]
    probes = [r for r in rs if r.get("kind") == "matmul_probe"]
    present = [i for i in impls if any(r["impl"] == i for r in results)]
    present += sorted({r["impl"] for r in results} - set(present))
    sections.append(table(workload, smoke, results, probes, present))
  commits = sorted({r["commit"] for r in records if "commit" in r})
  return "\n\n".join(sections) + f"\n\nCommit(s): {', '.join(commits) or 'unknown'}."


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workload", choices=sorted(common.WORKLOADS), default="20m")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--repeats", type=int, default=1, help="timed repetitions per process")
  ap.add_argument("--tasks", default="sample,iter")
  ap.add_argument("--impls", default=DEFAULT_IMPLS, help="comma-separated; also trl:defaults")
  ap.add_argument(
    "--precision",
    choices=("fp32", "bf16"),
    default="fp32",
    help="fp32 (the benchmark's workload) or bf16: each library in its own mixed-precision mode (bf16 compute, "
    "float32 parameters), passed to the workers as PEERS_PRECISION",
  )
  ap.add_argument("--model", help="the saved model (default: $PEERS_ROOT/model for 20m, model-150m for 150m)")
  ap.add_argument("--timeout", type=float, default=3600)
  ap.add_argument("--out", help="markdown table (default .peers/out/peers_bench_<workload>.md; raw .jsonl beside)")
  ap.add_argument(
    "--parallel",
    action="store_true",
    help="run the implementations of a task at the same time (on a machine shared with other "
    "jobs, they then see the same load; the first to finish frees CPU for the others)",
  )
  ap.add_argument("--summarise", nargs="*", metavar="JSONL", help="only tabulate earlier raw results")
  args = ap.parse_args(argv)
  impls = args.impls.split(",")
  for impl in impls:
    command(impl, "iter", 1, "")  # fail on an unknown name before anything runs
  smoke = bool(os.environ.get("PEERS_SMOKE"))
  model_dir = args.model or os.path.join(common.peers_root(), common.get_workload(args.workload).model_dir_name)
  os.environ["PEERS_PRECISION"] = args.precision  # every worker inherits it (common.PRECISION)
  tag = f"{args.workload}{'_bf16' if args.precision == 'bf16' else ''}{'_smoke' if smoke else ''}"
  out = args.out or os.path.join(ROOT, ".peers", "out", f"peers_bench_{tag}.md")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  raw = os.path.splitext(out)[0] + ".jsonl"
  records = []
  if args.summarise:
    for path in args.summarise:
      with open(path) as f:
        records += [json.loads(line) for line in f if line.strip()]
  else:
    if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
      raise SystemExit(
        f"no model at {model_dir}: `{common.venv_python('trl')} scripts/peers/make_model.py {model_dir} "
        f"--size {args.workload}`"
      )
    commit = git_commit()

    def record(res):
      res.update(workload=args.workload, smoke=smoke, commit=commit, precision=args.precision)
      records.append(res)
      with open(raw, "a") as f:
        f.write(json.dumps(res) + "\n")

    def probe(position):
      p = matmul_probe()
      p["position"] = position
      record(p)
      print(f"[matmul probe {position}] {p.get('gflops', float('nan')):.1f} GFLOP/s", flush=True)

    for r in range(args.rounds):
      probe(r)
      order = impls[r % len(impls) :] + impls[: r % len(impls)]
      for task in args.tasks.split(","):
        todo = [i for i in order if not (task == "sample" and i.startswith(ITER_ONLY))]

        def go(impl, task=task):
          return run_one(impl, task, args.repeats, model_dir, args.timeout, args.workload)

        if args.parallel:
          from concurrent.futures import ThreadPoolExecutor

          with ThreadPoolExecutor(len(todo)) as pool:
            batch = list(pool.map(go, todo))
        else:
          batch = (go(impl) for impl in todo)
        for res in batch:
          res["round"], res["parallel"] = r, args.parallel
          record(res)
          msg = (
            res["error"][-300:]
            if "error" in res
            else f"times {[round(t, 1) for t in res['times']]} s, warm-up {res['warmup_s']:.1f} s, "
            f"RSS {res['peak_rss_gb']:.2f} GB"
          )
          print(f"[round {r}] {res['impl']:20s} {task:6s} {msg} (load {res['load_before']:.1f})", flush=True)
    probe(args.rounds)
  text = report(records, impls)
  print("\n" + text)
  with open(out, "w") as f:
    f.write(text + "\n")
  print(f"\nwrote {out}" + ("" if args.summarise else f" and {raw}"))


if __name__ == "__main__":
  main()
