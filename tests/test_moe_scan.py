"""Scanned mixture-of-experts layers (``scan_layers=True`` for a MoE whose every layer is sparse, as Qwen3-30B-A3B).

References: transformers' logits of the same checkpoint (the HF files stay per layer and per expert), and the loop
model (its values are checked against transformers in tests/test_moe_hf.py): log-probs, gradients of every
parameter, the routes and routing replay, with full remat inside the scanned body; plus the HF round trip of the
stacked ``[L, E, ...]`` experts, the sampler. The refusal of a config with dense layers: tests/test_scan_layers.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import flat_params
from hf_utils import build_hf_model, hf_logits, jax_logits, left_padded_batch, sharp_moe_model, tiny_moe_config

from jaxgrpo import models
from jaxgrpo.models import moe
from jaxgrpo.models.log_probs import completion_log_probs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")  # tests/conftest.py

#: every layer sparse: Qwen3-MoE without mlp_only_layers (8 experts, top-2), Qwen2-MoE (shared expert); two layers
#: each: the scan stacks and the loop unrolls two different sparse layers (a third adds nothing to check, and the
#: loop model's programs compile in two thirds of the time)
ALL_SPARSE = {
  "qwen3_moe": tiny_moe_config("qwen3_moe", mlp_only_layers=[], num_hidden_layers=2),
  "qwen2_moe": tiny_moe_config("qwen2_moe", num_hidden_layers=2),
}


def _loop_model(family: str, seed: int = 0):
  """A random all-sparse loop model with O(1) router logits (routing far from uniform)."""
  return sharp_moe_model(ALL_SPARSE[family], seed)


def _forward(model, args, replay):
  """Log-probs summed (the loss), the log-probs, and the stacked routes of one forward under ``replay``."""
  graphdef, state = nnx.split(model)

  def loss(state):
    with moe.routing_scope(replay=replay) as scope:
      lp, _ = completion_log_probs(nnx.merge(graphdef, state), *args)
    route = scope.stacked()
    return jnp.sum(lp), (lp, route.logits, route.experts)

  grads, (lp, logits, experts) = jax.jit(jax.grad(loss, has_aux=True))(state)
  return grads, np.asarray(lp), np.asarray(logits), np.asarray(experts)


@pytest.mark.parametrize("family", sorted(ALL_SPARSE))
def test_scanned_moe_equals_the_loop_values_gradients_routes_and_replay(family):
  """Float32, full remat inside the scan: log-probs, every parameter's gradient (routers, experts, attention, shared
  expert), the router logits and the chosen experts of the scanned model equal the loop model's within 1e-6; with
  replayed experts (other than the router's) both use exactly those experts and give the same log-probs."""
  loop = _loop_model(family)
  loop.remat = models.RematPolicy.FULL
  scan = models.to_scan_layers(loop)
  assert scan.scan_layers and scan.layers.mlp.gate.shape[:2] == (loop.config.num_layers, loop.config.num_experts)
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, 128, (4, 10)), jnp.int32)
  mask = jnp.asarray(np.arange(10)[None] >= np.array([0, 2, 1, 3])[:, None])
  args = (tokens[:, :4], mask[:, :4], tokens[:, 4:], mask[:, 4:])
  m, k = len(loop.moe_layers), loop.config.num_experts_per_tok
  free = _forward(loop, args, None)
  other = jnp.asarray((free[3] + 1) % loop.config.num_experts, jnp.uint8)  # a different expert for every token
  for replay in (None, other):
    g_loop, lp_loop, logits_loop, experts_loop = _forward(loop, args, replay) if replay is not None else free
    g_scan, lp_scan, logits_scan, experts_scan = _forward(scan, args, replay)
    assert experts_scan.shape == (4, 10, m, k) and logits_scan.shape == (4, 10, m, loop.config.num_experts)
    np.testing.assert_array_equal(experts_scan, experts_loop)
    np.testing.assert_allclose(logits_scan, logits_loop, rtol=0, atol=1e-6)
    np.testing.assert_allclose(lp_scan, lp_loop, rtol=0, atol=1e-6)
    want = flat_params(g_loop)
    got = flat_params(nnx.state(models.to_loop_layers(nnx.merge(nnx.split(scan)[0], g_scan))))
    assert sorted(got, key=str) == sorted(want, key=str)
    for path in want:
      scale = max(1.0, float(np.abs(want[path]).max()))
      np.testing.assert_allclose(got[path], want[path], rtol=0, atol=1e-6 * scale, err_msg=str(path))
    if replay is not None:
      np.testing.assert_array_equal(experts_scan, np.asarray(other))
      assert np.abs(lp_scan - free[1])[np.asarray(mask[:, 4:])].max() > 1e-3  # the replay changed the forward


def test_scanned_moe_loads_matches_transformers_and_round_trips(tmp_path):
  """load_hf(scan_layers=True) assembles the experts ``[L, E, D, Fe]`` from the per-layer, per-expert HF tensors:
  logits equal transformers' (and the loop model's within 1e-6); save_hf of the scanned model writes per-expert
  tensors that transformers loads back to the same logits, and load_hf of them gives the same parameters."""
  hf_model = build_hf_model(ALL_SPARSE["qwen3_moe"], seed=1)
  hf_model.save_pretrained(str(tmp_path / "hf"))
  scan = models.load_hf(tmp_path / "hf", scan_layers=True)
  loop = models.load_hf(tmp_path / "hf")
  cfg = scan.config
  assert scan.scan_layers and scan.layers.mlp.gate.shape == (2, 8, cfg.hidden_size, cfg.moe_intermediate_size)
  assert scan.layers.mlp.gate.get_metadata()["out_sharding"] == ("layers", "expert", "embed", "expert_mlp")
  tokens, mask = left_padded_batch(np.random.default_rng(0), 3, 10, 128, pads=[0, 4, 2])
  want = hf_logits(hf_model, tokens, mask)
  got = jax_logits(scan, tokens, mask)
  assert np.abs(got - want)[mask].max() < 1e-4
  assert np.abs(got - jax_logits(loop, tokens, mask))[mask].max() < 1e-6
  models.save_hf(scan, tmp_path / "out")
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
  assert np.abs(hf_logits(back, tokens, mask) - want)[mask].max() < 1e-5
  again = flat_params(nnx.state(models.load_hf(tmp_path / "out", scan_layers=True)))
  for path, value in flat_params(nnx.state(scan)).items():
    np.testing.assert_array_equal(again[path], value, err_msg=str(path))


def test_scanned_moe_samples_and_records_routes_as_the_loop():
  """generate() of a scanned MoE (unstacked in its program) samples the loop model's tokens and records its
  experts bit for bit."""
  from jaxgrpo.rollout.sampling import SamplingConfig, generate

  loop = _loop_model("qwen3_moe")
  scan = models.to_scan_layers(loop)
  rng = np.random.default_rng(2)
  prompts = jnp.asarray(rng.integers(1, 128, (2, 5)), jnp.int32)
  pmask = jnp.asarray(np.arange(5)[None] >= np.array([[0], [2]]))
  sc = SamplingConfig(num_samples=2, max_new_tokens=5, pad_id=0, record_routing=True)
  want = generate(loop, prompts, pmask, sc, key=jax.random.key(0))
  got = generate(scan, prompts, pmask, sc, key=jax.random.key(0))
  for name in ("completions", "log_probs", "routing"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
