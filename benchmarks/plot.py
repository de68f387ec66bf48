"""The regime plot: cost per optimizer step relative to GRPO(β = 0.04) at each M, full fine-tuning and LoRA."""

from __future__ import annotations

from pathlib import Path

from benchmarks.config import BenchConfig


def regime_plot(result: dict, bench: BenchConfig, path: Path | str) -> None:
    """Two panels (full FT vs ``bench.baseline``, LoRA vs ``bench.lora_baseline``): per variant the ratio of median
    costs per optimizer step against M, with the paired per-repetition range as error bars."""
    import matplotlib

    matplotlib.use("Agg")  # no display here
    import matplotlib.pyplot as plt

    summary, meta = result["regime"]["summary"], result["meta"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, base, lora in ((axes[0], bench.baseline, False), (axes[1], bench.lora_baseline, True)):
        drawn = 0
        for name, by_m in summary.items():
            if bench.variants[name].lora != lora or name == base:
                continue
            ms = [int(m) for m in by_m if "vs_" + base in by_m[m]]
            ratios = [by_m[str(m)]["vs_" + base]["step"] for m in ms]
            low = [r - by_m[str(m)]["vs_" + base]["step_paired"]["min"] for m, r in zip(ms, ratios)]
            high = [by_m[str(m)]["vs_" + base]["step_paired"]["max"] - r for m, r in zip(ms, ratios)]
            if not ms:
                continue
            ax.errorbar(ms, ratios, yerr=[[max(v, 0) for v in low], [max(v, 0) for v in high]], marker="o",
                        capsize=3, label=name)
            drawn += 1
        if not drawn:  # a run without this panel's base (the tool loop's table: GRPO with tools is its base)
            ax.set_axis_off()
            ax.set_title(f"no variant measured against {base}", fontsize=9)
            continue
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks([int(m) for m in result["regime"]["meta"]["mini_batches"]])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("M (optimizer steps per rollout batch)")
        ax.set_title(f"{'LoRA' if lora else 'full fine-tuning'}: × {base} per optimizer step")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("cost per optimizer step (ratio of medians)")
    fig.suptitle(f"{meta.get('cpu_model', '')}, {meta['cpus']} CPUs, torch threads={meta['threads']}; "
                 f"load {meta['load_before'][0]:.1f} → {meta['load_after'][0]:.1f}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
