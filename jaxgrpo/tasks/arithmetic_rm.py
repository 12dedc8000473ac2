"""A reward model for the arithmetic demo, trained here on a synthetic preference: a correct answer above a
wrong one. The offline stand-in for a learned reward (``reward.sources`` of kind ``reward_model``): a tiny
``Qwen3ForSequenceClassification`` fitted in seconds, saved as a Hugging Face folder, loaded by the trainer
like any other reward model (``scripts/train_reward_model.py``, ``scripts/configs/demo_rm.yaml``).

- :func:`preference_pairs`: for each problem ``"What is a + b?"``, the chosen completion
  ``"a+b=c. \\boxed{c}"`` (the warm-up's format) against rejected ones: the worked result right but the boxed
  value off by ±1, ±2 or ±10 (the warm-up policy's own mistake, ``data.arithmetic.sft_noise``), a consistent
  wrong result, no boxed answer, and a random string.
- :func:`train_reward_model`: a Bradley-Terry fit, ``-log σ(r(chosen) - r(rejected))``, of a fresh
  ``jaxgrpo.rewards.RewardModel`` (Qwen3 decoder + score head) with AdamW, on rows rendered exactly as
  ``RewardModelReward`` renders them at scoring time (the trainer's templated prompt,
  ``jaxgrpo.rewards.reward_model.encode_row``).
- :func:`pair_accuracy`: the fraction of pairs whose chosen completion scores above the rejected one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxgrpo.data import INSTRUCTION, build_messages
from jaxgrpo.rewards.reward_model import RewardModel, encode_row
from jaxgrpo.tasks import script_io
from jaxgrpo.tasks.arithmetic import solution_text, tiny_model_config

__all__ = [
  "REJECTED_KINDS",
  "Pair",
  "RMResult",
  "preference_pairs",
  "encode_pairs",
  "train_reward_model",
  "pair_accuracy",
]

#: the kinds of rejected completion, in the order :func:`preference_pairs` draws them
REJECTED_KINDS = ("boxed_off", "consistent_wrong", "no_box", "random")
_OFFSETS = (-10, -2, -1, 1, 2, 10)
_RANDOM_CHARS = list("0123456789+=. {}\\boxed")


@dataclasses.dataclass(frozen=True)
class Pair:
  """One preference: ``chosen`` (right) above ``rejected`` (of kind ``kind``) for ``problem``."""

  problem: str
  chosen: str
  rejected: str
  kind: str


def _rejected(problem: str, answer: str, kind: str, rng: np.random.Generator) -> str:
  wrong = str(int(answer) + int(rng.choice(_OFFSETS)))
  if kind == "boxed_off":
    return solution_text(problem, answer, boxed=wrong)
  if kind == "consistent_wrong":
    return solution_text(problem, wrong)
  if kind == "no_box":
    return solution_text(problem, answer).split(" \\boxed")[0]
  return "".join(rng.choice(_RANDOM_CHARS, size=int(rng.integers(1, 16))))


def preference_pairs(
  rows: Sequence[dict], *, seed: int, weights: Sequence[float] = (0.4, 0.3, 0.15, 0.15)
) -> list[Pair]:
  """One :class:`Pair` per row of ``rows`` (``{"problem": "What is a + b?", "answer": "c"}``), its rejected
  kind drawn from :data:`REJECTED_KINDS` with ``weights``. Deterministic in ``seed``."""
  if len(weights) != len(REJECTED_KINDS) or min(weights) < 0 or sum(weights) <= 0:
    raise ValueError(f"`weights` must be {len(REJECTED_KINDS)} non-negative numbers (not all 0); got {weights}")
  p = np.asarray(weights, float) / np.sum(weights)
  rng = np.random.default_rng([seed, 3])
  pairs = []
  for r in rows:
    kind = REJECTED_KINDS[int(rng.choice(len(REJECTED_KINDS), p=p))]
    chosen = solution_text(r["problem"], r["answer"])
    pairs.append(Pair(r["problem"], chosen, _rejected(r["problem"], r["answer"], kind, rng), kind))
  return pairs


def encode_pairs(
  tokenizer, pairs: Sequence[Pair], *, instruction: str | None = INSTRUCTION, seq_len: int | None = None
):
  """``(tokens int32[2N, L], mask bool[2N, L])``: rows ``2i`` (chosen) and ``2i + 1`` (rejected), right-padded
  with the tokenizer's pad id; each rendered as the trainer's reward model sees it — the prompt's chat messages
  (``build_messages`` with ``instruction``: the trainer's ``prompt_messages`` column) and the completion through
  the reward model's own template (``encode_row``)."""
  rows = []
  for pair in pairs:
    prompt = build_messages(pair.problem, instruction)  # the trainer's `prompt_messages` column of the row
    rows += [encode_row(tokenizer, prompt, pair.chosen), encode_row(tokenizer, prompt, pair.rejected)]
  width = max(len(r) for r in rows) if seq_len is None else seq_len
  if max(len(r) for r in rows) > width:
    raise ValueError(f"`seq_len` {seq_len} is shorter than the longest encoded row ({max(len(r) for r in rows)})")
  tokens = np.full((len(rows), width), tokenizer.pad_token_id, np.int32)
  mask = np.zeros((len(rows), width), bool)
  for i, r in enumerate(rows):
    tokens[i, : len(r)], mask[i, : len(r)] = r, True
  return tokens, mask


@dataclasses.dataclass
class RMResult:
  """What :func:`train_reward_model` did: the model, the loss after every chunk of steps, its wall time."""

  model: RewardModel
  losses: list[float]
  seconds: float


def train_reward_model(
  tokenizer,
  rows: Sequence[dict],
  *,
  steps: int = 400,
  batch_size: int = 64,
  learning_rate: float = 3e-3,
  hidden_size: int = 64,
  num_layers: int = 2,
  seed: int = 0,
  instruction: str | None = INSTRUCTION,
  init_from: nnx.Module | None = None,
  progress: bool = False,
) -> RMResult:
  """A fresh ``Qwen3ForSequenceClassification``-shaped :class:`RewardModel` (one label, ``hidden_size`` wide,
  ``num_layers`` deep, over ``tokenizer``'s vocabulary; its pad id the tokenizer's) fitted for ``steps``
  AdamW steps (warm-up then cosine decay) of Bradley-Terry loss on :func:`preference_pairs` of ``rows``,
  ``batch_size`` pairs drawn with replacement per step, 50 steps per compiled ``lax.scan``.

  ``init_from``: a causal LM of the same decoder (e.g. the demo's warmed-up policy, as reward models start
  from the SFT model) whose decoder weights start the fit (``hidden_size``/``num_layers`` are then its own);
  None: a random decoder. ``progress``: a tqdm bar ``reward model`` (``script_io.step_bar``: ``compiling``
  until the first chunk's program is compiled, the ETA timed from then) with the loss as its postfix."""
  if steps < 1 or batch_size < 1:
    raise ValueError(f"`steps` and `batch_size` must be >= 1; got {steps} and {batch_size}")
  t0 = time.perf_counter()
  pairs = preference_pairs(rows, seed=seed)
  tokens, mask = encode_pairs(tokenizer, pairs, instruction=instruction)
  if init_from is None:
    cfg = tiny_model_config(len(tokenizer), hidden_size=hidden_size, num_layers=num_layers)
    cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, 2 * tokens.shape[1]))
  else:
    cfg = init_from.config
  model = RewardModel(cfg, 1, pad_token_id=tokenizer.pad_token_id, rngs=nnx.Rngs(seed))
  if init_from is not None:
    nnx.update(model.model, nnx.state(init_from, nnx.Param))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt = optax.adamw(
    optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(1, steps // 20), steps, learning_rate * 0.1),
    weight_decay=0.0,
  )
  opt_state = opt.init(params)
  tok_d = jnp.asarray(tokens.reshape(len(pairs), 2, -1))
  mask_d = jnp.asarray(mask.reshape(len(pairs), 2, -1))

  def loss_fn(p, idx):
    t, m = tok_d[idx].reshape(-1, tok_d.shape[-1]), mask_d[idx].reshape(-1, mask_d.shape[-1])
    r = nnx.merge(graphdef, p, rest)(t, m)[:, 0].reshape(-1, 2)
    return -jax.nn.log_sigmoid(r[:, 0] - r[:, 1]).mean()

  def one(carry, idx):
    p, s = carry
    loss, g = jax.value_and_grad(loss_fn)(p, idx)
    upd, s = opt.update(g, s, p)
    return (optax.apply_updates(p, upd), s), loss

  @jax.jit
  def run_chunk(p, s, idx):
    (p, s), losses = jax.lax.scan(one, (p, s), idx)
    return p, s, losses

  indices = np.random.default_rng([seed, 4]).integers(0, len(pairs), size=(steps, batch_size)).astype(np.int32)
  losses, done, chunk = [], 0, min(50, steps)
  bar = script_io.step_bar(steps, "reward model", disable=not progress)
  run_first = run_chunk.lower(params, opt_state, indices[:chunk]).compile()
  script_io.start_clock(bar)
  while done < steps:
    c = min(chunk, steps - done)
    run = run_first if c == chunk else run_chunk
    params, opt_state, chunk_losses = run(params, opt_state, indices[done : done + c])
    done += c
    losses.append(float(chunk_losses[-1]))
    bar.update(c)
    bar.set_postfix(loss=f"{losses[-1]:.4f}")
  bar.close()
  nnx.update(model, params)
  return RMResult(model, losses, time.perf_counter() - t0)


def pair_accuracy(
  model: RewardModel, tokenizer, pairs: Sequence[Pair], *, instruction: str | None = INSTRUCTION
) -> dict[str, float]:
  """The fraction of ``pairs`` whose chosen completion scores strictly above the rejected one: ``"all"`` and
  one entry per rejected kind present."""
  tokens, mask = encode_pairs(tokenizer, pairs, instruction=instruction)
  scores = model.score(tokens, mask)[:, 0].reshape(-1, 2)
  right = scores[:, 0] > scores[:, 1]
  kinds = np.asarray([p.kind for p in pairs])
  out = {"all": float(right.mean())}
  for kind in REJECTED_KINDS:
    if (kinds == kind).any():
      out[kind] = float(right[kinds == kind].mean())
  return out
