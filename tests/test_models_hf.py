"""HF checkpoint I/O: save_hf → transformers, sharded checkpoints, mesh placement, clear errors."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_utils import FAMILIES, build_hf_model, hf_logits, left_padded_batch, tiny_hf_config

from jaxgrpo import models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")  # tests/conftest.py


_BAD_LOAD_WORDS = ("missing", "unexpected", "not initialized", "newly initialized", "mismatch")


class _Capture(logging.Handler):
  def __init__(self):
    super().__init__(level=logging.DEBUG)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def _from_pretrained_capturing(directory):
  """Load with transformers while recording every log record of the ``transformers`` logger."""
  handler = _Capture()
  logger = logging.getLogger("transformers")
  old_level = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  try:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  finally:
    logger.removeHandler(handler)
    logger.setLevel(old_level)
  return model, handler.messages


def _bad_messages(messages):
  return [m for m in messages if any(w in m.lower() for w in _BAD_LOAD_WORDS)]


def _logits(model, tokens, mask):
  positions = models.positions_from_mask(jnp.asarray(mask))
  hidden, _ = model(jnp.asarray(tokens), positions, attention_mask=jnp.asarray(mask))
  return np.asarray(model.logits(hidden), np.float32)


@functools.lru_cache(maxsize=None)  # tests only read these models; building one costs seconds on CPU
def _random_model(family, tied, seed=0):
  cfg = models.config_from_hf(tiny_hf_config(family, tied=tied))
  model = models.build_model(cfg, rngs=nnx.Rngs(seed))
  # Randomise norm scales and biases so a swapped or dropped tensor changes the logits.
  _, state = nnx.split(model)
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(state):
    if "norm" in str(path) or "bias" in str(path) or "ln_" in str(path):
      var.set_value(jnp.asarray(1.0 * (path[-1] == "scale") + 0.1 * rng.standard_normal(var.shape), jnp.float32))
  return model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_save_hf_loads_in_transformers_without_warnings(tmp_path, family, tied):
  model = _random_model(family, tied)
  models.save_hf(model, tmp_path)
  hf_model, messages = _from_pretrained_capturing(str(tmp_path))
  assert not _bad_messages(messages), messages
  assert hf_model.config.model_type == family
  tokens, mask = left_padded_batch(np.random.default_rng(0), 2, 9, model.config.vocab_size, pads=[0, 4])
  err = np.abs(_logits(model, tokens, mask) - hf_logits(hf_model, tokens, mask))[mask].max()
  assert err < 1e-4, err
  # And back: load_hf of our own checkpoint reproduces every parameter exactly.
  again = models.load_hf(tmp_path)
  for (p1, v1), (p2, v2) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(again))):
    assert p1 == p2
    np.testing.assert_array_equal(np.asarray(v1.get_value()), np.asarray(v2.get_value()))


def test_capture_sees_missing_weight_message(tmp_path):
  """The warning check above is live: a checkpoint lacking a tensor is reported by transformers."""
  from safetensors.numpy import load_file, save_file

  models.save_hf(_random_model("qwen3", False), tmp_path)
  f = os.path.join(tmp_path, "model.safetensors")
  tensors = load_file(f)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, f, metadata={"format": "pt"})
  _, messages = _from_pretrained_capturing(str(tmp_path))
  assert _bad_messages(messages)


def test_load_sharded_checkpoint_with_index(tmp_path):
  hf_model = build_hf_model(tiny_hf_config("qwen2"), seed=3)
  hf_model.save_pretrained(str(tmp_path), max_shard_size="40KB")
  assert os.path.exists(tmp_path / "model.safetensors.index.json")
  assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) > 1
  model = models.load_hf(tmp_path)
  tokens, mask = left_padded_batch(np.random.default_rng(0), 2, 8, 128, pads=[0, 3])
  err = np.abs(_logits(model, tokens, mask) - hf_logits(hf_model, tokens, mask))[mask].max()
  assert err < 1e-4, err


def test_load_hf_casts_param_dtype_and_sets_compute_dtype(tmp_path):
  models.save_hf(_random_model("llama", False), tmp_path)
  model = models.load_hf(tmp_path, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  assert model.dtype == jnp.bfloat16
  assert {v.get_value().dtype for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
  hidden, _ = model(jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None])
  assert hidden.dtype == jnp.bfloat16


def test_unknown_model_type_raises(tmp_path):
  with open(tmp_path / "config.json", "w") as f:
    json.dump({"model_type": "bert", "vocab_size": 10}, f)
  with pytest.raises(ValueError, match="model_type='bert'"):
    models.load_hf(tmp_path)


def _rewrite(directory, fn):
  from safetensors.numpy import load_file, save_file

  f = os.path.join(directory, "model.safetensors")
  tensors = load_file(f)
  fn(tensors)
  save_file(tensors, f, metadata={"format": "pt"})


def test_missing_tensor_raises_naming_it(tmp_path):
  models.save_hf(_random_model("qwen3", False), tmp_path)
  _rewrite(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
  with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight.*missing"):
    models.load_hf(tmp_path)


def test_misshaped_tensor_raises_with_both_shapes(tmp_path):
  models.save_hf(_random_model("gpt2", False), tmp_path)

  def shrink(t):
    t["transformer.h.0.attn.c_attn.weight"] = t["transformer.h.0.attn.c_attn.weight"][:, :64].copy()

  _rewrite(tmp_path, shrink)
  with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn\.weight.*\(32, 64\).*\(32, 96\)"):
    models.load_hf(tmp_path)


def test_unused_checkpoint_tensor_is_reported(tmp_path, caplog):
  models.save_hf(_random_model("qwen2", True), tmp_path)
  _rewrite(tmp_path, lambda t: t.__setitem__("model.extra_adapter.weight", np.zeros((2, 2), np.float32)))
  with caplog.at_level(logging.WARNING, logger="jaxgrpo.models.hf"):
    models.load_hf(tmp_path)
  assert "model.extra_adapter.weight" in caplog.text


def test_not_a_directory_raises(tmp_path):
  with pytest.raises(ValueError, match="not a local directory"):
    models.load_hf(str(tmp_path / "nope" / "absent-model"))


def test_load_tokenizer_from_directory(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  vocab = {"[UNK]": 0, "a": 1, "b": 2}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
  fast.save_pretrained(str(tmp_path))
  loaded = models.load_tokenizer(tmp_path)
  assert loaded("a b c")["input_ids"] == [1, 2, 0]


_MESH_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import AxisType, PartitionSpec as P
    def make_mesh(shape, names):
        return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    from jaxgrpo import models
    directory = sys.argv[1]
    mesh = make_mesh((4, 2), ("fsdp", "tensor"))
    sharded = models.load_hf(directory, mesh=mesh)
    plain = models.load_hf(directory)
    specs = {}
    for (path, v), (_, w) in zip(nnx.to_flat_state(nnx.state(sharded)), nnx.to_flat_state(nnx.state(plain))):
        a = v.get_value()
        assert a.sharding.mesh.shape == mesh.shape, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w.get_value()))
        specs[path] = a.sharding.spec
    assert specs[("embed_tokens",)] == P("tensor", "fsdp"), specs[("embed_tokens",)]
    assert specs[("layers", 0, "attn", "k")] == P("fsdp", "tensor", None)
    assert specs[("layers", 0, "mlp", "down")] == P("tensor", "fsdp")
    assert specs[("final_norm", "scale")] == P(None)
    # a shard holds only its slice
    emb = sharded.embed_tokens.get_value()
    assert {s.data.shape for s in emb.addressable_shards} == {(64, 8)}
    # rules: a mesh axis absent from the mesh -> replicated; custom rules honoured
    rep = models.load_hf(directory, mesh=make_mesh((8,), ("data",)))
    assert rep.embed_tokens.get_value().sharding.spec == P(None, None)
    try:
        models.load_hf(directory, mesh=make_mesh((1, 8), ("fsdp", "tensor")))
    except ValueError as e:
        assert "not divisible" in str(e), e
    else:
        raise AssertionError("kv_heads=2 over tensor=8 should fail")
    tok = jnp.asarray(np.arange(12).reshape(2, 6) % 128, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    f = jax.jit(lambda m, t, p: m.logits(m(t, p)[0]))
    a = f(sharded, tok, pos); b = f(plain, tok, pos)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    try:
        models.load_hf(directory, mesh=jax.make_mesh((4, 2), ("fsdp", "tensor")))
    except ValueError as e:
        assert "AxisType.Auto" in str(e), e
    else:
        raise AssertionError("explicit mesh should be rejected")
    print("OK")
""")


@pytest.mark.subprocess
def test_load_hf_places_shards_on_mesh(tmp_path):
  hf_model = build_hf_model(tiny_hf_config("qwen3"), seed=4)
  hf_model.save_pretrained(str(tmp_path))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(
    [sys.executable, "-c", _MESH_SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
  )
  assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
