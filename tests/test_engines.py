"""The engine interface and the built-in engine (the vLLM engine: tests/test_engine_vllm.py)."""

from __future__ import annotations

import importlib.util
import time
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest
from helpers import flat_params, tiny_model

from jaxgrpo.kernels.config import preset
from jaxgrpo.loop import iteration
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.engines import (
  GENERATE_SIGNATURE,
  BuiltinEngine,
  Engine,
  Generation,
  check_engine,
  finish_reasons,
)
from jaxgrpo.rollout.engines.vllm import INSTALL_HINT
from jaxgrpo.rollout.sampling import SamplingConfig, generate
from jaxgrpo.run.specs import load_config
from jaxgrpo.run.trainer import Trainer
from jaxgrpo.step import train


def test_finish_reasons_from_the_definition():
  comps = np.array([[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0], [0, 0, 0, 0], [5, 6, 7, 3]])
  mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
  got = finish_reasons(comps, mask, (2, 3))
  want = []
  for c, m in zip(comps, mask):
    real = c[m]
    want.append("stop" if len(real) and real[-1] in (2, 3) else "length")
  assert got.tolist() == want == ["stop", "length", "stop", "length", "stop"]


def test_builtin_engine_is_the_sampler_and_follows_pushes():
  model, other = tiny_model(0), tiny_model(1)
  engine = BuiltinEngine()
  assert isinstance(engine, Engine)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 128, (2, 5)).astype(np.int32)
  mask = np.ones((2, 5), bool)
  mask[0, :2] = False
  sampling = SamplingConfig(num_samples=3, max_new_tokens=6, eos_ids=(7,), pad_id=0)
  kw = dict(key=jax.random.key(3), temperature=1.0)
  engine.push_weights(model)
  gen = engine.generate(tokens, mask, sampling, **kw)
  ref = generate(model, tokens, mask, sampling, **kw)
  for a, b in zip(gen.rollout, ref):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert gen.finish_reasons.shape == (6,)
  np.testing.assert_array_equal(gen.finish_reasons, finish_reasons(ref.completions, ref.mask, (7,)))
  engine.push_weights(other)
  np.testing.assert_array_equal(
    np.asarray(engine.generate(tokens, mask, sampling, **kw).rollout.log_probs),
    np.asarray(generate(other, tokens, mask, sampling, **kw).log_probs),
  )


def test_the_vllm_engine_missing_is_one_line_before_anything_heavy():
  if importlib.util.find_spec("vllm") is not None:
    pytest.fail("this test runs in the main environment, which has no vLLM (its own venv: .venv-vllm)")
  cfg = load_config(None, {"rollout.engine": "vllm", "devices.mesh": ""})
  t0 = time.perf_counter()
  with pytest.raises(ImportError) as e:
    Trainer(cfg, log=None)
  assert time.perf_counter() - t0 < 2.0  # no model built, no warm-up
  assert str(e.value) == INSTALL_HINT and "\n" not in INSTALL_HINT and "pip install 'jaxgrpo[vllm]'" in INSTALL_HINT


def test_engine_settings_are_checked_by_the_config():
  with pytest.raises(ValueError, match="rollout.engine"):
    load_config(None, {"rollout.engine": "sglang"})
  with pytest.raises(ValueError, match="rollout.vllm.dtype"):
    load_config(None, {"rollout.engine": "vllm", "rollout.vllm.dtype": "int8"})
  with pytest.raises(ValueError, match="step.temperature"):
    load_config(None, {"rollout.engine": "vllm", "step.temperature": 0.7, "rollout.top_k": 20})
  cfg = load_config(None, {"rollout.engine": "vllm", "rollout.vllm": {"dtype": "bfloat16", "max_num_seqs": 64}})
  assert cfg.rollout.vllm.dtype == "bfloat16" and cfg.rollout.vllm.max_num_seqs == 64
  assert load_config(None, {}).rollout.engine == "jax"


# ---------------------------------------------------------------- a user's engine (issue 33 item 7)
OFFSET = 0.5  # nats the engine adds to every reported log-prob: its μ is not the policy's


class OffsetEngine:
  """A user's engine written against the public protocol only: the jitted sampler on the pushed model, reporting
  log-probs ``OFFSET`` nats above the policy's (an engine with other kernels / dtype, exaggerated), so its
  log-probs must not be used as ``old_logp``."""

  name = "offset"
  logprobs_are_policy = False
  static_shapes = True  # the jitted sampler: the partial rollouts' pool buckets its shapes (few compiles)

  def __init__(self, **settings):
    self.settings, self.model, self.pushes, self.closed = settings, None, 0, False

  def push_weights(self, model):
    self.model, self.pushes = model, self.pushes + 1

  def release_memory(self):
    pass

  def reacquire_memory(self):
    pass

  def close(self):
    self.closed = True

  def generate(self, prompt_tokens, prompt_mask, sampling, *, key, temperature=1.0):
    r = generate(self.model, prompt_tokens, prompt_mask, sampling, key=key, temperature=temperature)
    r = r._replace(log_probs=np.where(np.asarray(r.mask), np.asarray(r.log_probs) + OFFSET, 0.0).astype(np.float32))
    return Generation(r, finish_reasons(r.completions, r.mask, sampling.eos_ids))


def make_offset_engine(**settings):
  """``rollout.engine: test_engines:make_offset_engine``."""
  return OffsetEngine(**settings)


def make_not_an_engine(**settings):
  return object()


def make_broken_engine(**settings):
  """A factory with a bug: it raises when the trainer calls it."""
  raise RuntimeError(f"no GPU for max_model_len={settings['max_model_len']}")


class KeywordEngine(OffsetEngine):
  """A user's engine written against the keyword signature retired by issue 34 (item 5)."""

  def generate(
    self, prompt_tokens, prompt_mask, *, num_samples, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
    eos_ids=(), pad_id, suppress_ids=None, key,
  ):  # fmt: skip
    raise AssertionError("never called: refused before any sampling")


def make_keyword_engine(**settings) -> KeywordEngine:
  """Its class is known from the annotation: refused when the config loads."""
  return KeywordEngine(**settings)


def make_some_engine(**settings):
  """Says nothing of its class: the engine it returns is refused by check_engine (the trainer, the iterations)."""
  return KeywordEngine(**settings)


NOT_CALLABLE = 3
K3_OFFSET = float(np.exp(-OFFSET) + OFFSET - 1)  # k3 = r − log r − 1 at r = π/μ = e^−OFFSET


def _step(model):
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  opt = optax.adam(1e-2)
  graphdef, state, shardings = train.init_train_state(model, opt, mesh)
  tc = train.TrainConfig(micro_batches=1, group_size=4, chunk_size=4)
  return train.make_train_step(graphdef, opt, preset("grpo"), mesh=mesh, shardings=shardings, train_config=tc), state


def test_grpo_iteration_takes_a_users_engine_and_recomputes_old_logp():
  """The user's engine samples exactly what the built-in sampler does, but reports log-probs OFFSET nats off:
  ``grpo_iteration(engine=...)`` pushes the policy, keeps the engine's log-probs as ``behavior_logp`` and
  recomputes ``old_logp`` with the policy, so the update equals the built-in iteration's (with the engine's
  log-probs as old_logp the ratio e^−0.5 would be clipped for negative advantages and the update differ); the
  mismatch metric is k3 at r = e^−OFFSET. The built-in engine fed a policy whose state the update donated
  refuses in one line naming push_weights."""
  step, state = _step(tiny_model(seed=2))
  _, state2, _ = train.init_train_state(tiny_model(seed=2), optax.adam(1e-2), step.mesh)
  prompts = np.array([[3, 4, 5], [0, 6, 7]], np.int32)
  sampling = iteration.SamplingConfig(num_samples=4, max_new_tokens=6, eos_ids=(1,))
  common = dict(key=jax.random.key(3), reward_fn=lambda p, c: [sum(t % 2 for t in x) for x in c], sampling=sampling)
  engine = OffsetEngine()
  out = iteration.grpo_iteration(step, state, prompts, prompts > 0, engine=engine, buckets=None, **common)
  want = iteration.grpo_iteration(step, state2, prompts, prompts > 0, buckets=None, **common)
  assert engine.pushes == 1 and out.metrics["grad_norm"] > 0
  np.testing.assert_array_equal(np.asarray(out.rollout.completions), np.asarray(want.rollout.completions))
  m = np.asarray(want.rollout.mask)
  np.testing.assert_allclose(np.asarray(out.rollout.log_probs)[m], np.asarray(want.rollout.log_probs)[m] + OFFSET)
  got, ref = flat_params(out.state.params), flat_params(want.state.params)
  for k in ref:
    np.testing.assert_allclose(got[k], ref[k], atol=1e-4, err_msg=str(k))  # adam: 1% of the step (lr 1e-2)
  del got, ref  # NumPy views of out.state's buffers: while they live, the step copies instead of donating
  assert out.metrics["engine/mismatch_k3"] == pytest.approx(K3_OFFSET, rel=1e-4)
  assert out.metrics["engine/logp_abs_diff_max"] == pytest.approx(OFFSET, abs=1e-4)
  assert out.metrics["engine/push_s"] >= 0 and "engine/mismatch_k3" not in want.metrics
  # the built-in engine after an update without a push: one line naming push_weights, not XLA's deleted buffer
  builtin = BuiltinEngine()
  out2 = iteration.grpo_iteration(step, out.state, prompts, prompts > 0, engine=builtin, buckets=None, **common)
  assert "engine/mismatch_k3" not in out2.metrics  # its log-probs are the policy's: used as old_logp
  settings = SamplingConfig(num_samples=4, max_new_tokens=6, pad_id=0)
  with pytest.raises(RuntimeError, match=r"call engine\.push_weights\(policy\)") as e:
    builtin.generate(prompts, prompts > 0, settings, key=jax.random.key(0))
  assert "\n" not in str(e.value)
  builtin.push_weights(iteration.policy_model(step.graphdef, out2.state))
  assert builtin.generate(prompts, prompts > 0, settings, key=jax.random.key(0)).rollout.completions.shape == (8, 6)
  with pytest.raises(
    TypeError, match=r"engine must implement jaxgrpo.rollout.engines.Engine; got object \(missing: name"
  ):
    iteration.grpo_iteration(step, out2.state, prompts, prompts > 0, engine=object(), **common)


def test_an_engine_with_the_retired_keyword_generate_is_refused_in_one_line_before_it_runs():
  """issue 34 item 5: ``Engine.generate(prompt_tokens, prompt_mask, sampling, *, key, temperature=1.0)``. A user's
  engine still written as ``generate(prompt_tokens, prompt_mask, *, num_samples, ..., key)`` is refused by its
  signature (nothing called): when the config loads if the factory is the class or is annotated with it, else
  by ``check_engine`` on the engine it returned; one line naming the engine, what it has and what it needs."""
  for factory in ("test_engines:KeywordEngine", "test_engines:make_keyword_engine"):
    with pytest.raises(ValueError) as e:
      load_config(None, {"rollout.engine": factory})
    msg = str(e.value)
    assert f"`rollout.engine`: {factory!r}: KeywordEngine.generate(prompt_tokens, prompt_mask, *, num_samples" in msg
    assert "too many positional arguments" in msg and GENERATE_SIGNATURE in msg and "\n" not in msg, msg
  for factory in ("test_engines:OffsetEngine", "test_engines:make_some_engine"):  # accepted when the config loads
    assert load_config(None, {"rollout.engine": factory}).rollout.engine == factory
  with pytest.raises(TypeError) as e:
    check_engine(make_some_engine(), "the object `rollout.engine: test_engines:make_some_engine` returned")
  msg = str(e.value)
  assert msg.startswith("the object `rollout.engine: test_engines:make_some_engine` returned: KeywordEngine.generate(")
  assert GENERATE_SIGNATURE in msg and "\n" not in msg, msg
  assert GENERATE_SIGNATURE == "generate(prompt_tokens, prompt_mask, sampling: SamplingConfig, *, key, temperature=1.0)"
  for engine in (OffsetEngine(), BuiltinEngine()):  # the new signature (with or without defaults for temperature)
    check_engine(engine)


def test_the_trainer_builds_a_users_engine_from_the_config_string(tmp_path):
  """``rollout.engine: test_engines:make_offset_engine``: checked when the config loads (importable,
  callable), the factory's result checked at construction; the run samples through it, pushes after every
  update and recomputes old_logp (mismatch k3 at r = e^−OFFSET every step)."""
  base = {
    "model.synthetic": {"hidden_size": 32, "num_layers": 1},
    "data.arithmetic": {"train_size": 64, "eval_size": 8, "sft_steps": 0},
    "data.max_prompt_tokens": 64,
    "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8},
    "step.chunk_size": None,
    "reward.timeout_s": None,
    "eval.every": 0,
    "run": {"steps": 2, "log_every": 1, "out": str(tmp_path)},
    "devices.mesh": "",
  }
  for bad, msg in (
    ("no_such_module_xyz:make", r"`rollout.engine`: 'no_such_module_xyz:make': cannot import module"),
    ("test_engines:missing", r"`rollout.engine`: 'test_engines:missing': module 'test_engines' has no attribute"),
    ("test_engines:NOT_CALLABLE", r"`rollout.engine`: 'test_engines:NOT_CALLABLE' is not callable \(int\)"),
  ):
    with pytest.raises(ValueError, match=msg):
      load_config(None, {**base, "rollout.engine": bad})
  with pytest.raises(TypeError, match=r"`rollout.engine: test_engines:make_not_an_engine` returned must implement"):
    Trainer(load_config(None, {**base, "rollout.engine": "test_engines:make_not_an_engine"}), log=None)
  trainer = Trainer(load_config(None, {**base, "rollout.engine": "test_engines:make_offset_engine"}), log=None)
  engine = trainer.engine
  assert isinstance(engine, OffsetEngine) and set(engine.settings) == {"config", "max_model_len", "temperature", "seed"}
  records = [r for r in trainer.run() if "loss" in r]
  trainer.close()
  assert len(records) == 2 and engine.pushes == 2 and engine.closed
  for r in records:
    assert r["engine/mismatch_k3"] == pytest.approx(K3_OFFSET, rel=1e-4), r
    assert r["engine/push_s"] >= 0 and r["engine/generate_s"] > 0


def test_an_engine_factory_that_raises_is_one_line(tmp_path, capfd):
  """``rollout.engine: test_engines:make_broken_engine`` raises a RuntimeError when called: ``scripts/train.py``
  exits 2 with one ``error:`` line naming the field, the exception and its message (before: a traceback; only
  ValueError/TypeError were one line); the exception stays the cause (``--traceback``)."""
  from helpers import train_main_here

  argv = [
    "--model.synthetic",
    "{hidden_size: 16, num_layers: 1}",
    "--data.arithmetic",
    "{train_size: 16, eval_size: 2, sft_steps: 0}",
    "--rollout.engine",
    "test_engines:make_broken_engine",
    "--run.out",
    str(tmp_path / "run"),
    "--no-progress",
  ]
  with pytest.raises(SystemExit) as e:
    train_main_here(argv)
  assert e.value.code == 2
  err = capfd.readouterr().err.strip().splitlines()
  assert "Traceback" not in "\n".join(err), err
  assert err[-1].startswith(
    "error: `rollout.engine: test_engines:make_broken_engine`: the factory raised RuntimeError: no GPU for "
    "max_model_len="
  ), err


def test_routing_replay_through_vllm_is_refused_for_a_moe_policy_in_one_line():
  """Issue 35 item 6: vLLM 0.32's CPU build cannot return routed experts (Model Runner V2 needs Triton; checked
  in its venv by tests/test_engine_vllm.py), so a MoE policy with ``rollout.engine: vllm`` and the default
  ``routing_replay: rollout`` is one line naming the reason and the fix; ``none``, a dense policy or the
  built-in sampler pass. Checked on the abstract model (``assemble.check_mesh_fits`` runs it before any weight)."""
  from jaxgrpo.run import assemble, builders

  moe = {"model.synthetic": {"hidden_size": 128, "num_layers": 1, "num_experts": 4, "experts_per_tok": 2}}
  with pytest.raises(ValueError) as e:  # a synthetic MoE: refused at load (composition.check_composition)
    load_config(None, {**moe, "rollout.engine": "vllm", "devices.mesh": ""})
  ok = load_config(None, {**moe, "rollout.engine": "vllm", "rollout.routing_replay": "none"})
  abstract, _ = builders.abstract_policy(ok.model)
  with pytest.raises(ValueError) as e2:  # a model directory's MoE: refused on its abstract config, before weights
    # (a loaded config with a synthetic MoE cannot hold it: stand in for a model directory's config)
    assemble.check_engine_policy(
      SimpleNamespace(rollout=SimpleNamespace(engine="vllm", routing_replay="rollout")), abstract.config
    )
  assert str(e2.value) == str(e.value)
  msg = str(e.value)
  assert (
    "\n" not in msg and "`rollout.routing_replay: none`" in msg and "Triton" in msg and "`rollout.engine: vllm`" in msg
  )
  assemble.check_engine_policy(
    load_config(None, {**moe, "rollout.engine": "vllm", "rollout.routing_replay": "none"}), abstract.config
  )
  assemble.check_engine_policy(load_config(None, moe), abstract.config)  # the built-in sampler replays
  dense = load_config(None, {"rollout.engine": "vllm", "model.synthetic": {"hidden_size": 128}})
  assemble.check_engine_policy(dense, builders.abstract_policy(dense.model)[0].config)
