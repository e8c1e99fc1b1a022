"""The benchmarks' statistics (benchmarks/common.py) against values worked out
by hand: the interval of paired rounds, the geometric mean, percentiles, and
the orders of alternating rounds (pure; no services)."""

import math

import pytest

from benchmarks.common import alternating, log_ratio_interval, paired_ratio, pct, percentile, ratio_interval, rotated

pytestmark = pytest.mark.unit


def test_interval_of_three_rounds_by_hand():
    # Ratios 1, 2, 4: logs 0, ln 2, 2 ln 2; mean ln 2, sample sd ln 2, se ln 2 / sqrt 3.
    # exp(ln 2 -/+ 2 ln 2 / sqrt 3) = 2 ** (1 -/+ 1.1547) = 0.898, 4.453.
    assert log_ratio_interval([1.0, 2.0, 4.0], [1.0, 1.0, 1.0]) == [0.898, 4.453]
    # z = 1: 2 ** (1 -/+ 0.57735) = 1.340, 2.984.
    assert log_ratio_interval([1.0, 2.0, 4.0], [1.0, 1.0, 1.0], z=1.0) == [1.34, 2.984]
    # The same through the rows the load benchmarks write.
    assert ratio_interval({"rounds_tokens_per_s": [10, 40, 20]}, {"rounds_tokens_per_s": [10, 20, 5]}) == [0.898, 4.453]


def test_paired_ratio_is_the_geometric_mean_of_the_rounds():
    r = paired_ratio([2.0, 8.0, 4.0], [1.0, 2.0, 4.0])  # per round 2, 4, 1
    assert r["rounds"] == [2.0, 4.0, 1.0]
    assert r["geomean"] == 2.0  # (2 * 4 * 1) ** (1/3)
    assert r["interval"] == [0.898, 4.453]
    # A round where either system made nothing has no ratio and is left out.
    assert paired_ratio([2.0, 0.0], [1.0, 3.0])["rounds"] == [2.0]
    assert paired_ratio([0.0], [1.0]) == {"geomean": None, "interval": None, "rounds": []}


def test_percentiles_are_linear_between_order_statistics():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted 1 2 3 4; position (n - 1) q
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)  # 3 + 0.7 * (4 - 3)
    assert pct(values, 0.9) == pytest.approx(3.7)
    assert pct(values, 0.0) == 1.0 and pct(values, 1.0) == 4.0
    assert pct([], 0.5) == 0.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_round_orders():
    assert [rotated("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert [alternating((1, 8), r) for r in range(3)] == [[1, 8], [8, 1], [1, 8]]
    assert rotated([], 3) == []


def test_hand_values_match_the_formula():
    # The constants above, from the formula itself (guards the arithmetic by hand).
    se = math.log(2) / math.sqrt(3)
    assert round(math.exp(math.log(2) - 2 * se), 3) == 0.898
    assert round(math.exp(math.log(2) + 2 * se), 3) == 4.453
