"""`armor-trl study`: the statistics against direct computations on made-up curves, the arms, and a 2-arm × 2-seed
smoke study that writes its files, resumes by re-running only missing runs, and summarises what it wrote."""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
from pathlib import Path

import pytest
import yaml

from armor_trl.app.cli import main
from armor_trl.app.experiments import plan, stats, study
from armor_trl.app.experiments.runner import read_curves, resolve_overrides
from armor_trl.app.experiments.summary import format_summary, summarize
from armor_trl.app.recipe.loading import load_recipe

REPO = Path(__file__).resolve().parents[1]


# --- statistics on made-up curves ------------------------------------------------------------------------------
def test_run_metrics_and_auc_by_hand():
    val = [(0, 0.4), (10, 0.6), (30, 0.5), (40, 0.45), (50, 0.55)]
    train = [(s, r) for s, r in zip(range(5, 105, 5), [0.1] * 18 + [0.8, 1.0])]  # 20 logs: the last 2 count
    m = stats.run_metrics(val, train)
    assert (m["start"], m["peak"], m["peak_step"], m["final"], m["min_after_peak"]) == (0.4, 0.6, 10, 0.55, 0.45)
    # trapezoids: 10·0.5 + 20·0.55 + 10·0.475 + 10·0.5 = 25.75 over 50 steps
    assert m["auc"] == pytest.approx(25.75 / 50)
    assert m["final_train_reward"] == pytest.approx(0.9)
    assert stats.run_metrics([(0, 0.3)], [])["auc"] == 0.3 and stats.run_metrics([(0, 0.3)], [])["final_train_reward"] is None
    assert stats.mean_std([0.5, 0.7]) == pytest.approx({"mean": 0.6, "std": 0.1414214, "n": 2})


def test_collapse_criterion():
    rising = [(s, r) for s, r in zip(range(10), [0.5] * 5 + [0.9] * 5)]
    falling = [(s, r) for s, r in zip(range(10), [0.9] * 5 + [0.5] * 5)]
    val = [(0, 0.45), (50, 0.52), (100, 0.41)]  # 0.11 below the peak, below the start
    assert stats.run_metrics(val, rising)["collapsed"] is True
    assert stats.run_metrics(val, falling)["collapsed"] is False  # training reward fell too: not the failure
    assert stats.run_metrics([(0, 0.45), (50, 0.52), (100, 0.43)], rising)["collapsed"] is False  # drop 0.09
    assert stats.run_metrics([(0, 0.40), (50, 0.52), (100, 0.41)], rising)["collapsed"] is False  # above start
    assert stats.run_metrics(val, [])["collapsed"] is None


def test_reference_accuracy_is_the_validation_at_the_step_its_weights_come_from():
    val = [(0, 0.45), (50, 0.52), (100, 0.47), (150, 0.40)]
    # static until a reset at 100 (validated), then one at 125 (not validated)
    weights = [(25, 0), (75, 0), (100, 100), (125, 125), (150, 125)]
    ref = stats.reference_accuracy(val, weights)
    assert ref["curve"] == [(25, 0.45), (75, 0.45), (100, 0.47)]
    assert ref["sources"] == [0, 100, 125] and ref["unmeasured"] == [125]
    # a rollback (collapse guard): π_ref holds the best checkpoint's weights from step 50 on
    assert stats.reference_accuracy(val, [(100, 50), (150, 50)])["curve"] == [(100, 0.52), (150, 0.52)]
    summary = summarize({"armor": {0: {"val": val, "train": [], "kl_reverse": [], "kl_forward": [],
                                       "anchors_found": [], "ref_weights_step": weights, "val_key": "val/avg@4",
                                       "val_problems": 10, "val_samples": 4}}}, resamples=10)
    assert summary["table"]["armor"]["ref_val_end"]["mean"] == 0.47
    assert summary["table"]["armor"]["ref_unmeasured_steps"] == [125]
    assert "not validated" in format_summary({**summary, "arms": ["armor"], "seeds": [0], "recipe": "r",
                                              "model": "m", "smoke": False, "runs_executed": 0, "workers": 1,
                                              "wall_time_s": 0.0})


def _exact_bootstrap(values, level=0.95):
    """Quantiles of the bootstrap distribution itself: every equally likely resample of the values, enumerated;
    the q-quantile is the smallest mean m with P(mean ≤ m) ≥ q."""
    means = sorted(statistics.fmean(c) for c in itertools.product(values, repeat=len(values)))
    tail = (1 - level) / 2
    return tuple(means[math.ceil(q * len(means)) - 1] for q in (tail, 1 - tail))


def test_bootstrap_ci_matches_the_enumerated_bootstrap():
    # 3 seeds: each all-equal resample has probability 1/27 > 2.5%, so the 95% interval is exactly [min, max]
    assert _exact_bootstrap([0.02, 0.05, 0.11]) == pytest.approx((0.02, 0.11))
    assert stats.bootstrap_ci([0.02, 0.05, 0.11], resamples=10_000, seed=0) == pytest.approx((0.02, 0.11))
    assert stats.bootstrap_ci([0.05, -0.01], seed=3) == pytest.approx((-0.01, 0.05))  # 2 seeds: 1/4 at each end
    five = [0.1, -0.05, 0.2, 0.03, 0.12]
    assert stats.bootstrap_ci(five, seed=0) == pytest.approx(_exact_bootstrap(five), abs=0.02)
    assert stats.bootstrap_ci(five, seed=7) == stats.bootstrap_ci(five, seed=7)  # seeded: reproducible


def test_verdict_follows_the_interval():
    assert stats.verdict((0.01, 0.2)) == "higher"
    assert stats.verdict((-0.2, -0.01)) == "lower"
    assert stats.verdict((-0.01, 0.2)) == "no detectable difference"
    assert stats.verdict((0.0, 0.2)) == "no detectable difference"
    assert stats.verdict(None).startswith("no detectable difference")


def _curves(vals, steps=(0, 10, 20, 30)):
    return {"val": list(zip(steps, vals)), "train": [(5, 0.5), (15, 0.7)]}


def test_paired_comparison_at_matched_steps():
    base = {0: _curves([0.5, 0.6, 0.4], (0, 10, 20)), 1: _curves([0.5, 0.5, 0.3], (0, 10, 20)),
            2: _curves([0.4, 0.5, 0.4], (0, 10, 20)), 9: _curves([0.1, 0.1, 0.1], (0, 10, 20))}
    # the arm validated once more (step 30), which the comparison must ignore; seed 9 has no partner
    arm = {0: _curves([0.5, 0.6, 0.5, 0.0]), 1: _curves([0.5, 0.6, 0.45, 0.0]), 2: _curves([0.4, 0.5, 0.42, 0.0])}
    result = stats.paired_comparison(arm, base, resamples=2000, seed=1)
    assert result["seeds"] == [0, 1, 2]
    final = result["metrics"]["final"]
    assert final["diffs"] == pytest.approx([0.1, 0.15, 0.02]) and final["mean"] == pytest.approx(0.09)
    assert final["ci"] == pytest.approx((0.02, 0.15)) and final["verdict"] == "higher"
    assert result["metrics"]["peak"]["diffs"] == pytest.approx([0.0, 0.1, 0.0])
    assert result["metrics"]["peak"]["verdict"] == "no detectable difference"
    # auc on steps 0..20, trapezoids: seed 1 arm 5.5 + 5.25, base 5 + 4 → (10.75 − 9) / 20
    assert result["metrics"]["auc"]["diffs"] == pytest.approx([0.5 / 20, 1.75 / 20, 0.1 / 20])
    assert result["metrics"]["final_train_reward"]["diffs"] == pytest.approx([0.0, 0.0, 0.0])
    assert [s["step"] for s in result["by_step"]] == [0, 10, 20]
    worse = stats.paired_comparison(base, arm, resamples=2000)
    assert worse["metrics"]["final"]["verdict"] == "lower"


def test_trailing_mean():
    assert stats.trailing_mean([1, 2, 3, 4], 2).tolist() == [1.0, 1.5, 2.5, 3.5]


# --- arms ------------------------------------------------------------------------------------------------------
REQUIRED_ARMS = ("grpo", "grpo_kl_0.01", "grpo_small_lr", "grpo_dynamic", "gate_only", "armor", "armor_mix_only",
                 "armor_anchor_only", "armor_unfiltered", "armor_reset_50", "qae", "qae_armor")


def test_every_shipped_arm_is_a_valid_recipe(tiny_model_path, tmp_path):
    recipe = yaml.safe_load((REPO / "configs" / "tiny_demo.yaml").read_text())
    arms, default = plan.load_arms(recipe)
    assert set(REQUIRED_ARMS) <= set(arms) and set(default) <= set(arms)
    resolved = plan.check_arms(arms, recipe, str(REPO / "configs" / "tiny_demo.yaml"), tiny_model_path)
    assert resolved["grpo_small_lr"]["learning_rate"] == pytest.approx(3e-4 * 7 / 8)
    assert "lr_scale" not in resolved["grpo_small_lr"]

    bad = tmp_path / "arms.yaml"
    bad.write_text("arms: {typo_arm: {method: armor, use_anchorz: false}}\n")
    bad_arms, _ = plan.load_arms(recipe, bad)
    with pytest.raises(ValueError, match="arm 'typo_arm'.*use_anchorz"):
        plan.check_arms(bad_arms, recipe, str(REPO / "configs" / "tiny_demo.yaml"), tiny_model_path)


def test_arms_from_the_recipe_and_lr_scale():
    recipe = {"learning_rate": 1e-3, "num_generations": 4,
              "study": {"arms": {"grpo": {"method": "grpo", "beta": 0.5}, "mine": {"lr_scale": 0.5}}}}
    arms, _ = plan.load_arms(recipe)
    assert arms["grpo"] == {"method": "grpo", "beta": 0.5} and "armor" in arms and "mine" in arms
    assert resolve_overrides({"lr_scale": "alpha"}, recipe) == {"learning_rate": pytest.approx(0.75e-3)}
    assert resolve_overrides({"lr_scale": "alpha", "armor_alpha": 0.5}, recipe)["learning_rate"] == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="lr_scale"):
        resolve_overrides({"lr_scale": "half"}, recipe)
    with pytest.raises(ValueError, match="Unknown arm.*nope"):
        plan.select_arms(arms, ["grpo", "nope"])
    with pytest.raises(ValueError, match="study: section"):
        plan.load_arms({"study": {"armz": {}}})



def test_an_arms_file_with_base_adds_to_that_files_arms(tmp_path, tiny_model_path):
    """configs/study/mode_search.yaml (the mode testbed's plain-GRPO search) adds its arms to arms.yaml, so the
    recipe's study.select still finds grpo_kl_*; its own arms are valid plain-GRPO recipes; a bad base is named."""
    recipe_file = REPO / "configs" / "mode_testbed.yaml"
    recipe = load_recipe(str(recipe_file))
    search = REPO / "configs" / "study" / "mode_search.yaml"
    arms, _ = plan.load_arms(recipe, search)
    own = [a for a in arms if a.startswith("s") and a[1:3].isdigit()]
    assert len(own) >= 10 and {"grpo", "grpo_kl_0.04", "armor"} <= set(arms)
    assert all(arms[a]["method"] == "grpo" and arms[a]["beta"] == 0.0 for a in own)  # the search is plain GRPO only
    plan.load_selection(recipe["study"], arms)  # grpo_kl_best's candidates come from the base file
    plan.check_arms({a: arms[a] for a in own}, recipe, str(recipe_file), tiny_model_path)
    overriding = tmp_path / "mine.yaml"
    overriding.write_text(f"base: {os.path.relpath(REPO / 'configs' / 'study' / 'arms.yaml', tmp_path)}\n"
                          "arms: {grpo: {method: grpo, beta: 0.5}}\n")
    mine, default = plan.load_arms({}, overriding)
    assert mine["grpo"] == {"method": "grpo", "beta": 0.5} and "armor" in mine and default == ["grpo", "grpo_small_lr",
                                                                                               "armor"]
    for base in ("missing.yaml", "mine.yaml"):
        overriding.write_text(f"base: {base}\narms: {{}}\n")
        with pytest.raises(ValueError, match=f"Arms file .*mine.yaml: base must name another arms file.*{base}"):
            plan.load_arms({}, overriding)

# --- a smoke study ---------------------------------------------------------------------------------------------
def _study(out, *extra):
    return main(["study", "--smoke", "--arms", "grpo,armor", "--seeds", "2", "--workers", "1", "--resamples", "500",
                 "--out", str(out), *extra])


def test_smoke_study_files_resume_and_statistics(tmp_path, capsys):
    out = tmp_path / "study" / "smoke"
    assert _study(out) == 0
    names = ["armor-seed0.jsonl", "armor-seed1.jsonl", "grpo-seed0.jsonl", "grpo-seed1.jsonl"]
    assert sorted(p.name for p in (out / "metrics").iterdir()) == names
    for png in ("curves.png", "kl.png", "reference.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Paired differences: arm − grpo" in (out / "summary.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs_executed"] == 4 and summary["seeds"] == [0, 1]
    assert set(summary["table"]) == {"grpo", "armor"} and set(summary["table"]["grpo"]) >= set(stats.METRICS)
    assert list(summary["comparisons"]) == ["grpo"] and list(summary["comparisons"]["grpo"]) == ["armor"]
    assert summary["evaluation"]["problems"] == 16 and summary["evaluation"]["samples"] == 4

    # the summary follows the files: per-seed final differences computed directly from the JSONL
    curves = {(arm, seed): read_curves(out / "metrics" / f"{arm}-seed{seed}.jsonl")
              for arm in ("grpo", "armor") for seed in (0, 1)}
    direct = [curves["armor", s]["val"][-1][1] - curves["grpo", s]["val"][-1][1] for s in (0, 1)]
    final = summary["comparisons"]["grpo"]["armor"]["metrics"]["final"]
    assert final["diffs"] == pytest.approx(direct) and final["n"] == 2
    assert summary["table"]["armor"]["final"]["mean"] == pytest.approx(
        statistics.fmean(curves["armor", s]["val"][-1][1] for s in (0, 1)))
    armor_records = [json.loads(line) for line in (out / "metrics" / "armor-seed0.jsonl").read_text().splitlines()]
    assert any("armor/ref_resets" in r for r in armor_records)  # ARMOR metrics reach the file (a step whose tokens are all masked logs no KL)
    # a static reference holds the warm model (step 0): its accuracy is that run's step-0 validation
    assert {r["armor/ref_weights_step"] for r in armor_records if "armor/ref_weights_step" in r} == {0}
    start = statistics.fmean(curves["armor", s]["val"][0][1] for s in (0, 1))
    assert summary["table"]["armor"]["ref_val_end"]["mean"] == pytest.approx(start)
    assert summary["table"]["grpo"]["ref_val_end"] is None
    assert {r["arm"] for r in armor_records} == {"armor"}

    # resume: a finished study runs nothing; a deleted result is the only run re-executed
    kept = {n: (out / "metrics" / n).stat().st_mtime_ns for n in names if n != "armor-seed1.jsonl"}
    run_time = sum(json.loads((out / "metrics" / n).read_text().splitlines()[0])["run_wall_time_s"] for n in names)
    assert summary["run_time_s"] == pytest.approx(run_time) and run_time > 0
    assert _study(out) == 0
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["runs_executed"] == 0 and resumed["run_time_s"] == pytest.approx(run_time)  # kept on a resume
    (out / "metrics" / "armor-seed1.jsonl").unlink()
    assert _study(out) == 0
    assert json.loads((out / "summary.json").read_text())["runs_executed"] == 1
    assert (out / "metrics" / "armor-seed1.jsonl").is_file()
    assert {n: (out / "metrics" / n).stat().st_mtime_ns for n in kept} == kept

    # other baselines: the summary pairs grpo with armor; an unknown baseline is refused
    assert _study(out, "--baselines", "armor") == 0
    comparisons = json.loads((out / "summary.json").read_text())["comparisons"]
    assert list(comparisons) == ["armor"]
    assert comparisons["armor"]["grpo"]["metrics"]["final"]["diffs"] == pytest.approx([-d for d in direct])
    capsys.readouterr()
    assert _study(out, "--baselines", "grpo,nope") == 2 and "nope" in capsys.readouterr().err

    # the folder refuses a changed definition of an arm it already ran
    arms_file = tmp_path / "arms.yaml"
    arms_file.write_text("arms: {grpo: {method: grpo, beta: 0.2}, armor: {method: armor}}\n")
    capsys.readouterr()
    assert _study(out, "--arms_file", str(arms_file)) == 2
    assert "arm 'grpo'" in capsys.readouterr().err


def test_unknown_arm_is_a_clear_error(tmp_path, capsys):
    assert main(["study", "--smoke", "--arms", "grpo,armr", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "armr" in err and "known arms" in err


# --- several warm checkpoints, primary comparisons, arms chosen on tuning seeds -----------------------------------
def _finals(out, arm, warm, seeds=(0, 1)):
    return [read_curves(out / "metrics" / f"{arm}-warm{warm}-seed{s}.jsonl")["val"][-1][1] for s in seeds]


def test_smoke_study_over_warm_checkpoints_names_files_resumes_and_reports_per_warm(tmp_path):
    import os
    import subprocess

    from armor_trl.app.experiments.runner import read_recipe, smoke_version, warm_start

    out = tmp_path / "study" / "warm"
    assert _study(out, "--warmup_seeds", "0,1", "--primary", "armor:grpo") == 0
    names = sorted(f"{arm}-warm{w}-seed{s}.jsonl" for arm in ("grpo", "armor") for w in (0, 1) for s in (0, 1))
    assert sorted(p.name for p in (out / "metrics").iterdir()) == names
    summary = json.loads((out / "summary.json").read_text())
    assert summary["warmup_seeds"] == [0, 1] and summary["runs_executed"] == 8 and summary["seeds"] == [0, 1]
    assert [w["seed"] for w in summary["warmups"]] == [0, 1]
    assert all(w["steps"] > 0 and "calibration_avg@4" in w for w in summary["warmups"])
    models = summary["model"]
    assert models["0"] != models["1"] and [w["model"] for w in summary["warmups"]] == [models["0"], models["1"]]
    # warm-up seed 0 is the recipe's own: the very checkpoint (cache key, folder) a one-warm study uses
    _, recipe = read_recipe(REPO / "configs" / "tiny_demo.yaml")
    settings, overrides = smoke_version(recipe)
    assert warm_start({**recipe, **overrides}, settings, out.parent / "cache")[0] == models["0"]
    first = json.loads((out / "metrics" / "armor-warm1-seed0.jsonl").read_text().splitlines()[0])
    assert (first["warmup_seed"], first["seed"], first["run"]) == (1, 0, "armor-warm1-seed0")

    # pairs share warm checkpoint and seed; per-warm tables follow each warm checkpoint's own files
    final = summary["comparisons"]["grpo"]["armor"]["metrics"]["final"]
    for w in (0, 1):
        direct = [a - b for a, b in zip(_finals(out, "armor", w), _finals(out, "grpo", w))]
        assert final["diffs"][str(w)] == pytest.approx(direct)
        assert summary["per_warm"][str(w)]["table"]["armor"]["final"]["mean"] == pytest.approx(
            statistics.fmean(_finals(out, "armor", w)))
    assert final["n"] == 4 and "sign_holds_on_every_warm" in final and "per_warm" in final
    assert summary["means"]["armor"]["final"]["mean"] == pytest.approx(statistics.fmean(
        statistics.fmean(_finals(out, "armor", w)) for w in (0, 1)))
    assert [(p["arm"], p["baseline"], list(p["metrics"])) for p in summary["primary"]] == [
        ("armor", "grpo", list(stats.PRIMARY))]
    text = (out / "summary.md").read_text()
    for part in ("× warm-up seeds [0, 1] × seeds [0, 1]", "## Warm checkpoint 1 (warm-up seed 1)",
                 "## Primary comparisons", "hierarchical percentile bootstrap", "sign on every warm", "Machine: "):
        assert part in text

    # the machine and the code the numbers came from
    assert summary["machine"]["cpu_model"] and summary["machine"]["cpu_cores"] == os.cpu_count()
    assert summary["machine"]["torch_threads_per_run"] == 1
    assert len(summary["runs"]) == 8 and all(r["wall_time_s"] > 0 for r in summary["runs"])
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert summary["git"]["commit"] == head.stdout.strip()

    # resume: only the deleted run is trained again
    kept = {n: (out / "metrics" / n).stat().st_mtime_ns for n in names if n != "armor-warm1-seed1.jsonl"}
    (out / "metrics" / "armor-warm1-seed1.jsonl").unlink()
    assert _study(out, "--warmup_seeds", "0,1") == 0
    assert json.loads((out / "summary.json").read_text())["runs_executed"] == 1
    assert {n: (out / "metrics" / n).stat().st_mtime_ns for n in kept} == kept


def test_study_folder_takes_more_warm_checkpoints_but_not_other_ones(tmp_path):
    folder = {"recipe": {"x": 1}, "smoke_overrides": {}, "arms": {"grpo": {}}}
    plan.check_study_folder(tmp_path, {**folder, "model": {"warm0": "a", "warm1": "b"}})
    plan.check_study_folder(tmp_path, {**folder, "model": {"warm0": "a", "warm2": "c"}})
    assert json.loads((tmp_path / "study.json").read_text())["model"] == {"warm0": "a", "warm1": "b", "warm2": "c"}
    with pytest.raises(ValueError, match="different model"):
        plan.check_study_folder(tmp_path, {**folder, "model": {"warm1": "other"}})
    with pytest.raises(ValueError, match="different model"):  # one warm checkpoint: other file names, other folder
        plan.check_study_folder(tmp_path, {**folder, "model": "a"})


def test_study_folder_keeps_its_runs_when_only_the_demos_own_settings_change(tmp_path):
    """`armor-trl demo`'s arms, seeds and overrides shape the demo alone; the demo's warm-up shapes every run."""
    warmup = {"kind": "tool_agent", "steps": 1200, "seed": 0}
    folder = {"smoke_overrides": {}, "arms": {"grpo": {}}, "model": "a"}
    plan.check_study_folder(tmp_path, {**folder, "recipe": {"x": 1, "demo": {"warmup": warmup}}})
    plan.check_study_folder(tmp_path, {**folder, "recipe": {"x": 1, "demo": {
        "warmup": warmup, "arms": ["grpo", "armor"], "seeds": 1, "overrides": {"max_steps": 60}}}})
    with pytest.raises(ValueError, match="different recipe"):
        plan.check_study_folder(tmp_path, {**folder, "recipe": {"x": 1, "demo": {"warmup": {**warmup, "steps": 9}}}})


def test_study_folder_keeps_its_runs_when_only_the_study_section_changes(tmp_path):
    """The study: section (which runs, which comparisons, a criterion) does not change how a run trains; any other
    recipe key does."""
    folder = {"recipe": {"x": 1, "study": {"seeds": 3}}, "smoke_overrides": {}, "arms": {"grpo": {}}, "model": "m"}
    plan.check_study_folder(tmp_path, folder)
    plan.check_study_folder(tmp_path, {**folder, "recipe": {"x": 1, "study": {"seeds": 3, "criterion": {}}}})
    plan.check_study_folder(tmp_path, {**folder, "recipe": {"x": 1}})
    with pytest.raises(ValueError, match="different recipe"):
        plan.check_study_folder(tmp_path, {**folder, "recipe": {"x": 2, "study": {"seeds": 3}}})


def test_study_folder_keeps_its_runs_when_the_recipe_marks_its_model_unset(tmp_path):
    """`model_name_or_path: null` in a recipe whose warm start builds the model changes no run: a folder made before
    the recipe marked it resumes; a model the recipe names is a different recipe."""
    folder = {"recipe": {"x": 1}, "smoke_overrides": {}, "arms": {"grpo": {}}, "model": "m"}
    plan.check_study_folder(tmp_path, folder)
    plan.check_study_folder(tmp_path, {**folder, "recipe": {"x": 1, "model_name_or_path": None}})
    with pytest.raises(ValueError, match="different recipe"):
        plan.check_study_folder(tmp_path, {**folder, "recipe": {"x": 1, "model_name_or_path": "other"}})


def _write_run(path, values):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": 10 * i, "val/avg@4": v}) + "\n" for i, v in enumerate(values)))


def test_select_best_takes_the_best_mean_over_warm_checkpoints_and_tuning_seeds(tmp_path):
    finals = {("a", 0): [0.5, 0.3], ("a", 1): [0.4, 0.4], ("b", 0): [0.6, 0.6], ("b", 1): [0.2, 0.4],
              ("c", 0): [0.2, 0.2], ("c", 1): [0.2, 0.2], ("d", 0): [0.5, 0.3], ("d", 1): [0.4, 0.4]}
    for (arm, warm), values in finals.items():
        for seed, value in zip((10, 11), values):
            _write_run(study.metrics_path(tmp_path, arm, seed, warm), [0.3, value])
    pick = lambda among, seeds: plan.select_best(tmp_path, {"among": among, "metric": "final"}, seeds, [0, 1],  # noqa: E731
                                                  lambda w: w)
    choice = pick(["c", "a", "b"], [10, 11])  # means of the warm means: a 0.4, b (0.6 + 0.3) / 2 = 0.45, c 0.2
    assert choice["chosen"] == "b" and choice["tuning_seeds"] == [10, 11] and choice["metric"] == "final"
    assert {arm: score["mean"] for arm, score in choice["scores"].items()} == pytest.approx(
        {"c": 0.2, "a": 0.4, "b": 0.45})
    assert choice["scores"]["b"]["per_warm"] == pytest.approx({0: 0.6, 1: 0.3})
    assert pick(["a", "b"], [10])["chosen"] == "a"  # only the tuning seeds count: on seed 10, a 0.45, b 0.4
    assert pick(["d", "a"], [10, 11])["chosen"] == "d"  # a tie: the first listed


def test_smoke_study_chooses_an_arm_on_tuning_seeds_and_reports_it_under_its_alias(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base: {REPO / 'configs' / 'tiny_demo.yaml'}\n"
                      "study: {select: {grpo_best: [grpo, grpo_small_lr]}, tuning_seeds: [10],\n"
                      "        primary: [[armor, grpo_best]]}\n")
    out = tmp_path / "study" / "select"
    assert main(["study", "--config", str(recipe), "--smoke", "--arms", "grpo_best,armor", "--seeds", "1",
                 "--workers", "1", "--resamples", "200", "--output_dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    chosen = summary["selection"]["grpo_best"]["chosen"]  # files are named by the arm that ran, reports by the alias
    assert sorted(p.name for p in (out / "metrics").iterdir()) == sorted(
        {"grpo-seed10.jsonl", "grpo_small_lr-seed10.jsonl", "armor-seed0.jsonl", f"{chosen}-seed0.jsonl"})
    choice = summary["selection"]["grpo_best"]
    assert choice["among"] == ["grpo", "grpo_small_lr"] and choice["tuning_seeds"] == [10]
    finals = {arm: read_curves(out / "metrics" / f"{arm}-seed10.jsonl")["val"][-1][1] for arm in choice["among"]}
    assert choice["chosen"] == max(choice["among"], key=finals.get)
    assert list(summary["table"]) == ["grpo_best", "armor"] and summary["runs_executed"] == 4
    assert [r["tuning"] for r in summary["runs"]] == [True, True, False, False]
    assert summary["primary"][0]["baseline"] == "grpo_best"
    assert "`grpo_best` = `" in (out / "summary.md").read_text()


def test_smoke_study_extends_a_grid_at_its_edge_and_composes_arms_from_the_choices(tmp_path):
    """select: extend adds arms when the choice sits at the grid's edge (pre-registered rule), and compose: builds
    arms from the choices: tuned ARMOR with the tuned KL's beta (ARMOR + KL), GRPO at lr x the tuned ARMOR's alpha."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"base: {REPO / 'configs' / 'tiny_demo.yaml'}\n"
        "study:\n"
        "  tuning_seeds: [10]\n"
        "  arms: {armor_a06: {method: armor, armor_alpha: 0.6}}\n"
        "  select:\n"
        "    kl_best: {among: [grpo_kl_0.01, grpo_kl_0.04], extend: {grpo_kl_0.04: [grpo_kl_0.1]}}\n"
        "    armor_best: [armor, armor_a06]\n"
        "  compose:\n"
        "    armor_kl: {base: armor_best, take: {beta: kl_best}}\n"
        "    small_lr: {base: grpo, lr_scale_alpha_of: armor_best}\n")
    out = tmp_path / "study"
    # the tuning results, fixed in advance (finished runs are skipped): 0.04 beats 0.01 at the grid's upper edge, so
    # the rule adds 0.1, which wins; ARMOR at alpha 0.6 beats the default
    for arm, final in (("grpo_kl_0.01", 0.1), ("grpo_kl_0.04", 0.3), ("grpo_kl_0.1", 0.4), ("armor", 0.2),
                       ("armor_a06", 0.5)):
        _write_run(plan.metrics_path(out, arm, 10), [0.2, final])
    assert main(["study", "--config", str(recipe), "--smoke", "--arms", "armor_kl,small_lr", "--seeds", "1",
                 "--workers", "1", "--resamples", "200", "--output_dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    kl = summary["selection"]["kl_best"]
    assert kl["among"] == ["grpo_kl_0.01", "grpo_kl_0.04", "grpo_kl_0.1"] and kl["chosen"] == "grpo_kl_0.1"
    assert summary["selection"]["armor_best"]["chosen"] == "armor_a06"
    assert summary["compositions"] == {"armor_kl": {"method": "armor", "armor_alpha": 0.6, "beta": 0.1},
                                       "small_lr": {"method": "grpo", "beta": 0.0, "lr_scale": 0.6}}
    assert summary["arms"] == summary["compositions"] and list(summary["table"]) == ["armor_kl", "small_lr"]
    assert summary["runs_executed"] == 2  # the two composed arms; every tuning run was there already
    ran = read_curves(out / "metrics" / "armor_kl-seed0.jsonl")
    assert ran["val"] and json.loads((out / "runs" / "armor_kl-seed0" / "resolved_overrides.json").read_text()
                                     if (out / "runs" / "armor_kl-seed0" / "resolved_overrides.json").is_file()
                                     else "{}") in ({}, {"method": "armor", "armor_alpha": 0.6, "beta": 0.1})


def test_compositions_are_checked_before_anything_trains():
    arms = {"grpo": {"method": "grpo"}, "armor": {"method": "armor"}}
    selection = plan.load_selection({"select": {"kl": ["grpo"]}}, arms)
    with pytest.raises(ValueError, match=r"study.compose.x names unknown arm\(s\) \['nope'\]"):
        plan.load_compositions({"compose": {"x": {"base": "armor", "take": {"beta": "nope"}}}}, arms, selection)
    with pytest.raises(ValueError, match="is also an arm's or a select: alias's name"):
        plan.load_compositions({"compose": {"kl": {"base": "armor"}}}, arms, selection)
    with pytest.raises(ValueError, match="must be a mapping with base:"):
        plan.load_compositions({"compose": {"x": {"take": {}}}}, arms, selection)
    with pytest.raises(ValueError, match=r"extend names unknown arm\(s\) \['nope'\]"):
        plan.load_selection({"select": {"kl": {"among": ["grpo"], "extend": {"grpo": ["nope"]}}}}, arms)


def test_every_composition_covers_every_choice_the_tuning_could_make():
    arms = {"kl_a": {"method": "grpo", "beta": 0.1}, "kl_b": {"method": "grpo", "beta": 0.2},
            "kl_c": {"method": "grpo", "beta": 0.4}, "ar": {"method": "armor"}}
    selection = plan.load_selection({"select": {"kl": {"among": ["kl_a", "kl_b"], "extend": {"kl_b": ["kl_c"]}}}},
                                    arms)
    spec = plan.load_compositions({"compose": {"x": {"base": "ar", "take": {"beta": "kl"}}}}, arms, selection)["x"]
    betas = [o["beta"] for o in plan.every_composition(spec, selection, arms, {"num_generations": 8})]
    assert betas == [0.1, 0.2, 0.4]  # the extension's arm too


def test_seed_sets_aliases_and_comparisons_are_checked_before_training(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base: {REPO / 'configs' / 'tiny_demo.yaml'}\n"
                      "study: {select: {kl_best: [grpo_kl_0.01, grpo_kl_0.1]}, tuning_seeds: [1, 5]}\n")
    cases = [
        (["--config", str(recipe), "--arms", "kl_best,armor", "--seeds", "3"], "Tuning seeds [1] are also reporting"),
        (["--config", str(recipe), "--arms", "kl_best", "--tuning_seeds", "0,9"], "Tuning seeds [0]"),
        (["--arms", "grpo,armor", "--primary", "armor:grpo_kl_0.1"], "not among this study's arms"),
        (["--arms", "grpo,armor", "--primary", "armor"], "two different arms"),
        (["--arms", "grpo", "--warmup_seeds", "0,x"], "--warmup_seeds"),
        (["--arms", "grpo", "--warmup_seeds", "1,1"], "repeats a seed"),
        (["--arms", "grpo", "--config", str(REPO / "configs" / "lora_gsm8k_single_gpu.yaml"), "--warmup_seeds", "0,1"],
         "trains model_name_or_path"),
        (["--arms", "grpo", "--preregister", str(tmp_path / "nope.md")], "nope.md: no such file"),
    ]
    for argv, message in cases:
        assert main(["study", "--smoke", "--output_dir", str(tmp_path / "s"), *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "s" / "metrics").exists()  # nothing trained
    bad = {"select": {"kl_best": ["grpo_kl_7"]}}
    with pytest.raises(ValueError, match="unknown arm"):
        plan.load_selection(bad, {"grpo": {}})
    with pytest.raises(ValueError, match="also an arm's name"):
        plan.load_selection({"select": {"grpo": ["grpo"]}}, {"grpo": {}})
    with pytest.raises(ValueError, match="metric must be one of"):
        plan.load_selection({"select": {"best": {"among": ["grpo"], "metric": "speed"}}}, {"grpo": {}})
    no_tuning = tmp_path / "no_tuning.yaml"
    no_tuning.write_text(f"base: {REPO / 'configs' / 'tiny_demo.yaml'}\nstudy: {{select: {{kl_best: [grpo]}}}}\n")
    assert main(["study", "--smoke", "--config", str(no_tuning), "--arms", "kl_best",
                 "--output_dir", str(tmp_path / "s")]) == 2
    assert "give --tuning_seeds" in capsys.readouterr().err


def test_preregistration_commit_is_recorded(tmp_path):
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *args: subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,  # noqa: E731
                                       check=True).stdout.strip()
    git("init", "-q")
    (repo / "prereg.md").write_text("arms: grpo, armor\n")
    git("add", "prereg.md")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "pre-register")
    record = study.provenance(repo / "prereg.md")["preregistration"]
    assert record["commit"] == git("rev-parse", "HEAD") and record["uncommitted_changes"] is False
    (repo / "prereg.md").write_text("arms: grpo, armor, more\n")
    assert study.provenance(repo / "prereg.md")["preregistration"]["uncommitted_changes"] is True
    (repo / "new.md").write_text("x")
    assert study.provenance(repo / "new.md")["preregistration"]["commit"] is None


def test_a_recipes_primary_comparisons_of_arms_not_run_are_left_out(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base: {REPO / 'configs' / 'tiny_demo.yaml'}\nstudy: {{primary: [[armor, grpo]]}}\n")
    out = tmp_path / "study" / "grpo_only"
    assert main(["study", "--config", str(recipe), "--smoke", "--arms", "grpo", "--seeds", "1", "--workers", "1",
                 "--resamples", "200", "--output_dir", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["primary"] == []


def test_mode_testbed_smoke_study_reports_modes_start_kl_and_pass_at_start_peak_end(tmp_path):
    out = tmp_path / "study" / "modes"
    assert main(["study", "--config", str(REPO / "configs" / "mode_testbed.yaml"), "--smoke", "--arms", "grpo,armor",
                 "--seeds", "1", "--warmup_seeds", "0", "--workers", "1", "--resamples", "200",
                 "--output_dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for png in ("modes.png", "start_kl.png", "curves.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    points = summary["at_points"]["grpo"]
    held_out = {f"pass@{j}" for j in (1, 2, 4, 8, 16)} | {"mode/carrying", "mode/worked", "mode/direct", "mode/other"}
    assert held_out <= set(points) and all(name.startswith("train/mode/") for name in set(points) - held_out)
    assert "train/mode/worked" in points  # the training problems' modes (val_datasets train=arithmetic:train)
    # the anchor mode diagnostic (anchor_mode_classifier) of the ARMOR arm, its table and plot
    diagnostic = summary["anchor_diagnostic"]
    assert set(diagnostic) == {"armor"} and diagnostic["armor"]["runs"] == 1
    logged_modes = diagnostic["armor"]["anchor_modes"]  # none when the gate kept no group (smoke: no anchor found)
    assert (out / "anchor_modes.png").is_file() == bool(logged_modes)
    assert "## Anchor mode diagnostic" in (out / "summary.md").read_text()
    records = [json.loads(line) for line in (out / "metrics" / "grpo-seed0.jsonl").read_text().splitlines()]
    validations = [r for r in records if "val/avg@16" in r]
    assert points["pass@16"]["start"] == pytest.approx(validations[0]["val/pass@16"])
    assert points["mode/carrying"]["end"] == pytest.approx(validations[-1]["val/mode/carrying"])
    peak = max(validations, key=lambda r: r["val/avg@16"])  # the first maximum
    assert points["pass@1"]["peak"] == pytest.approx(peak["val/pass@1"])
    assert sum(points[f"mode/{m}"]["start"] for m in ("carrying", "worked", "direct", "other")) == pytest.approx(1.0)
    assert all("val/kl_reverse_start" in r and "val/kl_forward_start" in r for r in validations)
    assert "pass@j and mode shares at each run's start / validation peak / end" in (out / "summary.md").read_text()


def test_criterion_section_is_checked():
    good = {"arm": "grpo", "general_mode": "carrying", "min_collapsed": 4, "min_warm_checkpoints": 2}
    assert plan.load_criterion({"criterion": good}) == good and plan.load_criterion({}) is None
    with pytest.raises(ValueError, match=r"study.criterion must be a mapping of exactly \['arm', 'general_mode'"):
        plan.load_criterion({"criterion": {**good, "extra": 1}})
    with pytest.raises(ValueError, match="study.criterion.min_collapsed must be an integer >= 1, got 0"):
        plan.load_criterion({"criterion": {**good, "min_collapsed": 0}})


def test_a_bad_criterion_is_refused_before_anything_trains(tmp_path, monkeypatch):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base: {os.path.relpath(REPO / 'configs' / 'mode_testbed.yaml', tmp_path)}\n"
                      "study: {criterion: {arm: grpo, general_mode: carrying, min_collapsed: 0, min_warm_checkpoints: 2}}\n")
    monkeypatch.setattr(study, "warm_start", lambda *a, **k: pytest.fail("warmed up before checking the criterion"))
    with pytest.raises(ValueError, match="study.criterion.min_collapsed must be an integer >= 1"):
        study.run_study(str(recipe), ["grpo"], 1, 1, str(tmp_path / "out"), smoke=True)


def test_a_study_folder_copied_elsewhere_resumes_from_its_stored_warm_checkpoint_and_refuses_other_weights(
        tmp_path, monkeypatch, capsys):
    """The folder stores its warm checkpoint with the weights' hash; a copy of its record, runs and warm checkpoint,
    with an empty cache beside it, resumes without building or training anything; other weights are refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    from armor_trl.app.experiments.warm_checkpoints import weights_hash

    first = tmp_path / "here" / "study"
    assert main(["study", "--smoke", "--arms", "grpo", "--seeds", "1", "--warmup_seeds", "0", "--workers", "1",
                 "--resamples", "200", "--out", str(first)]) == 0
    summary = json.loads((first / "summary.json").read_text())
    stored = first / "warm" / "warm0"
    digest = weights_hash(stored)
    assert json.loads((first / "study.json").read_text())["warm_checkpoints"] == {"0": digest}
    assert summary["warmups"][0]["weights_sha256"] == digest == weights_hash(summary["warmups"][0]["model"])

    # another machine: the folder's record, runs and warm checkpoint, no cache; nothing may be built or trained
    copy = tmp_path / "there" / "study"
    copy.mkdir(parents=True)
    for name in ("study.json", "metrics", "warm"):
        (shutil.copytree if (first / name).is_dir() else shutil.copy)(first / name, copy / name)

    def no_building(*args, **kwargs):
        raise AssertionError("a warm checkpoint was built again")

    monkeypatch.setattr("armor_trl.app.tiny.build_tiny_model", no_building)
    argv = ["study", "--smoke", "--arms", "grpo", "--seeds", "1", "--warmup_seeds", "0", "--workers", "1",
            "--resamples", "200", "--out", str(copy)]
    assert main(argv) == 0
    resumed = json.loads((copy / "summary.json").read_text())
    assert resumed["runs_executed"] == 0 and resumed["warmups"][0]["weights_sha256"] == digest
    assert weights_hash(resumed["warmups"][0]["model"]) == digest  # restored into the empty cache

    # a warm checkpoint with other weights (built on another CPU, or changed) is refused, naming both hashes
    cached = Path(resumed["warmups"][0]["model"])
    weights = load_file(cached / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, cached / "model.safetensors", metadata={"format": "pt"})
    other = weights_hash(cached)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "warm-up seed 0" in err and digest in err and other in err
    # the cache entry deleted, the stored copy is restored again and the study resumes
    shutil.rmtree(cached)
    assert main(argv) == 0 and weights_hash(cached) == digest


def test_study_folder_compares_its_recipe_as_study_json_holds_it(tmp_path):
    """A recipe whose YAML has int keys (the tool agent's warm-up `digits: {1: 0.5, 2: 0.5}`) is the same recipe after
    study.json's round trip turned them into strings: the folder resumes (it refused, after the tuning, before)."""
    folder = {"recipe": {"demo": {"warmup": {"digits": {1: 0.5, 2: 0.5}}}}, "smoke_overrides": {}, "model": "m",
              "arms": {"grpo": {}}}
    plan.check_study_folder(tmp_path, folder)
    plan.check_study_folder(tmp_path, {**folder, "arms": {"armor": {"method": "armor"}}})
    with pytest.raises(ValueError, match="different recipe"):
        plan.check_study_folder(tmp_path, {**folder, "recipe": {"demo": {"warmup": {"digits": {1: 0.4, 2: 0.6}}}}})
