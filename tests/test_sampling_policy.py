"""The samplers' one static argument (``SamplingPolicy``), the one length rule (``_checks.check_positions``), the
public abstract lowering of the sampler (``lower_generate``), and the samplers sitting below the train step."""

from __future__ import annotations

import ast
import contextlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgrpo import _checks, models
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout import refill, sampling
from jaxgrpo.rollout.environments import rollout as env_rollout

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROLLOUT = ROOT / "jaxgrpo" / "rollout"


def _jaxgrpo_imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """``(line, module)`` of every ``jaxgrpo...`` import in ``path`` (read with ``ast``, nothing imported)."""
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxgrpo"):
      out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    elif isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names if a.name.startswith("jaxgrpo")]
  return out


def test_the_samplers_engines_and_environments_import_nothing_of_the_step():
  """The samplers sit below the train step (issue 49 item 3): the temperature they record and check lives in
  ``jaxgrpo.models.log_probs``; only the environments' training loop (``environments/training.py``) reads a
  ``Batch``."""
  files = [ROLLOUT / n for n in ("sampling.py", "refill.py", "conversation.py")]
  files += sorted((ROLLOUT / "engines").glob("*.py")) + sorted((ROLLOUT / "environments").glob("*.py"))
  files = [f for f in files if f.name != "training.py"]
  assert len(files) > 10
  up = [
    f"{f.relative_to(ROOT)}:{line}: {name}"
    for f in files
    for line, name in _jaxgrpo_imports(f)
    if name == "jaxgrpo.step" or name.startswith("jaxgrpo.step.")
  ]
  assert not up, up


# ----------------------------------------------------------------------------- lower_generate

VOCAB = 64


def _config(**over):
  base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2)
  return models.Qwen3Config(**{**base, "head_dim": 8, "max_position_embeddings": 64, **over})


def _inputs():
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(1, VOCAB, (2, 5)), jnp.int32)
  mask = jnp.asarray(np.arange(5)[None] >= np.array([[0], [2]]))  # left padding
  return prompts, mask


@contextlib.contextmanager
def _dumped_programs(tmp_path):
  """JAX writes the StableHLO of every program it compiles in the block to ``tmp_path`` (jit caches cleared first,
  so a program compiled earlier is compiled, and dumped, again)."""
  old = (jax.config.values["jax_dump_ir_to"], jax.config.values["jax_include_debug_info_in_dumps"])
  jax.clear_caches()
  jax.config.update("jax_dump_ir_to", str(tmp_path))
  jax.config.update("jax_include_debug_info_in_dumps", False)
  try:
    yield tmp_path
  finally:
    jax.config.update("jax_dump_ir_to", old[0])
    jax.config.update("jax_include_debug_info_in_dumps", old[1])


def test_lower_generate_is_the_program_generate_compiles(tmp_path):
  """The StableHLO that ``lower_generate`` gives, from real or from abstract inputs (an ``nnx.eval_shape`` model,
  ``ShapeDtypeStruct`` prompts and key), is byte for byte the module JAX compiled when ``generate`` ran (read from
  JAX's own IR dump, not from this library), and the compiled program returns ``generate``'s rollout."""
  model = models.build_model(_config(), rngs=nnx.Rngs(0))
  prompts, mask = _inputs()
  config = sampling.SamplingConfig(num_samples=3, max_new_tokens=7, top_k=9, eos_ids=(5,), pad_id=0)
  key = jax.random.key(4)
  with _dumped_programs(tmp_path):
    want = sampling.generate(model, prompts, mask, config, key=key, temperature=0.7)
  (dumped,) = tmp_path.glob("*jit__generate_jit*.mlir")
  compiled_text = dumped.read_text()
  policy = sampling.SamplingPolicy.from_config(config, temperature=0.7, vocab_size=VOCAB)
  assert sampling.lower_generate(model, prompts, mask, policy, key=key).as_text() == compiled_text
  abstract = nnx.eval_shape(lambda: models.build_model(_config(), rngs=nnx.Rngs(0)))
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  lowered = sampling.lower_generate(abstract, spec(prompts), spec(mask), policy, key=spec(key))
  assert lowered.as_text() == compiled_text
  got = lowered.compile()(nnx.state(model), prompts, mask, key)
  for name in ("completions", "mask", "log_probs", "num_steps", "group_ids"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
  assert np.asarray(want.mask).sum() > 6  # tokens were sampled


def test_lower_generate_under_a_mesh_traces_in_the_mesh():
  """With ``mesh``, the program is traced inside ``jax.set_mesh(mesh)`` (the module declares the mesh; the
  platform is that of the mesh's devices, ``jaxgrpo.parallel.target``: the TPU slice's program, with its bf16
  products, is checked by tests/test_tpu_aot.py), and it computes ``generate``'s rollout."""
  model = models.build_model(_config(), rngs=nnx.Rngs(0))
  prompts, mask = _inputs()
  config = sampling.SamplingConfig(num_samples=2, max_new_tokens=4)
  policy = sampling.SamplingPolicy.from_config(config, temperature=1.0, vocab_size=VOCAB)
  mesh = shd.make_mesh("data=1", devices=jax.devices("cpu")[:1])
  key = jax.random.key(0)
  lowered = sampling.lower_generate(model, prompts, mask, policy, key=key, mesh=mesh)
  assert 'sdy.mesh @mesh = <["data"=1' in lowered.as_text()
  got = lowered.compile()(nnx.state(model), prompts, mask, key)
  want = sampling.generate(model, prompts, mask, config, key=key)
  np.testing.assert_array_equal(np.asarray(got.completions), np.asarray(want.completions))
  np.testing.assert_array_equal(np.asarray(got.log_probs), np.asarray(want.log_probs))


def test_lower_generate_refuses_bad_input_in_one_line():
  model = models.build_model(_config(), rngs=nnx.Rngs(0))
  prompts, mask = _inputs()
  config = sampling.SamplingConfig(num_samples=2, max_new_tokens=60)
  policy = sampling.SamplingPolicy.from_config(config, temperature=1.0, vocab_size=VOCAB)
  key = jax.random.key(0)
  with pytest.raises(TypeError, match=r"^lower_generate: `policy` must be a jaxgrpo.rollout.sampling.SamplingPolicy"):
    sampling.lower_generate(model, prompts, mask, config, key=key)
  with pytest.raises(ValueError, match=r"^`prompt_tokens` must be int32\[B, P\] with B, P >= 1; got float32\[2, 5\]$"):
    sampling.lower_generate(model, prompts.astype(jnp.float32), mask, policy, key=key)
  with pytest.raises(ValueError, match=r"^`key` must be a single PRNG key"):
    sampling.lower_generate(model, prompts, mask, policy, key=jax.random.split(key, 2))
  want = (
    "prompt length 5 + max_new_tokens 60 = 65 exceeds the 64 positions of the model (max_position_embeddings): "
    "shorten the prompts or lower SamplingConfig.max_new_tokens"
  )
  with pytest.raises(ValueError) as e:
    sampling.lower_generate(model, prompts, mask, policy, key=key)
  assert str(e.value) == want


# ----------------------------------------------------------------------------- the policy


def _policy(temperature=1.0, stop_ids=None, **over):
  config = sampling.SamplingConfig(**{"num_samples": 2, "max_new_tokens": 8, **over})
  return sampling.SamplingPolicy.from_config(config, temperature=temperature, vocab_size=VOCAB, stop_ids=stop_ids)


def test_the_policy_holds_the_checked_settings_and_the_temperature():
  """One hashable value: the ``SamplingConfig`` settings as Python scalars and tuples, the default suppressed ids
  resolved (the pad id unless it ends a completion), and the temperature; equal inputs give equal policies (one
  compiled program per policy)."""
  got = _policy(0.5, top_p=1, top_k=3, eos_ids=[7, 2], pad_id=0)
  want = sampling.SamplingPolicy(
    num_samples=2,
    max_new_tokens=8,
    temperature=0.5,
    top_p=1.0,
    top_k=3,
    eos_ids=(7, 2),
    pad_id=0,
    suppress_ids=(0,),
    record_routing=False,
  )
  assert got == want and hash(got) == hash(want) and type(got.top_p) is float
  assert {want: "program"}[_policy(0.5, top_k=3, eos_ids=(7, 2))] == "program"
  assert _policy(0.7, top_k=3, eos_ids=(7, 2)) != want  # another temperature: another program
  assert _policy(eos_ids=(0,)).suppress_ids == ()  # the pad id ends completions (GPT-2 style): nothing suppressed
  assert _policy(pad_id=3, stop_ids=(3,)).suppress_ids == ()  # a conversation's turns stop at their own ids
  assert _policy(suppress_ids=(9, 4, 9)).suppress_ids == (4, 9)
  assert _policy(max_new_tokens=None).max_new_tokens is None  # multi-turn: each turn sets its own


@pytest.mark.parametrize(
  "over, error, match",
  [
    (dict(temperature=-1.0), ValueError, r"^`temperature` must be >= 0.0 \(0 = greedy\); got -1.0$"),
    (dict(top_p=0.0), ValueError, r"^`top_p` must be > 0.0"),
    (dict(top_k=-1), ValueError, r"^`top_k` must be >= 0"),
    (dict(eos_ids=(VOCAB,)), ValueError, r"eos_ids"),
    (dict(suppress_ids=(5,), eos_ids=(5,)), ValueError, r"^`suppress_ids` and `eos_ids` share \[5\]"),
    (dict(stop_ids=(VOCAB + 1,)), ValueError, r"stop_ids"),
    (dict(record_routing=1), TypeError, r"^record_routing must be a bool; got 1$"),
  ],
)
def test_the_policy_refuses_a_bad_setting_in_one_line(over, error, match):
  with pytest.raises(error, match=match):
    _policy(**over)


def test_a_policy_needs_a_sampling_config():
  with pytest.raises(TypeError, match=r"^SamplingPolicy: `sampling` must be a jaxgrpo.rollout.sampling.SamplingConfig"):
    sampling.SamplingPolicy.from_config({"num_samples": 2}, temperature=1.0, vocab_size=VOCAB)


# ----------------------------------------------------------------------------- the length rule


def test_the_length_rule_is_one_line_naming_the_numbers_and_the_fix():
  """``_checks.check_positions`` is the one rule: a row that fills the positions exactly is allowed, one more
  token is refused with the sum and the fix; the samplers and the multi-turn context say it the same way."""
  _checks.check_positions([("a 60", 60), ("b 4", 4)], 64, "x", "fix it")  # exactly the limit: fits
  with pytest.raises(ValueError) as e:
    _checks.check_positions([("a 60", 60), ("b 5", 5)], 64, "the model (max_position_embeddings)", "fix it")
  assert str(e.value) == "a 60 + b 5 = 65 exceeds the 64 positions of the model (max_position_embeddings): fix it"

  model = models.build_model(_config(), rngs=nnx.Rngs(0))
  prompts, mask = _inputs()
  config = sampling.SamplingConfig(num_samples=2, max_new_tokens=60)
  want = (
    "prompt length 5 + max_new_tokens 60 = 65 exceeds the 64 positions of the model (max_position_embeddings): "
    "shorten the prompts or lower SamplingConfig.max_new_tokens"
  )
  for sample in (
    lambda: sampling.generate(model, prompts, mask, config, key=jax.random.key(0)),
    lambda: refill.generate_refill(model, prompts, mask, config, key=jax.random.key(0), num_slots=2, refill_every=2),
  ):
    with pytest.raises(ValueError) as e:
      sample()
    assert str(e.value) == want
  env = env_rollout.MultiTurnConfig(max_tokens=16, turn_tokens=8)
  with pytest.raises(ValueError) as e:
    env_rollout.context_width(41, env, 64)
  assert str(e.value) == (
    "prompt 41 + env.max_tokens 16 + turn tokens 8 = 65 exceeds the 64 positions of the model "
    "(max_position_embeddings): lower env.max_tokens or env.turn_tokens, or shorten the prompts"
  )
  assert env_rollout.context_width(40, env, 64) == 56  # fits exactly: the unrounded width
