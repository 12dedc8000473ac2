"""Learned and remote rewards (docs/rewards.md), each a reward function
``(prompts, completions, **columns) -> list[float]`` for ``jaxgrpo.data.rewards.RewardSet``:

- ``reward_model``: Hugging Face ``*ForSequenceClassification`` reward models (Llama, Qwen2, Qwen3) on the policy's
  decoder, read at the last non-pad token as transformers does; :class:`RewardModelReward` scores text.
- ``judge``: a generative judge through any ``Engine`` (:class:`JudgeReward`, :func:`parse_judgment`).
- ``remote``: an HTTP reward service (:class:`RemoteReward`).

A judge reply without a score and a failed service request give NaN, a *missing sample* (advantage 0, out of the
loss; ``RewardSet`` keeps it and counts ``"<name>/missing"``), and a counter saying why — never a silent 0.
"""

from jaxgrpo.rewards.judge import (
  DEFAULT_RUBRIC,
  DEFAULT_TEMPLATE,
  REFERENCE_TEMPLATE,
  VERDICTS,
  JudgeReward,
  parse_judgment,
)
from jaxgrpo.rewards.remote import RemoteReward
from jaxgrpo.rewards.reward_model import RewardModel, RewardModelReward, last_token_index, load_reward_model

__all__ = [
  "DEFAULT_RUBRIC",
  "DEFAULT_TEMPLATE",
  "JudgeReward",
  "REFERENCE_TEMPLATE",
  "RemoteReward",
  "RewardModel",
  "RewardModelReward",
  "VERDICTS",
  "last_token_index",
  "load_reward_model",
  "parse_judgment",
]
