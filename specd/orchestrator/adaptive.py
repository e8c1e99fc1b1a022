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
cheap (measured at batch 1: adaptive 0.90 x fixed K = 4). The server's goodput

    G(k) = (E(k) + E_rest) / T(k),  V = a + b*(R_rest + k + 1) + c*(S_rest + 1),  D = d*(L_rest + k)

and k = argmax G(k) over 0..k_max. At batch 1 that is the classic speculative
optimum; when rows are what costs and the forward is full of other sessions'
rows, a draft token must be likely kept to pay for its row, down to k = 0
(plain decoding) when none would.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


def round_ms(k: int, a: float, b: float, c: float, d: float, load: Load, o: float = 0.0) -> float:
    v = a + b * (load.rows + k + 1) + c * (load.sessions + 1)
    dr = d * (load.levels + k)
    return max(v, dr) + min(v, dr) / (load.sessions + 1) + o


def best_depth(
    rates: list[float], k_max: int, a: float, b: float, c: float, d: float, load: Load = Load(), o: float = 0.0
) -> int:
    def goodput(k: int) -> float:
        return (expected_tokens(rates, k) + load.tokens) / round_ms(k, a, b, c, d, load, o)

    return max(range(k_max + 1), key=lambda k: (goodput(k), -k))


@dataclass
class CostModel:
    """verify_ms ~ a + b * rows + c * sessions by least squares over recent
    forwards (an exponential window), draft_ms per level and tokens per
    session-cycle as moving averages, acceptance per level; shared by the
    sessions of one method in the orchestrator.

    Until forwards have seen rows vary apart from sessions, b and c lean on a
    weak prior (a row costs 2% and a session 10% of a one-row forward: small
    forwards are bound by reading the weights); data take over as they vary."""

    decay: float = 0.98  # weight of the past per observation (~50-forward window)
    prior: tuple[float, float] = (0.02, 0.10)
    prior_weight: float = 2.0
    # Weighted sums x x^T and x y over forwards, x = (1, rows, sessions): plain
    # floats, since every cycle of every session updates them.
    _m: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)], repr=False)
    _v: list[float] = field(default_factory=lambda: [0.0] * 3, repr=False)
    _w: float = 0.0
    _y: float = 0.0
    draft_ms_per_level: float = 0.0  # drafter time per draft token, over its batches
    tokens_per_cycle: float = 1.0  # per session-cycle
    overhead_ms: float = 0.0  # o: a cycle's wall time besides its verify and draft compute
    # Per draft level: kept given the level above was kept.
    level_rates: list[float] = field(default_factory=lambda: [0.7] * 16)
    _seen_draft: bool = field(default=False, repr=False)

    def observe_verify(self, rows: int, sessions: int, ms: float) -> None:
        x, g = (1.0, float(rows), float(sessions)), self.decay
        for i in range(3):
            self._v[i] = g * self._v[i] + x[i] * ms
            for j in range(3):
                self._m[i][j] = g * self._m[i][j] + x[i] * x[j]
        self._w, self._y = g * self._w + 1, g * self._y + ms

    def observe_draft(self, nodes: int, ms: float) -> None:
        """A drafter batch drafted `nodes` tokens (all its sessions') in ms."""
        if nodes > 0:
            per = ms / nodes
            self.draft_ms_per_level = per if not self._seen_draft else 0.9 * self.draft_ms_per_level + 0.1 * per
            self._seen_draft = True

    def observe_cycle(self, cycle_ms: float, verify_ms: float, draft_ms: float) -> None:
        """A session's cycle took cycle_ms of wall time, of which its verify
        forward (its batch's) and the draft it waited for computed the rest."""
        self.overhead_ms = 0.95 * self.overhead_ms + 0.05 * max(0.0, cycle_ms - verify_ms - draft_ms)

    def observe_tokens(self, committed: int) -> None:
        self.tokens_per_cycle = 0.95 * self.tokens_per_cycle + 0.05 * committed

    def observe_levels(self, drafted_depth: int, accepted: int) -> None:
        """Levels 1..accepted were kept, level accepted+1 (if drafted) was not;
        deeper ones were never tried."""
        for i in range(min(drafted_depth, accepted + 1, len(self.level_rates))):
            self.level_rates[i] = 0.98 * self.level_rates[i] + 0.02 * (1.0 if i < accepted else 0.0)

    @property
    def ready(self) -> bool:
        return self._w >= 1.0

    def line(self) -> tuple[float, float, float]:
        """(a, b, c) of verify_ms ~ a + b * rows + c * sessions."""
        # Ridge toward the prior on b and c (scaled by the typical cost), so
        # that rows always moving with sessions (fixed K) leave them defined.
        scale = self._y / self._w
        lam = self.prior_weight
        m, v = [row[:] for row in self._m], self._v[:]
        for i, frac in ((1, self.prior[0]), (2, self.prior[1])):
            m[i][i] += lam
            v[i] += lam * frac * scale
        a, b, c = _solve(m, v)
        return max(a, 0.0), max(b, 0.0), max(c, 0.0)


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
    stop drafting."""

    k_max: int
    first: float | None = None  # level 1 kept; None: take all sessions' rate
    probe_every: int = 8
    _zeros: int = 0

    def observe(self, drafted_depth: int, accepted: int, costs: CostModel) -> None:
        costs.observe_levels(drafted_depth, accepted)
        if drafted_depth:
            prior = costs.level_rates[0] if self.first is None else self.first
            self.first = 0.85 * prior + 0.15 * (1.0 if accepted else 0.0)

    def choose(self, costs: CostModel, rest_rows: float, rest_sessions: int) -> int:
        if not costs.ready:
            return self.k_max
        a, b, c = costs.line()
        rates = [costs.level_rates[0] if self.first is None else self.first] + costs.level_rates[1:]
        load = Load(rest_rows, rest_sessions, rest_sessions * costs.tokens_per_cycle, rest_rows - rest_sessions)
        k = best_depth(rates, self.k_max, a, b, c, costs.draft_ms_per_level, load, costs.overhead_ms)
        if k == 0:
            self._zeros += 1
            if self._zeros >= self.probe_every:
                self._zeros = 0
                return 1
        else:
            self._zeros = 0
        return k
