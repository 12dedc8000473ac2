"""Algorithm configuration: one frozen dataclass whose fields are the papers' symbols, and named presets.

=================  ==========================================================================
preset             what it is
=================  ==========================================================================
``grpo``           GRPO (DeepSeekMath) with group-std advantages and token-mean aggregation,
                   the form analysed by λ-GRPO; β=0 (set ``beta=0.04`` for the k3 KL term)
``dr_grpo``        Dr.GRPO: no std division, ``seq-mean-token-sum-norm``
``dapo``           DAPO: clip-higher (ε_low 0.2, ε_high 0.28), token-mean, β=0, dynamic sampling
``lambda_grpo``    λ-GRPO: GRPO with every token term divided by ``|λ(i,t)|``
``frpo``           FRPO: β=0.01 future-KL (reverse k1) cost-to-go inside the advantage
``lambda_frpo``    FRPO advantages with λ-GRPO's ``1/|λ|`` token weights (no paper has run it)
=================  ==========================================================================
"""

from __future__ import annotations

import dataclasses

from jaxgrpo import _checks
from jaxgrpo.advantages import ADVANTAGE_SCALES
from jaxgrpo.kl import FUTURE_KL_KINDS, KL_KINDS
from jaxgrpo.losses import AGGREGATIONS

__all__ = ["KL_PLACEMENTS", "GRPOConfig", "PRESETS", "preset"]

KL_PLACEMENTS = ("loss", "future")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
  """The objective of one GRPO-family algorithm. Validated on construction.

  Every field is checked for its type (``TypeError``: e.g. ``beta="0.1"``, ``std_ddof=True``) and
  its value (``ValueError``: negative, NaN or infinite numbers, unknown names). The config is
  frozen and hashable, so the jitted kernels take it as a static argument.

  Attributes:
    name: label (the preset's name, or "custom").
    advantage_scale: ``"group"`` (a_i = (r_i - mean_g)/(std_g + eps)), ``"none"`` (Dr.GRPO) or
      ``"batch"`` (std over the batch). See ``group_advantages``.
    std_ddof: ddof of the std (0 = population std, FRPO; TRL and the λ-GRPO code use 1).
    std_eps: eps added to the std (verl/Tunix 1e-6, TRL 1e-4).
    process_weights: λ-GRPO — multiply each token term by ``1/|λ(i,t)|``.
    beta: β, the KL coefficient (0 disables the reference model entirely).
    kl_estimator: the KL estimator D: for ``kl_placement="loss"`` one of k1, k2, k3, forward_k3;
      for ``"future"`` one of k1, k3, forward_k3.
    kl_placement: ``"loss"`` (GRPO: ``+β·D(i,t)`` per token in the loss) or ``"future"`` (FRPO:
      ``Â = sg(a_i - β·future_kl)`` in the advantage, no KL loss term).
    clip_eps_low, clip_eps_high: ε_low, ε_high of the ratio clip.
    dual_clip: c of the dual clip for negative advantages (None: off).
    num_iterations: μ, policy updates per rollout batch (PPO-style; ratios differ from 1 when > 1).
    aggregation: loss aggregation mode (see ``policy_loss``).
    max_tokens: constant of ``seq-mean-token-sum-norm`` (None: the padded completion length).
    dynamic_sampling: DAPO — drop groups whose rewards are all equal and refill (trainer).
  """

  name: str = "custom"
  advantage_scale: str = "group"
  std_ddof: int = 0
  std_eps: float = 1e-6
  process_weights: bool = False
  beta: float = 0.0
  kl_estimator: str = "k3"
  kl_placement: str = "loss"
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  dual_clip: float | None = None
  num_iterations: int = 1
  aggregation: str = "token-mean"
  max_tokens: int | None = None
  dynamic_sampling: bool = False

  def __post_init__(self):
    c = _checks  # `name` is a free label, checked by whoever builds it (e.g. jaxgrpo.specs)
    c.check_choice(self.advantage_scale, ADVANTAGE_SCALES, "advantage_scale")
    c.check_python_int(self.std_ddof, "std_ddof", minimum=0, hint="ddof of the std")
    c.check_python_float(self.std_eps, "std_eps", at_least=0.0, hint="eps added to the std")
    c.check_python_bool(self.process_weights, "process_weights")
    c.check_python_float(self.beta, "beta", at_least=0.0, hint="the KL coefficient β")
    c.check_choice(self.kl_placement, KL_PLACEMENTS, "kl_placement")
    kinds = KL_KINDS if self.kl_placement == "loss" else FUTURE_KL_KINDS
    c.check_choice(self.kl_estimator, kinds, "kl_estimator")
    c.check_python_float(self.clip_eps_low, "clip_eps_low", at_least=0.0, hint="ε_low of the clip")
    c.check_python_float(self.clip_eps_high, "clip_eps_high", at_least=0.0, hint="ε_high of the clip")
    if self.dual_clip is not None:
      c.check_python_float(self.dual_clip, "dual_clip", above=1.0, hint="c of the dual clip, typically 3, or None")
    c.check_python_int(self.num_iterations, "num_iterations", minimum=1, hint="μ, updates per rollout batch")
    c.check_choice(self.aggregation, AGGREGATIONS, "aggregation")
    if self.max_tokens is not None:
      c.check_python_int(self.max_tokens, "max_tokens", minimum=1, hint="or None for the padded length")
    c.check_python_bool(self.dynamic_sampling, "dynamic_sampling")

  @property
  def needs_reference(self) -> bool:
    """Whether reference-model log-probs are needed (β > 0)."""
    return self.beta > 0

  def replace(self, **changes) -> "GRPOConfig":
    """A copy with some fields changed (validated again)."""
    return dataclasses.replace(self, **changes)


PRESETS: dict[str, dict] = {
  "grpo": dict(),
  "dr_grpo": dict(advantage_scale="none", aggregation="seq-mean-token-sum-norm"),
  "dapo": dict(clip_eps_high=0.28, dynamic_sampling=True),
  "lambda_grpo": dict(process_weights=True),
  "frpo": dict(beta=0.01, kl_placement="future", kl_estimator="k1"),
  "lambda_frpo": dict(beta=0.01, kl_placement="future", kl_estimator="k1", process_weights=True),
}


def preset(name: str, **overrides) -> GRPOConfig:
  """The named preset (see the module table), with optional field overrides.

  >>> preset("lambda_grpo", beta=0.04).process_weights
  True
  """
  _checks.check_choice(name, tuple(PRESETS), "preset name")
  return GRPOConfig(name=name, **{**PRESETS[name], **overrides})
