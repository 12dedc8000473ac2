"""jaxgrpo: pure-JAX GRPO, λ-GRPO and FRPO for LLM post-training.

The folders are the layers, every import pointing down (README, "The library"; tests/test_layers.py checks
the rule over these prefixes):

``_checks``, ``_version``  the floor: argument checks, the version (import nothing of jaxgrpo)
``services/``   checkpoints, metrics sinks, the run lock, the verifier pool (callable from every layer)
``kernels/``    1 advantages, process sets (λ-GRPO), KL and FRPO, surrogates, losses, importance weights,
                ``GRPOConfig``/``GRPOHyper``, the objective — JAX and NumPy only
``parallel/``   2 meshes and sharding rules, multi-process start-up
``models/``     3 GPT-2, Llama 3.x, Qwen2/2.5/3, MoE; LoRA/QLoRA; Hugging Face import/export; log-probs
``data/``       4 prompts (loading, encoding, iteration), answers
``rollout/``    5 sampling (``SamplingConfig``, ``generate``, slot refill, conversations), engines, environments
``rewards/``    6 every reward: ``RewardSet`` and the verifiable rewards, sequence-classifier reward models,
                generative judges through any engine, HTTP reward services (failures are missing samples, counted)
``step/``       7 ``Batch``, packing, the jitted train step and the reference pass
``loop/``       8 the rollout source, scoring and batch assembly, the learner and its schedules, asynchronous and
                partial rollouts, the one-iteration API
``run/``        9 the run config, the builders, evaluation, the collapse guard, the ``Trainer`` loop
``tasks/``      10 the demo and example tasks (arithmetic, binary tree, calculator); registered, never
                imported by a lower layer
``plan/``       11 compile every program of a run ahead of time for a target (a TPU topology from a CPU, ``cpu-N``,
                this machine) and say what fits where (``scripts/plan.py``)

Every name in ``__all__`` is re-exported *lazily*: ``import jaxgrpo`` imports nothing else, and
``jaxgrpo.group_advantages`` (or any other name) imports its module on first access — a kernel JAX and
NumPy only, ``jaxgrpo.make_train_step`` Flax and Optax too. (So a process that needs one small module,
such as the verifier worker of ``jaxgrpo.services.timeout_pool``, does not pay for JAX.) The module
attributes ``jaxgrpo.models``, ``.sampling``, ``.sharding``, ``.train`` and ``.iteration`` name
``jaxgrpo.models``, ``jaxgrpo.rollout.sampling``, ``jaxgrpo.parallel.sharding``, ``jaxgrpo.step.train``
and ``jaxgrpo.loop.iteration``. Import the run layer and the services by their paths (heavier
dependencies: datasets, transformers' tokenizers, Orbax).
"""

import importlib

from jaxgrpo._version import __version__

# name -> (module, attribute; None for the module itself): imported on first access (layer 1 needs JAX and
# NumPy, the layers above Flax and Optax too)
_KERNELS = {
  "jaxgrpo.kernels.advantages": ("group_advantages", "group_baseline", "rloo_advantages"),
  "jaxgrpo.kernels.process_sets": (
    "prefix_hashes",
    "process_set_sizes",
    "process_rewards",
    "process_advantages",
    "process_tree_stats",
  ),
  "jaxgrpo.kernels.kl": ("kl_penalty", "future_kl", "frpo_advantages"),
  "jaxgrpo.kernels.losses": (
    "policy_loss",
    "policy_loss_terms",
    "combine_terms",
    "finalize_terms",
    "LossTerms",
  ),
  "jaxgrpo.kernels.surrogates": ("policy_surrogate", "Surrogate"),
  "jaxgrpo.kernels.importance": ("importance_weights", "ImportanceWeights"),
  "jaxgrpo.kernels.config": ("GRPOConfig", "preset", "PRESETS"),
  "jaxgrpo.kernels.hyper": ("GRPOHyper",),
  "jaxgrpo.kernels.objective": ("rollout_advantages", "objective_terms"),
}
_LAZY = {
  **{name: (module, name) for module, names in _KERNELS.items() for name in names},
  "models": ("jaxgrpo.models", None),
  "sampling": ("jaxgrpo.rollout.sampling", None),
  "sharding": ("jaxgrpo.parallel.sharding", None),
  "train": ("jaxgrpo.step.train", None),
  "iteration": ("jaxgrpo.loop.iteration", None),
  **{n: ("jaxgrpo.models", n) for n in ("build_model", "load_hf", "save_hf", "log_probs")},
  **{n: ("jaxgrpo.rollout.sampling", n) for n in ("generate", "Rollout")},
  "make_mesh": ("jaxgrpo.parallel.sharding", "make_mesh"),
  **{
    n: ("jaxgrpo.step.train", n)
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
  "SamplingConfig": ("jaxgrpo.rollout.sampling", "SamplingConfig"),
  **{n: ("jaxgrpo.loop.iteration", n) for n in ("grpo_iteration", "multiturn_iteration", "rollout_loss")},
  **{n: ("jaxgrpo.loop.collect", n) for n in ("place_prompts", "sample", "score")},
  **{n: ("jaxgrpo.step.feed", n) for n in ("make_batch", "make_reference", "place", "policy_model")},
  "sample_multiturn": ("jaxgrpo.rollout.environments.rollout", "sample_multiturn"),
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
