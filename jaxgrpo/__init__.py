"""jaxgrpo: pure-JAX GRPO, λ-GRPO and FRPO for LLM post-training.

The package is layered, every import pointing down (README, "The library"):

1. kernels — ``advantages``: group_advantages, group_baseline, rloo_advantages; ``process_sets``:
   prefix_hashes, process_set_sizes, process_rewards, process_advantages, process_tree_stats
   (λ-GRPO); ``kl``: kl_penalty, future_kl, frpo_advantages (FRPO); ``losses``: policy_loss,
   policy_loss_terms, LossHyper, combine_terms, finalize_terms, LossTerms; ``surrogates``:
   policy_surrogate (PPO clip, GSPO, GSPO-token, CISPO, SAPO, GMPO); ``importance``:
   importance_weights (TIS/MIS); ``config``: GRPOConfig, GRPOHyper, preset, PRESETS; ``objective``:
   rollout_advantages, objective_terms (config → kernels).
2. models/sampling — ``jaxgrpo.models``: build_model, load_hf, save_hf, log_probs (GPT-2, Llama 3.x,
   Qwen2/2.5, Qwen3); ``jaxgrpo.sampling``: generate, Rollout; ``jaxgrpo.sharding``: make_mesh;
   ``jaxgrpo.distributed``: multi-host start-up.
3. train step — ``jaxgrpo.train``: init_train_state, make_train_step, make_reference_fn, Batch,
   TrainConfig, TrainState, TrainStep (``Batch`` is ``jaxgrpo.batch``, its buckets and packing
   ``jaxgrpo.batch_packing``, both re-exported by ``train``).
4. iteration/trainer — ``jaxgrpo.iteration``: grpo_iteration and its pieces (sample, score,
   make_batch, place, make_reference, policy_model, rollout_loss), multiturn_iteration and
   sample_multiturn (environments); ``jaxgrpo.data``, ``rewards``,
   ``evaluation``, ``tasks`` (binary_tree, arithmetic), ``specs`` (the run config), ``builders`` (model
   and prompts from it), ``trainer``,
   ``collapse`` (the guard against a policy that collapses with finite values). Services beside them:
   ``jaxgrpo.checkpoint``, ``jaxgrpo.metrics``, ``jaxgrpo.runlock`` (one run per output directory).

The kernels (layer 1) are imported with the package and need only JAX and NumPy. Layers 2–3 and
``jaxgrpo.iteration`` are re-exported here *lazily*: ``jaxgrpo.make_train_step`` (or any name of
theirs in ``__all__``) imports its module, and Flax and Optax with it, on first access. Import the
other modules of layer 4 and the services yourself (heavier dependencies: datasets, transformers'
tokenizers, Orbax).
"""

import importlib

from jaxgrpo._version import __version__
from jaxgrpo.advantages import group_advantages, group_baseline, rloo_advantages
from jaxgrpo.config import PRESETS, GRPOConfig, GRPOHyper, preset
from jaxgrpo.importance import ImportanceWeights, importance_weights
from jaxgrpo.kl import frpo_advantages, future_kl, kl_penalty
from jaxgrpo.losses import LossHyper, LossTerms, combine_terms, finalize_terms, policy_loss, policy_loss_terms
from jaxgrpo.objective import objective_terms, rollout_advantages
from jaxgrpo.process_sets import (
  prefix_hashes,
  process_advantages,
  process_rewards,
  process_set_sizes,
  process_tree_stats,
)
from jaxgrpo.surrogates import Surrogate, policy_surrogate

# name -> (module, attribute; None for the module itself): imported on first access (layers 2-4 need Flax)
_LAZY = {
  **{m: (f"jaxgrpo.{m}", None) for m in ("models", "sampling", "sharding", "train", "iteration")},
  **{n: ("jaxgrpo.models", n) for n in ("build_model", "load_hf", "save_hf", "log_probs")},
  **{n: ("jaxgrpo.sampling", n) for n in ("generate", "Rollout")},
  "make_mesh": ("jaxgrpo.sharding", "make_mesh"),
  **{
    n: ("jaxgrpo.train", n)
    for n in (
      "Batch",
      "TrainConfig",
      "TrainState",
      "TrainStep",
      "init_train_state",
      "make_reference_fn",
      "make_train_step",
    )
  },
  **{
    n: ("jaxgrpo.iteration", n)
    for n in (
      "SamplingConfig",
      "grpo_iteration",
      "make_batch",
      "make_reference",
      "multiturn_iteration",
      "place",
      "place_prompts",
      "policy_model",
      "rollout_loss",
      "sample",
      "sample_multiturn",
      "score",
    )
  },
}


def __getattr__(name):
  """The lazy part of the public API (see the module docstring)."""
  if name not in _LAZY:
    raise AttributeError(f"module 'jaxgrpo' has no attribute {name!r}")
  module, attribute = _LAZY[name]
  value = importlib.import_module(module)
  value = value if attribute is None else getattr(value, attribute)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_LAZY))


__all__ = [
  "__version__",
  # advantages
  "group_advantages",
  "group_baseline",
  "rloo_advantages",
  # process sets (λ-GRPO)
  "prefix_hashes",
  "process_set_sizes",
  "process_rewards",
  "process_advantages",
  "process_tree_stats",
  # KL and FRPO
  "kl_penalty",
  "future_kl",
  "frpo_advantages",
  # losses
  "policy_loss",
  "policy_loss_terms",
  "LossHyper",
  "combine_terms",
  "finalize_terms",
  "LossTerms",
  "policy_surrogate",
  "Surrogate",
  "importance_weights",
  "ImportanceWeights",
  # configuration
  "GRPOConfig",
  "GRPOHyper",
  "preset",
  "PRESETS",
  "rollout_advantages",
  "objective_terms",
  # models, sampling, the train step, the iteration (lazy, in the order of _LAZY)
  *_LAZY,
]
