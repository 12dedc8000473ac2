"""``jaxgrpo.plan`` and ``scripts/plan.py``: a run's programs compiled ahead of time for a target.

The byte counts are compared with an independent count by formula (the model's shape, the FSDP rules of
``jaxgrpo.parallel.sharding``'s table: every weight's D over ``fsdp``, norm scales replicated), the topology names
with Cloud TPU's published slice shapes, the refusal with XLA's TPU compiler (through ``.venv-tpu``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import ROOT, cli_env, ensure_side_venv, train_main_here

from jaxgrpo import plan

DEMO = os.path.join(ROOT, "scripts", "configs", "demo.yaml")
POD = os.path.join(ROOT, "scripts", "configs", "pod_grpo.yaml")
DEMO_RM = os.path.join(ROOT, "scripts", "configs", "demo_rm.yaml")
# a toy Qwen3 whose weight matrices dominate (the replicated norm scales are 0.02% of the parameters)
TOY = dict(model_type="qwen3", vocab_size=32768, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64, intermediate_size=512, max_position_embeddings=512,
           tie_word_embeddings=False)  # fmt: skip


def _toy_counts(n: int) -> tuple[int, int]:
  """``(parameters sharded over fsdp, parameters replicated)`` of TOY, by formula."""
  d, v, L, h, kv, k, f = 256, 32768, 2, 4, 2, 64, 512
  matrices = 2 * v * d + L * (d * h * k + 2 * d * kv * k + h * k * d + 3 * d * f)
  vectors = L * (2 * d + 2 * k) + d  # two RMSNorms per layer, q/k norms over head_dim, the final norm
  return matrices, vectors


# a toy Qwen3 reward model (a classifier: tied embedding, no LM head, score head [D, 1])
TOY_RM = dict(architectures=["Qwen3ForSequenceClassification"], model_type="qwen3", vocab_size=512, hidden_size=64,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
              max_position_embeddings=512, tie_word_embeddings=True, num_labels=1, pad_token_id=0)  # fmt: skip
TEACHER_TOP_K = 4


def _plan_inputs(d) -> dict[str, list[str]]:
  """The input files of the CPU plans under ``d`` and each plan's ``scripts/plan.py`` arguments, by name."""
  (d / "config.json").write_text(json.dumps(TOY))
  small = ["--rollout.prompts_per_step", "8", "--rollout.group_size", "4", "--rollout.max_new_tokens", "32",
           "--data.max_prompt_tokens", "32"]  # fmt: skip
  rm = d / "rm"
  rm.mkdir()
  (rm / "config.json").write_text(json.dumps(TOY_RM))
  text = open(DEMO_RM).read()
  assert "path: ./runs/arith_rm," in text
  (d / "rm.yaml").write_text(text.replace("path: ./runs/arith_rm,", f"path: {rm},"))
  (d / "rm_missing.yaml").write_text(text.replace("path: ./runs/arith_rm,", f"path: {d / 'nothing'},"))
  import yaml

  demo = yaml.safe_load(open(DEMO))
  demo["objective"].update(beta=0.0, distill={"teacher": "synthetic:96x3", "weight": 1.0, "kind": "forward_kl",
                                             "top_k": TEACHER_TOP_K})  # fmt: skip
  (d / "distill.yaml").write_text(yaml.safe_dump(demo))
  model = ["--config", DEMO, "--model", str(d / "config.json"), "--topology", "cpu-8"]
  return {
    "cpu8": [*model, "--programs", "step", "--json", "--objective.beta", "0.0", *small],
    "own_devices": [*model, "--programs", "step,sampler,teacher", "--json", "--objective.beta", "0.0", *small,
                    "--devices.rollout", "2", "--devices.teacher", "2", "--rollout.max_staleness", "1",
                    "--objective.importance_correction", "tis", "--objective.distill.teacher", "synthetic:128x1"],
    "replicated_prompts": ["--config", DEMO, "--topology", "cpu-8", "--programs", "sampler", "--json",
                           "--rollout.prompts_per_step", "4", "--rollout.group_size", "2"],
    "reward_model": ["--config", str(d / "rm.yaml"), "--topology", "cpu-2", "--json", "--objective.beta", "0.0",
                     "--programs", "step,reward_model:rm"],
    "teacher": ["--config", str(d / "distill.yaml"), "--topology", "cpu-2", "--json", "--programs", "step,teacher"],
    "rm_missing": ["--config", str(d / "rm_missing.yaml"), "--topology", "cpu-2"],
  }  # fmt: skip


@pytest.fixture(scope="module")
def cpu_plans(tmp_path_factory):
  """The module's ``scripts/plan.py`` runs on host CPU devices (``cpu-8``, ``cpu-2``), each its ``main`` in ONE child
  with 8 devices (tests/plan_here.py: one start-up and one import for the six; a child each before): per name the
  run's ``returncode``, ``stdout`` and ``stderr`` as a process of its own gives them, and ``dir``, its input files."""
  d = tmp_path_factory.mktemp("plans")
  runs = _plan_inputs(d)
  (d / "runs.json").write_text(json.dumps(runs))
  env = cli_env()
  env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
  cmd = [sys.executable, os.path.join(ROOT, "tests", "plan_here.py"), str(d / "runs.json"), str(d / "out.json")]
  r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
  if r.returncode:
    pytest.fail(f"tests/plan_here.py exited with {r.returncode}:\n{r.stderr[-6000:]}")
  return {k: SimpleNamespace(**v) for k, v in json.loads((d / "out.json").read_text()).items()} | {"dir": d}


def test_the_planned_batch_holds_the_recorded_experts_in_the_samplers_dtype():
  """Routing replay's ``[B, P + T, M, k]`` record is planned in the compact dtype the sampler records
  (``moe.replay_dtype``: uint8 up to 256 experts, int16 above), so its argument bytes are a run's (int32: 4x)."""
  from jaxgrpo.plan.programs import RunShape, _host_batch

  shape = RunShape(prompts=2, group=4, prompt_len=16, new_tokens=8, completion_len=8)
  for experts, dtype in ((128, np.uint8), (512, np.int16)):
    routing = _host_batch(shape, 64, (3, 8, experts)).routing
    assert routing.shape == (8, 24, 3, 8) and routing.dtype == dtype, (experts, routing.dtype)
  assert _host_batch(shape, 64, None).routing is None


@pytest.mark.parametrize(
  "name, topology, devices",
  [
    ("v5p-64", "v5:2x4x4", 32),  # v5p names count TensorCores: 2 per chip
    ("v5p-128", "v5:4x4x4", 64),
    ("v5e-16", "v5e:4x4", 16),
    ("v5litepod-256", "v5e:16x16", 256),
    ("v6e-64", "v6e:8x8", 64),
    ("v4-8", "v4:2x2x1", 4),
    ("v5e:2x2", "v5e:2x2", 4),
  ],
)
def test_topology_names_map_to_cloud_tpu_slices(name, topology, devices):
  t = plan.parse_target(name)
  assert (t.topology, t.chips, t.platform, t.kind) == (topology, devices, "tpu", "topology")


def test_unknown_topology_is_refused_in_one_line():
  with pytest.raises(ValueError) as e:
    plan.parse_target("v5p-63")
  assert "\n" not in str(e.value) and "v5p-63" in str(e.value) and "TensorCores" in str(e.value)
  with pytest.raises(ValueError, match="unknown; expected a Cloud TPU name"):
    plan.parse_target("tpu-9000")


def test_collectives_are_counted_by_kind_in_hlo_text():
  hlo = """
  %ag = bf16[8,4]{1,0} all-gather-start(%p), dimensions={0}
  %agd = bf16[8,4]{1,0} all-gather-done(%ag)
  %ar = f32[] all-reduce(%x), to_apply=%sum
  %rs = f32[2] reduce-scatter(%y), dimensions={0}
  %cp = f32[2] collective-permute(%z), source_target_pairs={{0,1}}
  %all-gather.2 = bf16[8]{0} all-gather(%q), dimensions={0}
  """
  assert plan.count_collectives(hlo) == {
    "all-gather": 2,
    "all-reduce": 1,
    "reduce-scatter": 1,
    "collective-permute": 1,
  }


def test_step_flops_follow_the_palm_formula():
  cfg = plan.model_config("qwen3-8b")
  b, p, t = 512, 256, 1024
  n = 36 * (2 * 4096 * 32 * 128 + 2 * 4096 * 8 * 128 + 3 * 4096 * 12288)
  want = 6 * n * b * (p + t) + 6 * 4096 * 151936 * b * t + 6 * 36 * 32 * 128 * (p + t) ** 2 * b
  assert plan.step_flops(cfg, b, p, t) == pytest.approx(want, rel=1e-12)


def test_plan_on_cpu8_argument_and_alias_bytes_match_the_sharded_state(cpu_plans):
  """The step's per-device argument bytes = (parameters + AdamW's two moments, float32, sharded over 8) + the
  replicated norms, counters and step + the batch's rows / 8; the donated state aliases: alias bytes = the state."""
  r = cpu_plans["cpu8"]
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout)
  assert out["mesh"]["fsdp"] == 8 and "not a fit test" in " ".join(out["notes"])
  step = out["programs"][0]
  assert step["name"] == "step" and step["verdict"] == "no fit test"
  matrices, vectors = _toy_counts(8)
  counters = 4 + 4  # state.step and AdamW's count, int32, replicated
  state = 3 * 4 * (matrices // 8 + vectors) + counters
  rows, p, t = 32, 32, 32
  batch = rows // 8 * (p * 4 + p * 1 + t * 4 + t * 1 + t * 4 + 4 + 4)  # tokens, mask, completions, mask, old_logp,
  # group ids, rewards
  assert step["argument_bytes"] == pytest.approx(state + batch, rel=1e-3)
  assert step["alias_bytes"] == pytest.approx(state, rel=1e-3)
  assert step["collectives"].get("all-gather", 0) > 0  # FSDP gathers the weights


def test_a_sampler_and_a_teacher_on_devices_of_their_own_are_planned_there(cpu_plans):
  """``devices.rollout 2`` and ``devices.teacher 2`` on cpu-8, as the run splits them: the step's state over the
  4 devices left (its donated state aliases: the parameters and AdamW's two moments over 4, by formula), the sampler's
  float32 weights over its own 2 (+ its 8 prompts over them and the key), the teacher's over its own 2 (+ the batch's
  rows over them), and nothing else resident beside either (the moments and the teacher's weights live elsewhere).
  Before, the plan put every program on one mesh of all 8 devices whatever the placement."""
  r = cpu_plans["own_devices"]
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout)
  assert out["mesh"]["fsdp"] == 4 and {k: v["fsdp"] for k, v in out["own_meshes"].items()} == dict(sampler=2, teacher=2)
  assert "sampler on its own 2 devices" in r.stderr and "teacher on its own 2 devices" in r.stderr
  step, sampler, teacher = out["programs"]
  matrices, vectors = _toy_counts(8)
  assert step["alias_bytes"] == pytest.approx(3 * 4 * (matrices // 4 + vectors) + 8, rel=1e-3)
  prompts = 8 // 2 * 32 * (4 + 1)  # int32 tokens and a bool mask, 4 prompts per device
  assert sampler["argument_bytes"] == pytest.approx(4 * (matrices // 2 + vectors) + prompts + 8, rel=1e-4)
  # synthetic:128x1: a tied Qwen3 of V 128, D 128, 4 heads (2 KV) of 32, MLP 256 (jaxgrpo.plan.programs)
  d, v, h, kv, k, f = 128, 128, 4, 2, 32, 256
  t_matrices, t_vectors = v * d + (2 * d * h * k + 2 * d * kv * k + 3 * d * f), 2 * d + 2 * k + d
  rows = 32 // 2 * (32 * 5 + 32 * 5)  # the batch's prompts and completions (tokens, masks) over the teacher's 2
  assert teacher["argument_bytes"] == pytest.approx(4 * (t_matrices // 2 + t_vectors) + rows, rel=1e-3)
  assert [p["other_resident_bytes"] for p in out["programs"]] == [0, 0, 0]


def test_gpu_estimate_splits_the_gpus_as_the_run_places_them():
  """pod_distill on h100-8 with ``devices.rollout 2`` and ``devices.teacher 2``: the step's state over the 4 GPUs
  left, the sampler's and the teacher's bf16 weights over their own 2, the teacher's weights resident beside nothing
  of the policy's, the sampler beside nothing; ``devices`` that leave the step no GPU are refused in one line."""
  import dataclasses

  from jaxgrpo.run import specs

  cfg = specs.load_config(os.path.join(ROOT, "scripts", "configs", "pod_distill.yaml"), {})
  split = dataclasses.replace(cfg, devices=dataclasses.replace(cfg.devices, rollout=2, teacher=2))
  p = plan.plan_run(split, plan.parse_target("h100-8"), log=None)
  step, sampler, teacher = p.programs
  assert p.mesh == {"fsdp": 4} and p.own_meshes == {"sampler": {"fsdp": 2}, "teacher": {"fsdp": 2}}
  # Qwen3-8B teacher (bf16), Qwen3-1.7B student: vocab 151,936, D 2,048, 28 layers, 16 heads, 8 KV, 128, MLP 6,144
  v, d, layers, h, kv, hd, f = 151936, 4096, 36, 32, 8, 128, 12288
  assert teacher.argument_bytes == pytest.approx(
    2 * (2 * v * d + layers * (2 * d * h * hd + 2 * d * kv * hd + 3 * d * f)) / 2, rel=1e-6
  )
  d, layers, h, f = 2048, 28, 16, 6144
  student = v * d + layers * (2 * d * h * hd + 2 * d * kv * hd + 3 * d * f)  # tied
  assert sampler.argument_bytes == pytest.approx(2 * student / 2, rel=1e-6)
  assert step.argument_bytes == pytest.approx(3 * 2 * student / 4, rel=1e-6)
  assert sampler.other_resident_bytes == 0 and teacher.other_resident_bytes == 0
  assert step.other_resident_bytes == (2 * student / 4 if cfg.objective.beta > 0 else 0)  # the reference copy only
  crowded = dataclasses.replace(cfg, devices=dataclasses.replace(cfg.devices, rollout=4, teacher=4))
  with pytest.raises(ValueError, match=r"`devices.rollout`=4 \+ `devices.teacher`=4 do not fit the target's 8 GPUs"):
    plan.plan_run(crowded, plan.parse_target("h100-8"), log=None)


def test_gpu_target_is_an_estimate():
  from jaxgrpo.run import specs

  cfg = specs.load_config(POD, {})
  p = plan.plan_run(cfg, plan.parse_target("h100-8"), log=None)
  assert [x.name for x in p.programs] == ["step", "sampler"]
  assert all(x.verdict.startswith("estimated") for x in p.programs)
  assert any("estimated by formula" in n for n in p.notes)


def test_gpu_estimate_counts_the_kept_head_logits():
  """``step.head_logits: keep`` holds every chunk's float32 logits of a micro-batch until its backward pass: the
  step's estimated temporaries grow by ``R·(T − chunk)·V·4`` (R rows per GPU and micro-batch, T completion tokens)."""
  import dataclasses

  from jaxgrpo.plan.programs import run_shape
  from jaxgrpo.run import specs

  cfg = specs.load_config(POD, {})
  kept = dataclasses.replace(cfg, step=dataclasses.replace(cfg.step, head_logits="keep"))
  target = plan.parse_target("h100-8")
  base, more = (plan.plan_run(c, target, log=None).programs[0] for c in (cfg, kept))
  s, tc = run_shape(cfg), cfg.train_config()
  rows = s.rows / 8 / tc.mini_batches / tc.micro_batches
  v = more.temp_bytes - base.temp_bytes
  assert v == pytest.approx(rows * (s.completion_len - tc.chunk_size) * 151936 * 4, rel=1e-6), v


def test_gpu_estimate_with_a_teacher_counts_its_weights_and_its_pass():
  """scripts/configs/pod_distill.yaml (Qwen3-1.7B student, Qwen3-8B teacher, sampled form) on h100-8: a third
  program ``teacher`` whose argument is the 8B's bf16 weights over 8 GPUs (counted here from the published shape),
  whose output is the ``f32[R, T]`` log-probs per GPU, whose FLOPs are the 8B's forward over the batch (2 FLOPs per
  matmul weight per token, plus attention and head), and whose weights are resident beside the step and the sampler
  (their other-resident bytes grow by exactly that; before: no teacher row, and nothing counted)."""
  import dataclasses

  from jaxgrpo.run import specs

  cfg = specs.load_config(os.path.join(ROOT, "scripts", "configs", "pod_distill.yaml"), {})
  p = plan.plan_run(cfg, plan.parse_target("h100-8"), log=None)
  assert [x.name for x in p.programs] == ["step", "sampler", "teacher"]
  step, sampler, teacher = p.programs
  # Qwen3-8B: vocab 151,936, D 4,096, 36 layers, 32 heads, 8 KV heads, head_dim 128, MLP 12,288, untied head
  v, d, layers, h, kv, hd, f = 151936, 4096, 36, 32, 8, 128, 12288
  weights = 2 * (2 * v * d + layers * (2 * d * h * hd + 2 * d * kv * hd + 3 * d * f)) / 8  # bf16 over 8 GPUs
  assert teacher.argument_bytes == pytest.approx(weights, rel=1e-6)
  rows, t = 512 // 8, 1024
  assert teacher.output_bytes == rows * t * 4
  tokens = 512 * (256 + 1024)
  matmul = 2 * tokens * (layers * (2 * d * h * hd + 2 * d * kv * hd + 3 * d * f) + d * v)
  assert matmul < teacher.flops < 1.3 * matmul  # + attention's S² terms
  alone = plan.plan_run(dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, distill=None)),
                        plan.parse_target("h100-8"), log=None)  # fmt: skip
  for with_teacher, without in zip((step, sampler), alone.programs):
    assert with_teacher.other_resident_bytes - without.other_resident_bytes == teacher.argument_bytes


def test_a_teacher_that_does_not_fit_is_refused_in_one_line():
  """A ``teacher`` program the compiler found too large (verdict ``does not fit``, no fix found): the plan's refusal is
  one line naming the teacher's weights and the run's other long-lived bytes per device, and ``devices.teacher``."""
  gib = 2**30
  teacher = plan.ProgramPlan("teacher", 1, other_resident_bytes=int(12.5 * gib), verdict="does not fit")
  teacher.argument_bytes, teacher.output_bytes, teacher.alias_bytes = 80 * gib, gib // 512, 0
  teacher.temp_bytes, teacher.code_bytes, teacher.searched = 10 * gib, 0, True
  fits = plan.ProgramPlan("step", 1, verdict="fits")
  p = plan.RunPlan(plan.parse_target("v5p-64"), "qwen3-1.7b", {}, {"fsdp": 32}, [fits, teacher], [])
  line = p.refusal
  assert "\n" not in line and line.startswith("the teacher program does not fit v5p-64 (102.50 of 95.00 GiB/device)")
  assert "the teacher's weights take 80.00 GiB/device beside the run's 12.50 of long-lived arrays" in line
  assert "`devices.teacher`" in line and "more chips" in line
  # a teacher already on devices of its own (devices.teacher 4) shares them with nothing: more of them is the way
  own = plan.RunPlan(plan.parse_target("v5p-64"), "qwen3-1.7b", {}, {"fsdp": 28}, [fits, teacher], [],
                     {"teacher": {"data": 1, "fsdp": 4, "tensor": 1}})  # fmt: skip
  line = own.refusal
  assert "\n" not in line and "the teacher's weights take 80.00 GiB/device on its own 4 devices" in line
  assert "a larger `devices.teacher`" in line and "chips of its own" not in line


def _tpu_env() -> dict:
  env = cli_env()
  env.update(ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_SKIP_MDS_QUERY="1")  # several libtpu processes; no metadata server
  return env


@pytest.fixture(scope="module")
def tpu_plans(tmp_path_factory):
  """The module's compiles for TPU slices (XLA's TPU compiler, libtpu through ``.venv-tpu``) in ONE child
  (tests/plan_here.py: one start-up, one libtpu load; a child each before): ``v5e_16``, ``scripts/plan.py``'s run
  (``returncode``, ``stdout``, ``stderr``), and ``fix``, tests/tpu_aot_checks.py's fix-search report."""
  d = tmp_path_factory.mktemp("tpu_plans")
  runs = {"v5e_16": ["--config", POD, "--topology", "v5e-16", "--programs", "step", "--no-fix"]}
  (d / "runs.json").write_text(json.dumps(runs))
  python = ensure_side_venv("tpu")
  cmd = [python, os.path.join(ROOT, "tests", "plan_here.py"), str(d / "runs.json"), str(d / "out.json"), "fix"]
  r = subprocess.run(cmd, capture_output=True, text=True, env=_tpu_env() | {"JAX_PLATFORMS": "cpu"}, timeout=1500)
  if r.returncode:
    pytest.fail(f"tests/plan_here.py exited with {r.returncode}:\n{r.stderr[-6000:]}")
  out = json.loads((d / "out.json").read_text())
  return {"v5e_16": SimpleNamespace(**out["v5e_16"]), "fix": out["fix"]}


def test_8b_on_v5e_16_at_one_micro_batch_is_refused_by_the_tpu_compiler(tpu_plans):
  """Qwen3-8B shapes, the pod workload, one micro-batch, compiled for v5e:4x4 by XLA's TPU compiler (libtpu, through
  .venv-tpu): the step does not fit (its temporaries alone exceed the chip's 15.75 GiB); one line says so."""
  r = tpu_plans["v5e_16"]
  assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
  refused = [ln for ln in r.stderr.splitlines() if ln.startswith("refused: ")]
  assert len(refused) == 1, r.stderr[-3000:]
  assert refused[0].startswith("refused: the step program does not fit v5e-16 (XLA: HLO temporaries ")
  assert refused[0].endswith(
    "15.75G of HBM available); no fix searched (--no-fix; scripts/plan.py without it compiles more "
    "micro-batches until one fits)"
  )
  assert "exceeds available HBM (15.75G)" in r.stdout  # the compiler's own words, in the table's notes


def test_train_plan_only_prints_the_table_and_exits_before_anything_is_loaded(tmp_path, capsys):
  """``scripts/train.py --plan-only``: the plan of this machine's devices (the step and the sampler of the demo run,
  no reference pass at β = 0), exit 0, and no output directory written. Its ``main`` in this process (one device,
  the suite's flags, as the child it was: a child's start-up saved; a refusal exits through ``SystemExit``)."""
  out = tmp_path / "out"
  argv = ["--config", DEMO, "--plan-only", "--run.out", str(out), "--rollout.prompts_per_step", "2",
          "--rollout.group_size", "2", "--rollout.max_new_tokens", "8", "--objective.beta", "0.0"]  # fmt: skip
  try:
    train_main_here(argv)
  except SystemExit as e:
    pytest.fail(f"scripts/train.py --plan-only exited with {e.code}: {capsys.readouterr().err[-3000:]}")
  r = capsys.readouterr()
  table = [ln for ln in r.out.splitlines() if ln.startswith("| ")]
  assert [ln.split(" | ")[0][2:] for ln in table[1:]] == ["step", "sampler"]
  assert all(ln.rstrip(" |").endswith("no fit test") for ln in table[1:])
  assert "not a fit test" in r.out and not out.exists()


def test_a_sampler_whose_prompts_do_not_divide_the_mesh_compiles_as_the_run_places_them(cpu_plans):
  """4 prompts (× G 2 = 8 rows) on cpu-8: the 4 prompts do not divide the 8 devices of the batch axes, so the run
  passes them replicated (``collect.place_prompts``) and ``sampling.generate`` traces with no context mesh; the
  plan lowers the same program, which compiles (the pod workload on v5e-256: 64 prompts over 256 chips). Before,
  the plan lowered the prompts sharded over the batch axes under ``jax.set_mesh`` and refused a program the run
  never builds ("embeddings: dim 0 ('batch', size 4) is not divisible by mesh axis 'data'×'fsdp' of size 8")."""
  r = cpu_plans["replicated_prompts"]
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  (sampler,) = json.loads(r.stdout)["programs"]
  assert sampler["name"] == "sampler" and sampler["verdict"] == "no fit test" and sampler["error"] is None, sampler


def test_a_configured_reward_model_is_planned_with_its_sharded_weights(cpu_plans):
  """demo_rm.yaml's reward model (``reward.sources``: kind reward_model, batch_size 64), from a folder holding only
  its config.json (no weights: the plan is abstract), on cpu-2: the plan compiles its scoring forward
  (``RewardModel.score``'s program) on one call of 64 rows × (prompt 64 + 20 new tokens, padded to 128), and its
  argument bytes per device are the float32 weights (every matrix's D over fsdp = 2, norms replicated) + the
  tokens and mask of 32 rows, by formula; while the step runs the reward model's weights stay resident. Before,
  the plan had no reward-model program (and left its weights out of every total)."""
  r = cpu_plans["reward_model"]
  assert r.returncode == 0, r.stderr[-3000:]
  step, rmp = json.loads(r.stdout)["programs"]
  assert rmp["name"] == "reward_model:rm" and rmp["verdict"] == "no fit test", rmp
  d, v, layers, h, kv, k, f = 64, 512, 2, 4, 2, 16, 128
  matrices = v * d + layers * (d * h * k + 2 * d * kv * k + h * k * d + 3 * d * f) + d * 1  # + the score head
  vectors = layers * (2 * d + 2 * k) + d
  weights = 4 * (matrices // 2 + vectors)
  rows, tokens = 64 // 2, 128
  assert rmp["argument_bytes"] == pytest.approx(weights + rows * tokens * (4 + 1), rel=1e-3), rmp
  assert rmp["output_bytes"] == rows * 1 * 4  # f32[64, 1] scores, rows over fsdp
  assert step["other_resident_bytes"] == pytest.approx(weights, rel=1e-3), step  # β = 0: no reference copy
  assert rmp["flops"] > 0 and rmp["other_resident_bytes"] > 0


def test_a_distillation_teacher_is_planned_beside_the_policy(cpu_plans, tmp_path):
  """demo.yaml with ``objective.distill`` (a ``synthetic:96x3`` teacher, top-k 4, β 0), on cpu-2: the plan compiles
  the teacher's pass (its top-k on the step's batch) and the step with the teacher's fields in its batch (before:
  no teacher program, and the step's program failed for want of ``teacher_topk_ids``); the teacher's float32
  weights (matrices' D over fsdp = 2, vectors replicated; by formula) are resident while the step runs, and the
  pass returns only ``f32[B, T]`` + ``int32[B, T, k]`` + ``f32[B, T, k]`` per device."""
  from jaxgrpo.plan.programs import run_shape, teacher_config
  from jaxgrpo.run.specs import load_config

  k = TEACHER_TOP_K
  config = cpu_plans["dir"] / "distill.yaml"  # demo.yaml, β 0, distill from synthetic:96x3 with top-k 4
  r = cpu_plans["teacher"]
  assert r.returncode == 0, r.stderr[-3000:]
  step, teacher = json.loads(r.stdout)["programs"]
  assert (step["verdict"], teacher["name"], teacher["verdict"]) == ("no fit test", "teacher", "no fit test"), r.stdout
  c = teacher_config("synthetic:96x3")
  v, dm, layers, h, kv, hd, f = c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, \
    c.intermediate_size  # fmt: skip
  assert (dm, layers) == (96, 3)
  matrices = v * dm * (1 if c.tie_word_embeddings else 2) + layers * (2 * dm * h * hd + 2 * dm * kv * hd + 3 * dm * f)
  weights = 4 * (matrices // 2 + layers * (2 * dm + 2 * hd) + dm)
  assert step["other_resident_bytes"] == pytest.approx(weights, rel=1e-3), step  # β = 0: the teacher's copy only
  shape = run_shape(load_config(str(config)))
  rows, t = shape.rows // 2, shape.completion_len
  assert teacher["output_bytes"] == pytest.approx(rows * t * (4 + k * (4 + 4)), rel=1e-3), teacher
  assert teacher["argument_bytes"] > weights and teacher["flops"] > 0
  from jaxgrpo.plan import flops as fl  # the teacher's own forward (before: the policy's sampler FLOPs)

  assert teacher["flops"] == pytest.approx(fl.forward_flops(c, shape.rows, shape.prompt_len, t), rel=1e-9)
  # a run directory as the teacher (its checkpoint root or a step too): planned from the config saved with its
  # checkpoint, as the run reads it (``checkpoint.read_meta``); a tiny real run of one step, hidden 48
  from jaxgrpo.run.trainer import Trainer
  from jaxgrpo.services.checkpoint import Checkpointer, checkpoint_dir

  run = tmp_path / "teacher_run"
  tiny = {"model.synthetic": {"hidden_size": 48, "num_layers": 1}, "run.steps": 1, "run.out": str(run),
          "data.arithmetic": {"train_size": 64, "eval_size": 8, "sft_steps": 0, "max_operand": 9},
          "rollout.group_size": 2, "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 6,
          "reward.timeout_s": None}  # fmt: skip
  with Checkpointer(checkpoint_dir(run), log=None) as ckpt:
    Trainer(load_config(None, tiny), log=None, checkpoint_fn=ckpt.checkpoint_fn).run()
  for where in (run, run / "checkpoints", run / "checkpoints" / "1"):
    assert teacher_config(str(where)).hidden_size == 48, where


@pytest.mark.slow
def test_the_fix_search_names_the_micro_batch_count_the_tpu_compiler_accepts(tpu_plans):
  """``jaxgrpo.plan.plan_run`` with its fix search, end to end through XLA's TPU compiler (``.venv-tpu``) for
  v5e:2x2 (4 chips): a one-layer model whose float32 logits are, by formula, 32 rows x 256 tokens x 2**19 x 4 B =
  16 GiB per chip at one micro-batch (more than the 15.75 GiB XLA leaves) and 8 GiB at two. The compiler refuses
  one micro-batch (RESOURCE_EXHAUSTED, in seconds); the search compiles two, which fits; the refusal names it."""
  import tpu_aot_checks as checks

  out = tpu_plans["fix"]
  assert "failed" not in out, out.get("failed")  # the report raised (its traceback)
  rows = 16 * 8 // out["mesh"]["fsdp"]
  assert out["mesh"]["fsdp"] == 4 and rows * 256 * checks.FIX_MODEL["vocab_size"] * 4 == 16 * 2**30
  assert out["verdict"] == "does not fit" and "RESOURCE_EXHAUSTED" in out["error"], out
  assert [t[:2] for t in out["tried"]] == [["--step.micro_batches 2", "fits"]], out["tried"]
  assert out["refusal"].startswith("the step program does not fit v5e:2x2 (XLA: HLO temporaries "), out["refusal"]
  assert out["refusal"].endswith(
    f"; --step.micro_batches 2 fits ({out['tried'][0][2]:.2f} GiB/device; found by compiling)"
  )


def test_a_reward_model_without_its_config_json_is_refused_in_one_line(cpu_plans):
  """A ``reward.sources`` reward model whose folder has no config.json: exit 2, one ``error:`` line naming the
  field, the path and what the plan reads, before anything compiles."""
  r, missing = cpu_plans["rm_missing"], cpu_plans["dir"] / "nothing"
  assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
  errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
  assert errors == [
    f"error: `reward.sources['rm'].path` '{missing}': the plan reads the reward model's shape from "
    "its config.json, which is not there; give a *ForSequenceClassification folder or hub id (only config.json "
    "is read)"
  ], r.stderr[-2000:]


@pytest.mark.parametrize(
  "devices, prompts, want",
  [
    # the pod workload on v5e-256 (Qwen3-8B: 32 heads, 8 KV heads): the TPU compiler's 93.86 GiB per chip
    (
      256,
      64,
      "rollout.prompts_per_step 64 is not a multiple of the 256 devices of the batch axes (data×fsdp), so "
      "every device holds all 64 prompts and the KV cache of all 512 rows: --rollout.prompts_per_step 256 (a multiple "
      "of 256) or --devices.mesh fsdp=64,tensor=4 (prompts over 64, heads over 4) splits them (not compiled)",
    ),
    # 8 devices (cpu-8), 12 prompts: gcd 4, the other 2 on the tensor axis
    (
      8,
      12,
      "rollout.prompts_per_step 12 is not a multiple of the 8 devices of the batch axes (data×fsdp), so every "
      "device holds all 12 prompts and the KV cache of all 96 rows: --rollout.prompts_per_step 16 (a multiple of 8) "
      "or --devices.mesh fsdp=4,tensor=2 (prompts over 4, heads over 2) splits them (not compiled)",
    ),
    (8, 16, None),  # a multiple: the prompts are split, nothing to fix
  ],
)
def test_the_sampler_fix_names_prompts_per_step_a_multiple_of_the_batch_axes(devices, prompts, want):
  """A sampler whose prompts do not divide the batch axes runs with every prompt and the whole KV cache on every
  device (the run passes them replicated): its fix names the numbers and the counts that split them. Before, the
  plan offered no change for a sampler ("use more chips", the opposite of the fix)."""
  from jax.sharding import AbstractMesh

  from jaxgrpo.run import specs

  cfg = specs.load_config(POD, {"rollout.prompts_per_step": prompts})
  mesh = AbstractMesh((1, devices, 1), ("data", "fsdp", "tensor"))
  assert plan.sampler_fix(cfg, plan.model_config("qwen3-8b"), mesh) == want


@pytest.mark.parametrize("attention", ["dense", "blockwise"])
def test_the_plan_builds_the_model_with_the_runs_attention(attention):
  """The plan compiles the attention the run asks for (`model.attention`): before, it built every model with the
  default, so `--model.attention dense` printed blockwise's bytes for a TPU slice, silently."""
  from flax import nnx

  from jaxgrpo.models.attention import Attention
  from jaxgrpo.plan import programs
  from jaxgrpo.run import specs

  cfg = specs.load_config(POD, {"model.attention": attention})
  model = programs.abstract_model(cfg, plan.model_config("qwen3-0.6b"))
  impls = {m.implementation for _, m in nnx.iter_graph(model) if isinstance(m, Attention)}
  assert impls == {attention}


def test_a_sampler_whose_prompts_already_split_is_told_what_shrinks_it():
  """A sampler that does not fit although its prompts split over the batch axes (Qwen3-8B, 64 prompts × G 8 on the 64
  devices of fsdp): a larger fsdp axis would not divide the prompts (each device already holds one prompt's 8 rows),
  so the line names what does shrink it: a larger tensor axis (8 KV heads over 2), half the prompts over half the
  fsdp axis with the other half on the tensor axis (4 KV heads per device), 512 new tokens instead of 1,024. Before,
  the refusal said "use more chips (a larger fsdp axis)", which would replicate the prompts."""
  from jax.sharding import AbstractMesh

  from jaxgrpo.run import specs

  cfg = specs.load_config(POD, {"rollout.prompts_per_step": 64, "rollout.max_new_tokens": 1024})
  mesh = AbstractMesh((1, 64, 1), ("data", "fsdp", "tensor"))
  hint = plan.sampler_hint(cfg, plan.model_config("qwen3-8b"), mesh)
  assert hint == (
    "no change found: the sampler's 64 prompts already split over the 64 devices of the batch axes (data×fsdp; 8 "
    "rows and their KV cache per device), so a larger fsdp axis would not split them further; a larger tensor axis "
    "(--devices.mesh fsdp=64,tensor=2 on 128 devices: the KV cache's 8 heads and the layer weights over 2), or fewer "
    "prompts per step on the same devices (--rollout.prompts_per_step 32 --devices.mesh fsdp=32,tensor=2: 4 KV heads "
    "per device), or a shorter rollout (--rollout.max_new_tokens 512: the KV cache holds prompt + new tokens) "
    "shrinks it (not compiled)"
  )
  # 64 prompts on 16 devices: doubling fsdp still divides them, and half the prompts stay a multiple of 16
  wider = plan.sampler_hint(cfg, plan.model_config("qwen3-8b"), AbstractMesh((1, 16, 1), ("data", "fsdp", "tensor")))
  assert "--devices.mesh fsdp=32,tensor=1 on 32 devices: 16 rows each" in wider and "would not split" not in wider
  assert "--rollout.prompts_per_step 32: 16 rows per device" in wider
  sampler = plan.ProgramPlan("sampler", 1, verdict="does not fit", searched=True, hint=hint, error="RESOURCE_EXHAUSTED")
  refusal = plan.RunPlan(plan.parse_target("v5e-64"), "qwen3-8b", {}, {}, [sampler], []).refusal
  assert refusal.startswith("the sampler program does not fit v5e-64") and refusal.endswith("; " + hint)
  assert "use more chips" not in refusal and "\n" not in refusal
