"""The fields of a YAML recipe of ``armor-trl train``: :class:`TrainScriptArguments` (TRL's ``ScriptArguments`` plus
the dataset, reward and validation fields, :class:`DataArguments` among them), the methods a recipe may name, the
sections the experiments read, the ``trl grpo`` fields refused with the reason why, and :func:`armor_only_fields`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields

from trl import ScriptArguments

METHODS = ("armor", "grpo")
RESERVED_RECIPE_KEYS = ("demo", "study")  # recipe sections read by the experiments (armor_trl.app.experiments)
# `trl grpo` fields that armor-trl train does not take, and why (a flag or recipe key naming one is refused so)
REFUSED_TRL_FIELDS = {
    "reward_model_name_or_path": (
        "a `trl grpo` field that armor-trl train does not take: rewards are named in reward_funcs (built-in "
        "verifiers such as math_verify, or module:function of your own), and ARMOR's anchors need a reward that says "
        "'correct' (reaches anchor_reward_threshold), which a reward model's scores do not. To add a reward model's "
        "score, wrap it in a function (my_rewards.py), list my_rewards:score in reward_funcs after the verifier, and "
        "name the verifier in anchor_reward_funcs."
    ),
}


@dataclass
class DataArguments:
    """How a dataset becomes ``prompt`` + ``answer`` (see :func:`armor_trl.data.datasets.load_rlvr_dataset`)."""

    dataset_schema: str | None = field(
        default=None,
        metadata={"help": "Schema of the dataset: gsm8k, math, aime, dapo or prompt_answer. Default: detected."},
    )
    chat: bool = field(default=False, metadata={"help": "Write prompts as chat messages (uses the chat template)."})
    system_prompt: str | None = field(default=None, metadata={"help": "System message (or text prefix) of prompts."})
    instruction: str | None = field(
        default=None,
        metadata={"help": "Text appended to each problem; 'default' = ask for the final answer in \\boxed{}; 'dapo' = "
                  "DAPO-Math-17k's template (final 'Answer:' line, read by math_verify with that rule); prompts that "
                  "already carry DAPO's instruction get none. See docs/verifiers.md."},
    )
    arithmetic_train_size: int = field(default=64, metadata={"help": "dataset 'arithmetic': training problems."})
    arithmetic_eval_size: int = field(default=200, metadata={"help": "dataset 'arithmetic': held-out problems."})
    arithmetic_digits: int = field(default=2, metadata={"help": "dataset 'arithmetic': digits per operand."})
    arithmetic_eval_digits: int | None = field(
        default=None, metadata={"help": "dataset 'arithmetic': digits per operand of the held-out problems (the "
                                "tool-use testbed: 2, which only the tool solves). Default: arithmetic_digits."},
    )
    arithmetic_seed: int = field(default=0, metadata={"help": "dataset 'arithmetic': seed of the problem draw."})
    arithmetic_train_filter: str | None = field(
        default=None, metadata={"help": "dataset 'arithmetic': restrict the training problems only; 'no_carry' = "
                                "no column carries (a shortcut the held-out set punishes)."},
    )
    arithmetic_eval_filter: str | None = field(
        default=None, metadata={"help": "dataset 'arithmetic': restrict the held-out problems only; 'carry' = some "
                                "column carries (the mode testbed's held-out set). Default: unrestricted."},
    )
    arithmetic_train_carry_share: float | None = field(
        default=None, metadata={"help": "dataset 'arithmetic': this share of the training problems needs a carry, "
                                "the rest follows arithmetic_train_filter (the mode testbed's carry-mix variant). "
                                "Validate on those carry problems with the val_datasets source "
                                "'arithmetic:train_carry'. Default: none mixed in."},
    )


@dataclass
class TrainScriptArguments(ScriptArguments, DataArguments):
    """Dataset, reward and validation fields of ``armor-trl train`` (TRL's ScriptArguments plus these)."""

    method: str = field(
        default="armor",
        metadata={"help": "armor: ArmorGRPOTrainer + ArmorConfig; grpo: trl.GRPOTrainer + GRPOConfig.",
                  "choices": list(METHODS)},
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["math_verify"],
        metadata={"help": "Reward functions: built-in names (math_verify, exact_integer, final_integer, format), TRL's reward names "
                  "(accuracy_reward, think_format_reward, reasoning_accuracy_reward, ...) or import paths "
                  "'pkg.mod:func'. Weights: the config's reward_weights."},
    )
    tools: list[str] | None = field(
        default=None,
        metadata={"help": "Tools for TRL's tool loop (an agent): names of armor_trl.app.tool_testbed.TOOLS (add) or "
                  "import paths 'pkg.mod:func' (a function with a docstring TRL turns into its schema). Needs chat "
                  "prompts (chat: true) and a chat template that renders tool calls; see docs/agents.md."},
    )
    tool_failure_rate: float = field(
        default=0.0,
        metadata={"help": "With tools: this share of tool calls raise TimeoutError (drawn per call, seeded by the run's "
                  "seed), which TRL's loop answers with its error result, as a tool that times out would: the tool-use "
                  "testbed (configs/tool_use_testbed.yaml). 0: the tools as written."},
    )
    eval_dataset_name: str | None = field(
        default=None, metadata={"help": "Held-out set for validation (logged as val/avg@n). Default: dataset_name's "
                                "dataset_test_split, unless val_datasets is given."}
    )
    val_datasets: list[str] | None = field(
        default=None,
        metadata={"help": "More validation sets, each 'source' or 'name=source' (registry name, hub id or local file, "
                  "its default split), logged as val/<name>/avg@n; prompts are written like the training data's "
                  "(chat, system_prompt, instruction). E.g. aime24 aime25; 'train=arithmetic:train' = the arithmetic "
                  "task's training problems (first max_eval_samples)."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N training rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N held-out rows."})
    ref_model_name_or_path: str | None = field(
        default=None, metadata={"help": "method armor: initial reference policy. Default: the initial policy."}
    )
    resume_best_as_reference: str | None = field(
        default=None,
        metadata={"help": "Stage 2 of the paper's protocol: start ARMOR from the best checkpoint of this earlier run "
                  "directory, as policy and reference. Best = trainer_state.json's best_model_checkpoint, else the "
                  "checkpoint whose step has the highest recorded validation score in val_metrics.jsonl "
                  "(collapse_guard_metric / metric_for_best_model, else the first val/…avg@n)."},
    )
    val_every_steps: int = field(default=0, metadata={"help": "Validate every N optimizer steps (0 = never)."})
    val_k: int = field(default=4, metadata={"help": "k of pass@k in validation."})
    val_num_samples: int | None = field(default=None, metadata={"help": "Samples per problem (default: val_k)."})
    val_temperature: float | None = field(default=None, metadata={"help": "Default: the training temperature."})
    val_top_p: float = field(default=1.0, metadata={"help": "top-p of validation sampling."})
    val_max_new_tokens: int | None = field(default=None, metadata={"help": "Default: max_completion_length."})
    val_batch_size: int = field(default=64, metadata={"help": "Sequences per generate call in validation."})
    val_jsonl: str | None = field(default=None, metadata={"help": "Default: <output_dir>/val_metrics.jsonl."})
    val_kl_prompts: int = field(
        default=0,
        metadata={"help": "Log val/kl_reverse_start (on policy samples) and val/kl_forward_start (on samples of the "
                  "start model drawn once): KL between the policy and the model training started from, on the first "
                  "N held-out prompts at every validation, for any method (0 = off). Keeps a copy of the trainable "
                  "weights (the whole model in a full fine-tune, the adapter with LoRA) in device memory; not with "
                  "ZeRO-3. Uses validation's temperature (> 0)."},
    )
    val_kl_samples: int = field(default=4, metadata={"help": "Completions per prompt for val_kl_prompts."})
    val_mode_classifier: str | None = field(
        default=None,
        metadata={"help": "Log each validation set's share of sampled completions per solution mode, val/mode/<mode> "
                  "(val/<name>/mode/<mode>): a registered classifier ('arithmetic': the mode testbed's worked/direct/"
                  "other, armor_trl.rewards.modes) or an import path 'pkg.mod:func' (completion text -> mode label)."},
    )
    dry_run: bool = field(default=False, metadata={"help": "Validate the recipe and exit without loading weights."})
    anchors_dataset: str | None = field(
        default=None,
        metadata={"help": "method armor with anchor_source='column': folder written by `armor-trl anchors`; its "
                  "anchors are added to the training set as anchor_column, matched by prompt."},
    )
    dataset_mixture: typing.Any = field(default=None, init=False, repr=False)  # TRL's `datasets:` (DatasetMixtureConfig)
    anchor_set_allow_other_reference: bool = field(
        default=False,
        metadata={"help": "Accept an anchors_dataset sampled from another model than this run's reference "
                  "(ref_model_name_or_path, else model_name_or_path). Default: refused, since the weight fingerprint "
                  "in its metadata.json must match; anchors from another model are not the reference's own samples."},
    )


def armor_only_fields() -> list[str]:
    """Fields that ArmorConfig adds to GRPOConfig."""
    from trl import GRPOConfig

    from armor_trl.config import ArmorConfig

    return sorted({f.name for f in fields(ArmorConfig)} - {f.name for f in fields(GRPOConfig)})
