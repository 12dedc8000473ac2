"""The arithmetic task: the offline demo of the trainer, with no downloads.

A synthetic task "What is a + b?" with the answer in ``\\boxed{}``, a locally built tokenizer, a tiny
Qwen3-architecture model and a supervised warm-up — everything the trainer needs to run on a CPU.

- :class:`SyntheticModel`, :class:`ArithmeticTask`: the two specs a run names (``model.synthetic``,
  ``data.arithmetic``; see ``jaxgrpo.run.specs``).
- :func:`build_tokenizer`: a word/character-level ``tokenizers`` tokenizer wrapped in
  ``transformers.PreTrainedTokenizerFast`` with a small chat template (``<|user|>…<|end|><|assistant|>``).
  Digits are single tokens, so arithmetic is learnable by a tiny model.
- :func:`arithmetic_rows`, :func:`arithmetic_split`: prompts "What is a + b?" (and a - b, a * b) with
  the ground truth; the rows have the OpenRS layout (``problem``, ``answer``), so the trainer loads
  them like any math set.
- :func:`tiny_model_config`, :func:`model_config`: a Qwen3-architecture config of ~0.1M parameters.
- :func:`sft_warmup`: a few hundred steps of cross-entropy on ``"{a}+{b}={c}. \\boxed{c}"``
  completions through ``jaxgrpo.models`` and optax, so the RL rewards start above zero.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tk_models
from transformers import PreTrainedTokenizerFast

from jaxgrpo import models
from jaxgrpo.data import INSTRUCTION, build_messages
from jaxgrpo.run import registry
from jaxgrpo.run.task_specs import ArithmeticTask, SyntheticModel
from jaxgrpo.tasks import script_io

__all__ = [
  "SyntheticModel",
  "ArithmeticTask",
  "SPECIAL_TOKENS",
  "CHAT_TEMPLATE",
  "build_tokenizer",
  "arithmetic_rows",
  "arithmetic_split",
  "task_split",
  "solution_text",
  "tiny_model_config",
  "model_config",
  "sft_sequences",
  "sft_warmup",
  "warm_up",
  "SFTResult",
]


PAD, UNK, EOS = "<|pad|>", "<|unk|>", "<|end|>"
SPECIAL_TOKENS = (PAD, UNK, EOS, "<|user|>", "<|assistant|>", "<|system|>")
CHAT_TEMPLATE = (
  "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
  "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORD = r"\\[A-Za-z]+|[A-Za-z']+|\d|\s|[^\sA-Za-z\d]"


def build_tokenizer(extra_text: str = ""):
  """A deterministic tokenizer built locally: special tokens, every printable ASCII character,
  and the words of the papers' instruction and the task prompts (LaTeX commands such as ``\\boxed``
  are single tokens; digits always single characters). Decoding concatenates tokens.

  Returns a ``transformers.PreTrainedTokenizerFast`` with ``chat_template``, ``pad_token`` and
  ``eos_token`` set; ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` round-trip it.
  """
  words = set(re.findall(_WORD, INSTRUCTION + " What is plus minus times Answer " + extra_text))
  vocab_list = list(SPECIAL_TOKENS) + [chr(c) for c in range(32, 127)] + ["\n"]
  vocab_list += sorted(w for w in words if w not in vocab_list)
  # reserved tokens up to a multiple of 64, so the vocabulary divides any tensor-parallel axis
  reserved = [f"<|reserved_{i}|>" for i in range(-len(vocab_list) % 64)]
  vocab_list += reserved
  vocab = {w: i for i, w in enumerate(vocab_list)}
  tok = Tokenizer(tk_models.WordLevel(vocab=vocab, unk_token=UNK))
  # known words first (longest first), then any single character: unknown words fall back to chars
  known = sorted((w for w in words if len(w) > 1), key=lambda w: (-len(w), w))
  pattern = "|".join([re.escape(w) + r"(?![A-Za-z])" for w in known] + [r"[\s\S]"])
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(list(SPECIAL_TOKENS) + reserved)
  fast = PreTrainedTokenizerFast(
    tokenizer_object=tok,
    pad_token=PAD,
    unk_token=UNK,
    eos_token=EOS,
    additional_special_tokens=list(SPECIAL_TOKENS[3:]) + reserved,
  )
  fast.chat_template = CHAT_TEMPLATE
  return fast


def arithmetic_rows(num: int, *, seed: int, max_operand: int = 99, ops: str = "+") -> list[dict]:
  """``num`` synthetic problems ``{"problem": "What is a + b?", "answer": "c"}`` (OpenRS layout).

  Operands are uniform in ``[0, max_operand]``; ``ops`` is a subset of ``"+-*"``. Deterministic in
  ``seed``; use different seeds for the training and held-out sets.
  """
  if not ops or set(ops) - set("+-*"):
    raise ValueError(f"`ops` must be a non-empty subset of '+-*'; got {ops!r}")
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(num):
    a, b = (int(x) for x in rng.integers(0, max_operand + 1, size=2))
    op = ops[int(rng.integers(len(ops)))]
    c = a + b if op == "+" else a - b if op == "-" else a * b
    rows.append({"problem": f"What is {a} {op} {b}?", "answer": str(c)})
  return rows


def arithmetic_split(
  train_size: int, eval_size: int, *, seed: int, max_operand: int = 19, ops: str = "+"
) -> tuple[list[dict], list[dict]]:
  """Training and held-out problems over *disjoint* operand pairs: the ``(a, op, b)`` space is
  shuffled with ``seed``; the first ``eval_size`` problems are held out (each once), the training
  rows are drawn with replacement from the rest."""
  space = [(a, op, b) for a in range(max_operand + 1) for b in range(max_operand + 1) for op in ops]
  if eval_size >= len(space):
    raise ValueError(f"`eval_size`={eval_size} leaves no training problems out of {len(space)}")
  rng = np.random.default_rng([seed, 2])
  order = rng.permutation(len(space))

  def row(i):
    a, op, b = space[i]
    c = a + b if op == "+" else a - b if op == "-" else a * b
    return {"problem": f"What is {a} {op} {b}?", "answer": str(c)}

  held = [row(i) for i in order[:eval_size]]
  rest = order[eval_size:]
  train = [row(int(i)) for i in rng.choice(rest, size=train_size, replace=True)]
  return train, held


def solution_text(problem: str, answer: str, boxed: str | None = None) -> str:
  """The warm-up target completion: ``"a+b=c. \\boxed{c}"`` (``boxed`` replaces the boxed value)."""
  expr = problem.removeprefix("What is ").removesuffix("?").replace(" ", "")
  return f"{expr}={answer}. \\boxed{{{answer if boxed is None else boxed}}}"


def tiny_model_config(
  vocab_size: int, *, hidden_size: int = 64, num_layers: int = 2, max_position_embeddings: int = 256
) -> models.Qwen3Config:
  """A Qwen3-architecture config small enough to train on a CPU in minutes."""
  return models.Qwen3Config(
    vocab_size=vocab_size,
    hidden_size=hidden_size,
    num_layers=num_layers,
    num_heads=4,
    num_kv_heads=2,
    head_dim=hidden_size // 4,
    intermediate_size=2 * hidden_size,
    tie_word_embeddings=True,
    max_position_embeddings=max_position_embeddings,
  )


#: positions of the synthetic model by default (rotary: no parameter depends on it; ``synthetic.max_positions``):
#: room for the default ``data.max_prompt_tokens`` 512 + ``rollout.max_new_tokens`` 1024 of ``jaxgrpo.run.specs``
SYNTHETIC_POSITIONS = 2048


def model_config(spec: SyntheticModel, vocab_size: int) -> models.Qwen3Config:
  """The Qwen3 (or, with ``spec.num_experts``, Qwen3-MoE) config of ``spec`` over a vocabulary of
  ``vocab_size`` (``len(build_tokenizer())``), with ``spec.max_positions`` positions (default
  :data:`SYNTHETIC_POSITIONS`)."""
  cfg = tiny_model_config(
    vocab_size,
    hidden_size=spec.hidden_size,
    num_layers=spec.num_layers,
    max_position_embeddings=spec.max_positions,
  )
  if not spec.num_experts:
    return cfg
  fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
  return models.Qwen3MoeConfig(
    **fields,
    num_experts=spec.num_experts,
    num_experts_per_tok=spec.experts_per_tok,
    moe_intermediate_size=max(1, cfg.intermediate_size // spec.experts_per_tok),
    norm_topk_prob=True,
  )


def task_split(task: ArithmeticTask, *, seed: int) -> tuple[list[dict], list[dict]]:
  """``(train rows, held-out rows)`` of ``task`` (:func:`arithmetic_split` with its sizes, ``+`` only)."""
  return arithmetic_split(task.train_size, task.eval_size, seed=seed, max_operand=task.max_operand)


@dataclasses.dataclass
class SFTResult:
  """What :func:`sft_warmup` did: the loss after every 50 steps (and the last) and its wall time."""

  losses: list[float]
  seconds: float


def _noisy_answer(answer: str, rng: np.random.Generator) -> str:
  return str(int(answer) + int(rng.choice([-10, -2, -1, 1, 2, 10])))


def _sft_batches(tokenizer, rows: Sequence[dict], *, seq_len: int, noise: float = 0.0, seed: int = 0):
  """Full sequences ``prompt + solution + EOS`` (right-padded), and a loss mask on the completion.
  A fraction ``noise`` of the rows box a wrong answer (the worked result off by ±1, ±2 or ±10)."""
  rng = np.random.default_rng([seed, 1])
  toks, loss_masks = [], []
  for r in rows:
    boxed = _noisy_answer(r["answer"], rng) if noise and rng.random() < noise else None
    prompt = tokenizer.apply_chat_template(build_messages(r["problem"]), tokenize=False, add_generation_prompt=True)
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(solution_text(r["problem"], r["answer"], boxed), add_special_tokens=False)["input_ids"]
    c_ids = c_ids + [tokenizer.eos_token_id]
    ids = (p_ids + c_ids)[:seq_len]
    lm = ([False] * len(p_ids) + [True] * len(c_ids))[:seq_len]
    toks.append(ids + [tokenizer.pad_token_id] * (seq_len - len(ids)))
    loss_masks.append(lm + [False] * (seq_len - len(lm)))
  tokens = np.asarray(toks, np.int32)
  loss_mask = np.asarray(loss_masks, bool)
  attn = np.zeros_like(loss_mask)
  for i, t in enumerate(toks):
    attn[i, : len([x for x in t if x != tokenizer.pad_token_id])] = True
  return tokens, attn, loss_mask


def sft_warmup(
  model: nnx.Module,
  tokenizer,
  rows: Sequence[dict],
  *,
  steps: int,
  batch_size: int = 32,
  learning_rate: float = 3e-3,
  seed: int = 0,
  seq_len: int | None = None,
  noise: float = 0.0,
  log_every: int = 0,
  log: Callable[[str], None] | None = print,
  progress: bool = False,
) -> SFTResult:
  """Supervised warm-up (cross-entropy on the completion tokens) of ``model`` in place.

  ``noise``: the fraction of demonstrations that box a wrong answer (the worked result off by ±1,
  ±2 or ±10: ``"3+4=7. \\boxed{8}"``). The warm-up policy then often boxes something other than
  what it computed — high pass@k, low mean@k, like a base LLM that does not commit to its own
  reasoning — which RL with a verifier can fix.

  Uses ``jaxgrpo.models.log_probs`` (the same function the RL step differentiates) and AdamW with
  a cosine schedule; 50 steps run per call as one ``lax.scan`` (little Python overhead). Each step
  trains on ``batch_size`` rows drawn with replacement from ``rows`` (``{"problem", "answer"}``),
  tokenised as ``int32[batch_size, seq_len]`` (prompt + solution + EOS, right-padded; the loss covers
  the solution tokens only). ``log`` receives a progress line every ``log_every`` steps (0 or
  ``log=None``: silent). Returns the loss after every 50 steps.
  """
  if steps < 1:
    return SFTResult([], 0.0)
  t0 = time.perf_counter()
  if seq_len is None:
    lens = [
      len(
        tokenizer(
          tokenizer.apply_chat_template(build_messages(r["problem"]), tokenize=False, add_generation_prompt=True)
          + solution_text(r["problem"], r["answer"]),
          add_special_tokens=False,
        )["input_ids"]
      )
      + 1
      for r in rows
    ]
    seq_len = int(max(lens)) + 1  # room for a noisy answer one digit longer
  tokens, attn, loss_mask = _sft_batches(tokenizer, rows, seq_len=seq_len, noise=noise, seed=seed)
  losses = sft_sequences(
    model,
    tokens,
    attn,
    loss_mask,
    steps=steps,
    batch_size=batch_size,
    learning_rate=learning_rate,
    seed=seed,
    log_every=log_every,
    log=log,
    progress=progress,
  )
  return SFTResult(losses, time.perf_counter() - t0)


def sft_sequences(
  model: nnx.Module,
  tokens: np.ndarray,
  attn: np.ndarray,
  loss_mask: np.ndarray,
  *,
  steps: int,
  batch_size: int = 32,
  learning_rate: float = 3e-3,
  seed: int = 0,
  log_every: int = 0,
  log: Callable[[str], None] | None = print,
  progress: bool = False,
) -> list[float]:
  """Cross-entropy on the ``loss_mask`` tokens of fixed sequences, training ``model`` in place:
  ``tokens int32[N, L]`` right-padded, ``attn bool[N, L]`` the real tokens, ``loss_mask bool[N, L]`` the
  target tokens (e.g. a demonstration's completion, or a multi-turn conversation's policy turns).
  AdamW with a cosine schedule, ``batch_size`` rows drawn with replacement per step, 50 steps per
  compiled ``lax.scan``; returns the loss after every 50 steps (and the last). ``progress``: a tqdm bar
  (``script_io.step_bar``; its ETA starts after the first chunk's compilation) with the loss as its
  postfix, instead of the ``log`` lines."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt = optax.adamw(
    optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(1, steps // 20), steps, learning_rate * 0.1),
    weight_decay=0.0,
  )
  opt_state = opt.init(params)

  def loss_fn(p, tok, am, lm):
    m = nnx.merge(graphdef, p, rest)
    lp = models.log_probs(m, tok, am, chunk_size=tok.shape[1])
    lm = lm.astype(jnp.float32)
    return -(lp * lm).sum() / jnp.maximum(lm.sum(), 1.0)

  def one(carry, idx):
    p, s = carry
    loss, g = jax.value_and_grad(loss_fn)(p, tokens_d[idx], attn_d[idx], mask_d[idx])
    upd, s = opt.update(g, s, p)
    return (optax.apply_updates(p, upd), s), loss

  @jax.jit
  def run_chunk(p, s, idx):  # idx int32[C, batch]: C steps in one compiled scan
    (p, s), losses = jax.lax.scan(one, (p, s), idx)
    return p, s, losses

  tokens_d, attn_d, mask_d = jnp.asarray(tokens), jnp.asarray(attn), jnp.asarray(loss_mask)
  rng = np.random.default_rng(seed)
  indices = rng.integers(0, len(tokens), size=(steps, batch_size)).astype(np.int32)
  chunk = min(50, steps)
  bar = script_io.step_bar(steps, "supervised warm-up", disable=not progress)
  run_first = run_chunk.lower(params, opt_state, indices[:chunk]).compile()
  script_io.start_clock(bar)
  losses = []
  done = 0
  while done < steps:
    c = chunk if steps - done >= chunk else steps - done
    run = run_first if c == chunk else run_chunk
    params, opt_state, chunk_losses = run(params, opt_state, indices[done : done + c])
    done += c
    losses.append(float(chunk_losses[-1]))
    bar.update(c)
    bar.set_postfix(loss=f"{losses[-1]:.4f}")
    if not progress and log is not None and log_every and (done % max(log_every, chunk) < c or done == steps):
      log(f"sft step {done:4d} loss {losses[-1]:.4f}")
  bar.close()
  nnx.update(model, params)
  return losses


def warm_up(
  model: nnx.Module,
  tokenizer,
  rows: Sequence[dict],
  task: ArithmeticTask,
  *,
  seed: int,
  log: Callable[[str], None] | None = print,
  progress: bool = False,
) -> SFTResult:
  """:func:`sft_warmup` of ``model`` on ``rows`` with ``task``'s settings (``sft_steps``,
  ``sft_batch_size``, ``sft_learning_rate``, ``sft_noise``), logging four times (``progress``: a bar instead)."""
  return sft_warmup(
    model,
    tokenizer,
    rows,
    steps=task.sft_steps,
    batch_size=task.sft_batch_size,
    learning_rate=task.sft_learning_rate,
    seed=seed,
    noise=task.sft_noise,
    log_every=max(1, task.sft_steps // 4),
    log=log,
    progress=progress,
  )


registry.register_task("arithmetic", sys.modules[__name__])
