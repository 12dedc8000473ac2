"""Rewards, in one home (docs/rewards.md): ``reward_set`` (``RewardSet``: weighted reward functions, the
verifiable format and accuracy rewards, run in a timeout pool) and the learned and remote rewards, each a reward
function
``(prompts, completions, **columns) -> list[float]`` for ``jaxgrpo.rewards.reward_set.RewardSet``:

- ``reward_model``: Hugging Face ``*ForSequenceClassification`` reward models (Llama, Qwen2, Qwen3) on the policy's
  decoder, read at the last non-pad token as transformers does; :class:`RewardModelReward` scores text.
- ``judge``: a generative judge through any ``Engine`` (:class:`JudgeReward`, :func:`parse_judgment`).
- ``remote``: an HTTP reward service (:class:`RemoteReward`).

A judge reply without a score and a failed service request give NaN, a *missing sample* (advantage 0, out of the
loss; ``RewardSet`` keeps it and counts ``"<name>/missing"``), and a counter saying why — never a silent 0.
"""

import importlib

_NAMES = {
  "jaxgrpo.rewards.judge": (
    "DEFAULT_RUBRIC",
    "DEFAULT_TEMPLATE",
    "REFERENCE_TEMPLATE",
    "VERDICTS",
    "JudgeReward",
    "parse_judgment",
  ),
  "jaxgrpo.rewards.remote": ("RemoteReward",),
  "jaxgrpo.rewards.reward_model": ("RewardModel", "RewardModelReward", "last_token_index", "load_reward_model"),
}
_WHERE = {n: m for m, names in _NAMES.items() for n in names}
__all__ = sorted(_WHERE)


def __getattr__(name):
  """Imported on first access: ``jaxgrpo.rewards.reward_set`` (what the verifier worker of
  ``jaxgrpo.services.timeout_pool`` unpickles) must not pull in JAX through the judge or the reward model."""
  if name not in _WHERE:
    raise AttributeError(f"module 'jaxgrpo.rewards' has no attribute {name!r}")
  value = getattr(importlib.import_module(_WHERE[name]), name)
  globals()[name] = value
  return value
