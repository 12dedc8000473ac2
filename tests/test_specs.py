"""jaxgrpo.run.specs: the nested run config, its YAML form, errors for the old flat keys, and validation at load time."""

from __future__ import annotations

import dataclasses
import glob
import os
import warnings

import numpy as np
import pytest

from jaxgrpo.kernels.config import preset
from jaxgrpo.run import specs
from jaxgrpo.run.specs import TrainerConfig, config_from_dict, load_config
from jaxgrpo.step.train import TrainConfig
from jaxgrpo.tasks.arithmetic import ArithmeticTask, SyntheticModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# scripts/configs/demo.yaml's keys as they were written in the flat form of the single-class config
OLD_KEYS = {
  "preset": "objective.preset",
  "demo_hidden_size": "model.synthetic.hidden_size",
  "demo_layers": "model.synthetic.num_layers",
  "demo_max_operand": "data.arithmetic.max_operand",
  "demo_train_size": "data.arithmetic.train_size",
  "demo_eval_size": "data.arithmetic.eval_size",
  "demo_sft_steps": "data.arithmetic.sft_steps",
  "demo_sft_lr": "data.arithmetic.sft_learning_rate",
  "demo_sft_batch": "data.arithmetic.sft_batch_size",
  "demo_sft_noise": "data.arithmetic.sft_noise",
  "group_size": "rollout.group_size",
  "prompts_per_step": "rollout.prompts_per_step",
  "max_new_tokens": "rollout.max_new_tokens",
  "max_prompt_tokens": "data.max_prompt_tokens",
  "temperature": "step.temperature",
  "learning_rate": "optim.learning_rate",
  "max_grad_norm": "step.max_grad_norm",
  "chunk_size": "step.chunk_size",
  "rewards": "reward.weights",
  "reward_timeout_s": "reward.timeout_s",
  "steps": "run.steps",
  "eval_every": "eval.every",
  "checkpoint_every": "checkpoint.every",
  "eval_samples": "eval.samples",
  "eval_pass_k": "eval.pass_k",
  "eval_batch_prompts": "eval.batch_prompts",
  "seed": "run.seed",
  "out": "run.out",
  "epsilon": "objective.clip_eps_low",
  "epsilon_high": "objective.clip_eps_high",
  "mu": "objective.num_iterations",
  "mesh": "devices.mesh",
}


def _write(tmp_path, text: str, name="c.yaml") -> str:
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def test_nested_yaml_embeds_the_library_configs_and_overrides_apply(tmp_path):
  path = _write(
    tmp_path,
    "model: {path: /ckpt/qwen, dtype: bfloat16}\n"
    "data: {dataset: knoveleng/open-rs, mapping: openrs}\n"
    "objective: {preset: lambda_grpo, beta: 0.04}\n"
    "rollout: {group_size: 6}\n"
    "step: {micro_batches: 2, temperature: 0.75}\n"
    "optim: {learning_rate: 1e-6}\n"  # YAML 1.1 would read 1e-6 as a string
    "eval: {dataset: HuggingFaceH4/MATH-500, pass_k: [1, 4]}\n",
  )
  cfg = load_config(
    path,
    {
      "rollout.group_size": 3,
      "objective.clip_eps_low": 0.1,
      "objective.clip_eps_high": 0.1,
      "objective.dual_clip": 3.0,
    },
  )
  assert cfg.objective == preset("lambda_grpo", beta=0.04, clip_eps_low=0.1, clip_eps_high=0.1, dual_clip=3.0)
  assert cfg.step == TrainConfig(micro_batches=2, temperature=0.75)  # the library's own classes, embedded
  assert cfg.optim.learning_rate == 1e-6 and isinstance(cfg.optim.learning_rate, float)
  assert cfg.rollout.group_size == 3 and cfg.eval.pass_k == (1, 4) and cfg.model.synthetic is None
  assert cfg.train_config() == TrainConfig(micro_batches=2, temperature=0.75, group_size=3)
  assert config_from_dict(cfg.to_dict()) == cfg  # config.json reads back
  assert TrainerConfig() == config_from_dict({})  # the defaults are the arithmetic demo
  assert TrainerConfig().model.synthetic == SyntheticModel() and TrainerConfig().data.arithmetic == ArithmeticTask()


def test_every_shipped_config_loads_without_warnings():
  for path in sorted(glob.glob(os.path.join(ROOT, "scripts", "configs", "*.yaml"))):
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      cfg = load_config(path)
    assert config_from_dict(cfg.to_dict()) == cfg, path


@pytest.mark.parametrize("key, dotted", sorted(OLD_KEYS.items()))
def test_an_old_flat_key_is_one_error_naming_its_dotted_key(tmp_path, key, dotted):
  """No flat key is read any more (issue 23, item 3): in a file, in ``config_from_dict`` and as an
  override, the old key is one ValueError naming the dotted key to write instead."""
  assert not hasattr(specs, "FLAT_KEYS") and not hasattr(specs, "translate_keys")
  specs.field_type(dotted)  # the named key exists
  for load in (
    lambda: load_config(_write(tmp_path, f"{key}: 1\n")),
    lambda: config_from_dict({key: 1}),
    lambda: load_config(None, {key: 1}),
  ):
    with pytest.raises(ValueError, match=rf"unknown config key `{key}` \(did you mean [^?]*`{dotted}`"):
      load()


@pytest.mark.parametrize(
  "text, overrides, match",
  [
    ("rollout: {group_sise: 8}\n", {}, r"`rollout.group_sise`: did you mean `rollout.group_size`\?"),
    ("objective: {presett: grpo}\n", {}, r"`objective.presett`: did you mean `objective.preset`\?"),
    ("objective: {preset: grpo, bta: 0.1}\n", {}, r"`objective.bta`: did you mean `objective.beta`\?"),
    (
      "",
      {"objective.presett": "grpo"},
      r"unknown config key `objective.presett` \(did you mean `objective.preset`\?\)",
    ),
    ("", {"rollout.group_sise": 8}, r"unknown config key `rollout.group_sise` \(did you mean `rollout.group_size`\?\)"),
    ("", {"rollout.learning_rate": 1.0}, r"`rollout.learning_rate` \(did you mean `optim.learning_rate`\?\)"),
  ],
)
def test_a_mistyped_dotted_key_gets_a_did_you_mean(tmp_path, text, overrides, match):
  """A mistyped key inside a section, in YAML or as a dotted override, names its likely spelling (issue 46 item 5;
  before: only the old flat keys got a hint, a dotted key only the list of valid keys)."""
  with pytest.raises(ValueError, match=match):
    load_config(_write(tmp_path, text) if text else None, overrides)


def test_a_mistyped_best_metric_is_refused_with_the_known_names():
  """``checkpoint.best_metric`` must be a metric the evaluation logs (before: a typo silently turned keep-best
  off: no record ever had it)."""
  demo = os.path.join(ROOT, "scripts", "configs", "demo.yaml")
  with pytest.raises(ValueError, match=r"`checkpoint.best_metric`='eval_acuracy' is not a metric the evaluation logs"):
    load_config(demo, {"checkpoint.best_metric": "eval_acuracy"})
  with pytest.raises(ValueError, match=r"use one of \['eval_accuracy', 'eval_pass@1', 'eval_pass@4'\]"):
    load_config(demo, {"checkpoint.best_metric": "eval_pass@8"})  # pass_k is [1, 4]
  assert load_config(demo, {"checkpoint.best_metric": "eval_pass@4"}).checkpoint.best_metric == "eval_pass@4"
  assert load_config(demo, {"checkpoint.best_metric": None}).checkpoint.best_metric is None
  env = os.path.join(ROOT, "scripts", "configs", "demo_env.yaml")
  assert load_config(env).checkpoint.best_metric == "eval_env_reward"  # the default stands for the env's metric
  assert load_config(env, {"checkpoint.best_metric": "eval_env/turns"}).checkpoint.best_metric == "eval_env/turns"
  with pytest.raises(ValueError, match=r"use one of \['eval_env_reward', 'eval_env/<metric>'\]"):
    load_config(env, {"checkpoint.best_metric": "eval_pass@1"})


def test_a_command_line_source_on_a_file_with_the_other_gives_the_whole_fix_in_one_error(tmp_path):
  """``--model.path ./models/nope`` on the demo config: one error with every flag the fix needs and the missing
  path (before: three tries — `model.synthetic` to null, then `data.arithmetic.sft_steps` to zero, then the path);
  the flags it names make the config load."""
  demo = os.path.join(ROOT, "scripts", "configs", "demo.yaml")
  with pytest.raises(ValueError) as e:
    load_config(demo, {"model.path": "./models/nope"})
  msg = str(e.value)
  assert "`model.path` given on the command line and `model.synthetic` in the file" in msg, msg
  assert "add --model.synthetic null --data.arithmetic.sft_steps 0" in msg, msg
  assert msg.endswith("and `model.path`: no such file or directory: ./models/nope"), msg
  model = tmp_path / "model"
  model.mkdir()
  cfg = load_config(demo, {"model.path": str(model), "model.synthetic": None, "data.arithmetic.sft_steps": 0})
  assert cfg.model.path == str(model) and cfg.data.arithmetic.sft_steps == 0
  with pytest.raises(ValueError, match=r"`data.dataset` given on the command line .*: add --data.arithmetic null$"):
    load_config(demo, {"data.dataset": "openai/gsm8k"})


@pytest.mark.parametrize(
  "text, error, match",
  [
    ("model: demo\n", TypeError, r"config section `model` must be a mapping of fields; got 'demo'"),
    ("dataset: demo\n", ValueError, r"unknown config key `dataset` \(did you mean `data.dataset` or `eval.dataset`"),
    ("resume: true\n", ValueError, r"unknown config key `resume` \(resuming is a command-line choice"),
    ("group_sise: 4\n", ValueError, r"unknown config key `group_sise` \(did you mean [^?]*`rollout.group_size`"),
    ("rollout: {group_sise: 4}\n", ValueError, r"unknown key\(s\) \['group_sise'\] in `rollout`"),
    ("optim: {learning_rate: fast}\n", TypeError, r"`optim.learning_rate`: expected float; got 'fast' \(str\)"),
    ("rollout: {group_size: 4.0}\n", TypeError, r"`rollout.group_size`: expected int; got 4.0 \(float\)"),
    ("run: {save_model: 1}\n", TypeError, r"`run.save_model`: expected bool; got 1 \(int\)"),
    ("eval: {pass_k: [1, x]}\n", TypeError, r"`eval.pass_k\[1\]`: expected int; got 'x'"),
    ("reward: {weights: {accuracy: high}}\n", TypeError, r"`reward.weights.accuracy`: expected float"),
    ("step: {micro_batches: two}\n", TypeError, r"`step.micro_batches`: expected int"),
    ("objective: {preset: frpo, beta: -1.0}\n", ValueError, r"in `objective`: `beta` must be >= 0"),
    ("objective: {preset: ppo}\n", ValueError, r"preset name"),
    ("objective: {preset: frpo, name: x}\n", ValueError, r"give `preset` .* or `name`"),
    ("rollout: {group_size: 0}\n", ValueError, r"`rollout.group_size` must be >= 1; got 0"),
    ("eval: {samples: 2, pass_k: [4]}\n", ValueError, r"`eval.pass_k` entries must be ints in \[1, eval.samples=2\]"),
    ("reward: {weights: {length: 1.0}}\n", ValueError, r"`reward.weights` must map names from"),
    ("model: {dtype: bfloat16}\n", ValueError, r"`model` needs exactly one of `path`"),
    ("model: {path: x, synthetic: {}}\n", ValueError, r"`model` needs exactly one of `path`"),
    ("data: {}\n", ValueError, r"`data` needs exactly one of `dataset`"),
    ("model: {path: x}\n", ValueError, r"`data.arithmetic.sft_steps`=800 warms up the synthetic model only"),
    ("eval: {dataset: math}\n", ValueError, r"the arithmetic task brings its own held-out set"),
    ("step: {group_size: 3}\n", ValueError, r"`step.group_size`=3 must equal `rollout.group_size`=6"),
    ("rollout: 4\n", TypeError, r"section `rollout` must be a mapping"),
    ("data: {arithmetic: {eval_size: 400}}\n", ValueError, r"`arithmetic.eval_size`=400 leaves no training"),
    ("model: {synthetic: {}, remat: dot}\n", TypeError, r"`model.remat`: expected .*'dots_no_batch'.* got 'dot'"),
    ("step: {packing: 0}\n", ValueError, r"`packing` must be >= 1 \(a positive int or None\); got 0"),
    ("step: {packing_rows: 4}\n", ValueError, r"`packing_rows`=4 needs `packing`"),
    ("step: {prefix_sharing: tree}\n", ValueError, r"`prefix_sharing`='tree' needs `packing`"),
    ("step: {packing: 64, prefix_sharing: trie}\n", ValueError, r"`prefix_sharing` must be one of 'none', 'prompt'"),
  ],
)
def test_bad_configs_name_the_field_the_expected_type_and_the_value(tmp_path, text, error, match):
  with pytest.raises(error, match=match):
    load_config(_write(tmp_path, text))


def test_malformed_yaml_and_missing_files_give_one_message_naming_the_file(tmp_path):
  path = _write(tmp_path, "rollout:\n  group_size: 4\n   prompts_per_step: 2\n")
  with pytest.raises(ValueError, match=rf"config file {path} is not valid YAML at line 3, column \d+"):
    load_config(path)
  with pytest.raises(ValueError, match=r"cannot read config file .*nope.yaml"):
    load_config(str(tmp_path / "nope.yaml"))
  with pytest.raises(ValueError, match=r"must hold a mapping of sections; got list"):
    load_config(_write(tmp_path, "- 1\n- 2\n"))


def test_numbers_are_parsed_as_numbers():
  assert specs.parse_value("1e-4") == 1e-4 and specs.parse_value("3E5") == 3e5 and specs.parse_value("-2e3") == -2000.0
  assert specs.parse_value("1.0e-4") == 1e-4 and specs.parse_value("12") == 12 and specs.parse_value("v1e4") == "v1e4"
  # string fields keep the raw text on the command line; others are YAML
  assert specs.parse_override("run.out", "123") == "123" and specs.parse_override("run.out", "null") == "null"
  assert specs.parse_override("eval.dataset", "null") is None
  assert specs.parse_override("reward.weights", "{accuracy: 1}") == {"accuracy": 1}
  assert specs.parse_override("data.mapping", "{prompt: q, answer: a}") == {"prompt": "q", "answer": "a"}
  assert specs.field_type("reward.weights.format") is float and specs.field_type("objective.preset") is str


def test_a_run_that_cannot_learn_is_refused_at_load():
  """A group of one (advantage r - mean = 0) or a weight of 0 on every reward: every advantage is 0 at every
  step (before: a warning for G = 1, nothing for the weights; loss 0 at every step, exit 0)."""
  with pytest.raises(ValueError, match=r"`rollout.group_size` is 1: .* set `rollout.group_size` >= 2"):
    load_config(None, {"rollout.group_size": 1})
  with pytest.raises(ValueError, match=r"`reward.weights`=\{'accuracy': 0.0\}: every reward has weight 0"):
    load_config(None, {"reward.weights": {"accuracy": 0.0}})
  load_config(None, {"reward.weights": {"accuracy": 0.0, "format": 0.5}})  # one non-zero weight is enough


def test_specs_are_frozen_keyword_only_and_type_checked_in_python_too():
  cfg = TrainerConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.run = None
  with pytest.raises(TypeError):
    specs.RunSpec(10)
  with pytest.raises(TypeError, match=r"`rollout.group_size` must be a Python int; got '4' \(str\)"):
    specs.RolloutSpec(group_size="4")
  with pytest.raises(TypeError, match=r"config field `devices.mesh`: expected str; got 8 \(int\)"):
    TrainerConfig(devices=specs.DevicesSpec(mesh=8))
  with pytest.raises(TypeError, match=r"config field `objective.name`: expected str"):
    TrainerConfig(objective=preset("grpo").replace(name=3))


def test_remat_and_packing_in_the_run_config():
  model = {"model.synthetic": {}}  # a model section given replaces the default one
  cfg = load_config(None, {**model, "model.remat": "dots_no_batch", "step.packing": 2048, "step.packing_rows": 4})
  assert cfg.model.remat == "dots_no_batch" and cfg.train_config().packing == 2048
  assert config_from_dict(cfg.to_dict()) == cfg
  assert load_config(None, {**model, "model.remat": True}).model.remat is True  # old configs: true = full
  with pytest.raises(ValueError, match="`model.remat`: remat must be one of"):
    specs.ModelSpec(synthetic=SyntheticModel(), remat="everything")


def test_overrides_apply_on_top_of_the_defaults(tmp_path):
  """An override of one field of the default model or data keeps the default source (issue 22, item
  9): before, ``data.max_prompt_tokens`` alone replaced the arithmetic task by an empty data section."""
  cfg = load_config(None, {"data.max_prompt_tokens": 64, "model.dtype": "bfloat16"})
  assert cfg.data.arithmetic == ArithmeticTask() and cfg.data.max_prompt_tokens == 64
  assert cfg.model.synthetic == SyntheticModel() and cfg.model.dtype == "bfloat16"
  assert cfg == TrainerConfig(
    model=specs.ModelSpec(synthetic=SyntheticModel(), dtype="bfloat16"),
    data=specs.DataSpec(arithmetic=ArithmeticTask(), max_prompt_tokens=64),
  )
  # naming a source replaces the default one
  cfg = load_config(None, {"model.path": "/m", "data.dataset": "d.jsonl", "data.max_prompt_tokens": 64})
  assert (cfg.model.path, cfg.model.synthetic, cfg.data.dataset, cfg.data.arithmetic) == ("/m", None, "d.jsonl", None)
  # a file without the section: the same; a file's own section must name its source
  path = _write(tmp_path, "rollout: {group_size: 4}\n")
  assert load_config(path, {"data.max_prompt_tokens": 64}).data.arithmetic == ArithmeticTask()
  with pytest.raises(ValueError, match=r"`data` needs exactly one of `dataset`"):
    load_config(_write(tmp_path, "data: {max_prompt_tokens: 64}\n", "d.yaml"), {"data.split": "x"})


@pytest.mark.parametrize(
  "where, value",
  [
    ("optim.learning_rate", ".inf"),
    ("optim.learning_rate", "inf"),
    ("optim.learning_rate", ".nan"),
    ("optim.weight_decay", "-.inf"),
    ("step.temperature", "nan"),
    ("step.max_grad_norm", ".inf"),
    ("objective.beta", ".inf"),
    ("reward.weights.accuracy", ".nan"),
    ("data.arithmetic.sft_learning_rate", ".inf"),
    ("eval.temperature", "inf"),
  ],
)
def test_non_finite_numbers_are_refused_at_load_time(tmp_path, where, value):
  """NaN/±inf in any float field is one ValueError naming the field, in a file and on the command
  line, where ``nan``/``inf`` are parsed as floats, not strings (issue 22, item 12)."""
  section, _, rest = where.partition(".")
  text = (
    f"{section}: {{{rest}: {value}}}\n"
    if "." not in rest
    else f"{section}: {{{rest.replace('.', ': {')}: {value}}}}}\n"
  )
  with pytest.raises(ValueError, match=rf"`{where}`: expected a finite number; got (nan|inf|-inf)"):
    load_config(_write(tmp_path, text))
  parsed = specs.parse_override(where, value.lstrip("."))
  assert isinstance(parsed, float) and not np.isfinite(parsed)
  with pytest.raises(ValueError, match=rf"`{where}`: expected a finite number"):
    load_config(None, {where: parsed})


def test_specs_use_the_checks_of_the_library_configs():
  """One validation idiom (``_checks``) for the specs, ``TrainConfig`` and ``OptimSpec``: non-finite
  and out-of-range numbers are refused on construction in Python too."""
  inf = float("inf")
  with pytest.raises(ValueError, match=r"`optim.learning_rate` must be finite; got inf"):
    specs.OptimSpec(learning_rate=inf)
  with pytest.raises(ValueError, match=r"`optim.adam_b2` must be in \[0, 1\); got 1.0"):
    specs.OptimSpec(adam_b2=1.0)
  with pytest.raises(ValueError, match=r"`temperature` must be finite"):
    TrainConfig(temperature=float("nan"))
  with pytest.raises(TypeError, match=r"`micro_batches` must be a Python int"):
    TrainConfig(micro_batches=2.0)
  with pytest.raises(ValueError, match=r"`rollout.top_p` must be <= 1.0; got 1.5"):
    specs.RolloutSpec(top_p=1.5)
  with pytest.raises(ValueError, match=r"`reward.weights.accuracy` must be finite"):
    specs.RewardSpec(weights={"accuracy": inf})
  with pytest.raises(ValueError, match=r"`devices.host_timeout_s` must be >= 1.0 \(seconds\); got 0.5"):
    specs.DevicesSpec(host_timeout_s=0.5)


def test_a_one_step_warm_up_is_refused_naming_the_field():
  """``sft_steps: 1`` failed after the data was built, inside optax (``decay_steps=0``), without
  naming the field (issue 22, item 12): now refused at load time; 0 and 2 are valid."""
  with pytest.raises(ValueError, match=r"`arithmetic.sft_steps` must be 0 \(no warm-up\) or >= 2"):
    load_config(None, {"data.arithmetic.sft_steps": 1})
  assert load_config(None, {"data.arithmetic.sft_steps": 2}).data.arithmetic.sft_steps == 2


_PLUGIN = """
import jax.numpy as jnp
from jaxgrpo.kernels import surrogates


def _pg(logp, old_logp, adv, real):
  none = jnp.zeros_like(real)
  return surrogates.Surrogate(jnp.where(real, -adv * logp, 0.0), none, none, none)


surrogates.register_surrogate("plugin_pg", _pg)
"""


def test_run_imports_registers_a_surrogate_the_config_then_names(tmp_path):
  """``run.imports`` imports a user's module before the objective is read: its registered loss is nameable in
  ``objective.loss``; the list travels in ``config.json``, so a fresh process (a resume) reads it back."""
  import json
  import subprocess
  import sys

  (tmp_path / "my_losses.py").write_text(_PLUGIN)
  cfg_file = tmp_path / "run.yaml"
  cfg_file.write_text("run: {imports: [my_losses]}\nobjective: {preset: grpo, loss: plugin_pg}\n")
  code = (
    "import json, sys; from jaxgrpo.run.specs import load_config, config_from_dict\n"
    f"cfg = load_config({str(cfg_file)!r})\n"
    "print(json.dumps([cfg.objective.loss, list(cfg.run.imports), cfg.to_dict()]))\n"
  )
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  loss, imports, saved = json.loads(out.stdout.strip().splitlines()[-1])
  assert (loss, imports) == ("plugin_pg", ["my_losses"])
  code = (
    "import json, sys; from jaxgrpo.run.specs import config_from_dict\n"
    f"print(config_from_dict(json.loads({json.dumps(json.dumps(saved))})).objective.loss)\n"
  )
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  assert out.stdout.strip().splitlines()[-1] == "plugin_pg"

  no_import = tmp_path / "no_import.yaml"
  no_import.write_text("objective: {preset: grpo, loss: plugin_pg_never_registered}\n")
  with pytest.raises(ValueError, match="plugin_pg_never_registered"):
    load_config(str(no_import))


def test_run_imports_refuses_a_module_that_cannot_be_imported_and_a_non_list():
  with pytest.raises(ValueError, match=r"`run\.imports\[1\]`: cannot import 'no_such_module_xyz'"):
    load_config(None, {"run.imports": ["json", "no_such_module_xyz"]})
  with pytest.raises(TypeError, match=r"`run\.imports`: expected a list of module names"):
    load_config(None, {"run.imports": "json"})
