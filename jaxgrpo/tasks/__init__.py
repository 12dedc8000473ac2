"""Synthetic tasks that exercise the library end to end.

- ``binary_tree``: the λ-GRPO paper's depth-4 binary-tree task (Sullivan & Koller, §4), with the whole
  training run in one ``jit`` and seeds × cells ``vmap``-ped (re-exported here).
- ``arithmetic``: the trainer's offline demo — "What is a + b?", a locally built tokenizer, a tiny
  Qwen3 model and its supervised warm-up (import ``jaxgrpo.tasks.arithmetic``: it loads transformers).
"""

from jaxgrpo.tasks.binary_tree import (
  ALGORITHMS,
  PAPER_CELLS,
  PAPER_TABLE1,
  POLICIES,
  TabularPolicy,
  TransformerPolicy,
  TreeTask,
  leaf_actions,
  leaf_rewards,
  make_optimizer,
  make_policy,
  make_sweep,
  run_sweep,
  summarize_cell,
)

__all__ = [
  "ALGORITHMS",
  "PAPER_CELLS",
  "PAPER_TABLE1",
  "POLICIES",
  "TabularPolicy",
  "TransformerPolicy",
  "TreeTask",
  "leaf_actions",
  "leaf_rewards",
  "make_optimizer",
  "make_policy",
  "make_sweep",
  "run_sweep",
  "summarize_cell",
]
