"""What ArmorGRPOTrainer tells the outside world besides metrics: its model card and TRL's completions table."""

from __future__ import annotations

import math
import re

import pandas as pd
import pytest

from armor_trl import ArmorConfig, ArmorGRPOTrainer
from testing import cpu_args, has_digit_reward


def make_trainer(tiny_model_path, tiny_tokenizer, dataset, output_dir, **overrides):
    args = ArmorConfig(output_dir=str(output_dir), **cpu_args(**overrides))
    return ArmorGRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, args=args, train_dataset=dataset,
                            processing_class=tiny_tokenizer)


def test_model_card_names_armor_and_its_paper(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=1)
    trainer.create_model_card(model_name="tiny-armor")
    card = (tmp_path / "README.md").read_text()
    assert "This model was trained with ARMOR, a method introduced in" in card
    assert "ARMOR: Anchor Rollout and Mixed Optimization" in card
    assert "https://huggingface.co/papers/2607.10481" in card
    assert "Cite ARMOR as:" in card and "2607.10481" in card.split("Cite ARMOR as:")[1]
    citations = card.split("Cite ARMOR as:")[1]
    assert "Kexin Huang and Junkang Wu" in citations  # the paper's authors
    # GRPO, which ARMOR trains with, is cited too (as TRL's GRPOTrainer cards do), but not presented as the method
    assert "DeepSeekMath" in citations and "trained with GRPO" not in card
    assert "## ARMOR settings" in card and "| armor_alpha | 0.75 |" in card and "| anchor_filter | drop |" in card
    front_matter = card.split("---")[1]
    tags = re.findall(r"^- (\S+)$", front_matter, re.MULTILINE)
    assert {"trl", "grpo", "armor"} <= set(tags)


def test_completions_table_marks_the_anchor_of_each_group(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    """log_completions=True: TRL's table (written as parquet per logging step) has an `anchor` column that is True
    on exactly one row of every group whose reference candidates held a verified one: the group's anchor slot."""
    group = 4
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=3,
                           num_generations=group, log_completions=True, anchor_num_samples=4, anchor_filter="keep")
    trainer.train()
    tables = sorted((tmp_path / "completions").glob("completions_*.parquet"))
    assert len(tables) == 3
    groups_with_anchor = groups_without = 0
    for path in tables:
        table = pd.read_parquet(path)
        assert "anchor" in table.columns and table["anchor"].dtype == bool
        assert len(table) % group == 0
        for start in range(0, len(table), group):
            rows = table.iloc[start : start + group]
            flags = rows["anchor"].tolist()
            assert not any(flags[:-1])  # on-policy samples fill the first G-1 slots
            anchor_reward = rows["has_digit_reward"].iloc[-1]
            if flags[-1]:
                groups_with_anchor += 1
                assert anchor_reward >= trainer.args.anchor_reward_threshold  # a verified anchor
            else:
                groups_without += 1
                assert math.isnan(anchor_reward)  # an empty slot: no candidate was verified, no member of the group
    assert groups_with_anchor > 0
    found = [h["armor/anchor_found_frac"] for h in trainer.state.log_history if "armor/anchor_found_frac" in h]
    assert groups_with_anchor / (groups_with_anchor + groups_without) == pytest.approx(sum(found) / len(found))


def test_saving_a_lora_policy_writes_the_trained_adapter_only(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    from peft import LoraConfig

    args = ArmorConfig(output_dir=str(tmp_path), **cpu_args(max_steps=1))
    trainer = ArmorGRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, args=args,
                               train_dataset=prompt_dataset, processing_class=tiny_tokenizer,
                               peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    saved = sorted(path.name for path in (tmp_path / "final").iterdir())
    assert "adapter_config.json" in saved and "ref" not in saved  # PEFT would write the frozen "ref" adapter to ref/
    assert "ref" in trainer.model.peft_config  # the reference adapter is still there for training
