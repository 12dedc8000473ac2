"""LoRA / QLoRA as a mode of the train step, the iteration and the trainer (issue 16, phase 2).

References: the hand-written full-batch SGD update of ``helpers.reference_update`` (its adapter
entries), NumPy log-softmax of the plain base model, the model's own arrays before training (bit
for bit), XLA's memory analysis of the compiled step, transformers and peft for the exports.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import G, flat_params, make_batch, numpy_log_probs, reference_update, run_child, tiny_model

from jaxgrpo.kernels.config import preset
from jaxgrpo.loop import iteration
from jaxgrpo.models import Qwen3Config, build_model, lora
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.rollout.sampling import generate
from jaxgrpo.step import train

LR = 0.5


def _lora_model(*, seed=0, dropout=0.0, quantize=None, b_std=0.05, layers=2):
  """The helpers' tiny Qwen3 with rank-4 adapters on every projection and trained-like B (so that A
  gets gradients and dropout changes the log-probs)."""
  model = tiny_model(seed=seed, layers=layers)
  cfg = lora.LoRAConfig(rank=4, alpha=8, dropout=dropout, quantize=quantize, group_size=8)
  lora.apply_lora(model, cfg, key=jax.random.key(1))
  rng = np.random.default_rng(seed + 1)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    if path[-1] == "b" and b_std:
      var.set_value(jnp.asarray(b_std * rng.standard_normal(var.shape), jnp.float32))
  return model


def _step(model, *, opt, micro=1, dropout_key=None, config=None, max_grad_norm=None, mesh=None, packing=None):
  mesh = mesh or shd.make_mesh("data=1", devices=jax.devices()[:1])
  graphdef, state, shardings = train.init_train_state(model, opt, mesh, trainable=nnx.LoRAParam)
  tc = train.TrainConfig(
    micro_batches=micro,
    max_grad_norm=max_grad_norm,
    group_size=G,
    chunk_size=4,
    packing=packing,
  )
  step = train.make_train_step(
    graphdef,
    opt,
    config or preset("grpo"),
    mesh=mesh,
    shardings=shardings,
    train_config=tc,
    dropout_key=dropout_key,
  )
  return step, state


def _batch():
  return make_batch()._replace(ref_logp=None)


def _host(tree):
  return jax.tree.map(np.asarray, tree)


# --------------------------------------------------------------------------------------------
# the step: only adapters change, Adam state of the adapters, against the hand-written update


def test_lora_step_is_the_handwritten_update_of_the_adapters_and_the_base_is_untouched():
  """One LoRA step (SGD, 2 micro-batches) == the adapter entries of a hand-written full-batch SGD
  step on the whole model (no clipping: the other entries do not enter the adapters' update); the
  frozen base arrays are returned as the very same, unchanged arrays, over several steps; the Adam
  state of a LoRA run is that of the adapters."""
  batch = _batch()
  want, want_metrics, _ = reference_update(_lora_model(layers=1), batch, preset("grpo"), lr=LR, max_grad_norm=1e30)
  model = _lora_model(layers=1)  # one layer: the adapters' update does not depend on the depth
  step, state = _step(model, opt=optax.sgd(LR), micro=2)
  frozen_before = _host(state.frozen)
  adapters_before = flat_params(state.params)
  frozen_ids = [id(x) for x in jax.tree.leaves(state.frozen)]
  new, metrics = step(state, batch)
  got = flat_params(new.params)
  assert set(got) == set(adapters_before) and all(k[-1] in ("a", "b") for k in got)
  for k in got:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=str(k))
    assert np.abs(got[k] - adapters_before[k]).max() > 0, k  # A and B both moved
  assert float(metrics["loss"]) == pytest.approx(want_metrics["loss"], rel=1e-5, abs=1e-7)
  for _ in range(2):  # the same program again
    new, metrics = step(new, batch)
    assert np.isfinite(float(metrics["loss"]))
  assert [id(x) for x in jax.tree.leaves(new.frozen)] == frozen_ids  # no copy, no donation
  jax.tree.map(np.testing.assert_array_equal, frozen_before, _host(new.frozen))
  frozen_flat = dict(nnx.to_flat_state(frozen_before))
  for path, v in nnx.to_flat_state(nnx.state(model)):  # the model's own arrays: not donated, not changed
    assert not v.get_value().is_deleted(), path
  for path, v in nnx.to_flat_state(nnx.state(iteration.policy_model(step.graphdef, new))):
    if not isinstance(v, nnx.LoRAParam):
      np.testing.assert_array_equal(np.asarray(v.get_value()), frozen_flat[path].get_value(), err_msg=str(path))

  # Adam: two moments per adapter entry, none for the base
  mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
  _, adam, _ = train.init_train_state(model, optax.adamw(1e-2), mesh, trainable=nnx.LoRAParam)
  counts = lora.count_params(model)
  assert sum(x.size for x in jax.tree.leaves(adam.opt_state) if x.ndim > 0) == 2 * counts.adapter
  assert counts.adapter == sum(x.size for x in jax.tree.leaves(adam.params))
  assert sum(x.nbytes for x in jax.tree.leaves(adam.opt_state)) <= lora.adam_state_bytes(model).lora + 64


def test_qlora_trains_the_adapters_and_keeps_the_codes():
  """NF4 base (int8: the 8-device test) with float32 adapters."""
  model = _lora_model(quantize="nf4", layers=1)
  with pytest.raises(ValueError, match=r"non-floating-point arrays .*codes.*trainable=nnx.LoRAParam"):
    train.init_train_state(model, optax.sgd(LR), shd.make_mesh("data=1", devices=jax.devices()[:1]))
  step, state = _step(model, opt=optax.adam(1e-2))
  codes = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state.frozen) if p[-1] in ("codes", "scales")}
  assert codes and all(p[-1] != "codes" or c.dtype in (np.int8, np.uint8) for p, c in codes.items())
  before = flat_params(state.params)
  for _ in range(2):
    state, metrics = step(state, _batch())
  assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
  after = flat_params(state.params)
  assert all(np.abs(after[k] - before[k]).max() > 0 for k in before)
  for p, v in nnx.to_flat_state(state.frozen):
    if p in codes:
      np.testing.assert_array_equal(np.asarray(v.get_value()), codes[p], err_msg=str(p))


def test_frozen_base_is_an_argument_not_a_copy_in_the_compiled_step():
  """XLA's memory analysis of the compiled LoRA step on a model whose base (21 MB) dwarfs the
  activations of a small batch (32 tokens): the base is an argument only — neither an output nor
  among the temporaries (activations, below a quarter of it), so the step holds no copy of it; the
  outputs are the adapters, their Adam moments, the step and the metrics, written over the donated
  inputs."""
  cfg = Qwen3Config(
    vocab_size=1024,
    hidden_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=128,
    intermediate_size=1024,
    tie_word_embeddings=True,
  )
  model = build_model(cfg, rngs=nnx.Rngs(0))
  lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8), key=jax.random.key(0))
  step, state = _step(model, opt=optax.adam(1e-3))
  frozen_bytes = sum(x.nbytes for x in jax.tree.leaves(state.frozen))
  trained_bytes = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
  ma = step.lower(state, make_batch(b=4, p=2, t=6)._replace(ref_logp=None)).compile().memory_analysis()
  assert frozen_bytes > 2e7 and trained_bytes < 0.05 * frozen_bytes
  assert ma.argument_size_in_bytes >= frozen_bytes + trained_bytes
  assert ma.output_size_in_bytes < trained_bytes + 4096
  assert ma.alias_size_in_bytes >= trained_bytes - 64
  assert ma.temp_size_in_bytes < 0.25 * frozen_bytes, (ma.temp_size_in_bytes, frozen_bytes)


def test_dropout_needs_a_key_and_a_packed_batch_its_rows():
  """Errors at trace time, nothing compiled (that the key is used: the micro-batch test)."""
  model = _lora_model(dropout=0.3, layers=1)
  step, state = _step(model, opt=optax.sgd(LR))
  with pytest.raises(ValueError, match="dropout 0.3 but make_train_step got no dropout_key"):
    step(state, _batch())
  with pytest.raises(TypeError, match="dropout_key must be a typed PRNG key"):
    _step(model, opt=optax.sgd(LR), dropout_key=jnp.zeros(3, jnp.uint32))
  step, state = _step(model, opt=optax.sgd(LR), dropout_key=jax.random.key(0), packing=16)
  packed = step.pack(_batch())
  with pytest.raises(ValueError, match=r"dropout 0.3 and batch.packed has no row_in_slot .*step.pack"):
    step(state, packed._replace(packed=packed.packed._replace(row_in_slot=None)))


def _two_updates(packing, micro, key=3, dropout=0.3):
  model = _lora_model(dropout=dropout, layers=1)
  init = flat_params(nnx.state(model, nnx.LoRAParam))
  step, state = _step(model, opt=optax.sgd(LR, momentum=0.9), micro=micro, dropout_key=jax.random.key(key),
                      packing=packing)  # fmt: skip
  for _ in range(2):
    state, metrics = step(state, _batch())
  return np.concatenate([(flat_params(state.params)[k] - init[k]).ravel() for k in sorted(init)]), metrics


@pytest.mark.slow
def test_packed_step_with_dropout_equals_the_unpacked_step():
  """LoRA adapter dropout composes with packing: each token's mask comes from its sequence's row key and its
  position (``jaxgrpo.models.log_probs.token_dropout_keys``), wherever the token sits, so two updates of the packed
  step (2 micro-batches) equal the unpacked step's with the same run key — and differ from the updates without
  dropout and with another key (the masks reach the adapters)."""
  unpacked, m_unpacked = _two_updates(None, 2)
  packed, m_packed = _two_updates(32, 2)
  assert np.abs(unpacked).max() > 1e-3
  assert np.abs(packed - unpacked).max() <= 1e-5 * np.abs(unpacked).max()
  assert float(m_packed["loss"]) == pytest.approx(float(m_unpacked["loss"]), rel=1e-5, abs=1e-7)
  assert np.abs(_two_updates(32, 2, dropout=0.0)[0] - unpacked).max() > 1e-2 * np.abs(unpacked).max()
  assert np.abs(_two_updates(32, 2, key=4)[0] - unpacked).max() > 1e-2 * np.abs(unpacked).max()


@pytest.mark.parametrize("sharing", ["prompt", "tree"])
def test_prefix_trees_share_the_dropout_masks_of_the_tokens_they_share(sharing):
  """With prefix sharing a shared token is computed once, with the mask of the sequence that laid it out. When the
  sequences of a group have one row key, the row-wise forward draws those same masks for the tokens they share
  (same key, same position), so the packed trees' log-probs and adapter gradients equal the row-wise ones."""
  from jaxgrpo.models.log_probs import completion_log_probs, packed_log_probs

  model = _lora_model(dropout=0.3, layers=1)
  batch = _batch()
  b = np.shape(batch.completions)[0]
  keys = jax.random.split(jax.random.key(5), b // G)[np.repeat(np.arange(b // G), G)]  # one key per group
  pk = train.pack_batch(batch, row_length=32, sharing=sharing).packed
  cols = [jnp.asarray(x) for x in (batch.prompt_tokens, batch.prompt_mask, batch.completions, batch.mask)]
  w = jnp.asarray(np.random.default_rng(0).standard_normal(np.shape(batch.completions)), jnp.float32)
  adapters, rest = nnx.state(model, nnx.LoRAParam, ...)
  graphdef = nnx.graphdef(model)

  def rowwise(a):
    return completion_log_probs(nnx.merge(graphdef, a, rest), *cols, dropout_key=keys)[0]

  def tree(a):
    args = [jnp.asarray(x) for x in (pk.tokens, pk.positions, pk.segment_ids, pk.head_index, pk.unpack_index)]
    m = nnx.merge(graphdef, a, rest)
    return packed_log_probs(m, *args, kv_end=jnp.asarray(pk.kv_end), dropout_key=keys, row_in_slot=pk.row_in_slot)[0]

  mask = np.asarray(batch.mask)
  want, got = (np.asarray(jax.jit(f)(adapters)) for f in (rowwise, tree))
  np.testing.assert_allclose(got[mask], want[mask], atol=2e-5)
  plain = np.asarray(completion_log_probs(model, *cols)[0])
  assert np.abs(plain - want)[mask].max() > 1e-3  # dropout is on
  grad = lambda f: flat_params(jax.jit(jax.grad(lambda a: jnp.sum(f(a) * w)))(adapters))
  g_want, g_got = grad(rowwise), grad(tree)
  for k in g_want:
    np.testing.assert_allclose(g_got[k], g_want[k], atol=1e-5 * np.abs(g_want[k]).max() + 1e-7, err_msg=k)


@pytest.mark.slow
def test_micro_batches_change_nothing_with_lora_dropout():
  """Per-row dropout keys: K = 1 and K = 4 give the same two updates (SGD with momentum); another key
  gives other updates (the key reaches the adapters) from the same program (the key is an argument of
  the compiled step, not a constant in it: a new seed does not recompile)."""
  model = _lora_model(dropout=0.3, layers=1)
  init = flat_params(nnx.state(model, nnx.LoRAParam))
  out, programs = {}, {}
  for micro, key in ((1, 3), (4, 3), (4, 4)):
    step, state = _step(model, opt=optax.sgd(LR, momentum=0.9), micro=micro, dropout_key=jax.random.key(key))
    programs[micro, key] = step.lower(state, _batch()).as_text()
    for _ in range(2):
      state, _ = step(state, _batch())
    out[micro, key] = np.concatenate([(flat_params(state.params)[k] - init[k]).ravel() for k in sorted(init)])
  u1 = out[1, 3]
  assert np.abs(u1).max() > 1e-3
  assert np.abs(out[4, 3] - u1).max() <= 1e-6 * np.abs(u1).max()
  assert np.abs(out[4, 4] - u1).max() > 1e-2 * np.abs(u1).max()
  assert programs[4, 3] == programs[4, 4] and programs[1, 3] != programs[4, 3]


# --------------------------------------------------------------------------------------------
# mesh invariance (1 vs 8 devices), one child process

_MESHES = r"""
import jax, numpy as np, optax
from jax.sharding import PartitionSpec as P
from flax import nnx
from helpers import G, flat_params, make_batch
from test_lora_train import _lora_model
from jaxgrpo.parallel import sharding as shd; from jaxgrpo.step import train
from jaxgrpo.kernels.config import preset

assert jax.device_count() == 8
MESHES = ["data=1", "data=2,fsdp=2,tensor=2"]
batch = make_batch()
for quantize, dropout in ((None, 0.2), ("int8", 0.0)):
  results = {}
  for spec in MESHES:
    mesh = shd.make_mesh(spec, devices=jax.devices()[:1] if spec == "data=1" else None)
    model = _lora_model(dropout=dropout, quantize=quantize, layers=1)
    opt = optax.sgd(0.5, momentum=0.9)
    graphdef, state, shardings = train.init_train_state(model, opt, mesh, trainable=nnx.LoRAParam)
    step = train.make_train_step(graphdef, opt, preset("grpo", beta=0.04), mesh=mesh, shardings=shardings,
                                 train_config=train.TrainConfig(micro_batches=2, group_size=G, chunk_size=8),
                                 dropout_key=jax.random.key(5))
    b = shd.place_batch(batch, mesh)
    for _ in range(2):
      state, metrics = step(state, b)
    if spec != "data=1":
      layer, mom = state.params["layers"][0], state.opt_state[0].trace["layers"][0]
      for tree in (layer, mom):
        assert tree["mlp"]["gate_lora"]["a"][...].sharding.spec == P("fsdp", None)
        assert tree["mlp"]["gate_lora"]["b"][...].sharding.spec == P(None, "tensor")
        assert tree["attn"]["q_lora"]["b"][...].sharding.spec == P(None, "tensor", None)
      base = state.frozen["layers"][0]["mlp"]["gate"]
      w = base["codes"][...] if quantize else base[...]
      assert w.sharding.spec == P("fsdp", "tensor"), w.sharding
    results[spec] = flat_params(state.params)
    print(quantize, spec, float(metrics["loss"]), float(metrics["grad_norm"]))
  for spec in MESHES[1:]:
    for k in results["data=1"]:
      np.testing.assert_allclose(results[spec][k], results["data=1"][k], rtol=1e-5, atol=1e-7,
                                 err_msg=f"{quantize} {spec} {k}")
print("OK")
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_mesh_invariance_lora_and_qlora_8_devices():
  assert run_child(_MESHES, devices=8).strip().endswith("OK")


# --------------------------------------------------------------------------------------------
# the reference: the base model on the frozen arrays


def test_packed_lora_step_with_a_reference_is_the_handwritten_update_and_the_reference_is_the_base():
  """Packing + β > 0: the reference pass (packed too) is the plain base model on the state's own frozen
  arrays (NumPy log-softmax of the model before the adapters were added); the packed LoRA step with
  that reference is the hand-written full-batch SGD update with the k3 KL term."""
  config = preset("grpo", beta=0.04)
  model = _lora_model(layers=1)
  step, state = _step(model, opt=optax.sgd(LR), config=config, micro=2, packing=16)
  reference = iteration.make_reference(step, state)
  assert all(a is b for a, b in zip(jax.tree.leaves(reference.params), jax.tree.leaves(state.frozen)))
  with pytest.raises(TypeError, match="needs the TrainState"):
    iteration.make_reference(step, state.params)
  batch = make_batch()
  got = np.asarray(reference.log_probs(batch))
  want = numpy_log_probs(tiny_model(layers=1), batch)  # the plain model the adapters were added to
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
  adapted = numpy_log_probs(iteration.policy_model(step.graphdef, state), batch)
  assert np.abs(adapted - want).max() > 1e-3  # the adapters change the policy, not the reference
  batch = reference(batch)
  update, _, _ = reference_update(_lora_model(layers=1), batch, config, lr=LR, max_grad_norm=1e30)
  state, _ = step(state, batch)
  for k, v in flat_params(state.params).items():
    np.testing.assert_allclose(v, update[k], rtol=1e-5, atol=1e-7, err_msg=str(k))
  np.testing.assert_array_equal(np.asarray(reference.log_probs(batch)), got)  # still valid, unchanged


def test_sampling_config_merge_lora_samples_the_merged_model():
  model = _lora_model(b_std=0.3, layers=1)
  prompts = jnp.asarray(make_batch().prompt_tokens[::4])
  pmask = jnp.asarray(make_batch().prompt_mask[::4])
  sampling = iteration.SamplingConfig(num_samples=2, max_new_tokens=5, merge_lora=True)
  got = iteration.sample(model, prompts, pmask, sampling, key=jax.random.key(2))
  plain = iteration.SamplingConfig(num_samples=2, max_new_tokens=5, pad_id=0, suppress_ids=None)
  want = generate(lora.merge_lora(model), prompts, pmask, plain, key=jax.random.key(2))
  np.testing.assert_array_equal(np.asarray(got.completions), np.asarray(want.completions))
  np.testing.assert_array_equal(np.asarray(got.log_probs), np.asarray(want.log_probs))


# --------------------------------------------------------------------------------------------
# the trainer: exact resume of adapters-only checkpoints, refusal on other base weights, export
# (merged and PEFT after real training steps; every family's exports: test_lora_hf)


def _run_config(out, steps, **over):
  from jaxgrpo.run import specs

  d = {
    "model.synthetic": {"hidden_size": 32, "num_layers": 1},
    "data.arithmetic": {
      "train_size": 64,
      "eval_size": 0,  # no held-out set, no evaluation: not what is tested here
      "sft_steps": 2,
      "sft_learning_rate": 1e-2,
      "sft_batch_size": 16,
    },
    "data.max_prompt_tokens": 64,
    "rollout.group_size": 4,
    "rollout.prompts_per_step": 2,
    "rollout.max_new_tokens": 16,
    "optim.learning_rate": 3e-3,
    "step.temperature": 1.5,
    "step.chunk_size": None,
    "objective.beta": 0.04,
    "reward.timeout_s": None,
    "checkpoint.every": 1,
    "run.out": str(out),
    "run.steps": steps,
    "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.1},
  }
  d.update(over)
  return specs.load_config(None, d)


# varies within every group whatever the (barely warmed-up) model writes: real updates in a few steps
_LENGTH_REWARD = {"length": (lambda prompts, completions, **_: [len(c) / 16 for c in completions], 1.0)}


def _train(cfg, *, resume=False):
  from jaxgrpo.run.trainer import Trainer
  from jaxgrpo.services import checkpoint as ck

  with ck.Checkpointer(ck.checkpoint_dir(cfg.run.out), async_save=False, log=None) as c:
    restore_fn = c.restore_fn if resume else None
    trainer = Trainer(cfg, log=None, checkpoint_fn=c.checkpoint_fn, restore_fn=restore_fn, reward_fns=_LENGTH_REWARD)
    records = trainer.run()
  timing = ("tokens_per_sec", "step_time", "rollout_time")
  return trainer, [{k: v for k, v in r.items() if k not in timing} for r in records]


@pytest.mark.slow
def test_trainer_lora_resume_is_exact_refuses_other_base_weights_and_exports(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  from hf_utils import jax_logits
  from safetensors.numpy import load_file

  from jaxgrpo import models
  from jaxgrpo.run import builders
  from jaxgrpo.services import checkpoint as ck

  straight, want = _train(_run_config(tmp_path / "straight", 3, **{"run.save_model": True}))
  assert all(r["grad_norm"] > 0 for r in want if "grad_norm" in r)
  shutil.copytree(tmp_path / "straight" / "checkpoints", tmp_path / "cut" / "checkpoints")
  shutil.rmtree(tmp_path / "cut" / "checkpoints" / "3")  # as if the run had stopped after saving step 2
  resumed, got = _train(_run_config(tmp_path / "cut", 3), resume=True)
  assert resumed.resumed and [r["step"] for r in got] == [3] and [r["step"] for r in want] == [1, 2, 3]
  assert got == [r for r in want if r["step"] > 2]
  for a, b in zip(jax.tree.leaves(straight.state.train.params), jax.tree.leaves(resumed.state.train.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # the checkpoint holds the adapters, their optimizer state and the base fingerprint only
  meta = ck.read_meta(tmp_path / "cut")
  names = [k for k in meta["params_signature"]]
  assert names and all("_lora" in k for k in names)
  fp = lora.base_fingerprint(resumed.model)
  assert meta["fingerprints"] == {builders.BASE_WEIGHTS: fp} and meta["config"]["lora"]["rank"] == 4

  # other base weights are refused naming both digests (a longer warm-up: other weights, same identity
  # fields; base_fingerprint of other weights: test_lora.py), and so is another LoRA config
  from jaxgrpo.run.trainer import run_meta

  template = resumed.state.snapshot()
  other = "0" * 64
  with ck.Checkpointer(ck.checkpoint_dir(tmp_path / "cut"), async_save=False, log=None) as c:
    with pytest.raises(ck.CheckpointError, match=rf"base_weights: {fp} in the checkpoint, {other} now"):
      c.restore_fn(run_meta(_run_config(tmp_path / "cut", 6), base_fingerprint=other), template)
    rank8 = _run_config(tmp_path / "cut", 6, lora={"rank": 8, "alpha": 8.0, "dropout": 0.1})
    with pytest.raises(ck.CheckpointError, match=r"lora.rank: 4 in the checkpoint, 8 now"):
      c.restore_fn(run_meta(rank8, base_fingerprint=fp), template)
    assert c.restore_fn(run_meta(_run_config(tmp_path / "cut", 6), base_fingerprint=fp), template) is not None

  # end-of-run export: merged (transformers) and PEFT (on the base written as HF) reproduce the policy
  policy = straight.policy()
  tokens = np.asarray(make_batch().prompt_tokens[:3], np.int64) % policy.config.vocab_size
  mask = np.ones(tokens.shape, bool)
  ours = jax_logits(policy, tokens, mask)  # the policy's logits, one jitted forward (all-ones mask)
  out = tmp_path / "straight"
  merged = transformers.AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
  with torch.no_grad():
    assert np.abs(merged(torch.from_numpy(tokens)).logits.numpy() - ours).max() < 1e-4
  models.save_hf(lora.base_model(policy), tmp_path / "base_hf")
  base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base_hf", dtype=torch.float32).eval()
  with torch.no_grad():
    peft_logits = peft.PeftModel.from_pretrained(base, out / "model-peft").eval()(torch.from_numpy(tokens)).logits
  assert np.abs(peft_logits.numpy() - ours).max() < 1e-4
  # ... and scripts/export_hf.py's path rebuilds the base from the checkpoint's config: the same files
  written = builders.export_hf(str(out), str(tmp_path / "exported"))
  assert written == [str(tmp_path / "exported"), str(tmp_path / "exported-peft"), str(tmp_path / "exported-base")]
  for name in ("exported/model.safetensors", "exported-peft/adapter_model.safetensors"):
    want_t = load_file(out / name.replace("exported", "model"))
    got_t = load_file(tmp_path / name)
    assert want_t.keys() == got_t.keys() and all(np.array_equal(want_t[k], got_t[k]) for k in want_t)


# --------------------------------------------------------------------------------------------
# the config: a validated `lora` section (no section: full fine-tuning), the ready YAML files


def test_lora_section_is_validated_at_load_time_and_the_ready_configs_load():
  import os

  from jaxgrpo.run import specs

  cfg = specs.load_config(None, {"lora": {"rank": 8, "alpha": 16, "quantize": "nf4", "group_size": 16}})
  assert cfg.lora == lora.LoRAConfig(rank=8, alpha=16.0, quantize="nf4", group_size=16)
  assert specs.load_config(None, cfg.to_dict()).lora == cfg.lora  # what config.json holds
  assert specs.load_config(None, {}).lora is None and specs.load_config(None, {"lora": None}).lora is None
  bad = [
    ({"lora": {"rank": 0}}, ValueError, r"in `lora`: rank must be a positive int, got 0"),
    (
      {"lora": {"rnak": 8}},
      ValueError,
      r"unknown key\(s\) \['rnak'\] in `lora` \(`lora.rnak`: did you mean `lora.rank`\?\); valid keys: \['rank'",
    ),
    ({"lora": {"rank": "x"}}, TypeError, r"config field `lora.rank`: expected int; got 'x' \(str\)"),
    ({"lora": {"quantize": "int3"}}, ValueError, r"quantize must be None or one of"),
    ({"rollout.merge_lora": True}, ValueError, r"`rollout.merge_lora` is true but there is no `lora` section"),
  ]
  for over, err, match in bad:
    with pytest.raises(err, match=match):
      specs.load_config(None, over)
  assert specs.load_config(None, {"lora": {"dropout": 0.1}, "step.packing": 64}).lora.dropout == 0.1  # composes
  configs = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "configs")
  demo = specs.load_config(os.path.join(configs, "demo_lora.yaml"), {"lora.quantize": "int8"})
  plain = specs.load_config(os.path.join(configs, "demo.yaml"), {})
  assert demo.lora == lora.LoRAConfig(rank=8, alpha=16.0, dropout=0.05, quantize="int8")
  assert demo.run.steps == plain.run.steps and demo.data == plain.data and demo.rollout == plain.rollout
  paper = specs.load_config(os.path.join(configs, "lambda_grpo_openrs_lora.yaml"), {})
  full = specs.load_config(os.path.join(configs, "lambda_grpo_openrs.yaml"), {})
  assert paper.lora == lora.LoRAConfig(rank=64, alpha=128.0, dropout=0.05) and paper.objective == full.objective
