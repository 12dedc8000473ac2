"""The distillation teacher of a run (``objective.distill.teacher``): which model it names, loaded, its tokenizer
checked against the policy's in one line.

``objective.distill.teacher`` is one of:

- ``synthetic:<hidden_size>x<num_layers>``: the arithmetic task's model of that shape (``model.synthetic``'s
  architecture and tokenizer), initialised from ``run.seed + 1`` — untrained, for tests and plans;
- a Hugging Face model directory (it holds ``config.json``): its weights and tokenizer;
- a run directory or checkpoint of this library (``jaxgrpo.run.builders.load_policy``): the trained policy of
  another run (a LoRA run's adapters merged into its base), e.g. a larger model trained on the same task;
- ``http://host:port``: a teacher server (``scripts/teacher_server.py`` serving one of the above elsewhere;
  ``jaxgrpo.run.teacher_remote``), nothing loaded here;
- ``vllm:<one of the local forms>``: that model served by vLLM's ``prompt_logprobs``
  (``jaxgrpo.rollout.engines.vllm_teacher``; the ``vllm`` extra, temperature 1).

The model is then placed on the train mesh beside the policy (``jaxgrpo.step.feed.make_teacher``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Callable

import jax
from flax import nnx

from jaxgrpo.models import lora
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.run import builders
from jaxgrpo.run.specs import ModelSpec, TrainerConfig
from jaxgrpo.run.task_specs import SyntheticModel
from jaxgrpo.services import checkpoint
from jaxgrpo.step import feed
from jaxgrpo.step.teacher_remote import is_remote_teacher

__all__ = [
  "build_teacher", "check_teacher_devices", "check_tokenizers", "load_teacher", "teacher_source", "tokenizer_fingerprint",
]  # fmt: skip

_SYNTHETIC = re.compile(r"^synthetic:(\d+)x(\d+)$")


def teacher_source(teacher: str) -> str:
  """``"synthetic"``, ``"hf"``, ``"run"``, ``"remote"`` (``http(s)://``) or ``"vllm"`` (``vllm:<local form>``):
  what ``objective.distill.teacher`` names (ValueError in one line for a ``synthetic:`` of another form or a path
  that does not exist)."""
  if is_remote_teacher(teacher):
    return "remote"
  if teacher.startswith("vllm:"):
    if teacher_source(teacher[5:]) not in ("synthetic", "hf", "run"):
      raise ValueError(f"`objective.distill.teacher`={teacher!r}: `vllm:` takes a local teacher, not a URL")
    return "vllm"
  if teacher.startswith("synthetic:"):
    if not _SYNTHETIC.match(teacher):
      raise ValueError(
        f"`objective.distill.teacher`={teacher!r}: a synthetic teacher is `synthetic:<hidden_size>x<num_layers>`, "
        "e.g. `synthetic:128x4`"
      )
    return "synthetic"
  if not os.path.exists(teacher):
    raise ValueError(
      f"`objective.distill.teacher`={teacher!r} does not exist: give an HF model directory, a run directory or "
      "checkpoint of this library, or `synthetic:<hidden_size>x<num_layers>`"
    )
  try:  # a run directory (it holds config.json too: the run's), a checkpoint root or a step
    checkpoint.read_meta(teacher)
    return "run"
  except checkpoint.CheckpointError:
    if os.path.isfile(os.path.join(teacher, "config.json")):
      return "hf"
    raise ValueError(
      f"`objective.distill.teacher`={teacher!r} is neither a run directory or checkpoint of this library (no "
      "complete checkpoint) nor an HF model directory (no config.json)"
    ) from None


def check_tokenizers(policy_tokenizer, teacher_tokenizer, teacher: str) -> None:
  """ValueError in one line unless the teacher's tokenizer maps every token string to the policy's id (the
  teacher scores the policy's token ids): the same vocabulary, compared entry by entry."""
  mine, theirs = _vocab(policy_tokenizer), _vocab(teacher_tokenizer)
  if mine == theirs:
    return
  differ = sorted(set(mine.items()) ^ set(theirs.items()))
  example = f"; e.g. {differ[0][0]!r}" if differ else ""
  raise ValueError(
    f"`objective.distill.teacher`={teacher!r}: its tokenizer differs from the policy's ({len(theirs)} vs "
    f"{len(mine)} entries, {len(differ)} differing{example}): the teacher must share the policy's tokenizer"
  )


def tokenizer_fingerprint(tokenizer) -> str:
  """``"sha256:<hex>"`` of the tokenizer's vocabulary (every (token string, id) pair, sorted): equal exactly when
  :func:`check_tokenizers` accepts the pair. A teacher server reports its own (``jaxgrpo.run.teacher_remote``)."""
  items = sorted((str(k), int(v)) for k, v in _vocab(tokenizer).items())
  return "sha256:" + hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def _vocab(tokenizer) -> dict:
  get = getattr(tokenizer, "get_vocab", None)
  return dict(get()) if get is not None else {i: i for i in range(len(tokenizer))}


def build_teacher(cfg: TrainerConfig, policy_tokenizer, *, log: Callable[[str], None] | None = None) -> nnx.Module:
  """The teacher model of ``cfg.objective.distill.teacher`` (module docstring), on the default device (the
  caller places it: ``jaxgrpo.step.feed.make_teacher``), its tokenizer checked against ``policy_tokenizer``
  (:func:`check_tokenizers`) before it is returned. The synthetic and HF forms take the policy's dtypes."""
  d = cfg.objective.distill
  if d is None or d.teacher is None:
    raise ValueError(
      "`objective.distill.teacher` is not set: a run loads its teacher from it (an HF directory, a run "
      "directory, or `synthetic:<hidden_size>x<num_layers>`)"
    )
  kind = teacher_source(d.teacher)
  if kind in ("remote", "vllm"):
    raise ValueError(
      f"`objective.distill.teacher`={d.teacher!r} is served outside the train mesh: "
      "jaxgrpo.run.teacher_remote.connect builds its teacher"
    )
  model, tokenizer = load_teacher(
    d.teacher, seed=cfg.run.seed + 1, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype
  )
  check_tokenizers(policy_tokenizer, tokenizer, d.teacher)
  if log is not None:
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    log(f"teacher: {d.teacher} ({kind}, {n:,} parameters), distill kind={d.kind} weight={d.weight}")
  return model


def load_teacher(teacher: str, *, seed: int, dtype: str = "float32", param_dtype: str = "float32"):
  """``(model, tokenizer)`` of a local teacher (``synthetic:...``, an HF directory, a run directory or checkpoint:
  the module docstring), on the default device. ``seed`` initialises a synthetic teacher (a run's in-process
  teacher uses ``run.seed + 1``); the synthetic and HF forms take ``dtype``/``param_dtype``, a run's its own."""
  kind = teacher_source(teacher)
  if kind in ("remote", "vllm"):
    raise ValueError(f"`teacher`={teacher!r} is served (a URL or vllm:...); a local teacher is loaded from a model")
  dtypes = dict(dtype=dtype, param_dtype=param_dtype)
  if kind == "synthetic":
    hidden, layers = (int(x) for x in _SYNTHETIC.match(teacher).groups())
    spec = ModelSpec(synthetic=SyntheticModel(hidden_size=hidden, num_layers=layers), **dtypes)
    return builders.build_policy(spec, seed=seed)
  if kind == "hf":
    return builders.build_policy(ModelSpec(path=teacher, **dtypes), seed=0)
  model, tokenizer, saved = builders.load_policy(teacher)
  if saved.lora is not None:
    model = lora.merge_lora(model)
  return model, tokenizer


def check_teacher_devices(cfg: TrainerConfig, train_mesh, teacher_mesh, *, log: Callable[[str], None] | None = None):
  """With ``devices.teacher`` (``teacher_mesh`` not None): ValueError in one line, before the teacher is loaded,
  unless its mesh is disjoint from the train mesh, the rollout batch's rows split over its ``data × fsdp`` and the
  step's micro-batches (its pass runs the step's micro-batches), and with ``step.packing`` the two meshes split
  the rows alike (``jaxgrpo.step.feed.check_teacher_mesh``); then logs where the teacher is."""
  if teacher_mesh is None:
    return
  tc = cfg.train_config()
  feed.check_teacher_mesh(teacher_mesh, train_mesh, tc)
  rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
  splits = tc.mini_batches * tc.micro_batches if tc.packing else tc.micro_batches
  try:
    shd.check_batch_divisible(rows, teacher_mesh, splits=splits, what="the rollout batch")
  except ValueError as e:
    raise ValueError(f"`devices.teacher_mesh`={cfg.devices.teacher_mesh or 'fsdp=-1'!r}: {e}") from None
  if log is not None:
    ids = [d.id for d in teacher_mesh.devices.flat]
    log(
      f"teacher: on its own {len(ids)} devices {ids} (mesh {dict(teacher_mesh.shape)}), the policy on {train_mesh.size}"
    )
