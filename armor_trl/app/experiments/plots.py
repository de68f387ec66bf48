"""The plots of a study: ``curves.png``, ``kl.png``, ``reference.png``, ``start_kl.png``, ``modes.png`` and
``anchor_modes.png`` (:func:`plot_study`), each a mean over seeds with a ±1 std band; :func:`pyplot` imports matplotlib
only when a plot is drawn (the ``experiments`` extra), for the demo's plots too."""

from __future__ import annotations

from pathlib import Path

from armor_trl.app.experiments import stats


def _share_curve(series_by_mode: dict, mode: str, smooth: int) -> list[tuple[int, float]]:
    """``mode``'s share over the rounds of its prompt type (:func:`stats.mode_share_series`), a trailing mean over
    ``smooth`` of them, held at every later round of the run until that type's next round: runs whose rounds with
    rows of the type differ still share steps to average over."""
    own = stats.mode_share_series(series_by_mode, mode)
    smoothed = dict(zip((step for step, _ in own), stats.trailing_mean([v for _, v in own], smooth)))
    curve, last = [], None
    for step in sorted({s for values in series_by_mode.values() for s, _ in values}):
        last = smoothed.get(step, last)
        if last is not None:
            curve.append((step, float(last)))
    return curve


def _band(runs: list[list[tuple[int, float]]], smooth: int = 1):
    """Steps every run has, and the mean and std over runs there (a trailing mean over ``smooth`` points first)."""
    import numpy as np

    common = sorted(set.intersection(*[{s for s, _ in r} for r in runs])) if runs else []
    if not common:
        return None
    keep = set(common)
    values = np.array([[v for s, v in r if s in keep] for r in runs])
    if smooth > 1:
        values = np.stack([stats.trailing_mean(row, smooth) for row in values])
    return np.array(common), values.mean(axis=0), values.std(axis=0)


def pyplot():
    """matplotlib.pyplot on the Agg backend, imported only when a plot is drawn: matplotlib is not a dependency of the
    training library, it comes with the ``experiments`` extra."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            "The study and demo plots need matplotlib, which armor-trl installs only with its experiments extra: "
            "armor-trl[experiments] (in a clone: pip install '.[experiments]'; for a wheel, [experiments] after its "
            "path)."
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_study(curves: dict, out: Path, smooth: int = 5) -> None:
    """curves.png: validation accuracy and training reward per arm; kl.png: reverse KL(π_θ‖π_ref) on on-policy
    samples and forward KL(π_ref‖π_θ) on anchors; reference.png: the policy's validation accuracy next to that of
    the π_ref in use (:func:`stats.reference_accuracy`). Mean over seeds with a ±1 std band."""
    plt = pyplot()
    colors = plt.get_cmap("tab10" if len(curves) <= 10 else "tab20")
    curves = {arm: {seed: {**c, "ref_val": stats.reference_accuracy(c["val"], c["ref_weights_step"])["curve"]}
                    for seed, c in runs.items()} for arm, runs in curves.items()}
    for filename, panels in (
        ("curves.png", [("val", "held-out validation accuracy", 1), ("train", f"training reward (on-policy, "
                                                                             f"mean of {smooth} logs)", smooth)]),
        ("kl.png", [("kl_reverse", "reverse KL(π_θ‖π_ref), on-policy samples", smooth),
                    ("kl_forward", "forward KL(π_ref‖π_θ), anchors", smooth)]),
        ("reference.png", [("val", "policy π_θ: held-out validation accuracy", 1),
                           ("ref_val", "reference π_ref in use: its held-out accuracy", 1)]),
        ("start_kl.png", [("kl_reverse_start", "reverse KL(π_θ‖π_0), policy samples, held-out prompts", 1),
                          ("kl_forward_start", "forward KL(π_0‖π_θ), samples of the start model", 1)]),
    ):
        if filename == "start_kl.png" and not any(c.get("kl_reverse_start") for runs in curves.values()
                                                  for c in runs.values()):
            continue  # val_kl_prompts was off
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
        for ax, (key, title, window) in zip(axes, panels):
            for i, (arm, runs) in enumerate(curves.items()):
                band = _band([c[key] for c in runs.values() if c[key]], window)
                if band is None:
                    continue
                steps, mean, std = band
                ax.plot(steps, mean, color=colors(i), label=arm)
                ax.fill_between(steps, mean - std, mean + std, color=colors(i), alpha=0.2)
            ax.set(title=title, xlabel="step")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, "not logged by these arms", ha="center", transform=ax.transAxes)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
    modes = list(dict.fromkeys(m for runs in curves.values() for c in runs.values() for m in c.get("modes", {})))
    if modes:  # modes.png: each mode's share of the held-out samples (val_mode_classifier)
        fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 3.8), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            for i, (arm, runs) in enumerate(curves.items()):
                band = _band([c["modes"][mode] for c in runs.values() if c.get("modes", {}).get(mode)], 1)
                if band is not None:
                    steps, mean, std = band
                    ax.plot(steps, mean, color=colors(i), label=arm)
                    ax.fill_between(steps, mean - std, mean + std, color=colors(i), alpha=0.2)
            ax.set(title=f"held-out share: {mode}", xlabel="step", ylim=(0, 1))
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "modes.png", dpi=110)
        plt.close(fig)
    anchor_modes = list(dict.fromkeys(m for runs in curves.values() for c in runs.values()
                                      for m in (*c.get("anchor_modes", {}), *c.get("policy_modes", {}))))
    if anchor_modes:  # anchor_modes.png: the anchor mode diagnostic (anchor_mode_classifier), ARMOR arms only
        fig, axes = plt.subplots(1, len(anchor_modes), figsize=(4.2 * len(anchor_modes), 3.8), squeeze=False)
        for ax, mode in zip(axes[0], anchor_modes):
            for i, (arm, runs) in enumerate(curves.items()):
                for key, style, label in (("anchor_modes", "-", "anchors"), ("policy_modes", "--", "on-policy")):
                    band = _band([_share_curve(c[key], mode, smooth) for c in runs.values() if c.get(key)])
                    if band is not None:
                        steps, mean, _ = band
                        ax.plot(steps, mean, style, color=colors(i), label=f"{arm}: {label}")
            ax.set(title=f"kept groups' share: {mode}", xlabel="step", ylim=(0, 1))
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "anchor_modes.png", dpi=110)
        plt.close(fig)
