"""The batch-1 speedup benchmark's summaries (pure; no services): ratios from
alternating rounds, the best setting and its goals, the tables, and the span
accounting of its tracing rounds (benchmarks/common.py, benchmarks/otlp.py,
benchmarks/speedup_summary.py, benchmarks/traced.py)."""

import pytest

from benchmarks.common import best_setting, goal_check, goal_line, paired_ratio, rotated
from benchmarks.otlp import expected_spans, missing_spans
from benchmarks.speedup_summary import HF_ASSISTED, HF_TARGET, Draft, Row, comparison_table, summarise_mode
from benchmarks.traced import tracing_table

pytestmark = pytest.mark.unit


def test_each_system_takes_each_place_once_over_as_many_rounds():
    systems = ["off", "chain-2", "chain-4", HF_ASSISTED]
    orders = [rotated(systems, r) for r in range(len(systems))]
    assert orders[0] == systems
    for place in range(len(systems)):
        assert sorted(o[place] for o in orders) == sorted(systems)
    assert rotated(systems, len(systems)) == systems


def test_paired_ratio_cancels_a_shared_drift_and_needs_three_rounds_for_an_interval():
    # The machine halves its speed in round 2: each round's ratio is still 2.
    r = paired_ratio([40.0, 20.0, 40.0], [20.0, 10.0, 20.0])
    assert r["geomean"] == pytest.approx(2.0)
    assert r["interval"] == [2.0, 2.0]
    assert r["rounds"] == [2.0, 2.0, 2.0]
    two = paired_ratio([40.0, 20.0], [20.0, 10.0])
    assert two["geomean"] == pytest.approx(2.0) and two["interval"] is None
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0, 3.0], [1.0, 2.0])


def test_the_goal_is_judged_on_the_lower_bound_not_the_point_ratio():
    spread = {"geomean": 2.0, "interval": [1.8, 2.2]}
    assert goal_check(spread, 1.9) == {"goal": 1.9, "point": 2.0, "lower_bound": 1.8, "met": False}
    assert goal_check({"geomean": 2.0, "interval": [1.95, 2.05]}, 1.9)["met"] is True
    assert goal_check({"geomean": 2.0, "interval": None}, 1.9)["met"] is None
    assert "NOT MET (lower bound 1.800 < 1.9)" in goal_line("x", goal_check(spread, 1.9))
    assert "NOT ESTABLISHED" in goal_line("x", goal_check({"geomean": 2.0, "interval": None}, 1.9))
    assert ": point 2.000, goal 1.9: MET" in goal_line("x", goal_check({"geomean": 2.0, "interval": [1.95, 2.05]}, 1.9))


def test_best_setting_is_the_highest_point_ratio():
    assert best_setting({"a": {"geomean": 1.2}, "b": {"geomean": 1.5}, "c": {"geomean": None}}) == "b"
    assert best_setting({}) is None


def specd_row(label, mode, tps, cycles, drafted, accepted, outputs, verify_ms=40.0, draft_ms=5.0):
    """A round of a specd setting: 100 tokens at `tps` tokens/s."""
    return Row(
        "specd",
        mode,
        Draft.parse(label),
        tokens=100,
        seconds=100 / tps,
        cycles=cycles,
        drafted=drafted,
        accepted=accepted,
        draft_ms=draft_ms * cycles,
        verify_ms=verify_ms * cycles,
        overheads_ms=[1.0, 2.0, 3.0],
        outputs=outputs,
    )


def hf_row(system, mode, tps, outputs):
    return Row(system, mode, None, tokens=100, seconds=100 / tps, outputs=outputs)


def test_summarise_mode_ratios_best_setting_goals_and_greedy_equality():
    same, other = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 7]]
    drift = [1.0, 0.5, 1.0]  # the machine's speed per round, shared by every system
    rows = {
        "off": [specd_row("off", "greedy", 20 * d, 100, 0, 0, same, draft_ms=0.0) for d in drift],
        # chain-2 differs from off on one prompt in round 2 only
        "chain-2": [
            specd_row("2", "greedy", 30 * d, 40, 80, 60, other if i == 1 else same, verify_ms=50.0)
            for i, d in enumerate(drift)
        ],
        "chain-4": [specd_row("4", "greedy", 40 * d, 30, 120, 70, same, verify_ms=60.0) for d in drift],
        HF_ASSISTED: [hf_row(HF_ASSISTED, "greedy", 32 * d, same) for d in drift],
        HF_TARGET: [hf_row(HF_TARGET, "greedy", 16 * d, same) for d in drift],
    }
    s = summarise_mode(rows, goal_vs_off=1.9, goal_vs_hf=1.15)
    ratios = {(r["a"], r["b"]): r for r in s["ratios"]}
    assert ratios[("chain-4", "off")]["geomean"] == pytest.approx(2.0)
    assert ratios[("chain-4", "off")]["interval"] == [2.0, 2.0]
    assert ratios[("chain-4", HF_ASSISTED)]["geomean"] == pytest.approx(1.25)
    assert ratios[(HF_ASSISTED, HF_TARGET)]["geomean"] == pytest.approx(2.0)
    assert ratios[(HF_TARGET, "off")]["geomean"] == pytest.approx(0.8)
    assert ("off", "off") not in ratios and (HF_ASSISTED, "off") in ratios
    assert s["best"]["setting"] == "chain-4"
    assert s["best"]["vs_off"]["met"] is True  # 2.0 (2.0-2.0) clears 1.9
    assert s["best"]["vs_hf_assisted"]["met"] is True  # 1.25 clears 1.15
    c2 = s["systems"]["chain-2"]
    assert c2["greedy_outputs_equal_off"] == "5/6"
    assert s["systems"]["chain-4"]["greedy_outputs_equal_off"] == "6/6"
    assert c2["mean_accepted_length"] == pytest.approx((3 * 60 + 3 * 40) / (3 * 40))  # bonus included
    assert c2["alpha"] == pytest.approx(0.75)
    # tok/s pooled over the rounds: 300 tokens over the summed seconds
    assert c2["tokens_per_s"] == pytest.approx(300 / (100 / 30 + 100 / 15 + 100 / 30), abs=0.01)
    # Theory from the measured costs: 2.5 tokens per cycle / ((50 + 5) / 40)
    assert c2["predicted_speedup"] == pytest.approx(2.5 / (55 / 40), abs=1e-3)
    assert c2["overhead_ms_p50"] == 2.0
    table = comparison_table(s)
    assert "| chain-4 | 30 | 2.000 (2.000-2.000) | 1.250 (1.250-1.250) |" in table
    assert "| hf-assisted | 24 | 1.600 (1.600-1.600) |  | 2.000 (2.000-2.000) |" in table


def test_sampled_mode_has_no_greedy_comparison_and_no_interval_below_three_rounds():
    rows = {
        "off": [specd_row("off", "T=0.8", 20, 100, 0, 0, [[1]], draft_ms=0.0) for _ in range(2)],
        "chain-2": [specd_row("2", "T=0.8", 25, 40, 80, 60, [[2]]) for _ in range(2)],
        HF_ASSISTED: [hf_row(HF_ASSISTED, "T=0.8", 30, [[1]]) for _ in range(2)],
        HF_TARGET: [hf_row(HF_TARGET, "T=0.8", 15, [[1]]) for _ in range(2)],
    }
    s = summarise_mode(rows, 1.9, 1.15)
    assert "greedy_outputs_equal_off" not in s["systems"]["chain-2"]
    assert s["best"]["vs_off"]["met"] is None
    assert s["best"]["vs_hf_assisted"]["point"] == pytest.approx(25 / 30, abs=1e-4)
    assert "1.250 (no interval)" in comparison_table(s)


def test_expected_spans_follow_the_stats_and_missing_ones_are_named():
    stats = [
        {"cycles": 10, "drafts": 9, "method": "draft_model"},
        {"cycles": 5, "drafts": 4, "method": "ngram"},  # drafted in the orchestrator: no drafter span
        {"cycles": 7, "drafts": 0, "method": "off"},
    ]
    e = expected_spans(stats)
    assert e == {
        "specdec.generate": 3,
        "specdec.prefill": 3,
        "verifier.prefill": 3,
        "specdec.cycle": 22,
        "specdec.verify": 22,
        "verifier.verify": 22,
        "specdec.draft": 13,
        "drafter.propose": 9,
    }
    received = {**e, "specdec.cycle": 21, "drafter.close": 1}
    del received["drafter.propose"]
    assert missing_spans(e, received) == {"specdec.cycle": 1, "drafter.propose": 9}
    assert missing_spans(e, {**e, "specdec.cycle": 30}) == {}


def test_tracing_table_shows_the_interval_and_the_span_counts():
    row = {
        "streams": 8,
        "setting": "chain-4",
        "untraced": {"tokens_per_s": 100.0, "overhead_ms_p50": 2.0},
        "traced": {"tokens_per_s": 95.0, "overhead_ms_p50": 3.0},
        "ratio": {"geomean": 0.95, "interval": [0.9, 1.0]},
        "spans_expected": 700,
        "spans_received_checked": 700,
        "spans_received_all": 1500,
    }
    line = tracing_table([row]).splitlines()[-1]
    assert line == "| 8 | chain-4 | 100.0 | 95.0 | 0.950 (0.900-1.000) | 2 / 3 | 700 / 700 (1500) |"
