"""The generative judge (jaxgrpo.rewards.judge): the reply parser on hand-written replies, and the judge through the
real built-in engine (``BuiltinEngine`` + ``sampling.generate``) on a hand-built model whose greedy reply is a
function of the prompt's last token (so the verdict depends on the answer): parsed scores, NaN and a counter for
an unparsable reply, one engine call per batch, and the missing sample kept NaN by a RewardSet."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxgrpo.rewards.judge import JudgeReward, parse_judgment
from jaxgrpo.rewards.reward_set import RewardSet

CASES = [
  # boxed first: a number, a verdict word, or nothing usable (a box is never skipped over)
  ("Reasoning... \\boxed{7}", 7.0),
  ("\\boxed{3} then \\boxed{yes}", 1.0),
  ("\\boxed{Incorrect}", 0.0),
  ("Score: 9, but \\boxed{maybe}", None),
  ("\\boxed{\\frac{3}{4}}", 0.75),
  # labelled values, the last one wins
  ("Score: 8/10", 0.8),
  ("Rating: 7.", 7.0),
  ("score = 4\nscore = 5", 5.0),
  ("Score: 3 / 4. Final verdict: correct", 1.0),
  ("Verdict: WRONG", 0.0),
  ("Judgement: -0.5", -0.5),
  ("The answer is correct.", 1.0),
  # the whole reply, or its first word
  (" 6. ", 6.0),
  ("Yes", 1.0),
  ("no.", 0.0),
  ("No, because 2 + 3 is 5, not 6.", 0.0),
  ("**Correct**", 1.0),
  # nothing: counted by the judge, never guessed
  ("the answer is 9", None),
  ("I think 5 is right", None),
  ("maybe", None),
  ("", None),
  ("yesterday", None),
  ("Score: high", None),
]


@pytest.mark.parametrize("reply,want", CASES)
def test_parse_judgment(reply, want):
  assert parse_judgment(reply) == want


def test_parse_judgment_custom_verdicts_and_type():
  assert parse_judgment("PASS", verdicts={"pass": 2.0}) == 2.0
  assert parse_judgment("yes", verdicts={"pass": 2.0}) is None
  with pytest.raises(TypeError, match="`text` must be a str"):
    parse_judgment(None)


# ----------------------------------------------------------------------------- through the built-in engine


def automaton_judge(tok, chain: dict[str, str]):
  """A 1-layer Llama whose greedy next token is ``chain[current token]`` (else EOS): embeddings are one-hot
  (D = V), the layer adds nothing (zero output projections), and the head maps token t's direction to the
  logit of its successor. A real model through the real sampler; its reply depends on the prompt's last token."""
  import jax.numpy as jnp
  from flax import nnx

  from jaxgrpo.models import LlamaConfig, build_model

  v = len(tok)
  cfg = LlamaConfig(
    vocab_size=v,
    hidden_size=v,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=8,
    max_position_embeddings=256,
  )
  model = build_model(cfg, rngs=nnx.Rngs(0))
  nxt = np.full(v, tok.eos_token_id)
  for a, b in chain.items():
    nxt[tok.convert_tokens_to_ids(a)] = tok.convert_tokens_to_ids(b)
  head = np.zeros((v, v), np.float32)
  head[np.arange(v), nxt] = 10.0
  model.embed_tokens[...] = jnp.eye(v)
  model.lm_head[...] = jnp.asarray(head)
  layer = model.layers[0]
  layer.attn.o[...] = jnp.zeros_like(layer.attn.o[...])
  layer.mlp.down[...] = jnp.zeros_like(layer.mlp.down[...])
  return model


class CountingEngine:
  """The built-in engine, counting its generate calls."""

  def __init__(self, model):
    from jaxgrpo.rollout.engines.builtin import BuiltinEngine

    self.inner, self.calls, self.rows = BuiltinEngine(model), 0, []
    self.name = "jax"

  def generate(self, prompt_tokens, prompt_mask, sampling, *, key, temperature=1.0):
    self.calls += 1
    self.rows.append(np.asarray(prompt_tokens).shape[0])
    return self.inner.generate(prompt_tokens, prompt_mask, sampling, key=key, temperature=temperature)

  def push_weights(self, model):
    self.inner.push_weights(model)

  def release_memory(self):
    pass

  def reacquire_memory(self):
    pass

  def close(self):
    self.inner.close()


def test_judge_through_the_builtin_engine():
  from jaxgrpo.tasks.arithmetic import build_tokenizer

  tok = build_tokenizer(extra_text="yes no maybe")
  # the answer's last digit decides the reply: 5 -> "yes", 9 -> "no", 8 -> "maybe" (no score), 7 -> "\boxed{7}"
  chain = {"5": "yes", "9": "no", "8": "maybe", "7": "\\boxed", "\\boxed": "{", "{": "6", "6": "}"}
  engine = CountingEngine(automaton_judge(tok, chain))
  judge = JudgeReward(
    engine,
    tok,
    template="{rubric} Question: {question} Answer: {answer}",
    chat=False,
    max_new_tokens=6,
    pad_multiple=16,
  )
  prompts = ["What is 2 + 3?", "What is 4 + 5?", "What is 4 + 4?", "What is 3 + 4?", "What is 1 + 4?"]
  completions = ["5", "9", "8", "7", "The sum is 5"]
  got = judge(prompts, completions)
  assert judge.last_replies == ["yes", "no", "maybe", "\\boxed{6}", "yes"]
  assert got[:2] == [1.0, 0.0] and math.isnan(got[2]) and got[3:] == [6.0, 1.0]
  assert judge.pop_counters() == {"unparsable": 1}
  assert engine.calls == 1 and engine.rows == [5]  # every row of the call in one generate

  # through a RewardSet: the unparsable row stays NaN (a missing sample), counted, and the total is NaN there
  judge.scale = (0.0, 6.0)  # numbers rescaled; 1.0 for "yes" stays in range
  res = RewardSet({"judge": (judge, 2.0)}, on_error="raise")(prompts[:3], completions[:3])
  assert np.isnan(res.per_fn["judge"][2]) and np.isnan(res.total[2])
  np.testing.assert_allclose(res.total[:2], [2 / 6, 0.0])
  assert res.counters == {"judge/unparsable": 1, "judge/missing": 1}
  assert engine.calls == 2


def test_judge_arguments_are_checked():
  from jaxgrpo.tasks.arithmetic import build_tokenizer

  tok = build_tokenizer()
  engine = CountingEngine(None)
  with pytest.raises(ValueError, match=r"\{answer\} placeholder"):
    JudgeReward(engine, tok, template="{question}")
  with pytest.raises(ValueError, match="may use only"):
    JudgeReward(engine, tok, template="{answer} {score}")
  with pytest.raises(ValueError, match="reference_column"):
    JudgeReward(engine, tok, template="{answer} vs {reference}")
  with pytest.raises(ValueError, match="lo < hi"):
    JudgeReward(engine, tok, scale=(1.0, 1.0))
  with pytest.raises(TypeError, match="must implement jaxgrpo.rollout.engines.Engine"):
    JudgeReward(object(), tok)
  judge = JudgeReward(engine, tok, reference_column="answer", template="{answer} {reference}")
  with pytest.raises(ValueError, match="needs the column 'answer'"):
    judge(["q"], ["a"])


def test_the_documented_judge_shows_the_reference_and_a_template_without_it_is_refused():
  """docs/rewards.md's ``JudgeReward(engine, tok, reference_column="answer")``: the rendered prompt holds the
  reference (before, the default template had no ``{reference}`` and the column was read, then dropped)."""
  from jaxgrpo.tasks.arithmetic import build_tokenizer

  tok = build_tokenizer()
  engine = CountingEngine(None)
  judge = JudgeReward(engine, tok, reference_column="answer", chat=False)
  text = judge.render("what is 2+2?", "5", reference="4")
  assert text.endswith("Question: what is 2+2?\n\nReference answer: 4\n\nAnswer: 5\n\nIs the answer correct?")
  assert "Reference" not in JudgeReward(engine, tok, chat=False).render("what is 2+2?", "5")
  with pytest.raises(ValueError, match=r"no \{reference\} placeholder, so the judge would never see the reference"):
    JudgeReward(engine, tok, reference_column="answer", template="{question} {answer}")


def test_a_template_with_literal_json_braces_is_refused_with_the_hint_to_double_them():
  from jaxgrpo.tasks.arithmetic import build_tokenizer

  tok = build_tokenizer()
  engine = CountingEngine(None)
  with pytest.raises(ValueError, match=r'must be doubled: \{\{"score": 1\}\}'):
    JudgeReward(engine, tok, template='{question} {answer} Reply as JSON: {"score": <0-10>}', chat=False)
  judge = JudgeReward(engine, tok, template='{answer} Reply as JSON: {{"score": <0-10>}}', chat=False)
  assert judge.render("q", "7") == '7 Reply as JSON: {"score": <0-10>}'
