import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch
import trl
from packaging.version import Version
from packaging.specifiers import SpecifierSet

import armor_trl
from armor_trl.integration import trl_generation, trl_seam, vllm_engine


_getsource = inspect.getsource


def test_installed_trl_is_a_supported_version():
    assert Version(trl.__version__) in SpecifierSet(trl_seam.SUPPORTED_TRL)


def test_private_surface_we_rely_on_still_exists():
    assert trl_seam.check_trl_surface() == []


def test_surface_check_detects_a_missing_method(monkeypatch):
    monkeypatch.delattr(trl.GRPOTrainer, "_generate_single_turn")
    assert any("_generate_single_turn" in p for p in trl_seam.check_trl_surface())


def test_private_attributes_we_touch_exist_on_a_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    from testing import make_trainer

    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path)
    assert trl_seam.missing_attributes(trainer) == []


def test_surface_check_covers_the_vllm_wrapper_methods_the_engine_helpers_call(monkeypatch):
    module_name, _, class_name = vllm_engine.VLLM_ENGINE.rpartition(".")
    wrapper = getattr(importlib.import_module(module_name), class_name)
    monkeypatch.delattr(wrapper, "sync_weights")
    assert any(f"{class_name}.sync_weights is missing" in p for p in trl_seam.check_trl_surface())


def test_surface_check_detects_a_loss_that_computes_the_log_probs_twice(monkeypatch):
    def _compute_loss(self, model, inputs):
        a = self._get_per_token_logps_and_entropies(model, inputs)
        b = self._get_per_token_logps_and_entropies(model, inputs)
        return a, b

    monkeypatch.setattr(trl.GRPOTrainer, "_compute_loss", _compute_loss)
    assert any("2 times" in p for p in trl_seam.check_trl_surface())


def test_surface_check_detects_a_loss_type_or_level_armor_has_not_derived(monkeypatch):
    def _compute_loss(self, model, inputs):
        logps = self._get_per_token_logps_and_entropies(model, inputs)
        reference = inputs["ref_per_token_logps"]  # noqa: F841 - what the surface check looks for
        if self.importance_sampling_level == "token" or self.importance_sampling_level == "segment":
            pass
        if self.loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo"] or self.loss_type == "new":
            return logps
        elif self.loss_type == "vespo" or self.importance_sampling_level == "sequence":
            return logps

    monkeypatch.setattr(trl.GRPOTrainer, "_compute_loss", _compute_loss)
    problems = trl_seam.check_trl_surface()
    assert any("loss types" in p and "'new'" in p for p in problems)
    assert any("importance-sampling levels" in p and "'segment'" in p for p in problems)
    monkeypatch.setattr(trl_seam, "LOSS_TYPES", (*trl_seam.LOSS_TYPES, "new"))
    monkeypatch.setattr(trl_seam, "IMPORTANCE_SAMPLING_LEVELS", ("token", "sequence", "segment"))
    assert trl_seam.check_trl_surface() == []


@pytest.mark.parametrize("body", [
    "logps = self._get_per_token_logps_and_entropies(model, inputs)\n",  # no KL read
    "reference = inputs['ref_per_token_logps']\nlogps = self._get_per_token_logps_and_entropies(model, inputs)\n",
])
def test_surface_check_detects_a_kl_term_armor_cannot_hand_its_reference(monkeypatch, body):
    """ARMOR + KL sets TRL's KL reference input while TRL computes the policy's log-probs: TRL must read it after."""
    source = "def _compute_loss(self, model, inputs):\n" + "".join(f"    {line}\n" for line in body.splitlines())
    scope = {}
    exec(compile(source, "<fake>", "exec"), scope)
    monkeypatch.setattr(trl.GRPOTrainer, "_compute_loss", scope["_compute_loss"])
    monkeypatch.setattr(trl_seam.inspect, "getsource", lambda f: source if f is scope["_compute_loss"] else
                        _getsource(f))
    assert any("ref_per_token_logps" in p for p in trl_seam.check_trl_surface())


def test_the_mixed_log_probs_reach_the_loss_exactly_once_or_the_run_stops():
    class Holder:
        pass

    trainer = Holder()
    with trl_seam.loss_logps_replaced(trainer, lambda logps: logps * 2) as policy:
        replaced = trl_seam.replaced_loss_logps(trainer, torch.ones(2), "entropies")
    assert replaced.tolist() == [2.0, 2.0]
    assert policy["logps"].tolist() == [1.0, 1.0] and policy["entropies"] == "entropies"
    assert trl_seam.replaced_loss_logps(trainer, torch.ones(1)).tolist() == [1.0]  # outside the block: untouched
    for calls in (0, 2):  # TRL's loss changed the way it computes the policy's log-probs: the run stops
        with pytest.raises(RuntimeError, match=f"computed the policy's log-probs {calls} times"):
            with trl_seam.loss_logps_replaced(trainer, lambda logps: logps):
                for _ in range(calls):
                    trl_seam.replaced_loss_logps(trainer, torch.ones(1))


def private_names_of_grpo_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path) -> set[str]:
    """Private attribute and method names of TRL's GRPOTrainer (class and a built instance), transformers' included."""
    from testing import cpu_args, has_digit_reward

    trainer = trl.GRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, train_dataset=prompt_dataset,
                              args=trl.GRPOConfig(output_dir=str(tmp_path), **cpu_args()),
                              processing_class=tiny_tokenizer)
    names = set(dir(trl.GRPOTrainer)) | set(vars(trainer)) | set(trl_seam.VLLM_ATTRIBUTES)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_no_module_but_the_seam_touches_trls_private_surface(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    private = private_names_of_grpo_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path)
    assert {"_metrics", "_is_vlm", "_get_output_dir", "_determine_best_metric"} <= private  # the scan sees them
    package = Path(armor_trl.__file__).parent
    # the seam's modules: TRL's (and transformers') private names with the surface check, TRL's generation and scoring
    # path, and TRL's vLLM wrapper with vLLM's own names
    seam = {Path(module.__file__).resolve() for module in (trl_seam, trl_generation, vllm_engine)}
    assert {path.name for path in seam} == {"trl_seam.py", "trl_generation.py", "vllm_engine.py"}
    assert all(path.parent == package.resolve() / "integration" for path in seam)
    offences = []
    for path in sorted(package.rglob("*.py")):
        if path.resolve() in seam:
            continue
        tree = ast.parse(path.read_text())
        own = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)} - set(trl_seam.OVERRIDDEN)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and re.match(r"(trl|vllm)\.", node.module or ""):
                offences.append(f"{path.name}:{node.lineno}: imports from {node.module}")
            if isinstance(node, ast.Import) and any(re.match(r"(trl|vllm)\.", a.name) for a in node.names):
                offences.append(f"{path.name}:{node.lineno}: imports a TRL / vLLM submodule")
            if isinstance(node, ast.Attribute) and node.attr in private and node.attr not in own:
                # overriding a private method and calling the parent's version of it is what a subclass does
                via_super = isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super"
                if not (via_super and node.attr in trl_seam.OVERRIDDEN):
                    offences.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert offences == [], "\n".join(offences)


def test_the_surface_lists_every_private_name_the_generation_half_touches(tiny_model_path, tiny_tokenizer,
                                                                         prompt_dataset, tmp_path):
    """trl_generation touches TRL's private names only through the lists check_trl_surface checks."""
    private = private_names_of_grpo_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path)
    listed = {*trl_seam.OVERRIDDEN, *trl_seam.CALLED, *trl_seam.ATTRIBUTES, *trl_seam.VLLM_ATTRIBUTES,
              *trl_seam.TOOL_ATTRIBUTES}
    tree = ast.parse(Path(trl_generation.__file__).read_text())
    touched = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in private}
    assert {"_generate_single_turn", "_calculate_rewards", "_tokenizer"} <= touched  # the scan sees them
    assert touched - listed == set()
    helpers = {f"{node.module}.{alias.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and (node.module or "").startswith("trl.") for alias in node.names}
    assert helpers and helpers <= set(trl_seam.HELPERS)


def test_surface_check_detects_a_missing_helper(monkeypatch):
    import trl.data_utils

    monkeypatch.delattr(trl.data_utils, "is_conversational")
    assert any("trl.data_utils.is_conversational cannot be imported" in p for p in trl_seam.check_trl_surface())


def test_names_replaced_by_overlapping_blocks_are_restored_whatever_order_they_end_in(monkeypatch):
    # two trainers built at once (colocated_engine_built's replacement of vLLM's names): the first block ends first
    import sys
    import types

    module = types.ModuleType("armor_fake_vllm")
    module.setup = original = lambda: "vllm"
    monkeypatch.setitem(sys.modules, "armor_fake_vllm", module)
    first = vllm_engine._replaced("armor_fake_vllm.setup", lambda f: lambda: f() + "+first")
    second = vllm_engine._replaced("armor_fake_vllm.setup", lambda f: lambda: f() + "+second")
    first.__enter__()
    second.__enter__()
    assert module.setup() == "vllm+first+second"
    first.__exit__(None, None, None)
    assert module.setup() == "vllm+second"  # the open block's replacement stays
    second.__exit__(None, None, None)
    assert module.setup is original


def test_surface_check_detects_a_generate_that_no_longer_calls_the_rollout_func(monkeypatch):
    def _generate(self, prompts):
        return self.custom_generation(prompts)

    monkeypatch.setattr(trl.GRPOTrainer, "_generate", _generate)
    assert any("rollout_func" in p for p in trl_seam.check_trl_surface())


def test_the_environment_row_helpers_restate_trls_inline_code():
    """trl_generation's helpers for environment rows (``prompt_after_reset``, ``reset_kwargs``, ``default_prompt``,
    ``environment_tool_row``) restate statements TRL makes inline in ``_generate_and_score_completions``: that code is
    pinned here, so a TRL release that changes how it resets, appends an observation, defaults a prompt or builds a
    row's tool dicts fails this test and the helpers are read again. (Their behaviour against TRL's own training:
    tests/test_environment_anchors.py.)"""
    import inspect
    import re as regex

    from trl import GRPOTrainer

    source = regex.sub(r"\s+", " ", inspect.getsource(GRPOTrainer._generate_and_score_completions))
    for statement in (
        'prompts = [x.get("prompt", [{"role": "user", "content": ""}]) for x in inputs]',  # default_prompt
        'reset_kwargs = {k: v for k, v in x.items() if k != "environment"} if self._multi_environment else x',
        "observation = environment.reset(**reset_kwargs)",
        'if isinstance(observation, list) and isinstance(content, str): content = [{"type": "text", "text": content}]',
        'if isinstance(observation, str) and isinstance(content, list): observation = [{"type": "text", "text": '
        'observation}]',  # prompt_after_reset
        'prompts[i] = prompt[:-1] + [{**prompt[-1], "content": content + observation}]',
        'if member_name not in ("reset", "get_reward") and not member_name.startswith("_")',  # environment_tool_row
        "for tool in self._standalone_tools + methods: if inspect.iscoroutinefunction(tool):",
    ):
        assert statement in source, statement
    from armor_trl.integration import trl_generation

    prompt = [{"role": "user", "content": "q"}]
    assert trl_generation.prompt_after_reset(prompt, " obs") == [{"role": "user", "content": "q obs"}]
    assert trl_generation.prompt_after_reset(prompt, [{"type": "image"}]) == [
        {"role": "user", "content": [{"type": "text", "text": "q"}, {"type": "image"}]}]
    assert trl_generation.ENVIRONMENT_ONLY_METHODS == ("reset", "get_reward")
