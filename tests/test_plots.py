"""The study's plots: the anchor mode diagnostic drawn per prompt type over the rounds that had rows of that type."""

from __future__ import annotations

from armor_trl.app.experiments import plots


def test_the_anchor_mode_plot_averages_a_share_over_the_rounds_of_its_prompt_type():
    modes = {"carrying": [(0, 0.5), (1, 1.0), (2, 1.0)], "worked": [(0, 0.5)], "carry/carrying": [(1, 1.0), (2, 0.0)],
             "no_carry/worked": [(0, 1.0)]}
    assert plots._share_curve(modes, "carry/carrying", 1) == [(1, 1.0), (2, 0.0)]  # no carry rows in round 0: no share
    assert plots._share_curve(modes, "carry/carrying", 2) == [(1, 1.0), (2, 0.5)]
    assert plots._share_curve(modes, "no_carry/worked", 1) == [(0, 1.0), (1, 1.0), (2, 1.0)]  # held until the next round
    assert plots._share_curve(modes, "worked", 1) == [(0, 0.5), (1, 0.0), (2, 0.0)]  # rounds with rows, another mode: 0


def test_a_study_with_the_diagnostic_by_prompt_type_draws_its_anchor_modes(tmp_path):
    steps = range(0, 40, 8)
    # carry-prompt rows in alternate rounds, at different rounds in the two runs: each run's own rounds count
    runs = {seed: {"val": [(s, 0.3) for s in steps], "train": [(s, 0.5) for s in steps], "kl_reverse": [],
                   "kl_forward": [], "ref_weights_step": [], "anchor_modes": {
                       "worked": [(s, 1.0) for s in steps], "no_carry/worked": [(s, 1.0) for s in steps],
                       "carry/carrying": [(s, 1.0) for i, s in enumerate(steps) if i % 2 == seed]},
                   "policy_modes": {"worked": [(s, 1.0) for s in steps]}} for seed in (0, 1)}
    plots.plot_study({"armor": runs}, tmp_path, smooth=2)
    assert (tmp_path / "anchor_modes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the carry-prompt share is 1 wherever a run has had carry rows, never pulled towards 0 by the other rounds
    curves = [plots._share_curve(c["anchor_modes"], "carry/carrying", 2) for c in runs.values()]
    assert all(value == 1.0 for curve in curves for _, value in curve)
