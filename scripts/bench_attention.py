"""Peak memory and time of an attention gradient: the model's ``attention="dense"`` vs ``attention="blockwise"``.

Each (implementation, length) runs in a fresh child process (``--child``) on one row of ``L`` tokens. Two modes:

- ``--mode layer`` (default): one ``jaxgrpo.models.attention.Attention`` layer (D = 64, 4 heads of 16, no RoPE): its
  projections, attention, the output projection, and the gradient of a linear read-out ``⟨y, w⟩`` with respect to
  the input and the four weights;
- ``--mode model``: a tiny 2-layer Qwen3 model (D = 64, 4 heads of 16, vocabulary 256, ``build_model``): the
  gradient of the sum of its log-probs (``jaxgrpo.models.log_probs``) with respect to every weight;
- ``--mode step``: one GRPO train step (``jaxgrpo.make_train_step``, SGD) of that model on one group of 2 rows of
  ``L`` tokens (compiled by a first step outside the measurement).

``dense`` materialises the scores ``[B, N, G, L, L]`` in float32; ``blockwise`` is the same module with
``set_attention(model, "blockwise")`` (the CPU's default blocks). The child compiles the gradient, resets its peak RSS
(``/proc/self/clear_refs``), runs it once and ``--repeats`` times more, and reports the peak RSS (``VmHWM``) over the
RSS before the first run (the program's temporaries and outputs, not the compiler's) and the median time of the
repeats. The parent watches each child's RSS and stops one that passes ``--cap-gib`` (the machine is shared: a dense
row at 16k tokens would take ~10 GiB); such a row reads "over the cap"; one that XLA refuses to allocate
(RESOURCE_EXHAUSTED) reads "out of memory" with XLA's line.
Ends with the memory slope: the ratio of the peak over the baseline from each length to the next (linear: 2×
per doubling, quadratic: 4×).

    python scripts/bench_attention.py                       # one layer at 2k, 4k, 8k, 16k tokens, cap 8 GiB
    python scripts/bench_attention.py --lengths 256 512 1024 2048 --repeats 5   # the crossover of ``auto``
    python scripts/bench_attention.py --mode model --lengths 2048 4096 8192 16384
    python scripts/bench_attention.py --mode step --impls blockwise --lengths 16384 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxgrpo import make_mesh, preset
from jaxgrpo.models import Qwen3Config, build_model
from jaxgrpo.models.attention import Attention, set_attention
from jaxgrpo.models.log_probs import log_probs
from jaxgrpo.step.batch import Batch
from jaxgrpo.step.state import TrainConfig, init_train_state
from jaxgrpo.step.train import make_train_step

GIB = 2**30
D, H, N, K, VOCAB = 64, 4, 4, 16, 256


def _rss(pid: int | str = "self", field: str = "VmRSS") -> int:
  """Resident bytes of a process (Linux ``/proc/PID/status``: ``VmRSS`` now, ``VmHWM`` its peak); 0 once it is
  gone."""
  try:
    with open(f"/proc/{pid}/status") as f:
      return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))
  except (OSError, StopIteration):
    return 0


def _reset_peak() -> None:
  """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux: ``5`` into ``/proc/self/clear_refs``)."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def _layer_gradient(impl: str, length: int):
  """``(gradient function, its arguments)`` of one attention layer's read-out ``⟨y, w⟩``."""
  layer = Attention(
    hidden_size=D, num_heads=H, num_kv_heads=N, head_dim=K, qkv_bias=False, o_bias=False, qk_norm_eps=None,
    inv_freq=None, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0),
  )  # fmt: skip
  graphdef, weights = nnx.split(set_attention(layer, impl))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(1, length, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(1, length, D)), jnp.float32)
  seg = jnp.ones((1, length), jnp.int32)
  positions = jnp.zeros((1, length), jnp.int32)

  def readout(p, x):
    return jnp.vdot(nnx.merge(graphdef, p)(x, positions, seg, None, None, None)[0], w)

  return jax.grad(readout, argnums=(0, 1)), (weights, x)


def _model_gradient(impl: str, length: int):
  """``(gradient function, its arguments)`` of the sum of a tiny 2-layer model's log-probs on one row."""
  graphdef, weights = nnx.split(_tiny_model(impl, length))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, size=(1, length)), jnp.int32)

  def total(p, tokens):
    return jnp.sum(log_probs(nnx.merge(graphdef, p), tokens))

  return jax.grad(total), (weights, tokens)


def _tiny_model(impl: str, length: int):
  cfg = Qwen3Config(
    vocab_size=VOCAB, hidden_size=D, num_layers=2, num_heads=H, num_kv_heads=N, head_dim=K, intermediate_size=2 * D,
    max_position_embeddings=max(length, 2048),
  )  # fmt: skip
  return build_model(cfg, rngs=nnx.Rngs(0), attention=impl)


def _train_step(impl: str, length: int):
  """``(step, (state, batch))``: ``make_train_step`` (GRPO, SGD) of the tiny model on one group of 2 rows of
  ``length`` tokens (a 16-token prompt, the rest completion) on a 1-device mesh."""
  mesh = make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.sgd(1e-3)
  graphdef, state, shardings = init_train_state(_tiny_model(impl, length), opt, mesh)
  tc = TrainConfig(group_size=2)
  step = make_train_step(graphdef, opt, preset("grpo"), mesh=mesh, shardings=shardings, train_config=tc)
  rng = np.random.default_rng(0)
  P, T = 16, length - 16
  batch = Batch(
    prompt_tokens=np.repeat(rng.integers(1, VOCAB, (1, P)), 2, axis=0).astype(np.int32),
    prompt_mask=np.ones((2, P), bool), completions=rng.integers(1, VOCAB, (2, T)).astype(np.int32),
    mask=np.ones((2, T), bool), old_logp=np.full((2, T), -np.log(VOCAB), np.float32),
    group_ids=np.zeros(2, np.int32), rewards=np.array([0.0, 1.0], np.float32),
  )  # fmt: skip
  return step, (state, batch)


def _child(mode: str, impl: str, length: int, repeats: int) -> dict:
  if mode == "step":  # a train step: compiled (and its state advanced) by a first call outside the measurement
    step, (state, batch) = _train_step(impl, length)
    held = list(jax.block_until_ready(step(state, batch)))  # [state, metrics]

    def run():  # the step donates its state: each call takes the one the last returned
      held[:] = step(held[0], batch)
      return held
  else:
    fn, args = {"layer": _layer_gradient, "model": _model_gradient}[mode](impl, length)
    compiled = jax.jit(fn).lower(*args).compile()
    run = lambda: compiled(*args)
  _reset_peak()  # the compiler's own peak is not the program's
  base = _rss()
  jax.block_until_ready(run())  # the first run: fresh pages for every buffer
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - t)
  peak = _rss(field="VmHWM")
  return {"impl": impl, "length": length, "peak_over_base": peak - base, "seconds": sorted(times)[len(times) // 2]}


def _run(mode: str, impl: str, length: int, repeats: int, cap: float) -> dict:
  """One child; stopped (and reported over the cap) when its RSS passes ``cap`` bytes."""
  cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, str(length), "--repeats", str(repeats)]
  cmd += ["--mode", mode]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  top = 0
  while proc.poll() is None:
    top = max(top, _rss(proc.pid))
    if top > cap:
      proc.kill()
      proc.wait()
      return {"impl": impl, "length": length, "over_cap": top}
    time.sleep(0.05)
  out, err = proc.communicate()
  if proc.returncode and "RESOURCE_EXHAUSTED" in err:  # XLA refused the program's buffers before RSS grew
    return {"impl": impl, "length": length, "out_of_memory": err.strip().splitlines()[-1][:160]}
  if proc.returncode:
    raise SystemExit(f"bench_attention: the {impl} child at {length} tokens exited {proc.returncode}:\n{err[-3000:]}")
  return json.loads(out.strip().splitlines()[-1])


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or "unknown CPU"


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
  p.add_argument("--impls", nargs="+", choices=["dense", "blockwise"], default=["dense", "blockwise"])
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--cap-gib", type=float, default=8.0, help="stop a child whose RSS passes this (GiB)")
  p.add_argument("--mode", choices=["layer", "model", "step"], default="layer", help="a layer, a model, a train step")
  p.add_argument("--child", nargs=2, metavar=("IMPL", "LENGTH"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    print(json.dumps(_child(args.mode, args.child[0], int(args.child[1]), args.repeats)))
    return []
  if args.repeats < 1 or args.cap_gib <= 0 or min(args.lengths) < 1:
    raise SystemExit(f"bench_attention: --repeats, --cap-gib and --lengths must be positive; got {vars(args)}")
  print(
    f"# {_cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; {args.mode}: D={D}, {H} heads of {K}"
  )
  what = "one train step" if args.mode == "step" else "one gradient"
  print(f"| tokens | attention | peak RSS over baseline | time of {what} |")
  print("| ---: | --- | ---: | ---: |")
  rows = []
  for impl in args.impls:
    for length in sorted(args.lengths):
      r = _run(args.mode, impl, length, args.repeats, args.cap_gib * GIB)
      rows.append(r)
      if "out_of_memory" in r:
        print(f"| {length:,} | {impl} | out of memory: {r['out_of_memory']} | — |")
      elif "over_cap" in r:
        print(f"| {length:,} | {impl} | over the {args.cap_gib:g} GiB cap (stopped at {r['over_cap'] / GIB:.2f}) | — |")
      else:
        print(
          f"| {length:,} | {impl} | {r['peak_over_base'] / 2**20:,.1f} MiB | {r['seconds'] * 1e3:,.1f} ms |", flush=True
        )
  for impl in args.impls:  # lengths whose peak is under 1 MiB (allocator noise) give no ratio
    done = [r for r in rows if r["impl"] == impl and r.get("peak_over_base", 0) >= 2**20]
    slopes = [f"{b['length']}/{a['length']} ×{b['peak_over_base'] / a['peak_over_base']:.2f}"
              for a, b in zip(done, done[1:])]  # fmt: skip
    print(f"# memory slope, {impl}: {', '.join(slopes) or '—'}")
  return rows


if __name__ == "__main__":
  main()
