"""orchestrator/cycle/adaptive.py: the depth rule, the cost fit, a session's acceptance."""
import pytest

from orchestrator.cycle.adaptive import (
    CostModel,
    Load,
    RoundCosts,
    RunningMean,
    SessionDepth,
    best_depth,
    expected_tokens,
    round_ms,
)

pytestmark = pytest.mark.unit


def test_expected_tokens():
    assert expected_tokens([0.0] * 5, 5) == 1.0
    assert expected_tokens([1.0] * 4, 4) == 5.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)
    assert expected_tokens([0.7, 0.9, 0.9], 2) == pytest.approx(1 + 0.7 + 0.63)


def test_depth_follows_acceptance_and_load():
    # Batch 1, weight-bound forwards (a row costs 2% of a step), cheap drafting: draft deep
    # when drafts are kept, shallow when not.
    assert best_depth([0.9] * 8, 8, RoundCosts(a=40, b=0.8, c=0, d=1.0)) >= 6
    assert best_depth([0.3] * 8, 8, RoundCosts(a=40, b=0.8, c=0, d=1.0)) <= 2
    # Batch 16, compute bound: every row costs 8 ms and the forward holds 15 other sessions'
    # 60 rows and 22.5 tokens. A draft row now costs what a token earns: no drafting.
    busy = Load(rows=60, sessions=15, tokens=15 * 1.5, levels=45)
    assert best_depth([0.35] * 8, 8, RoundCosts(a=40, b=8.0, c=0, d=1.0), load=busy) == 0
    # A rule blind to the rest of the batch (the batch-1 view, same costs) would still draft.
    assert best_depth([0.35] * 8, 8, RoundCosts(a=40, b=8.0, c=0, d=1.0)) > 0
    # Very likely drafts are worth a row even then.
    assert best_depth([0.98] * 8, 8, RoundCosts(a=40, b=8.0, c=0, d=1.0), load=busy) > 0
    # When what costs is the session, not the row (c large, b small), load does not stop drafting.
    assert best_depth([0.7] * 8, 8, RoundCosts(a=20, b=0.3, c=10, d=1.0), load=busy) >= 4
    # Drafting alongside verification: with many sessions the drafter's time mostly hides
    # behind the verifier's, so a slow drafter stops deep drafting at batch 1 only.
    assert best_depth([0.6] * 8, 8, RoundCosts(a=30, b=0.3, c=0, d=25)) <= 1
    assert best_depth([0.6] * 8, 8, RoundCosts(a=30, b=0.3, c=10, d=1), load=Load(rows=45, sessions=15, tokens=30,
                                                                        levels=30)) >= 3


def test_cost_line_is_learnt_from_varied_batches():
    costs = CostModel()
    assert not costs.ready
    for i in range(300):
        sessions = 1 + i % 16
        rows = sessions * (1 + (i * 7) % 5)
        costs.observe_verify(rows, sessions, 10.0 + 2.0 * rows + 3.0 * sessions)
    a, b, c = costs.line()
    assert a == pytest.approx(10.0, rel=0.05) and b == pytest.approx(2.0, rel=0.05) and c == pytest.approx(3.0, rel=0.05)
    # Batch 1 with a fixed K: rows never vary; b and c come from the prior, small parts of a.
    flat = CostModel()
    for _ in range(50):
        flat.observe_verify(5, 1, 30.0)
    a, b, c = flat.line()
    assert a + 5 * b + c == pytest.approx(30.0, rel=0.02) and 0 < b < 0.1 * a


def test_session_acceptance_and_probing():
    costs = CostModel()
    s = SessionDepth(k_max=4)
    for _ in range(300):
        s.observe(4, 4, costs)            # every draft token kept
    # Level 5, never drafted, leans on level 4's rate (not on the 0.7 prior it would keep for good).
    rates = costs.level_rates
    assert s.first > 0.95 and min(rates[:4]) > 0.95 and rates[4] == rates[3]
    for _ in range(300):
        s.observe(4, 1, costs)            # level 1 kept, level 2 not; 3 and 4 never tried
    assert s.first > 0.95 and costs.level_rates[1] < 0.05 and costs.level_rates[2] > 0.95
    for _ in range(60):
        s.observe(4, 0, costs)            # first token rejected each time
    assert s.first < 0.05
    for _ in range(20):
        costs.observe_verify(1, 1, 40.0)
    costs.observe_draft(1, 30.0)          # drafting costs nearly a verify step
    picks = []
    for _ in range(16):                   # one forward per cycle (batch 1)
        costs.observe_verify(1, 1, 40.0)
        picks.append(s.choose(costs, rest_rows=0, rest_sessions=0))
    assert picks.count(0) == 14 and picks.count(1) == 2   # a probe every 8th forward keeps alpha fresh


def test_sessions_at_depth_0_probe_in_the_same_forward():
    """Sessions that one forward answered probe together (one drafter batch,
    one verify forward), whenever each of them stopped drafting; a session
    not answered by that forward probes at its next cycle."""
    costs = CostModel()
    for _ in range(20):
        costs.observe_verify(1, 1, 40.0)
    costs.observe_draft(1, 30.0)
    for _ in range(60):
        costs.observe_levels(1, 0)        # nobody's drafts are kept
    sessions = [SessionDepth(k_max=4, first=0.0) for _ in range(4)]
    probes = {i: [] for i in range(4)}
    for forward in range(40):
        costs.observe_verify(4, 4, 40.0)
        for i, s in enumerate(sessions):
            if forward >= 3 * i:          # session i joins at depth 0 three forwards after the one before
                if s.choose(costs, rest_rows=3, rest_sessions=3) == 1:
                    probes[i].append(forward)
    assert probes[1] == probes[2] == probes[3] and len(probes[3]) >= 3, probes
    assert set(probes[3]) <= set(probes[0]), probes
    assert all(b - a == 8 for a, b in zip(probes[3], probes[3][1:])), probes


def test_the_hold_margin_is_on_this_sessions_share():
    """In a forward of 24 sessions one session's depth moves the whole
    forward's goodput by a few percent at most, so a margin on the whole would
    hold any depth: a session that started at K = 4 with drafts nobody keeps
    (the others drafting 4 too) must still drop to 0. At batch 1 the same
    margin keeps a depth within 5 % of the best."""
    costs = RoundCosts(a=25.0, b=0.35, c=0.38, d=0.4, o=17.0)
    busy = Load(rows=34, sessions=23, tokens=23.0, levels=11)
    rates = [0.0] + [0.014] * 7
    assert best_depth(rates, 4, costs, busy) == 0
    assert best_depth(rates, 4, costs, busy, hold=4, margin=0.05) == 0
    # Batch 1: depths 2 and 3 within 1 % of each other; the running one is kept.
    flat = [0.7] * 8
    alone = RoundCosts(a=25.0, b=1.0, c=0.0, d=3.0, o=5.0)
    best = best_depth(flat, 8, alone)
    other = best + 1 if best < 8 else best - 1
    near = (expected_tokens(flat, other)) / round_ms(other, alone, Load())
    top = (expected_tokens(flat, best)) / round_ms(best, alone, Load())
    assert near >= top / 1.05, (best, other, near, top)
    assert best_depth(flat, 8, alone, hold=other, margin=0.05) == other


def test_fixed_cycle_overhead_makes_depth_pay():
    """A cost every cycle pays whatever its depth (messages, the orchestrator)
    favours deeper drafts: the same rates and forward costs pick a deeper k
    once it is counted, and the model learns it from cycles' wall times."""
    rates = [0.7] * 8
    shallow = best_depth(rates, 8, RoundCosts(a=25, b=1.0, c=0, d=3.0))
    deep = best_depth(rates, 8, RoundCosts(a=25, b=1.0, c=0, d=3.0, o=20.0))
    assert deep > shallow, (shallow, deep)
    costs = CostModel()
    for _ in range(200):
        costs.observe_cycle(cycle_ms=50.0, verify_ms=30.0, draft_ms=8.0)
    assert abs(costs.overhead_ms - 12.0) < 0.1
    costs.observe_cycle(cycle_ms=10.0, verify_ms=30.0, draft_ms=8.0)     # never negative
    assert costs.overhead_ms > 11.0


def test_running_mean_starts_from_data_and_clips_one_off_stalls():
    m = RunningMean(0.95)
    assert m.value == 0.0 and not m.seen
    m.observe(2.0)
    assert m.value == 2.0                  # the first observation at face value, not 0.1 of it
    for _ in range(10):
        m.observe(2.0)
    m.observe(200.0)                       # a one-off stall counts as 4x the mean
    assert m.value < 3.0
    for _ in range(20):                    # a real, lasting rise still gets through
        m.observe(50.0)
    assert m.value > 30.0                  # (the window lags as any ~20-draw average does)
    cold = RunningMean(0.9)
    cold.observe(100.0)                    # a cold first call...
    cold.observe(1.5)                      # ...is dropped by the first warm one under 1/4 of it
    assert cold.value == 1.5


def test_fresh_cost_model_is_not_poisoned_by_first_calls():
    costs = CostModel()
    costs.observe_draft(4, 400.0)          # a cold first draft: 100 ms per level
    costs.observe_verify(5, 1, 300.0)
    for _ in range(15):
        costs.observe_draft(4, 6.0)
        costs.observe_verify(5, 1, 5.0)
        costs.observe_verify(3, 1, 4.6)
    assert costs.draft_ms_per_level == pytest.approx(1.5)  # a plain 0.9 average kept ~20 ms
    a, b, c = costs.line()
    assert a + 5 * b + c < 10.0


def test_a_row_of_spread_on_a_busy_host_does_not_make_rows_dear():
    # A fresh stack's first verify forwards at batch 1 on a loaded 2-core host
    # (ms, logged): one forward had a row fewer (its root run ahead), and the
    # times swing by half. A row of the demo pair's target costs ~0.1 ms.
    costs = CostModel()
    for rows, ms in ((5, 48.75), (4, 27.99), (5, 41.07), (5, 31.12), (5, 36.87)):
        costs.observe_verify(rows, 1, ms)
    a, b, c = costs.line()
    assert b < 0.05 * (a + 5 * b + c), (a, b, c)  # a prior weight of 2 said 3.6 ms a row
    # ...so a drafter kept ~90 % of the time still drafts K = 4, even one
    # costing 11.5 ms a level (its process starved too).
    rates = [0.95, 0.83, 0.77, 0.94]
    assert best_depth(rates, 4, RoundCosts(a, b, c, d=11.5, o=7.2), hold=4, margin=0.05) == 4


def test_fresh_model_drafts_k_first_and_one_miss_does_not_sink_deep_levels():
    costs, s = CostModel(), SessionDepth(k_max=4)
    for _ in range(3):
        costs.observe_verify(5, 1, 5.0)
        assert s.choose(costs, 0, 0) == 4  # exploring: K until explore_cycles forwards
    costs.observe_verify(5, 1, 5.0)
    assert costs.ready
    s.observe(4, 1, costs)                 # level 2 missed once, deeper levels untried
    s.observe(4, 4, costs)
    s.observe(4, 4, costs)
    rates = costs.level_rates
    assert rates[1] > 0.6 and rates[4] == rates[3]
    costs.observe_draft(4, 4.0)
    assert s.choose(costs, 0, 0) == 4      # cheap drafting, good acceptance: deep


def test_depth_holds_near_a_tie_and_moves_for_a_clear_gain():
    rates, costs = [0.75] * 8, RoundCosts(a=10.0, b=0.4, c=0.7, d=3.0, o=3.0)  # k = 3 wins by 2%
    free = best_depth(rates, 4, costs)
    assert free < 4                                           # alone, k = 4 narrowly loses ...
    assert best_depth(rates, 4, costs, hold=4, margin=0.05) == 4   # ... and is kept near the tie
    assert best_depth([0.2] * 8, 4, costs, hold=4, margin=0.05) < 2  # a clear loss still moves


def test_probes_that_keep_nothing_come_less_often():
    """Probes whose token is rejected stretch the interval (16, 32, then 64
    forwards at most after 4, 8, 16 misses in a row; the next probe at the
    next multiple of it, so that sessions stay on one clock), counted over the
    method's sessions: a new session starts at the long interval. A probe
    whose token is kept brings it back to 8."""
    costs = CostModel()
    for _ in range(20):
        costs.observe_verify(1, 1, 40.0)
    costs.observe_draft(1, 30.0)
    for _ in range(60):
        costs.observe_levels(1, 0)
    s = SessionDepth(k_max=4, first=0.0)
    probes = []
    for forward in range(800):
        costs.observe_verify(1, 1, 40.0)
        if s.choose(costs, 0, 0) == 1:
            probes.append(forward)
            s.observe(1, 0, costs)       # rejected
            s.first = 0.0
        else:
            s.observe(0, 0, costs)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[:3] == [8, 8, 8] and set(gaps[16:]) == {64}, gaps
    assert len(probes) <= 16 + (800 - 8 * (3 + 4 * 2 + 8 * 4)) // 64 + 1, probes  # at a fixed 8: 100
    # A new request's session, after those misses: 64 forwards between its probes too.
    fresh, fresh_probes = SessionDepth(k_max=4, first=0.0), []
    for forward in range(200):
        costs.observe_verify(1, 1, 40.0)
        if fresh.choose(costs, 0, 0) == 1:
            fresh_probes.append(forward)
            fresh.observe(1, 0, costs)
            fresh.first = 0.0
        else:
            fresh.observe(0, 0, costs)
    assert [b - a for a, b in zip(fresh_probes, fresh_probes[1:])] == [64, 64], fresh_probes
    # A kept probe: the next one 8 forwards on (once the level-1 rate is back at 0).
    while s.choose(costs, 0, 0) != 1:
        costs.observe_verify(1, 1, 40.0)
    s.observe(1, 1, costs)
    s.first = 0.0
    at = costs.forwards
    while True:
        costs.observe_verify(1, 1, 40.0)
        if s.choose(costs, 0, 0) == 1:
            break
    assert costs.forwards - at <= 8
