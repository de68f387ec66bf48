"""The features a user switches, combined pairwise (a covering array), each combination trained for a few steps through
a deterministic generator, with invariants (docs/anchors.md, "Which features combine"):

* it trains, or it is refused at construction with an error that names both features of the refused pair;
* every reward function call sees every field TRL gives it (the dataset's columns, a rollout_func's extra fields),
  each row its own;
* where docs/algorithm.md says so, the kept groups, their anchors and advantages, the gate's decisions, the loss and
  its gradient norm equal the paper's path (every group looks, K candidates at once: ``anchor_eligible_only=False``,
  ``anchor_sampling="eager"``) under the same other settings;
* at every loss, the π_ref log-probs the batch carries are those of the π_ref the trainer holds;
* a run stopped after its first rollout batch and resumed from its checkpoint continues exactly (the same rows, loss
  and gradient at the last step).

The generator is faked at the model (``generate`` and ``generate_batch``, so TRL's transformers and continuous-batching
paths, a rollout_func through ``generate_completions``, π_ref's full model or LoRA adapter all run as they do): every
completion is a fixed function of the prompt, whether π_ref or the policy drew it, the draw's index and the round.
Two processes are simulated as tests/test_anchor_waves.py does: the collective counts of anchor sampling
(``agreed_count``) see another process with two more groups to draw in every call, so this one pads its calls. The
distributed engine is no factor here; real launches hold FSDP2 where it meets resets, the LoRA reference, anchors from
the cache and tools (tests/test_multiprocess.py, tests/test_multiprocess_agent.py: the tests docs/anchors.md names,
whose existence the last test here checks).

Size: 14 features (dynamic sampling and its keep rule, anchor_filter, eager/lazy, eligible-only, the anchor source:
online / cache / column, same-call resets, LoRA reference, the generation path: generate / rollout_func / continuous
batching, VLM prompts, two processes, resume, the 8 loss types, ARMOR + KL, an agent: none / tools /
environment_factory); the greedy covering array below has 41 combinations (checked to cover every allowed pair),
7 of them refusals. Each trains 2 steps (6 with two steps per rollout batch), plus the paper's path where it differs
(30) and a resumed run where asked for (10): 74 short runs (docs/anchors.md, "Which features combine", holds the
table of pairs and the time).

An agent's generator (``tools`` or ``environment_factory``) calls ``add(n, n + 1)`` in every draw's first turn and gives
the draw's answer after the tool's result, so which draws are right is the same as without one.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from datasets import Dataset
from PIL import Image

from armor_trl import ArmorConfig, ArmorGRPOTrainer, generate_completions
from armor_trl.app.tool_testbed import add
from armor_trl.reference.policy import REF_ADAPTER
from armor_trl.rollout import anchor_rollout, anchor_waves
from testing import capture_rounds, cpu_args, kept_rows, logged, reference_logps_gaps, tool_call

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental in TRL

# --- the features and their levels ------------------------------------------------------------------------------------
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo", "cispo", "vespo")
FEATURES = {
    "dynamic": ("off", "on", "keep_unsolved"),  # dynamic sampling and its keep rule
    "filter": ("drop", "keep"),  # anchor_filter
    "sampling": ("eager", "lazy"),  # anchor_sampling
    "eligible": ("on", "off"),  # anchor_eligible_only
    "source": ("online", "cache", "column"),  # anchors sampled, from the anchor cache, from a dataset column
    # π_ref reset after every step, candidates in the policy's call; "resets_in_rollout": two optimizer steps per
    # rollout batch (steps_per_generation=2), so the schedule's resets fall inside a batch and act at its end
    "same_call": ("off", "resets", "resets_in_rollout"),
    "reference": ("full", "lora"),
    "path": ("generate", "rollout_func", "continuous_batching"),
    "prompts": ("text", "vlm"),
    "processes": ("one", "two"),
    "resume": ("no", "yes"),
    "loss": LOSS_TYPES,
    "kl": ("off", "on"),  # ARMOR + KL: beta = 0 or 0.05
    "agent": ("none", "tools", "environment"),  # TRL's tool loop: tools=[add], or environment_factory (its add)
}
NAMES = tuple(FEATURES)
# refused at construction, the error naming both features (these words, one of each side's, in the message)
REFUSED = {
    (("prompts", "vlm"), ("source", "cache")): ("vision-language", "anchor_cache"),
    (("path", "continuous_batching"), ("prompts", "vlm")): ("continuous_batching", "multimodal"),
    (("agent", "tools"), ("path", "rollout_func")): ("tools", "rollout_func"),
    (("agent", "environment"), ("path", "rollout_func")): ("environment_factory", "rollout_func"),
    (("agent", "environment"), ("source", "cache")): ("anchor_cache", "environment_factory"),
    (("agent", "environment"), ("source", "column")): ("anchor_source='column'", "environment_factory"),
    (("agent", "environment"), ("prompts", "vlm")): ("environment_factory", "vision-language"),
}
# combined nowhere (docs/anchors.md says why): a rollout_func for a VLM would have to generate with the images itself
EXCLUDED = {(("path", "rollout_func"), ("prompts", "vlm"))}


def pairs_of(row: dict) -> set:
    return {tuple(sorted([(a, row[a]), (b, row[b])])) for a, b in itertools.combinations(NAMES, 2)}


def covering_array() -> list[dict]:
    """Rows that hold every allowed pair of levels at least once, in rows holding no refused or excluded pair, plus one
    row per refused pair (greedy, deterministic: each new row takes, feature by feature, the level that covers most
    pairs still missing, starting from the first missing pair)."""
    banned = set(REFUSED) | EXCLUDED
    missing = {tuple(sorted([(a, x), (b, y)])) for a, b in itertools.combinations(NAMES, 2)
               for x in FEATURES[a] for y in FEATURES[b]} - banned
    rows = []
    while missing:
        (a, x), (b, y) = min(missing)
        row = {a: x, b: y}
        for name in sorted(NAMES, key=lambda n: -len(FEATURES[n])):
            if name in row:
                continue
            best, gain = None, -1
            for level in FEATURES[name]:
                trial = {**row, name: level}
                if any(all(trial.get(f) == v for f, v in pair) for pair in banned):
                    continue
                covered = sum(1 for pair in missing if all(trial.get(f) == v for f, v in pair) and
                              any(f == name for f, _ in pair))
                if covered > gain:
                    best, gain = level, covered
            row[name] = best
        rows.append({name: row[name] for name in NAMES})
        missing -= pairs_of(rows[-1])
    base = {**rows[0], "path": "generate", "source": "online", "prompts": "text", "agent": "none"}
    for (a, x), (b, y) in sorted(REFUSED):  # (each with its refused pair alone)
        rows.append({**base, a: x, b: y})
    return rows


ROWS = covering_array()


def row_id(row: dict) -> str:
    return "-".join(str(row[name]) for name in NAMES)


def refusal_of(row: dict):
    return next((words for pair, words in REFUSED.items() if all(row[f] == v for f, v in pair)), None)


def test_the_matrix_covers_every_allowed_pair_and_tests_each_refusal():
    covered = set().union(*(pairs_of(row) for row in ROWS if refusal_of(row) is None))
    allowed = {tuple(sorted([(a, x), (b, y)])) for a, b in itertools.combinations(NAMES, 2)
               for x in FEATURES[a] for y in FEATURES[b]} - set(REFUSED) - EXCLUDED
    assert allowed <= covered
    assert not any(pair <= set(row.items()) for row in ROWS for pair in map(set, EXCLUDED))
    assert {tuple(pair) for row in ROWS for pair in REFUSED if set(pair) <= set(row.items())} == set(REFUSED)
    assert sum(refusal_of(row) is None for row in ROWS) <= 35  # trained rows: minutes, not hours (a refusal only builds)


# --- a deterministic generator, at the model ---------------------------------------------------------------------------
G, K = 4, 4  # num_generations (cpu_args), anchor_num_samples (ArmorConfig's default)


class ModelFake:
    """Completions as fixed functions of (prompt n, who draws: π_ref or the policy, the draw's index j, the optimizer
    step and the round within it). The index of a draw counts the earlier generate calls of this round that held the
    prompt plus its place among the call's rows of that prompt: the j-th candidate of a group is the same whether it
    was drawn with all K at once or in waves, padded for another process or not.

    Policy: by c = (n + step + round) % 3 a group is all correct (0), all wrong (1), or mixed (2: even j correct).
    π_ref: the j-th draw is verified (holds a digit) iff j >= n % 5 (never for n % 5 == 4, K = 4). A same-call round's
    candidates (the last K of the G − 1 + K rows of a prompt in the policy's call) are π_ref's draws (π_ref holds the
    policy's weights): they follow π_ref's rule, so the same candidates come in every round until the next reset."""

    def __init__(self, tokenizer, trainer, tools: bool = False):
        self.tokenizer, self.trainer, self.tools = tokenizer, trainer, tools
        self.digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
        self.letters = tokenizer.convert_tokens_to_ids(list("abcxyz"))
        self.calls: dict = {}
        self.step, self.round = None, 0

    def start_round(self):
        step = self.trainer.state.global_step
        self.round = self.round + 1 if step == self.step else 0
        self.step, self.calls = step, {}

    def is_reference(self, model) -> bool:
        reference = self.trainer.reference
        if reference.kind == "full":
            return model is reference.model
        return self.trainer.model.active_adapter == REF_ADAPTER

    def completions(self, model, prompts: list[list[int]]) -> list[list[int]]:
        """One list of token ids per prompt; with an agent (``tools``: a tool call first, the draw's answer after the
        tool's result) each ends in eos and is padded to the call's widest."""
        reference = self.is_reference(model)
        per_prompt = Counter(map(tuple, prompts))
        same_call = not reference and set(per_prompt.values()) == {G - 1 + K}
        seen: dict = {}
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            n = int(re.search(r"(\d+)\+", text).group(1))
            key = (reference, tuple(ids))
            j = self.calls.get(key, 0) + seen.get(key, 0)
            seen[key] = seen.get(key, 0) + 1
            if same_call and j >= G - 1:  # a candidate: π_ref's (j − G + 1)-th draw
                reference, j = True, j - G + 1
            if reference:
                first = self.digits[j % 10] if j >= n % 5 else self.letters[j % 6]
                out.append([first, self.letters[(n + j) % 6], self.letters[j % 6]])
            else:
                kind = (n + self.step + self.round) % 3
                correct = kind == 0 or (kind == 2 and j % 2 == 0)
                token = self.digits[(n + self.step) % 10] if correct else self.letters[(n + j) % 6]
                out.append([token, self.letters[(j + self.round) % 6], self.letters[n % 6]])
            if self.tools:  # every draw calls add(n, n + 1) first; after its result, the draw's answer
                turn = tool_call("add", a=n, b=n + 1) if "\nt:" not in text else self.tokenizer.decode(out[-1]) + "</s>"
                out[-1] = self.tokenizer(turn, add_special_tokens=False)["input_ids"]
            reference = self.is_reference(model)
        for key in seen:
            self.calls[key] = self.calls.get(key, 0) + 1
        width = max(map(len, out))
        return [ids + [self.tokenizer.pad_token_id] * (width - len(ids)) for ids in out]

    def install(self, monkeypatch, model_class):
        fake = self

        def generate(model, input_ids=None, attention_mask=None, **kwargs):
            model.get_input_embeddings()(input_ids[:, :1])  # the model ran (what ARMOR checks of a rollout_func)
            prompts = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
            return torch.cat([input_ids, torch.tensor(fake.completions(model, prompts))], dim=1)

        def generate_batch(model, inputs, **kwargs):
            model.get_input_embeddings()(torch.tensor([inputs[0][:1]]))
            pad = fake.tokenizer.pad_token_id
            return {f"req_{i}": SimpleNamespace(generated_tokens=[t for t in ids if t != pad])
                    for i, ids in enumerate(fake.completions(model, [list(ids) for ids in inputs]))}

        monkeypatch.setattr(model_class, "generate", generate)
        monkeypatch.setattr(model_class, "generate_batch", generate_batch)
        score_round = self.trainer._score_round
        self.trainer._score_round = lambda inputs: self.start_round() or score_round(inputs)


# --- the pieces of a run -----------------------------------------------------------------------------------------------
def has_digit(completion) -> float:
    text = completion if isinstance(completion, str) else completion[-1]["content"]
    return float(any(ch.isdigit() for ch in text))


def fields_checked_reward(expected: set, calls: list):
    """has_digit (from the row's env_score where a rollout_func gave one), after checking that the call carries every
    field TRL gives a reward function and that each row's env_score is its own completion's."""

    def reward(prompts, completions, completion_ids, **kwargs):
        missing = expected - set(kwargs)
        assert not missing, f"a reward call lacks the fields {sorted(missing)}"
        scores = kwargs.get("env_score", [None] * len(completions))
        for score, completion in zip(scores, completions):
            assert score is None or score == has_digit(completion), "a row got another row's env_score"
        calls.append(len(completions))
        return [has_digit(c) if s is None else s for s, c in zip(scores, completions)]

    return reward


def env_rollout(tokenizer):
    def rollout_func(prompts, trainer):
        prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
        completion_ids = generate_completions(trainer, prompt_ids)
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None,
                "env_score": [has_digit(text) for text in texts]}

    return rollout_func


def numbers_for(row: dict) -> range:
    """Six distinct prompts, visited again across rounds (the cache's rotation); never twice in one round, where which
    group's draw is which would be arbitrary. Eight with two steps per rollout batch (four prompts each): an epoch of
    two rollout batches, so the checkpoint after the first is inside an epoch (a resume at an epoch's end replays the
    previous epoch's prompt order, in TRL's GRPOTrainer too)."""
    return range(8 if row["same_call"] == "resets_in_rollout" else 6)


def dataset_for(row: dict) -> Dataset:
    rows = []
    for n in numbers_for(row):
        item = {"prompt": f"{n}+{n + 1}=", "answer": str(2 * n + 1)}
        if row["prompts"] == "vlm" or row["agent"] != "none":  # TRL's tool loop takes chat prompts
            item["prompt"] = [{"role": "user", "content": item["prompt"]}]
        if row["prompts"] == "vlm":
            item["image"] = image_of(n)
        if row["source"] == "column":
            item["anchors"] = [str(2 * n + 1)]
        rows.append(item)
    return Dataset.from_list(rows)


def settings(row: dict, paper: bool = False) -> dict:
    fields = dict(max_steps=2, anchor_fail_after_rounds=0, anchor_reward_threshold=1.0, loss_type=row["loss"],
                  anchor_filter=row["filter"], anchor_sampling="eager" if paper else row["sampling"],
                  anchor_eligible_only=False if paper else row["eligible"] == "on",
                  anchor_same_call=row["same_call"] == "resets", dynamic_sampling=row["dynamic"] != "off",
                  dynamic_sampling_keep_unsolved=row["dynamic"] == "keep_unsolved")
    if row["kl"] == "on":
        fields["beta"] = 0.05
    if row["same_call"] != "off":
        fields["ref_reset_steps"] = 1
    if row["same_call"] == "resets_in_rollout":  # three rollout batches of two optimizer steps
        fields.update(steps_per_generation=2, max_steps=6)
    if row["source"] == "cache":
        fields.update(anchor_cache=True, anchor_cache_per_prompt=2)
    elif row["source"] == "column":
        fields["anchor_source"] = "column"
    if row["path"] == "continuous_batching":
        fields.update(use_transformers_continuous_batching=True, transformers_continuous_batching_config={
            "num_blocks": 32, "max_batch_tokens": 128, "page_size": 16})
    if row["resume"] == "yes":  # a checkpoint at the end of the first rollout batch
        fields.update(save_strategy="steps", save_steps=fields.get("steps_per_generation", 1))
    if row["agent"] != "none":  # a tool call, its result and the answer
        fields["max_completion_length"] = 96
    return fields


class AddEnvironment:
    """environment_factory's environment: reset with the row (nothing to show), its method ``add`` (the tool testbed's)
    a tool."""

    add = staticmethod(add)

    def reset(self, **kwargs):
        self.row = kwargs


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from armor_trl.app.tiny import build_tiny_vlm, build_tiny_vlm_processor

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm")), build_tiny_vlm_processor()


@pytest.fixture(scope="module")
def tool_vlm(tmp_path_factory):
    from armor_trl.app.tiny import build_tiny_vlm, build_tiny_vlm_processor

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-tool-vlm"), tools=True), build_tiny_vlm_processor(tools=True)


def model_of(row, request):
    """(model path, processing class) of ``row``: the tiny text model or VLM, with the tool-calling chat template for
    an agent."""
    text, vlm = ("tiny_model_path", "tiny_tokenizer"), ("vlm",)
    if row["agent"] != "none":
        text, vlm = ("tool_model", "tool_tokenizer"), ("tool_vlm",)
    names = text if row["prompts"] == "text" else vlm
    values = [request.getfixturevalue(name) for name in names]
    return tuple(values) if len(values) == 2 else values[0]


def build(row, output_dir, model_path, processing_class, paper=False):
    """The trainer of ``row`` with its reward-call log: (trainer, reward calls)."""
    from peft import LoraConfig

    data = dataset_for(row)
    expected = set(data.column_names) - {"prompt"} | {"trainer_state", "log_extra", "log_metric"}
    if row["path"] == "rollout_func":
        expected.add("env_score")
    if row["agent"] == "environment":
        expected.add("environments")
    calls = []
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    trainer = ArmorGRPOTrainer(
        model=model_path, reward_funcs=fields_checked_reward(expected, calls),
        args=ArmorConfig(output_dir=str(output_dir), **cpu_args(**settings(row, paper))), train_dataset=data,
        processing_class=processing_class,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]) if row["reference"] == "lora" else None,
        rollout_func=env_rollout(tokenizer) if row["path"] == "rollout_func" else None,
        tools=[add] if row["agent"] == "tools" else None,
        environment_factory=AddEnvironment if row["agent"] == "environment" else None)
    return trainer, calls


def image_of(n: int) -> Image.Image:
    """Prompt n's image: one colour (n·8), 56 or 84 pixels wide (rows of different lengths)."""
    return Image.fromarray(np.full((56, 84 if n % 2 else 56, 3), n * 8, dtype=np.uint8))


def check_rows_keep_their_images(batch, processor) -> None:
    """Each row's pixels (and grid) in a VLM batch are its own prompt's image, processed."""
    texts = processor.tokenizer.batch_decode(batch["prompt_ids"], skip_special_tokens=True)
    grids = batch["image_grid_thw"]
    for text, pixels, grid in zip(texts, torch.split(batch["pixel_values"], grids.prod(-1).tolist()), grids):
        expected = processor.image_processor(images=[image_of(int(re.search(r"(\d+)\+", text).group(1)))],
                                             return_tensors="pt")
        assert torch.equal(grid.cpu(), expected["image_grid_thw"][0]), text
        assert torch.equal(pixels.cpu(), expected["pixel_values"]), text


def check_tool_results_are_masked(batch, tokenizer, column: bool) -> None:
    """Every row of an agent's batch, anchors included, is a tool call, add's result for its own prompt (masked out
    of the loss: tool_mask 0) and an answer (the model's: tool_mask 1); an anchor from the dataset column, written
    before any loop ran, is one model turn, its answer (every token the model's)."""
    for i in torch.nonzero(batch["completion_mask"].sum(dim=1) > 0).flatten().tolist():
        n = int(re.search(r"(\d+)\+", tokenizer.decode(batch["prompt_ids"][i], skip_special_tokens=True)).group(1))
        ids = batch["completion_ids"][i][batch["completion_mask"][i].bool()]
        tool = batch["tool_mask"][i][: len(ids)].bool()
        if column and batch["armor_is_anchor"][i] and tool.all():  # (a same-call round's anchor ran the loop)
            assert tokenizer.decode(ids, skip_special_tokens=True) == str(2 * n + 1)
            continue
        assert tokenizer.decode(ids[~tool]) == f"\nt:{2 * n + 1}\na:", (i, tokenizer.decode(ids))
        assert tokenizer.decode(ids[tool]).startswith(tool_call("add", a=n, b=n + 1)), (i, tokenizer.decode(ids))


def first_difference(rows: list, expected: list):
    """Where two lists of kept rows first differ, for the assertion's message."""
    index = next((i for i, (a, b) in enumerate(zip(rows, expected)) if a != b), min(len(rows), len(expected)))
    return index, rows[index : index + 1], expected[index : index + 1], len(rows), len(expected)


GATES = ("armor/groups_kept_frac", "armor/dropped_all_correct_frac", "armor/dropped_all_wrong_frac",
         "armor/dropped_no_anchor_frac", "armor/generation_rounds", "armor/batch_short_groups")


def train(row, output_dir, model_path, processing_class, monkeypatch, paper=False, resume_from=None):
    """Train ``row`` through the fake generator: (trainer, the batches in the loss, reward calls)."""
    trainer, calls = build(row, output_dir, model_path, processing_class, paper)
    policy = trainer.unwrapped_policy()
    base = policy.get_base_model() if row["reference"] == "lora" else policy
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    ModelFake(tokenizer, trainer, tools=row["agent"] != "none").install(monkeypatch, type(base))
    if row["processes"] == "two":  # the other process has two more groups to draw in every collective call
        for module in (anchor_waves, anchor_rollout):
            monkeypatch.setattr(module, "agreed_count", lambda trainer, local: local + 2)
    batches, gaps = capture_rounds(trainer), reference_logps_gaps(trainer)
    trainer.train(resume_from_checkpoint=resume_from)
    assert all(gap < 1e-5 for _, gap in gaps), gaps  # π_ref's log-probs at every loss: the π_ref the trainer holds
    for batch in batches:
        if row["prompts"] == "vlm":
            check_rows_keep_their_images(batch, processing_class)
        if row["agent"] != "none":
            check_tool_results_are_masked(batch, tokenizer, column=row["source"] == "column")
    return trainer, batches, calls


def by_step(trainer, key) -> dict:
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h}


@pytest.mark.parametrize("row", ROWS, ids=[row_id(row) for row in ROWS])
def test_feature_pairs(row, request, tmp_path, monkeypatch):
    model_path, processing_class = model_of(row, request)
    words = refusal_of(row)
    if words is not None:  # refused at construction, naming both features
        with pytest.raises(ValueError) as refused:
            build(row, tmp_path / "refused", model_path, processing_class)
        message = str(refused.value)
        assert all(word in message for word in words), message
        return

    trainer, batches, calls = train(row, tmp_path / "run", model_path, processing_class, monkeypatch)
    steps = settings(row)["max_steps"]
    assert trainer.state.global_step == steps and len(logged(trainer, "loss")) == steps
    assert calls, "no reward function was called"

    if (row["eligible"], row["sampling"]) != ("off", "eager"):  # the paper's path under the same other settings
        paper, paper_batches, _ = train(row, tmp_path / "paper", model_path, processing_class, monkeypatch,
                                        paper=True)
        assert len(batches) == len(paper_batches)
        for step, (got, expected) in enumerate(zip(batches, paper_batches)):
            assert kept_rows(got) == kept_rows(expected), (step, first_difference(kept_rows(got), kept_rows(expected)))
        for key in GATES + ("loss", "grad_norm"):
            assert logged(trainer, key) == pytest.approx(logged(paper, key), abs=1e-5), key

    if row["resume"] == "yes":  # stopped after the first rollout batch: that checkpoint alone, resumed
        cut, checkpoint = tmp_path / "cut", f"checkpoint-{settings(row)['save_steps']}"
        shutil.copytree(tmp_path / "run" / checkpoint, cut / checkpoint)
        resumed, resumed_batches, _ = train(row, cut, model_path, processing_class, monkeypatch,
                                            resume_from=str(cut / checkpoint))
        assert resumed.state.global_step == steps
        assert kept_rows(resumed_batches[-1]) == kept_rows(batches[-1])
        for key in ("loss", "grad_norm"):
            assert by_step(resumed, key)[steps] == pytest.approx(by_step(trainer, key)[steps], abs=1e-6), key


def test_the_support_table_states_what_the_matrix_runs():
    from testing import REPO

    text = (REPO / "docs" / "anchors.md").read_text()
    section = text[text.index("## Which features combine"):]
    trained = [row for row in ROWS if refusal_of(row) is None]
    paper = sum((row["eligible"], row["sampling"]) != ("off", "eager") for row in trained)
    resumed = sum(row["resume"] == "yes" for row in trained)
    assert f"{len(ROWS)} combinations" in section and f"{len(ROWS) + 4} test items" in section  # (and the four checks here)
    assert f"({paper} of them)" in section and f"resumed ({resumed})" in section
    assert f"{len(trained) + paper + resumed} short runs" in section
    assert all(f"`{loss}`" in section for loss in LOSS_TYPES)
    for (a, x), (b, y) in [*REFUSED, *EXCLUDED]:  # each pair left out of the trained combinations has its row
        words = {"prompts": "VLM prompts", "source": {"cache": "`anchor_cache`", "column": '`anchor_source="column"`'},
                 "path": {"continuous_batching": "continuous batching", "rollout_func": "`rollout_func`"},
                 "agent": {"tools": "`tools`", "environment": "`environment_factory`"}}
        first = words[a] if isinstance(words[a], str) else words[a][x]
        second = words[b] if isinstance(words[b], str) else words[b][y]
        assert any(line.startswith("|") and first in line and second in line for line in section.splitlines()), (a, b)


def test_the_agent_feature_meets_several_processes():
    """In the matrix the agent meets two (simulated) processes; real ones, DDP and ZeRO-3 with different turn counts
    per process, run in tests/test_multiprocess_agent.py, which the table's processes row names."""
    from testing import REPO

    assert {row["agent"] for row in ROWS if row["processes"] == "two" and refusal_of(row) is None} >= {"tools",
                                                                                                        "environment"}
    multiprocess = (REPO / "tests" / "test_multiprocess_agent.py").read_text()
    assert "def test_zero3_agent_with_unequal_turn_counts_trains_with_anchors" in multiprocess
    assert "def test_ddp_agent_with_unequal_turn_counts_trains_with_anchors" in multiprocess
    text = (REPO / "docs" / "anchors.md").read_text()
    row = next(line for line in text[text.index("## Which features combine"):].splitlines()
               if line.startswith("| processes |"))
    assert "test_multiprocess_agent.py" in row and "DDP" in row and "ZeRO-3" in row


FSDP2_LAUNCHES = {  # FSDP2 where it meets the matrix's features: the real launches (docs/anchors.md) and their switches
    "test_multiprocess.py": {"test_fsdp2": "check_run(", "test_fsdp2_lora": "reset_at=LORA_RESET_AT",
                             "test_fsdp2_lora_resume_matches_uninterrupted": "*LORA"},
    "test_multiprocess_agent.py": {
        "test_fsdp2_agent_with_unequal_turn_counts_and_anchor_cache_trains_like_ddp": '"--anchor_cache"'},
}


def test_fsdp2_meets_resets_lora_cache_and_tools_in_real_launches():
    """The section names the two-process FSDP2 tests that stand for FSDP2 as a level of the distributed engine; each
    exists in its module and passes the switch it is named for."""
    from testing import REPO

    section = (REPO / "docs" / "anchors.md").read_text()
    section = section[section.index("## Which features combine"):]
    for module, tests in FSDP2_LAUNCHES.items():
        source = (REPO / "tests" / module).read_text()
        for name, switch in tests.items():
            assert f"`{name}`" in section, name
            body = source[source.index(f"def {name}("):].split("\n@pytest")[0]  # up to the next test
            assert switch in body, (name, switch)
