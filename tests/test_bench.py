"""Tests of the bench (the `benchmarks` package, `python -m benchmarks`): its configuration file, its time split, and
a smoke run (one repetition of 1-2 tiny steps per variant) that checks structure only.

No timing assertions: timings on a shared CI machine mean nothing. `make bench` runs the real measurement.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the benchmarks package lives at the repository root, next to armor_trl
    sys.path.insert(0, str(REPO))

from benchmarks import config, instruments  # noqa: E402

BENCH = [sys.executable, "-m", "benchmarks"]
CONFIGS = [
    "grpo_b0", "grpo_b004", "armor_full", "armor_cache", "armor_cache_failures", "grpo_b004_lora", "armor_lora",
    "grpo_dynamic", "armor_dynamic", "armor_dynamic_eligible", "armor_dynamic_lazy", "armor_dynamic_keep",
    "armor_dynamic_deferred", "grpo_dynamic_batch", "armor_dynamic_deferred_batch", "grpo_dynamic_wide",
    "armor_dynamic_eligible_wide", "armor_dynamic_deferred_lazy", "armor_lazy", "armor_same_call", "armor_same_call_lora",
    "armor_column", "armor_column_lora", "grpo_tools_b004", "armor_tools",
]
REGIME_VARIANTS = [
    "grpo_b0", "grpo_b004", "armor_full", "armor_cache", "armor_column", "armor_same_call", "grpo_b004_lora", "armor_lora",
    "armor_column_lora", "armor_same_call_lora", "armor_lazy", "grpo_dynamic", "armor_dynamic", "armor_dynamic_eligible",
    "armor_dynamic_lazy", "armor_dynamic_keep", "armor_dynamic_deferred", "armor_dynamic_deferred_lazy",
    "grpo_dynamic_batch", "armor_dynamic_deferred_batch", "grpo_dynamic_wide", "armor_dynamic_eligible_wide",
    "grpo_tools_b004", "armor_tools",
]
ANCHOR_WORK = ["candidate_rows_per_step", "candidates_scored_per_step", "anchors_per_step", "candidate_rows_per_anchor",
               "eligible_share", "deferred_groups_per_step", "mixed_share"]
PARTS = ["policy_gen", "anchor_gen", "anchor_score", "ref_fwd", "reward", "gen_other", "loss_bwd", "push_ref",
         "push_policy", "policy_tools", "anchor_tools", "other"]


def test_bench_config_is_data_and_checked(tmp_path):
    bench = config.load()
    assert list(bench.variants) == CONFIGS
    assert bench.baselines == ("grpo_b004", "grpo_b004_lora")
    assert [v.name for v in bench.variants.values() if v.column] == ["armor_column", "armor_column_lora"]
    assert {name for name, v in bench.variants.items() if v.armor and v.trainer == "armor_trl"} == {
        n for n in CONFIGS if n.startswith("armor_")}
    assert set(bench.presets) == {"full", "smoke", "memory", "gpu"}
    assert bench.presets["gpu"]["device"] == "cuda" and bench.presets["gpu"]["arch"] == "qwen2"
    assert bench.regime["variants"] == REGIME_VARIANTS and bench.regime["mini_batches"] == [1, 4, 16]
    assert {(t["variant"], t["m"], t["bound"]) for t in bench.regime["targets"]} >= {
        ("armor_full", 16, 1.10), ("armor_lora", 16, 1.10), ("armor_same_call", 1, 1.05), ("armor_column", "all", 1.00)}
    bad = tmp_path / "bench.yaml"
    text = config.CONFIG_FILE.read_text()
    bad.write_text(text.replace("trainer: trl\n    beta: 0.0\n", "trainer: trl\n    armor: true\n", 1))
    with pytest.raises(ValueError, match="grpo_b0"):
        config.load(bad)
    bad.write_text(text.replace("variant: armor_full, base: grpo_b004", "variant: armor_fulll, base: grpo_b004", 1))
    with pytest.raises(ValueError, match="armor_fulll"):
        config.load(bad)


def test_split_separates_policy_and_anchor_generation():
    # ARMOR: TRL's generation call for the on-policy rows is timed apart from ARMOR's override around it
    armor = {"step_s": 1.0, "gs_total": 0.7, "gen_single_turn": 0.5, "policy_generate": 0.2, "anchor_generate": 0.25,
             "rewards": 0.05, "ref_fwd_armor": 0.1, "training_step": 0.25, "prepare_inputs": 0.0}
    parts = instruments.split(armor)
    assert list(parts) == PARTS
    assert parts["policy_gen"] == 0.2 and parts["anchor_gen"] == 0.25
    assert parts["anchor_score"] == pytest.approx(0.05)
    assert parts["gen_other"] == pytest.approx(0.05) and parts["other"] == pytest.approx(0.05)
    assert sum(parts.values()) == pytest.approx(1.0)
    # GRPO: no anchors, so everything in the generation call is the policy's
    grpo = {"step_s": 1.0, "gs_total": 0.7, "gen_single_turn": 0.5, "rewards": 0.05, "logps_in_gen": 0.1,
            "training_step": 0.25, "prepare_inputs": 0.0}
    parts = instruments.split(grpo)
    assert parts["policy_gen"] == 0.5 and parts["anchor_gen"] == 0.0 and parts["anchor_score"] == 0.0
    assert parts["push_ref"] == parts["push_policy"] == 0.0  # no vLLM engine


def test_split_times_the_engines_weight_pushes_on_their_own():
    # vLLM: π_ref's push happens in ARMOR's override (around the candidates' call), TRL's push of π_θ in its generation
    armor = {"step_s": 1.0, "gs_total": 0.7, "gen_single_turn": 0.5, "policy_generate": 0.2, "anchor_generate": 0.15,
             "ref_push": 0.06, "weight_sync": 0.1, "rewards": 0.05, "ref_fwd_armor": 0.1, "training_step": 0.25,
             "prepare_inputs": 0.0}
    parts = instruments.split(armor)
    assert parts["push_ref"] == 0.06 and parts["push_policy"] == pytest.approx(0.04)
    assert parts["policy_gen"] == pytest.approx(0.16) and parts["anchor_score"] == pytest.approx(0.09)
    assert sum(parts.values()) == pytest.approx(1.0)


def test_split_counts_the_draw_after_the_refill_loop_as_anchor_work():
    # issue 45: deferred candidates are drawn in _generate_and_score_completions, outside ARMOR's _generate_single_turn
    raw = {"step_s": 1.0, "gs_total": 0.8, "gen_single_turn": 0.3, "policy_generate": 0.2, "anchor_generate": 0.05,
           "deferred_anchors": 0.25, "anchor_generate_after": 0.15, "ref_push_after": 0.02, "weight_sync": 0.02,
           "rewards": 0.05, "ref_fwd_armor": 0.1, "training_step": 0.15, "prepare_inputs": 0.0}
    parts = instruments.split(raw)
    assert parts["anchor_gen"] == pytest.approx(0.2) and parts["push_ref"] == pytest.approx(0.02)
    assert parts["anchor_score"] == pytest.approx(0.05 + 0.08)  # in the round, and the rest of the draw after it
    assert parts["gen_other"] == pytest.approx(0.1) and sum(parts.values()) == pytest.approx(1.0)


def test_split_takes_the_tool_loops_turns_out_of_where_they_ran():
    # ARMOR, an anchored round: the rows' and the candidates' loops run inside its _generate_single_turn (_nested)
    raw = {"step_s": 1.0, "gs_total": 0.8, "gen_single_turn": 0.6, "policy_generate": 0.1, "anchor_generate": 0.1,
           "policy_tool_turns_nested": 0.15, "anchor_tool_turns_nested": 0.2, "rewards": 0.05, "ref_fwd_armor": 0.1,
           "training_step": 0.15, "prepare_inputs": 0.0}
    parts = instruments.split(raw)
    assert list(parts) == PARTS
    assert parts["policy_tools"] == 0.15 and parts["anchor_tools"] == 0.2
    assert parts["anchor_score"] == pytest.approx(0.05) and sum(parts.values()) == pytest.approx(1.0)
    # GRPO: TRL's loop runs beside its _generate_single_turn, in _generate_and_score_completions
    raw = {"step_s": 1.0, "gs_total": 0.8, "gen_single_turn": 0.3, "policy_tool_turns": 0.3, "rewards": 0.05,
           "logps_in_gen": 0.1, "training_step": 0.15, "prepare_inputs": 0.0}
    parts = instruments.split(raw)
    assert parts["policy_tools"] == 0.3 and parts["gen_other"] == pytest.approx(0.05)
    assert parts["policy_gen"] == 0.3 and sum(parts.values()) == pytest.approx(1.0)


@pytest.mark.slow
def test_bench_smoke_of_the_tool_workload(tmp_path):
    """GRPO and ARMOR with tools (the warm-started tool agent, TRL's loop): the time split shows the rows' tool turns
    and, for ARMOR, the candidates' own; the regime targets compare ARMOR with GRPO with the same tools."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    configs = ["grpo_b004", "grpo_tools_b004", "armor_tools"]
    proc = subprocess.run([*BENCH, "--smoke", "--configs", ",".join(configs), "--mini-batches", "1,16", "--out",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    summary, regime = result["summary"], result["regime"]["summary"]
    assert summary["grpo_b004"]["split_s"]["policy_tools"] == 0.0
    assert summary["grpo_tools_b004"]["split_s"]["policy_tools"] > 0
    assert summary["grpo_tools_b004"]["split_s"]["anchor_tools"] == 0.0
    assert summary["armor_tools"]["metrics"]["armor/anchor_found_frac"] >= 0
    for m in ("1", "16"):  # (the first step of a rollout batch is a same-call round: no routed candidates there)
        assert regime["armor_tools"][m]["split_s"]["policy_tools"] > 0, m
    assert any(regime["armor_tools"][m]["split_s"]["anchor_tools"] > 0 for m in ("1", "16"))
    tools = [t for t in result["regime"]["targets"] if "armor_tools" in t["target"]]
    assert [t["target"] for t in tools] == ["step armor_tools / grpo_tools_b004 at M=1 <= 1.30",
                                            "step armor_tools / grpo_tools_b004 at M=16 <= 1.15",
                                            "armor_tools measured / floor at M=1 <= 1.15",
                                            "armor_tools measured / floor at M=16 <= 1.05"]
    assert all(isinstance(t["met"], bool) and t["measured"] > 0 for t in tools)
    # the generate calls of the turns after a tool result, the training rows' and (ARMOR) the candidates' (the smoke
    # shape's agent may call no tool: counted, not required)
    assert summary["grpo_tools_b004"]["work"]["policy_turn_calls"] >= 0
    assert summary["grpo_b004"]["work"]["policy_turn_calls"] == summary["grpo_b004"]["work"]["anchor_turn_calls"] == 0
    assert all(regime["armor_tools"][m]["work"]["anchor_turn_calls"] >= 0 for m in ("1", "16"))
    assert all(regime["armor_tools"][m]["floor"]["kind"] == "tools" for m in ("1", "16"))


def test_the_turns_after_a_tool_result_are_counted_apart_for_the_rows_and_the_candidates():
    key = instruments._generate_key
    assert key(set()) == "policy_generate" and key({"anchor_gen"}) is None  # first turns (candidates': generate's)
    assert key({"tool_turns"}) == "policy_turn_generate"
    assert key({"tool_turns", "candidates", "single_turn"}) == "anchor_turn_generate"
    done = instruments.work({"policy_generate": 1, "policy_turn_generate": 2, "anchor_turn_generate": 3, "gen_turn": 9},
                            {})
    assert (done["policy_turn_calls"], done["anchor_turn_calls"]) == (2, 3)
    assert instruments.work({"gen_single_turn": 1, "gen_turn": 4}, {})["policy_turn_calls"] == 4  # GRPO: TRL's loop


def test_timers_count_rows_of_log_prob_passes_made_not_skipped():
    timers = instruments.Timers()
    passes = timers.wrap(lambda model, ids: (None, None, None) if model == "skip" else ("logps", None, None), "logps",
                         rows_fn=lambda args, result: 0 if result[0] is None else len(args[1]))
    generate = timers.wrap(lambda ids: ids, "policy_generate")
    passes("policy", [1, 2, 3])
    passes("skip", [1, 2, 3, 4])  # a round's π_old pass left to the batch that trains
    generate([1])
    generate([2])
    assert timers.step_rows["logps"] == 3
    wall, _, done = timers.take()
    assert done["policy_calls"] == 2 and done["anchor_calls"] == 0 and "logps" in wall
    assert timers.take()[2]["policy_calls"] == 0  # per step: the next starts from zero


def _regime_entry(step, policy_gen=0.0, policy_rows=0, ref_fwd=0.0, logp_rows=0, candidates=None):
    entry = {"cost_per_step_s": {"median": step}, "split_s": {"policy_gen": policy_gen, "ref_fwd": ref_fwd},
             "work": {"policy_rows": policy_rows, "logp_rows": logp_rows}}
    if candidates is not None:
        entry["anchor_work"] = {"candidate_rows_per_step": candidates}
    return entry


def test_the_floor_prices_what_armor_requires_at_the_runs_costs_per_row():
    from benchmarks import floor

    bench = config.load()
    summary = {
        "grpo_dynamic": {"16": _regime_entry(0.30, policy_gen=0.12, policy_rows=60)},  # 2 ms per generated row
        "grpo_b004": {"16": _regime_entry(0.25, ref_fwd=0.064, logp_rows=64)},  # 1 ms per log-prob row
        "armor_dynamic_eligible": {"16": _regime_entry(0.40, candidates=20.0)},
        "armor_full": {"16": _regime_entry(0.28, candidates=16.0)},  # not in the loop: no floor
    }
    # two measured optimizer steps after 16 warm-up ones; the rollout step logs 25% of 40 groups dropped for no anchor
    runs = [{"config": "armor_dynamic_eligible", "mini_batches": 16, "warmup_steps": 16, "steps": [{}] * 18,
             "dropped_by_step": [[16, 0.2, 0.2, 0.5, 40.0], [17, 0.3, 0.2, 0.25, 40.0]]}]
    floor.add(summary, runs, bench, g=8, train_rows=32)
    entry = summary["armor_dynamic_eligible"]["16"]["floor"]
    assert entry["gate_dropped_groups"] == pytest.approx(0.25 * 40 / 2)
    # 0.30 + 2 ms × (20 candidate rows + 5 groups × 7 on-policy rows) + 1 ms × 32 rows that train
    assert entry["floor_s"] == pytest.approx(0.30 + 0.002 * (20 + 5 * 7) + 0.001 * 32)
    assert entry["measured_over_floor"] == pytest.approx(0.40 / entry["floor_s"])
    assert "floor" not in summary["armor_full"]["16"] and "floor" not in summary["grpo_dynamic"]["16"]
    lines = floor.table(summary)
    assert any(line.startswith("| armor_dynamic_eligible | 16 |") for line in lines)
    from benchmarks import regime

    judged = {t["target"]: t["met"] for t in regime.check_targets(summary, bench)}
    assert judged["armor_dynamic_eligible measured / floor at M=16 <= 1.05"] is True  # 0.40 s against 0.442 s


def test_the_floor_splits_into_the_steps_parts_and_they_add_up_to_measured_minus_floor():
    from benchmarks import floor

    bench = config.load()
    base = _regime_entry(0.30, policy_gen=0.12, policy_rows=60)  # 2 ms per generated row
    base["split_s"].update(loss_bwd=0.10, reward=0.01)  # parts 0.23 s of a 0.30 s median step: 0.07 s not split
    base["work"]["policy_calls"] = 0.125
    armor = _regime_entry(0.50, policy_gen=0.15, policy_rows=62, ref_fwd=0.03, candidates=20.0)
    # the candidates: 20 rows in 0.2 calls per step, 0.06 s to generate (3 ms a row, priced at 2) + 0.004 s scoring
    armor["split_s"].update(anchor_gen=0.06, anchor_score=0.004, loss_bwd=0.11, reward=0.01)
    armor["work"].update(policy_calls=0.25, anchor_calls=0.2)
    summary = {"grpo_dynamic": {"16": base}, "grpo_b004": {"16": _regime_entry(0.25, ref_fwd=0.064, logp_rows=64)},
               "armor_dynamic_eligible": {"16": armor}}
    runs = [{"config": "armor_dynamic_eligible", "mini_batches": 16, "warmup_steps": 16, "steps": [{}] * 17,
             "dropped_by_step": [[17, 0.2, 0.2, 0.0, 40.0]]}]  # nothing dropped for want of an anchor
    floor.add(summary, runs, bench, g=8, train_rows=32)
    fl = summary["armor_dynamic_eligible"]["16"]["floor"]
    parts = fl["parts"]
    assert parts["floor"]["candidates"] == pytest.approx(0.002 * 20)
    assert parts["measured"]["candidates"] == pytest.approx(0.064)
    assert parts["floor"]["logps"] == pytest.approx(0.001 * 32) and parts["measured"]["logps"] == pytest.approx(0.03)
    assert parts["floor"]["policy"] == pytest.approx(0.12) and parts["floor"]["rest"] == pytest.approx(0.01)
    differences = sum(parts["measured"][p] - parts["floor"][p] for p in parts["floor"])
    assert differences + parts["unsplit"] == pytest.approx(0.50 - fl["floor_s"])
    assert parts["unsplit"] == pytest.approx((0.50 - 0.364) - 0.07)  # the parts sum to 0.364 s of 0.50
    assert parts["candidate_rows_per_call"] == pytest.approx(100) and parts["policy_rows_per_call"] == pytest.approx(248)
    assert parts["base_policy_rows_per_call"] == pytest.approx(480)
    row = next(line for line in floor.parts_table(summary) if line.startswith("| `armor_dynamic_eligible` | 16 |"))
    # measured − floor 0.50 − 0.372 s; candidates +24 ms at 3.20 ms a row against 2.00 priced
    assert "| +128.0 | +30.0 | +24.0 | -2.0 | +0.0 | +10.0 | +0.0 | +66.0 | 3.20 / 2.00 | 0.250 (0.125) + 0.200 |" in row


def _tool_entry(step, policy_gen=0.0, policy_tools=0.0, policy_rows=0, ref_fwd=0.0, logp_rows=0, candidates=None,
                anchor_gen=0.0, anchor_tools=0.0, anchor_calls=None):
    entry = _regime_entry(step, policy_gen, policy_rows, ref_fwd, logp_rows, candidates)
    entry["split_s"].update(policy_tools=policy_tools, anchor_gen=anchor_gen, anchor_tools=anchor_tools)
    entry["work"].update(anchor_calls=anchor_calls, anchor_turn_calls=None if anchor_calls is None else 1.0)
    return entry


def test_the_tool_loops_floor_prices_candidate_trajectories_over_all_their_turns():
    from benchmarks import floor

    bench = config.load()
    assert bench.tool_floor == {"variants": {"armor_tools": "grpo_tools_b004"}, "logp_price": "grpo_tools_b004"}
    summary = {
        # GRPO with tools: 32 trajectories per step, 0.20 s first turns + 0.12 s later turns: 10 ms per trajectory
        "grpo_tools_b004": {m: _tool_entry(0.90, policy_gen=0.20, policy_tools=0.12, policy_rows=32, ref_fwd=0.064,
                                           logp_rows=32) for m in ("1", "16")},
        # 16 candidate trajectories per step at 18 ms each, measured (their calls' fixed cost among it)
        "armor_tools": {m: _tool_entry(1.30, policy_rows=28, candidates=16.0, anchor_gen=0.16, anchor_tools=0.128,
                                       anchor_calls=2.0) for m in ("1", "16")},
        "armor_dynamic_eligible": {"16": _regime_entry(0.40, candidates=20.0)},  # no loop base here: no floor
    }
    floor.add(summary, [], bench, g=8, train_rows=32)
    entry = summary["armor_tools"]["1"]["floor"]
    assert entry["kind"] == "tools" and entry["base"] == "grpo_tools_b004"
    assert entry["gen_s_per_row"] == pytest.approx(0.01) and entry["candidate_s_per_row"] == pytest.approx(0.018)
    # 0.90 + 10 ms × (16 candidate trajectories − 4 anchor slots, one per group of 8) + no π_ref pass (β 0.04 base)
    assert entry["credited_rows"] == 4 and entry["ref_rows"] == 0 and entry["gate_dropped_groups"] == 0
    assert entry["floor_s"] == pytest.approx(0.90 + 0.01 * (16 - 4))
    assert entry["measured_over_floor"] == pytest.approx(1.30 / 1.02)
    assert "floor" not in summary["armor_dynamic_eligible"]["16"] and "floor" not in summary["grpo_tools_b004"]["1"]
    lines = floor.table(summary)
    assert any("against its floor" in line and "tool loop" in line for line in lines)
    assert "| armor_tools | 1 | grpo_tools_b004 | 1.300 | 1.44 | 1.020 | 1.27 | 16.0 | 2.00 + 1.00 | 0.00 | 4.0 | " \
           "28.0 / 32.0 | 10.00 | 18.00 | 2.00 × 0 |" in lines
    from benchmarks import regime

    judged = {t["target"]: t["met"] for t in regime.check_targets(summary, bench)}
    assert judged["armor_tools measured / floor at M=1 <= 1.15"] is False  # 1.27: the candidates' calls cost more
    assert judged["armor_tools measured / floor at M=16 <= 1.05"] is False
    # the model itself: π_ref's pass is added only where the base runs at β = 0, the gate's groups at G − slots rows
    assert floor.floor_s(1.0, 0.01, 0.002, 16, 2, 8, 1, 32, 4) == pytest.approx(1.0 + 0.01 * (16 + 14 - 4) + 0.064)


def test_the_further_bench_tables_are_configured_and_rendered_with_their_floor(tmp_path):
    from benchmarks import table

    bench = config.load()
    assert set(bench.tables) == {"tools", "tools_vllm", "dynamic_vllm"}
    vllm = bench.tables["dynamic_vllm"]
    assert {row["variant"] for row in vllm["rows"]} == {"grpo_b004", "armor_full", "armor_lazy", "grpo_dynamic",
                                                        "armor_dynamic_eligible", "armor_dynamic_deferred",
                                                        "armor_dynamic_lazy"}
    assert "--vllm" in vllm["arguments"] and "--mini-batches 1,16" in vllm["arguments"]
    assert "--regime-reps 3" in vllm["arguments"] and "--mixed-share 0.5" in vllm["arguments"]
    arguments = table.bench_arguments(bench, Path("out"), "dynamic_vllm")
    assert arguments[:2] == ["--configs", "grpo_b004,armor_full,armor_lazy,grpo_dynamic,armor_dynamic_eligible,"
                                          "armor_dynamic_deferred,armor_dynamic_lazy"]
    spec = table.spec_of(bench, "tools")
    assert spec.make == "bench-tools" and spec.start == "<!-- bench-table-tools:start -->"
    assert spec.pages == (Path("docs") / "performance.md",)
    result = {"meta": {"commit": "abc1234", "cpu_model": "Test CPU", "cpus": 2, "time": "2026-12-06 10:00:00",
                       "hidden": 128, "layers": 3, "g": 8, "k": 4, "mixed_share": None, "wall_s": 540.0,
                       "mode": "full"},
              "regime": {"meta": {"mini_batches": [1, 16], "reps": 3, "batch": 32},
                         "runs": [{"load": [0.5, 0.8]}], "summary": {
                             "grpo_tools_b004": {m: {"cost_per_step_s": {"median": 0.95}} for m in ("1", "16")},
                             "armor_tools": {m: {"cost_per_step_s": {"median": 1.3},
                                                 "vs_grpo_tools_b004": {"step": 1.37,
                                                                        "step_paired": {"min": 1.3, "max": 1.4}},
                                                 "floor": {"kind": "tools", "measured_over_floor": 1.12}}
                                             for m in ("1", "16")}}}}
    block = table.render(result, bench, "tools")
    assert block.startswith(spec.generated) and "Measured by `make bench-tools` at commit abc1234" in block
    assert "(`armor_tools`) | `grpo_tools_b004` | 1.37× (1.30–1.40) | 1.37× (1.30–1.40) |" in block
    assert "ARMOR on TRL's tool loop against its floor" in block and "| `armor_tools` | 1.12 | 1.12 |" in block
    assert "DAPO's loop against its floor" not in block
    # written into its own file and region, the other tables' regions untouched
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "bench.json").write_text(json.dumps(result))
    (tmp_path / "docs").mkdir()
    page = f"# Page\n{table.START}\nmain\n{table.END}\n{spec.start}\nold\n{spec.end}\nafter\n"
    (tmp_path / "docs" / "performance.md").write_text(page)
    table.write(tmp_path / "results" / "bench.json", tmp_path, "tools")
    text = (tmp_path / "docs" / "performance.md").read_text()
    assert table.region(text, spec) == block == (tmp_path / spec.file).read_text().strip()
    assert table.region(text) == "main" and text.endswith("after\n")
    with pytest.raises(ValueError, match="no bench table 'nope'"):
        table.spec_of(bench, "nope")


def test_the_bench_table_is_rendered_from_a_run_and_copied_between_the_markers(tmp_path):
    from benchmarks import table

    bench = config.load()
    result = {"meta": {"commit": "abc1234", "cpu_model": "Test CPU", "cpus": 2, "time": "2026-12-05 10:00:00",
                       "hidden": 128, "layers": 3, "g": 8, "k": 4, "mixed_share": 0.5, "wall_s": 1200.0,
                       "mode": "full"},
              "regime": {"meta": {"mini_batches": [1, 16], "reps": 3, "batch": 32},
                         "runs": [{"load": [1.0, 1.2]}, {"load": [1.1, 1.4]}], "summary": {}}}
    paired = {"min": 1.01, "max": 1.2}
    result["regime"]["summary"] = {
        "grpo_b004": {m: {"cost_per_step_s": {"median": 0.25}} for m in ("1", "16")},
        "armor_full": {m: {"cost_per_step_s": {"median": 0.3}, "vs_grpo_b004": {"step": 1.11, "step_paired": paired}}
                       for m in ("1", "16")},
        "armor_dynamic_eligible": {m: {"cost_per_step_s": {"median": 0.4}, "floor": {"measured_over_floor": 1.04},
                                       "vs_grpo_dynamic": {"step": 1.3, "step_paired": paired}} for m in ("1", "16")},
    }
    block = table.render(result, bench)
    assert "commit abc1234 on Test CPU (2 CPUs)" in block and "3 repetitions" in block and "load 1.20–1.40" in block
    result["meta"]["commit_at_end"] = "def5678+changes"  # the checkout moved on while the runs ran
    assert "commit abc1234 (at def5678+changes when it ended) on Test CPU" in table.render(result, bench)
    result["meta"]["commit_at_end"] = "abc1234"
    assert "(`grpo_b004`) | — | 0.250 s | 0.250 s |" in block
    assert "(`armor_full`) | `grpo_b004` | 1.11× (1.01–1.20) | 1.11× (1.01–1.20) |" in block
    assert "(`armor_dynamic_eligible`) | `grpo_dynamic` | 1.30× (1.01–1.20) |" in block
    assert "| `armor_dynamic_eligible` | 1.04 | 1.04 |" in block
    # the pages: the region is replaced, the rest kept; a page without the region is a clear error, none written
    for page in table.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text(f"# Page\n\nbefore\n{table.START}\nold\n{table.END}\nafter\n")
    (tmp_path / table.TABLE_FILE).write_text(block + "\n")
    table.sync(tmp_path, table.MAIN_SPEC)
    for page in table.PAGES:
        text = (tmp_path / page).read_text()
        assert table.region(text) == block and text.startswith("# Page\n\nbefore\n") and text.endswith("after\n")
    assert table.PAGES == (Path("docs") / "performance.md",)  # the README quotes cells, it holds no copy
    (tmp_path / "docs" / "performance.md").write_text("# no region\n")
    (tmp_path / table.TABLE_FILE).write_text("new\n")
    with pytest.raises(ValueError, match="performance.md has no bench-table region: add the line <!-- bench-table:start"):
        table.sync(tmp_path, table.MAIN_SPEC)
    assert (tmp_path / "docs" / "performance.md").read_text() == "# no region\n"  # untouched


def test_bench_smoke_writes_json_and_table(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run(
        [*BENCH, "--smoke", "--mixed-share", "0.5", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = json.loads((tmp_path / "bench.json").read_text())
    assert set(result) == {"meta", "summary", "targets", "anchor_work_targets", "runs", "regime"}
    meta = result["meta"]
    assert meta["mixed_share"] == 0.5
    assert meta["mode"] == "smoke" and meta["g"] == 8 and meta["k"] == 4 and meta["reps"] == 1
    # the smoke preset never repeats a run on a busy machine (the suite's): one attempt each, its load recorded
    assert meta["load_retries"] == 0 and all(len(run["load_attempts"]) == 1 for run in result["runs"])
    assert meta["configs"] == CONFIGS
    assert list(result["summary"]) == CONFIGS
    assert len(result["runs"]) == len(CONFIGS)  # one process per (configuration, repetition)

    for name, entry in result["summary"].items():
        assert entry["step_s"]["median"] > 0, name
        assert entry["peak_rss_mb"]["median"] > 0, name
        assert set(entry["split_s"]) == set(PARTS), name
        assert entry["vs_grpo_b004"]["step"] > 0 and entry["vs_grpo_b004"]["rss"] > 0, name
    summary, regime = result["summary"], result["regime"]
    assert summary["grpo_b004"]["vs_grpo_b004"]["step"] == 1.0
    assert summary["grpo_b004_lora"]["vs_grpo_b004_lora"]["step"] == 1.0
    # the instrumentation sees what each trainer does
    assert summary["grpo_b0"]["split_s"]["ref_fwd"] == 0.0
    assert summary["grpo_b004"]["split_s"]["ref_fwd"] > 0
    assert summary["grpo_b0"]["split_s"]["anchor_gen"] == 0.0
    assert summary["grpo_b0"]["split_s"]["anchor_score"] == 0.0
    for name in ("armor_full", "armor_cache", "armor_lora"):
        assert summary[name]["split_s"]["ref_fwd"] > 0, name
        assert summary[name]["reset_s"]["median"] > 0, name
        assert "armor/anchor_found_frac" in summary[name]["metrics"], name
    assert summary["armor_full"]["split_s"]["anchor_gen"] > 0
    assert summary["armor_full"]["split_s"]["anchor_score"] > 0 and summary["armor_full"]["split_s"]["policy_gen"] > 0
    assert summary["armor_full"]["reset_kind"] == "full" and summary["armor_lora"]["reset_kind"] == "lora"
    assert "armor/anchor_cache_hit_frac" in summary["armor_cache"]["metrics"]
    assert "whatif_merged_generation" in summary["armor_lora"]
    for name in ("grpo_dynamic", "armor_dynamic"):  # the refill cost is reported
        assert summary[name]["metrics"]["armor/generation_rounds"] >= 1, name
    # issue 36: the candidates' work, per optimizer step and per verified anchor, against each variant's paper path
    for name in ("armor_full", "armor_lazy", "armor_dynamic", "armor_dynamic_eligible", "armor_dynamic_lazy"):
        work = summary[name]["anchor_work"]
        assert set(ANCHOR_WORK) <= set(work) and work["candidate_rows_per_step"] >= 0, name
        assert work["vs_reference"]["reference"] == ("armor_dynamic" if "dynamic" in name else "armor_full"), name
        assert all(regime["summary"][name][m]["anchor_work"]["eligible_share"] is not None for m in ("1", "16"))
    assert summary["armor_dynamic"]["anchor_work"]["eligible_share"] == 1.0  # the paper's path: every group
    # issue 45: the work per optimizer step; log-probs only for the rows that train (π_old at M = 16, π_ref for ARMOR)
    rows = 16  # the smoke preset's rows per optimizer step
    for name, entry in summary.items():
        assert set(entry["work"]) == {"policy_calls", "policy_rows", "anchor_calls", "logp_rows", "policy_turn_calls",
                                      "anchor_turn_calls"}, name
        assert entry["work"]["policy_rows"] >= entry["work"]["policy_calls"] > 0, name
    assert regime["summary"]["grpo_dynamic"]["16"]["work"]["logp_rows"] == rows
    assert regime["summary"]["armor_dynamic"]["16"]["work"]["logp_rows"] <= 2 * rows
    assert summary["grpo_dynamic"]["work"]["policy_calls"] >= 1 and summary["grpo_dynamic"]["work"]["anchor_calls"] == 0
    for name in ("armor_dynamic_deferred", "armor_dynamic_deferred_lazy"):  # keep: nothing draws in its round
        work = summary[name]["anchor_work"]
        assert work["eligible_share"] == 0.0 and work["vs_reference"]["reference"] == "armor_dynamic_keep", name
    assert summary["armor_dynamic_deferred"]["work"]["anchor_calls"] <= 1  # one candidate call per rollout batch
    assert summary["armor_dynamic_keep"]["anchor_work"]["deferred_groups_per_step"] == 0.0
    assert summary["armor_dynamic"]["anchor_work"]["mixed_share"] is not None
    assert "anchor_work" not in summary["grpo_b004"]
    assert all(t["met"] in (True, False) for t in result["anchor_work_targets"])  # judged: the run's share is 0.5
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

    # the paper's regime: M optimizer steps per rollout batch, cost per optimizer step
    assert regime["meta"]["mini_batches"] == [1, 4, 16]
    assert regime["meta"]["variants"] == REGIME_VARIANTS and list(regime["summary"]) == REGIME_VARIANTS
    assert len(regime["runs"]) == len(REGIME_VARIANTS) * 3
    for run in regime["runs"]:  # whole rollout batches: a multiple of M optimizer steps
        assert len(run["steps"]) % run["mini_batches"] == 0 and len(run["steps"]) > run["warmup_steps"]
    for name, by_m in regime["summary"].items():
        assert list(by_m) == ["1", "4", "16"], name
        for m, entry in by_m.items():
            assert entry["cost_per_step_s"]["median"] > 0 and set(entry["split_s"]) == set(PARTS), (name, m)
            assert entry["vs_grpo_b004"]["step"] > 0 and entry["vs_grpo_b004"]["rss"] > 0, (name, m)
    assert regime["summary"]["grpo_b004"]["16"]["vs_grpo_b004"]["step"] == 1.0
    assert regime["summary"]["armor_full"]["16"]["split_s"]["anchor_gen"] > 0
    assert regime["summary"]["armor_column"]["16"]["split_s"]["anchor_gen"] == 0.0
    for name in ("armor_same_call", "armor_same_call_lora"):  # the hybrid phase: candidates in the policy's own call
        assert summary[name]["split_s"]["anchor_gen"] == 0.0 and summary[name]["metrics"]["armor/anchor_same_call"] == 1
        assert all(regime["summary"][name][m]["split_s"]["anchor_gen"] == 0.0 for m in ("1", "4", "16")), name
    assert regime["targets"] and all(isinstance(t["met"], bool) for t in regime["targets"])
    assert (tmp_path / "regime.png").stat().st_size > 0
    assert regime["meta"]["pregeneration"]["prompts"] == regime["meta"]["prompts"] == 16 // 8 * 16

    table = (tmp_path / "bench.md").read_text()
    assert table in proc.stdout
    for name in CONFIGS:
        assert f"| {name} |" in table
    assert "| config | policy_gen | anchor_gen |" in table
    assert "| target | measured" in table
    assert "| config | M | s/opt step" in table and "| armor_lora | 16 |" in table
    assert "| config | candidate rows / opt step |" in table and "| config | M | candidate rows / opt step |" in table
    assert "| config | M | policy generate calls / opt step |" in table
    assert "| target | measured | paired range | met |" in table
    # ARMOR in DAPO's loop against its floor, at every M
    for name in ("armor_dynamic", "armor_dynamic_eligible", "armor_dynamic_lazy", "armor_dynamic_keep",
                 "armor_dynamic_deferred", "armor_dynamic_deferred_lazy"):
        for m in ("1", "4", "16"):
            fl = regime["summary"][name][m]["floor"]
            assert fl["floor_s"] > regime["summary"]["grpo_dynamic"][m]["cost_per_step_s"]["median"], (name, m)
            assert fl["measured_over_floor"] > 0 and fl["gen_s_per_row"] > 0 and fl["logp_s_per_row"] > 0, (name, m)
            assert f"| {name} | {m} |" in table.split("against its floor")[1]
        assert regime["summary"][name]["16"]["vs_grpo_dynamic"]["step"] > 0
    assert all("floor" not in regime["summary"][name][m] for name in ("armor_full", "grpo_dynamic") for m in ("1", "16"))
    # ARMOR on TRL's tool loop against its floor (the base: GRPO with the same tools), at every M
    for m in ("1", "4", "16"):
        fl = regime["summary"]["armor_tools"][m]["floor"]
        assert fl["kind"] == "tools" and fl["base"] == "grpo_tools_b004" and fl["measured_over_floor"] > 0, m
        assert fl["credited_rows"] == 16 // 8 and fl["ref_rows"] == 0 and fl["candidate_s_per_row"] > 0, m
        assert f"| armor_tools | {m} | grpo_tools_b004 |" in table.split("tool loop against its floor")[1]

    # the tables can be rendered again from the saved raw runs, without training
    again = subprocess.run(
        [*BENCH, "--from-json", str(tmp_path / "bench.json"), "--out", str(tmp_path / "again")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "again" / "bench.md").read_text() == table


def test_gpu_preset_path_runs_on_cpu_at_a_small_shape(tmp_path):
    """The GPU preset's code path (a Qwen2 model with Qwen2.5-0.5B's proportions, the preset's training overrides,
    the regime) at a tiny shape on the CPU: what scripts/gpu_check.sh --full runs on a GPU, checked for structure here."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run(
        [*BENCH, "--preset", "gpu", "--device", "cpu", "--hidden", "64", "--layers", "1", "--completion", "8",
         "--batch", "16", "--steps", "2", "--warmup", "1", "--reps", "1", "--prompts", "4", "--configs",
         "grpo_b004,armor_same_call", "--mini-batches", "1,2", "--regime-reps", "1", "--load-retries", "0",
         "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["meta"]["arch"] == "qwen2" and result["meta"]["device"] == "cpu"
    assert list(result["regime"]["summary"]) == ["grpo_b004", "armor_same_call"]
    assert result["regime"]["summary"]["armor_same_call"]["1"]["split_s"]["anchor_gen"] == 0.0
    with pytest.raises(subprocess.CalledProcessError):  # CUDA is refused where there is none, before any work
        subprocess.run([*BENCH, "--preset", "gpu", "--out", str(tmp_path / "cuda")], cwd=REPO, env=env, check=True,
                       capture_output=True, text=True, timeout=120)


def test_the_throwaway_turn_report_gives_each_processs_share_of_its_training(tmp_path):
    from benchmarks import throwaway_turn

    ranks = [{"rank": 0, "steps": 8, "train_s": 40.0, "throwaway_turns": 0, "throwaway_s": 0.0},
             {"rank": 1, "steps": 8, "train_s": 40.0, "throwaway_turns": 12, "throwaway_s": 1.2}]
    for record in ranks:
        (tmp_path / f"rank{record['rank']}.json").write_text(json.dumps(record))
    result = throwaway_turn.report(tmp_path)
    assert result["throwaway_share"] == [0.0, pytest.approx(0.03)]
    assert result["throwaway_ms"] == [None, pytest.approx(100.0)]
    assert json.loads((tmp_path / "throwaway_turn.json").read_text())["ranks"] == ranks
