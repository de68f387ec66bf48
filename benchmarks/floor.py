"""ARMOR's floor inside DAPO's loop: what `grpo_dynamic` measured plus what ARMOR's algorithm requires on top, priced
at the same run's measured costs per row (docs/performance.md, "The floor of ARMOR in DAPO's loop").

For an ARMOR variant with dynamic sampling, at each M, per optimizer step:

    floor = grpo_dynamic's step
          + generation cost per row × (candidate rows + groups the gate dropped × on-policy rows per group)
          + log-prob cost per row × rows that train (π_ref's forward: the loop runs at β = 0, grpo_dynamic has none)

The generation cost per row is grpo_dynamic's policy_gen over the policy rows it generated; the log-prob cost per row
is the ``logp_price`` variant's ref_fwd over its log-prob rows (GRPO β 0.04: π_ref's pass, and π_old's at M > 1),
both at the same M in the same run. What the floor leaves out is what the algorithm does not require: refill rounds beyond
what is missing, a generate call's cost beyond its rows, and the bookkeeping around the candidates.
"""

from __future__ import annotations

import statistics

from benchmarks.config import BenchConfig


def gate_dropped_groups(run: dict, warmup_steps: int) -> float | None:
    """Groups the gate dropped for want of an anchor per measured optimizer step (None: no drop metrics)."""
    # [step, all correct, all wrong, no anchor, groups generated] (runs recorded before the floor lack the last two)
    rows = [entry for entry in run.get("dropped_by_step", []) if entry[0] > warmup_steps]
    if not rows or any(len(entry) < 5 or entry[4] is None for entry in rows):
        return None
    return sum(entry[3] * entry[4] for entry in rows) / (len(run["steps"]) - warmup_steps)


def loop_variants(bench: BenchConfig, names) -> list:
    """The ARMOR variants inside DAPO's loop among ``names``."""
    return [n for n in names if bench.variants[n].armor and bench.variants[n].args.get("dynamic_sampling")]


def _price(entry: dict | None, part: str, rows: str) -> float | None:
    work = (entry or {}).get("work") or {}
    return entry["split_s"][part] / work[rows] if work.get(rows) else None


def add(summary: dict, runs: list, bench: BenchConfig, g: int, train_rows: int) -> None:
    """Add ``floor`` to each loop variant's regime entry (``summary``: variant -> M -> entry) whose base was measured
    at the same M."""
    settings = bench.loop_floor
    if not settings:
        return
    base_name, logp_name = settings["base"], settings["logp_price"]
    for name in loop_variants(bench, summary):
        slots = bench.variants[name].args.get("anchors_per_group", 1)
        for m, entry in summary[name].items():
            base = summary.get(base_name, {}).get(m)
            gen_price = _price(base, "policy_gen", "policy_rows")
            logp_price = _price(summary.get(logp_name, {}).get(m), "ref_fwd", "logp_rows") or _price(
                base, "ref_fwd", "logp_rows")
            dropped = [gate_dropped_groups(r, r["warmup_steps"]) for r in runs
                       if r["config"] == name and str(r["mini_batches"]) == m]
            dropped = [d for d in dropped if d is not None]
            candidates = (entry.get("anchor_work") or {}).get("candidate_rows_per_step")
            if base is None or gen_price is None or logp_price is None or candidates is None or not dropped:
                continue
            gate_groups = statistics.median(dropped)
            floor = (base["cost_per_step_s"]["median"] + gen_price * (candidates + gate_groups * (g - slots))
                     + logp_price * train_rows)
            entry["floor"] = {
                "base": base_name, "floor_s": floor, "measured_over_floor": entry["cost_per_step_s"]["median"] / floor,
                "over_base": entry["cost_per_step_s"]["median"] / base["cost_per_step_s"]["median"],
                "gen_s_per_row": gen_price, "logp_s_per_row": logp_price, "candidate_rows": candidates,
                "gate_dropped_groups": gate_groups, "train_rows": train_rows,
                "policy_rows": (entry.get("work") or {}).get("policy_rows"),
                "base_policy_rows": base["work"]["policy_rows"],
            }


def table(summary: dict) -> list:
    """Markdown lines: each loop variant at each M against its floor."""
    f = lambda v, d=3: "—" if v is None else f"{v:.{d}f}"  # noqa: E731
    rows = []
    for name, by_m in summary.items():
        for m, entry in by_m.items():
            fl = entry.get("floor")
            if fl:
                rows.append(
                    f"| {name} | {m} | {f(entry['cost_per_step_s']['median'])} | {f(fl['over_base'], 2)} | "
                    f"{f(fl['floor_s'])} | {f(fl['measured_over_floor'], 2)} | {f(fl['candidate_rows'], 1)} | "
                    f"{f(fl['gate_dropped_groups'], 2)} | "
                    f"{f(fl['policy_rows'], 1)} / {f(fl['base_policy_rows'], 1)} | "
                    f"{f(fl['gen_s_per_row'] * 1e3, 2)} | {f(fl['logp_s_per_row'] * 1e3, 2)} |")
    if not rows:
        return []
    base = next(e["floor"]["base"] for by_m in summary.values() for e in by_m.values() if "floor" in e)
    return ["", f"ARMOR in DAPO's loop against its floor (per optimizer step): {base}'s measured step + generation cost "
            "per row × (candidate rows + groups the gate dropped × on-policy rows per group) + log-prob cost per row × "
            "rows that train (π_ref's forward), priced at this run's measured costs per row at the same M "
            "(benchmarks/floor.py):", "",
            f"| config | M | s/opt step | × {base} | floor s/opt step | measured / floor | candidate rows / opt step | "
            f"groups the gate dropped / opt step | policy rows / opt step (variant / {base}) | generation ms per row | "
            "log-prob ms per row |",
            "|---|---|---|---|---|---|---|---|---|---|---|", *rows]
