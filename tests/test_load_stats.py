"""The ratio interval of the load benchmarks (benchmarks/common.py; pure, no services)."""
import pytest

from benchmarks.common import ratio_interval

pytestmark = pytest.mark.unit


def rounds(*tps):
    return {"rounds_tokens_per_s": list(tps)}


def test_a_drift_shared_by_both_settings_cancels():
    # The machine's speed doubles between rounds: paired per round, the ratio stays exactly 2.
    assert ratio_interval(rounds(100, 200, 150), rounds(50, 100, 75)) == [2.0, 2.0]


def test_spread_widens_the_interval_around_the_geometric_mean():
    lo, hi = ratio_interval(rounds(110, 90, 100, 105), rounds(100, 100, 100, 100))
    gmean = (1.1 * 0.9 * 1.0 * 1.05) ** 0.25
    assert lo < gmean < hi
    assert hi - lo > 0.05
    # More rounds with the same spread narrow it.
    lo8, hi8 = ratio_interval(rounds(*[110, 90, 100, 105] * 2), rounds(*[100] * 8))
    assert hi8 - lo8 < hi - lo


def test_too_few_rounds_give_no_interval():
    assert ratio_interval(rounds(100, 90), rounds(100, 100)) is None
