"""orchestrator/adaptive.py: the depth rule, the cost fit, a session's acceptance."""
import pytest

from orchestrator.adaptive import CostModel, SessionDepth, best_depth, expected_tokens


def test_expected_tokens():
    assert expected_tokens([0.0] * 5, 5) == 1.0
    assert expected_tokens([1.0] * 4, 4) == 5.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)
    assert expected_tokens([0.7, 0.9, 0.9], 2) == pytest.approx(1 + 0.7 + 0.63)


def test_depth_follows_acceptance_and_load():
    # Batch 1, weight-bound forwards (a row costs 2% of a step), cheap drafting: draft deep
    # when drafts are kept, shallow when not.
    assert best_depth([0.9] * 8, 8, a=40, b=0.8, d=1.0) >= 6
    assert best_depth([0.3] * 8, 8, a=40, b=0.8, d=1.0) <= 2
    # The same pair at batch 16, compute bound: 15 other sessions' rows and tokens in the
    # forward. A draft row now costs what a whole session's token earns: no drafting.
    busy = dict(a=40, b=8.0, d=1.0, rest_rows=60, rest_tokens=15 * 1.5)
    assert best_depth([0.35] * 8, 8, **busy) == 0
    # A rule blind to the rest of the batch (batch-1 view with the same costs) would still draft.
    assert best_depth([0.35] * 8, 8, a=40, b=8.0, d=1.0) > 0
    # Very likely drafts are worth a row even then.
    assert best_depth([0.98] * 8, 8, **busy) > 0


def test_cost_line_is_learnt_from_varied_batches():
    costs = CostModel()
    assert not costs.ready
    for i in range(300):
        rows = 1 + (i * 7) % 40
        costs.observe_verify(rows, 10.0 + 2.0 * rows)
    a, b = costs.line()
    assert a == pytest.approx(10.0, rel=0.05) and b == pytest.approx(2.0, rel=0.05)
    # No spread in rows (batch 1, fixed K): the slope comes from the prior, a small fraction of a.
    flat = CostModel()
    for _ in range(50):
        flat.observe_verify(5, 30.0)
    a, b = flat.line()
    assert a + 5 * b == pytest.approx(30.0, rel=0.01) and 0 < b < 0.1 * a


def test_session_acceptance_and_probing():
    costs = CostModel()
    s = SessionDepth(k_max=4)
    for _ in range(300):
        s.observe(4, 4, costs)            # every draft token kept
    assert s.first > 0.95 and min(costs.level_rates[:4]) > 0.95 and costs.level_rates[4] == 0.7
    for _ in range(300):
        s.observe(4, 1, costs)            # level 1 kept, level 2 not; 3 and 4 never tried
    assert s.first > 0.95 and costs.level_rates[1] < 0.05 and costs.level_rates[2] > 0.95
    for _ in range(60):
        s.observe(4, 0, costs)            # first token rejected each time
    assert s.first < 0.05
    for _ in range(20):
        costs.observe_verify(1, 40.0)
    costs.observe_draft(1, 30.0)          # drafting costs nearly a verify step
    picks = [s.choose(costs, rest_rows=0, rest_sessions=0) for _ in range(16)]
    assert picks.count(0) == 14 and picks.count(1) == 2   # a probe every 8th cycle keeps alpha fresh
