"""Sequence-classifier reward models (jaxgrpo.rewards.reward_model) against transformers' own
``*ForSequenceClassification`` on tiny random checkpoints built here (CPU torch, no downloads): the scores of
left- and right-padded batches, a pad id inside a row, several families, tied and untied embeddings, one and
three labels, bfloat16, a tensor-parallel mesh (a child with 2 CPU devices), and the reward-function wrapper
against transformers scoring the same rendered text."""

from __future__ import annotations

import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_child
from hf_utils import tiny_hf_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxgrpo.rewards.reward_model import RewardModelReward, last_token_index, load_reward_model  # noqa: E402

PAD = 3


def make_classifier(directory, family: str, *, tied: bool, num_labels: int = 1, seed: int = 0, vocab_size=128):
  """A random ``AutoModelForSequenceClassification`` of ``family`` (every weight, biases and norm scales
  included, drawn away from 0/1), saved to ``directory``; returns (directory, torch model)."""
  cfg = tiny_hf_config(family, tied=tied, vocab_size=vocab_size)
  cfg["pad_token_id"] = PAD
  config = transformers.AutoConfig.for_model(**cfg, num_labels=num_labels)
  torch.manual_seed(seed)
  model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
      else:
        p.copy_(torch.randn_like(p) * 0.05)
    model.score.weight.mul_(20.0)  # scores of order 1, so that 1e-4 is a tight bound
  model.save_pretrained(str(directory))
  return str(directory), model


def hf_scores(model, tokens, mask):
  with torch.no_grad():
    out = model(input_ids=torch.as_tensor(tokens, dtype=torch.long), attention_mask=torch.as_tensor(mask).long())
  return out.logits.float().numpy()


def padded(rng, lengths, width, *, left: bool, vocab=128):
  tokens = np.full((len(lengths), width), PAD, np.int64)
  mask = np.zeros((len(lengths), width), bool)
  for b, n in enumerate(lengths):
    row = rng.integers(PAD + 1, vocab, n)
    sl = slice(width - n, width) if left else slice(0, n)
    tokens[b, sl], mask[b, sl] = row, True
  return tokens, mask


@pytest.mark.parametrize(
  "family,tied,num_labels",
  [("qwen2", False, 1), ("qwen3", True, 1), ("llama", False, 3), ("llama", True, 1)],
)
def test_scores_match_transformers_left_and_right_padded(tmp_path, family, tied, num_labels):
  path, hf = make_classifier(tmp_path / family, family, tied=tied, num_labels=num_labels)
  rm = load_reward_model(path)
  assert rm.num_labels == num_labels and rm.pad_token_id == PAD
  rng = np.random.default_rng(1)
  for left in (True, False):
    tokens, mask = padded(rng, [12, 9, 4, 1], 12, left=left)
    want = hf_scores(hf, tokens, mask)
    got = rm.score(tokens, mask)
    assert got.dtype == np.float32 and got.shape == (4, num_labels)
    assert np.abs(want).max() > 0.1  # not a vanishing head
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  # transformers' rule, not the mask: a pad id inside a right-padded row is skipped (the row is read before it)
  tokens, mask = padded(rng, [10, 7, 5, 12], 12, left=False)
  tokens[0, 9] = PAD  # the last real token is the pad id: read at position 8
  tokens[1, 3] = PAD  # a pad id in the middle: still read at position 6
  np.testing.assert_allclose(rm.score(tokens, mask), hf_scores(hf, tokens, mask), atol=1e-4, rtol=0)


def test_last_token_index_is_transformers_rule():
  tokens = np.array([[5, 6, 7, PAD, PAD], [PAD, PAD, 5, 6, 7], [PAD] * 5, [5, PAD, 6, PAD, PAD], [5, 6, 7, 8, 9]])
  # NumPy from the formula of GenericForSequenceClassification: argmax(arange(S) * (ids != pad))
  want = np.argmax(np.arange(5) * (tokens != PAD), axis=-1)
  np.testing.assert_array_equal(np.asarray(last_token_index(jnp.asarray(tokens), PAD)), want)
  np.testing.assert_array_equal(want, [2, 4, 0, 2, 4])
  np.testing.assert_array_equal(np.asarray(last_token_index(jnp.asarray(tokens), None)), [4] * 5)


def test_bfloat16_scores_close_to_float32(tmp_path):
  path, hf = make_classifier(tmp_path / "q3", "qwen3", tied=False)
  tokens, mask = padded(np.random.default_rng(2), [12, 8, 3, 10], 12, left=True)
  want = hf_scores(hf, tokens, mask)
  rm = load_reward_model(path, dtype=jnp.bfloat16)
  assert rm.score_head[...].dtype == jnp.bfloat16
  got = rm.score(tokens, mask)
  assert got.dtype == np.float32
  # bf16 keeps 8 bits of mantissa: 2-3 significant digits after two layers
  np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max(), rtol=0)
  assert np.abs(got - want).max() > 1e-6  # really computed in bf16


def test_bad_inputs_are_named(tmp_path):
  path, _ = make_classifier(tmp_path / "q2", "qwen2", tied=False)
  rm = load_reward_model(path)
  with pytest.raises(ValueError, match=r"`tokens` must be ids in \[0, 128\)"):
    rm.score(np.array([[1, 200]]))
  with pytest.raises(ValueError, match="`mask` must have the shape"):
    rm.score(np.ones((2, 4), np.int32), np.ones((2, 3), bool))
  with pytest.raises(ValueError, match=r"`tokens` must be int\[B, S\]"):
    rm.score(np.ones((4,), np.int32))
  nopad = load_reward_model(path)
  nopad.pad_token_id = None
  with pytest.raises(ValueError, match="no pad_token_id"):
    nopad.score(np.ones((2, 4), np.int32))
  causal = tmp_path / "causal"
  transformers.AutoModelForCausalLM.from_config(
    transformers.AutoConfig.for_model(**tiny_hf_config("qwen2"))
  ).save_pretrained(str(causal))
  with pytest.raises(ValueError, match="ForSequenceClassification"):
    load_reward_model(causal)


def test_reward_function_renders_with_chat_template_and_matches_transformers(tmp_path):
  from jaxgrpo.tasks.arithmetic import build_tokenizer

  tok = build_tokenizer()
  assert tok.pad_token_id != PAD
  path, hf = make_classifier(tmp_path / "rm", "qwen2", tied=False, vocab_size=len(tok))
  # the checkpoint's pad id must be the tokenizer's: rewrite the config as a user would ship it
  hf.config.pad_token_id = tok.pad_token_id
  hf.save_pretrained(path)
  # the tokenizer object itself: transformers 5's AutoTokenizer would rebuild it as a Qwen2Tokenizer (other ids)
  fn = RewardModelReward(load_reward_model(path), tok, batch_size=2, pad_multiple=16)
  prompts = ["What is 2 + 3?", "What is 7 + 1?", "What is 4 + 4?"]
  completions = ["2+3=5. \\boxed{5}", "\\boxed{9}", "4+4=8, so the answer is \\boxed{8}"]
  got = fn(prompts, completions, answer=["5", "8", "8"])
  want = []
  for p, c in zip(prompts, completions):  # transformers on each text alone (no padding at all)
    text = tok.apply_chat_template(
      [{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False
    )
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
      want.append(float(hf(input_ids=ids).logits[0, 0]))
  assert isinstance(got, list) and len(got) == 3
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  fn.max_length = 8  # keeps the last 8 tokens: counted
  fn(prompts[:1], completions[:1])
  assert fn.pop_counters() == {"truncated": 1}


def test_sharded_on_a_tensor_mesh_matches_transformers(tmp_path):
  path, hf = make_classifier(tmp_path / "q3", "qwen3", tied=True)
  tokens, mask = padded(np.random.default_rng(3), [12, 5, 9, 2], 12, left=True)
  np.save(tmp_path / "tokens.npy", tokens)
  np.save(tmp_path / "mask.npy", mask)
  code = textwrap.dedent(
    f"""
    import numpy as np
    from jaxgrpo.parallel.sharding import make_mesh
    from jaxgrpo.rewards.reward_model import load_reward_model
    mesh = make_mesh("data=1,fsdp=2,tensor=2")
    rm = load_reward_model({path!r}, mesh=mesh)
    q = rm.model.layers[0].attn.q[...]
    assert len(q.sharding.device_set) == 4 and q.addressable_shards[0].data.size < q.size, q.sharding
    np.save({str(tmp_path / "got.npy")!r}, rm.score(np.load({str(tmp_path / "tokens.npy")!r}),
                                                   np.load({str(tmp_path / "mask.npy")!r})))
    """
  )
  run_child(code, devices=4, timeout=300)
  np.testing.assert_allclose(np.load(tmp_path / "got.npy"), hf_scores(hf, tokens, mask), atol=1e-4, rtol=0)


def test_bench_reward_model_smoke(capsys):
  import importlib.util
  import os

  path = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_reward_model.py")
  spec = importlib.util.spec_from_file_location("bench_reward_model", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out = bench.main(
    ["--hidden", "64", "--layers", "1", "--vocab", "256", "--batch", "2", "--seq", "16", "--rounds", "1"]
  )
  assert out["max_abs_diff"] < 1e-4 and out["ratio"] > 0
  assert "ratio (jaxgrpo tokens/s / transformers tokens/s)" in capsys.readouterr().out


def test_an_overflowing_score_is_a_missing_sample(tmp_path):
  """A head that overflows float32 (every score weight 3e38: transformers' logits are ±inf too) gives missing
  samples (NaN, counted ``nonfinite``) in a RewardSet, whatever its ``on_error``: before, the reward function
  returned ±inf and a RewardSet raised (or, with ``on_error="zero"``, scored those rows 0)."""
  from jaxgrpo.rewards.reward_set import RewardSet
  from jaxgrpo.tasks.arithmetic import build_tokenizer

  tok = build_tokenizer()
  path, hf = make_classifier(tmp_path / "rm", "qwen2", tied=False, vocab_size=len(tok))
  hf.config.pad_token_id = tok.pad_token_id
  with torch.no_grad():
    hf.score.weight.fill_(3e38)
  hf.save_pretrained(path)
  fn = RewardModelReward(load_reward_model(path), tok, batch_size=2, pad_multiple=16, name="rm")
  completions = ["\\boxed{5}", "\\boxed{9}", "4+4=8", "no"]
  want = []
  for c in completions:
    text = tok.apply_chat_template(
      [{"role": "user", "content": "q"}, {"role": "assistant", "content": c}], tokenize=False
    )
    with torch.no_grad():
      want.append(
        float(hf(input_ids=tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]).logits[0, 0])
      )
  bad = ~np.isfinite(want)
  assert bad.any()  # the premise: transformers' own scores overflow
  for on_error in ("raise", "zero"):
    res = RewardSet([fn], on_error=on_error)(["q"] * 4, completions)
    assert np.isnan(res.total[bad]).all()
    np.testing.assert_allclose(res.total[~bad], np.asarray(want)[~bad], rtol=1e-3)
    assert res.counters == {"rm/missing": int(bad.sum()), "rm/nonfinite": int(bad.sum())}
