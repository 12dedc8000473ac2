#!/usr/bin/env python
"""The cost of a teacher server against the in-process teacher: one batch scored by each, the same weights.

    python scripts/bench_teacher_remote.py --teacher synthetic:128x2 --rows 64 --prompt 48 --completion 64 --top-k 16

Starts ``scripts/teacher_server.py`` on a free port of 127.0.0.1 (a child process: on one machine the two share
its cores), places the same teacher in this process (``feed.make_teacher``), scores a random batch with each
(once to compile, then ``--repeats`` rounds alternating the two, ``_bench.alternating_times``) and prints one line
per teacher: median and min seconds per batch, and the largest |Δ| between their log-probs. docs/distillation.md quotes the numbers of this machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from jaxgrpo.tasks import script_io  # noqa: E402

script_io.hide_torch_banner()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxgrpo.kernels import distill  # noqa: E402
from jaxgrpo.kernels.config import preset  # noqa: E402
from jaxgrpo.parallel import sharding as shd  # noqa: E402
from jaxgrpo.run.teacher import load_teacher  # noqa: E402
from jaxgrpo.step import feed, train  # noqa: E402
from jaxgrpo.step.batch import Batch  # noqa: E402
from jaxgrpo.step.teacher_remote import RemoteTeacher  # noqa: E402


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--teacher", default="synthetic:128x2")
  ap.add_argument("--rows", type=int, default=64)
  ap.add_argument("--prompt", type=int, default=48)
  ap.add_argument("--completion", type=int, default=64)
  ap.add_argument("--top-k", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args(argv)
  server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "teacher_server.py")
  proc = subprocess.Popen(
    [sys.executable, server, "--teacher", args.teacher, "--port", "0"], stdout=subprocess.PIPE, text=True
  )
  try:
    line = proc.stdout.readline()
    if not line.startswith("serving "):
      print(f"error: the teacher server did not start: {line!r}", file=sys.stderr)
      return 2
    url = line.split(" on ")[1].split()[0]
    model, _ = load_teacher(args.teacher, seed=1)
    b, p, t, k = args.rows, args.prompt, args.completion, args.top_k
    rng = np.random.default_rng(0)
    v = model.config.vocab_size
    batch = Batch(
      rng.integers(0, v, (b, p)).astype(np.int32),
      np.ones((b, p), bool),
      rng.integers(0, v, (b, t)).astype(np.int32),
      np.ones((b, t), bool),
      np.zeros((b, t), np.float32),
      np.arange(b, dtype=np.int32),
      np.zeros(b, np.float32),
    )
    mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
    opt = optax.sgd(0.1)
    graphdef, _, shardings = train.init_train_state(model, opt, mesh)  # any student: only the mesh and config count
    cfg = preset("grpo", distill=distill.DistillConfig(kind="jsd", top_k=k))
    tc = train.TrainConfig(group_size=1)
    step = train.make_train_step(graphdef, opt, cfg, mesh=mesh, shardings=shardings, train_config=tc)
    teachers = {"in-process": feed.make_teacher(step, model), "remote": RemoteTeacher(url, top_k=k)}
    logp = {n: np.asarray(f(batch).teacher_logp) for n, f in teachers.items()}
    fns = [lambda f=f: f(batch).teacher_logp for f in teachers.values()]
    times = _bench.alternating_times(fns, args.repeats, warmup=1)
    diff = float(np.abs(logp["remote"] - logp["in-process"]).max())
    print(_bench.backend_line())
    for name, ts in zip(teachers, times):
      print(
        f"{name}: {args.teacher}, {b} rows × {p}+{t} tokens, top-{k}: median {np.median(ts):.3f} s, "
        f"min {min(ts):.3f} s per batch; max |Δ logp| {diff:.1e}"
      )
  finally:
    proc.kill()
    proc.wait()
  return 0


if __name__ == "__main__":
  sys.exit(main())
