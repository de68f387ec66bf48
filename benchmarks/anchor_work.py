"""The anchor candidates' work (issue 36): candidate rows generated per optimizer step and per verified anchor, for
eager and lazy sampling, with and without eligibility, next to the times.

Counts come from ArmorGRPOTrainer's running totals (``AnchorRollout.counts``), recorded at the end of every optimizer
step (``benchmarks.run``), and are taken over the measured steps (after warm-up). "Groups drawing in their round" is the
share of generated groups that drew candidates in the round that generated them; deferred groups (``anchor_deferred``)
draw after the refill loop instead, counted per optimizer step. A "verified anchor" is a group that
found its anchor among this round's fresh candidates (cache hits and column anchors are not counted). Candidate rows
include the padding rows of other processes and, in a same-call round, the K rows per group of the policy's call.
The ratios compare each variant with its paper path (``bench.yaml``: ``anchor_work.reference``), measured in the same
bench run.
"""

from __future__ import annotations

import statistics

from benchmarks.config import BenchConfig

COUNTS = ("candidate_rows", "candidates_scored", "anchors_from_candidates", "groups", "eligible_groups",
          "deferred_groups")


def measured(run: dict, warmup_steps: int) -> dict | None:
    """A run's candidate work over its measured steps (None: no anchor rollout, or no measured step)."""
    records = run.get("anchor_counts")
    if not records or len(records) <= warmup_steps:
        return None
    start = records[warmup_steps - 1] if warmup_steps > 0 else {}
    delta = {key: records[-1].get(key, 0) - start.get(key, 0) for key in COUNTS}  # (older runs lack deferred_groups)
    steps = len(records) - warmup_steps
    anchors = delta["anchors_from_candidates"]
    return {
        "candidate_rows_per_step": delta["candidate_rows"] / steps,
        "candidates_scored_per_step": delta["candidates_scored"] / steps,
        "anchors_per_step": anchors / steps,
        "candidate_rows_per_anchor": delta["candidate_rows"] / anchors if anchors else None,
        "eligible_share": delta["eligible_groups"] / delta["groups"] if delta["groups"] else None,
        "deferred_groups_per_step": delta["deferred_groups"] / steps,
    }


def mixed_share(run: dict, warmup_steps: int) -> float | None:
    """The realized share of generated groups with mixed on-policy outcomes (dynamic sampling's drop metrics)."""
    drops = [(correct, wrong) for step, correct, wrong, *_ in run.get("dropped_by_step", []) if step > warmup_steps]
    if not drops:
        return None
    return 1.0 - statistics.mean(c for c, _ in drops) - statistics.mean(w for _, w in drops)


def summarize(runs: list, warmup_steps_of) -> dict | None:
    """Median over repetitions of each quantity of :func:`measured` (and the realized mixed share)."""
    per_run = [(measured(run, warmup_steps_of(run)), mixed_share(run, warmup_steps_of(run))) for run in runs]
    per_run = [(work, share) for work, share in per_run if work is not None]
    if not per_run:
        return None
    out = {}
    for key in per_run[0][0]:
        values = [work[key] for work, _ in per_run if work[key] is not None]
        out[key] = statistics.median(values) if values else None
    shares = [share for _, share in per_run if share is not None]
    out["mixed_share"] = statistics.median(shares) if shares else None
    return out


def with_ratios(entries: dict, bench: BenchConfig) -> None:
    """Add ``vs_reference``: rows per step and per verified anchor over the variant's paper path (same M / table)."""
    for name, entry in entries.items():
        work, reference = entry.get("anchor_work"), bench.anchor_work.get("reference", {}).get(name)
        base = entries.get(reference, {}).get("anchor_work") if reference else None
        if not work or not base:
            continue
        ratio = lambda key: (work[key] / base[key] if work[key] is not None and base[key] else None)  # noqa: E731
        work["vs_reference"] = {"reference": reference, "rows_per_step": ratio("candidate_rows_per_step"),
                                "rows_per_anchor": ratio("candidate_rows_per_anchor")}


def check_targets(entries: dict, bench: BenchConfig, mixed_share_setting: float | None, label: str = "") -> list:
    """Issue 36's count targets: candidate rows per verified anchor over the paper path's, at a mixed-share setting
    (``met`` is None when this run used another setting)."""
    rows = []
    for target in bench.anchor_work.get("targets", []):
        work = entries.get(target["variant"], {}).get("anchor_work") or {}
        ratio = (work.get("vs_reference") or {}).get("rows_per_anchor")
        if ratio is None:
            continue
        applies = mixed_share_setting is not None and abs(mixed_share_setting - target["mixed_share"]) < 1e-9
        rows.append({"target": f"candidate rows per verified anchor {target['variant']} / {target['base']}{label} "
                               f"<= {target['bound']:.2f} at mixed share {target['mixed_share']:.0%}",
                     "measured": ratio, "mixed_share_setting": mixed_share_setting,
                     "realized_mixed_share": work.get("mixed_share"),
                     "met": bool(ratio <= target["bound"]) if applies else None})
    return rows


def table(entries: dict, title: str, m_of=None) -> list:
    """Markdown lines: one row per variant (and M) with candidate work."""
    f = lambda v, d=2: "—" if v is None else f"{v:.{d}f}"  # noqa: E731
    rows = []
    for name, entry in entries.items():
        for m, e in (entry.items() if m_of else [(None, entry)]):
            work = e.get("anchor_work")
            if not work:
                continue
            vs = work.get("vs_reference") or {}
            rows.append(f"| {name} | {'' if m is None else m + ' | '}{f(work['candidate_rows_per_step'], 1)} | "
                        f"{f(work['candidates_scored_per_step'], 1)} | {f(work['anchors_per_step'], 2)} | "
                        f"{f(work['candidate_rows_per_anchor'])} | {vs.get('reference', '—')} | "
                        f"{f(vs.get('rows_per_step'))} | {f(vs.get('rows_per_anchor'))} | {f(work['eligible_share'])} | "
                        f"{f(work.get('deferred_groups_per_step'))} | {f(work['mixed_share'])} |")
    if not rows:
        return []
    return ["", title, "",
            "| config | " + ("M | " if m_of else "") + "candidate rows / opt step | scored / opt step | verified anchors / "
            "opt step | rows per verified anchor | paper path | × rows/step | × rows/anchor | groups drawing in their "
            "round | deferred groups / opt step | mixed groups (realized) |",
            "|---|" + ("---|" if m_of else "") + "---|---|---|---|---|---|---|---|---|---|", *rows]


def targets_table(rows: list) -> list:
    if not rows:
        return []
    f = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
    lines = ["", "Candidate-work targets (met only judged at the target's mixed share):", "",
             "| target | measured | mixed share set / realized | met |", "|---|---|---|---|"]
    for row in rows:
        met = {True: "yes", False: "**no**", None: "— (other mixed share)"}[row["met"]]
        lines.append(f"| {row['target']} | {f(row['measured'])} | {f(row['mixed_share_setting'])} / "
                     f"{f(row['realized_mixed_share'])} | {met} |")
    return lines
