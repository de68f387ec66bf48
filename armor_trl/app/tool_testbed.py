"""A tiny tool-calling agent for the CPU: the character-level Llama of :mod:`armor_trl.app.tiny` (its tool-calling chat
template) warm-started, supervised, to solve the arithmetic task (``"3+5="``; ``digits`` per operand) by calling an exact
``add(a, b)`` tool through TRL's tool loop and answering with its result (docs/agents.md).

The warm start's conversations, per problem (shares set by :func:`build_tool_agent`'s arguments):

* the tool way: ``add(a, b)``, then the answer copied from the tool's result;
* a wrong tool name first (``wrong_name_share``): ``sum(a, b)``, which TRL answers with its error result (a tool
  failure), then ``add``, then the answer: so the agent's tool failures are real TRL failures;
* no tool (``direct_share``): the answer written at once, which a model this small gets right only sometimes;
* a timed-out call first (``retry_share``): ``add`` answered with TRL's error result for a tool that raised
  (``{'error': 'add timed out'}``), then ``add`` again, then the answer: the retry a flaky tool needs.

:func:`unreliable` wraps a tool so that a share of its calls raise (a tool that times out, as real tools do): TRL's loop
answers such a call with its error result and counts a failure. The tool-use testbed (configs/tool_use_testbed.yaml,
docs/evidence.md) trains on 1-digit problems, which the agent can answer without the tool, with an ``add`` that times out
on a share of calls, and validates on 2-digit problems, which only the tool solves.

The tools a recipe may name (``tools: [add]``) are :data:`TOOLS`; :func:`resolve_tools` also takes import paths.
``python -m armor_trl.app.tool_testbed <folder>`` writes the warm-started model and prints its calibration.
"""

from __future__ import annotations

import functools
import os
import random

from armor_trl.rewards.functions import import_callable


def add(a: int, b: int) -> int:
    """
    Adds two integers exactly.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum.
    """
    return a + b


TOOLS = {"add": add}  # the tools a recipe names (`tools: [add]`)
WRONG_TOOL = "sum"  # the name the warm start sometimes tries first: not a tool, so TRL's call fails
TIMEOUT = "{name} timed out"  # what an unreliable tool raises (TRL writes it into its error result)


def unreliable(tool, failure_rate: float, seed: int = 0):
    """``tool`` with a share ``failure_rate`` of its calls raising ``TimeoutError`` (drawn from its own generator,
    seeded ``seed``, so a run's failures repeat with its seed); same name, signature and docstring, so TRL builds
    the same schema."""
    if not 0.0 <= failure_rate < 1.0:
        raise ValueError(f"tool_failure_rate must lie in [0, 1), got {failure_rate!r}.")
    if failure_rate == 0.0:
        return tool
    rng = random.Random(f"{seed}-{tool.__name__}")

    @functools.wraps(tool)
    def flaky(*args, **kwargs):
        if rng.random() < failure_rate:
            raise TimeoutError(TIMEOUT.format(name=tool.__name__))
        return tool(*args, **kwargs)

    return flaky


def resolve_tools(names, failure_rate: float = 0.0, seed: int = 0) -> list:
    """The tool functions of ``names``: a name of :data:`TOOLS` or an import path ``pkg.mod:func``; with
    ``failure_rate`` > 0 each made :func:`unreliable` (seeded ``seed``)."""
    tools = []
    for name in names or []:
        if name in TOOLS:
            tools.append(TOOLS[name])
        elif ":" not in name:
            raise ValueError(f"Unknown tool {name!r}: expected one of {sorted(TOOLS)} or an import path "
                             "'pkg.module:function'.")
        else:
            tools.append(import_callable(name, *name.split(":", 1), "tool"))
    return [unreliable(tool, failure_rate, seed) for tool in tools]


WAYS = ("tool", "wrong_name", "direct", "retry")


def conversation(a: int, b: int, way: str) -> list[dict]:
    """The warm start's conversation for ``a+b=`` solved ``way`` (:data:`WAYS`): "tool", "wrong_name", "direct" or
    "retry" (a timed-out ``add`` first)."""
    if way not in WAYS:
        raise ValueError(f"Unknown way {way!r}: expected one of {list(WAYS)}.")

    def call(name):
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}]}

    answer = {"role": "assistant", "content": str(a + b)}
    messages = [{"role": "user", "content": f"{a}+{b}="}]
    if way == "wrong_name":
        messages += [call(WRONG_TOOL), {"role": "tool", "name": WRONG_TOOL,
                                        "content": str({"error": f"Tool {WRONG_TOOL} not found."})}]
    if way == "retry":
        messages += [call("add"), {"role": "tool", "name": "add",
                                   "content": str({"error": TIMEOUT.format(name="add")})}]
    if way in ("tool", "wrong_name", "retry"):
        messages += [call("add"), {"role": "tool", "name": "add", "content": str(a + b)}]
    return messages + [answer]


def supervised_example(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(token ids, labels) of a conversation as TRL's loop builds it: the prompt and the tool results are context
    (label -100), the assistant turns are learned, each up to and with its eos."""
    ids, labels = [], []
    previous = ""
    for end in range(1, len(messages) + 1):
        next_is_assistant = end < len(messages) and messages[end]["role"] == "assistant"
        text = tokenizer.apply_chat_template(messages[:end], tokenize=False, add_generation_prompt=next_is_assistant)
        if messages[end - 1]["role"] == "assistant":
            text = text[: text.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)]
        piece = text[len(previous):]
        piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
        ids += piece_ids
        labels += piece_ids if messages[end - 1]["role"] == "assistant" else [-100] * len(piece_ids)
        previous = text
    return ids, labels


def warm_start_examples(tokenizer, n: int, seed: int, digits: int | dict = 1, wrong_name_share: float = 0.2,
                        direct_share: float = 0.2, retry_share: float = 0.0,
                        exclude: set | None = None) -> list[tuple[list[int], list[int]]]:
    """``n`` supervised examples on random problems, each solved one of the ways (the rest of the shares: "tool").
    ``digits``: digits per operand, or ``{digits: weight}`` to draw them per problem; problems ``"a+b="`` in
    ``exclude`` (held-out ones) are never drawn."""
    if min(wrong_name_share, direct_share, retry_share) < 0 or wrong_name_share + direct_share + retry_share > 1:
        raise ValueError("the warm start's way shares (wrong_name, direct, retry) must be >= 0 and sum to at most 1, "
                         f"got {wrong_name_share}, {direct_share}, {retry_share}.")
    mix = digits if isinstance(digits, dict) else {digits: 1.0}
    rng = random.Random(seed)
    examples = []
    while len(examples) < n:
        d = rng.choices(list(mix), weights=list(mix.values()))[0]
        low, high = 10 ** (d - 1) if d > 1 else 0, 10**d - 1
        a, b = rng.randint(low, high), rng.randint(low, high)
        draw = rng.random()
        way = ("direct" if draw < direct_share else "wrong_name" if draw < direct_share + wrong_name_share
               else "retry" if draw < direct_share + wrong_name_share + retry_share else "tool")
        if exclude and f"{a}+{b}=" in exclude:
            continue
        examples.append(supervised_example(tokenizer, conversation(a, b, way)))
    return examples


def build_tool_agent(path: str | os.PathLike, steps: int = 800, seed: int = 0, hidden_size: int = 64,
                     num_layers: int = 2, batch_size: int = 32, learning_rate: float = 3e-3, digits: int | dict = 1,
                     wrong_name_share: float = 0.2, direct_share: float = 0.2, threads: int | None = 1,
                     retry_share: float = 0.0, exclude: set | None = None) -> str:
    """Write the warm-started tool agent to ``path`` (model and tool-calling tokenizer, ``save_pretrained``); return
    the path. ``steps`` supervised steps of ``batch_size`` conversations (fresh problems each step; ``digits``,
    the shares and ``exclude`` as :func:`warm_start_examples`), AdamW at ``learning_rate``, on ``threads`` torch
    threads (None: as set; a model this small trains fastest on one, and several spin against each other on a busy
    machine); deterministic for ``seed`` on one machine."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from armor_trl.app.tiny import build_tiny_model

    path = os.fspath(path)
    build_tiny_model(path, hidden_size=hidden_size, num_layers=num_layers, seed=seed, tools=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads or threads_before)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    examples = warm_start_examples(tokenizer, steps * batch_size, seed, digits, wrong_name_share, direct_share,
                                   retry_share, exclude)
    model.train()
    for step in range(steps):
        batch = examples[step * batch_size : (step + 1) * batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.set_num_threads(threads_before)
    model.eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write the warm-started tiny tool agent (docs/agents.md).")
    parser.add_argument("output", help="folder to write the model and its tokenizer to")
    parser.add_argument("--steps", type=int, default=800, help="supervised warm-start steps")
    parser.add_argument("--digits", type=int, default=1, help="digits per operand of the warm start's problems")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tool_agent(args.output, steps=args.steps, seed=args.seed, digits=args.digits))


if __name__ == "__main__":
    main()
