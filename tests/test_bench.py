"""Smoke test of benchmarks/bench.py: one repetition of 1-2 tiny steps per configuration; checks structure only.

No timing assertions: timings on a shared CI machine mean nothing. `make bench` runs the real measurement.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "bench.py"
CONFIGS = [
    "grpo_b0", "grpo_b004", "armor_full", "armor_cache", "armor_cache_failures", "grpo_b004_lora", "armor_lora",
    "grpo_dynamic", "armor_dynamic", "armor_column", "armor_column_lora",
]
PARTS = ["policy_gen", "anchor_gen", "anchor_score", "ref_fwd", "reward", "gen_other", "loss_bwd", "other"]


def test_bench_smoke_writes_json_and_table(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = json.loads((tmp_path / "bench.json").read_text())
    assert set(result) == {"meta", "summary", "targets", "runs"}
    meta = result["meta"]
    assert meta["mode"] == "smoke" and meta["g"] == 8 and meta["k"] == 4 and meta["reps"] == 1
    assert meta["configs"] == CONFIGS
    assert list(result["summary"]) == CONFIGS
    assert len(result["runs"]) == len(CONFIGS)  # one process per (configuration, repetition)

    for name, entry in result["summary"].items():
        assert entry["step_s"]["median"] > 0, name
        assert entry["peak_rss_mb"]["median"] > 0, name
        assert set(entry["split_s"]) == set(PARTS), name
        assert entry["vs_grpo_b004"]["step"] > 0 and entry["vs_grpo_b004"]["rss"] > 0, name
    summary = result["summary"]
    assert summary["grpo_b004"]["vs_grpo_b004"]["step"] == 1.0
    assert summary["grpo_b004_lora"]["vs_grpo_b004_lora"]["step"] == 1.0
    # the instrumentation sees what each trainer does
    assert summary["grpo_b0"]["split_s"]["ref_fwd"] == 0.0
    assert summary["grpo_b004"]["split_s"]["ref_fwd"] > 0
    assert summary["grpo_b0"]["split_s"]["anchor_gen"] == 0.0
    for name in ("armor_full", "armor_cache", "armor_lora"):
        assert summary[name]["split_s"]["ref_fwd"] > 0, name
        assert summary[name]["reset_s"]["median"] > 0, name
        assert "armor/anchor_found_frac" in summary[name]["metrics"], name
    assert summary["armor_full"]["split_s"]["anchor_gen"] > 0
    assert summary["armor_full"]["reset_kind"] == "full" and summary["armor_lora"]["reset_kind"] == "lora"
    assert "armor/anchor_cache_hit_frac" in summary["armor_cache"]["metrics"]
    assert "whatif_merged_generation" in summary["armor_lora"]
    for name in ("grpo_dynamic", "armor_dynamic"):  # the refill cost is reported
        assert summary[name]["metrics"]["armor/generation_rounds"] >= 1, name
    for name in ("armor_column", "armor_column_lora"):  # pre-generated anchors: no reference generation at all
        assert summary[name]["split_s"]["anchor_gen"] == 0.0, name
        assert summary[name]["split_s"]["ref_fwd"] > 0, name
        assert summary[name]["metrics"]["armor/anchor_found_frac"] > 0, name
    assert meta["pregeneration"]["prompts_per_s"] > 0 and meta["pregeneration"]["num_candidates"] == 2 * meta["k"]
    assert meta["anchor_break_even"]["break_even_epochs"] is not None
    for run in result["runs"]:
        assert len(run["steps"]) == meta["steps"]
        assert run["peak_rss_mb"] >= run["rss_start_mb"] > 0

    assert [t["target"] for t in result["targets"]] == [
        "step time armor_full / grpo_b004 <= 1.25",
        "step time armor_cache / grpo_b004 <= 1.10",
        "step time armor_cache_failures / grpo_b004 <= 1.10",
        "peak RSS armor_full / grpo_b004 <= 1.05",
        "LoRA reset / armor_lora step < 0.01",
        "step time armor_column / grpo_b004 <= 1.05",
        "step time armor_column_lora / grpo_b004_lora <= 1.05",
        "peak RSS armor_column / grpo_b004 <= 1.05",
    ]
    assert all(isinstance(t["met"], bool) and t["measured"] > 0 for t in result["targets"])

    table = (tmp_path / "bench.md").read_text()
    assert table in proc.stdout
    for name in CONFIGS:
        assert f"| {name} |" in table
    assert "| config | policy_gen | anchor_gen |" in table
    assert "| target | measured" in table

    # the tables can be rendered again from the saved raw runs, without training
    again = subprocess.run(
        [sys.executable, str(BENCH), "--from-json", str(tmp_path / "bench.json"), "--out", str(tmp_path / "again")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "again" / "bench.md").read_text() == table
