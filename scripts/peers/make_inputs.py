"""Write the identical inputs of the numeric comparison (NumPy only: runs in any of the venvs).

    python scripts/peers/make_inputs.py .peers/out/inputs.npz

B = 16 rows in 4 contiguous groups of G = 4 (the layout every peer requires), T = 12 completion
slots, right-padded ragged masks (lengths 1..12, one full row per group). The log-probs put a third
of the ratios outside the clip range on both sides, with advantages of both signs. Group 2 has four
equal rewards (zero std: advantage 0, never NaN). float64 draws rounded to float32, stored float32. The loss comparisons
use the fixed `advantages` (one per row), so that a loss difference is never an advantage one;
`token_advantages` (per token, FRPO-like) feed the token-level losses' per-token rows.
`behavior_logp` (old + N(0, 0.3)) is a mismatched behaviour policy for the off-policy corrections:
with the cap `is_cap` = 2 some token ratios and most sequence ratios are truncated/masked. `entropy`
(uniform in [0, 3]) stands for the per-token policy entropy of the entropy-bonus rows.
"""

from __future__ import annotations

import sys

import numpy as np

B, G, T = 16, 4, 12


def make(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, T + 1, B)
  lengths[::G] = T
  mask = np.arange(T)[None] < lengths[:, None]
  old_logp = -np.abs(rng.normal(1.5, 1.0, (B, T)))
  logp = old_logp + rng.normal(0.0, 0.3, (B, T))  # |log ratio| ~ 0.3: many clipped tokens
  ref_logp = old_logp + rng.normal(0.0, 0.2, (B, T))
  rewards = rng.integers(0, 2, B).astype(np.float64) + 0.25 * rng.normal(size=B)
  rewards[8:12] = 0.5  # group 2: all equal
  advantages = rng.normal(0.0, 1.0, B)  # fixed, for the loss comparisons
  # drawn after the original fields, so that those keep their values
  token_advantages = advantages[:, None] + 0.5 * rng.normal(0.0, 1.0, (B, T))
  behavior_logp = old_logp + rng.normal(0.0, 0.3, (B, T))
  entropy = rng.uniform(0.0, 3.0, (B, T))
  z = lambda x: np.where(mask, x, 0.0).astype(np.float32)
  return {
    "logp": z(logp),
    "old_logp": z(old_logp),
    "ref_logp": z(ref_logp),
    "mask": mask,
    "rewards": rewards.astype(np.float32),
    "advantages": advantages.astype(np.float32),
    "group_ids": np.repeat(np.arange(B // G), G).astype(np.int32),
    "group_size": np.int32(G),
    "epsilon_low": np.float32(0.2),
    "epsilon_high": np.float32(0.28),
    "beta": np.float32(0.04),
    "token_advantages": z(token_advantages),
    "behavior_logp": z(behavior_logp),
    "entropy": z(entropy),
    "is_cap": np.float32(2.0),
    "entropy_coef": np.float32(0.01),
  }


if __name__ == "__main__":
  out = sys.argv[1] if len(sys.argv) > 1 else ".peers/out/inputs.npz"
  import os

  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  np.savez(out, **make())
  print(f"wrote {out}")
