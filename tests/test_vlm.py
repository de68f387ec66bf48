"""ARMOR on a vision-language model (a tiny Qwen2-VL built locally): every row, on-policy or anchor, generated and
scored with its own prompt's image; π_ref's log-probs of each row equal a direct forward with its image; dynamic
sampling moves rows with their images; the drop-in identity and resume hold; what stays refused says why."""

import re

import numpy as np
import pytest
import torch
from datasets import Dataset
from PIL import Image
from transformers import GenerationMixin
from trl import GRPOConfig, GRPOTrainer

from armor_trl import ArmorConfig, ArmorGRPOTrainer
from armor_trl.app.tiny import build_tiny_vlm, build_tiny_vlm_processor
from testing import StopAt, capture_rounds, cpu_args, logged


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def processor():
    return build_tiny_vlm_processor()


def image_of(n: int) -> Image.Image:
    """Prompt n's image: one colour (n·8), 56 or 84 pixels wide (16 or 24 patches: rows differ in length)."""
    return Image.fromarray(np.full((56, 84 if n % 2 else 56, 3), n * 8, dtype=np.uint8))


@pytest.fixture
def image_dataset():
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"{n}+{n + 1}="}], "image": image_of(n)}
                              for n in range(16)])


def number_of(text: str) -> int:
    return int(re.search(r"(\d+)\+", text).group(1))


def prompt_text(prompt) -> str:
    content = prompt[-1]["content"]
    return content if isinstance(content, str) else next(part["text"] for part in content if part["type"] == "text")


def image_checked_reward(prompts, completions, image, **kwargs):
    """The share of digits, after checking that each row was scored with its own prompt's image."""
    for prompt, row_image in zip(prompts, image):
        n = number_of(prompt_text(prompt))
        if np.asarray(row_image)[0, 0, 0] != n * 8:
            raise AssertionError(f"prompt {n} scored with the image of {np.asarray(row_image)[0, 0, 0] // 8}")
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in texts]


def vlm_trainer(vlm_path, processor, dataset, output_dir, **overrides):
    fields = dict(anchor_reward_threshold=0.1, anchor_same_call=False)
    fields.update(overrides)
    return ArmorGRPOTrainer(model=vlm_path, reward_funcs=image_checked_reward,
                            args=ArmorConfig(output_dir=str(output_dir), **cpu_args(**fields)),
                            train_dataset=dataset, processing_class=processor)


def processed(processor, n: int) -> dict:
    return processor.image_processor(images=[image_of(n)], return_tensors="pt")


def rows_of_pixels(pixel_values, image_grid_thw, rows: int) -> list[torch.Tensor]:
    """pixel_values cut into rows (one image per row)."""
    assert image_grid_thw.size(0) == rows
    return list(torch.split(pixel_values, image_grid_thw.prod(-1).tolist()))


def check_rows_have_their_images(processor, input_ids, pixel_values, image_grid_thw):
    """Each row's pixels (and grid) are its prompt's image, processed."""
    texts = processor.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
    for text, pixels, grid in zip(texts, rows_of_pixels(pixel_values, image_grid_thw, len(texts)), image_grid_thw):
        expected = processed(processor, number_of(text))
        assert torch.equal(grid.cpu(), expected["image_grid_thw"][0]), text
        torch.testing.assert_close(pixels.cpu(), expected["pixel_values"], rtol=0, atol=0, msg=text)


def record_generate(monkeypatch):
    calls = []
    original = GenerationMixin.generate

    def recording(model, *args, **kwargs):
        calls.append((model, kwargs["input_ids"], kwargs.get("pixel_values"), kwargs.get("image_grid_thw")))
        return original(model, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", recording)
    return calls


@pytest.mark.parametrize("same_call", [False, True])
def test_every_row_is_generated_and_scored_with_its_own_prompts_image(same_call, vlm_path, processor, image_dataset,
                                                                      tmp_path, monkeypatch):
    calls = record_generate(monkeypatch)
    trainer = vlm_trainer(vlm_path, processor, image_dataset, tmp_path, max_steps=2, anchor_same_call=same_call)
    rounds = capture_rounds(trainer)
    trainer.train()  # (the reward function checks every scored row's image, candidates included)
    reference, policy = trainer.reference.model, trainer.unwrapped_policy()
    sizes = [(model is reference, len(ids)) for model, ids, _, _ in calls]
    # round 1 same-call: one policy call, 3 rows + 4 candidates per group; otherwise 3 policy rows, then 4 candidates
    # per group on π_ref
    expected = [(False, 14)] if same_call else [(False, 6), (True, 8)]
    assert sizes == expected + [(False, 6), (True, 8)]
    for model, input_ids, pixel_values, image_grid_thw in calls:
        assert model in (reference, policy) and pixel_values is not None
        check_rows_have_their_images(processor, input_ids, pixel_values, image_grid_thw)
    for output in rounds:  # the batch TRL trains on: each row with its own image
        assert output["armor_is_anchor"].any()
        check_rows_have_their_images(processor, output["prompt_ids"], output["pixel_values"], output["image_grid_thw"])
    assert logged(trainer, "armor/anchor_found_frac")


@pytest.mark.parametrize("use_anchors", [True, False])  # False: the mixed ratio alone needs π_ref's log-probs too
def test_reference_logps_of_every_row_equal_a_direct_forward_with_its_image(use_anchors, vlm_path, processor,
                                                                            image_dataset, tmp_path):
    trainer = vlm_trainer(vlm_path, processor, image_dataset, tmp_path, max_steps=1, use_anchors=use_anchors)
    rounds = capture_rounds(trainer)
    trainer.train()
    output, reference = rounds[0], trainer.reference.model
    texts = processor.tokenizer.batch_decode(output["prompt_ids"], skip_special_tokens=True)
    width, image_pad = output["completion_ids"].size(1), processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for row, text in enumerate(texts):
        ids = torch.cat([output["prompt_ids"][row][output["prompt_mask"][row].bool()], output["completion_ids"][row]])

        def logps(n):
            image = processed(processor, n)
            with torch.no_grad():
                logits = reference(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None],
                                   pixel_values=image["pixel_values"], image_grid_thw=image["image_grid_thw"],
                                   mm_token_type_ids=(ids == image_pad).long()[None]).logits
            scores = torch.log_softmax(logits[0, -width - 1 : -1].float() / trainer.temperature, dim=-1)
            return scores.gather(-1, output["completion_ids"][row][:, None]).squeeze(-1)

        mask = output["completion_mask"][row].bool() if output["completion_mask"][row].any() else slice(None)
        n = number_of(text)
        torch.testing.assert_close(output["armor_ref_logps"][row][mask], logps(n)[mask], rtol=1e-5, atol=1e-5)
        # ... and the check can tell images apart: another image (same size) gives other log-probs
        other = (n + 2) % 16
        assert (output["armor_ref_logps"][row][mask] - logps(other)[mask]).abs().max() > 1e-5


def test_dynamic_sampling_keeps_each_row_with_its_image(vlm_path, processor, image_dataset, tmp_path):
    trainer = vlm_trainer(vlm_path, processor, image_dataset, tmp_path, max_steps=2, dynamic_sampling=True,
                          dynamic_sampling_max_rounds=3, anchor_reward_threshold=0.3)
    rounds = capture_rounds(trainer)
    trainer.train()
    assert max(logged(trainer, "armor/generation_rounds")) > 1  # batches were joined from several rounds
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for batch in rounds:
        check_rows_have_their_images(processor, batch["prompt_ids"], batch["pixel_values"], batch["image_grid_thw"])
        assert batch["num_images"] == [1] * batch["prompt_ids"].size(0)
        if "mm_token_type_ids" in batch:  # re-padded with its prompt and completion
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            assert torch.equal(batch["mm_token_type_ids"].bool(), ids == image_pad)


def test_with_both_switches_off_a_vlm_trains_as_in_grpo_trainer(vlm_path, processor, image_dataset, tmp_path):
    common = cpu_args(max_steps=2, num_iterations=2, epsilon_high=0.28)  # (ArmorConfig's epsilon_high)
    grpo = GRPOTrainer(model=vlm_path, reward_funcs=image_checked_reward,
                       args=GRPOConfig(output_dir=str(tmp_path / "grpo"), **common), train_dataset=image_dataset,
                       processing_class=processor)
    grpo.train()
    armor = ArmorGRPOTrainer(model=vlm_path, reward_funcs=image_checked_reward,
                             args=ArmorConfig(output_dir=str(tmp_path / "armor"), use_anchors=False,
                                              use_mixed_ratio=False, **common),
                             train_dataset=image_dataset, processing_class=processor)
    armor.train()
    for (name, p), q in zip(grpo.model.named_parameters(), armor.model.parameters()):
        assert torch.equal(p, q), name
    assert logged(grpo, "loss") == logged(armor, "loss")


class ReferenceAtFirstStep(StopAt):
    """Keeps π_ref's weights as the (resumed) run's first step begins."""

    def __init__(self, trainer):
        super().__init__(step=-1)
        self.trainer, self.weights = trainer, None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.weights is None:
            policy = self.trainer.unwrapped_policy()
            self.weights = [p.detach().clone() for p in self.trainer.reference.parameters_of(policy)]


def test_a_vlm_run_resumes_exactly(vlm_path, processor, image_dataset, tmp_path):
    """A run stopped at step 2 and resumed ends like the straight run: the policy's parameters and the losses after
    the resume are the straight run's, and the reference it starts from is the one the checkpoint saved after its
    reset, bit for bit. (transformers saves a Qwen2-VL under its checkpoint key names, ``visual.*``, and its Trainer
    loads them into ``model.visual.*`` without converting them: nothing would load, silently.)"""
    def trainer_for(output_dir):
        return vlm_trainer(vlm_path, processor, image_dataset, output_dir, ref_reset_steps=2, max_steps=4,
                           save_strategy="steps", save_steps=2)

    def losses(trainer):
        return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}

    straight = trainer_for(tmp_path / "straight")
    straight.train()
    first = trainer_for(tmp_path / "interrupted")
    first.add_callback(StopAt(2))
    first.train()
    assert first.state.global_step == 2 and first.reference.resets == 1
    saved = [p.detach().clone() for p in first.reference.parameters_of(first.unwrapped_policy())]
    assert not all(torch.equal(a, b) for a, b in zip(saved, build_reference_weights(vlm_path, first)))

    resumed = trainer_for(tmp_path / "interrupted")
    start = ReferenceAtFirstStep(resumed)
    resumed.add_callback(start)
    resumed.train(resume_from_checkpoint=True)
    assert all(torch.equal(a, b) for a, b in zip(saved, start.weights))
    assert resumed.state.global_step == 4 and resumed.reference.resets == 2
    assert logged(resumed, "armor/anchor_found_frac")
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6, msg=name)
    assert [losses(resumed)[step] for step in (3, 4)] == pytest.approx([losses(straight)[step] for step in (3, 4)],
                                                                       abs=1e-6)


def build_reference_weights(vlm_path, trainer):
    """The initial model's weights, in the order of the reference's parameters."""
    from transformers import AutoModelForImageTextToText

    initial = dict(AutoModelForImageTextToText.from_pretrained(vlm_path).named_parameters())
    return [initial[name] for name, _ in trainer.reference.model.named_parameters()]


@pytest.mark.parametrize("fields, message", [
    (dict(anchor_cache=True), "anchor_cache=True with a vision-language model: the cache keys a prompt by its token ids"),
])
def test_what_stays_refused_for_a_vlm_says_why(fields, message, vlm_path, processor, image_dataset, tmp_path):
    with pytest.raises(ValueError, match=message):
        vlm_trainer(vlm_path, processor, image_dataset, tmp_path, **fields)


def test_vllm_anchors_for_a_vlm_are_refused_naming_what_works(tmp_path):
    """(Checked on the config: without vllm installed TRL stops at construction before ARMOR's check.)"""
    from armor_trl.integration.checks import check_vlm_anchors

    with pytest.raises(ValueError, match="vision-language model needs use_vllm=False.*use_anchors=False"):
        check_vlm_anchors(ArmorConfig(output_dir=str(tmp_path), **cpu_args(use_vllm=True)))


def test_environment_anchors_for_a_vlm_are_refused_naming_what_works(tmp_path):
    """(The whole construction is refused in tests/test_feature_matrix.py, the VLM × environment_factory pair.)"""
    from armor_trl.integration.checks import check_vlm_anchors

    args = ArmorConfig(output_dir=str(tmp_path), **cpu_args())
    check_vlm_anchors(args)  # tools or no agent: nothing refused
    with pytest.raises(ValueError, match="environment_factory and a vision-language model.*tools=.*use_anchors=False"):
        check_vlm_anchors(args, environments=True)


def test_column_anchors_for_a_vlm_join_their_rows_with_their_images(vlm_path, processor, tmp_path):
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{n}+{n + 1}="}], "image": image_of(n),
                                  "anchors": [f"{2 * n + 1}"]} for n in range(16)])
    trainer = vlm_trainer(vlm_path, processor, dataset, tmp_path, max_steps=2, anchor_source="column")
    rounds = capture_rounds(trainer)
    trainer.train()
    for output in rounds:
        texts = processor.tokenizer.batch_decode(output["prompt_ids"], skip_special_tokens=True)
        for row in output["armor_is_anchor"].nonzero().flatten().tolist():
            anchor = processor.tokenizer.decode(output["completion_ids"][row], skip_special_tokens=True)
            assert anchor == str(2 * number_of(texts[row]) + 1)  # its own row's anchor ...
        check_rows_have_their_images(processor, output["prompt_ids"], output["pixel_values"], output["image_grid_thw"])
    assert min(logged(trainer, "armor/anchor_found_frac")) == 1.0


def test_the_vlm_recipe_keeps_each_rows_image_with_its_chat_prompt(monkeypatch, tmp_path):
    """configs/qwen2.5-vl-3b_lora_vlm.yaml on a local stand-in of its hub dataset (image, problem, solution): the
    training rows keep their images beside chat prompts, as TRL's VLM path reads them."""
    from pathlib import Path

    import armor_trl.data.datasets
    from armor_trl.app.recipe.build import train_datasets
    from armor_trl.app.recipe.parsing import parse_train_args

    stand_in = Dataset.from_list([{"image": image_of(n), "problem": f"What is {n}+{n + 1}?",
                                   "solution": f"\\boxed{{{2 * n + 1}}}", "original_question": "",
                                   "original_answer": ""} for n in range(3)])
    monkeypatch.setattr(armor_trl.data.datasets, "load_dataset", lambda path, name=None, split=None, **kw: stand_in)
    recipe = Path(__file__).resolve().parents[1] / "configs" / "qwen2.5-vl-3b_lora_vlm.yaml"
    script, training_args, _, _ = parse_train_args(["--config", str(recipe), "--dry_run"])
    train, _ = train_datasets(script)
    assert not training_args.use_vllm and not training_args.anchor_cache
    for n, row in enumerate(train):
        assert row["prompt"][-1]["role"] == "user" and f"What is {n}+{n + 1}?" in row["prompt"][-1]["content"]
        assert np.asarray(row["image"])[0, 0, 0] == n * 8 and row["answer"] == f"\\boxed{{{2 * n + 1}}}"


def test_with_lora_the_reference_adapter_samples_candidates_with_their_images(vlm_path, processor, image_dataset,
                                                                              tmp_path, monkeypatch):
    """The recipe's set-up (LoRA): π_ref is the "ref" adapter, active while the candidates are generated."""
    from peft import LoraConfig

    from armor_trl.reference.policy import REF_ADAPTER

    calls = record_generate(monkeypatch)
    active = []
    original = GenerationMixin.generate

    def noting_adapter(model, *args, **kwargs):
        active.append(trainer.unwrapped_policy().active_adapter)
        return original(model, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", noting_adapter)
    trainer = ArmorGRPOTrainer(
        model=vlm_path, reward_funcs=image_checked_reward, train_dataset=image_dataset, processing_class=processor,
        args=ArmorConfig(output_dir=str(tmp_path), **cpu_args(max_steps=2, anchor_reward_threshold=0.1,
                                                            anchor_same_call=False, ref_reset_steps=1)),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.reference.kind == "lora"
    rounds = capture_rounds(trainer)
    trainer.train()
    assert [len(ids) for _, ids, _, _ in calls] == [6, 8, 6, 8]
    assert active == ["default", REF_ADAPTER] * 2
    for _, input_ids, pixel_values, image_grid_thw in calls:
        check_rows_have_their_images(processor, input_ids, pixel_values, image_grid_thw)
    assert all(output["armor_is_anchor"].any() for output in rounds) and trainer.reference.resets == 2


def test_a_processor_field_that_cannot_be_cut_into_rows_is_named():
    """A processor whose image fields are neither per patch with image_grid_thw, per image nor per row stops the
    anchor round naming the field and the models that work."""
    from armor_trl.rollout.multimodal import RowMedia

    prompt_ids = [[1, 2], [3, 4], [5, 6]]
    fields = {"pixel_values": torch.zeros(7, 4)}  # 7 tiles for 3 rows of one image each
    with pytest.raises(ValueError, match="cannot cut the processor's field 'pixel_values' into rows.*Qwen2-VL"):
        RowMedia(prompt_ids, [[image_of(0)]] * 3, fields)
    media = RowMedia(prompt_ids, [[image_of(0)]] * 3, {"pixel_values": torch.arange(3.0)[:, None]})
    images, picked = media.select([prompt_ids[2], prompt_ids[0]])
    assert picked["pixel_values"].flatten().tolist() == [2.0, 0.0] and len(images) == 2
