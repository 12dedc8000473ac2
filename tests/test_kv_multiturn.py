"""The KV cache kept across turns (issue 35.2): the per-row cache of the models (``init_cache(per_row=True)``)
against the uncached full forward for every family, and ``sample_multiturn``'s cached sampler
(``ConversationSampler``) against the re-prefill path (``kv_cache=False``) and against the teacher-forced
log-probs of the final trajectories (``jaxgrpo.models.log_probs``, the uncached forward)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ref_log_probs, tiny_chat_policy
from hf_utils import FAMILIES, MOE_FAMILIES, tiny_hf_config, tiny_moe_config
from test_packing_models import randomized

from jaxgrpo import models
from jaxgrpo.models.attention import init_kv_cache
from jaxgrpo.rollout.conversation import ConversationSampler
from jaxgrpo.rollout.environments import MultiTurnConfig, StepResult, sample_multiturn
from jaxgrpo.rollout.environments.tools import TOOL_CALL_END
from jaxgrpo.rollout.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("full_fp32_matmuls")  # tests/conftest.py


def _tiny(family, scan=False):
  hf = tiny_moe_config(family) if family in MOE_FAMILIES else tiny_hf_config(family)
  model = randomized(models.build_model(models.config_from_hf(hf), rngs=nnx.Rngs(0)))
  return models.to_scan_layers(model) if scan else model


@pytest.mark.parametrize(
  "family,scan", [(f, False) for f in FAMILIES + MOE_FAMILIES] + [("qwen3", True)], ids=lambda v: str(v)
)
def test_per_row_cache_appends_equal_full_forward(family, scan):
  """Rows append chunks of different lengths (some rows none) and single decode tokens (some rows masked) to
  one per-row cache; every fed token's hidden state equals the uncached forward of the whole sequence at
  that position, and ``index``/``valid`` count exactly each row's tokens."""
  model = _tiny(family, scan)
  rng = np.random.default_rng(0)
  # per row: the lengths of its appends, in call order (0: the row sits out that call)
  steps = [(4, 1, 6), (3, 5, 0), (1, 0, 1), (0, 1, 1), (2, 7, 3)]
  total = np.sum(steps, axis=0)
  seqs = [rng.integers(1, 128, size=t).tolist() for t in total]
  max_len = int(total.max()) + 3
  graphdef, state = nnx.split(model)
  call = jax.jit(lambda state, *a, **kw: nnx.merge(graphdef, state)(*a, **kw))  # one compile per width
  cache = model.init_cache(3, max_len, per_row=True)
  got = [[] for _ in range(3)]
  done = np.zeros(3, int)
  width = 8  # one pad column more than the longest append: padded tails must not count
  for lens in steps:
    tokens = np.zeros((3, width), np.int32)
    mask = np.zeros((3, width), bool)
    for r, n in enumerate(lens):
      tokens[r, :n], mask[r, :n] = seqs[r][done[r] : done[r] + n], True
    positions = done[:, None] + np.arange(width)[None]
    hidden, cache = call(state, tokens, jnp.asarray(positions, jnp.int32), attention_mask=mask, cache=cache)
    hidden = np.asarray(hidden, np.float32)  # a host copy: slicing it compiles nothing
    for r, n in enumerate(lens):
      got[r].append(hidden[r, :n])
    done += lens
  np.testing.assert_array_equal(cache.index, total)
  np.testing.assert_array_equal(cache.valid, np.arange(max_len)[None] < total[:, None])
  full = np.zeros((3, int(total.max())), np.int32)
  full_mask = np.zeros_like(full, bool)
  for r, s in enumerate(seqs):
    full[r, : len(s)], full_mask[r, : len(s)] = s, True
  ref, _ = call(state, full, models.positions_from_mask(jnp.asarray(full_mask)), attention_mask=full_mask)
  ref = np.asarray(ref, np.float32)
  for r in range(3):
    np.testing.assert_allclose(np.concatenate(got[r]), ref[r, : total[r]], atol=2e-5)


class Scripted:
  """``row["turns"]`` policy turns, each answered by ``obs k`` (a tool message of a few tokens)."""

  def __init__(self, tools=()):
    self.tools = tools

  def reset(self, row):
    self.row, self.k = row, 0
    return [{"role": "user", "content": f"go {row['turns']} {row.get('tag', '')}"}]

  def step(self, text):
    self.k += 1
    if self.k >= self.row["turns"]:
      return StepResult((), float(self.k), True)
    return StepResult([{"role": "tool", "content": f"obs {self.k} " * self.k}], 0.0, False)


TOOL = {
  "type": "function",
  "function": {"name": "calc", "description": "A calculator.", "parameters": {"type": "object", "properties": {}}},
}


@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.9), (0.0, 1.0)])
def test_cached_rollout_equals_reprefill_and_teacher_forcing(temperature, top_p):
  """Ragged turn counts, observations of growing length, a turn cut by the token budget, and two stop sets
  (the group with a tool also stops at ``</tool_call>``: two keys in one cached call): the cached rollout
  gives the re-prefill path's token ids, masks and rewards exactly and its log-probs within float32
  rounding, and its log-probs are the uncached forward's over the final ``prompt ‖ trajectory``."""
  tok, model, sampling, _ = tiny_chat_policy()
  sampling = SamplingConfig(
    num_samples=2, eos_ids=sampling.eos_ids, pad_id=sampling.pad_id, top_p=top_p, suppress_ids=None
  )
  assert tok.convert_tokens_to_ids(TOOL_CALL_END) not in (None, tok.unk_token_id)  # one token: a 2nd stop set
  rows = [{"turns": 1}, {"turns": 3, "tag": "tool"}, {"turns": 4}]
  make_env = lambda row: Scripted((TOOL,) if row.get("tag") else ())
  cfg = MultiTurnConfig(max_turns=4, max_tokens=72, turn_tokens=14)
  key = jax.random.key(3)
  outs = [
    sample_multiturn(model, rows, make_env, tok, sampling, cfg, key=key, temperature=temperature, kv_cache=kv)
    for kv in (False, True)
  ]
  old, new = outs
  for name in ("prompt_tokens", "prompt_mask", "completions", "mask", "policy_mask", "rewards", "turns"):
    np.testing.assert_array_equal(getattr(new, name), getattr(old, name), err_msg=name)
  assert (new.turns > 1).sum() >= 2 and new.mask.sum(1).max() > 40  # several turns were taken
  np.testing.assert_allclose(new.log_probs, old.log_probs, atol=2e-5)
  assert (new.log_probs[~new.policy_mask] == 0).all()
  tokens = np.concatenate([new.prompt_tokens, new.completions], 1)
  attn = np.concatenate([new.prompt_mask, new.mask], 1)
  lp = ref_log_probs(model, tokens, attn, temperature=temperature or 1.0)
  lp = np.asarray(lp)[:, new.prompt_tokens.shape[1] :]
  np.testing.assert_allclose(np.where(new.policy_mask, lp, 0), new.log_probs, atol=2e-5)


def test_conversation_sampler_moe_and_errors():
  """A MoE policy through the cached sampler, turns over subsets of the rows (a subset of 3 of 6 rows decodes
  as 4 rows, one a padding row, and is written back into the full cache): every turn's log-probs equal the
  uncached forward's over the conversation so far, rows that sat out a turn included; bad inputs are refused
  with the argument named."""
  model = _tiny("qwen3_moe")
  prompts = [[3, 4, 5]] * 2 + [[7]] * 2 + [[8, 9]] * 2
  sampling = SamplingConfig(num_samples=2, pad_id=0)
  conv = ConversationSampler(model, prompts, sampling, max_len=24)
  key = jax.random.key(0)
  convs = {i: list(p) for i, p in enumerate(prompts)}
  sampled = {i: [] for i in convs}  # (start, log-probs) of each turn

  def turn(rows, appended=None, budgets=None):
    for i, ids in (appended or {}).items():
      convs[i] += ids
    out = conv.turn([(key, rows)], max_new_tokens=4, appended=appended, budgets=budgets)
    assert sorted(out) == sorted(rows)
    for i, (ids, lps) in out.items():
      sampled[i].append((len(convs[i]), lps))
      convs[i] += ids.tolist()
    return out

  first = turn([0, 1, 2, 3, 4, 5], budgets={1: 2})
  turn([3, 0, 5], appended={0: [9, 10, 11], 3: [12]})  # 3 of 6 rows: 4 decode rows, one padding
  turn([1, 4, 2], appended={1: [13, 14]})  # rows that sat out the last turn (the same 4-row program)
  turn([0, 3, 5, 2], appended={5: [15]})  # rows whose cache came back from a subset's decode
  assert len(first[1][0]) == 2 and all(conv.length(i) == len(c) for i, c in convs.items())
  width = max(len(c) for c in convs.values())
  tokens, mask = np.zeros((len(convs), width), np.int32), np.zeros((len(convs), width), bool)
  for i, ids in convs.items():  # right-padded: real token k of each row at position k
    tokens[i, : len(ids)], mask[i, : len(ids)] = ids, True
  lp = np.asarray(ref_log_probs(model, tokens, mask))
  for i in convs:
    for start, lps in sampled[i]:
      np.testing.assert_allclose(lps, lp[i, start : start + len(lps)], atol=2e-5, err_msg=f"row {i}")
  assert sum(len(v) for v in sampled.values()) == 16
  with pytest.raises(ValueError, match="exceed the cache"):
    conv.turn([(key, [0])], max_new_tokens=8, appended={0: list(range(1, 12))})
  with pytest.raises(ValueError, match=r"budgets\[2\]"):
    conv.turn([(key, [2])], max_new_tokens=4, budgets={2: 5})
  with pytest.raises(ValueError, match=r"rows \[1\] that take no turn"):
    conv.turn([(key, [2])], max_new_tokens=4, appended={1: [5]})
  with pytest.raises(ValueError, match=r"appended\[2\]"):
    conv.turn([(key, [2])], max_new_tokens=4, appended={2: [10**6]})
  with pytest.raises(ValueError, match="appear once"):
    conv.turn([(key, [2]), (key, [2])], max_new_tokens=4)
  with pytest.raises(ValueError, match=r"prompts\[1\]"):
    ConversationSampler(model, [[1, 2], [1, 3]], sampling, max_len=8)
  with pytest.raises(ValueError, match="max_len"):
    ConversationSampler(model, [[1, 2], [1, 2]], sampling, max_len=1)


_MESH_CHILD = """
import jax, numpy as np
from flax import nnx
from helpers import tiny_chat_policy
from test_multiturn_rollout import Scripted
from jaxgrpo.parallel.sharding import make_mesh, shard_tree
from jaxgrpo.rollout.environments import MultiTurnConfig, sample_multiturn

tok, model, sampling, _ = tiny_chat_policy()
rows = [{"turns": 1}, {"turns": 3}]
cfg = MultiTurnConfig(max_turns=4, max_tokens=80, turn_tokens=12)
run = lambda m, kv: sample_multiturn(m, rows, lambda r: Scripted(), tok, sampling, cfg, key=jax.random.key(0), kv_cache=kv)
ref = run(model, False)
for spec in ("fsdp=2", "tensor=2"):
  mesh = make_mesh(spec)
  graphdef, state = nnx.split(model)
  with jax.set_mesh(mesh):
    out = run(nnx.merge(graphdef, shard_tree(state, mesh)[0]), True)
  same = bool((out.completions == ref.completions).all() and (out.policy_mask == ref.policy_mask).all())
  print(spec, same, float(np.abs(out.log_probs - ref.log_probs).max()), int(out.mask.sum()))
"""


@pytest.mark.slow
def test_cached_rollout_on_a_sharded_policy():
  """The per-row cache's scatter writes under a 2-device mesh (FSDP- and tensor-sharded weights, the
  activations constrained by the model's rules): the same trajectories as the unsharded re-prefill path."""
  from helpers import run_child

  lines = run_child(_MESH_CHILD, devices=2).strip().splitlines()[-2:]
  assert [line.split()[0] for line in lines] == ["fsdp=2", "tensor=2"], lines
  for line in lines:
    spec, same, diff, tokens = line.split()
    assert same == "True" and float(diff) < 2e-5 and int(tokens) > 40, line


@pytest.mark.parametrize("scan", [False, True], ids=["per-layer", "stacked"])
def test_take_and_put_cache_rows_against_numpy(scan):
  """``take_cache_rows`` is NumPy row indexing with empty rows for out-of-range indices; ``put_cache_rows``
  NumPy row assignment that skips them — on the batch axis of every array (axis 1 of a stacked k/v)."""
  cache = init_kv_cache(2, 4, 6, 2, 3, jnp.float32, stacked=scan, per_row=True)  # L=2, B=4, T=6, N=2, K=3
  leaves, treedef = jax.tree.flatten(cache)
  rng = np.random.default_rng(1)
  rand = lambda x: (rng.random(x.shape) < 0.5) if x.dtype == bool else rng.integers(0, 9, x.shape).astype(x.dtype)
  cache = jax.tree.unflatten(treedef, [jnp.asarray(rand(x)) for x in leaves])
  rows = np.array([2, 0, 4, 3], np.int32)  # 4: out of range, a padding row
  sub = models.take_cache_rows(cache, jnp.asarray(rows))
  new = jax.tree.map(lambda x: jnp.asarray(rand(x)), sub)
  back = models.put_cache_rows(cache, jnp.asarray(rows), new)
  for x, s, n, b in zip(*(jax.tree.leaves(t) for t in (cache, sub, new, back))):
    x, s, n, b = map(np.asarray, (x, s, n, b))
    axis = 1 if scan and x.ndim == 5 else 0
    xm, sm, nm, bm = (np.moveaxis(a, axis, 0) for a in (x, s, n, b))
    np.testing.assert_array_equal(sm[[0, 1, 3]], xm[[2, 0, 3]])
    assert not sm[2].any()  # the padding row is empty
    want = xm.copy()
    want[[2, 0, 3]] = nm[[0, 1, 3]]
    np.testing.assert_array_equal(bm, want)
