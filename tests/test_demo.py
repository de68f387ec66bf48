"""The offline demo: `armor-trl demo --smoke` writes metrics, a plot and a summary, deterministically, never
overwriting an earlier run; the summary numbers are computed correctly."""

from __future__ import annotations

import json

import pytest

from armor_trl.experiments import demo
from armor_trl.cli import main

TIMING = ("time", "per_second", "runtime")


def _records(path):
    """Metric records without wall-clock values (which differ between identical runs)."""
    return [{k: v for k, v in json.loads(line).items() if not any(t in k for t in TIMING)}
            for line in path.read_text().splitlines()]


def test_smoke_demo_writes_results_deterministically(tmp_path, capsys, monkeypatch):
    assert main(["demo", "--smoke", "--output_dir", str(tmp_path)]) == 0
    first = capsys.readouterr().out
    (run_dir,) = tmp_path.glob("run-*")
    assert sorted(p.name for p in (run_dir / "metrics").iterdir()) == [
        "armor-seed0.jsonl", "grpo-seed0.jsonl", "grpo_kl-seed0.jsonl", "grpo_small_lr-seed0.jsonl"]
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["smoke"] and set(summary["methods"]) == {"grpo", "grpo_kl", "grpo_small_lr", "armor"}
    assert summary["methods"]["armor"]["anchors_found"] is not None and summary["methods"]["grpo"]["anchors_found"] is None
    for line in ("| method | start val | peak val", "| GRPO (β=0) |", "| GRPO + KL |", "| GRPO, lr × (G−1)/G |", "| ARMOR |"):
        assert line in first
    armor = _records(run_dir / "metrics" / "armor-seed0.jsonl")
    assert armor[0]["step"] == 0 and "val/avg@4" in armor[0]  # the warm checkpoint's validation
    assert any("armor/anchor_found_frac" in r for r in armor) and any("val/pass@4" in r for r in armor[1:])
    kl = _records(run_dir / "metrics" / "grpo_kl-seed0.jsonl")
    assert any("kl" in r for r in kl)  # the KL baseline really trains with beta > 0
    small = _records(run_dir / "metrics" / "grpo_small_lr-seed0.jsonl")
    plain = _records(run_dir / "metrics" / "grpo-seed0.jsonl")
    lr = lambda records: next(r["learning_rate"] for r in records if "learning_rate" in r)  # noqa: E731
    assert lr(small) == pytest.approx(lr(plain) * 7 / 8)  # the control runs at α × the learning rate

    # A second run: the warm checkpoint comes from the cache, results go to a new folder, numbers are identical.
    import armor_trl.tiny

    monkeypatch.setattr(armor_trl.tiny, "build_tiny_model", lambda *a, **k: pytest.fail("warm checkpoint not cached"))
    assert main(["demo", "--smoke", "--output_dir", str(tmp_path)]) == 0
    second_dir = next(p for p in tmp_path.glob("run-*") if p != run_dir)
    for name in ("armor-seed0.jsonl", "grpo-seed0.jsonl", "grpo_kl-seed0.jsonl"):
        assert _records(second_dir / "metrics" / name) == _records(run_dir / "metrics" / name)


def _run(method, val, rewards, anchors=None):
    key = "armor/policy_reward_mean" if method == "armor" else "reward"
    history = [{"step": 5 * (i + 1), key: r, **({"armor/anchor_found_frac": anchors} if anchors else {})}
               for i, r in enumerate(rewards)]
    return {"method": method, "seed": 0, "wall_time": 10.0, "history": history,
            "validation": [{"step": 10 * i, "val/avg@4": v} for i, v in enumerate(val)]}


def test_summary_numbers():
    summary = demo.summarize_run(_run("armor", [0.4, 0.6, 0.5, 0.45], [0.5] * 9 + [1.0], anchors=0.75))
    assert summary["start_val"] == 0.4 and summary["peak_val"] == 0.6 and summary["peak_step"] == 10
    assert summary["final_val"] == 0.45 and summary["drop_from_peak"] == pytest.approx(0.15)
    assert summary["final_train_reward"] == 1.0 and summary["anchors_found"] == 0.75
    assert demo.summarize_run(_run("grpo", [0.5, 0.4], [0.2]))["anchors_found"] is None
    table = demo.aggregate([demo.summarize_run(_run("grpo", [0.5, v], [0.2])) for v in (0.4, 0.6)])
    assert table["peak_val"]["mean"] == pytest.approx(0.55) and table["peak_val"]["std"] == pytest.approx(0.0707, abs=1e-4)
    assert "0.550 ± 0.071" in demo.format_table({"grpo": table}, seeds=2)


def test_fresh_run_dirs_never_collide(tmp_path):
    dirs = {demo.fresh_run_dir(str(tmp_path), smoke=False) for _ in range(3)}
    assert len(dirs) == 3 and all(d.is_dir() for d in dirs)


def test_missing_recipe_is_a_clear_error(tmp_path, capsys):
    assert main(["demo", "--smoke", "--config", str(tmp_path / "nope.yaml"), "--output_dir", str(tmp_path)]) == 2
    assert "not found" in capsys.readouterr().err
