"""docs/agents.md's example, end to end: the warm-started tiny tool agent (armor_trl.app.tool_testbed) really emits
tool calls, and configs/tool_agent_tiny.yaml trains it with anchors through TRL's own tool loop; the anchors' and the
on-policy rows' tool metrics are logged apart, next to TRL's."""

from __future__ import annotations

import dataclasses
import math
import os
import re

import pytest

from armor_trl.app.recipe.build import build_trainer
from armor_trl.app.recipe.parsing import parse_train_args
from armor_trl.app.tool_testbed import TOOLS, add, conversation, resolve_tools, supervised_example
from testing import REPO, logged

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
RECIPE = REPO / "configs" / "tool_agent_tiny.yaml"
PAGE = REPO / "docs" / "agents.md"
AGENT = '"results/tool_agent/model"'  # where the page's shell block writes the agent its Python block trains

@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """The example's agent, its default warm start (docs/agents.md)."""
    from armor_trl.app.tool_testbed import build_tool_agent

    return build_tool_agent(tmp_path_factory.mktemp("tool-agent"))


def test_a_warm_start_conversation_learns_the_model_turns_only(tool_tokenizer):
    """The supervised example is the text TRL's loop builds (prompt, call, the tool's result line, answer), with the
    prompt and the tool results as context: the model learns its calls and its answer, never the results."""
    ids, labels = supervised_example(tool_tokenizer, conversation(12, 35, "wrong_name"))
    assert tool_tokenizer.decode(ids) == (
        'u:12+35=\na:<tool_call>{"name": "sum", "arguments": {"a": 12, "b": 35}}</tool_call></s>'
        "\nt:{<pad>error<pad>: <pad>Tool sum not found.<pad>}\na:"  # (the character tokenizer has no quote: unknown)
        '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 35}}</tool_call></s>\nt:47\na:47</s>')
    learned = tool_tokenizer.decode([token for token, label in zip(ids, labels) if label != -100])
    assert learned == ('<tool_call>{"name": "sum", "arguments": {"a": 12, "b": 35}}</tool_call></s>'
                       '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 35}}</tool_call></s>47</s>')


def test_tools_are_named_from_the_registry_or_an_import_path():
    assert resolve_tools(["add"]) == [add] and TOOLS["add"](12, 35) == 47
    assert resolve_tools(["armor_trl.app.tool_testbed:add"]) == [add]
    with pytest.raises(ValueError, match="Unknown tool 'ad'.*add"):
        resolve_tools(["ad"])


@pytest.mark.slow
def test_the_example_trains_with_anchors_through_trls_tool_loop(agent, tmp_path):
    script_args, training_args, model_args, _ = parse_train_args([
        "--config", str(RECIPE), "--model_name_or_path", agent, "--output_dir", str(tmp_path), "--max_steps", "4",
        "--use_cpu", "true"])
    trainer = build_trainer(script_args, training_args, model_args)
    trainer.train()

    def values(key):
        found = logged(trainer, key)
        assert found, f"{key} was not logged"
        return [value for value in found if not math.isnan(value)]

    assert max(values("armor/anchor_found_frac")) > 0, "no verified π_ref trajectory anchored a group"
    assert values("armor/anchor_reward_mean") and min(values("armor/anchor_reward_mean")) == 1.0
    # the model's own tool calls, TRL's counts and ours for anchor and on-policy rows apart: calls, and failures
    # (a call of the tool that does not exist)
    for key in ("tools/call_frequency", "tools/failure_frequency", "armor/anchor_tool_call_frequency",
                "armor/policy_tool_call_frequency", "armor/policy_tool_failure_frequency"):
        assert max(values(key)) > 0, key
    assert values("armor/anchor_tool_failure_frequency")  # finite where an anchor made a call


def test_the_python_example_runs_as_written_and_is_the_recipes_run(tmp_path, monkeypatch):
    """docs/agents.md's Python block, unchanged but for the agent's path (a 30-step warm start here: it rarely calls its
    tool and never answers right, so the early stop for a run without anchors is off) and two steps in tmp_path: it
    trains with π_ref's candidates through TRL's loop, and its settings, data, tool and reward are the recipe's (the
    page says "the same run"), whose run on the page's agent the slow test above checks."""
    import yaml

    import armor_trl
    from armor_trl.app.recipe.build import train_datasets
    from armor_trl.app.tool_testbed import build_tool_agent
    from armor_trl.rewards import resolve_rewards

    code = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)[0]
    assert "build_tool_agent" not in code and code.count(AGENT) == 1  # it trains the agent the shell block wrote
    agent = build_tool_agent(tmp_path / "agent", steps=30, batch_size=16)
    real, written = armor_trl.ArmorConfig, []

    def short_run(output_dir, **kwargs):
        written.append(real(output_dir, **kwargs))
        return real(str(tmp_path / "run"), **{**kwargs, "max_steps": 2, "use_cpu": True, "anchor_fail_after_rounds": 0,
                                              "disable_tqdm": True})

    monkeypatch.setattr(armor_trl, "ArmorConfig", short_run)
    namespace = {"__name__": "agents_example"}
    exec(compile(code.replace(AGENT, repr(agent)), "docs/agents.md example", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 2
    assert max(logged(trainer, "armor/anchor_candidate_rows")) > 0  # π_ref's candidates ran through the loop

    script_args, recipe_args, _, _ = parse_train_args(["--config", str(RECIPE), "--model_name_or_path", agent])
    fields = {field.name for field in dataclasses.fields(real)}
    keys = [key for key in yaml.safe_load(RECIPE.read_text()) if key in fields and key not in ("disable_tqdm",)]
    assert len(keys) >= 20
    differ = {key: (getattr(written[0], key), getattr(recipe_args, key)) for key in keys
              if getattr(written[0], key) != getattr(recipe_args, key)}
    assert not differ, differ
    assert list(namespace["train"]["prompt"]) == list(train_datasets(script_args)[0]["prompt"])
    assert trainer.tools == resolve_tools(script_args.tools)
    assert [f.__name__ for f in trainer.reward_funcs] == [f.__name__ for f in resolve_rewards(script_args.reward_funcs)]
