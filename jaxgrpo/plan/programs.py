"""The programs a run executes, built from abstract inputs (``jax.ShapeDtypeStruct`` s with their shardings: no
parameter is materialised, nothing runs), ready to ``lower()`` for any mesh — compile-only TPU devices included.

:class:`RunPrograms` reads the run config (``jaxgrpo.run.specs.TrainerConfig``) as the ``Trainer`` does: the
model (``model.dtype``/``param_dtype``/``remat``/``scan_layers``, the ``lora`` section's adapters), AdamW
(``assemble.optimizer``), the step's ``TrainConfig`` (micro/mini-batches, packing, chunking), the objective (β > 0:
the reference pass), the rollout (``prompts_per_step`` × ``group_size``, ``max_new_tokens``; an engine other than
``jax``: the π_old recomputation) and the mesh (``devices.mesh`` over the target's devices). The completion length
compiled is the top bucket of ``max_new_tokens`` (``train.bucket_length``) and the prompt length
``data.max_prompt_tokens`` rounded up to 16: the largest shapes of the run.
"""

from __future__ import annotations

import dataclasses
import json
import os

import huggingface_hub
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxgrpo import _checks
from jaxgrpo.models import build_model, lora, moe
from jaxgrpo.models.config import config_from_hf
from jaxgrpo.parallel import sharding as shd
from jaxgrpo.plan import shapes
from jaxgrpo.rewards import reward_model as rm_lib
from jaxgrpo.rollout import sampling
from jaxgrpo.rollout.engines import registry as engine_registry
from jaxgrpo.run import assemble, builders
from jaxgrpo.run.spec_schema import DTYPES, ModelSpec
from jaxgrpo.run.specs import config_from_dict
from jaxgrpo.run.task_specs import SyntheticModel
from jaxgrpo.run.trainer import dropout_key
from jaxgrpo.services import checkpoint
from jaxgrpo.step import train
from jaxgrpo.step.teacher_remote import is_served_teacher

__all__ = [
  "RunPrograms", "RunShape", "abstract_model", "abstract_reward_model", "per_device_bytes", "run_shape", "teacher_config",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RunShape:
  """The largest shapes a run compiles: ``prompts`` × ``group`` rows, prompts of ``prompt_len`` tokens, completions of
  ``completion_len`` (the top bucket of ``new_tokens``)."""

  prompts: int
  group: int
  prompt_len: int
  new_tokens: int
  completion_len: int

  @property
  def rows(self) -> int:
    return self.prompts * self.group


def run_shape(cfg) -> RunShape:
  roll = cfg.rollout
  prompt = -(-cfg.data.max_prompt_tokens // 16) * 16
  return RunShape(
    roll.prompts_per_step, roll.group_size, prompt, roll.max_new_tokens, train.bucket_length(roll.max_new_tokens)
  )


def per_device_bytes(tree) -> int:
  """Bytes one device holds of ``tree`` (``ShapeDtypeStruct`` s with shardings; the largest shard)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
  return total


def _sds(shape, dtype, sharding):
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def abstract_model(cfg, model_config, *, adapters: bool = True):
  """The run's policy as ``ShapeDtypeStruct`` s: ``build_model`` of ``model_config`` with the run's dtypes, remat,
  layout and attention, and the ``lora`` section's adapters (``builders.add_adapters``; not with
  ``adapters=False``: a distillation teacher, built with the policy's settings as the run builds it)."""
  spec = cfg.model

  def build():
    model = build_model(
      model_config,
      rngs=nnx.Rngs(0),
      dtype=DTYPES[spec.dtype],
      param_dtype=DTYPES[spec.param_dtype],
      remat=spec.remat,
      scan_layers=spec.scan_layers,
      attention=spec.attention,
    )
    if cfg.lora is not None and adapters:
      builders.add_adapters(model, cfg.lora, seed=cfg.run.seed)
    return model

  return nnx.eval_shape(build)


def teacher_config(teacher: str):
  """The model config of ``objective.distill.teacher`` for planning: ``synthetic:<hidden>x<layers>`` (the synthetic
  model the run builds), a named shape (``qwen3-32b``: ``jaxgrpo.plan.shapes``), or an HF directory /
  ``config.json``. A run directory of this library is planned from its saved model's HF directory (one line)."""
  hidden_layers = teacher.removeprefix("synthetic:").split("x") if teacher.startswith("synthetic:") else None
  if hidden_layers is not None:
    if len(hidden_layers) != 2 or not all(x.isdigit() for x in hidden_layers):
      raise ValueError(f"`objective.distill.teacher`={teacher!r}: a synthetic teacher is `synthetic:<hidden>x<layers>`")
    synthetic = SyntheticModel(hidden_size=int(hidden_layers[0]), num_layers=int(hidden_layers[1]))
    return builders.model_config(ModelSpec(synthetic=synthetic))
  if not _is_hf_dir(teacher):
    try:  # a run directory, checkpoint root or step of this library: the config saved with its checkpoint
      meta = checkpoint.read_meta(teacher)
    except checkpoint.CheckpointError:
      meta = None  # not a run's: a named shape or a config.json, below
    if meta is not None and meta.get("config"):
      return builders.model_config(config_from_dict(meta["config"], where=f"config saved in {teacher}").model)
  try:
    return shapes.model_config(teacher)
  except ValueError as e:
    raise ValueError(f"`objective.distill.teacher`: {e}") from None


def _is_hf_dir(path: str) -> bool:
  file = os.path.join(path, "config.json")
  if not os.path.isfile(file):
    return False
  with open(file) as f:
    return "model_type" in json.load(f)


#: rows are right-padded to a multiple of this many tokens (``RewardModelReward``'s default, which the run uses)
RM_PAD_MULTIPLE = 64


def _reward_model_config(spec) -> str:
  """The path of the ``config.json`` of a reward model's ``path``: in its folder, or only that file fetched from
  the hub for a hub id (the run downloads the whole model there anyway). ValueError in one line otherwise."""
  where, path = f"reward.sources[{spec.name!r}].path", os.fspath(spec.path)
  local = os.path.join(path, "config.json")
  if os.path.isfile(local):
    return local
  if not os.path.exists(path) and not _checks.names_local_path(path):
    try:
      return huggingface_hub.hf_hub_download(path, "config.json")
    except Exception as e:  # noqa: BLE001 - one line with the reason
      reason = " ".join(str(e).split())[:200]
      raise ValueError(f"`{where}` {path!r}: its config.json could not be fetched from the hub: {reason}") from None
  raise ValueError(
    f"`{where}` {path!r}: the plan reads the reward model's shape from its config.json, which is not there; give a "
    "*ForSequenceClassification folder or hub id (only config.json is read)"
  )


def abstract_reward_model(spec, mesh):
  """The reward model of a ``reward.sources`` entry (``kind: reward_model``) as ``ShapeDtypeStruct`` s: a
  ``rewards.reward_model.RewardModel`` of its folder's ``config.json`` (``num_labels``, ``pad_token_id``; the
  weights are not read), in ``spec.dtype``, ``DEFAULT_RULES``, as ``assemble.reward_source`` loads it on the
  policy's mesh. ValueError in one line when there is no ``config.json`` (:func:`_reward_model_config`)."""
  with open(_reward_model_config(spec)) as f:
    raw = json.load(f)
  num_labels = int(raw.get("num_labels") or len(raw.get("id2label") or {}) or 1)
  pad = raw.get("pad_token_id")
  pad = pad[0] if isinstance(pad, list) and pad else pad
  dtype = DTYPES[spec.dtype]
  model = nnx.eval_shape(
    lambda: rm_lib.RewardModel(
      config_from_hf(raw),
      num_labels,
      pad_token_id=pad,
      rngs=nnx.Rngs(0),
      dtype=dtype,
      param_dtype=dtype,
      rules=shd.DEFAULT_RULES,
    )  # fmt: skip
  )
  model.mesh = mesh  # static, as load_reward_model sets it
  return model


def _host_batch(shape: RunShape, vocab: int, routing: tuple[int, int, int] | None, distill=None) -> train.Batch:
  """A NumPy batch of the run's largest shapes (one full-length completion per group: the top bucket); with a
  distillation config (``GRPOConfig.distill``) the teacher's fields the step reads (``teacher_logp``, and the
  top-k forms' ``[B, T, k]`` ids and log-probs); with ``routing`` = ``(M, k, E)`` the recorded experts
  ``[B, P + T, M, k]`` in the sampler's compact dtype (``moe.replay_dtype(E)``: their bytes as a run has them)."""
  rng = np.random.default_rng(0)
  b, g, p, t = shape.rows, shape.group, shape.prompt_len, shape.completion_len
  lens = rng.integers(max(1, t // 2), t + 1, b)
  lens[::g] = t
  mask = np.arange(t)[None] < lens[:, None]
  comp = np.where(mask, rng.integers(1, vocab, (b, t)), 0).astype(np.int32)
  old = np.where(mask, -3.0, 0.0).astype(np.float32)
  prompts = np.repeat(rng.integers(1, vocab, (b // g, p)), g, axis=0).astype(np.int32)
  batch = train.Batch(prompts, np.ones((b, p), bool), comp, mask, old, np.repeat(np.arange(b // g), g).astype(np.int32),
                      rng.integers(0, 2, b).astype(np.float32), old)  # fmt: skip
  if routing is not None:
    m, k, e = routing
    batch = batch._replace(routing=np.zeros((b, p + t, m, k), moe.replay_dtype(e)))
  if distill is not None:
    batch = batch._replace(teacher_logp=old)
    if not distill.sampled:
      k = distill.top_k
      ids = np.broadcast_to(np.arange(k, dtype=np.int32), (b, t, k))
      batch = batch._replace(teacher_topk_ids=ids, teacher_topk_logp=np.full((b, t, k), -np.log(k), np.float32))
  return batch


class RunPrograms:
  """The programs of one run on ``mesh``, abstract; :meth:`lower` gives each one's ``jax.stages.Lowered``.

  Attributes:
    names: the programs this run executes, in order of importance: ``step`` (the train step), ``sampler``
      (``rollout.sampling.generate``: prefill + decode loop), ``reference`` (β > 0), ``old_logp`` (the π_old
      recomputation of an engine whose log-probs are not the policy's), ``reward_model:<name>`` (each
      ``reward.sources`` entry of ``kind: reward_model``: its scoring forward, one call of ``batch_size`` rows).
    shape: the :class:`RunShape`; state, shardings, graphdef, step: as the ``Trainer`` builds them.
    resident: ``{name: per-device bytes}`` of the arrays that live through the whole run (train state; the
      reference's copy of the parameters).
  """

  def __init__(self, cfg, model_config, mesh, *, rollout_mesh=None, teacher_mesh=None):
    self.cfg, self.model_config, self.mesh = cfg, model_config, mesh
    self.rollout_mesh, self.teacher_mesh = rollout_mesh, teacher_mesh  # None: the program runs on ``mesh``
    self.shape = run_shape(cfg)
    model = abstract_model(cfg, model_config)
    self.optimizer = assemble.optimizer(cfg)
    trainable = nnx.Param if cfg.lora is None else nnx.LoRAParam
    self.graphdef, self.state, self.shardings = train.init_train_state(
      model, self.optimizer, mesh, trainable=trainable, abstract=True
    )
    self.train_config = cfg.train_config()
    self.step = train.make_train_step(
      self.graphdef,
      self.optimizer,
      cfg.objective,
      mesh=mesh,
      shardings=self.shardings,
      train_config=self.train_config,
      dropout_key=None if cfg.lora is None else dropout_key(cfg.run.seed),  # as the Trainer: LoRA dropout
    )
    self.sample_graphdef = nnx.graphdef(model)
    replay = cfg.rollout.routing_replay == "rollout" and moe.is_moe(model)
    n_moe = sum(model_config.is_moe_layer(i) for i in range(model_config.num_layers)) if replay else 0
    self._routing = (n_moe, model_config.num_experts_per_tok, model_config.num_experts) if replay else None
    self.names = ("step", "sampler")
    self.names += ("reference",) if self.step.reads_ref_logp else ()
    # the learner recomputes old_logp for an engine whose log-probs are not the policy's (its class says so)
    self._recomputes = not engine_registry.capability(cfg.rollout.engine, "logprobs_are_policy")
    self.names += ("old_logp",) if self._recomputes else ()
    self.reward_models = {}  # program name -> (spec, graphdef, abstract state with shardings, decoder config)
    for spec in cfg.reward.sources:
      if spec.kind == "reward_model":
        rm = abstract_reward_model(spec, mesh)
        rm_graphdef, rm_state = nnx.split(rm)
        rm_state = shd.abstract_tree(rm_state, shd.tree_shardings(rm_state, mesh, shd.DEFAULT_RULES))
        self.reward_models[f"reward_model:{spec.name}"] = (spec, rm_graphdef, rm_state, rm.config)
    self.names += tuple(self.reward_models)
    distill = cfg.objective.distill
    self._teacher = None  # (graphdef, abstract params with shardings, top_k) of the distillation teacher
    self.teacher_config = None  # its model config (the teacher pass's FLOPs)
    # a remote teacher (http://...) or vLLM's (vllm:...) holds nothing on the JAX devices planned here
    if distill is not None and distill.teacher is not None and not is_served_teacher(distill.teacher):
      self.teacher_config = teacher_config(distill.teacher)
      teacher = abstract_model(cfg, self.teacher_config, adapters=False)
      t_graphdef, t_params = nnx.split(teacher)
      t_mesh = self.mesh_of("teacher")
      t_params = shd.abstract_tree(t_params, shd.tree_shardings(t_params, t_mesh, teacher.rules))
      self._teacher = (t_graphdef, t_params, None if distill.sampled else distill.top_k)
      self.names += ("teacher",)
    lora_ref = cfg.lora is not None
    self.resident = {"train state": per_device_bytes(self.state)}
    if self.step.reads_ref_logp and not lora_ref:
      self.resident["reference copy"] = per_device_bytes(self.state.params)
    for name, (_, _, rm_state, _) in self.reward_models.items():
      self.resident[name] = per_device_bytes(rm_state)  # loaded once, beside the policy, for the whole run
    if self._teacher is not None and teacher_mesh is None:  # on devices of its own it is resident only there
      self.resident["teacher"] = per_device_bytes(self._teacher[1])  # the teacher's copy, the whole run
    if lora_ref:
      self._ref_graphdef = nnx.graphdef(lora.base_model(model))
      self._ref_params, self._ref_sh = self.state.frozen, self.shardings.frozen
    else:
      self._ref_graphdef, self._ref_params, self._ref_sh = self.graphdef, self.state.params, self.shardings.params

  def mesh_of(self, name: str):
    """The mesh program ``name`` runs on: the sampler on ``devices.rollout``'s mesh and the teacher on
    ``devices.teacher``'s when the run gives them devices of their own, every other program on the train mesh."""
    own = {"sampler": self.rollout_mesh, "teacher": self.teacher_mesh}.get(name)
    return self.mesh if own is None else own

  def other_resident(self, name: str) -> int:
    """Per-device bytes of the run's long-lived arrays that program ``name`` does not take as arguments (a program on
    devices of its own shares them with nothing: its weights are its arguments)."""
    if self.mesh_of(name) is not self.mesh:
      return 0
    opt = per_device_bytes(self.state.opt_state)
    ref = self.resident.get("reference copy", 0)
    # the reference pass of a LoRA run reads the frozen base weights, which the train state holds: not counted twice
    state = self.resident["train state"] - (per_device_bytes(self.state.frozen) if self.cfg.lora is not None else 0)
    # every reward model and the teacher, but this program's own
    rms = sum(self.resident[n] for n in (*self.reward_models, "teacher") if n in self.resident and n != name)
    if name in self.reward_models or name == "teacher":
      return self.resident["train state"] + ref + rms
    return rms + {"step": ref, "sampler": opt + ref, "reference": state, "old_logp": opt + ref}[name]

  def lower(self, name: str) -> jax.stages.Lowered:
    if name in self.reward_models:
      return self._reward_model(name)
    programs = dict(step=self._step, sampler=self._sampler, reference=self._reference, old_logp=self._old_logp)
    return {**programs, "teacher": self._teacher_pass}[name]()

  def reward_model_shape(self, name: str) -> tuple[int, int]:
    """``(rows, tokens)`` of one call of reward model ``name``: its ``batch_size`` rows of the longest prompt +
    completion, right-padded to a multiple of 64 tokens and capped at its positions (``RewardModelReward``)."""
    spec, _, _, config = self.reward_models[name]
    cap, s = config.max_position_embeddings, self.shape
    return spec.batch_size, min(cap, -(-(s.prompt_len + s.new_tokens) // RM_PAD_MULTIPLE) * RM_PAD_MULTIPLE)

  def _reward_model(self, name: str):
    """``RewardModel.score``'s program (``reward_model.score_program``) on one call's ``[batch_size, S]``, under
    the mesh as ``score`` runs it."""
    _, graphdef, state, _ = self.reward_models[name]
    b, t = self.reward_model_shape(name)
    bsh = shd.batch_sharding(self.mesh, shd.DEFAULT_RULES)
    tokens, mask = _sds((b, t), jnp.int32, bsh), _sds((b, t), jnp.bool_, bsh)
    with jax.set_mesh(self.mesh):
      return rm_lib.score_program.lower(graphdef, state, tokens, mask)

  def _batch(self) -> train.Batch:
    return _host_batch(self.shape, self.model_config.vocab_size, self._routing, self.cfg.objective.distill)

  def _step(self):
    host = self._batch()
    return self.step.lower(self.state, host if self._recomputes else host._replace(behavior_logp=None))

  def _log_probs(self, graphdef, params, shardings):
    fn = train.make_reference_fn(graphdef, mesh=self.mesh, param_shardings=shardings, train_config=self.train_config)
    return fn.lower(params, self._batch())

  def _teacher_pass(self):
    """The distillation teacher's log-prob pass (``step.feed.make_teacher``: the reference pass of the teacher's
    model, with its top-k for the top-k forms) on the step's batch."""
    graphdef, params, top_k = self._teacher
    shardings = jax.tree.map(lambda x: x.sharding, params)
    fn = train.make_reference_fn(
      graphdef, mesh=self.mesh_of("teacher"), param_shardings=shardings, train_config=self.train_config, top_k=top_k
    )
    return fn.lower(params, self._batch())

  def _reference(self):
    return self._log_probs(self._ref_graphdef, self._ref_params, self._ref_sh)

  def _old_logp(self):
    params, sh = self.state.params, self.shardings.params
    if jax.tree.leaves(self.shardings.frozen):
      params, sh = nnx.merge_state(params, self.state.frozen), nnx.merge_state(sh, self.shardings.frozen)
    return self._log_probs(self.graphdef, params, sh)

  def _sampler(self):
    s, mc, mesh, rules = self.shape, self.model_config, self.mesh_of("sampler"), self.step.rules
    replicated = NamedSharding(mesh, PartitionSpec())
    # as ``collect.place_prompts`` places them: over the batch axes when they divide the prompts, else replicated
    divides = s.prompts % shd.batch_shards(mesh, rules) == 0
    psh = shd.batch_sharding(mesh, rules) if divides else replicated
    prompts = _sds((s.prompts, s.prompt_len), jnp.int32, psh)
    mask = _sds((s.prompts, s.prompt_len), jnp.bool_, psh)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = _sds(key.shape, key.dtype, replicated)
    state = nnx.State.merge(self.state.params, self.state.frozen)
    if mesh is not self.mesh:  # devices.rollout: the weights pushed to the rollout mesh, sharded by the same rules
      state = shd.abstract_tree(state, shd.tree_shardings(state, mesh, rules))
    eos = mc.eos_token_id if isinstance(mc.eos_token_id, (tuple, list)) else (mc.eos_token_id or 1,)
    pad = 0 if 0 not in eos else max(eos) + 1
    config = sampling.SamplingConfig(
      num_samples=s.group,
      max_new_tokens=s.new_tokens,
      top_p=float(self.cfg.rollout.top_p),
      top_k=int(self.cfg.rollout.top_k),
      eos_ids=tuple(int(e) for e in eos),
      pad_id=pad,
      suppress_ids=(pad,),
      record_routing=self._routing is not None,
    )
    policy = sampling.SamplingPolicy.from_config(
      config, temperature=float(self.train_config.temperature), vocab_size=mc.vocab_size
    )
    model = nnx.merge(self.sample_graphdef, state)
    # as ``sampling.generate`` traces it: the platform of the state's devices, no context mesh (no activation
    # constraints), the prompts placed as the run places them
    return sampling.lower_generate(model, prompts, mask, policy, key=key)
