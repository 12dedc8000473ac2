"""The hand-written gradients of the LM head and the decoder (A/B against plain autodiff, same run).

Three custom VJPs replace autodiff in the train step's backward pass, each with the same forward pass:

- ``head``: ``jaxgrpo.models.log_probs.head_log_probs``, the chunked log-prob/entropy kernel; its
  backward pass recomputes a chunk's logits and needs only the chunk's logsumexp (before: the chunk
  under ``jax.checkpoint``, autodiff of logsumexp / take_along_axis / the entropy);
- ``softmax``: the attention softmax (``jaxgrpo.models.attention._attention_softmax``): keeps only the
  probabilities;
- ``swiglu``: ``silu(g) * u`` (``jaxgrpo.models.llama.swiglu``): keeps only ``g`` and ``u``.

For each variant (cumulative: ``autodiff`` = none of them, ``+head``, ``+softmax``, ``+swiglu`` = the
library) the script compiles (1) the gradient of ``chunked_log_probs`` alone (the LM head: w.r.t. the
head weight and the hidden states) and (2) the jitted GRPO train step at ``bench_train_step.py``'s
shapes, and prints ``cost_analysis()`` FLOPs and bytes accessed and ``memory_analysis()`` temporary
bytes — deterministic, so they can be compared on a busy machine — with the ratio to ``autodiff``
compiled in the same run. The old programs are rebuilt by patching the three module-level functions
back to plain autodiff while tracing. ``--rounds N`` also times the compiled steps round-robin,
and the head programs (``_bench.alternating_times``; wall times are only meaningful on a quiet
machine).

  python scripts/bench_head.py                        # V=32000 D=384 L=4, 64×(16+256), K=4, chunk 128
  python scripts/bench_head.py --rounds 5             # + head and step times, alternating
  python scripts/bench_head.py --dtype bfloat16 --variants autodiff,+swiglu
  python scripts/bench_head.py --head-only --vocab 151936
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import statistics
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxgrpo.kernels.config import preset
from jaxgrpo.models import Qwen3Config, build_model
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import train

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/_bench.py, also when loaded by path
import _bench  # noqa: E402
import bench_train_step  # noqa: E402

_log_probs = importlib.import_module("jaxgrpo.models.log_probs")
_attention = importlib.import_module("jaxgrpo.models.attention")
_llama = importlib.import_module("jaxgrpo.models.llama")

MIB = 2**20
VARIANTS = ("autodiff", "+head", "+softmax", "+swiglu")  # cumulative; the last is the library


def _plain_softmax(scores):
  return jax.nn.softmax(scores, axis=-1)


def _plain_swiglu(g, u):
  return jax.nn.silu(g) * u


@contextlib.contextmanager
def variant(name: str):
  """Trace with the first ``VARIANTS.index(name)`` hand-written gradients; the others plain autodiff."""
  keep = VARIANTS.index(name)
  with contextlib.ExitStack() as stack:
    if keep < 1:  # the chunk under jax.checkpoint, as for a model that is not a CausalLM
      stack.enter_context(mock.patch.object(_log_probs, "_uses_head_kernel", lambda model: False))
    if keep < 2:
      stack.enter_context(mock.patch.object(_attention, "_attention_softmax", _plain_softmax))
    if keep < 3:
      stack.enter_context(mock.patch.object(_llama, "swiglu", _plain_swiglu))
    yield


def stats(compiled) -> dict:
  """``flops``, ``bytes`` (accessed) from ``cost_analysis()`` and ``temp`` bytes from ``memory_analysis()``."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  mem = compiled.memory_analysis()
  return {
    "flops": float(cost.get("flops", 0.0)),
    "bytes": float(cost.get("bytes accessed", 0.0)),
    "temp": float(mem.temp_size_in_bytes) if mem is not None else 0.0,
  }


def print_table(title: str, rows: dict) -> None:
  base = rows["autodiff"]
  print(f"\n{title}")
  print("| variant | GFLOP | ratio | GB accessed | ratio | temp MiB | ratio |")
  print("|---|---|---|---|---|---|---|")
  for name, s in rows.items():

    def r(key, s=s):
      return s[key] / base[key] if base[key] else float("nan")

    print(
      f"| {name} | {s['flops'] / 1e9:.3f} | {r('flops'):.3f} | {s['bytes'] / 1e9:.3f} | {r('bytes'):.3f} "
      f"| {s['temp'] / MIB:.1f} | {r('temp'):.3f} |"
    )


def head_rows(cfg, dtype, batch, length, chunk_size) -> dict:
  """Compiled ``value_and_grad`` of ``Σ logp + Σ entropy`` (the entropy differentiated, temperature
  0.7) w.r.t. the parameters and the hidden states, per variant (only ``+head`` changes this program).
  The value is needed as in the train step (its loss and metrics): with ``grad`` alone XLA drops the
  old path's forward matmul, while the kernel's forward pass must still produce the logsumexp."""
  one_layer = dataclasses.replace(cfg, num_layers=1)  # only the head matters here
  abstract = nnx.eval_shape(lambda: build_model(one_layer, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype))
  graphdef, state = nnx.split(abstract)
  hidden = jax.ShapeDtypeStruct((batch, length, cfg.hidden_size), dtype)
  targets = jax.ShapeDtypeStruct((batch, length), jnp.int32)

  def loss(st, h, tgt):
    model = nnx.merge(graphdef, st)
    logp, ent = _log_probs.chunked_log_probs(
      model, h, tgt, temperature=0.7, chunk_size=chunk_size, with_entropy=True, entropy_grad=True
    )
    return logp.sum() + ent.sum()

  rows, compiled = {}, {}
  for name in VARIANTS[:2]:
    with variant(name):
      compiled[name] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(state, hidden, targets).compile()
    rows[name] = stats(compiled[name])
  return rows, compiled


def time_head(compiled, cfg, dtype, batch, length, rounds) -> dict:
  """Alternating wall times of the compiled head programs on random inputs of their shapes."""
  model = build_model(dataclasses.replace(cfg, num_layers=1), rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
  state = nnx.state(model)
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.standard_normal((batch, length, cfg.hidden_size)), dtype)
  targets = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, length)), jnp.int32)
  fns = [lambda f=f: f(state, hidden, targets) for f in compiled.values()]
  return dict(zip(compiled, _bench.alternating_times(fns, rounds)))


def print_times(title: str, times: dict) -> None:
  base = statistics.median(next(iter(times.values())))
  print(f"\n{title}, median of alternating rounds (provisional unless the machine is quiet):")
  for name, t in times.items():
    med = statistics.median(t)
    print(f"  {name:<10} {med:8.3f} s  (min {min(t):.3f})  ratio {med / base:.3f}")


def _lower_step(step, state, batch):
  """The step's program for ``state`` and a placed ``batch`` (``TrainStep.lower``: under its mesh, the
  frozen variables a separate argument)."""
  return step.lower(state, batch)


def step_rows(args, cfg, dtype, variants, *, warm: bool):
  """The train step per variant: ``(rows, steps, states, placed batch)``. Each variant is lowered (and,
  with ``warm``, called once: the jitted function's own cache then holds that variant's program, so
  later calls of ``steps[name]`` need no patch) inside :func:`variant`."""
  model = build_model(cfg, rngs=nnx.Rngs(0), dtype=dtype)
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.adamw(1e-6)
  tc = train.TrainConfig(micro_batches=args.micro_batches, chunk_size=args.chunk_size, group_size=args.group)
  batch = bench_train_step.make_batch(
    np.random.default_rng(0), args.batch, args.group, args.prompt, args.length, args.vocab
  )
  config = preset("grpo", beta=0.04)
  rows, steps, states = {}, {}, {}
  placed = shd.place_batch(batch, mesh)
  for name in variants:
    graphdef, state, shardings = train.init_train_state(model, opt, mesh)
    step = train.make_train_step(graphdef, opt, config, mesh=mesh, shardings=shardings, train_config=tc)
    with variant(name):
      rows[name] = stats(_lower_step(step, state, placed).compile())
      if warm:
        state, _ = step(state, placed)
    steps[name], states[name] = step, state
  return rows, steps, states, placed


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--hidden", type=int, default=384)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=16)
  ap.add_argument("--length", type=int, default=256)
  ap.add_argument("--micro-batches", type=int, default=4)
  ap.add_argument("--chunk-size", type=int, default=128)
  ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
  ap.add_argument(
    "--variants",
    default=",".join(VARIANTS),
    help=f"comma-separated train-step variants, autodiff first (default: all of {', '.join(VARIANTS)})",
  )
  ap.add_argument("--head-only", action="store_true", help="only the LM head's program (no train step)")
  ap.add_argument(
    "--rounds", type=int, default=0, help="also time the compiled programs, round-robin (0: compile only)"
  )
  args = ap.parse_args(argv)
  variants = tuple(args.variants.split(","))
  if variants[0] != "autodiff" or not set(variants) <= set(VARIANTS):
    ap.error(f"--variants must start with autodiff and name some of {VARIANTS}; got {args.variants!r}")

  dtype = jnp.dtype(args.dtype)
  cfg = Qwen3Config(
    vocab_size=args.vocab,
    hidden_size=args.hidden,
    num_layers=args.layers,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    intermediate_size=4 * args.hidden,
    tie_word_embeddings=True,
  )
  print(
    f"{_bench.backend_line()}; V={args.vocab} D={args.hidden} L={args.layers} dtype={args.dtype}; "
    f"step: grpo β=0.04, {args.batch}×({args.prompt}+{args.length}), K={args.micro_batches}, chunk {args.chunk_size}"
  )
  mb = args.batch // args.micro_batches
  head, head_compiled = head_rows(cfg, dtype, mb, args.length, args.chunk_size)
  print_table(
    f"LM head alone: value_and_grad of chunked_log_probs (logp + entropy), {mb}×{args.length} positions", head
  )
  result = {"head": head}
  if args.rounds > 0:
    result["head_times"] = time_head(head_compiled, cfg, dtype, mb, args.length, args.rounds)
    print_times("LM head alone, wall time", result["head_times"])
  if args.head_only:
    return result
  rows, steps, states, placed = step_rows(args, cfg, dtype, variants, warm=args.rounds > 0)
  print_table("train step (jitted, compiled)", rows)
  result["step"] = rows
  if args.rounds > 0:

    def run_of(name):
      def run():
        states[name], _ = steps[name](states[name], placed)
        return states[name]

      return run

    times = _bench.alternating_times([run_of(n) for n in variants], args.rounds, warmup=0)  # warmed above
    assert all(steps[n].traces == 1 for n in variants), "a step was retraced (outside its variant)"
    result["times"] = dict(zip(variants, times))
    print_times("train step, wall time", result["times"])
  return result


if __name__ == "__main__":
  main()
