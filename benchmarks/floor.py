"""ARMOR's floors: what a base without ARMOR measured plus what ARMOR's algorithm requires on top, priced at the same
run's measured costs per row (docs/performance.md, "The floor of ARMOR in DAPO's loop" and "The floor of ARMOR on
TRL's tool loop").

Inside DAPO's loop (``loop_floor`` in bench.yaml), for an ARMOR variant with dynamic sampling, at each M, per
optimizer step:

    floor = grpo_dynamic's step
          + generation cost per row × (candidate rows + groups the gate dropped × on-policy rows per group)
          + log-prob cost per row × rows that train (π_ref's forward: the loop runs at β = 0, grpo_dynamic has none)

On TRL's tool loop (``tool_floor``), for each ARMOR variant with tools against its base (GRPO with the same tools), at
each M, per optimizer step:

    floor = the base's step
          + trajectory cost per row × (candidate rows + groups the gate dropped × on-policy rows per group
                                       − anchor slots per optimizer step)
          + log-prob cost per row × rows that train, where the base runs at β = 0 (a β > 0 base pays π_ref's pass)

The generation cost per row is the base's policy_gen over the policy rows it generated; on the tool loop a row's
cost over all its turns, (policy_gen + policy_tools) over the trajectories (a trajectory is one policy row: its first
turn's). The log-prob cost per row is the ``logp_price`` variant's ref_fwd over its log-prob rows (π_ref's pass, and
π_old's at M > 1), both at the same M in the same run. On the tool loop, where nothing refills, the anchor slots'
on-policy rows (groups per optimizer step × slots) are rows ARMOR does not generate and are credited. Both price a
generate call by its rows: a call's fixed cost is in the price only as the base's calls carry it (the base's calls
over its rows); ARMOR's extra calls (a candidate call per round, a lazy wave, a refill round for a gate drop) are
not. What the floor leaves out is what the algorithm does not require: refill rounds beyond what is missing, a
generate call's cost beyond its rows, and the bookkeeping around the candidates.

Where a variant exceeds its floor is read off the same run's time split (``parts``): the floor split into the parts
of the step it prices (the policy's rows, the candidates, the log-prob passes, vLLM's weight pushes, loss +
backward, the rest: the base's measured part plus what the floor adds to it) beside the variant's measured parts, with the generate calls and rows
per call that make a row cost more than its price.
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
    """The ARMOR variants inside DAPO's loop among ``names`` (without tools: those have the tool floor)."""
    return [n for n in names if bench.variants[n].armor and bench.variants[n].args.get("dynamic_sampling")
            and not bench.variants[n].tools]


def tool_variants(bench: BenchConfig, names) -> dict:
    """{ARMOR variant on the tool loop among ``names``: its base} (bench.yaml ``tool_floor``)."""
    return {n: base for n, base in (bench.tool_floor.get("variants") or {}).items() if n in names}


def _price(entry: dict | None, parts: tuple, rows: str) -> float | None:
    work = (entry or {}).get("work") or {}
    return sum(entry["split_s"].get(part, 0.0) for part in parts) / work[rows] if work.get(rows) else None


def floor_s(base_step: float, gen_price: float, logp_price: float, candidate_rows: float, gate_groups: float,
            g: int, slots: int, ref_rows: float, credited_rows: float = 0.0) -> float:
    """The floor per optimizer step: the base's step, the rows ARMOR must generate on top (its candidates and the
    on-policy rows of the groups the gate drops, less ``credited_rows`` it does not generate) at the base's cost per
    row, and π_ref's pass over ``ref_rows`` at the log-prob cost per row."""
    return (base_step + gen_price * (candidate_rows + gate_groups * (g - slots) - credited_rows)
            + logp_price * ref_rows)


# the parts of a step the floor prices, each a sum of the time split's parts (instruments.py); anything else is "rest"
PARTS = {
    "policy": ("policy_gen", "policy_tools"),  # the policy's generate calls (and tool turns): its rows and refills
    "candidates": ("anchor_gen", "anchor_tools", "anchor_score"),  # π_ref's candidates: generate, tool turns, scoring
    "logps": ("ref_fwd",),  # the log-prob passes while batches are built (π_old's, π_ref's)
    "pushes": ("push_ref", "push_policy"),  # vLLM: weights pushed into the engine (π_ref's for candidates, π_θ's)
    "loss_bwd": ("loss_bwd",),
}


def _split_parts(split: dict) -> dict:
    named = {part: sum(split.get(key, 0.0) for key in keys) for part, keys in PARTS.items()}
    named["rest"] = sum(split.values()) - sum(named.values())
    return named


def _per(numerator, denominator):
    return numerator / denominator if numerator is not None and denominator else None


def parts(entry: dict, base: dict, added: dict) -> dict:
    """The floor's parts (the base's measured parts plus ``added``: seconds the floor adds to a part) and the
    variant's measured parts, per optimizer step; ``unsplit``: what the medians of whole steps hold beyond their
    parts' medians (the variant's less the floor's), so the parts' differences add up to measured − floor. Beside
    them the work that prices a row: generate calls and rows per call, the variant's and the base's."""
    measured, floor = _split_parts(entry["split_s"]), _split_parts(base["split_s"])
    for part, seconds in added.items():
        floor[part] += seconds
    work, base_work = entry.get("work") or {}, base.get("work") or {}
    unsplit = ((entry["cost_per_step_s"]["median"] - sum(measured.values()))
               - (base["cost_per_step_s"]["median"] - sum(floor.values()) + sum(added.values())))
    candidates = (entry.get("anchor_work") or {}).get("candidate_rows_per_step")
    return {
        "measured": measured, "floor": floor, "unsplit": unsplit,
        "policy_calls": work.get("policy_calls"), "base_policy_calls": base_work.get("policy_calls"),
        "candidate_calls": work.get("anchor_calls"),
        "policy_rows_per_call": _per(work.get("policy_rows"), work.get("policy_calls")),
        "base_policy_rows_per_call": _per(base_work.get("policy_rows"), base_work.get("policy_calls")),
        "candidate_rows_per_call": _per(candidates, work.get("anchor_calls")),
    }


def _gate_groups(runs: list, name: str, m: str) -> float | None:
    dropped = [gate_dropped_groups(r, r["warmup_steps"]) for r in runs
               if r.get("config") == name and str(r.get("mini_batches")) == m]
    dropped = [d for d in dropped if d is not None]
    return statistics.median(dropped) if dropped else None


def add(summary: dict, runs: list, bench: BenchConfig, g: int, train_rows: int) -> None:
    """Add ``floor`` to each loop variant's and each tool variant's regime entry (``summary``: variant -> M -> entry)
    whose base was measured at the same M."""
    _add_loop(summary, runs, bench, g, train_rows)
    _add_tools(summary, runs, bench, g, train_rows)


def _add_loop(summary: dict, runs: list, bench: BenchConfig, g: int, train_rows: int) -> None:
    settings = bench.loop_floor
    if not settings:
        return
    base_name, logp_name = settings["base"], settings["logp_price"]
    for name in loop_variants(bench, summary):
        slots = bench.variants[name].args.get("anchors_per_group", 1)
        for m, entry in summary[name].items():
            base = summary.get(base_name, {}).get(m)
            gen_price = _price(base, ("policy_gen",), "policy_rows")
            logp_price = _price(summary.get(logp_name, {}).get(m), ("ref_fwd",), "logp_rows") or _price(
                base, ("ref_fwd",), "logp_rows")
            gate_groups = _gate_groups(runs, name, m)
            candidates = (entry.get("anchor_work") or {}).get("candidate_rows_per_step")
            if base is None or gen_price is None or logp_price is None or candidates is None or gate_groups is None:
                continue
            floor = floor_s(base["cost_per_step_s"]["median"], gen_price, logp_price, candidates, gate_groups, g, slots,
                            train_rows)
            entry["floor"] = {
                "kind": "loop", "base": base_name, "floor_s": floor,
                "measured_over_floor": entry["cost_per_step_s"]["median"] / floor,
                "over_base": entry["cost_per_step_s"]["median"] / base["cost_per_step_s"]["median"],
                "gen_s_per_row": gen_price, "logp_s_per_row": logp_price, "candidate_rows": candidates,
                "gate_dropped_groups": gate_groups, "train_rows": train_rows,
                "policy_rows": (entry.get("work") or {}).get("policy_rows"),
                "base_policy_rows": base["work"]["policy_rows"],
                "parts": parts(entry, base, {"policy": gen_price * gate_groups * (g - slots),
                                             "candidates": gen_price * candidates, "logps": logp_price * train_rows}),
            }


def _add_tools(summary: dict, runs: list, bench: BenchConfig, g: int, train_rows: int) -> None:
    settings = bench.tool_floor
    if not settings:
        return
    for name, base_name in tool_variants(bench, summary).items():
        variant, base_variant = bench.variants[name], bench.variants[base_name]
        slots = variant.args.get("anchors_per_group", 1)
        for m, entry in summary[name].items():
            base = summary.get(base_name, {}).get(m)
            gen_price = _price(base, ("policy_gen", "policy_tools"), "policy_rows")
            logp_price = _price(summary.get(settings["logp_price"], {}).get(m), ("ref_fwd",), "logp_rows")
            candidates = (entry.get("anchor_work") or {}).get("candidate_rows_per_step")
            if base is None or gen_price is None or logp_price is None or candidates is None:
                continue
            gate_groups = 0.0
            if variant.args.get("dynamic_sampling"):
                gate_groups = _gate_groups(runs, name, m)
                if gate_groups is None:
                    continue
            # the anchor slots' rows, which ARMOR does not generate on-policy (without refill rounds: DAPO's loop
            # regenerates what it drops, so there the rounds, not the slots, decide the policy's rows)
            credited = 0.0 if variant.args.get("dynamic_sampling") else train_rows / g * slots
            ref_rows = train_rows if base_variant.beta == 0 else 0
            floor = floor_s(base["cost_per_step_s"]["median"], gen_price, logp_price, candidates, gate_groups, g,
                            slots, ref_rows, credited)
            split = entry["split_s"]
            own = (split.get("anchor_gen", 0.0) + split.get("anchor_tools", 0.0)) / candidates if candidates else None
            entry["floor"] = {
                "kind": "tools", "base": base_name, "floor_s": floor,
                "measured_over_floor": entry["cost_per_step_s"]["median"] / floor,
                "over_base": entry["cost_per_step_s"]["median"] / base["cost_per_step_s"]["median"],
                "gen_s_per_row": gen_price, "logp_s_per_row": logp_price, "candidate_rows": candidates,
                "candidate_s_per_row": own, "gate_dropped_groups": gate_groups, "credited_rows": credited,
                "ref_rows": ref_rows, "train_rows": train_rows,
                "policy_rows": (entry.get("work") or {}).get("policy_rows"),
                "base_policy_rows": base["work"]["policy_rows"],
                "anchor_calls": (entry.get("work") or {}).get("anchor_calls"),
                "anchor_turn_calls": (entry.get("work") or {}).get("anchor_turn_calls"),
                "parts": parts(entry, base, {"policy": gen_price * (gate_groups * (g - slots) - credited),
                                             "candidates": gen_price * candidates, "logps": logp_price * ref_rows}),
            }


def _f(v, d=3):
    return "—" if v is None else f"{v:.{d}f}"


def table(summary: dict) -> list:
    """Markdown lines: each loop variant, then each tool variant, at each M against its floor, then where each
    exceeds it."""
    return _loop_table(summary) + _tool_table(summary) + parts_table(summary)


PARTS_TEXT = ("Where the step differs from its floor, part by part (ms per optimizer step, measured − floor; the floor's "
              "part is the base's measured part plus what the floor adds to it: the candidates' rows and the gate's "
              "refills at the base's cost per row, π_ref's pass at the log-prob cost per row; benchmarks/floor.py). "
              "*Not split*: what the medians of whole steps hold beyond their parts' medians. Beside it what prices a "
              "row: generate calls per optimizer step and rows per call, the variant's and the base's:")


def parts_table(summary: dict) -> list:
    """Markdown lines: each variant with a floor at each M, its excess over the floor part by part."""
    rows = []
    for name, m, entry in _floors(summary, "loop") + _floors(summary, "tools"):
        fl = entry["floor"]
        split = fl.get("parts")
        if not split:
            continue
        diff = {part: (split["measured"][part] - split["floor"][part]) * 1e3 for part in split["floor"]}
        priced = fl["gen_s_per_row"] * 1e3
        own = _per(split["measured"]["candidates"], fl["candidate_rows"])
        rows.append(
            f"| `{name}` | {m} | {_f(fl['measured_over_floor'], 2)} | "
            f"{(entry['cost_per_step_s']['median'] - fl['floor_s']) * 1e3:+.1f} | "
            + " | ".join(f"{diff[part]:+.1f}" for part in (*PARTS, "rest")) + f" | {split['unsplit'] * 1e3:+.1f} | "
            f"{_f(None if own is None else own * 1e3, 2)} / {_f(priced, 2)} | "
            f"{_f(split['policy_calls'], 3)} ({_f(split['base_policy_calls'], 3)}) + {_f(split['candidate_calls'], 3)} | "
            f"{_f(split['policy_rows_per_call'], 1)} ({_f(split['base_policy_rows_per_call'], 1)}) / "
            f"{_f(split['candidate_rows_per_call'], 1)} |")
    if not rows:
        return []
    return ["", PARTS_TEXT, "",
            "| variant | M | measured / floor | measured − floor | policy's rows (generate, tool turns) | candidates "
            "(generate, tool turns, scoring) | log-prob passes | weight pushes (vLLM) | loss + backward | the rest | "
            "not split | candidate ms per row: measured / priced | generate calls / opt step: policy (base) + "
            "candidates | rows per call: policy (base) / candidates |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", *rows]


def _floors(summary: dict, kind: str) -> list:
    return [(name, m, entry) for name, by_m in summary.items() for m, entry in by_m.items()
            if (entry.get("floor") or {}).get("kind", "loop") == kind and "floor" in entry]


def _loop_table(summary: dict) -> list:
    rows = []
    for name, m, entry in _floors(summary, "loop"):
        fl = entry["floor"]
        rows.append(
            f"| {name} | {m} | {_f(entry['cost_per_step_s']['median'])} | {_f(fl['over_base'], 2)} | "
            f"{_f(fl['floor_s'])} | {_f(fl['measured_over_floor'], 2)} | {_f(fl['candidate_rows'], 1)} | "
            f"{_f(fl['gate_dropped_groups'], 2)} | "
            f"{_f(fl['policy_rows'], 1)} / {_f(fl['base_policy_rows'], 1)} | "
            f"{_f(fl['gen_s_per_row'] * 1e3, 2)} | {_f(fl['logp_s_per_row'] * 1e3, 2)} |")
    if not rows:
        return []
    base = _floors(summary, "loop")[0][2]["floor"]["base"]
    return ["", f"ARMOR in DAPO's loop against its floor (per optimizer step): {base}'s measured step + generation cost "
            "per row × (candidate rows + groups the gate dropped × on-policy rows per group) + log-prob cost per row × "
            "rows that train (π_ref's forward), priced at this run's measured costs per row at the same M "
            "(benchmarks/floor.py):", "",
            f"| config | M | s/opt step | × {base} | floor s/opt step | measured / floor | candidate rows / opt step | "
            f"groups the gate dropped / opt step | policy rows / opt step (variant / {base}) | generation ms per row | "
            "log-prob ms per row |",
            "|---|---|---|---|---|---|---|---|---|---|---|", *rows]


def _tool_table(summary: dict) -> list:
    rows = []
    for name, m, entry in _floors(summary, "tools"):
        fl = entry["floor"]
        rows.append(
            f"| {name} | {m} | {fl['base']} | {_f(entry['cost_per_step_s']['median'])} | {_f(fl['over_base'], 2)} | "
            f"{_f(fl['floor_s'])} | {_f(fl['measured_over_floor'], 2)} | {_f(fl['candidate_rows'], 1)} | "
            f"{_f(fl['anchor_calls'], 2)} + {_f(fl.get('anchor_turn_calls'), 2)} | {_f(fl['gate_dropped_groups'], 2)} | {_f(fl['credited_rows'], 1)} | "
            f"{_f(fl['policy_rows'], 1)} / {_f(fl['base_policy_rows'], 1)} | {_f(fl['gen_s_per_row'] * 1e3, 2)} | "
            f"{_f(None if fl['candidate_s_per_row'] is None else fl['candidate_s_per_row'] * 1e3, 2)} | "
            f"{_f(fl['logp_s_per_row'] * 1e3, 2)} × {fl['ref_rows']} |")
    if not rows:
        return []
    return ["", "ARMOR on TRL's tool loop against its floor (per optimizer step): the base's measured step (GRPO with "
            "the same tools) + trajectory cost per row over all its turns × (candidate rows + groups the gate dropped × "
            "on-policy rows per group − anchor slots, rows ARMOR does not generate) + log-prob cost per row × rows that "
            "train where the base runs at β = 0, priced at this run's measured costs per row at the same M "
            "(benchmarks/floor.py); the candidates' own measured cost per row (anchor_gen + anchor_tools over their "
            "rows) beside it:", "",
            "| config | M | base | s/opt step | × base | floor s/opt step | measured / floor | candidate rows / opt step | "
            "candidate generate calls / opt step (first turns + later turns) | groups the gate dropped / opt step | slot rows credited / opt step | "
            "policy rows / opt step (variant / base) | trajectory ms per row (base) | candidate ms per row (measured) | "
            "log-prob ms per row × rows |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", *rows]
