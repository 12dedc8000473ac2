"""Decode attention over a long cache reads only the filled slots (``jaxgrpo.models.attention.decode_attention_blocks``,
docs/sampling.md "Long rollouts"): the blocks against NumPy's softmax attention written from the formula, and the
samplers over a cache of more than ``DECODE_BLOCKED_FROM`` slots — ``generate``, speculative verify steps, the slot
refill's and the multi-turn sampler's per-row caches — against a teacher-forced dense pass, the whole-cache program and
one device (a mesh over 8 virtual devices)."""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ref_log_probs, run_child
from test_speculative import _teacher_forced as teacher_forced  # float64 log-softmax of a cache-free forward

from jaxgrpo import models
from jaxgrpo.models import attention
from jaxgrpo.rollout.conversation import ConversationSampler
from jaxgrpo.rollout.refill import generate_refill
from jaxgrpo.rollout.sampling import SamplingConfig, SamplingPolicy, generate, lower_generate
from jaxgrpo.rollout.speculative import SpeculativeConfig, generate_speculative


def _numpy_attention(qt, keys, values, mask, scale):
  """softmax(q·kᵀ·scale, masked)·v in float64 over every slot: ``[B, N, G, S, K]``."""
  s = np.einsum("bngsk,bnkt->bngst", qt.astype(np.float64), keys) * scale
  s = np.where(mask[:, None, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bngst,bntk->bngsk", p / p.sum(-1, keepdims=True), values)


@pytest.mark.parametrize("bound", [1, 7, 128, 300, 1000, 1100])
@pytest.mark.parametrize("block", [128, 384])
def test_blocks_equal_softmax_attention_over_the_filled_slots(bound, block):
  """Random keys, values and validity, the queries at the last filled slots; a cache of 1,100 slots (not a multiple of
  either block: the last block's window is shifted back and its repeated slots masked)."""
  rng = np.random.default_rng(bound * block)
  B, N, G, S, K, T = 3, 2, 2, 2, 8, 1100
  qt, keys = rng.standard_normal((B, N, G, S, K)), rng.standard_normal((B, N, K, T))
  values = rng.standard_normal((B, N, T, K))
  q_slot = np.maximum(np.array([bound - 2, bound - 1]), 0)
  mask = (np.arange(T)[None, None] <= q_slot[None, :, None]) & (rng.random((B, 1, T)) < 0.8)
  mask[:, :, q_slot] = True  # a query sees its own slot
  got = attention.decode_attention_blocks(
    *(jnp.asarray(x, jnp.float32) for x in (qt, keys, values)), jnp.asarray(mask), jnp.int32(bound), block=block,
    scale=K**-0.5,
  )  # fmt: skip
  np.testing.assert_allclose(np.asarray(got), _numpy_attention(qt, keys, values, mask, K**-0.5), atol=2e-6)


def test_bad_arguments_are_refused_in_one_line_naming_them():
  qt, keys = jnp.zeros((1, 2, 2, 1, 8)), jnp.zeros((1, 2, 8, 300))
  values, mask = jnp.zeros((1, 2, 300, 8)), jnp.ones((1, 1, 300), bool)
  run = lambda **kw: attention.decode_attention_blocks(
    **{"qt": qt, "keys": keys, "values": values, "mask": mask, "bound": jnp.int32(5), "block": 128, "scale": 1.0, **kw}
  )
  assert run().shape == qt.shape
  with pytest.raises(ValueError, match=r"`qt` must be \[B, N, G, S, K\]; got shape \(1, 2, 8\)$"):
    run(qt=jnp.zeros((1, 2, 8)))
  with pytest.raises(ValueError, match=r"`values` must be \[B, N, T, K\] = \[1, 2, 300, 8\] for `qt`"):
    run(values=jnp.zeros((1, 2, 8, 300)))
  with pytest.raises(ValueError, match=r"`mask` must be \[B, S, T\] = \[1, 1, 300\]"):
    run(mask=jnp.ones((1, 300), bool))
  with pytest.raises(ValueError, match=r"`block` must be an int in \[1, T = 300\]; got 512$"):
    run(block=512)
  with pytest.raises(ValueError, match=r"`attention` must be one of"):
    attention.decode_block("flash", 4096)


def test_the_block_is_chosen_by_the_cache_length_and_the_implementation():
  assert attention.decode_block("auto", attention.DECODE_BLOCKED_FROM - 1) == 0  # short caches: one dense pass
  assert attention.decode_block("dense", 40_000) == 0
  for slots in (1024, 1039, 4096, 32_767):
    block = attention.decode_block("auto", slots)
    assert block % 128 == 0 and block <= slots and -(-slots // block) <= attention.DECODE_MAX_BLOCKS, (slots, block)
  assert attention.decode_block("blockwise", 1039) == 256


def _model(implementation: str) -> nnx.Module:
  cfg = models.Qwen3Config(
    vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
    tie_word_embeddings=True, max_position_embeddings=2048,
  )  # fmt: skip
  graphdef, state = nnx.split(models.build_model(cfg, rngs=nnx.Rngs(0)))
  model = nnx.merge(graphdef, jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, state))
  return models.set_attention(model, implementation)


@pytest.fixture(scope="module")
def long_rollouts():
  """``generate`` over a cache of 24 + 1,016 - 1 = 1,039 slots (blocks of 256) and over the same cache read whole
  (``attention="dense"``), the same key; the blocked model's teacher-forced log-probs (a dense cache-free pass)."""
  prompts = np.zeros((2, 24), np.int32)
  prompts[0, 10:], prompts[1, :] = np.arange(1, 15), np.arange(30, 54)
  mask = prompts > 0
  sampling = SamplingConfig(num_samples=2, max_new_tokens=1016, pad_id=0)
  out = {}
  for impl in ("auto", "dense"):
    out[impl] = generate(_model(impl), prompts, mask, sampling, key=jax.random.key(1))
  out["teacher"] = teacher_forced(_model("dense"), out["auto"], 1.0)
  policy = SamplingPolicy.from_config(sampling, temperature=1.0, vocab_size=61)
  for impl in ("auto", "dense"):  # the decode loop's programs: one block loop per layer inside it, or none
    text = lower_generate(_model(impl), prompts, mask, policy, key=jax.random.key(1)).as_text()
    out[f"{impl}_whiles"] = text.count("stablehlo.while")
  return out


def test_a_long_rollout_reads_the_filled_slots_and_keeps_its_log_probs(long_rollouts):
  """Every sampled token's log-prob equals the teacher-forced pass (1e-5), and the rollout is the whole-cache
  rollout's: the same tokens for the same uniforms, log-probs within 1e-5 (up to a row's first differing token, if
  any: a draw that falls within ~1e-6 of a boundary of the cumulative distribution may go either way)."""
  auto, dense = long_rollouts["auto"], long_rollouts["dense"]
  assert attention.decode_block("auto", 24 + 1016 - 1) == 256
  assert int(np.asarray(auto.mask).sum(1).min()) == 1016  # no stop id: every row runs the whole cache
  assert long_rollouts["auto_whiles"] == long_rollouts["dense_whiles"] + 2  # the 2 layers' block loops
  np.testing.assert_allclose(np.asarray(auto.log_probs), long_rollouts["teacher"], atol=1e-5)
  a, d = np.asarray(auto.completions), np.asarray(dense.completions)
  same = np.cumprod(a == d, axis=1).astype(bool)  # [N, T]: before each row's first differing token
  assert same.mean() > 0.9, same.sum(1)
  diff = np.abs(np.asarray(auto.log_probs) - np.asarray(dense.log_probs))
  assert diff[same].max() <= 1e-5


def test_speculative_decoding_over_a_long_cache_keeps_greedy_and_its_log_probs():
  """Verify steps of k + 1 query rows over per-row cache indices, blocked: greedy equals plain greedy decoding
  (blocked too), and every log-prob the teacher-forced pass's."""
  prompts = np.tile(np.array([[5, 6, 7, 5, 6, 7, 5, 6]], np.int32), (2, 1))
  prompts[1, :3] = 0
  mask = prompts > 0
  sampling = SamplingConfig(num_samples=1, max_new_tokens=1020, pad_id=0)
  model = _model("auto")
  plain = generate(model, prompts, mask, sampling, key=jax.random.key(0), temperature=0.0)
  spec, stats = generate_speculative(
    model, prompts, mask, sampling, key=jax.random.key(0), temperature=0.0,
    speculative=SpeculativeConfig(num_draft=3, ngram=2),
  )  # fmt: skip
  assert int(stats.accepted) > 0 and attention.decode_block("auto", 8 + 1020 - 1 + 3) > 0
  np.testing.assert_array_equal(np.asarray(spec.completions), np.asarray(plain.completions))
  np.testing.assert_allclose(np.asarray(spec.log_probs), teacher_forced(_model("dense"), spec, 1.0), atol=1e-5)


def test_bench_decode_attention_smoke():
  """The benchmark's both ways on a tiny model: blocks chosen, the same tokens, the analytic slots read."""
  path = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_decode_attention.py")
  spec = importlib.util.spec_from_file_location("bench_decode_attention", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out = bench.main(
    "--prompts 1 --samples 2 --prompt-len 8 --new-tokens 1020 --rounds 1 --vocab 61 --hidden 32 --layers 1 "
    "--heads 2 --kv-heads 1 --head-dim 16 --intermediate 64".split()
  )
  assert out["max_logp_diff"] <= 1e-5 and out["same_tokens"] > 0.9 and out["speedup"] > 0
  # 1,027 slots in blocks of 256: step t reads ceil((8 + t) / 256) blocks, at most the cache
  whole, filled = bench.slots_read(8, 1020, 256)
  want = np.mean([min(-(-(8 + t) // 256) * 256, 1027) for t in range(1, 1020)])
  assert whole == 1027 and filled == pytest.approx(want) and filled < 0.7 * whole


def test_slot_refill_over_a_long_cache_keeps_each_rows_log_probs():
  """The refill pool's per-row cache (slots at different fills; a newcomer starts low while the other slot is far
  along), blocked: each row is ``generate``'s row cut at its budget (tokens up to a first differing draw, log-probs
  1e-5) and every log-prob the teacher-forced pass's."""
  prompts = np.array([[0, 0, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], np.int32)
  mask = prompts > 0
  sampling = SamplingConfig(num_samples=2, max_new_tokens=1020, pad_id=0)
  budgets = np.array([300, 1020, 640, 1020], np.int32)
  model = _model("auto")
  refill = generate_refill(
    model, prompts, mask, sampling, key=jax.random.key(5), num_slots=2, refill_every=40, budgets=budgets
  )
  plain = generate(model, prompts, mask, sampling, key=jax.random.key(5))
  assert attention.decode_block("auto", 6 + 1020 - 1) == 256
  lengths = np.asarray(refill.mask).sum(1)
  np.testing.assert_array_equal(lengths, budgets)  # no stop id: every row runs to its budget
  np.testing.assert_allclose(np.asarray(refill.log_probs), teacher_forced(_model("dense"), refill, 1.0), atol=1e-5)
  a, d = np.asarray(refill.completions), np.asarray(plain.completions)
  same = np.cumprod(a == d, axis=1).astype(bool) & np.asarray(refill.mask)
  assert same.sum() > 0.9 * lengths.sum(), same.sum(1)
  assert np.abs(np.asarray(refill.log_probs) - np.asarray(plain.log_probs))[same].max() <= 1e-5


def test_a_multi_turn_cache_over_a_long_conversation_keeps_the_log_probs():
  """The multi-turn sampler's per-row cache kept across turns (1,100 slots, blocks of 256): two turns of up to 500
  tokens with an observation appended between them; every sampled token's log-prob equals a teacher-forced dense
  pass over the whole conversation (1e-5)."""
  model = _model("auto")
  rows = [list(p) for p in ([3, 4, 5, 6, 7], [9, 10, 11]) for _ in range(2)]  # N = 2 prompts x G = 2
  conv = ConversationSampler(model, [list(r) for r in rows], SamplingConfig(num_samples=2, pad_id=0), max_len=1100)
  assert attention.decode_block("auto", 1100) == 256
  sampled = [[] for _ in rows]  # (position in the conversation, log-prob) of every sampled token
  for turn in range(2):
    appended = {i: [20 + i, 21, 22] for i in range(4)} if turn else None
    if appended:
      for i, ids in appended.items():
        rows[i] += ids
    out = conv.turn([(jax.random.key(turn), [0, 1, 2, 3])], max_new_tokens=500, appended=appended)
    for i, (tokens, logps) in out.items():
      sampled[i] += [(len(rows[i]) + j, float(lp)) for j, lp in enumerate(logps)]
      rows[i] += [int(t) for t in tokens]
  assert min(len(r) for r in rows) > 1000  # past the first blocks: the later turn reads 4 blocks
  width = max(map(len, rows))
  tokens = np.zeros((4, width), np.int32)
  for i, r in enumerate(rows):
    tokens[i, : len(r)] = r
  mask = np.arange(width)[None] < np.array([len(r) for r in rows])[:, None]
  logp = np.asarray(ref_log_probs(_model("dense"), jnp.asarray(tokens), jnp.asarray(mask)))  # [N, L]: token k's
  for i, pairs in enumerate(sampled):
    want = [logp[i, k] for k, _ in pairs]
    np.testing.assert_allclose([lp for _, lp in pairs], want, atol=1e-5, err_msg=f"row {i}")


_SHARDED = r"""
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
from jaxgrpo import models
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.sampling import SamplingConfig, generate
from jaxgrpo.step import train

assert jax.device_count() == 8
cfg = models.Qwen3Config(
  vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
  tie_word_embeddings=True, max_position_embeddings=2048,
)
graphdef, state = nnx.split(models.build_model(cfg, rngs=nnx.Rngs(0)))
prompts = np.arange(1, 4 * 16 + 1, dtype=np.int32).reshape(4, 16) % 63 + 1
prompts[1, :5] = 0
sampling = SamplingConfig(num_samples=2, max_new_tokens=1012, pad_id=0)
out = {}
for spec in ("data=1", "data=2,fsdp=2,tensor=2"):
  mesh = shd.make_mesh(spec, devices=jax.devices()[:1] if spec == "data=1" else None)
  model = nnx.merge(graphdef, jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, state))
  _, params, _ = train.init_train_state(model, optax.sgd(0.1), mesh)
  model = nnx.merge(graphdef, params.params)
  tokens, mask = shd.place_batch((prompts, prompts > 0), mesh)
  with jax.set_mesh(mesh):
    r = generate(model, tokens, mask, sampling, key=jax.random.key(2))
  out[spec] = (np.asarray(r.completions), np.asarray(r.log_probs))
  if spec != "data=1":
    assert len(r.completions.sharding.device_set) == 8, r.completions.sharding
(a, la), (b, lb) = out.values()
same = np.cumprod(a == b, axis=1).astype(bool)
assert same.mean() > 0.9, same.sum(1)
np.testing.assert_allclose(la[same], lb[same], atol=1e-5)
print("OK", same.mean())
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_long_rollout_on_a_sharded_mesh_equals_one_device_8_devices():
  """The blocks over a cache whose rows and kv heads are split (``data=2, fsdp=2, tensor=2``, 1,027 slots): the
  one-device rollout's tokens and log-probs (1e-5, up to a row's first differing draw)."""
  assert "OK" in run_child(_SHARDED, devices=8)
