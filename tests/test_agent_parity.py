"""Agents with anchors as TRL runs them (issue 57): TRL's tool metrics on the same trajectories, no tool loop where TRL
runs none, a group's environments starting alike (hidden random state), the candidates' environment pool, reward
functions called as TRL's tests call them, the π_ref log-probs of rows out of the loss, π_ref's sampling settings on
every turn, and TRL's tool / environment training scenarios with anchors (same-call rounds included).

The tiny tool model generates through testing.ToolFake (a deterministic generator at the model that answers each row by
its text), or PerRow below (each row by its text and its place among the call's rows of that text).
"""

from __future__ import annotations

import os
import random
import re
from collections import Counter

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from armor_trl.rewards.checks import checked
from testing import (G, ToolFake, anchor_rows, answer_reward, async_multiply, build_tool_trainer, capture_rounds,
                     chat_numbers, cpu_args, divide, last_tool_result, logged, multiply, multiply_turn, row_text,
                     tool_call)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def number(text: str) -> int:
    return int(re.search(r"u:(\d+)\*", text).group(1))


class PerRow(ToolFake):
    """Answers each row by its text and its place among the call's rows of that text (``first_turns[place % len]``, or
    ``first_turns(text, place)``; after a tool result ``after_result``): the
    rows of a group say different things, as TRL's tests' fakes do, whatever the size of the call (a same-call round
    carries G - 1 + K rows per prompt; TRL's fakes answer by the call's size)."""

    def __init__(self, tokenizer, trainer, first_turns, after_result="Done!</s>"):
        super().__init__(tokenizer, trainer)
        self.first_turns, self.after_result = first_turns, after_result

    def completions(self, model, prompts):
        texts = [self.tokenizer.decode(ids) for ids in prompts]
        self.calls.append((self.is_reference(model), texts))
        seen, out = Counter(), []
        for text in texts:
            place = seen[text]
            seen[text] += 1
            if "\nt:" in text:
                said = self.after_result
            elif callable(self.first_turns):
                said = self.first_turns(text, place)
            else:
                said = self.first_turns[place % len(self.first_turns)]
            out.append(self.tokenizer(said, add_special_tokens=False)["input_ids"])
        width = max(map(len, out))
        return [ids + [self.tokenizer.pad_token_id] * (width - len(ids)) for ids in out]

    def is_reference(self, model) -> bool:
        return model is not self.trainer.model


# --- 4. tools/failure_frequency as TRL counts ---------------------------------------------------------------------
def lookup(key: str) -> dict:
    """
    Looks a key up.

    Args:
        key: The key.

    Returns:
        The entry, or an error entry.
    """
    return {"error": f"no entry {key}"}  # a normal result that reads like an error: no failure in TRL's count


def mixed_calls(text: str) -> str:
    """Per prompt n: a call that succeeds, one whose result reads like an error, one that raises, an unknown tool."""
    n = number(text)
    return [tool_call("multiply", a=n, b=3), tool_call("lookup", key="k"), tool_call("divide", a=n, b=0),
            tool_call("sum", a=n, b=3)][n % 4]


def test_tool_metrics_equal_plain_trls_on_the_same_trajectories(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """The policy and π_ref write the same trajectories: TRL's tools/call_frequency and tools/failure_frequency under
    ARMOR (anchored rounds, the same-call round and a separate π_ref call) equal plain GRPOTrainer's, step by step."""
    tools = [multiply, lookup, divide]
    data = chat_numbers(range(8))
    settings = cpu_args(max_completion_length=96, max_steps=2, per_device_train_batch_size=8, shuffle_dataset=False)
    plain = GRPOTrainer(model=tool_model, reward_funcs=answer_reward, args=GRPOConfig(str(tmp_path / "trl"), **settings),
                        train_dataset=data, processing_class=tool_tokenizer, tools=tools)
    PerRow(tool_tokenizer, plain, lambda text, place: mixed_calls(text), "done</s>").install(monkeypatch)
    plain.train()
    armor = build_tool_trainer(tool_model, tool_tokenizer, tmp_path / "armor", data, tools=tools, shuffle_dataset=False)
    PerRow(tool_tokenizer, armor, lambda text, place: mixed_calls(text), "done</s>").install(monkeypatch)
    armor.train()
    assert logged(armor, "armor/anchor_same_call") == [1.0, 0.0]
    for key in ("tools/call_frequency", "tools/failure_frequency"):
        assert logged(armor, key) == logged(plain, key), key
    assert logged(plain, "tools/failure_frequency") == [0.0, 1.0]  # step 1: multiply, lookup; step 2: divide, sum


# --- 3. an environment without tool methods ----------------------------------------------------------------------
def test_an_environment_without_tool_methods_runs_no_tool_loop(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """TRL runs no loop without tools: a tool call the model writes anyway stays one turn, every token the model's
    (no tool result, no second turn, no tool_mask), for the policy's rows and π_ref's candidates alike."""

    class QuizEnvironment:
        def reset(self, **kwargs):
            return None

    def calls_a_tool(completions, **kwargs):
        return [float(bool(c[-1].get("tool_calls"))) for c in completions]

    call = tool_call("multiply", a=1, b=3)
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), tools=(),
                                 environment_factory=QuizEnvironment, reward_funcs=calls_a_tool,
                                 anchor_same_call=False)
    fake = ToolFake(tool_tokenizer, trainer, reference_turn=lambda text: call, policy_turn=lambda text: call).install(
        monkeypatch)
    batches = capture_rounds(trainer)
    trainer.train()
    assert not any("\nt:" in text for _, texts in fake.calls for text in texts)  # no turn after a tool result
    for batch in batches:
        assert "tool_mask" not in batch
        assert len(anchor_rows(batch)) == 2
        assert all(row_text(tool_tokenizer, batch, row) == call for row in range(len(batch["completion_ids"])))
    assert not logged(trainer, "tools/call_frequency") and not logged(trainer, "armor/anchor_tool_call_frequency")


# --- 2. hidden random state drawn on reset ---------------------------------------------------------------------------
class SecretEnvironment:
    """Draws a secret on reset from Python's global generator; the observation does not show it. ``reveal`` tells it,
    and the reward is whether the last answer was it."""

    made: list = []

    def __init__(self):
        self.secret, self.row, self.answer, self.resets = None, None, None, []
        SecretEnvironment.made.append(self)

    def reset(self, **kwargs):
        self.secret, self.row, self.answer = random.randint(0, 10**6), kwargs["prompt"][-1]["content"], None
        self.resets.append((self.row, self.secret))
        return None

    def reveal(self) -> int:
        """
        Reveals the secret.

        Returns:
            The secret.
        """
        return self.secret


def reveal_turn(text: str) -> str:
    result = last_tool_result(text)
    return f"{result}</s>" if result is not None else tool_call("reveal")


def test_a_groups_environments_start_from_one_random_state(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """A secret drawn with ``random`` on reset, invisible in the prompt: every reset of a group (the policy's G and
    π_ref's K candidates') draws the same secret, so the anchor solved its group's task; groups draw anew."""
    SecretEnvironment.made = []

    def solved(completions, environments, **kwargs):
        return [float(c[-1]["content"].strip() == str(env.secret)) for c, env in zip(completions, environments)]

    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), tools=(),
                                 environment_factory=SecretEnvironment, reward_funcs=solved, anchor_same_call=False)
    ToolFake(tool_tokenizer, trainer, reference_turn=reveal_turn).install(monkeypatch)
    random.seed(0)
    batches = capture_rounds(trainer)
    trainer.train()
    secrets = {}
    for instance in SecretEnvironment.made:
        for row, secret in instance.resets:
            secrets.setdefault(row, set()).add(secret)
    assert len(secrets) == 4 and all(len(drawn) == 1 for drawn in secrets.values()), secrets
    assert len({next(iter(drawn)) for drawn in secrets.values()}) == 4  # each group its own
    for batch in batches:
        assert len(anchor_rows(batch)) == 2
    # the anchors' answers are their group's secret (the reward read their own instance's)
    assert logged(trainer, "armor/anchor_reward_mean") == [1.0, 1.0]


def test_a_reset_drawing_from_a_generator_of_its_own_is_still_refused(tool_model, tool_tokenizer, tmp_path,
                                                                      monkeypatch):
    """A reset that draws its task from a generator of its own (not the global ones) and shows it: refused."""
    source = random.Random(1234)

    class OwnGeneratorEnvironment:
        def reset(self, **kwargs):
            return source.choice(["cat", "dog", "owl", "bee", "ant", "elk"]) + "?"

    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, None, tools=(), reward_funcs=answer_reward,
                                 environment_factory=OwnGeneratorEnvironment)
    ToolFake(tool_tokenizer, trainer, reference_turn=lambda text: "12</s>").install(monkeypatch)
    with pytest.raises(ValueError, match="reproduce the group's initial state.*use_anchors=False"):
        trainer.train()


# --- 6. the candidates' environment pool ------------------------------------------------------------------------------
def test_candidate_environments_are_reused_across_rounds_and_closed(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """π_ref's candidates hold K instances per group of a round, made once and reused by every later round, and
    closed (their close()) when train() returns."""
    made, closed = [], []

    class ClosingEnvironment:
        def __init__(self):
            made.append(self)

        def reset(self, **kwargs):
            return None

        def increment(self, step: int) -> int:
            """
            Returns the step.

            Args:
                step: Value to add.

            Returns:
                The step.
            """
            return step

        def close(self):
            """
            Releases the environment.
            """
            closed.append(self)

    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(1, 13)), tools=(),
                                 environment_factory=ClosingEnvironment, reward_funcs=answer_reward,
                                 anchor_same_call=False, max_steps=3)
    ToolFake(tool_tokenizer, trainer, reference_turn=lambda text: "3</s>").install(monkeypatch)
    policy_pool = trainer._environment_pool[None]
    trainer.train()
    candidates = [instance for instance in made if all(instance is not p for p in policy_pool)]
    assert len(candidates) == 2 * 2  # K = 2 per group, 2 groups per round, over 3 rounds
    assert sorted(map(id, closed)) == sorted(map(id, candidates)) and trainer.anchor_rollout.environment_pool == {}


# --- 7. reward functions called as TRL calls them ---------------------------------------------------------------------
def test_the_reward_wrapper_takes_an_environment_owned_reward_called_with_environments_only():
    """TRL's own tests call an environment-owned reward directly (``reward_funcs[-1](environments=[...])``)."""

    class Scored:
        def get_reward(self):
            return 1.0

    def get_reward(environments, **kwargs):
        return [e.get_reward() if isinstance(e, Scored) else None for e in environments]

    wrapped = checked(get_reward, "Scored")
    assert wrapped(environments=[Scored(), object()]) == [1.0, None]
    assert wrapped(environments=[Scored()], completions=["a"]) == [1.0]
    with pytest.raises(ValueError, match="returned 2 rewards for 1"):
        checked(lambda environments, **kwargs: [1.0, 1.0], "two")(environments=[Scored()])


def test_an_environment_owned_reward_of_a_built_trainer_called_directly(tool_model, tool_tokenizer, tmp_path):
    class Counter:
        def reset(self, **kwargs):
            self.counter = 3

        def get_reward(self) -> float:
            return float(self.counter)

    class Plain:
        def reset(self, **kwargs):
            return None

    data = chat_numbers(range(8)).add_column("environment", ["counter", "plain"] * 4)
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, data, tools=(), reward_funcs=answer_reward,
                                 environment_factory={"counter": Counter, "plain": Plain})
    counter = Counter()
    counter.reset()
    assert trainer.reward_funcs[-1](environments=[counter, Plain()]) == [3.0, None]


# --- 9. π_ref's log-probs of rows out of the loss ---------------------------------------------------------------------
def test_rows_out_of_the_loss_carry_zero_reference_logps_marked(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """π_ref is never verified: every anchor slot is empty (its completion masked from attention). Its armor_ref_logps
    are 0, marked by armor_loss_row = False, in a same-call round (π_ref's log-probs are TRL's old ones, computed in the
    round: num_iterations=2) and in a round with a separate π_ref call alike; the rows in the loss carry real
    (negative) log-probs."""
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), anchor_filter="keep",
                                 num_iterations=2, max_steps=4)
    ToolFake(tool_tokenizer, trainer, reference_turn=lambda text: "8</s>").install(monkeypatch)
    batches = capture_rounds(trainer)
    trainer.train()
    assert logged(trainer, "armor/anchor_same_call") == [1.0, 0.0]
    for batch in batches:
        kept = batch["armor_loss_row"]
        assert (~kept).sum() == 2 and not batch["armor_is_anchor"].any()
        assert (batch["armor_ref_logps"][~kept] == 0).all()
        in_loss = batch["completion_mask"][kept].bool()
        assert (batch["armor_ref_logps"][kept][in_loss] < 0).all()


# --- 5. π_ref's sampling settings on every turn --------------------------------------------------------------------------
SAMPLING = dict(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1)


@pytest.mark.parametrize("path", ["generate", "continuous_batching"])
def test_every_candidate_turn_is_sampled_with_the_trainings_settings(path, tool_model, tool_tokenizer, tmp_path,
                                                                       monkeypatch):
    """docs/anchors.md: π_ref's candidates are sampled with the trainer's own sampling settings. Every generation call,
    π_ref's first turns and its turns after a tool result included, gets them as transformers resolves them."""
    from transformers import LlamaForCausalLM

    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), anchor_same_call=False,
                                 use_transformers_continuous_batching=path == "continuous_batching", **SAMPLING)
    fake = ToolFake(tool_tokenizer, trainer).install(monkeypatch)
    seen = []
    generate, generate_batch = LlamaForCausalLM.generate, LlamaForCausalLM.generate_batch

    def settings(model, config):
        resolved, _ = model._prepare_generation_config(config)
        return {name: getattr(resolved, name) for name in (*SAMPLING, "do_sample")}

    def recording_generate(model, *args, generation_config=None, **kwargs):
        seen.append((fake.is_reference(model), settings(model, generation_config)))
        return generate(model, *args, generation_config=generation_config, **kwargs)

    def recording_batch(model, inputs, generation_config=None, **kwargs):
        seen.append((fake.is_reference(model), settings(model, generation_config)))
        return generate_batch(model, inputs, generation_config=generation_config, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "generate", recording_generate)
    monkeypatch.setattr(LlamaForCausalLM, "generate_batch", recording_batch)
    trainer.train()
    reference_turns = [texts for is_reference, texts in fake.calls if is_reference]
    assert any("\nt:" in text for texts in reference_turns for text in texts)  # π_ref's turns after a tool result
    assert len(seen) == len(fake.calls) and sum(is_reference for is_reference, _ in seen) == len(reference_turns) >= 4
    assert all(values == {**SAMPLING, "do_sample": True} for _, values in seen), seen


# --- 8. TRL's tool / environment training scenarios, anchors on ---------------------------------------------------------
def trains(trainer) -> dict:
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert any(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())
    return trainer.state.log_history


def counter_class(calls: list | None = None, with_reward=False, observation=None):
    class CounterEnvironment:
        def reset(self, **kwargs):
            self.counter = 0
            return observation

        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            if calls is not None:
                calls.append(step)
            self.counter += step
            return self.counter

    if with_reward:
        CounterEnvironment.get_reward = lambda self: float(self.counter)
    return CounterEnvironment


def first_call_steps(history) -> dict:
    return next(entry for entry in history if "tools/call_frequency" in entry)


def length_reward(completions, **kwargs):
    return [float(len(c[-1]["content"])) for c in completions]


def turns_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


SCENARIO_ARGS = dict(max_steps=2, num_generations=3, per_device_train_batch_size=6, learning_rate=0.1)


@pytest.mark.parametrize("tool", [multiply, async_multiply], ids=["sync", "async"])
def test_trl_scenario_tools(tool, tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """TRL's test_train_with_tools with anchors: of a group's draws one calls the tool right, one with a wrong argument
    name (a failure), one calls none."""
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), tools=[tool],
                                 reward_funcs=length_reward, **SCENARIO_ARGS)
    PerRow(tool_tokenizer, trainer, [tool_call(tool.__name__, a=3, b=4), tool_call(tool.__name__, a=3, c=4),
                                     "I don't know any tool</s>"]).install(monkeypatch)
    history = trains(trainer)
    assert logged(trainer, "armor/anchor_same_call") == [1.0, 0.0]
    assert first_call_steps(history)["tools/call_frequency"] == pytest.approx(2 / 3)
    assert first_call_steps(history)["tools/failure_frequency"] == pytest.approx(1 / 2)


def test_trl_scenario_environment_factory(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """TRL's test_train_with_environment_factory with anchors: increment, an unknown tool (a failure), no call."""
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), tools=(),
                                 environment_factory=counter_class(), reward_funcs=length_reward, **SCENARIO_ARGS)
    PerRow(tool_tokenizer, trainer, [tool_call("increment", step=1), tool_call("decrement", step=2),
                                     "I won't increment</s>"]).install(monkeypatch)
    history = trains(trainer)
    assert first_call_steps(history)["tools/call_frequency"] == pytest.approx(2 / 3)
    assert first_call_steps(history)["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert [env.counter for env in trainer.environments[:3]] == [1, 0, 0]


def test_trl_scenario_multiple_environments(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """TRL's test_train_with_multiple_environments with anchors: each row's tool call dispatches to its environment."""
    increments, shouts = [], []

    class EchoEnvironment:
        def reset(self, **kwargs):
            return "Echo."

        def shout(self, text: str) -> str:
            """
            Shout the given text.

            Args:
                text: Text to shout.

            Returns:
                The text in upper case.
            """
            shouts.append(text)
            return text.upper()

    data = Dataset.from_dict({"environment": ["counter", "echo"] * 8})
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, data, tools=(), reward_funcs=turns_reward,
                                 environment_factory={"counter": counter_class(increments, observation="Count."),
                                                      "echo": EchoEnvironment},
                                 shuffle_dataset=False, **{**SCENARIO_ARGS, "num_generations": 2,
                                                           "per_device_train_batch_size": 4})

    def first_turns(text, place):  # per group: one call of its environment's tool, one answer without
        if place % 2:
            return "Done!</s>"
        return tool_call("increment", step=1) if "Count." in text else tool_call("shout", text="hi")

    PerRow(tool_tokenizer, trainer, first_turns).install(monkeypatch)
    trains(trainer)
    assert increments and shouts


@pytest.mark.parametrize("with_funcs", [False, True], ids=["owned", "beside_reward_funcs"])
def test_trl_scenario_environment_owned_reward(with_funcs, tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """TRL's test_train_with_environment_owned_reward and ..._coexists_with_reward_funcs with anchors."""
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), tools=(),
                                 environment_factory=counter_class(with_reward=True),
                                 reward_funcs=length_reward if with_funcs else None, **SCENARIO_ARGS)
    assert trainer.reward_func_names == (["length_reward"] if with_funcs else []) + ["CounterEnvironment"]
    PerRow(tool_tokenizer, trainer, [tool_call("increment", step=1), tool_call("decrement", step=2),
                                     "I won't increment</s>"]).install(monkeypatch)
    trains(trainer)
    assert logged(trainer, "rewards/CounterEnvironment/mean")


def test_trl_scenario_environment_owned_reward_mixed_environments(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """TRL's test_environment_owned_reward_mixed_environments with anchors: the reward applies to its environment's
    rows only, and called directly with ``environments=[...]`` it answers None for the others."""
    plain = counter_class()
    scored = counter_class(with_reward=True)
    data = chat_numbers(range(8)).add_column("environment", ["scored", "plain"] * 4)
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, data, tools=(), reward_funcs=length_reward,
                                 environment_factory={"scored": scored, "plain": plain}, **SCENARIO_ARGS)
    PerRow(tool_tokenizer, trainer, [tool_call("increment", step=2), "no</s>", tool_call("increment", step=1)]).install(
        monkeypatch)
    trains(trainer)
    a, b = scored(), plain()
    a.reset()
    b.reset()
    assert trainer.reward_funcs[-1](environments=[a, b]) == [0.0, None]


def test_trl_scenario_environment_owned_data(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """TRL's test_train_with_environment_owned_data with anchors: no dataset, reset supplies the prompt."""
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, None, tools=(),
                                 environment_factory=counter_class(observation="Count to 3."),
                                 reward_funcs=length_reward, **SCENARIO_ARGS)
    PerRow(tool_tokenizer, trainer, [tool_call("increment", step=3), "3</s>", "ok</s>"]).install(monkeypatch)
    trains(trainer)


def test_trl_scenario_malformed_tool_calls(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """TRL's test_train_with_malformed_tool_calls with anchors: calls TRL cannot parse run no tool."""
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)),
                                 reward_funcs=length_reward, **SCENARIO_ARGS)
    fake = PerRow(tool_tokenizer, trainer, ['<tool_call>{"arguments": {"a": 3}}</tool_call></s>',
                                            "<tool_call>{arguments: {a: 3}}</tool_call></s>", "plain</s>"])
    fake.install(monkeypatch)
    trains(trainer)
    assert logged(trainer, "tools/call_frequency") == [0.0, 0.0]
    assert not any("\nt:" in text for _, texts in fake.calls for text in texts)


# --- 1. equal generation calls over processes (one process here; two real ones: tests/test_multiprocess_agent.py) ------
def test_a_finished_loop_joins_the_other_processes_turns_with_throwaway_turns(tool_model, tool_tokenizer, tmp_path,
                                                                             monkeypatch):
    """Generation calls made collective (as under ZeRO-3), and another process simulated that needs two more turns
    than this one in every loop: after each of its loops this process makes two throw-away one-row turns, each through
    the model its loop generated with (π_ref for the candidates' loops), then goes on."""
    from armor_trl.integration import trl_generation
    from armor_trl.rollout import tool_turns

    monkeypatch.setattr(trl_generation, "generation_is_collective", lambda trainer: True)
    asked = Counter()

    def most_rows(agreement, rows):
        if rows:
            return rows
        asked[id(agreement)] += 1
        return int(asked[id(agreement)] <= 2)  # the other process: two more turns (of one row) after this one's last

    monkeypatch.setattr(tool_turns.TurnAgreement, "_most_rows", most_rows)
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), anchor_same_call=False)
    with_tool = multiply_turn()
    fake = ToolFake(tool_tokenizer, trainer, reference_turn=lambda text: with_tool(text) if "u:" in text else "</s>")
    fake.install(monkeypatch)
    batches = capture_rounds(trainer)
    trainer.train()
    loops = len(asked)
    assert loops == 2 * 2 and trainer._armor_throwaway_turns == 2 * loops  # per round: the policy's, the candidates'
    throwaway = [(is_reference, texts) for is_reference, texts in fake.calls if len(texts) == 1]
    assert len(throwaway) == 2 * loops
    assert [is_reference for is_reference, _ in throwaway] == [False, False, True, True] * 2
    assert all("u:" not in texts[0] for _, texts in throwaway)  # one token of a prompt, not a row's question
    for batch in batches:  # the rounds are what they are without the other process
        assert len(anchor_rows(batch)) == 2


def test_a_throwaway_turn_decodes_one_token(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """On the transformers path (ZeRO-3, FSDP: every process decodes in lockstep until all are done) a throw-away
    turn decodes one token, counted at the real model's ``generate``; training's settings are back afterwards."""
    from transformers import LlamaForCausalLM

    from armor_trl.integration import trl_generation

    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)))
    decoded, generate = [], LlamaForCausalLM.generate

    def counted(model, input_ids=None, **kwargs):
        output = generate(model, input_ids=input_ids, **kwargs)
        decoded.append(output.size(1) - input_ids.size(1))
        return output

    monkeypatch.setattr(LlamaForCausalLM, "generate", counted)
    config = trainer.generation_config
    for seed in range(3):
        torch.manual_seed(seed)
        trl_generation.throwaway_turn(trainer, tool_tokenizer("u:5*3?")["input_ids"][:1])
    assert decoded == [1, 1, 1]
    assert trainer.generation_config is config and config.max_new_tokens == trainer.max_completion_length
