"""Which combinations of a run's options are refused, one line each and in one place: the check the
:class:`~jaxgrpo.run.spec_schema.TrainerConfig` runs at load (one process assumed) and the trainer runs
again at start (``process_count`` = ``jax.process_count()``). A refusal names the options and its reason:
physical or mathematical (what a device, the engine's build or its API cannot do; what has no meaning), never
"not built yet".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxgrpo.rollout.engines.registry import capability
from jaxgrpo.step.teacher_remote import is_served_teacher

if TYPE_CHECKING:
  from jaxgrpo.run.spec_schema import TrainerConfig

__all__ = ["PARTIAL_ROUTING_REPLAY_ERROR", "check_composition"]


def check_composition(cfg: TrainerConfig, *, process_count: int = 1) -> None:
  """Every combination of options a run refuses, one line each, in one place: at load (``TrainerConfig``,
  one process assumed) and again when the trainer starts (``process_count`` = ``jax.process_count()``).
  A combination is refused only for a physical or mathematical reason, stated in its line. What an engine cannot
  do is asked of its class (``jaxgrpo.rollout.engines.registry.capability``), never of its name."""
  roll = cfg.rollout
  synthetic_moe = cfg.model.synthetic is not None and getattr(cfg.model.synthetic, "num_experts", 0)
  refusal = capability(roll.engine, "routing_replay_refusal", None)  # vLLM's: physical (its CPU build)
  if refusal and roll.routing_replay == "rollout" and synthetic_moe:
    raise ValueError(refusal)
  filtered = capability(roll.engine, "filtered_logprobs_off_unit_temperature")
  if filtered and cfg.step.temperature != 1.0 and (roll.top_k or roll.top_p < 1.0):  # physical
    raise ValueError(
      f"`rollout.engine: {roll.engine}` with `step.temperature`={cfg.step.temperature} != 1 cannot report "
      f"full-vocabulary log-probs after top-k/top-p filtering (rollout.top_k={roll.top_k}, rollout.top_p={roll.top_p}): "
      'use temperature 1 or no filtering (docs/sampling.md, "Engines")'
    )
  if not capability(roll.engine, "samples_on_mesh") and cfg.devices.rollout:  # physical: the engine places itself
    raise ValueError(
      f"`devices.rollout`={cfg.devices.rollout} gives the built-in sampler devices of its own; `rollout.engine: "
      f"{roll.engine}` samples on the engine's own devices: unset one"
    )
  if roll.partial.enabled:
    _check_partial(cfg, process_count, synthetic_moe)
  if roll.speculative != "off":
    _check_speculative(cfg)
  if cfg.objective.distill is not None:
    _check_distill(cfg)
  elif cfg.devices.teacher is not None:  # physical: nothing to place there
    raise ValueError(
      f"`devices.teacher`={cfg.devices.teacher} gives a distillation teacher devices of its own, but "
      "`objective.distill` is not set: set the teacher or unset devices.teacher"
    )


def _check_speculative(cfg: TrainerConfig) -> None:
  """The combination ``rollout.speculative`` refuses, in one line (jaxgrpo.rollout.speculative). It composes with
  everything else, multi-turn on several processes included (the collective rounds speculate:
  ``jaxgrpo.rollout.engines.collective``)."""
  roll = cfg.rollout
  if not capability(roll.engine, "speculates"):  # physical: another engine runs its own decoding
    raise ValueError(
      f"`rollout.speculative: {roll.speculative}` is the built-in sampler's; `rollout.engine: {roll.engine}` decodes "
      "by itself (configure its own speculative decoding): set rollout.speculative: off"
    )


def _check_distill(cfg: TrainerConfig) -> None:
  """The combinations a distillation term (``objective.distill``) refuses, one line each."""
  d = cfg.objective.distill
  if d.teacher is None:
    raise ValueError(
      "`objective.distill` needs `teacher`: an HF model directory, a run directory or checkpoint, "
      "`synthetic:<hidden_size>x<num_layers>`, a teacher server's `http://host:port` or `vllm:<one of those>`"
    )
  if cfg.devices.teacher is not None and is_served_teacher(d.teacher):  # physical
    raise ValueError(
      f"`devices.teacher`={cfg.devices.teacher} places an in-process teacher, but `objective.distill.teacher`="
      f"{d.teacher!r} is served outside the run's JAX devices (a server or vLLM): unset devices.teacher"
    )


#: why partial rollouts refuse MoE routing replay (mathematical: no routing to replay exists).
PARTIAL_ROUTING_REPLAY_ERROR = (
  "`rollout.partial.enabled` with a mixture-of-experts policy and `rollout.routing_replay: rollout`: a row "
  "re-prefilled at a weight update routes its earlier positions once per version, and each token was sampled "
  "through its own version's experts at those positions, so no single routing per position (what replay gives the "
  "learner's one pass) reproduces every token's sampling; set `rollout.routing_replay: none`"
)


def _check_partial(cfg: TrainerConfig, process_count: int, synthetic_moe) -> None:
  """The combinations partial rollouts refuse, one line each."""
  roll, part = cfg.rollout, cfg.rollout.partial
  if roll.max_staleness < 1:
    raise ValueError(
      "`rollout.partial.enabled` needs `rollout.max_staleness` >= 1 (a row crossing a weight update holds tokens "
      f"one version older); got {roll.max_staleness}"
    )
  if part.ahead is not None and part.ahead >= roll.max_staleness:
    raise ValueError(
      f"`rollout.partial.ahead`={part.ahead} must be < `rollout.max_staleness`={roll.max_staleness}: a row carried "
      "into the next batch would always be older than max_staleness"
    )
  if synthetic_moe and roll.routing_replay == "rollout":  # mathematical
    raise ValueError(PARTIAL_ROUTING_REPLAY_ERROR)
