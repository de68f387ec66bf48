"""Anchors with ``environment_factory`` (armor_trl.rollout.tool_anchors): π_ref's candidates run in environment
instances of their own, reset with their group's row, scored on them.

The tiny tool model's fake generator (testing.ToolFake): the policy answers "7" at once; π_ref calls its environment's
tool and answers with the result. The environments record who made them, how they were reset and what was called on
them, so each test can say which instance a candidate ran in and what its reward was computed from.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re

import pydantic
import pytest

from testing import (G, Registry, ToolFake, anchor_rows, build_tool_trainer, capture_rounds, chat_numbers,
                     counter_environment, cpu_args, last_tool_result, logged, row_text, tool_call)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def increment_turn(prompt_text: str) -> str:
    """π_ref on "n*3?": increment the counter by 3n, then answer with the counter."""
    result = last_tool_result(prompt_text)
    if result is not None:
        return f"{result}</s>"
    return tool_call("increment", step=3 * int(re.search(r"u:(\d+)\*", prompt_text).group(1)))


def answer_reward(completions, answer, **kwargs):
    return [float(completion[-1]["content"].strip() == expected) for completion, expected in zip(completions, answer)]


def check_anchor_environments(trainer, registry, batches, groups: int):
    """Every round has its anchors, each a π_ref trajectory that ran in a candidate environment of its own, reset
    with its group's row exactly as the policy's (same kwargs), never one of the policy's instances."""
    candidates = registry.candidates_of(trainer)
    assert candidates, "π_ref's candidates ran in environments made for them"
    policy = [instance for pool in trainer._environment_pool.values() for instance in pool]
    assert all(instance.counter == 0 for instance in policy if hasattr(instance, "counter")), \
        "the policy's environments saw no candidate's tool call"
    policy_resets = [kwargs for instance in policy for kwargs in instance.resets]
    assert all(kwargs in policy_resets for instance in candidates for kwargs in instance.resets)
    for batch in batches:
        assert len(anchor_rows(batch)) == groups


def test_environment_factory_candidates_run_and_are_scored_in_environments_of_their_own(tool_model, tool_tokenizer,
                                                                                        tmp_path, monkeypatch):
    registry = Registry()
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(1, 9)), tools=(),
                                 environment_factory=counter_environment(registry), reward_funcs=None,
                                 anchor_same_call=False)
    assert trainer.reward_func_names == ["CounterEnvironment"]
    ToolFake(tool_tokenizer, trainer, reference_turn=increment_turn).install(monkeypatch)
    batches = capture_rounds(trainer)
    trainer.train()
    check_anchor_environments(trainer, registry, batches, groups=2)
    # the anchors' rewards are get_reward on their own instances (1: counter = answer); the policy's are 0
    assert logged(trainer, "armor/anchor_reward_mean") == [1.0, 1.0]
    assert logged(trainer, "armor/policy_reward_mean") == [0.0, 0.0]
    # each candidate's instance holds the counter its trajectory left, and was reset once per candidate it served
    incremented = [instance for instance in registry.candidates_of(trainer) if instance.counter]
    assert incremented and all(str(instance.counter) == instance.row["answer"] for instance in incremented)
    batch = batches[-1]
    for row in anchor_rows(batch):
        answer = re.search(r"u:(\d+)\*", tool_tokenizer.decode(batch["prompt_ids"][row])).group(1)
        assert row_text(tool_tokenizer, batch, row, mask_value=0) == f"\nt:{3 * int(answer)}\na:"


def test_environment_owned_reward_beside_reward_functions(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """get_reward is one more reward column (weight 1); candidates are verified by both, each on its own data."""
    registry = Registry()
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(1, 9)), tools=(),
                                 environment_factory=counter_environment(registry), reward_funcs=answer_reward,
                                 anchor_same_call=False, anchor_reward_threshold=2.0)
    assert trainer.reward_func_names == ["answer_reward", "CounterEnvironment"]
    ToolFake(tool_tokenizer, trainer, reference_turn=increment_turn).install(monkeypatch)
    batches = capture_rounds(trainer)
    trainer.train()
    check_anchor_environments(trainer, registry, batches, groups=2)
    assert logged(trainer, "armor/anchor_reward_mean") == [2.0, 2.0]  # both columns verified the anchors


def test_several_environments_route_each_candidate_to_its_rows_environment(tool_model, tool_tokenizer, tmp_path,
                                                                           monkeypatch):
    """A dict factory: each row's ``environment`` column picks its environment; candidates get an instance of that
    environment, reset without the control column, and see the observation its reset returns."""
    registry = Registry()
    shouted = []

    class EchoEnvironment:
        def __init__(self):
            self.resets = []
            registry.instances.append(self)

        def reset(self, **kwargs):
            self.resets.append(dict(kwargs))
            return "Echo."

        def shout(self, text: str) -> str:
            """
            Shout the text.

            Args:
                text: The text.

            Returns:
                It, upper case.
            """
            shouted.append((id(self), text))
            return text.upper()

    def turn(prompt_text: str) -> str:
        result = last_tool_result(prompt_text)
        if result is not None:
            return f"{result}</s>"
        if "Echo." in prompt_text:
            return tool_call("shout", text="hi")
        return increment_turn(prompt_text)

    def reward(completions, answer, environment, **kwargs):
        expected = ["HI" if name == "echo" else value for name, value in zip(environment, answer)]
        return [float(c[-1]["content"].strip() == e) for c, e in zip(completions, expected)]

    data = chat_numbers(range(1, 9)).add_column("environment", ["counter", "echo"] * 4)
    trainer = build_tool_trainer(
        tool_model, tool_tokenizer, tmp_path, data, tools=(), reward_funcs=reward, anchor_same_call=False,
        environment_factory={"counter": counter_environment(registry, with_reward=False, observation="Count."),
                             "echo": EchoEnvironment})
    ToolFake(tool_tokenizer, trainer, reference_turn=turn).install(monkeypatch)
    batches = capture_rounds(trainer)
    trainer.train()
    check_anchor_environments(trainer, registry, batches, groups=2)
    candidates = registry.candidates_of(trainer)
    assert all("environment" not in kwargs for instance in registry.instances for kwargs in instance.resets)
    assert {type(instance).__name__ for instance in candidates} == {"CounterEnvironment", "EchoEnvironment"}
    assert shouted and all(owner in {id(i) for i in candidates} for owner, _ in shouted)
    for batch in batches:
        for row in anchor_rows(batch):
            prompt = tool_tokenizer.decode(batch["prompt_ids"][row])
            expected = "HI</s>" if "Echo." in prompt else None
            if expected:
                assert row_text(tool_tokenizer, batch, row, mask_value=1).endswith(expected)


def test_environment_owned_reward_in_mixed_environments(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """One environment scores itself (get_reward), the other is scored by a reward function: a candidate is verified
    by the column that applies to it (the other is None for it)."""
    registry = Registry()

    def format_reward(completions, environment, **kwargs):
        return [None if name == "scored" else float(c[-1]["content"].strip().isdigit())
                for c, name in zip(completions, environment)]

    data = chat_numbers(range(1, 9)).add_column("environment", ["scored", "plain"] * 4)
    trainer = build_tool_trainer(
        tool_model, tool_tokenizer, tmp_path, data, tools=(), reward_funcs=format_reward, anchor_same_call=False,
        environment_factory={"scored": counter_environment(registry),
                             "plain": counter_environment(registry, with_reward=False)})
    assert trainer.reward_func_names == ["format_reward", "CounterEnvironment"]
    ToolFake(tool_tokenizer, trainer, reference_turn=increment_turn, policy_turn=lambda text: "x</s>").install(
        monkeypatch)
    batches = capture_rounds(trainer)
    trainer.train()
    check_anchor_environments(trainer, registry, batches, groups=2)


def test_environment_owned_data_without_a_dataset(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """No train_dataset: reset returns the prompt. A reset that returns the same task for the same row is reproducible:
    the candidates start where the group does."""
    registry = Registry()

    class GuessEnvironment:
        def __init__(self):
            self.resets = []
            registry.instances.append(self)

        def reset(self, **kwargs):
            self.resets.append(dict(kwargs))
            return "4*3?"

    def reward_len(completions, **kwargs):
        return [float(len(c[-1]["content"]) >= 2) for c in completions]

    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, None, tools=(), reward_funcs=reward_len,
                                 environment_factory=GuessEnvironment, anchor_same_call=False)
    ToolFake(tool_tokenizer, trainer, reference_turn=lambda text: "12</s>").install(monkeypatch)
    batches = capture_rounds(trainer)
    trainer.train()
    assert all(len(anchor_rows(batch)) == 2 for batch in batches)
    assert registry.candidates_of(trainer)


def test_an_environment_that_draws_its_task_on_reset_is_refused_naming_why(tool_model, tool_tokenizer, tmp_path,
                                                                           monkeypatch):
    draw = random.SystemRandom()  # a generator of its own (a group's resets share the global ones' state)

    class RandomWordEnvironment:
        def reset(self, **kwargs):
            return draw.choice(["cat", "dog", "owl", "bee", "ant", "elk", "emu", "yak", "fox", "hen"]) + "?"

    def reward_len(completions, **kwargs):
        return [float(len(c[-1]["content"])) for c in completions]

    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, None, tools=(), reward_funcs=reward_len,
                                 environment_factory=RandomWordEnvironment)
    ToolFake(tool_tokenizer, trainer, reference_turn=lambda text: "12</s>").install(monkeypatch)
    random.seed(0)
    with pytest.raises(ValueError, match="reproduce the group's initial state.*environment-owned data.*"
                                         "use_anchors=False"):
        trainer.train()


def test_an_unknown_environment_raises_trls_own_error(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    registry = Registry()
    data = chat_numbers(range(1, 9)).add_column("environment", ["unknown"] * 8)
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, data, tools=(), reward_funcs=answer_reward,
                                 environment_factory={"counter": counter_environment(registry)})
    ToolFake(tool_tokenizer, trainer).install(monkeypatch)
    with pytest.raises(ValueError, match="not among the environments"):
        trainer.train()


def test_anchor_cache_and_column_anchors_with_environments_are_refused(tool_model, tool_tokenizer, tmp_path):
    registry = Registry()
    for setting, match in (({"anchor_cache": True}, "anchor_cache=True with environment_factory.*cannot replay"),
                           ({"anchor_source": "column"}, "anchor_source='column' with environment_factory")):
        with pytest.raises(ValueError, match=match):
            build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(1, 9)), tools=(),
                               reward_funcs=answer_reward, environment_factory=counter_environment(registry), **setting)



def test_a_same_call_round_runs_its_candidates_in_environments_of_their_own(tool_model, tool_tokenizer, tmp_path,
                                                                            monkeypatch):
    """π_ref = π_θ: the candidates are extra rows of the policy's call and loop, each still in its own instance."""
    registry = Registry()
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(1, 9)), tools=(),
                                 environment_factory=counter_environment(registry), reward_funcs=None, max_steps=1)
    ToolFake(tool_tokenizer, trainer, reference_turn=increment_turn).install(monkeypatch)
    batches = capture_rounds(trainer)
    trainer.train()
    assert logged(trainer, "armor/anchor_same_call") == [1.0]
    check_anchor_environments(trainer, registry, batches, groups=2)
    assert logged(trainer, "armor/anchor_reward_mean") == [1.0]


def closing_environment(registry: Registry, closed: list):
    """counter_environment whose ``close`` is recorded, and raises for the first candidate instance closed."""
    base = counter_environment(registry)

    class ClosingEnvironment(base):
        def close(self) -> None:
            """
            Close the environment.
            """
            if not closed:
                closed.append(None)
                raise OSError("the first one's close() failed")
            closed.append(self)

    return ClosingEnvironment


@pytest.mark.parametrize("training_fails", [False, True], ids=["trained", "training_error"])
def test_a_failing_close_neither_skips_the_others_nor_hides_the_training_error(tool_model, tool_tokenizer, tmp_path,
                                                                              monkeypatch, training_fails):
    registry, closed = Registry(), []

    def reward(completions, answer, **kwargs):
        if training_fails and trainer.state.global_step == 1:  # candidates' instances exist by now
            raise ValueError("the training error")
        return answer_reward(completions, answer)

    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(1, 9)), tools=(),
                                 environment_factory=closing_environment(registry, closed), reward_funcs=reward,
                                 anchor_same_call=False)
    ToolFake(tool_tokenizer, trainer, reference_turn=increment_turn).install(monkeypatch)
    expected = "the training error" if training_fails else r"close\(\) of 1 of .*the first one's close\(\) failed"
    with pytest.raises(Exception, match=expected):  # (the reward's error reaches train() wrapped, naming it)
        trainer.train()
    candidates = registry.candidates_of(trainer)
    assert len(candidates) >= 2 and closed[0] is None  # the first one's close() raised ...
    assert {id(instance) for instance in closed[1:]} == {id(instance) for instance in candidates[1:]}  # ... the rest ran
    assert trainer.anchor_rollout.environment_pool == {}


# --- environments of every kind TRL takes (a group's resets share one random state) -----------------------------
SECRETS: list = []  # (environment class, the row's question, the secret its reset drew), every reset in order


def reveal(self) -> int:
    """
    Reveals the secret.

    Returns:
        The secret.
    """
    return self.state["secret"]


def secret_reset(self, **kwargs):
    """Draw a secret from Python's global generator (hidden: the observation does not show it)."""
    self.state["secret"] = random.randint(0, 10**6)
    SECRETS.append((type(self).__name__, kwargs["prompt"][-1]["content"], self.state["secret"]))


class PlainSecret:
    def __init__(self):
        self.state = {}

    reset, reveal = secret_reset, reveal


@dataclasses.dataclass(frozen=True)
class FrozenSecret:
    state: dict = dataclasses.field(default_factory=dict)
    reset, reveal = secret_reset, reveal


class PydanticSecret(pydantic.BaseModel):
    state: dict = {}
    reset, reveal = secret_reset, reveal


class SlottedSecret:
    __slots__ = ("state",)

    def __init__(self):
        self.state = {}

    reset, reveal = secret_reset, reveal


def reveal_turn(text: str) -> str:
    result = last_tool_result(text)
    return f"{result}</s>" if result is not None else tool_call("reveal")


def solved(completions, environments, **kwargs):
    return [float(c[-1]["content"].strip() == str(env.state.get("secret"))) for c, env in zip(completions, environments)]


def secret_trainer(tool_model, tool_tokenizer, tmp_path, factory, data=None):
    return build_tool_trainer(tool_model, tool_tokenizer, tmp_path, data or chat_numbers(range(8)), tools=(),
                              environment_factory=factory, reward_funcs=solved, anchor_same_call=False)


class SlottedWithDictSecret(SlottedSecret):
    __slots__ = ("__dict__",)


@pytest.mark.parametrize("factory", [FrozenSecret, {"plain": PlainSecret, "frozen": FrozenSecret,
                                                    "slotted": SlottedWithDictSecret}],
                         ids=["frozen_dataclass", "mixed"])
def test_every_kind_of_environment_trains_its_groups_resets_from_one_random_state(tool_model, tool_tokenizer, tmp_path,
                                                                                   monkeypatch, factory):
    """A frozen dataclass, or several classes mixed by the ``environment`` column: every reset of a group (the
    policy's G, π_ref's K candidates') draws the group's hidden secret, so the anchors solved their own group's task;
    no candidate is reset with another group's."""
    SECRETS.clear()
    data = chat_numbers(range(8))
    if isinstance(factory, dict):
        data = data.add_column("environment", ["plain", "frozen", "slotted", "frozen"] * 2)
    trainer = secret_trainer(tool_model, tool_tokenizer, tmp_path, factory, data)
    ToolFake(tool_tokenizer, trainer, reference_turn=reveal_turn).install(monkeypatch)
    random.seed(0)
    trainer.train()
    drawn = {}
    for kind, row, secret in SECRETS:
        drawn.setdefault((kind, row), set()).add(secret)
    assert len(drawn) == 4 and all(len(secrets) == 1 for secrets in drawn.values()), drawn
    assert len(SECRETS) == 4 * (G + 2)  # each group: its G rows and K = 2 candidates
    if isinstance(factory, dict):
        assert len({kind for kind, _ in drawn}) >= 2
    assert logged(trainer, "armor/anchor_reward_mean") == [1.0, 1.0]


def test_an_environment_that_takes_no_attribute_is_refused_with_anchors_naming_why(tool_model, tool_tokenizer,
                                                                                    tmp_path):
    for factory in (SlottedSecret, {"plain": PlainSecret, "slotted": SlottedSecret}):
        with pytest.raises(ValueError, match=r"SlottedSecret.*__slots__.*'__dict__'.*use_anchors=False"):
            secret_trainer(tool_model, tool_tokenizer, tmp_path, factory)
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), tools=(),
                                 environment_factory=SlottedSecret, reward_funcs=solved, use_anchors=False)
    assert trainer.anchor_rollout is None  # (without anchors no reset is wrapped: TRL's own path)


def test_a_pydantic_model_environment_is_built_and_goes_as_far_as_plain_grpo(tool_model, tool_tokenizer, tmp_path,
                                                                             monkeypatch):
    """A pydantic model takes no new attribute through its own ``__setattr__``; the trainer is built all the same and
    its resets are grouped (a group's and its candidates' secrets alike). Training goes as far as plain GRPOTrainer
    goes: with a chat template that renders tools, transformers cannot render pydantic's own public methods (``copy``,
    ``model_dump``, ...), which TRL exposes as tools, and both stop there with the same error."""
    from trl import GRPOConfig, GRPOTrainer

    trainer = secret_trainer(tool_model, tool_tokenizer, tmp_path / "armor", PydanticSecret)
    resets, make = trainer.group_resets, trainer.environment_factories[None]
    trainer.environments = [make() for _ in range(4)]  # a round of 2 groups of 2, as TRL hands them out
    resets.start_round(4, 2)
    SECRETS.clear()
    random.seed(0)
    for row, instance in enumerate(trainer.environments):
        instance.reset(prompt=[{"role": "user", "content": f"q{row // 2}"}])
    with resets.as_group(1):
        make().reset(prompt=[{"role": "user", "content": "q1"}])  # a candidate of group 1
    secrets = [secret for *_, secret in SECRETS]
    assert secrets[0] == secrets[1] != secrets[2] == secrets[3] == secrets[4]
    ToolFake(tool_tokenizer, trainer, reference_turn=reveal_turn).install(monkeypatch)
    trainer.environments = None
    with pytest.raises(Exception) as armor:
        trainer.train()
    plain = GRPOTrainer(model=tool_model, reward_funcs=solved, train_dataset=chat_numbers(range(8)),
                        processing_class=tool_tokenizer, environment_factory=PydanticSecret,
                        args=GRPOConfig(str(tmp_path / "grpo"), **cpu_args(per_device_train_batch_size=8,
                                                                           max_completion_length=96)))
    with pytest.raises(type(armor.value), match=re.escape(str(armor.value)[:40])):
        plain.train()
