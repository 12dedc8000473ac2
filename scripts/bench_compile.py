"""Compile time of the programs a GRPO run compiles, at depth: a Qwen3-0.6B-shaped model, loop vs ``scan_layers``.

The model is Qwen3-0.6B's shape by default (28 layers, D = 1024, 16 heads / 8 kv heads of 128, MLP 3072,
vocab 151936, tied embeddings), random and **never allocated**: the programs are lowered ahead of time from
``jax.ShapeDtypeStruct`` s (``nnx.eval_shape``) and compiled, nothing runs. Per layout (``--scan loop``,
``scan`` or ``both``) it times ``jax.jit(...).lower(...)`` (trace) and ``.compile()`` of:

- ``sample``: ``rollout.sampling.generate``'s program (the prefill of the prompts and the decode
  ``while_loop``: one program, compiled once per run for its ``max_new_tokens`` and prompt bucket);
- ``step``: the GRPO train step (``TrainStep.jitted``), once per completion bucket;
- ``reference``: the reference log-prob pass (``make_reference_fn``), once per completion bucket;

for the completion buckets of ``--buckets`` (default: ``DEFAULT_BUCKETS`` up to ``--max-new-tokens``).
Every compile follows ``jax.clear_caches()`` with the persistent compilation cache off, so each is a
cold compile. ``--rounds`` repeats everything (layouts alternated) and the table shows medians.

``--first-step`` instead measures, in fresh child processes, the time from process start to the first
train step beginning: import, build the random model (real weights, ``--dtype``), compile and run a small
rollout (``generate``), the reference pass, then compile the step (``--first-step-run``: run it too); once with
an empty persistent cache (cold) and once more with the cache the first child wrote (warm); the programs that
compiled for 1 s or more are listed from the children's ``jax_log_compiles`` lines.

``--run`` times the programs' steady state instead (real random weights, layouts in alternation, medians).

    python scripts/bench_compile.py --max-new-tokens 256            # the BENCHMARKS.md table (0.6B shape, both)
    python scripts/bench_compile.py --scan scan --buckets 128       # one layout, one bucket
    python scripts/bench_compile.py --first-step --scan scan --max-new-tokens 32   # start -> first step
    python scripts/bench_compile.py --run --num-layers 4 --buckets 128 --max-new-tokens 32 --run-repeats 5
    python scripts/bench_compile.py --tiny                          # a smoke run (2 layers, D = 64)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

_T_START = time.perf_counter()  # before jax is imported: --first-step children count from here

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxgrpo.kernels.config import preset  # noqa: E402
from jaxgrpo.models import Qwen3Config, build_model  # noqa: E402
from jaxgrpo.parallel import sharding as shd  # noqa: E402
from jaxgrpo.rollout import sampling  # noqa: E402
from jaxgrpo.step import feed, train  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402

PROGRAMS = ("sample", "step", "reference")
#: Qwen3-0.6B's shape (config.json of Qwen/Qwen3-0.6B) and the --tiny smoke shape
SHAPE_06B = dict(
  num_layers=28,
  hidden_size=1024,
  num_heads=16,
  num_kv_heads=8,
  head_dim=128,
  intermediate_size=3072,
  vocab_size=151936,
)
SHAPE_TINY = dict(
  num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=512
)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def load() -> str:
  return " ".join(f"{x:.2f}" for x in os.getloadavg())


def model_config(args) -> Qwen3Config:
  shape = dict(SHAPE_TINY if args.tiny else SHAPE_06B)
  for name in shape:
    if getattr(args, name) is not None:
      shape[name] = getattr(args, name)
  return Qwen3Config(
    **shape, max_position_embeddings=args.prompt + max(args.max_new_tokens, 32) + 1, tie_word_embeddings=True
  )


def default_buckets(max_new_tokens: int) -> tuple[int, ...]:
  """The completion buckets a run with ``max_new_tokens`` can compile: ``DEFAULT_BUCKETS`` up to the one that
  holds ``max_new_tokens``."""
  top = train.bucket_length(max_new_tokens)
  return tuple(b for b in train.DEFAULT_BUCKETS if b <= top) or (top,)


class Programs:
  """The abstract model of one layout and the jitted functions whose compile time is measured."""

  def __init__(self, cfg, *, scan: bool, args, mesh):
    dtype = DTYPES[args.dtype]
    self.args, self.mesh, self.cfg = args, mesh, cfg
    model = nnx.eval_shape(
      lambda: build_model(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype, scan_layers=scan, remat=args.remat)
    )
    opt = optax.adamw(1e-6)
    # the public abstract path: ShapeDtypeStructs with the run's shardings, nothing allocated
    self.graphdef, self.state, shardings = train.init_train_state(model, opt, mesh, abstract=True)
    tc = train.TrainConfig(micro_batches=1, group_size=args.group)
    config = dataclasses.replace(preset("grpo"), beta=0.04)  # β > 0: the run has a reference pass
    self.step = train.make_train_step(self.graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
    self.reference = train.make_reference_fn(
      self.graphdef, mesh=mesh, param_shardings=shardings.params, train_config=tc
    )
    self.sample_graphdef, _ = nnx.split(model)

  def lower(self, program: str, bucket: int) -> jax.stages.Lowered:
    a = self.args
    rng = np.random.default_rng(0)
    if program == "sample":
      prompts = jnp.asarray(rng.integers(1, self.cfg.vocab_size, (a.batch // a.group, a.prompt)), jnp.int32)
      model = nnx.merge(self.sample_graphdef, nnx.State.merge(self.state.params, self.state.frozen))
      config = sampling.SamplingConfig(num_samples=a.group, max_new_tokens=bucket, eos_ids=(1,), pad_id=0)
      policy = sampling.SamplingPolicy.from_config(config, temperature=1.0, vocab_size=self.cfg.vocab_size)
      return sampling.lower_generate(model, prompts, jnp.ones(prompts.shape, bool), policy, key=jax.random.key(0))
    batch = _bench.grpo_batch(rng, a.batch, a.group, a.prompt, bucket, self.cfg.vocab_size)
    if program == "step":
      return self.step.lower(self.state, batch)
    return self.reference.lower(self.state.params, batch)

  def compile_seconds(self, program: str, bucket: int) -> tuple[float, float]:
    """``(trace s, compile s)`` of ``program`` at ``bucket``, after ``jax.clear_caches()``."""
    jax.clear_caches()
    t0 = time.perf_counter()
    lowered = self.lower(program, bucket)
    t1 = time.perf_counter()
    lowered.compile(compiler_options=self.args.compiler_options)
    return t1 - t0, time.perf_counter() - t1


def compile_table(args) -> dict:
  """``{"layout/program": [seconds summed over the program's buckets, one per round]}``, printed as a table;
  the persistent compilation cache off meanwhile (every compile cold), restored after."""
  was = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    return _compile_table(args)
  finally:
    jax.config.update("jax_enable_compilation_cache", was)


def _compile_table(args) -> dict:
  cfg = model_config(args)
  buckets = default_buckets(args.max_new_tokens) if args.buckets is None else args.buckets
  layouts = ("loop", "scan") if args.scan == "both" else (args.scan,)
  print(backend_line())
  print(
    f"Qwen3 L={cfg.num_layers} D={cfg.hidden_size} H={cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim} "
    f"F={cfg.intermediate_size} V={cfg.vocab_size} {args.dtype}; {args.batch} rows (groups of {args.group}), "
    f"prompt {args.prompt}; sample max_new_tokens {args.max_new_tokens}; step/reference buckets {list(buckets)}; "
    f"{args.rounds} round(s); XLA compiler options {args.compiler_options}; XLA_FLAGS {os.environ.get('XLA_FLAGS')!r}"
  )
  print(f"load average at start: {load()}")
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  progs = {lay: Programs(cfg, scan=lay == "scan", args=args, mesh=mesh) for lay in layouts}
  plan = {"sample": (args.max_new_tokens,), "step": tuple(buckets), "reference": tuple(buckets)}
  totals = {(lay, p): [] for lay in layouts for p in PROGRAMS}
  traces = {(lay, p): [] for lay in layouts for p in PROGRAMS}
  programs = args.programs
  for r in range(args.rounds):
    order = layouts if r % 2 == 0 else layouts[::-1]
    for program in programs:
      for lay in order:
        secs = [progs[lay].compile_seconds(program, t) for t in plan[program]]
        totals[lay, program].append(sum(tr + c for tr, c in secs))
        traces[lay, program].append(sum(tr for tr, _ in secs))
        per = ", ".join(f"{t}: {tr + c:.1f}" for t, (tr, c) in zip(plan[program], secs))
        print(f"  round {r} {lay:4s} {program:9s} {sum(tr + c for tr, c in secs):7.1f} s  ({per})", flush=True)
    print(f"  load average after round {r}: {load()}", flush=True)
  print(f"\ncompile seconds (trace + compile; median of {args.rounds} round(s)):")
  print("| program | buckets | " + " | ".join(f"{lay} s (trace s)" for lay in layouts) + " |")
  print("|---|---|" + "---|" * len(layouts))
  for program in programs + ("all",):
    names = programs if program == "all" else (program,)
    cells = []
    for lay in layouts:
      tot = sum(statistics.median(totals[lay, p]) for p in names)
      tr = sum(statistics.median(traces[lay, p]) for p in names)
      cells.append(f"{tot:.1f} ({tr:.1f})")
    what = ", ".join(str(b) for b in plan[program]) if program != "all" else ""
    print(f"| {program} | {what} | " + " | ".join(cells) + " |")
  print(f"load average at end: {load()}")
  return {f"{lay}/{p}": v for (lay, p), v in totals.items()}


def backend_line() -> str:
  d = jax.devices()[0]
  return f"jax {jax.__version__}, backend {jax.default_backend()}, {len(jax.devices())} x {d.device_kind}"


def first_step_child(args) -> None:
  """In a fresh process: build the real random model, run a small rollout (``generate``: compile + run), the
  reference pass and one train step; print the seconds since this process started at each mark (JSON)."""
  marks = {"imported": time.perf_counter() - _T_START}
  cfg = model_config(args)
  dtype = DTYPES[args.dtype]
  model = build_model(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype, scan_layers=args.scan == "scan")
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.adamw(1e-6)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  tc = train.TrainConfig(micro_batches=1, group_size=args.group)
  config = dataclasses.replace(preset("grpo"), beta=0.04)
  step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
  reference = feed.make_reference(step, state)
  jax.block_until_ready(state)
  marks["model built"] = time.perf_counter() - _T_START
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(2, cfg.vocab_size, (args.batch // args.group, args.prompt)), jnp.int32)
  scfg = sampling.SamplingConfig(
    num_samples=args.group, max_new_tokens=args.max_new_tokens, eos_ids=(), pad_id=0, suppress_ids=(0,)
  )
  roll = sampling.generate(
    feed.policy_model(graphdef, state), prompts, jnp.ones(prompts.shape, bool), scfg, key=jax.random.key(0)
  )
  jax.block_until_ready(roll.completions)
  marks["rollout done"] = time.perf_counter() - _T_START
  batch = train.Batch(
    np.asarray(roll.prompt_tokens),
    np.asarray(roll.prompt_mask),
    np.asarray(roll.completions),
    np.asarray(roll.mask),
    np.asarray(roll.log_probs),
    np.asarray(roll.group_ids),
    rng.integers(0, 2, args.batch).astype(np.float32),
  )
  batch = reference(train.pad_to_bucket(batch))
  jax.block_until_ready(batch.ref_logp)
  marks["reference done"] = time.perf_counter() - _T_START
  step.lower(state, batch).compile()  # what the first call compiles before it runs
  marks["step begins"] = time.perf_counter() - _T_START
  if args.first_step_run:  # the step itself (a 0.6B step runs for minutes on 2 busy cores)
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    marks["step done"] = time.perf_counter() - _T_START
  print("MARKS " + json.dumps(marks), flush=True)


def compile_log(stderr: str) -> list:
  """``[(program, seconds, read from the persistent cache)]`` of the programs that took 1 s or more, in order,
  from the ``jax_log_compiles`` lines of a child's stderr (a cache hit is logged just before its program's
  "Finished XLA compilation" line, whose seconds then are the read)."""
  out, hit = [], False
  for line in stderr.splitlines():
    if "Persistent compilation cache hit for" in line:
      hit = True
    m = re.search(r"Finished XLA compilation of (\S+) in ([0-9.e+-]+) sec", line)
    if m:
      if float(m.group(2)) >= 1.0:
        out.append((m.group(1), float(m.group(2)), hit))
      hit = False
  return out


def first_step(args) -> dict:
  """Two children with one persistent cache directory: cold (empty) then warm; their marks. A temporary
  directory (no ``--cache-dir``) is deleted at the end."""
  cache = args.cache_dir or tempfile.mkdtemp(prefix="jaxgrpo_cc_")
  argv = [a for a in sys.argv[1:] if a != "--first-step"]
  out = {}
  print(backend_line())
  for which in ("cold", "warm"):
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache, JAX_LOG_COMPILES="1")
    if which == "cold" and os.listdir(cache):
      raise SystemExit(f"--cache-dir {cache} is not empty: the cold run needs an empty one")
    print(f"load average before the {which} child: {load()}", flush=True)
    t0 = time.perf_counter()
    res = subprocess.run(
      [sys.executable, os.path.abspath(__file__), "--first-step-child", *argv],
      env=env,
      capture_output=True,
      text=True,
    )
    wall = time.perf_counter() - t0
    if res.returncode:
      raise SystemExit(f"the {which} child failed (rc {res.returncode}):\n{res.stdout}\n{res.stderr}")
    marks = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("MARKS "))[6:])
    marks["process wall (parent)"] = wall
    marks["compiles"] = compile_log(res.stderr)
    out[which] = marks
    print(f"{which} cache ({cache}): " + ", ".join(f"{k} {v:.1f} s" for k, v in marks.items() if k != "compiles"))
    for name, secs, hit in marks["compiles"]:
      print(f"    {name}: {'read from the cache' if hit else 'compiled'} in {secs:.1f} s", flush=True)
  print(f"load average at end: {load()}")
  if not args.cache_dir:
    shutil.rmtree(cache, ignore_errors=True)
  return out


def run_times(args) -> dict:
  """Steady-state seconds of the three programs per layout (real random weights), timed in alternation. With
  ``--compiler-options`` and one layout: that layout with the default options vs with those (step and reference
  pass; the sampler takes no options in a run)."""
  cfg = model_config(args)
  dtype = DTYPES[args.dtype]
  bucket = (args.buckets or default_buckets(args.max_new_tokens))[0]
  layouts = ("loop", "scan") if args.scan == "both" else (args.scan,)
  options = {lay: None for lay in layouts}
  if args.compiler_options and len(layouts) == 1:
    layouts = (layouts[0], f"{layouts[0]}+options")
    options = {layouts[0]: None, layouts[1]: args.compiler_options}
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  print(backend_line())
  print(
    f"run time: Qwen3 L={cfg.num_layers} D={cfg.hidden_size} V={cfg.vocab_size} {args.dtype}; train batch "
    f"{args.batch} x ({args.prompt} + {bucket}); generate {args.batch} rows x {args.max_new_tokens} new tokens "
    f"(no EOS); optimizer SGD (no moments: both layouts fit in memory); load average {load()}",
    flush=True,
  )
  opt = optax.sgd(1e-6)
  config = dataclasses.replace(preset("grpo"), beta=0.04)
  rng = np.random.default_rng(0)
  batch = _bench.grpo_batch(rng, args.batch, args.group, args.prompt, bucket, cfg.vocab_size)
  prompts = jnp.asarray(batch.prompt_tokens[:: args.group])
  scfg = sampling.SamplingConfig(
    num_samples=args.group, max_new_tokens=args.max_new_tokens, eos_ids=(), pad_id=0, suppress_ids=(0,)
  )
  fns = {}
  for lay in layouts:
    tc = train.TrainConfig(micro_batches=1, group_size=args.group, compiler_options=options[lay])
    model = build_model(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype, scan_layers=lay.startswith("scan"))
    graphdef, state, shardings = train.init_train_state(model, opt, mesh)
    del model
    step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
    reference = feed.make_reference(step, state)
    holder = {"state": state}
    placed = step.place_batch(batch)

    def run_step(step=step, holder=holder, placed=placed):
      holder["state"], m = step(holder["state"], placed)
      return m["loss"]

    def run_sample(graphdef=graphdef, holder=holder):
      model = feed.policy_model(graphdef, holder["state"])
      return sampling.generate(model, prompts, jnp.ones(prompts.shape, bool), scfg, key=jax.random.key(0)).completions

    fns[lay] = {"step": run_step, "reference": lambda r=reference: r(batch).ref_logp, "sample": run_sample}
  out = {}
  for program in [p for p in ("step", "reference", "sample") if p in args.programs]:
    times = _bench.alternating_times([fns[lay][program] for lay in layouts], args.run_repeats, warmup=1)
    med = _bench.medians(times)
    out[program] = dict(zip(layouts, med))
    cells = "   ".join(f"{lay} {m:8.3f} s" for lay, m in zip(layouts, med))
    ratio = f"   {layouts[1]}/{layouts[0]} {med[1] / med[0]:.3f}" if len(layouts) == 2 else ""
    print(f"  {program:9s}  {cells}{ratio}   (load {load()})", flush=True)
  return out


def parse(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--tiny", action="store_true", help="the smoke shape: 2 layers, D 64, vocab 512")
  ap.add_argument("--num-layers", "--layers", dest="num_layers", type=int)
  ap.add_argument("--hidden-size", "--hidden", dest="hidden_size", type=int)
  ap.add_argument("--num-heads", dest="num_heads", type=int)
  ap.add_argument("--num-kv-heads", dest="num_kv_heads", type=int)
  ap.add_argument("--head-dim", dest="head_dim", type=int)
  ap.add_argument("--intermediate-size", dest="intermediate_size", type=int)
  ap.add_argument("--vocab-size", "--vocab", dest="vocab_size", type=int)
  ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="parameters and compute")
  ap.add_argument("--remat", default="none")
  ap.add_argument("--scan", choices=("loop", "scan", "both"), default="both", help="layer layout(s)")
  ap.add_argument("--batch", type=int, default=8, help="rows of the train batch (prompts x group)")
  ap.add_argument("--group", type=int, default=4)
  ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (a multiple of 16: the prompt bucket)")
  ap.add_argument("--max-new-tokens", type=int, default=512, help="the sampler's budget; the top bucket")
  ap.add_argument("--buckets", type=lambda s: tuple(int(x) for x in s.split(",")), help="completion buckets")
  ap.add_argument("--rounds", type=int, default=1)
  ap.add_argument(
    "--compiler-options",
    type=json.loads,
    help="XLA options (JSON), e.g. '{\"xla_backend_optimization_level\": 0}': every program of the compile table; --run "
    "with one --scan layout: its step and reference pass with and without them",
  )
  ap.add_argument(
    "--programs",
    type=lambda s: tuple(s.split(",")),
    default=PROGRAMS,
    help=f"comma-separated subset of {','.join(PROGRAMS)}",
  )
  ap.add_argument("--run", action="store_true", help="steady-state run time per layout instead of compile time")
  ap.add_argument("--run-repeats", type=int, default=3, help="--run: timed calls per layout (alternating)")
  ap.add_argument("--first-step", action="store_true", help="process start -> first step, cold and warm cache")
  ap.add_argument("--first-step-run", action="store_true", help="--first-step: run the step too (else compile it)")
  ap.add_argument("--first-step-child", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--cache-dir", help="--first-step: the persistent cache directory (default: a new temp dir)")
  args = ap.parse_args(argv)
  if args.scan == "both" and (args.first_step or args.first_step_child):
    ap.error("--first-step needs one layout: --scan loop or --scan scan")
  if not args.programs or set(args.programs) - set(PROGRAMS):
    ap.error(f"--programs must be a non-empty subset of {','.join(PROGRAMS)}; got {','.join(args.programs)}")
  if args.batch % args.group:
    ap.error(f"--batch {args.batch} must be a multiple of --group {args.group}")
  return args


def main(argv=None):
  args = parse(argv)
  if args.first_step_child:
    return first_step_child(args)
  if args.first_step:
    return first_step(args)
  if args.run:
    return run_times(args)
  return compile_table(args)


if __name__ == "__main__":
  t = time.perf_counter()
  main()
  print(f"total {time.perf_counter() - t:.0f} s")
