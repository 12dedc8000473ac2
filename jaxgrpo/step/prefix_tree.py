"""Prefix trees of sequences (host-side NumPy): the packed layout of prefix-shared training
(``TrainConfig.prefix_sharing``), where the tokens that several sequences share are laid out, and computed, once.

The sequences of a GRPO group share their prompt, and often the first tokens of their completions. A *tree* holds
each shared prefix once: its tokens are laid out in pre-order (depth first), so that the subtree of column j is the
interval ``[j, end[j])``, and a token attends exactly to its ancestors and itself::

    query i sees key j  ⟺  j ≤ i < end[j]                      (end[j] = j + size of j's subtree)

an interval per key (``jaxgrpo.models.TreeSegments``; the blockwise kernel's ``kv_end``), no ``[S, S]`` mask. A
token's position (RoPE, learned positions) is its depth, its position in its sequence.

The log-prob of a sequence's token at depth d comes from the hidden state of its parent (depth d - 1). The packed
rows keep the rule of plain packing — the target at column c is predicted from column c - 1 — by laying out a
*copy* of the branch point before every branch that does not follow its parent directly (the second and later
children of a node): one extra token per such branch, whose hidden state equals the original's (same token, same
position, same ancestors). A sequence's target at depth d is the column where its token at depth d was laid out
first, so sequences that share a completion token share its log-prob entry, and its hidden state receives the sum
of their gradients: the gradient of the row-wise step.

Construction (:func:`build_trees`): the sequences are sorted lexicographically; each shares with the previous one
``ℓ`` tokens (their longest common prefix — the longest with any earlier sequence — or, with ``prompt`` sharing,
at most both prompts), and lays out only its tokens from depth ℓ (after a copy of depth ℓ - 1 when the last laid
out column is not that token). A new tree starts when ℓ ≤ 1 or when the tree would outgrow the row length.

Every tree goes whole into one packed row (``jaxgrpo.step.packing.pack_slots``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["SHARING", "Tree", "ancestors", "build_trees", "subtree_ends"]

SHARING = ("none", "prompt", "tree")  # TrainConfig.prefix_sharing: nothing, the prompts, every common prefix


class Tree(NamedTuple):
  """One tree (a packed segment) of n columns in pre-order.

  Attributes:
    tokens: ``int32[n]`` token ids.
    depth: ``int32[n]`` each column's depth (its position in its sequences).
    parent: ``int32[n]`` the column whose hidden state each column attends to as its parent, -1 for a root.
    end: ``int32[n]`` exclusive end of each column's subtree (:func:`subtree_ends`).
    members: ``int[m]`` the sequences of the tree (indices into :func:`build_trees`' lists).
    targets: list of m ``int32[c_k]`` arrays: the column of member k's completion token t (its log-prob's target;
      the column before it holds its parent or a copy of it).
    owner: ``int[n]`` the sequence (index into :func:`build_trees`' lists) that laid each column out: the column
      holds that sequence's token at ``depth`` (per-token data of the sequences, e.g. a mixture of experts'
      recorded routing, is taken from it).
  """

  tokens: np.ndarray
  depth: np.ndarray
  parent: np.ndarray
  end: np.ndarray
  members: np.ndarray
  targets: list
  owner: np.ndarray


def subtree_ends(parent) -> np.ndarray:
  """``end[j]`` = 1 + the last column of j's subtree, for columns in pre-order (every ``parent[j] < j``)."""
  parent = np.asarray(parent)
  end = np.arange(1, parent.size + 1, dtype=np.int32)
  for j in range(parent.size - 1, -1, -1):
    if parent[j] >= 0:
      end[parent[j]] = max(end[parent[j]], end[j])
  return end


def ancestors(parent) -> np.ndarray:
  """``bool[n, n]``: ``[i, j]`` True iff column j is column i or one of its ancestors (walks the parent links)."""
  parent = np.asarray(parent)
  out = np.zeros((parent.size, parent.size), bool)
  for i in range(parent.size):
    j = i
    while j >= 0:
      out[i, j] = True
      j = parent[j]
  return out


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
  n = min(a.size, b.size)
  diff = np.flatnonzero(a[:n] != b[:n])
  return int(diff[0]) if diff.size else n


class _Builder:
  """The tree being laid out: its columns and the previous member's chain (column per depth)."""

  def __init__(self):
    self.tokens, self.depth, self.parent, self.owner = [], [], [], []
    self.members, self.targets = [], []
    self.chain = self.first = None  # previous member: attention chain and first-laid-out column, per depth

  def size(self) -> int:
    return len(self.tokens)

  def new_columns(self, length: int, shared: int) -> int:
    """Columns a member of ``length`` tokens sharing ``shared`` with the previous one adds."""
    if shared >= length:
      return 0
    return length - shared + int(self.size() - 1 != self.chain[shared - 1])

  def add(self, index: int, seq: np.ndarray, prompt: int, shared: int) -> None:
    chain = np.empty(seq.size, np.int64)
    first = np.empty(seq.size, np.int64)
    if shared:
      chain[:shared], first[:shared] = self.chain[:shared], self.first[:shared]
    if 0 < shared < seq.size and self.size() - 1 != self.chain[shared - 1]:  # a copy of the branch point
      parent = self.chain[shared - 2] if shared > 1 else -1
      chain[shared - 1] = self._column(index, seq[shared - 1], shared - 1, parent)
    for d in range(shared, seq.size):
      chain[d] = first[d] = self._column(index, seq[d], d, chain[d - 1] if d else -1)
    self.chain, self.first = chain, first
    self.members.append(index)
    self.targets.append(first[prompt:].astype(np.int32))

  def _column(self, owner: int, token, depth: int, parent: int) -> int:
    self.owner.append(owner)
    self.tokens.append(int(token))
    self.depth.append(depth)
    self.parent.append(int(parent))
    return len(self.tokens) - 1

  def done(self) -> Tree:
    parent = np.asarray(self.parent, np.int32)
    return Tree(
      tokens=np.asarray(self.tokens, np.int32),
      depth=np.asarray(self.depth, np.int32),
      parent=parent,
      end=subtree_ends(parent),
      members=np.asarray(self.members, np.int64),
      targets=self.targets,
      owner=np.asarray(self.owner, np.int64),
    )


def build_trees(sequences, prompt_lengths, sharing: str, capacity: int) -> list[Tree]:
  """Lay out ``sequences`` (prompt, then completion tokens) as prefix trees of at most ``capacity`` columns.

  Args:
    sequences: list of ``int[n_k]`` arrays, each ``n_k <= capacity`` with a prompt of ``prompt_lengths[k] >= 1``
      tokens and at least one completion token.
    prompt_lengths: ``int[m]``.
    sharing: ``"prompt"`` (share at most the prompts) or ``"tree"`` (every common prefix, completions too;
      identical sequences are laid out once).
    capacity: the packed row length L.

  Returns:
    The trees, each a :class:`Tree`; every sequence is a member of exactly one.
  """
  if sharing not in SHARING[1:]:
    raise ValueError(f"sharing must be one of {SHARING[1:]}; got {sharing!r}")
  seqs = [np.asarray(s, np.int64) for s in sequences]
  prompt_lengths = np.asarray(prompt_lengths, np.int64)
  order = sorted(range(len(seqs)), key=lambda k: seqs[k].tolist())
  trees, tree, prev = [], None, None
  for k in order:
    seq, p = seqs[k], int(prompt_lengths[k])
    shared = 0 if tree is None else _common_prefix(seqs[prev], seq)
    if sharing == "prompt":
      shared = min(shared, p, int(prompt_lengths[prev])) if tree is not None else 0
    if tree is None or shared <= 1 or tree.size() + tree.new_columns(seq.size, shared) > capacity:
      if tree is not None:
        trees.append(tree.done())
      tree, shared = _Builder(), 0
    tree.add(k, seq, p, shared)
    prev = k
  if tree is not None:
    trees.append(tree.done())
  return trees
