"""The peers benchmark's FLOP count (`scripts/peers/common.py`) against torch's FLOP counter on the HF model.

`bench_peers.py` reports every iteration as a fraction of its matmul floor, `common.model_flops` /
measured GFLOP/s. These tests count the matmul FLOPs that transformers' Qwen3 really performs
(`torch.utils.flop_counter.FlopCounterMode`, eager attention) for a forward pass, a forward and
backward pass, and `generate`, and compare them with the formula term by term. Where the two
differ by design (eager attention computes the full S × S scores where the formula counts the
causal half; `generate` prefills every row where the formula shares a prompt's prefill across its
group) the difference is computed independently and checked exactly.
"""

import dataclasses
import importlib.util
import os
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "peers", "common.py")
_SPEC = importlib.util.spec_from_file_location("peers_common", _PATH)
common = importlib.util.module_from_spec(_SPEC)
sys.modules["peers_common"] = common  # dataclasses look their module up while the class is created
_SPEC.loader.exec_module(common)

SHAPE = common.ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=24, intermediate=96, vocab=300)
WORK = common.Workload(name="tiny", model=SHAPE, prompts=2, prompt_len=5, samples=3, new_tokens=4, micro=6, chunk=4)


def hf_model(shape: common.ModelShape):
  cfg = transformers.Qwen3Config(
    vocab_size=shape.vocab,
    hidden_size=shape.hidden,
    num_hidden_layers=shape.layers,
    num_attention_heads=shape.heads,
    num_key_value_heads=shape.kv_heads,
    head_dim=shape.head_dim,
    intermediate_size=shape.intermediate,
    tie_word_embeddings=True,
    max_position_embeddings=64,
    attn_implementation="eager",  # attention as two counted matmuls (q·kᵀ, p·v)
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
  )
  torch.manual_seed(0)
  return transformers.Qwen3ForCausalLM(cfg).eval()


def counted(fn) -> int:
  with FlopCounterMode(display=False) as fc:
    fn()
  return fc.get_total_flops()


def attention_full_minus_causal(n: int) -> int:
  """Eager attention over n positions computes n² scores per head; the formula counts n(n+1)/2."""
  att = 4 * SHAPE.layers * SHAPE.heads * SHAPE.head_dim
  return att * (n * n - n * (n + 1) // 2)


@pytest.mark.parametrize("shape", [SHAPE, common.WORKLOADS["20m"].model, common.WORKLOADS["150m"].model])
def test_n_params_is_the_hf_models_parameter_count(shape):
  if shape.n_params > 50e6:  # the 150m model: count on the meta device (no memory)
    with torch.device("meta"):
      model = hf_model(shape)
  else:
    model = hf_model(shape)
  assert sum(p.numel() for p in model.parameters()) == shape.n_params


def test_reference_forward_flops():
  model, w = hf_model(SHAPE), WORK
  s, t = w.prompt_len + w.new_tokens, w.new_tokens
  ids = torch.randint(2, SHAPE.vocab, (w.rows, s))
  with torch.no_grad():
    got = counted(lambda: model(ids, logits_to_keep=t))  # the head only where a completion token is predicted
  want = common.model_flops(w)["reference"] + w.rows * attention_full_minus_causal(s)
  assert got == want


def test_train_step_is_three_forwards():
  model, w = hf_model(SHAPE), WORK
  s, t = w.prompt_len + w.new_tokens, w.new_tokens
  ids = torch.randint(2, SHAPE.vocab, (w.rows, s))
  forward = counted(lambda: model(ids, logits_to_keep=t))
  both = counted(lambda: model(ids, logits_to_keep=t).logits.logsumexp(-1).sum().backward())
  flops = common.model_flops(w)
  assert both == 3 * forward
  assert flops["train"] == 3 * flops["reference"]
  assert flops["head_recompute"] == w.rows * t * 2 * SHAPE.vocab * SHAPE.hidden


def test_rollout_flops():
  model, w = hf_model(SHAPE), WORK
  p, t = w.prompt_len, w.new_tokens
  prompts = torch.randint(2, SHAPE.vocab, (w.prompts, p))

  def generate():
    with torch.no_grad():
      out = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=True,
        num_return_sequences=w.samples,
        max_new_tokens=t,
        min_new_tokens=t,
        eos_token_id=None,
        pad_token_id=0,
      )
    assert out.shape == (w.rows, p + t)

  got = counted(generate)
  n = SHAPE.trunk_matmul_params
  causal_prefill = 4 * SHAPE.layers * SHAPE.heads * SHAPE.head_dim * p * (p + 1) // 2
  shared_prefill = 2 * n * p + causal_prefill  # what the formula counts once per prompt
  # transformers prefills each of the rows (num_return_sequences expands the prompts first), with full attention
  want = common.model_flops(w)["rollout"] + (w.rows - w.prompts) * shared_prefill
  want += w.rows * attention_full_minus_causal(p)
  assert got == want


def test_workloads_are_what_the_docs_say():
  w20, w150 = common.get_workload("20m"), common.get_workload("150m")
  assert (w20.model.n_params, w150.model.n_params) == (20_549_248, 158_616_576)
  assert (w20.prompts, w20.samples, w20.new_tokens, w20.micro) == (16, 8, 128, 64)
  assert (w150.prompts, w150.samples, w150.new_tokens, w150.micro) == (8, 4, 64, 16)
  for w in (w20, w150):
    assert w.rows // w.micro == 2  # two micro-batches per update in every workload
  smoke = common.get_workload("150m", smoke=True)
  assert (
    smoke.rows // smoke.micro == 2 and dataclasses.replace(smoke, prompts=8, new_tokens=64, micro=16, chunk=64) == w150
  )
  with pytest.raises(ValueError, match="unknown workload"):
    common.get_workload("7b")


def test_jaxgrpo_preset_argument():
  assert common.jaxgrpo_preset(["w", "m", "iter", "1"]) == (
    "grpo",
    {"aggregation": "seq-mean-token-mean", "beta": 0.04},
  )
  assert common.jaxgrpo_preset(["w", "m", "iter", "1", "frpo"]) == ("frpo", {"aggregation": "seq-mean-token-mean"})
  with pytest.raises(ValueError, match="not benchmarked"):
    common.jaxgrpo_preset(["w", "m", "iter", "1", "dapo"])


def _shape_floor():
  path = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "peers", "shape_floor.py")
  spec = importlib.util.spec_from_file_location("peers_shape_floor", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.parametrize("name", ["tiny", "20m", "150m"])
def test_shape_floor_lists_the_weight_matmuls_of_the_flop_formula(name):
  """`shape_floor.py` times the matmuls one by one; its weight matmuls (everything but attention)
  must add up to the FLOP formula without its attention terms, phase by phase."""
  floor = _shape_floor()
  w = WORK if name == "tiny" else common.get_workload(name)
  m = w.model
  att = 4 * m.layers * m.heads * m.head_dim
  p, t, r, s = w.prompt_len, w.new_tokens, w.rows, w.prompt_len + w.new_tokens
  causal = lambda c: att * c * (c + 1) // 2  # noqa: E731
  attention = {
    "rollout": w.prompts * causal(p) + r * sum(att * (p + i) for i in range(1, t)),
    "reference": r * causal(s),
  }
  attention["train"] = 3 * attention["reference"]
  flops = common.model_flops(w)
  expect = {
    "rollout": flops["rollout"] - attention["rollout"],
    "reference": flops["reference"] - attention["reference"],
    "train": flops["train"] + flops["head_recompute"] - attention["train"],
  }
  for phase, specs in floor.phase_specs(w).items():
    weights = sum(floor._flops(spec) * count for spec, count in specs if spec[0] == "mm")
    assert weights == expect[phase], (phase, weights, expect[phase])
