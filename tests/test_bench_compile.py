"""scripts/bench_compile.py: the ahead-of-time programs it times are the ones a run compiles, and its smoke path."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxgrpo.models import build_model
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.step import train

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_compile.py")


def _load():
  spec = importlib.util.spec_from_file_location("bench_compile", _PATH)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  return bench


def test_abstract_reference_program_runs_the_real_weights():
  """The reference program lowered from ShapeDtypeStructs (no weights) accepts the real parameters and gives
  the log-probs of the run's own reference pass, and of a NumPy log-softmax of the model's logits."""
  bench = _load()
  args = bench.parse(
    ["--tiny", "--num-layers", "1", "--scan", "scan", "--batch", "4", "--group", "2", "--prompt", "16"]
  )
  cfg = bench.model_config(args)
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  progs = bench.Programs(cfg, scan=True, args=args, mesh=mesh)
  compiled = progs.lower("reference", 32).compile()

  model = build_model(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, scan_layers=True)
  graphdef, state, shardings = train.init_train_state(model, optax.sgd(0.0), mesh)
  reference = train.make_reference_fn(graphdef, mesh=mesh, param_shardings=shardings.params)
  batch = bench._bench.grpo_batch(np.random.default_rng(0), 4, 2, 16, 32, cfg.vocab_size)
  cols = tuple(jnp.asarray(getattr(batch, f)) for f in ("prompt_tokens", "prompt_mask", "completions", "mask"))
  got = np.asarray(compiled(state.params, cols))
  np.testing.assert_array_equal(got, np.asarray(reference(state.params, batch)))

  # independent reference: log_softmax of the model's own logits at the completion positions, in NumPy
  tokens = np.concatenate([batch.prompt_tokens, batch.completions], axis=1)
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  hidden = model(jnp.asarray(tokens), jnp.asarray(positions))
  hidden = hidden[0] if isinstance(hidden, tuple) else hidden
  logits = np.asarray(model.logits(hidden, out_dtype=jnp.float32), np.float64)[:, 15:-1]  # predict completions
  logits -= logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  want = np.take_along_axis(logp, batch.completions[..., None], -1)[..., 0]
  mask = np.asarray(batch.mask)
  np.testing.assert_allclose(got[mask], want[mask], atol=0.05)


def test_bench_compile_smoke(capsys):
  bench = _load()
  was = jax.config.jax_enable_compilation_cache
  res = bench.main(
    ["--tiny", "--num-layers", "1", "--scan", "both", "--programs", "reference", "--buckets", "32", "--batch", "4"]
    + ["--group", "2", "--prompt", "16", "--max-new-tokens", "32"]
  )
  out = capsys.readouterr().out
  assert jax.config.jax_enable_compilation_cache == was  # the bench turns the persistent cache back on
  assert "| reference | 32 |" in out and "| all |" in out
  assert len(res["loop/reference"]) == 1 and res["loop/reference"][0] > 0 and res["scan/reference"][0] > 0


def test_compile_log_reads_compiles_and_cache_reads_in_order():
  """The --first-step parser: jax_log_compiles lines of a child (a cache hit is logged before its program's
  "Finished XLA compilation" line); programs under 1 s left out."""
  bench = _load()
  log = "\n".join(
    [
      "WARNING:jax._src.dispatch:Finished XLA compilation of jit(_normal) in 0.2 sec",
      "WARNING:jax._src.dispatch:Finished XLA compilation of jit(_generate_jit) in 9.5 sec",
      "WARNING:jax._src.compiler:Persistent compilation cache hit for 'jit_fn' with key 'jit_fn-abc'",
      "WARNING:jax._src.dispatch:Finished XLA compilation of jit(fn) in 2.25 sec",
      "WARNING:jax._src.dispatch:Finished XLA compilation of jit(fn) in 14 sec",
    ]
  )
  assert bench.compile_log(log) == [
    ("jit(_generate_jit)", 9.5, False),
    ("jit(fn)", 2.25, True),
    ("jit(fn)", 14.0, False),
  ]
