"""The engine interface and the built-in engine (the vLLM engine: tests/test_engine_vllm.py)."""

from __future__ import annotations

import importlib.util
import time

import jax
import numpy as np
import pytest
from helpers import tiny_model

from jaxgrpo.engines import BuiltinEngine, Engine, finish_reasons
from jaxgrpo.engines.vllm import INSTALL_HINT
from jaxgrpo.sampling import generate
from jaxgrpo.specs import load_config
from jaxgrpo.trainer import Trainer


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
  kw = dict(num_samples=3, max_new_tokens=6, temperature=1.0, eos_ids=(7,), pad_id=0, key=jax.random.key(3))
  engine.push_weights(model)
  gen = engine.generate(tokens, mask, **kw)
  ref = generate(model, tokens, mask, **kw)
  for a, b in zip(gen.rollout, ref):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert gen.finish_reasons.shape == (6,)
  np.testing.assert_array_equal(gen.finish_reasons, finish_reasons(ref.completions, ref.mask, (7,)))
  engine.push_weights(other)
  np.testing.assert_array_equal(
    np.asarray(engine.generate(tokens, mask, **kw).rollout.log_probs),
    np.asarray(generate(other, tokens, mask, **kw).log_probs),
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
