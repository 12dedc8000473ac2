"""What the multi-turn rollout (``jaxgrpo.rollout.environments.sample_multiturn``) costs with and without the
KV cache kept across turns.

``sample_multiturn(..., kv_cache=False)`` re-prefills ``prompt ‖ trajectory so far`` at every turn
(``jaxgrpo.rollout.sampling.generate`` keeps no KV cache across calls); the default ``kv_cache=True``
(``jaxgrpo.rollout.conversation.ConversationSampler``) keeps one cache per rollout, decodes the policy's tokens and
prefills each observation once. This script times, alternately, after one warm-up each (compilation
excluded), on the same model and the same numbers of tokens:

- ``multiturn``: ``sample_multiturn`` with a scripted environment, re-prefill (``kv_cache=False``) and cached
  (``kv_cache=True``): every trajectory takes exactly
  ``--turns`` turns of exactly ``--turn-tokens`` policy tokens (no EOS), each answered by the same
  observation; host work (decode, environment, template) included;
- ``one decode``: one ``generate`` call decoding all of a trajectory's tokens (policy and observation)
  in one continuous KV-cached loop from the prompt — what a cache-keeping sampler costs at most (it
  would prefill the observation tokens, cheaper than decoding them);
- ``turn decodes``: the policy tokens alone, ``--turns`` independent ``generate`` calls of
  ``--turn-tokens`` from the bare prompt — the decode work without any conversation prefix.

    python scripts/bench_multiturn.py                 # BENCHMARKS.md, "Multi-turn rollout: re-prefill"
    python scripts/bench_multiturn.py --rows 4 --turns 2 --turn-tokens 4 --repeats 1   # smoke run
    python scripts/bench_multiturn.py --long-every 8  # ragged: 1 trajectory in 8 takes the 4 turns, the rest one
    python scripts/bench_multiturn.py --draft-model small --repeats 3   # also speculative turns with a draft model

``--draft-model small|self`` adds two variants: ``sample_multiturn`` decoding every turn by verify steps with a draft
model (``rollout.speculative: draft``, k = ``--draft-tokens``), re-prefilled per turn (``generate_speculative``,
``kv_cache=False``) and cached (``ConversationSampler(draft_model=)``: the draft's KV cache kept beside the
policy's). ``small``: a random model of the vocabulary (hidden ``--hidden`` / 2, 1 layer), drafts rarely
accepted; ``self``: the policy itself as its draft, every draft accepted (p = q) — the best case.

With ``--long-every K`` only the two multiturn variants are ragged (one decode and the turn decodes still time
every row at its full length: compare the two multiturn lines then).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

from jaxgrpo import data as data_lib
from jaxgrpo.loop.iteration import SamplingConfig  # noqa: E402
from jaxgrpo.models import build_model  # noqa: E402
from jaxgrpo.rollout.environments import MultiTurnConfig, StepResult, sample_multiturn  # noqa: E402
from jaxgrpo.rollout.environments.chat import ChatFormat  # noqa: E402
from jaxgrpo.rollout.sampling import generate  # noqa: E402
from jaxgrpo.rollout.speculative import SpeculativeConfig, SpeculativeSwitch  # noqa: E402
from jaxgrpo.tasks import arithmetic, calculator  # noqa: E402

OBSERVATION = "result: 12345678"


class Fixed:
  """``turns`` turns, every one answered by the same tool message."""

  tools = ()

  def __init__(self, turns):
    self.turns = turns

  def reset(self, row):
    self.k = 0
    return [{"role": "user", "content": row["problem"]}]

  def step(self, text):
    self.k += 1
    if self.k >= self.turns:
      return StepResult((), 1.0, True)
    return StepResult([{"role": "tool", "content": OBSERVATION}], 0.0, False)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--rows", type=int, default=32, help="trajectories (prompts × G with G = 1)")
  ap.add_argument("--turns", type=int, default=4)
  ap.add_argument(
    "--long-every",
    type=int,
    default=1,
    help="ragged turns: trajectory i takes --turns turns when i %% K == 0, else one (1: all take --turns)",
  )
  ap.add_argument("--turn-tokens", type=int, default=24)
  ap.add_argument("--hidden", type=int, default=64)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--draft-model", choices=("small", "self"), default=None, help="also time a draft model's turns")
  ap.add_argument("--draft-tokens", type=int, default=4, help="k, tokens drafted per verify step")
  args = ap.parse_args(argv)
  print(_bench.backend_line())
  tok = calculator.build_tokenizer()
  cfg = arithmetic.tiny_model_config(
    len(tok), hidden_size=args.hidden, num_layers=args.layers, max_position_embeddings=1024
  )
  model = build_model(cfg, rngs=nnx.Rngs(0))
  rows = [
    {"problem": f"What is {10 + i} * {20 + i}?", "turns": args.turns if i % args.long_every == 0 else 1}
    for i in range(args.rows)
  ]
  fmt = ChatFormat(tok)
  obs_len = len(fmt.observation_ids([{"role": "tool", "content": OBSERVATION}], fmt.encode("x")))
  total = args.turns * args.turn_tokens + (args.turns - 1) * obs_len
  sampling = SamplingConfig(num_samples=1, max_new_tokens=1, eos_ids=(), pad_id=tok.pad_token_id)
  env_config = MultiTurnConfig(
    max_turns=args.turns, max_tokens=total, turn_tokens=args.turn_tokens, stop_at_tool_call=False
  )
  prompts = [fmt.prompt_ids(Fixed(1).reset(r)) for r in rows]
  p_len = max(len(p) for p in prompts)
  tokens, mask = data_lib.pad_left(prompts, p_len, tok.pad_token_id)
  key = jax.random.key(0)

  draft = None
  if args.draft_model == "self":
    draft = model
  elif args.draft_model == "small":
    small = arithmetic.tiny_model_config(
      len(tok), hidden_size=args.hidden // 2, num_layers=1, max_position_embeddings=1024
    )
    draft = build_model(small, rngs=nnx.Rngs(1))
  spec = SpeculativeConfig(mode="draft", num_draft=args.draft_tokens, draft="in memory")
  acceptance = {}

  def multiturn(kv_cache, draft_model=None):
    switch = None if draft_model is None else SpeculativeSwitch(config=spec, draft_model=draft_model)
    out = sample_multiturn(
      model, rows, lambda r: Fixed(r["turns"]), tok, sampling, env_config, key=key, kv_cache=kv_cache,
      speculative=switch,
    )  # fmt: skip
    if switch is not None:
      acceptance[kv_cache] = switch.metrics["rollout/spec_acceptance"]
    # an observation is one token shorter after a turn that happened to end in <|im_end|> (not written twice)
    long = [i % args.long_every == 0 for i in range(args.rows)]
    assert out.mask.sum(1)[long].min() >= total - args.turns, (out.mask.sum(1), total)
    return out

  one = SamplingConfig(num_samples=1, max_new_tokens=total, pad_id=tok.pad_token_id)
  per_turn = SamplingConfig(num_samples=1, max_new_tokens=args.turn_tokens, pad_id=tok.pad_token_id)

  def one_decode():
    return generate(model, tokens, mask, one, key=key)

  def turn_decodes():
    return [generate(model, tokens, mask, per_turn, key=key) for _ in range(args.turns)]

  reprefill, cached = multiturn(False), multiturn(True)
  same_ids = bool((reprefill.completions == cached.completions).all())
  logp_diff = float(abs(reprefill.log_probs - cached.log_probs).max())
  fns = [lambda: multiturn(False), lambda: multiturn(True), one_decode, turn_decodes]
  if draft is not None:
    fns += [lambda: multiturn(False, draft), lambda: multiturn(True, draft)]
  times = _bench.alternating_times(fns, args.repeats)
  med = [statistics.median(t) for t in times]
  print(
    f"rows {args.rows}, prompt {p_len} tokens, {args.turns} turns × {args.turn_tokens} policy tokens, "
    f"{args.turns - 1} observations × {obs_len} tokens = {total} tokens per trajectory"
  )
  names = (
    "multiturn (re-prefill per turn)",
    "multiturn (KV cache kept)",
    "one continuous decode",
    "turn decodes alone",
    f"draft model {args.draft_model} (re-prefill per turn)",
    f"draft model {args.draft_model} (KV caches kept)",
  )
  for name, t in zip(names, med):
    print(f"{name:40s} {t:7.3f} s  ({args.rows * total / t:8.0f} trajectory tokens/s)")
  print(f"cached vs re-prefill: same token ids {same_ids}, max |log-prob difference| {logp_diff:.2e}")
  print(f"re-prefill rollout / one continuous decode: {med[0] / med[2]:.2f}x")
  print(f"cached rollout / one continuous decode: {med[1] / med[2]:.2f}x")
  print(f"re-prefill / cached: {med[0] / med[1]:.2f}x")
  if draft is not None:
    print(
      f"draft model (k={args.draft_tokens}): acceptance re-prefill {acceptance[False]:.3f}, cached "
      f"{acceptance[True]:.3f}; re-prefill / cached: {med[4] / med[5]:.2f}x; cached plain / cached draft: "
      f"{med[1] / med[5]:.2f}x"
    )
  return med


if __name__ == "__main__":
  main()
