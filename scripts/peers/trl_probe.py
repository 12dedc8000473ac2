"""Where TRL's GRPO iteration spends its time, under each thread count, denormal mode and TRL configuration.

    .peers/trl/bin/python scripts/peers/trl_probe.py                  # the default grid, 20m workload
    .peers/trl/bin/python scripts/peers/trl_probe.py --threads 2 --denormal 0 --variants fair --profile torch
    PEERS_WORKLOAD=150m .peers/trl/bin/python scripts/peers/trl_probe.py --model .peers/model-150m
    .peers/trl/bin/python scripts/peers/trl_probe.py --threads 2 --denormal 0 --no-mkldnn --out DIR   # no oneDNN bf16
    .peers/trl/bin/python scripts/peers/trl_probe.py --summarise A/trl_probe.jsonl B/trl_probe.jsonl  # one table
    PEERS_SMOKE=1 .peers/trl/bin/python scripts/peers/trl_probe.py --threads 1,2 --denormal 0,1   # plumbing check

Why: one TRL iteration of the same pinned versions measured 93.6 s, 500 s and 87.9 s. This runs the
benchmark's own `GRPOTrainer` (built by `worker_trl.make_trainer`, the iteration `bench_peers.py`
times) and times its pieces inside each optimizer step, as TRL runs them:

- ``generate``: `model.generate` as TRL calls it (transformers, no vLLM; one call for all rows);
- ``reference``: the reference model's log-prob forward (no grad, micro-batches of MICRO rows);
- ``old_logps``: the policy's no-grad log-prob pass (TRL skips it when generation and update are
  aligned, as here: expect 0);
- ``policy_fwd``: the policy's log-prob + entropy forward with grad (one per micro-batch);
- ``backward``: `accelerator.backward` of each micro-batch's loss;
- ``clip``: gradient-norm clipping (from the last backward to the optimizer step);
- ``optimizer``: `optimizer.step` (fused AdamW);
- ``reward``: the reward function; ``other``: the rest of the step (advantages, logging, data).

Each configuration is its own process (``--one``; the grid driver starts them): torch intra-op
threads (``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` set to match), `torch.set_flush_denormal`, and the
TRL variant (``fair``: fp32, no gradient checkpointing; ``defaults``: TRL's bf16 autocast +
gradient checkpointing; see worker_trl.py). The grid is threads × denormal for ``fair`` and the
usable core count without flushing for other variants. Step 0 (start-up) is not timed; then
``--iterations`` timed steps (medians). ``--no-mkldnn`` turns oneDNN off in every configuration
(``torch.backends.mkldnn.enabled = False``): torch then runs bf16 matmuls in its own CPU kernels,
which is what it does on a CPU whose oneDNN has no bf16 support (no AVX-512 or AVX2-VNNI-2), so the
``defaults`` variant shows what bf16 autocast costs there. ``--profile torch`` adds one more step under
`torch.profiler` (table of the top operators by self CPU time + a Chrome trace), ``--profile
py-spy`` records the whole process with py-spy (``.peers/trl/bin/pip install py-spy==0.4.3``).

Writes DIR/trl_probe.md (the table and a verdict naming every factor that changes the iteration by
≥ 1.5×), DIR/trl_probe.jsonl (raw, with each process's environment record) and any profiles.
A full-size grid takes about an hour on 2 cores (each process: start-up step + timed steps); run it
on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

PIECES = ("generate", "reference", "old_logps", "policy_fwd", "backward", "clip", "optimizer", "reward", "other")


# ----------------------------------------------------------------------------- one configuration (child)


class PieceTimer:
  """Per-step sums of the time spent in each wrapped call; one dict per optimizer step."""

  def __init__(self):
    self.steps: list[dict] = []
    self.current: dict | None = None
    self.last_backward_end = None

  def add(self, piece: str, seconds: float) -> None:
    if self.current is not None:
      self.current[piece] = self.current.get(piece, 0.0) + seconds

  def wrap(self, fn, label):
    """``fn`` timed under ``label(*args)`` (a function, so the label can depend on the call)."""

    def timed(*args, **kwargs):
      t0 = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        t1 = time.perf_counter()
        piece = label(*args, **kwargs)
        self.add(piece, t1 - t0)
        if piece == "backward":
          self.last_backward_end = t1

    return timed


def make_callback(timer: PieceTimer, profile_step: int | None, out_prefix: str):
  import torch
  from transformers import TrainerCallback

  class Stamps(TrainerCallback):
    def __init__(self):
      self.profiler = None

    def on_step_begin(self, args, state, control, **kw):
      timer.current = {"t0": time.perf_counter()}
      if profile_step is not None and state.global_step == profile_step:
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.profiler.__enter__()

    def on_pre_optimizer_step(self, args, state, control, **kw):
      self.pre_opt = time.perf_counter()
      if timer.last_backward_end is not None:
        timer.add("clip", self.pre_opt - timer.last_backward_end)

    def on_optimizer_step(self, args, state, control, **kw):
      timer.add("optimizer", time.perf_counter() - self.pre_opt)

    def on_step_end(self, args, state, control, **kw):
      step = timer.current
      step["iteration"] = time.perf_counter() - step.pop("t0")
      step["other"] = step["iteration"] - sum(step.get(p, 0.0) for p in PIECES if p != "other")
      if self.profiler is not None:
        self.profiler.__exit__(None, None, None)
        table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        with open(out_prefix + "_torch_profile.txt", "w") as f:
          f.write(table + "\n")
        self.profiler.export_chrome_trace(out_prefix + "_torch_trace.json")
        step["profiled"] = True
        self.profiler = None
      timer.steps.append(step)
      timer.current = None

  return Stamps()


def run_one(args) -> None:
  import torch
  import transformers
  import worker_trl

  name = worker_trl.variant()
  worker_trl.set_threads(name)
  tok = transformers.AutoTokenizer.from_pretrained(args.model)
  model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
  timer = PieceTimer()
  reward = common.RewardClock(lambda prompts, completions, **kw: [common.reward_text(c) for c in completions])
  reward_timed = timer.wrap(reward, lambda *a, **k: "reward")
  reward_timed.__name__ = reward.__name__
  steps = 1 + args.iterations + (1 if args.profile == "torch" else 0)
  with tempfile.TemporaryDirectory() as tmp:
    trainer = worker_trl.make_trainer(model, tok, reward_timed, steps, tmp, name)
    ref = trainer.ref_model

    def logps_label(model_, *a, **k):
      if model_ is ref:
        return "reference"
      return "policy_fwd" if torch.is_grad_enabled() else "old_logps"

    trainer._get_per_token_logps_and_entropies = timer.wrap(trainer._get_per_token_logps_and_entropies, logps_label)
    trainer.accelerator.backward = timer.wrap(trainer.accelerator.backward, lambda *a, **k: "backward")
    trainer.model.generate = timer.wrap(trainer.model.generate, lambda *a, **k: "generate")
    dtypes = worker_trl.DtypeProbe()
    dtypes.attach(trainer.model, "policy")
    if ref is not None:
      dtypes.attach(ref, "reference")
    profile_step = steps - 1 if args.profile == "torch" else None
    trainer.add_callback(make_callback(timer, profile_step, args.out_prefix))
    trainer.train()
  timed = [s for i, s in enumerate(timer.steps) if i >= 1 and not s.get("profiled")]
  if not timed or any("generate" not in s for s in timer.steps):
    raise RuntimeError(f"the probe's timers did not see every piece: {timer.steps}")
  res = {
    "impl": "trl_probe",
    "variant": name,
    "threads": torch.get_num_threads(),
    "flush_denormal": bool(os.environ.get("PEERS_FLUSH_DENORMAL")),
    "mkldnn": torch.backends.mkldnn.enabled,
    "steps": timer.steps,
    "median": {k: statistics.median(s.get(k, 0.0) for s in timed) for k in ("iteration", *PIECES)},
    "trl_config": worker_trl.effective_config(trainer, dtypes),
  }
  common.report(res)


# ----------------------------------------------------------------------------- the grid (driver)


def configs(args) -> list[tuple[str, int, int]]:
  usable = common.usable_cores()
  out = []
  for variant in args.variants.split(","):
    if variant == "fair":
      out += [(variant, int(t), int(d)) for t in args.threads.split(",") for d in args.denormal.split(",")]
    else:
      out.append((variant, usable, 0))
  return out


def run_grid(args) -> list[dict]:
  os.makedirs(args.out, exist_ok=True)
  raw = os.path.join(args.out, "trl_probe.jsonl")
  results = []
  pyspy = None
  if args.profile == "py-spy":
    pyspy = args.py_spy or shutil.which(
      "py-spy", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    )
    if not pyspy:
      raise SystemExit("--profile py-spy: no py-spy found; install it with `.peers/trl/bin/pip install py-spy==0.4.3`")
  for variant, threads, denormal in configs(args):
    tag = f"{variant}_t{threads}_d{denormal}" + ("_nomkldnn" if args.no_mkldnn else "")
    env = dict(os.environ, PEERS_TRL_VARIANT=variant, PEERS_TORCH_THREADS=str(threads))
    env.pop("PEERS_TORCH_MKLDNN", None)
    if args.no_mkldnn:
      env["PEERS_TORCH_MKLDNN"] = "0"
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.pop("PEERS_FLUSH_DENORMAL", None)
    if denormal:
      env["PEERS_FLUSH_DENORMAL"] = "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--one", "--model", args.model]
    cmd += ["--iterations", str(args.iterations), "--out-prefix", os.path.join(args.out, tag)]
    if args.profile == "torch":
      cmd += ["--profile", "torch"]
    if pyspy:
      cmd = [pyspy, "record", "--native", "--rate", "50", "-o", os.path.join(args.out, tag + "_pyspy.svg"), "--"] + cmd
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    res = next((json.loads(ln[7:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if res is None:
      res = {"variant": variant, "threads": threads, "flush_denormal": bool(denormal), "error": p.stderr[-3000:]}
    res.update(tag=tag, wall_s=time.perf_counter() - t0, load_before=load)
    results.append(res)
    with open(raw, "a") as f:
      f.write(json.dumps(res) + "\n")
    msg = res.get("error", "")[-400:] if "error" in res else f"iteration {res['median']['iteration']:.1f} s"
    print(f"[{tag}] {msg} (load {load:.1f})", flush=True)
  return results


def _fmt(x):
  return "—" if x is None else f"{x:.2f}"


def table(results: list[dict]) -> str:
  ok = [r for r in results if "median" in r]
  env = ok[0]["env_end"] if ok else common.environment()
  cpu = env["cpu"]
  lines = [
    f"TRL iteration pieces, workload {common.WORKLOAD.name}{' (PEERS_SMOKE)' if os.environ.get('PEERS_SMOKE') else ''}: "
    f"{common.PROMPTS} prompts × {common.SAMPLES} samples × {common.NEW_TOKENS} tokens; "
    f"{env['cpu_count']} CPUs, affinity {env['affinity']}, cgroup quota {env['cgroup_cpu']['cores'] or 'none'}, "
    f"usable cores {env['usable_cores']}; {cpu['model']} (flags: {' '.join(cpu['flags']) or 'none of ' + ' '.join(common.CPU_FLAGS)}).",
    "Medians over the timed steps, seconds.",
    "",
    "| variant | threads | flush denormal | oneDNN | iteration | " + " | ".join(PIECES) + " | busy cores | "
    "others' cores | invol. switches | load before | peak RSS GB |",
    "| --- | ---: | --- | --- |" + " ---: |" * (len(PIECES) + 6),
  ]
  for r in results:
    if "median" not in r:
      lines.append(
        f"| {r['variant']} | {r['threads']} | {r['flush_denormal']} | {r.get('mkldnn', True)} | failed: see trl_probe.jsonl |"
      )
      continue
    m, s = r["median"], r["env_summary"]
    cells = [r["variant"], str(r["threads"]), "on" if r["flush_denormal"] else "off"]
    cells += ["on" if r.get("mkldnn", True) else "off", _fmt(m["iteration"])]
    cells += [_fmt(m.get(p)) for p in PIECES]
    cells += [f"{s['process_busy_cores']:.2f}", f"{common.others_cores(r):.2f}"]
    cells += [str(s["involuntary_switches"]), f"{r['load_before']:.1f}"]
    cells.append(f"{r['peak_rss_gb']:.2f}")
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", verdict(ok, env["usable_cores"])]
  return "\n".join(lines)


def verdict(ok: list[dict], usable: int) -> str:
  """Each factor's effect on the iteration against the fair baseline (usable threads, no flushing)."""

  def find(variant, threads, flush, mkldnn=True):
    want = (variant, threads, flush, mkldnn)
    return next(
      (r for r in ok if (r["variant"], r["threads"], r["flush_denormal"], r.get("mkldnn", True)) == want), None
    )

  base = find("fair", usable, False)
  if base is None:
    return f"No verdict: the baseline (fair, {usable} threads, no flushing) did not run."
  b = base["median"]
  factors = []
  for r in ok:
    if r is base:
      continue
    variant, usual = r["variant"], r["threads"] == usable and not r["flush_denormal"]
    against = []  # (what changed, the run it is compared with)
    if not r.get("mkldnn", True):
      same = find(variant, r["threads"], r["flush_denormal"])
      if same is not None:
        against.append((f"oneDNN off for {variant!r} (torch's own kernels, as on a CPU without oneDNN bf16)", same))
      if variant != "fair" and usual:
        against.append((f"TRL variant {variant!r} with oneDNN off, against fair with it on", base))
    elif variant == "fair" and not r["flush_denormal"]:
      what = f"threads {r['threads']} instead of {usable}" + (" (oversubscribed)" if r["threads"] > usable else "")
      against.append((what, base))
    elif variant == "fair" and r["threads"] == usable:
      against.append(("torch.set_flush_denormal(True)", base))
    elif variant != "fair" and usual:
      against.append((f"TRL variant {variant!r} (bf16 autocast + gradient checkpointing)", base))
    for what, ref in against:
      m, rm = r["median"], ref["median"]
      ratio = m["iteration"] / rm["iteration"]
      pieces = sorted(PIECES, key=lambda p: -abs(m.get(p, 0) - rm.get(p, 0)))[:2]
      where = ", ".join(f"{p} {rm.get(p, 0):.1f} → {m.get(p, 0):.1f} s" for p in pieces)
      factors.append((ratio, what, where))
  lines = [f"Verdict (against fair, {usable} threads, no flushing: {b['iteration']:.1f} s per iteration):"]
  for ratio, what, where in sorted(factors, reverse=True):
    if ratio >= 3 or ratio <= 1 / 3:
      tag = "CAUSE: alone explains a ≥3× change"
    elif ratio >= 1.5 or ratio <= 1 / 1.5:
      tag = "contributes (1.5–3×)"
    else:
      tag = "not a cause (< 1.5×)"
    lines.append(f"- {what}: ×{ratio:.2f} — {tag}; largest changes: {where}")
  busy = [r["tag"] for r in ok if common.others_cores(r) > 0.25]
  if busy:
    lines.append(
      f'UNRELIABLE: other processes used > 0.25 core during {", ".join(busy)} (column "others\' cores"); '
      "rerun on a quiet machine before naming a cause."
    )
  lines.append(
    "A benchmark RESULT whose env_end.torch.threads exceeds env_end.usable_cores ran oversubscribed; "
    "compare its factor here."
  )
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default=os.path.join(common.peers_root(), common.WORKLOAD.model_dir_name))
  ap.add_argument("--threads", default="1,2,4,16", help="torch intra-op thread counts (variant fair)")
  ap.add_argument("--denormal", default="0,1", help="torch.set_flush_denormal off (0) / on (1) (variant fair)")
  ap.add_argument("--variants", default="fair,defaults", help="TRL configurations (worker_trl.VARIANTS)")
  ap.add_argument("--iterations", type=int, default=1, help="timed steps per process (after the start-up step)")
  ap.add_argument(
    "--no-mkldnn",
    action="store_true",
    help="oneDNN off in every configuration (torch's own bf16 kernels, as on a CPU without oneDNN bf16)",
  )
  ap.add_argument("--profile", choices=("none", "torch", "py-spy"), default="none")
  ap.add_argument("--py-spy", help="the py-spy executable (default: next to this Python, then PATH)")
  ap.add_argument("--timeout", type=float, default=7200)
  ap.add_argument("--out", default=os.path.join(common.REPO_ROOT, ".peers", "out", f"trl_probe_{common.WORKLOAD.name}"))
  ap.add_argument("--summarise", nargs="*", metavar="JSONL", help="only tabulate earlier raw results")
  ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child: one configuration
  ap.add_argument("--out-prefix", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.one:
    return run_one(args)
  if args.summarise:
    results = [json.loads(ln) for path in args.summarise for ln in open(path) if ln.strip()]
  else:
    results = run_grid(args)
  text = table(results)
  print("\n" + text)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "trl_probe.md"), "w") as f:
    f.write(text + "\n")
  print(f"\nwrote {os.path.join(args.out, 'trl_probe.md')}")


if __name__ == "__main__":
  main()
