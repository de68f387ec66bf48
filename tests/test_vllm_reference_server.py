"""Anchors from a second vLLM server holding π_ref (vllm_reference_server_base_url / _port), with fake servers.

TRL's VLLMGeneration is replaced by ``FakeServer`` (server mode needs a CUDA trainer and vLLM's NCCL weight transfer, so
no real server can run on the CPU machines), so the trainer is built
exactly as with ``use_vllm=True, vllm_mode="server"``: TRL constructs the policy's engine, ARMOR the reference's.
"""

import pytest
import torch
from peft import LoraConfig
from torch import nn
from transformers import TrainerCallback

from armor_trl import ArmorConfig, ArmorGRPOTrainer
from armor_trl.reference.policy import ReferencePolicy, adapter_parameters
from armor_trl.reference.vllm_server import ReferenceServer
from testing import capture_rounds, cpu_args

REFERENCE_URL = "http://localhost:8001"


class FakeServer:
    """Stands in for TRL's VLLMGeneration in server mode: records weight pushes and generations."""

    def __init__(self, model, accelerator, processing_class, **settings):
        self.model, self.settings = model, settings
        self.__dict__.update(settings)  # temperature, top_p, ... as VLLMGeneration keeps them
        self.trainer, self.sample = None, None  # set by the test
        self.pushes, self.generated = [], []

    def sync_weights(self):
        adapter = getattr(self.model, "active_adapter", None)
        weights = adapter_parameters(self.model, adapter) if adapter else dict(self.model.named_parameters())
        from_policy_model = self.model is self.trainer.model
        snapshot = {name: param.detach().clone() for name, param in weights.items()}
        self.pushes.append({"step": self.trainer.state.global_step, "adapter": adapter, "policy_model": from_policy_model,
                            "weights": snapshot})

    def generate(self, prompts, images, num_generations, profiler=None):
        self.generated.append((self.trainer.state.global_step, len(prompts)))
        completions = [self.sample() for _ in prompts]
        return prompts, completions, [[[-0.5] for _ in ids] for ids in completions], None


class PolicySnapshots(TrainerCallback):
    """The policy's weights (the trained adapter's for LoRA) at the start and after every step (and its reset)."""

    def __init__(self, trainer):
        self.trainer, self.at = trainer, {}

    def _take(self, step):
        model = self.trainer.model
        weights = adapter_parameters(model, "default") if hasattr(model, "peft_config") else dict(model.named_parameters())
        self.at[step] = {name: param.detach().clone() for name, param in weights.items()}

    def on_train_begin(self, args, state, control, **kwargs):
        self._take(0)

    def on_step_end(self, args, state, control, **kwargs):
        self._take(state.global_step)


def sevens(completions, **kwargs):
    """Share of the character 7: the reference server answers "777" (verified), the policy random digits."""
    return [text.count("7") / max(len(text), 1) for text in completions]


def server_trainer(monkeypatch, tiny_model_path, tiny_tokenizer, dataset, tmp_path, **overrides):
    servers = []

    def make_server(*args, **kwargs):
        servers.append(FakeServer(*args, **kwargs))
        return servers[-1]

    monkeypatch.setattr("trl.trainer.grpo_trainer.VLLMGeneration", make_server)
    monkeypatch.setattr("trl.generation.vllm_generation.VLLMGeneration", make_server)
    # server mode needs a CUDA trainer (NCCL weight transfer); the fake servers take the weights on the CPU
    monkeypatch.setattr("armor_trl.integration.checks.check_vllm_device", lambda args: None)
    peft_config = overrides.pop("peft_config", None)
    args = ArmorConfig(
        output_dir=str(tmp_path), use_vllm=True, vllm_mode="server", vllm_reference_server_base_url=REFERENCE_URL,
        vllm_importance_sampling_correction=False, **cpu_args(**overrides),
    )
    trainer = ArmorGRPOTrainer(model=tiny_model_path, reward_funcs=sevens, args=args, train_dataset=dataset,
                               processing_class=tiny_tokenizer, peft_config=peft_config)
    policy_server, reference_server = servers
    digits = torch.tensor(tiny_tokenizer.convert_tokens_to_ids(list("0123456789")))
    seven = tiny_tokenizer.convert_tokens_to_ids("7")
    generator = torch.Generator().manual_seed(0)
    policy_server.sample = lambda: digits[torch.randint(10, (3,), generator=generator)].tolist()
    reference_server.sample = lambda: [seven] * 3
    policy_server.trainer = reference_server.trainer = trainer
    snapshots = PolicySnapshots(trainer)
    trainer.add_callback(snapshots)  # after ReferenceResetCallback: sees the weights a reset copied
    return trainer, policy_server, reference_server, snapshots, seven


def assert_same(left: dict, right: dict):
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


def test_anchor_candidates_come_from_the_reference_server_which_gets_weights_only_at_resets(
    monkeypatch, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    trainer, policy_server, reference_server, snapshots, seven = server_trainer(
        monkeypatch, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=5, ref_reset_steps=2,
        anchor_num_samples=2, anchor_same_call=False,  # the reference server's path (same-call: test_same_call.py)
    )
    # the reference's server samples like the policy's, on its own URL and weight-update group
    assert reference_server.settings["server_base_url"] == REFERENCE_URL
    assert reference_server.settings["group_port"] == 51217 != policy_server.settings["group_port"]
    assert reference_server.settings["temperature"] == policy_server.settings["temperature"]
    rounds = capture_rounds(trainer)
    trainer.train()

    # the policy's server: one push of the policy per step (TRL's own bookkeeping), policy rollouts only
    assert [(p["step"], p["policy_model"]) for p in policy_server.pushes] == [(s, True) for s in range(5)]
    assert policy_server.generated == [(s, 6) for s in range(5)]  # G-1 = 3 rollouts for each of 2 groups
    assert trainer._last_loaded_step == 4
    # the reference's server: K = 2 candidates per group every step; started with the model path, so weights
    # arrive only after the resets at steps 2 and 4, and they are the policy's weights at that reset
    assert reference_server.generated == [(s, 4) for s in range(5)]
    assert [(p["step"], p["policy_model"]) for p in reference_server.pushes] == [(2, False), (4, False)]
    for push in reference_server.pushes:
        assert_same(push["weights"], snapshots.at[push["step"]])
    first, second = (push["weights"] for push in reference_server.pushes)
    assert any(not torch.equal(first[name], second[name]) for name in first)  # the policy did move in between
    # the anchors in the groups are the reference server's completions
    for out in rounds:
        anchors = out["completion_ids"][[3, 7]]
        assert (anchors[:, :3] == seven).all()
        assert out["armor_is_anchor"][[3, 7]].all()


def test_gpu_checks_push_recorder_sees_the_pushes_at_the_resets(monkeypatch, tiny_model_path, tiny_tokenizer,
                                                               prompt_dataset, tmp_path):
    """scripts/gpu_check.py --reference_server's bookkeeping, on fake servers (it read a renamed attribute once)."""
    from testing import load_gpu_check

    gpu_check = load_gpu_check()
    trainer, *_ = server_trainer(monkeypatch, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=5,
                                 ref_reset_steps=2, anchor_num_samples=2, anchor_same_call=False)
    pushes = gpu_check.record_reference_pushes(trainer)
    trainer.train()
    assert pushes == list(range(2, 5, 2))  # what the GPU check expects for τ = 2


def test_lora_reference_is_pushed_once_at_the_start_and_at_resets_with_the_ref_adapter(
    monkeypatch, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    trainer, policy_server, reference_server, snapshots, _ = server_trainer(
        monkeypatch, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=3, ref_reset_steps=2,
        anchor_num_samples=2, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), anchor_same_call=False,
    )
    trainer.train()
    # the server holds the base model: the "ref" adapter (merged by TRL's sync) is pushed before the first anchors
    assert [(p["step"], p["adapter"]) for p in reference_server.pushes] == [(0, "ref"), (2, "ref")]
    for push in reference_server.pushes:
        assert_same(push["weights"], snapshots.at[push["step"]])
    assert {p["adapter"] for p in policy_server.pushes} == {"default"}
    assert [step for step, _ in policy_server.generated] == [0, 1, 2]
    assert trainer.model.active_adapter == "default"


def test_weights_are_pushed_when_the_reference_changed_since_the_last_push():
    reference = ReferencePolicy.full(nn.Linear(2, 2))
    engine = FakeServer(None, None, None)
    engine.trainer = type("T", (), {"model": None, "state": type("S", (), {"global_step": 0})})()
    engine.sample = lambda: [1]
    server = ReferenceServer(engine, reference, unwrap=lambda model: model, holds_initial_reference=True)
    server.generate([[5]], 1, policy=None)
    assert engine.pushes == []  # the server was started with the reference
    reference.resets = 3  # e.g. restored from a checkpoint written after three resets
    server.generate([[5]], 1, policy=None)
    server.generate([[5]], 1, policy=None)
    assert len(engine.pushes) == 1 and engine.model is reference.model
    unknown = ReferenceServer(engine, ReferencePolicy.full(nn.Linear(2, 2)), lambda m: m, holds_initial_reference=False)
    unknown.generate([[5]], 1, policy=None)
    assert len(engine.pushes) == 2  # a reference not built from the server's model path is pushed before first use


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(vllm_reference_server_base_url=REFERENCE_URL), "need use_vllm=True and vllm_mode='server'"),
        (dict(vllm_reference_server_port=8001, use_vllm=True, vllm_mode="colocate"), "vllm_mode='server'"),
        (dict(vllm_reference_server_port=8000, use_vllm=True, vllm_mode="server"), "is the policy's"),
        (dict(vllm_reference_server_port=8001, use_vllm=True, vllm_mode="server", vllm_reference_group_port=51216),
         "vllm_reference_group_port and vllm_group_port"),
        (dict(vllm_reference_server_port=8001, use_vllm=True, vllm_mode="server", use_anchors=False), "use_anchors=True"),
        (dict(vllm_reference_server_host="gpu2"), "needs vllm_reference_server_port"),
    ],
)
def test_reference_server_settings_are_checked(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        ArmorConfig(output_dir=str(tmp_path), **cpu_args(**fields))


def test_reference_server_url_from_host_and_port(tmp_path):
    config = ArmorConfig(output_dir=str(tmp_path), **cpu_args(use_vllm=True, vllm_mode="server", vllm_reference_server_port=8001))
    assert config.vllm_reference_server_url == "http://0.0.0.0:8001"
    assert ArmorConfig(output_dir=str(tmp_path), **cpu_args()).vllm_reference_server_url is None


def test_trl_vllm_generation_takes_the_settings_the_reference_server_passes():
    import inspect

    from trl.generation.vllm_generation import VLLMGeneration

    from armor_trl.reference.vllm_server import SHARED_SETTINGS

    parameters = set(inspect.signature(VLLMGeneration.__init__).parameters)
    expected = {"model", "accelerator", "processing_class", "mode", "server_base_url", "group_port", *SHARED_SETTINGS}
    assert expected <= parameters, sorted(expected - parameters)
    assert {"sync_weights", "generate"} <= set(dir(VLLMGeneration))
