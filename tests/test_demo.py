"""The offline demo: `armor-trl demo --smoke` runs the mode testbed's four arms as a study over seeds, writes
metrics, plots with bands and a summary, resumes without retraining, and its headline follows the summary."""

from __future__ import annotations

import json

import pytest

from armor_trl.app.cli import main
from armor_trl.app.experiments import demo, plan
from armor_trl.app.experiments.runner import read_curves
from armor_trl.app.experiments.summary import summarize

PNG = b"\x89PNG\r\n\x1a\n"


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_smoke_demo_runs_the_testbed_arms_over_seeds_and_resumes(tmp_path, capsys, monkeypatch):
    assert main(["demo", "--smoke", "--seeds", "2", "--workers", "1", "--output_dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    # progress while it runs (the full demo's warm-up takes minutes): the warm-up's steps, then the runs
    assert "warm-up (seed 0)" in captured.err and "calibration avg@4" in captured.err
    assert "study runs" in captured.err and "8/8" in captured.err
    folder = tmp_path / "mode_testbed-smoke"
    expected = sorted(f"{arm}-seed{seed}.jsonl" for arm in demo.ARMS for seed in (0, 1))
    assert sorted(p.name for p in (folder / "metrics").iterdir()) == expected
    for png in ("curves.png", "kl.png", "reference.png"):
        assert (folder / png).read_bytes()[:8] == PNG
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["recipe"].endswith("mode_testbed.yaml") and summary["smoke"] and summary["seeds"] == [0, 1]
    assert summary["warmup_seeds"] == [demo.WARMUP_SEED] and summary["primary"] == []  # one warm checkpoint
    for png in ("modes.png", "start_kl.png"):  # the mode testbed's own plots: mode shares, KL to the start model
        assert (folder / png).read_bytes()[:8] == PNG
    assert list(summary["table"]) == list(demo.ARMS) and summary["runs_executed"] == 8
    for label in ("| GRPO (β=0) |", "| GRPO + KL (β=0.1) |", "| GRPO, lr × α |", "| ARMOR |",
                  "Paired difference vs GRPO (β=0)", "docs/evidence.md", str(folder / "summary.md")):
        assert label in out
    warm = summary["warmups"][0]  # the user sees which warm checkpoint their machine built
    assert (f"Warm checkpoint (warm-up seed {warm['seed']}): {warm['steps']} supervised steps, calibration avg@4 "
            f"{warm['calibration_avg@4']:.3f}") in out and "Machine: " in out

    kl = _records(folder / "metrics" / "grpo_kl_0.1-seed0.jsonl")
    assert any("kl" in r for r in kl)  # the KL baseline really trains with beta > 0
    lr = lambda records: next(r["learning_rate"] for r in records if "learning_rate" in r)  # noqa: E731
    small, plain = (_records(folder / "metrics" / f"{arm}-seed0.jsonl") for arm in ("grpo_small_lr", "grpo"))
    assert lr(small) == pytest.approx(lr(plain) * 7 / 8)  # the control runs at α × the learning rate
    armor = _records(folder / "metrics" / "armor-seed1.jsonl")
    assert armor[0]["step"] == 0 and "val/avg@16" in armor[0] and any("armor/anchor_found_frac" in r for r in armor)

    # a rerun trains nothing (the warm model is cached, every run finished) and prints the same table
    import armor_trl.app.tiny

    monkeypatch.setattr(armor_trl.app.tiny, "build_tiny_model", lambda *a, **k: pytest.fail("warm checkpoint not cached"))
    assert main(["demo", "--smoke", "--seeds", "2", "--workers", "1", "--output_dir", str(tmp_path)]) == 0
    again = capsys.readouterr().out
    assert "0 run(s) trained now" in again
    headline = lambda text: text[text.index("mode_testbed, 2 seeds"):text.index("Details")]  # noqa: E731
    assert headline(again) == headline(out)


@pytest.mark.slow
def test_the_tool_use_demo_runs_grpo_the_tuned_kl_and_armor_through_the_tool_loop(tmp_path, capsys):
    """`armor-trl demo --config configs/tool_use_testbed.yaml` (smoke): the recipe's demo arms and seeds, the tool agent's
    warm start, validation through TRL's tool loop with the held-out tool-call rate in the files and the headline."""
    assert main(["demo", "--smoke", "--config", str(plan.CONFIGS / "tool_use_testbed.yaml"), "--workers", "1",
                 "--output_dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "tool_use_testbed-smoke"
    assert sorted(p.name for p in (folder / "metrics").iterdir()) == ["armor-seed0.jsonl", "grpo-seed0.jsonl",
                                                                      "grpo_kl_1.6-seed0.jsonl"]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["warmups"][0]["kind"] == "tool_agent" and summary["warmups"][0]["steps"] == 20
    for arm in ("grpo", "grpo_kl_1.6", "armor"):
        first = _records(folder / "metrics" / f"{arm}-seed0.jsonl")[0]
        assert {"val/tool_call_rate", "val/tool_calls", "val/mode/tool", "val/train/tool_call_rate"} <= set(first)
        curves = read_curves(folder / "metrics" / f"{arm}-seed0.jsonl")
        assert curves["modes"]["tool_called"][0] == (0, first["val/tool_call_rate"])
        assert curves["set_modes"]["train"]["tool_called"][0] == (0, first["val/train/tool_call_rate"])
    assert "Held-out tool-call rate" in out and "supervised steps;" in out and "GRPO + KL (β=1.6)" in out
    assert "Kept the tool" in out and "configs/tool_use_study.yaml" in out and "configs/mode_testbed.yaml" not in out  # its own study


def _curve(val, reward=0.5):
    return {"val": val, "train": [(s, reward) for s, _ in val], "kl_reverse": [], "kl_forward": [],
            "anchors_found": [], "ref_weights_step": [], "val_key": "val/avg@4", "val_problems": 1000,
            "val_samples": 4}


def test_headline_follows_the_summary():
    curves = {
        "grpo": {0: _curve([(0, 0.45), (50, 0.52), (100, 0.40)]), 1: _curve([(0, 0.46), (50, 0.50), (100, 0.42)])},
        "armor": {0: _curve([(0, 0.45), (50, 0.51), (100, 0.44)]), 1: _curve([(0, 0.46), (50, 0.50), (100, 0.45)])},
    }
    summary = summarize(curves, resamples=200)
    summary.update(out="results/demo/x", seeds=[0, 1], runs_executed=4, wall_time_s=12.0,
                   recipe="configs/mode_testbed.yaml")
    text = demo.format_demo(summary)
    final = summary["comparisons"]["grpo"]["armor"]["metrics"]["final"]
    assert final["mean"] == pytest.approx(0.035)
    low, high = final["ci"]
    assert f"ARMOR final: +0.035 [{low:+.3f}, {high:+.3f}] (higher)" in text
    assert "| GRPO (β=0) | 0.455 ± 0.007 | 0.510 ± 0.014 | 0.410 ± 0.014 |" in text
    # the collapse count: grpo seed 0 ends 0.12 below its peak and below its start; seed 1 0.08 (no); rewards flat
    assert summary["table"]["grpo"]["collapsed"] == {"count": 0, "n": 2}
    assert "4 run(s) trained now, 12 s." in text and text.startswith("mode_testbed, 2 seeds (0, 1)")


def test_missing_recipe_is_a_clear_error(tmp_path, capsys):
    assert main(["demo", "--smoke", "--config", str(tmp_path / "nope.yaml"), "--output_dir", str(tmp_path)]) == 2
    assert "not found" in capsys.readouterr().err


def test_read_curves_of_the_demo_metrics_need_validation(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    with pytest.raises(ValueError, match="val_every_steps"):
        read_curves(path)


def test_corrupt_experiment_files_are_named(tmp_path):
    """A metrics file cut short, a corrupt study.json, an arms file with a repeated key: one error naming the file."""
    metrics = tmp_path / "grpo-seed0.jsonl"
    metrics.write_text('{"step": 0, "val/avg@4": 0.5}\n{"step": 1, "val/av')
    with pytest.raises(ValueError, match=f"{metrics}: line 2 is not valid JSON"):
        read_curves(metrics)
    arms = tmp_path / "arms.yaml"
    arms.write_text("arms:\n  grpo: {}\n  grpo: {beta: 0.1}\n")
    with pytest.raises(ValueError, match=f"{arms}:3:3: invalid YAML: duplicate key 'grpo'"):
        plan.load_arms({}, arms)
    arms.write_text("arms: [grpo]\n")
    with pytest.raises(ValueError, match=f"Arms file {arms} must be a mapping"):
        plan.load_arms({}, arms)
    (tmp_path / "study.json").write_text('{"recipe": ')
    with pytest.raises(ValueError, match=f"{tmp_path / 'study.json'}: not valid JSON"):
        plan.check_study_folder(tmp_path, {"recipe": {}, "smoke_overrides": None, "model": None, "arms": {}})


def test_demo_real_prints_a_line_per_step(capsys):
    from types import SimpleNamespace

    callback = demo.step_lines("demo --real: ARMOR")
    state = SimpleNamespace(max_steps=4, global_step=0)
    callback.on_train_begin(None, state, None)
    state.global_step = 1
    callback.on_step_end(None, state, None)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "demo --real: ARMOR: training 4 step(s)"
    assert lines[1].startswith("demo --real: ARMOR: step 1/4 done, ") and lines[1].endswith(" s elapsed")


def test_an_agents_headline_says_which_arm_kept_the_tool():
    """An agent's demo: per arm the held-out tool-call rate, start → end, and whether the arm kept the tool (its final
    rate at least half its start, the pre-registered study's "lost the tool" turned round)."""
    curves = {arm: {0: _curve([(0, 0.2), (60, 0.1)])} for arm in ("grpo", "armor")}
    summary = summarize(curves, resamples=200)
    summary["at_points"] = {"grpo": {"mode/tool_called": {"start": 0.7, "end": 0.02}},
                            "armor": {"mode/tool_called": {"start": 0.7, "end": 0.35}}}
    summary.update(out="results/demo/x", seeds=[0], runs_executed=2, wall_time_s=5.0,
                   recipe="configs/tool_use_testbed.yaml")
    text = demo.format_demo(summary)
    assert "GRPO (β=0) 0.700 → 0.020; ARMOR 0.700 → 0.350" in text
    assert "Kept the tool (its final rate at least half its start): ARMOR. Lost it: GRPO (β=0)." in text
    assert demo.VERDICTS["tool_use_testbed"] in text  # what the pre-registered study decided, under the table
