"""Shared by the three benchmark workers (NumPy + stdlib only: imported inside every venv)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time

PROMPTS, PROMPT_LEN, SAMPLES, NEW_TOKENS, VOCAB = 16, 32, 8, 128, 32000
BETA, LR, MICRO = 0.04, 1e-6, 64  # KL coefficient, AdamW learning rate, rows per micro-batch
CHUNK = 32  # jaxgrpo's log-prob chunk: 64 rows × 32 positions = 2048 tokens of f32 logits (262 MB) at a time
if os.environ.get("PEERS_SMOKE"):  # a seconds-long run of the same code paths (not a benchmark)
  PROMPTS, NEW_TOKENS, MICRO = 2, 8, 8


def prompt_ids(seed: int = 0):
  """The shared prompts: int[16, 32] token ids in [2, 32000) (0 = pad, 1 = EOS are never drawn)."""
  import numpy as np

  return np.random.default_rng(seed).integers(2, VOCAB, (PROMPTS, PROMPT_LEN))


def prompt_texts(seed: int = 0) -> list[str]:
  """The same prompts as text for the word-level tokenizer ("t17 t2093 ...")."""
  return [" ".join(f"t{i}" for i in row) for row in prompt_ids(seed)]


def reward_ids(ids) -> float:
  """The shared (cheap, host-side) reward: fraction of even token ids in the completion."""
  ids = [int(i) for i in ids]
  return sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1)


def reward_text(text: str) -> float:
  return reward_ids(w[1:] for w in text.split() if w.startswith("t") and w[1:].isdigit())


def peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


class RewardClock:
  """Wraps a reward function; the times between its calls are the iteration times of a trainer
  that calls it once per GRPO iteration (after the rollout, before the update)."""

  def __init__(self, fn):
    self.fn, self.stamps = fn, []
    self.__name__ = "even_token_fraction"

  def __call__(self, *args, **kwargs):
    self.stamps.append(time.perf_counter())
    return self.fn(*args, **kwargs)

  def intervals(self) -> list[float]:
    return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


def report(result: dict) -> None:
  result["peak_rss_gb"] = round(peak_rss_gb(), 3)
  result["pid"] = os.getpid()
  print("RESULT " + json.dumps(result), flush=True)
  sys.stdout.flush()
