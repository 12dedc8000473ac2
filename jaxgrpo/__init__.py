"""jaxgrpo: pure-JAX GRPO, λ-GRPO and FRPO for LLM post-training.

The package is layered, every import pointing down (README, "The library"):

1. kernels — ``advantages``: group_advantages, group_baseline, rloo_advantages; ``process_sets``:
   prefix_hashes, process_set_sizes, process_rewards, process_advantages, process_tree_stats
   (λ-GRPO); ``kl``: kl_penalty, future_kl, frpo_advantages (FRPO); ``losses``: policy_loss,
   policy_loss_terms, combine_terms, finalize_terms, LossTerms; ``surrogates``: policy_surrogate
   (PPO clip, GSPO, GSPO-token, CISPO, SAPO, GMPO); ``importance``: importance_weights (TIS/MIS);
   ``config``: GRPOConfig, preset, PRESETS; ``objective``: rollout_advantages, objective_terms
   (config → kernels).
2. models/sampling — ``jaxgrpo.models``: build_model, load_hf, save_hf, log_probs (GPT-2, Llama 3.x,
   Qwen2/2.5, Qwen3); ``jaxgrpo.sampling``: generate, Rollout; ``jaxgrpo.sharding``: make_mesh;
   ``jaxgrpo.distributed``: multi-host start-up.
3. train step — ``jaxgrpo.train``: make_train_step, TrainConfig, TrainState.
4. iteration/trainer — ``jaxgrpo.iteration``: grpo_iteration and its pieces (sample, score,
   make_batch, make_reference, policy_model); ``jaxgrpo.data``, ``rewards``, ``evaluation``, ``tasks`` (binary_tree,
   arithmetic), ``specs`` (the run config), ``builders`` (model and prompts from it), ``trainer``,
   ``collapse`` (the guard against a policy that collapses with finite values).
   Services beside them: ``jaxgrpo.checkpoint``, ``jaxgrpo.metrics``, ``jaxgrpo.runlock`` (one run per
   output directory) (they import nothing of jaxgrpo).

Layers 1–3 and ``jaxgrpo.iteration`` are re-exported here; import the modules of layer 4 and the services yourself (heavier
dependencies: datasets, transformers' tokenizers, Orbax).
"""

from jaxgrpo import iteration, models, sampling, sharding, train  # noqa: E402  (subsystems, after the kernels)
from jaxgrpo._version import __version__
from jaxgrpo.advantages import group_advantages, group_baseline, rloo_advantages
from jaxgrpo.config import PRESETS, GRPOConfig, preset
from jaxgrpo.importance import ImportanceWeights, importance_weights
from jaxgrpo.iteration import SamplingConfig, grpo_iteration
from jaxgrpo.kl import frpo_advantages, future_kl, kl_penalty
from jaxgrpo.losses import LossTerms, combine_terms, finalize_terms, policy_loss, policy_loss_terms
from jaxgrpo.models import build_model, load_hf, log_probs, save_hf
from jaxgrpo.objective import objective_terms, rollout_advantages
from jaxgrpo.process_sets import (
  prefix_hashes,
  process_advantages,
  process_rewards,
  process_set_sizes,
  process_tree_stats,
)
from jaxgrpo.sampling import Rollout, generate
from jaxgrpo.sharding import make_mesh
from jaxgrpo.surrogates import Surrogate, policy_surrogate
from jaxgrpo.train import TrainConfig, TrainState, make_train_step

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
  "combine_terms",
  "finalize_terms",
  "LossTerms",
  "policy_surrogate",
  "Surrogate",
  "importance_weights",
  "ImportanceWeights",
  # configuration
  "GRPOConfig",
  "preset",
  "PRESETS",
  "rollout_advantages",
  "objective_terms",
  # models, sampling, the train step
  "models",
  "sampling",
  "sharding",
  "train",
  "iteration",
  "grpo_iteration",
  "SamplingConfig",
  "build_model",
  "load_hf",
  "save_hf",
  "log_probs",
  "generate",
  "Rollout",
  "make_mesh",
  "make_train_step",
  "TrainConfig",
  "TrainState",
]
