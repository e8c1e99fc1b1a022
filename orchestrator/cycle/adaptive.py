"""Choosing each cycle's draft depth from what is measured (pure; no grpc).

A verify forward of S sessions and R rows (each session's pending token and
draft nodes) costs about V = a + b*R + c*S ms: b is what a row costs (FLOPs,
once the forward is compute bound), c what a session costs however long its
draft (its attention, acceptance, compaction, messages). Drafting costs about
d ms per level. A session drafting k tokens commits E(k) = 1 + r1 + r1*r2 +
... + r1*...*rk tokens per cycle, where ri is the chance that level i is kept
given that level i-1 was: r1 is the session's own (how well the drafter knows
this text), the deeper ones are measured over all sessions. Acceptances are
correlated (after a kept token the next is likelier kept), so one i.i.d. rate,
(1 - a^(k+1)) / (1 - a), would undervalue depth.

With this session at depth k and the forward's other sessions as they are
(R_rest rows, S_rest sessions, E_rest tokens, L_rest draft levels), a round
costs T = max(V, D) + min(V, D) / n + o: alone (n = 1) drafting and verifying
follow each other; with n sessions the drafter drafts some while the verifier
verifies others, so mostly the busier of the two counts. o is what a cycle
costs besides the two computations (the messages, the orchestrator's work,
waiting for a batch): measured, because it is a fixed cost per cycle that
makes depth pay more - left out, the choice runs shallow when the forwards are
cheap (docs/architecture.md gives the measurement). The server's goodput

    G(k) = (E(k) + E_rest) / T(k),  V = a + b*(R_rest + k + 1) + c*(S_rest + 1),  D = d*(L_rest + k)

and k = argmax G(k) over 0..k_max. At batch 1 that is the classic speculative
optimum; when rows are what costs and the forward is full of other sessions'
rows, a draft token must be likely kept to pay for its row, down to k = 0
(plain decoding) when none would.

Within the chosen depth, the same round costs set the confidence below which
the drafter stops (SessionDepth.threshold; the rule and what it learns:
orchestrator/cycle/confidence.py): a node is worth drafting below when its
expected share of committed tokens, at the round's ms per token, exceeds what
one more row and level add to T.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.cycle.confidence import ConfidenceTable


def expected_tokens(rates: list[float], k: int) -> float:
    """Tokens per cycle with k draft tokens; rates[i]: level i+1 kept given level i was."""
    total, reach = 1.0, 1.0
    for r in rates[:k]:
        reach *= r
        total += reach
    return total


@dataclass(frozen=True)
class Load:
    """The rest of the verify forward a session shares (none: batch 1)."""

    rows: float = 0.0  # R_rest
    sessions: int = 0  # S_rest
    tokens: float = 0.0  # E_rest: what those sessions commit per cycle
    levels: float = 0.0  # L_rest: their draft levels (drafter work)


@dataclass(frozen=True)
class RoundCosts:
    """What a round costs, in ms: a verify forward a + b*rows + c*sessions,
    d per draft level, and o besides the two computations."""

    a: float
    b: float
    c: float
    d: float
    o: float = 0.0


def round_ms(k: int, costs: RoundCosts, load: Load) -> float:
    v = costs.a + costs.b * (load.rows + k + 1) + costs.c * (load.sessions + 1)
    dr = costs.d * (load.levels + k)
    return max(v, dr) + min(v, dr) / (load.sessions + 1) + costs.o


def best_depth(
    rates: list[float],
    k_max: int,
    costs: RoundCosts,
    load: Load = Load(),
    hold: int | None = None,
    margin: float = 0.0,
) -> int:
    """hold: the depth running now, kept unless another's goodput beats it by
    more than `margin` (a fraction). For a move to plain decoding the margin
    is on this session's share of the goodput: the goodput is the whole
    forward's, of which one session among n is about 1/n, so a margin on the
    whole would keep a session drafting tokens nobody keeps at a large batch
    (32 sessions drafting 4 such tokens each cost a few % of the goodput
    each, and together a third of it); between two depths that both draft,
    the whole margin still damps the estimates' noise."""

    def goodput(k: int) -> float:
        return (expected_tokens(rates, k) + load.tokens) / round_ms(k, costs, load)

    best = max(range(k_max + 1), key=lambda k: (goodput(k), -k))
    m = margin / (load.sessions + 1) if best == 0 else margin
    if hold is not None and hold <= k_max and goodput(best) <= (1.0 + m) * goodput(hold):
        return hold
    return best


def screened(x: float, reference: float, settled: bool, clip: float) -> float | None:
    """An observation as a running estimate should take it, against what the
    estimate expects (`reference`): once settled, at most `clip` times that
    (winsorised: a one-off stall cannot poison the estimate, a real rise still
    moves it); before, None when it is under 1/clip of it: the observations
    before were the outliers (cold calls), to be dropped, not this one."""
    if settled:
        return min(x, clip * reference)
    return None if x * clip < reference else x


@dataclass
class RunningMean:
    """An exponentially weighted mean that starts from its first observations
    rather than from a made-up value: the weights are normalised (the bias
    correction of Adam's moments), so after n observations the mean is theirs,
    however small n. A plain moving average started at 0 (or at a guess) took
    ~20 cycles at 0.95 to get near the truth, longer than a short request: the
    first request of a fresh system chose its depths from the start value.

    Observations over `clip` times the current mean count as `clip` times it
    (winsorised), once `settle` of them are in: a one-off stall (a page fault,
    a neighbour's burst) cannot poison the window, while a real rise in cost
    still moves the mean by up to that factor per observation. Before that, an
    observation under 1/clip of the mean drops what came before: the first
    calls were the outliers (cold), not this one."""

    decay: float
    clip: float = 4.0
    settle: float = 3.0  # observations (weight) before clipping starts
    value: float = 0.0  # what is returned before any observation
    _w: float = field(default=0.0, repr=False)
    _s: float = field(default=0.0, repr=False)

    def observe(self, x: float) -> None:
        kept = screened(x, self.value, self._w >= self.settle, self.clip)
        if kept is None:  # the observations so far were cold
            self._w = self._s = 0.0
        else:
            x = kept
        self._w = self.decay * self._w + 1.0
        self._s = self.decay * self._s + x
        self.value = self._s / self._w

    @property
    def seen(self) -> bool:
        return self._w > 0.0


@dataclass
class CostModel:
    """verify_ms ~ a + b * rows + c * sessions by least squares over recent
    forwards (an exponential window), draft_ms per level and tokens per
    session-cycle as moving averages, acceptance per level; shared by the
    sessions of one method in the orchestrator.

    Until forwards have seen rows vary apart from sessions, b and c lean on a
    prior (a row costs 2% and a session 10% of a one-row forward: small
    forwards are bound by reading the weights); data take over as they vary
    (for b, once rows have spread by more than a row or two: prior_weight).

    Cold start: what a fresh system learns from its first request must be what
    it will cost later, or a short request runs at the depth its first cycles
    chose. So (1) the model services warm up before they serve (a forward of
    each shape their batchers run; specd_core/runtime/warmup.py), so that first
    forwards, allocations and kernel selection are not in the first verify and
    draft times; (2) draft and overhead times are normalised, winsorised means
    (RunningMean) that take their first observations at face value and clip
    later one-off stalls, and verify times are winsorised against the line's
    own prediction; (3) a draft level's acceptance leans, until it has data of
    its own, on the level above's rather than on a fixed 0.7: a level that is
    never drafted (because the prior made it look poor) would otherwise stay
    at the prior for good, and acceptances are positively correlated, so the
    level above is the better guess. Measured on the demo pair, the first
    request of a fresh stack went from 0.6 x fixed K = 4's accepted length to
    about 1.0 x (docs/architecture.md, "Adaptive depth")."""

    decay: float = 0.98  # weight of the past per observation (~50-forward window)
    prior: tuple[float, float] = (0.02, 0.10)
    # The prior's weight on b and on c, in squared rows (sessions) of spread
    # among forwards. b's is heavy: at batch 1 rows vary by a row or two (a
    # depth change, a root run ahead), and on a busy host one forward's time
    # swings by 30-50 %, so two forwards a row apart said a row cost 4-8 ms
    # on the demo pair (truly ~0.1), and the session drafted shallow for the
    # rest of a short request. A batch's rows spread by tens, which outweighs
    # it at once.
    prior_weight: tuple[float, float] = (16.0, 2.0)
    # A verify forward over this many times the line's prediction counts as
    # this many times it (once the line has a few forwards): see RunningMean.
    verify_clip: float = 4.0
    # Cycles at the request's K before the model chooses: a fresh model's
    # first cycles are one or two draws per level, too few to tell a level
    # that is poor from one that missed once (greedy text is the same every
    # run, so an early miss would steer every fresh start alike).
    explore_cycles: int = 4
    _forwards: int = field(default=0, repr=False)
    last_forward: int = field(default=0, repr=False)  # the batch_id learned last (learn_costs)
    # Probes at depth 1 in a row, over all sessions, whose token was rejected
    # (SessionDepth: how far apart the next probes are).
    probe_misses: int = 0
    # Weighted sums x x^T and x y over forwards, x = (1, rows, sessions): plain
    # floats, since every cycle of every session updates them.
    _m: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)], repr=False)
    _v: list[float] = field(default_factory=lambda: [0.0] * 3, repr=False)
    _w: float = 0.0
    _y: float = 0.0
    # Drafter time per draft token, over its batches.
    _draft: RunningMean = field(default_factory=lambda: RunningMean(0.9), repr=False)
    tokens_per_cycle: float = 1.0  # per session-cycle
    # o: a cycle's wall time besides its verify and draft compute.
    _overhead: RunningMean = field(default_factory=lambda: RunningMean(0.95), repr=False)
    # Per draft level: kept given the level above was kept, as weighted counts
    # (decay `level_decay` per observation of that level) and the prior weight
    # of the level above's rate (level 1's prior: `first_prior`).
    level_decay: float = 0.98
    first_prior: float = 0.7
    level_prior_weight: float = 1.0
    _level_n: list[float] = field(default_factory=lambda: [0.0] * 16, repr=False)
    _level_kept: list[float] = field(default_factory=lambda: [0.0] * 16, repr=False)
    # Acceptance per bucket of the drafter's confidence: where drafts stop
    # (orchestrator/cycle/confidence.py).
    confidence: ConfidenceTable = field(default_factory=ConfidenceTable)

    @property
    def forwards(self) -> int:
        """Verify forwards learned so far (each once, whatever the sessions in it)."""
        return self._forwards

    @property
    def draft_ms_per_level(self) -> float:
        return self._draft.value

    @property
    def overhead_ms(self) -> float:
        return self._overhead.value

    @property
    def level_rates(self) -> list[float]:
        """Per draft level: kept given the level above was kept (a level's own
        data, shrunk toward the level above's rate by level_prior_weight)."""
        rates, prior, w0 = [], self.first_prior, self.level_prior_weight
        for n, kept in zip(self._level_n, self._level_kept):
            prior = (kept + w0 * prior) / (n + w0)
            rates.append(prior)
        return rates

    def observe_verify(self, rows: int, sessions: int, ms: float) -> None:
        if self._w > 0.0:  # as RunningMean, against the line's prediction
            a, b, c = self.line()
            predicted = max(a + b * rows + c * sessions, 1e-3)
            kept = screened(ms, predicted, self._forwards >= self.explore_cycles, self.verify_clip)
            if kept is None:  # the forwards before were cold: drop them
                self._m, self._v = [[0.0] * 3 for _ in range(3)], [0.0] * 3
                self._w = self._y = 0.0
            else:
                ms = kept
        x, g = (1.0, float(rows), float(sessions)), self.decay
        for i in range(3):
            self._v[i] = g * self._v[i] + x[i] * ms
            for j in range(3):
                self._m[i][j] = g * self._m[i][j] + x[i] * x[j]
        self._w, self._y = g * self._w + 1, g * self._y + ms
        self._forwards += 1

    def observe_draft(self, nodes: int, ms: float) -> None:
        """A drafter batch drafted `nodes` tokens (all its sessions') in ms."""
        if nodes > 0:
            self._draft.observe(ms / nodes)

    def observe_cycle(self, cycle_ms: float, verify_ms: float, draft_ms: float) -> None:
        """A session's cycle took cycle_ms of wall time, of which its verify
        forward (its batch's) and the draft it waited for computed the rest."""
        self._overhead.observe(max(0.0, cycle_ms - verify_ms - draft_ms))

    def observe_tokens(self, committed: int) -> None:
        self.tokens_per_cycle = 0.95 * self.tokens_per_cycle + 0.05 * committed

    def observe_levels(self, drafted_depth: int, accepted: int) -> None:
        """Levels 1..accepted were kept, level accepted+1 (if drafted) was not;
        deeper ones were never tried."""
        g = self.level_decay
        for i in range(min(drafted_depth, accepted + 1, len(self._level_n))):
            self._level_n[i] = g * self._level_n[i] + 1.0
            self._level_kept[i] = g * self._level_kept[i] + (1.0 if i < accepted else 0.0)

    @property
    def ready(self) -> bool:
        return self._forwards >= self.explore_cycles

    def line(self) -> tuple[float, float, float]:
        """(a, b, c) of verify_ms ~ a + b * rows + c * sessions."""
        # Ridge toward the prior on b and c (scaled by the typical cost), so
        # that rows always moving with sessions (fixed K) leave them defined.
        scale = self._y / self._w
        m, v = [row[:] for row in self._m], self._v[:]
        for i, frac, lam in ((1, self.prior[0], self.prior_weight[0]), (2, self.prior[1], self.prior_weight[1])):
            m[i][i] += lam
            v[i] += lam * frac * scale
        a, b, c = _solve(m, v)
        return max(a, 0.0), max(b, 0.0), max(c, 0.0)

    def round_costs(self) -> RoundCosts:
        """The verify line, the draft cost per level and the cycle's overhead, as learnt."""
        return RoundCosts(*self.line(), self.draft_ms_per_level, self.overhead_ms)


def _solve(m: list[list[float]], v: list[float]) -> list[float]:
    """m x = v for a small symmetric positive definite m (Gaussian elimination;
    m and v are overwritten)."""
    n = len(v)
    for k in range(n):
        for i in range(k + 1, n):
            f = m[i][k] / m[k][k]
            v[i] -= f * v[k]
            for j in range(k, n):
                m[i][j] -= f * m[k][j]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (v[i] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


@dataclass
class SessionDepth:
    """One session's adaptive depth: its first-level acceptance (a moving
    average, starting from all sessions'), and a probe at depth 1 now and then
    while it runs at 0, so that its acceptance is not frozen by the choice to
    stop drafting.

    Probes keep time by the verify forwards the shared cost model has learned
    (one probe per `probe_every` of them), not by the session's own cycles:
    the sessions one forward answered choose their next depth right after it,
    so at depth 0 they probe together, in one drafter batch and one verify
    forward. Counted per session, their probes fell on different cycles, and
    under load nearly every cycle carried a few: each added a verify forward
    of its own (a plain session's next row is computed ahead, a drafted one's
    is not), which cost 18-22 % of the tokens/s of plain decoding with a
    drafter whose drafts were never kept (docs/architecture.md).

    While probes keep nothing the interval grows: `probe_every` times 2, 4,
    8 (at most `probe_backoff` doublings) after 4, 8, 16 rejected probes in a
    row (`misses_per_doubling` apiece: a drafter whose first level is kept
    80 % of the time misses 4 in a row 0.2 % of the time, while a session
    that dropped to depth 0 on a timing blip must come back within a short
    request), counted over all the method's sessions (CostModel.probe_misses), so that a
    new request starts where the others are instead of at the shortest
    interval (a 64-token request ends before its own misses would count
    much); a probe that keeps its token brings every session back to
    `probe_every`. The intervals are powers of two of one clock, so sessions
    still probe in the same forwards (the next probe after a doubling comes at
    the next multiple of the new interval)."""

    k_max: int
    first: float | None = None  # level 1 kept; None: take all sessions' rate
    probe_every: int = 8  # verify forwards (all sessions') per probe
    probe_backoff: int = 3  # at most 2**3 x probe_every forwards between probes
    misses_per_doubling: int = 4
    _probing: bool = False  # the depth chosen last was a probe
    # Hysteresis: the depth changes only for a goodput over (1 + hold_margin) x
    # the current one's (a move to depth 0: on this session's share, best_depth).
    # Near a tie the estimates' noise (a few cycles' draws of acceptance,
    # timings on a busy host) would flip the choice back and forth, and a flip
    # to a shallower depth also stops the deeper levels' learning.
    hold_margin: float = 0.05
    _probed: int | None = None  # the probe period of the last probe (or of the first depth 0)
    _last: int | None = None  # the depth chosen last (not a probe)

    def observe(self, drafted_depth: int, accepted: int, costs: CostModel) -> None:
        costs.observe_levels(drafted_depth, accepted)
        if self._probing and drafted_depth:
            costs.probe_misses = 0 if accepted else costs.probe_misses + 1
        self._probing = False
        if drafted_depth:
            prior = costs.level_rates[0] if self.first is None else self.first
            self.first = 0.85 * prior + 0.15 * (1.0 if accepted else 0.0)

    def _rates_and_load(self, costs: CostModel, rest_rows: float, rest_sessions: int) -> tuple[list[float], Load]:
        rates = costs.level_rates
        if self.first is not None:
            rates[0] = self.first
        load = Load(rest_rows, rest_sessions, rest_sessions * costs.tokens_per_cycle, rest_rows - rest_sessions)
        return rates, load

    def threshold(self, costs: CostModel, k: int, rest_rows: float, rest_sessions: int) -> float:
        """The confidence below which drafting stops, at depth k: where one more
        node's expected tokens are worth less than the row and level it adds
        (orchestrator/cycle/confidence.py). 0 until the model is ready."""
        if k == 0 or not costs.ready:
            return 0.0
        rates, load = self._rates_and_load(costs, rest_rows, rest_sessions)
        round_costs = costs.round_costs()
        here = round_ms(k, round_costs, load)
        token_ms = here / (expected_tokens(rates, k) + load.tokens)
        return costs.confidence.threshold(token_ms, round_ms(k + 1, round_costs, load) - here)

    def choose(self, costs: CostModel, rest_rows: float, rest_sessions: int) -> int:
        if not costs.ready:
            return self.k_max
        rates, load = self._rates_and_load(costs, rest_rows, rest_sessions)
        hold = self.k_max if self._last is None else self._last  # a fresh session starts from K
        k = best_depth(rates, self.k_max, costs.round_costs(), load, hold, self.hold_margin)
        self._last = k
        if k == 0:
            doublings = min(self.probe_backoff, (costs.probe_misses // self.misses_per_doubling).bit_length())
            period = costs.forwards // (self.probe_every << doublings)
            if self._probed is None or self._probed > period:  # the first at 0, or the interval grew
                self._probed = period
            elif period > self._probed:
                self._probed = period
                self._probing = True
                return 1
        else:
            self._probed = None
        return k
