"""A guard against a policy that collapses while its numbers stay finite.

A learning rate far too large (1e6, 1e30) need not produce a NaN: the policy can collapse to the
uniform distribution over the vocabulary (entropy → ln V, reward → 0) with finite parameters, and a
run would go on saving such checkpoints until keep-last-K has deleted every good one. The NaN checks
(``jaxgrpo.services.checkpoint.first_nonfinite``) cannot see this; this guard reads the step's metrics.

Two rules, each from the records the trainer already logs (``entropy``: the mean per-token entropy of
the sampling distribution, in nats; ``reward_mean``):

* **entropy near uniform**: ``entropy ≥ entropy_frac · ln V`` (V = the vocabulary size; ln V is the
  entropy of the uniform distribution, the maximum), at a step after one where it was at most
  ``ln V / 2`` (the policy had learned something: a trained language model's per-token entropy is a
  few nats against ln V ≈ 12 for V = 150k). A run whose policy starts near uniform (an untrained
  random model) is not flagged: only a rise to it.
* **zero reward**: ``reward_mean == 0`` for ``zero_reward_steps`` consecutive steps, after a step
  with a non-zero reward (0: rule off).

``action`` ``"stop"`` raises :class:`PolicyCollapsed` naming the step and the rule before anything of
that step is evaluated or saved; ``"warn"`` logs one line per episode and goes on; ``"off"`` disables the
guard. The metrics of step N describe the policy that step N - 1 left (step N samples from it), so when
step N trips the guard, a checkpoint of step N - 1 holds the collapsed policy: ``scripts/train.py`` moves
it aside (``Checkpointer.set_aside``) and names the last checkpoint before it, whose policy step N - 1's
metrics passed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

__all__ = [
  "CollapseGuard",
  "CollapseWatch",
  "PolicyCollapsed",
  "ACTIONS",
  "DEFAULT_GUARD",
  "NoLearningSignal",
  "no_learning_signal",
  "SignalWatch",
]

ACTIONS = ("stop", "warn", "off")


class PolicyCollapsed(RuntimeError):
  """The policy collapsed (finite values). Attributes: ``step``, ``reason`` (the rule and values) and
  ``condemned`` (``step - 1``): the step whose updated policy the metrics of ``step`` measure (its rollouts
  were sampled from it), so a checkpoint of ``condemned`` holds the collapsed policy too
  (``scripts/train.py`` moves it aside, ``Checkpointer.set_aside``)."""

  def __init__(self, message: str, *, step: int, reason: str):
    super().__init__(message)
    self.step, self.reason = step, reason
    self.condemned = step - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollapseGuard:
  """The guard's settings (see the module docstring).

  Attributes:
    action: ``"stop"`` (raise :class:`PolicyCollapsed`), ``"warn"`` (log and go on) or ``"off"``.
    entropy_frac: the fraction x of ln V at or above which the entropy counts as collapsed to uniform,
      in (0, 1]; None: rule off.
    zero_reward_steps: N consecutive steps of zero mean reward (after a non-zero one) that count as a
      collapse; 0: rule off.
  """

  action: str = "stop"
  entropy_frac: float | None = 0.95
  zero_reward_steps: int = 0

  def __post_init__(self):
    if self.action not in ACTIONS:
      raise ValueError(f"collapse guard `action` must be one of {ACTIONS}; got {self.action!r}")
    if self.entropy_frac is not None and not (0.0 < self.entropy_frac <= 1.0):
      raise ValueError(f"collapse guard `entropy_frac` must be in (0, 1] or None; got {self.entropy_frac!r}")
    if not isinstance(self.zero_reward_steps, int) or self.zero_reward_steps < 0:
      raise ValueError(f"collapse guard `zero_reward_steps` must be an int >= 0; got {self.zero_reward_steps!r}")


class CollapseWatch:
  """The guard's state over one run: call :meth:`update` with every step's metrics, in order.

  Args:
    guard: the settings.
    vocab_size: V, the size of the policy's output distribution.
  """

  def __init__(self, guard: CollapseGuard, vocab_size: int):
    if vocab_size < 2:
      raise ValueError(f"`vocab_size` must be >= 2; got {vocab_size}")
    self.guard = guard
    self.max_entropy = math.log(vocab_size)
    self._learned = False  # seen an entropy of at most ln V / 2
    self._rewarded = False  # seen a non-zero mean reward
    self._zero_run = 0
    self._reported = False  # warn once per collapsed episode

  def update(self, metrics: Mapping[str, Any]) -> str | None:
    """The reason the policy counts as collapsed after this step (None: it does not)."""
    if self.guard.action == "off":
      return None
    reasons = []
    ent, frac = metrics.get("entropy"), self.guard.entropy_frac
    if frac is not None and isinstance(ent, float) and math.isfinite(ent):
      if ent <= 0.5 * self.max_entropy:
        self._learned = True
      elif ent >= frac * self.max_entropy and self._learned:
        reasons.append(
          f"entropy {ent:.4f} nats is {ent / self.max_entropy:.1%} of ln V = {self.max_entropy:.4f} (the uniform "
          f"distribution; limit {frac:.0%}): the policy collapsed to uniform"
        )
    reward, n = metrics.get("reward_mean"), self.guard.zero_reward_steps
    if n and isinstance(reward, float) and math.isfinite(reward):  # NaN: no finite reward, not a non-zero one
      if reward != 0.0:
        self._rewarded, self._zero_run = True, 0
      elif self._rewarded:
        self._zero_run += 1
        if self._zero_run >= n:
          reasons.append(f"mean reward 0 for {self._zero_run} consecutive steps (limit {n}) after non-zero rewards")
    if not reasons:
      self._reported = False
      return None
    return "; ".join(reasons)

  def check(self, metrics: Mapping[str, Any], log) -> None:
    """:meth:`update`, then act: raise :class:`PolicyCollapsed` (``stop``) or log once per episode (``warn``)."""
    reason = self.update(metrics)
    if reason is None:
      return
    step = int(metrics["step"])
    if self.guard.action == "stop":
      raise PolicyCollapsed(
        f"training stopped at step {step}: the policy collapsed ({reason}); its parameters are finite. "
        f"Nothing of step {step} was saved; its metrics measure the policy step {step - 1} left (its rollouts "
        f"were sampled from it), so a checkpoint of step {step - 1} is not good either. Usual cause: a "
        "learning rate far too large. Resume from a checkpoint before it with other settings (a changed "
        "learning rate needs --allow-changed-config); --on-collapse warn would go on",
        step=step,
        reason=reason,
      )
    if not self._reported:
      self._reported = True
      log(f"warning: step {step}: the policy collapsed ({reason}); training goes on (--on-collapse warn)")


#: the default: stop when the entropy reaches 95% of ln V (``Trainer(collapse_guard=...)``)
DEFAULT_GUARD = CollapseGuard()


class NoLearningSignal(RuntimeError):
  """Training stopped because nothing was learned for ``run.max_zero_advantage_steps`` consecutive steps
  (:class:`SignalWatch`). Attributes: ``step``, ``reason`` (the cause, with the numbers)."""

  def __init__(self, message: str, *, step: int, reason: str):
    super().__init__(message)
    self.step, self.reason = step, reason


def no_learning_signal(metrics: Mapping[str, Any]) -> str | None:
  """Why a step's update learned nothing from its rewards, from its metrics (None: it could learn):

  * ``"no finite reward"``: every reward was NaN/±inf (``reward_mean`` NaN: missing samples, no row in the loss);
  * ``"every advantage 0"``: ``advantage_min == advantage_max == 0`` (every group's rewards equal: a reward that
    never varies, e.g. always 0)."""
  reward = metrics.get("reward_mean")
  if isinstance(reward, float) and math.isnan(reward):
    return "no finite reward"
  lo, hi = metrics.get("advantage_min"), metrics.get("advantage_max")
  if isinstance(lo, float) and isinstance(hi, float) and lo == 0.0 and hi == 0.0:
    return "every advantage 0"
  return None


class SignalWatch:
  """Stops a run that cannot learn: :meth:`check` raises :class:`NoLearningSignal` after ``steps`` consecutive
  steps of :func:`no_learning_signal` (0: never), naming the cause and the likely fix.

  Args:
    steps: ``run.max_zero_advantage_steps``.
  """

  def __init__(self, steps: int):
    self.steps = steps
    self._run: list[str] = []

  def check(self, metrics: Mapping[str, Any]) -> None:
    why = no_learning_signal(metrics)
    self._run = [] if why is None else [*self._run, why]
    if not self.steps or len(self._run) < self.steps:
      return
    step = int(metrics["step"])
    if all(w == "no finite reward" for w in self._run):
      cause = (
        "no reward was finite (every reward NaN/inf: missing samples, nothing in the loss); check the reward "
        "functions or the environment's rewards"
      )
    else:
      reward = metrics.get("reward_mean")
      cause = (
        f"every advantage was 0 (the rewards within every group were equal; last mean reward {reward}); check "
        "`reward.weights` and the reward functions (a reward that never varies), or the task's difficulty"
      )
    reason = f"{cause}"
    raise NoLearningSignal(
      f"training stopped at step {step}: nothing was learned in the last {self.steps} steps: {reason}. "
      "Nothing of this step was saved; the limit is `run.max_zero_advantage_steps` (0: never stop)",
      step=step,
      reason=reason,
    )
