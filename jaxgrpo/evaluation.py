"""Evaluation metrics for sampled answers: the unbiased pass@k estimator and mean@k.

With n samples per problem of which c are correct (Chen et al., 2021, "Evaluating Large Language
Models Trained on Code", eq. 1):

    pass@k = E_problems[ 1 - C(n - c, k) / C(n, k) ]      (k <= n)

the probability that at least one of k samples drawn without replacement from the n is correct,
computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (stable for large n). mean@k is the mean accuracy
of k samples per problem, ``E_problems[c / n]`` with n = k samples (the λ-GRPO / FRPO papers'
"mean@k"; pass@1 equals it).
"""

from __future__ import annotations

import numpy as np

__all__ = ["pass_at_k", "mean_at_k", "summarize_eval"]


def _check(num_samples, num_correct):
  n = np.asarray(num_samples)
  c = np.asarray(num_correct)
  if not (np.issubdtype(n.dtype, np.integer) and np.issubdtype(c.dtype, np.integer)):
    raise TypeError(f"`num_samples` and `num_correct` must be integers; got {n.dtype}, {c.dtype}")
  if np.any(n < 1) or np.any(c < 0) or np.any(c > n):
    raise ValueError(
      "need 1 <= num_samples and 0 <= num_correct <= num_samples; got "
      f"num_samples={n.tolist()}, num_correct={c.tolist()}"
    )
  return np.broadcast_arrays(n, c)


def pass_at_k(num_samples, num_correct, k: int) -> np.ndarray:
  """Unbiased pass@k per problem: ``1 - C(n-c, k) / C(n, k)``; float64 with the broadcast shape.

  Args:
    num_samples: int, n samples per problem (scalar or ``[P]``); k <= n required.
    num_correct: int, c correct samples per problem (``[P]``).
    k: int >= 1.
  """
  n, c = _check(num_samples, num_correct)
  if not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"`k` must be an int >= 1; got {k!r}")
  if np.any(k > n):
    raise ValueError(f"`k`={k} exceeds num_samples={n.tolist()}")
  out = np.empty(n.shape, np.float64)
  for idx in np.ndindex(n.shape):
    ni, ci = int(n[idx]), int(c[idx])
    if ni - ci < k:
      out[idx] = 1.0
    else:
      out[idx] = 1.0 - float(np.prod(1.0 - k / np.arange(ni - ci + 1, ni + 1, dtype=np.float64)))
  return out


def mean_at_k(num_samples, num_correct) -> np.ndarray:
  """Per-problem accuracy ``c / n`` (float64); its mean over problems is mean@k with n = k."""
  n, c = _check(num_samples, num_correct)
  return c.astype(np.float64) / n


def summarize_eval(correct: np.ndarray, ks=(1,)) -> dict[str, float]:
  """``correct`` bool ``[P, n]`` (n samples per problem) → ``{"eval_accuracy": mean@n,
  "eval_pass@k": ... for k in ks (k <= n)}``, averaged over the P problems."""
  correct = np.asarray(correct, bool)
  if correct.ndim != 2 or correct.shape[1] < 1:
    raise ValueError(f"`correct` must be bool [P, n] with n >= 1; got shape {correct.shape}")
  n = correct.shape[1]
  c = correct.sum(1)
  out = {"eval_accuracy": float(mean_at_k(n, c).mean())}
  for k in ks:
    if k <= n:
      out[f"eval_pass@{k}"] = float(pass_at_k(n, c, int(k)).mean())
  return out
