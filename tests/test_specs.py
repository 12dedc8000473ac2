"""jaxgrpo.specs: the nested run config, its YAML form, the old flat keys, and validation at load time."""

from __future__ import annotations

import dataclasses
import glob
import os
import warnings

import pytest

from jaxgrpo import specs
from jaxgrpo.config import preset
from jaxgrpo.specs import TrainerConfig, config_from_dict, load_config
from jaxgrpo.tasks.arithmetic import ArithmeticTask, SyntheticModel
from jaxgrpo.train import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# scripts/configs/demo.yaml as it was written in the flat form of the single-class config
FLAT_DEMO = """
model: demo
dataset: demo
preset: grpo
demo_hidden_size: 64
demo_layers: 2
demo_max_operand: 19
demo_train_size: 4000
demo_eval_size: 128
demo_sft_steps: 800
demo_sft_lr: 3.0e-3
demo_sft_batch: 32
demo_sft_noise: 0.7
group_size: 8
prompts_per_step: 16
max_new_tokens: 20
max_prompt_tokens: 64
temperature: 1.0
learning_rate: 1.0e-4
max_grad_norm: 1.0
chunk_size: null
rewards: {accuracy: 1.0}
reward_timeout_s: 10.0
steps: 60
eval_every: 20
checkpoint_every: 20
eval_samples: 4
eval_pass_k: [1, 4]
eval_batch_prompts: 128
seed: 0
out: runs/demo
"""


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
  cfg = load_config(path, {"rollout.group_size": 3, "epsilon": 0.1, "objective.dual_clip": 3.0})
  assert cfg.objective == preset("lambda_grpo", beta=0.04, clip_eps_low=0.1, clip_eps_high=0.1, dual_clip=3.0)
  assert cfg.step == TrainConfig(micro_batches=2, temperature=0.75)  # the library's own classes, embedded
  assert cfg.optim.learning_rate == 1e-6 and isinstance(cfg.optim.learning_rate, float)
  assert cfg.rollout.group_size == 3 and cfg.eval.pass_k == (1, 4) and cfg.model.synthetic is None
  assert cfg.train_config() == TrainConfig(micro_batches=2, temperature=0.75, group_size=3)
  assert config_from_dict(cfg.to_dict()) == cfg  # config.json reads back
  assert TrainerConfig() == config_from_dict({})  # the defaults are the arithmetic demo
  assert TrainerConfig().model.synthetic == SyntheticModel() and TrainerConfig().data.arithmetic == ArithmeticTask()


def test_every_shipped_config_loads_and_the_demo_equals_its_old_flat_form(tmp_path):
  for path in sorted(glob.glob(os.path.join(ROOT, "scripts", "configs", "*.yaml"))):
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # nested form: no deprecation warning
      cfg = load_config(path)
    assert config_from_dict(cfg.to_dict()) == cfg, path
  flat = FLAT_DEMO.replace("model: demo\ndataset: demo\n", "")  # no one-to-one nested form: errors below
  with pytest.warns(
    FutureWarning, match=r"demo_layers → model.synthetic.num_layers[\s\S]*group_size → rollout.group_size"
  ):
    old = load_config(_write(tmp_path, flat))
  assert old == load_config(os.path.join(ROOT, "scripts", "configs", "demo.yaml"))


def test_flat_key_table_targets_real_fields():
  for key, paths in specs.FLAT_KEYS.items():
    for path in paths:
      specs.field_type(path)  # raises for a path that does not exist
    assert key not in specs.SECTIONS or key == "preset"


@pytest.mark.parametrize(
  "text, error, match",
  [
    ("model: demo\n", ValueError, r"`model: 'demo'` is the old flat form: write `model: \{path:"),
    ("dataset: demo\n", ValueError, r"`dataset` is gone: write `data: \{dataset:"),
    ("resume: true\n", ValueError, r"`resume` is gone: resuming is a command-line choice"),
    ("group_sise: 4\n", ValueError, r"unknown config key `group_sise` \(did you mean `group_size`\?\)"),
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
    ("rollout: {group_size: 0}\n", ValueError, r"`rollout.group_size` must be an int >= 1; got 0"),
    ("eval: {samples: 2, pass_k: [4]}\n", ValueError, r"`eval.pass_k` entries must be ints in \[1, eval.samples=2\]"),
    ("reward: {weights: {length: 1.0}}\n", ValueError, r"`reward.weights` must map names from"),
    ("model: {dtype: bfloat16}\n", ValueError, r"`model` needs exactly one of `path`"),
    ("model: {path: x, synthetic: {}}\n", ValueError, r"`model` needs exactly one of `path`"),
    ("data: {}\n", ValueError, r"`data` needs exactly one of `dataset`"),
    ("model: {path: x}\n", ValueError, r"`data.arithmetic.sft_steps`=800 warms up the synthetic model only"),
    ("eval: {dataset: math}\n", ValueError, r"the arithmetic task brings its own held-out set"),
    ("step: {group_size: 3}\n", ValueError, r"`step.group_size`=3 must equal `rollout.group_size`=6"),
    ("rollout: {group_size: 2}\ngroup_size: 3\n", ValueError, r"both `group_size` and `rollout.group_size`"),
    ("rollout: 4\n", TypeError, r"section `rollout` must be a mapping"),
    ("data: {arithmetic: {eval_size: 400}}\n", ValueError, r"`arithmetic.eval_size`=400 leaves no training"),
    ("model: {synthetic: {}, remat: dot}\n", TypeError, r"`model.remat`: expected .*'dots_no_batch'.* got 'dot'"),
    ("step: {packing: 0}\n", ValueError, r"`packing` must be a positive int or None; got 0"),
    ("step: {packing_rows: 4}\n", ValueError, r"`packing_rows`=4 needs `packing`"),
  ],
)
def test_bad_configs_name_the_field_the_expected_type_and_the_value(tmp_path, text, error, match):
  with pytest.raises(error, match=match):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", FutureWarning)
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
  assert specs.parse_override("out", "123") == "123" and specs.parse_override("run.out", "null") == "null"
  assert specs.parse_override("eval.dataset", "null") is None
  assert specs.parse_override("rewards", "{accuracy: 1}") == {"accuracy": 1}
  assert specs.parse_override("data.mapping", "{prompt: q, answer: a}") == {"prompt": "q", "answer": "a"}
  assert specs.field_type("reward.weights.format") is float and specs.field_type("objective.preset") is str


def test_flat_aliases_keep_their_old_meaning():
  with pytest.warns(FutureWarning):
    cfg = config_from_dict({"preset": "dapo", "epsilon": 0.1, "epsilon_high": 0.3, "mu": None, "beta": None})
  assert (cfg.objective.clip_eps_low, cfg.objective.clip_eps_high) == (0.1, 0.3)  # epsilon_high wins
  assert cfg.objective == preset("dapo", clip_eps_low=0.1, clip_eps_high=0.3)  # None: the preset's value
  assert load_config(None, {"epsilon_high": 0.3, "epsilon": 0.1}).objective.clip_eps_high == 0.3  # any order


def test_group_size_one_warns_that_advantages_vanish():
  with pytest.warns(UserWarning, match="every group-relative advantage is 0"):
    load_config(None, {"rollout.group_size": 1})


def test_specs_are_frozen_keyword_only_and_type_checked_in_python_too():
  cfg = TrainerConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.run = None
  with pytest.raises(TypeError):
    specs.RunSpec(10)
  with pytest.raises(TypeError, match=r"`rollout.group_size` must be an int >= 1; got '4' \(str\)"):
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
