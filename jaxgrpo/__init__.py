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

Every name in ``__all__`` is re-exported *lazily*: ``import jaxgrpo`` imports nothing else, and
``jaxgrpo.group_advantages`` (or any other name) imports its module on first access — a kernel (layer 1)
JAX and NumPy only, ``jaxgrpo.make_train_step`` Flax and Optax too. (So a process that needs one small
module, such as the verifier worker of ``jaxgrpo.timeout_pool``, does not pay for JAX.) Import the other
modules of layer 4 and the services yourself (heavier dependencies: datasets, transformers' tokenizers,
Orbax).
"""

import importlib

from jaxgrpo._version import __version__

# name -> (module, attribute; None for the module itself): imported on first access (layer 1 needs JAX and
# NumPy, layers 2-4 Flax and Optax too)
_KERNELS = {
  "jaxgrpo.advantages": ("group_advantages", "group_baseline", "rloo_advantages"),
  "jaxgrpo.process_sets": (
    "prefix_hashes",
    "process_set_sizes",
    "process_rewards",
    "process_advantages",
    "process_tree_stats",
  ),
  "jaxgrpo.kl": ("kl_penalty", "future_kl", "frpo_advantages"),
  "jaxgrpo.losses": ("policy_loss", "policy_loss_terms", "LossHyper", "combine_terms", "finalize_terms", "LossTerms"),
  "jaxgrpo.surrogates": ("policy_surrogate", "Surrogate"),
  "jaxgrpo.importance": ("importance_weights", "ImportanceWeights"),
  "jaxgrpo.config": ("GRPOConfig", "GRPOHyper", "preset", "PRESETS"),
  "jaxgrpo.objective": ("rollout_advantages", "objective_terms"),
}
_LAZY = {
  **{name: (module, name) for module, names in _KERNELS.items() for name in names},
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


__all__ = ["__version__", *_LAZY]
