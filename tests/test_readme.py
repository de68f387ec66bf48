"""The README leads: install near the top, a quickstart that runs as written (model and data swapped for local ones),
no link that leaves the repository."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
QUICKSTART_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
QUICKSTART_DATA = 'load_dataset("openai/gsm8k", "main", split="train")'

# the project's own notes and spec, which a user does not have (the first spelt in parts, so that this file is no hit
# of the project's own grep for it)
SHARED = "/".join(("..", "shared"))
OUTSIDE = (SHARED, "ARMOR.md", "/work/")

def quickstart(which: int = 0) -> str:
    """The README's first python code block (the GPU quickstart), or its second (the CPU variant)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) > which, "README.md lacks its ```python quickstart blocks"
    return blocks[which]


def test_install_comes_by_line_30_and_works_today():
    """One install line, near the top, that works from a clone today (armor-trl is not on the package index): when it
    is published, that line is the one to change. No placeholder to fill in, no install from the index anywhere."""
    lines = README.read_text().splitlines()
    install = README.read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    commands = [block.strip() for block in re.findall(r"```bash\n(.*?)```", install, flags=re.S)]
    assert commands == ["pip install ."]
    assert next(i for i, line in enumerate(lines, 1) if line.strip() == "pip install .") <= 30
    assert "not on the package index" in install and "make dist" in install
    pages = [README, *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "armor_trl").rglob("*.py")),
             REPO / "notebooks" / "armor_grpo_colab.ipynb"]
    for page in pages:
        text = page.read_text()
        for wrong in ("pip install armor-trl", 'pip install "armor-trl[', "pip install 'armor-trl[",
                      "<URL of this repository>", "<your git host>"):
            assert wrong not in text, f"{page.name}: {wrong}"


def test_quickstart_is_short_and_uses_what_the_issue_asks_for():
    code = quickstart()
    assert len(code.strip().splitlines()) <= 20
    assert QUICKSTART_MODEL in code and QUICKSTART_DATA in code
    assert "peft_config=LoraConfig(" in code and "from armor_trl.rewards import" in code
    compile(code, "README quickstart", "exec")


def test_readme_keeps_its_commands_and_cites_the_paper():
    text = README.read_text()
    assert "make demo" in text and "make test" in text and "make test-trl" in text
    for author in ("Kexin Huang", "Junkang Wu", "Jinda Lu", "Shuo Yang", "Chiyu Ma", "Jiancan Wu", "Xiang Wang",
                   "Xiangnan He", "Guoyin Wang", "Jingren Zhou"):
        assert author in text
    assert "2607.10481" in text


def test_no_link_leaves_the_repository():
    """Relative links in README.md and docs/*.md point at files that exist in the repository."""
    pages = [README, *sorted((REPO / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        assert SHARED not in text, page
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target) or target.startswith(("#", "mailto:")):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            assert path.is_relative_to(REPO) and path.exists(), f"{page.name}: {target}"


def test_quickstart_runs_on_the_tiny_model(tiny_model_path, tmp_path, monkeypatch):
    """The quickstart as written, with the model name swapped for the tiny local model, GSM8K for a few local rows of
    the same shape, and the config kept to two CPU steps."""
    import armor_trl
    import datasets

    from armor_trl.integration.checks import optimizer_steps_per_rollout

    code = quickstart()
    assert code.count(QUICKSTART_MODEL) == 1 and code.count(QUICKSTART_DATA) == 1
    code = code.replace(QUICKSTART_MODEL, tiny_model_path).replace(QUICKSTART_DATA, "local_gsm8k_rows()")

    def local_gsm8k_rows():  # GSM8K's columns and answer format
        return datasets.Dataset.from_dict({
            "question": [f"Tom has {i} apples and buys {i + 1} more. How many apples does he have?" for i in range(16)],
            "answer": [f"{i} + {i + 1} = <<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1}\n#### {2 * i + 1}" for i in range(16)],
        })

    config_class = armor_trl.ArmorConfig
    made = []

    def cpu_config(**kwargs):
        """The README's ArmorConfig, kept to two CPU steps in tmp_path. A random tiny model never solves GSM8K, so no
        anchor is found: the check that stops such a run early (where it exists) is off here, it is tested elsewhere."""
        overrides = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                         num_generations=4, max_completion_length=8, use_cpu=True, bf16=False, report_to="none",
                         save_strategy="no", gradient_checkpointing=False, disable_tqdm=True, logging_steps=1)
        if "anchor_fail_after_rounds" in {f.name for f in dataclasses.fields(config_class)}:
            overrides["anchor_fail_after_rounds"] = 0
        made.append(config_class(**{**kwargs, **overrides}))
        return made[-1]

    monkeypatch.setattr(armor_trl, "ArmorConfig", cpu_config)
    namespace = {"local_gsm8k_rows": local_gsm8k_rows, "__name__": "readme_quickstart"}
    exec(compile(code, "README quickstart", "exec"), namespace)

    trainer = namespace["trainer"]
    assert made and trainer.args is made[0]
    assert trainer.state.global_step == 2
    assert optimizer_steps_per_rollout(trainer.args) == 4  # the paper's multi-update regime, as README says
    assert hasattr(trainer.model, "peft_config")  # LoRA from peft_config
    assert any(key.startswith("armor/") for entry in trainer.state.log_history for key in entry)


def test_the_cpu_quickstart_runs_as_written(tmp_path, monkeypatch, caplog):
    """The README's CPU block, unchanged, in an empty folder: the tiny model learns to write a "7", ARMOR finds
    anchors, the mixed ratio acts (several optimizer steps per rollout batch), bf16 left unset trains in fp32."""
    import logging

    from armor_trl.integration.checks import optimizer_steps_per_rollout

    code = quickstart(1)
    assert "build_tiny_model" in code and "bf16" not in code.split("trainer.train()")[0]
    assert len(code.strip().splitlines()) <= 15
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme_cpu_quickstart"}
    with caplog.at_level(logging.WARNING):
        exec(compile(code, "README CPU quickstart", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == trainer.args.max_steps == 16
    assert trainer.args.bf16 is False and optimizer_steps_per_rollout(trainer.args) == 4
    assert "fully on-policy" not in caplog.text
    logged = [entry for entry in trainer.state.log_history if "armor/policy_reward_mean" in entry]
    assert max(entry["armor/anchor_found_frac"] for entry in logged) > 0
    assert max(entry["armor/policy_abs_mixed_ratio_dev_mean"] for entry in logged) > 0  # r_mix left 1
    assert logged[-1]["armor/policy_reward_mean"] > logged[0]["armor/policy_reward_mean"]  # it learned


SHIPPED = ("README.md", "LICENSE", "Makefile", "pyproject.toml", "armor_trl", "configs", "docs", "notebooks", "scripts",
           "benchmarks")  # what a clone, the sdist or the wheel hands a user (tests/ aside)


def shipped_text_files():
    for name in SHIPPED:
        path = REPO / name
        for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            if "__pycache__" in file.parts or file.suffix in (".png", ".pyc", ".safetensors", ".parquet"):
                continue
            try:
                yield file, file.read_text()
            except UnicodeDecodeError:
                continue


def test_no_shipped_file_points_outside_the_repository():
    found = [(str(file.relative_to(REPO)), text.count(marker)) for file, text in shipped_text_files()
             for marker in OUTSIDE if marker in text]
    assert not found, found


def test_every_armor_config_field_is_documented_in_configuration_md():
    from trl import GRPOConfig

    from armor_trl import ArmorConfig

    text = (REPO / "docs" / "configuration.md").read_text()
    grpo = {field.name for field in dataclasses.fields(GRPOConfig)}
    own = [field.name for field in dataclasses.fields(ArmorConfig) if field.name not in grpo]
    assert len(own) >= 40
    # named in code, alone (`name`) or with a value (`name=...`)
    assert [name for name in own if not re.search(rf"`{name}[`=]", text)] == []


def test_the_authors_code_is_named_and_the_differences_stated():
    readme, algorithm = README.read_text(), (REPO / "docs" / "algorithm.md").read_text()
    assert "released no code" not in readme
    for page in (readme, algorithm):
        assert "github.com/Hesse73/ARMOR" in page
    section = algorithm.split("## The authors' code", 1)[1].split("\n## ", 1)[0]
    for topic in ("What counts as correct", "QAE's quantile", "Same-call anchors", "Step units"):
        assert topic in section
