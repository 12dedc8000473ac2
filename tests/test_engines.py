"""The engine interface and the built-in engine (the vLLM engine: tests/test_engine_vllm.py)."""

from __future__ import annotations

import jax
import numpy as np
from helpers import tiny_model

from jaxgrpo.engines import BuiltinEngine, Engine, finish_reasons
from jaxgrpo.sampling import generate


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
