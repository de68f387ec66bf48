"""The bench's settings as data: variants, baselines, targets, presets and defaults, read from ``bench.yaml``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

CONFIG_FILE = Path(__file__).with_name("bench.yaml")
TRAINERS = ("trl", "armor_trl")
REWARDS = ("digit", "digit_01")
WHATIFS = ("generate_rows", "merged_generation")
QUANTITIES = ("step", "rss", "lora_reset")


@dataclass(frozen=True)
class Variant:
    """One trainer set-up to measure."""

    name: str
    description: str
    trainer: str = "trl"  # trl: trl.GRPOTrainer; armor_trl: ArmorGRPOTrainer
    armor: bool = False  # anchors and the mixed ratio on (ArmorGRPOTrainer only)
    beta: float = 0.0
    lora: bool = False
    reward: str = "digit"
    args: dict = field(default_factory=dict)  # further ArmorConfig fields
    whatif: tuple = ()
    tools: bool = False  # the tool workload: the warm-started tool agent, chat prompts, tools=[add] (TRL's tool loop)

    @property
    def column(self) -> bool:
        """Trains on pre-generated anchors (needs the bulk pass before the runs)."""
        return self.args.get("anchor_source") == "column"


@dataclass(frozen=True)
class Target:
    label: str
    variant: str
    base: str
    quantity: str  # step | rss | lora_reset
    bound: float


@dataclass(frozen=True)
class BenchConfig:
    variants: dict  # name -> Variant, in run order
    baseline: str
    lora_baseline: str
    targets: list
    presets: dict  # name -> {"shape": {...}, "calibration_draws": int, "whatif_repeats": int, optional "load_retries"}
    defaults: dict
    training: dict
    lora: dict
    regime: dict  # {"variants": [...], "mini_batches": [...], "targets": [...]}
    anchor_work: dict = field(default_factory=dict)  # {"reference": {variant: its paper path}, "targets": [...]}
    loop_floor: dict = field(default_factory=dict)  # {"base": grpo_dynamic, "logp_price": grpo_b004} (floor.py)
    tool_floor: dict = field(default_factory=dict)  # {"variants": {armor_tools: grpo_tools_b004}, "logp_price": ...}
    table: dict = field(default_factory=dict)  # the current bench table (table.py): {"arguments": ..., "rows": [...]}
    tables: dict = field(default_factory=dict)  # further tables (table.py): name -> {"file", "marker", "make", ...}

    @property
    def baselines(self) -> tuple:
        return (self.baseline, self.lora_baseline)


def _variant(name: str, fields: dict) -> Variant:
    variant = Variant(name=name, **{**fields, "whatif": tuple(fields.get("whatif", ()))})
    problems = []
    if variant.trainer not in TRAINERS:
        problems.append(f"trainer must be one of {TRAINERS}")
    if variant.armor and variant.trainer != "armor_trl":
        problems.append("armor: true needs trainer: armor_trl")
    if variant.reward not in REWARDS:
        problems.append(f"reward must be one of {REWARDS}")
    if variant.args and variant.trainer != "armor_trl":
        problems.append("args are ArmorConfig fields: trainer must be armor_trl")
    if set(variant.whatif) - set(WHATIFS) or (variant.whatif and not variant.armor):
        problems.append(f"whatif takes {WHATIFS}, on ARMOR variants")
    if variant.tools and (variant.lora or variant.column or variant.whatif):
        problems.append("tools: true is built for full fine-tuning with online anchors (no lora, column, whatif)")
    if problems:
        raise ValueError(f"bench variant {name!r}: " + "; ".join(problems))
    return variant


def load(path: Path | str = CONFIG_FILE) -> BenchConfig:
    raw = yaml.safe_load(Path(path).read_text())
    variants = {name: _variant(name, fields) for name, fields in raw["variants"].items()}
    targets = [Target(**row) for row in raw["targets"]]
    config = BenchConfig(
        variants=variants, baseline=raw["baselines"]["full"], lora_baseline=raw["baselines"]["lora"],
        targets=targets, presets=raw["presets"], defaults=raw["defaults"], training=raw["training"], lora=raw["lora"],
        regime=raw.get("regime") or {"variants": [], "mini_batches": []},
        anchor_work=raw.get("anchor_work") or {}, loop_floor=raw.get("loop_floor") or {},
        tool_floor=raw.get("tool_floor") or {}, table=raw.get("bench_table") or {},
        tables=raw.get("bench_tables") or {},
    )
    named = config.baselines + tuple(n for t in targets for n in (t.variant, t.base)) + tuple(config.regime["variants"])
    for name in named:
        if name not in variants:
            raise ValueError(f"{path}: {name!r} is not a variant")
    work = config.anchor_work
    named = tuple(work.get("reference", {}).items()) + tuple((t["variant"], t["base"]) for t in work.get("targets", []))
    for name in (n for pair in named for n in pair):
        if name not in variants:
            raise ValueError(f"{path}: anchor_work names {name!r}, which is not a variant")
    tool_names = [n for pair in (config.tool_floor.get("variants") or {}).items() for n in pair]
    tool_names += [config.tool_floor["logp_price"]] if config.tool_floor else []
    table_rows = config.table.get("rows", []) + [row for t in config.tables.values() for row in t.get("rows", [])]
    for name in list(config.loop_floor.values()) + tool_names + [n for row in table_rows for n in
                                                                 (row["variant"], row["base"])]:
        if name not in variants:
            raise ValueError(f"{path}: loop_floor, tool_floor, bench_table or bench_tables names {name!r}, which is not "
                             "a variant")
    for name, settings in config.tables.items():
        missing = {"file", "marker", "make", "arguments", "rows"} - set(settings)
        if missing or name == "main":
            raise ValueError(f"{path}: bench_tables.{name} needs file, marker, make, arguments and rows (missing: "
                             f"{sorted(missing)}); 'main' is bench_table's name")
    for name, base in (config.tool_floor.get("variants") or {}).items():
        if not (variants[name].armor and variants[name].tools and variants[base].tools and not variants[base].armor):
            raise ValueError(f"{path}: tool_floor: {name!r} must be an ARMOR variant with tools and its base {base!r} "
                             "one with tools and without ARMOR")
    for target in targets:
        if target.quantity not in QUANTITIES:
            raise ValueError(f"{path}: target {target.label!r}: quantity must be one of {QUANTITIES}")
    if any(not isinstance(m, int) or m < 1 for m in config.regime["mini_batches"]):
        raise ValueError(f"{path}: regime mini_batches must be positive integers")
    for target in config.regime.get("targets", []):
        if target["variant"] not in config.regime["variants"] or target["base"] not in config.regime["variants"]:
            raise ValueError(f"{path}: regime target {target}: variant and base must be regime variants")
        if target["quantity"] not in ("step", "rss", "floor") or not (target["m"] == "all" or isinstance(target["m"], int)):
            raise ValueError(f"{path}: regime target {target}: quantity is step, rss or floor, m an integer or 'all'")
    return config
