"""Ratios between systems measured in alternating rounds (pure functions).

A ratio between two systems is only a result when both ran side by side: each
round runs every system once, in an order rotated each round, and each ratio
is the geometric mean of its per-round ratios with a rough 95 % interval from
their spread (`specd.bench.log_ratio_interval`, also benchmarks/load.py's
`ratio_interval`). A drift of the machine that a round's systems share cancels
in the per-round ratio; the interval says how much noise is left.

Here: the order of a round, a ratio with its interval, the best setting and
whether its interval clears a goal, and the Markdown tables the benchmarks print.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TypeVar

from specd.bench import log_ratio_interval

T = TypeVar("T")


def rotated(items: Sequence[T], r: int) -> list[T]:
    """Round r's order: the items rotated by r, so that over the rounds each
    system runs in each place (first, last, ...) in turn, and a drift within a
    round does not always weigh on the same one."""
    if not items:
        return []
    k = r % len(items)
    return list(items[k:]) + list(items[:k])


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> dict:
    """a over b from paired rounds (a[i] ran in the same round as b[i]): the
    per-round ratios, their geometric mean, and the interval (None with fewer
    than 3 rounds: two ratios say nothing about the spread)."""
    if len(a) != len(b):
        raise ValueError(f"paired rounds differ in number: {len(a)} vs {len(b)}")
    per_round = [x / y for x, y in zip(a, b) if x > 0 and y > 0]
    return {
        "geomean": round(statistics.geometric_mean(per_round), 4) if per_round else None,
        "interval": log_ratio_interval(a, b),
        "rounds": [round(x, 4) for x in per_round],
    }


def best_setting(vs_base: dict[str, dict]) -> str | None:
    """The setting with the highest point ratio (geometric mean) over the base;
    None when there is none."""
    scored = {k: v["geomean"] for k, v in vs_base.items() if v.get("geomean") is not None}
    return max(scored, key=lambda k: scored[k]) if scored else None


def goal_check(ratio: dict, goal: float) -> dict:
    """Whether a ratio's interval clears a goal: its LOWER bound must be at
    least the goal (the point ratio alone does not make the claim). met is
    None when there is no interval (too few rounds to tell)."""
    lower = ratio["interval"][0] if ratio.get("interval") else None
    return {
        "goal": goal,
        "point": ratio.get("geomean"),
        "lower_bound": lower,
        "met": None if lower is None else lower >= goal,
    }


def fmt_ratio(ratio: dict | None) -> str:
    """'1.23 (1.20-1.26)'; the interval as 'no interval' below 3 rounds."""
    if not ratio or ratio.get("geomean") is None:
        return ""
    iv = ratio.get("interval")
    return f"{ratio['geomean']:.3f} ({iv[0]:.3f}-{iv[1]:.3f})" if iv else f"{ratio['geomean']:.3f} (no interval)"


def goal_line(what: str, check: dict) -> str:
    """One line saying plainly whether a goal is met by the interval's lower bound."""
    if check["met"] is None:
        verdict = "NOT ESTABLISHED (no interval: fewer than 3 rounds)"
    elif check["met"]:
        verdict = f"MET (lower bound {check['lower_bound']:.3f} >= {check['goal']})"
    else:
        verdict = f"NOT MET (lower bound {check['lower_bound']:.3f} < {check['goal']})"
    point = "" if check["point"] is None else f"point {check['point']:.3f}, "
    return f"{what}: {point}goal {check['goal']}: {verdict}"


def _cell(v) -> str:
    if v is None:
        return ""
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def comparison_table(summary: dict) -> str:
    """One mode's systems as a Markdown table: tok/s (all rounds pooled), the
    ratios with their intervals, and the per-cycle figures of specd's settings.
    `summary`: benchmarks.speedup's per-mode summary (systems, ratios)."""
    ratios = {(r["a"], r["b"]): r for r in summary["ratios"]}
    head = (
        "| system | tok/s | x off (interval) | x HF assisted (interval) | x HF target-only (interval) "
        "| accepted length | alpha | predicted x | overhead p50 / p90 ms | verify / draft ms per cycle "
        "| greedy = off |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for name, d in summary["systems"].items():
        cols = [
            name,
            _cell(d["tokens_per_s"]),
            fmt_ratio(ratios.get((name, "off"))),
            fmt_ratio(ratios.get((name, "hf-assisted"))),
            fmt_ratio(ratios.get((name, "hf-target-only"))),
            _cell(d.get("mean_accepted_length")),
            _cell(d.get("alpha")),
            _cell(d.get("predicted_speedup")),
            f"{d['overhead_ms_p50']:.2f} / {d['overhead_ms_p90']:.2f}" if "overhead_ms_p50" in d else "",
            f"{d['verify_ms_per_cycle']:.1f} / {d['draft_ms_per_cycle']:.1f}" if "verify_ms_per_cycle" in d else "",
            d.get("greedy_outputs_equal_off", ""),
        ]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def tracing_table(rows: Sequence[dict]) -> str:
    """The tracing cost per level: traced / untraced tokens/s with its interval,
    the per-cycle overhead of both, and the spans received of the names checked
    against the count expected (all spans received in brackets)."""
    lines = [
        "| streams | setting | untraced tok/s | traced tok/s | traced / untraced (interval) "
        "| overhead p50 untraced / traced ms | spans received / expected (all received) |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in rows:
        lines.append(
            f"| {t['streams']} | {t['setting']} | {t['untraced']['tokens_per_s']:.1f} "
            f"| {t['traced']['tokens_per_s']:.1f} "
            f"| {fmt_ratio(t['ratio'])} | {_cell(t['untraced'].get('overhead_ms_p50'))} / "
            f"{_cell(t['traced'].get('overhead_ms_p50'))} | {t['spans_received_checked']} / {t['spans_expected']} "
            f"({t['spans_received_all']}) |"
        )
    return "\n".join(lines)
