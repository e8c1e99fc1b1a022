"""Choosing each cycle's draft depth from what is measured (pure; no grpc).

A verify forward over R rows (every batched session's pending token and draft
nodes) costs about a + b*R ms; drafting costs about d ms per depth level. A
session drafting k tokens commits E(k) = 1 + r1 + r1*r2 + ... + r1*...*rk tokens
per cycle on average, where ri is the chance that level i is kept given that
level i-1 was: r1 is the session's own (how well the drafter knows this text),
the deeper ones are measured over all sessions. Acceptances are correlated
(after a kept token the next is likelier kept), so one per-token rate, the
i.i.d. (1 - a^(k+1)) / (1 - a), would undervalue depth. The server's goodput
with this session at depth k, the batch's other sessions as they are:

    G(k) = (E(k) + E_rest) / (d*k + a + b*(R_rest + k + 1))

so k = argmax G(k) over 0..k_max. At batch 1 (E_rest = R_rest = 0) that is the
classic speculative optimum; when the batch is full of other sessions' tokens
(compute bound, b*R_rest large) a draft token must be likely to be kept to pay
for its row, and k falls - to 0, plain decoding, when none would.
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


def best_depth(rates: list[float], k_max: int, a: float, b: float, d: float,
               rest_rows: float = 0.0, rest_tokens: float = 0.0) -> int:
    def goodput(k: int) -> float:
        return (expected_tokens(rates, k) + rest_tokens) / (d * k + a + b * (rest_rows + k + 1))
    return max(range(k_max + 1), key=lambda k: (goodput(k), -k))


@dataclass
class CostModel:
    """verify_ms ~ a + b * rows by least squares over recent forwards (an
    exponential window), and draft_ms per depth level as a moving average;
    shared by every session of the orchestrator.

    Until the forwards have seen a range of row counts, the slope leans on a
    prior (b = prior_slope * a: a small forward is bound by reading weights,
    so a few more rows cost little); data replace it as rows vary."""
    decay: float = 0.98                # weight of the past per observation (~50-forward window)
    prior_slope: float = 0.05
    prior_weight: float = 4.0
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    draft_ms_per_level: float = 0.0
    tokens_per_cycle: float = 1.0      # per session-cycle, over all sessions
    # Per draft level: kept given the level above was kept, over all sessions.
    level_rates: list[float] = field(default_factory=lambda: [0.7] * 16)
    _seen_draft: bool = field(default=False, repr=False)

    def observe_levels(self, drafted_depth: int, accepted: int) -> None:
        """Levels 1..accepted were kept, level accepted+1 (if drafted) was not;
        deeper ones were never tried."""
        for i in range(min(drafted_depth, accepted + 1, len(self.level_rates))):
            self.level_rates[i] = 0.98 * self.level_rates[i] + 0.02 * (1.0 if i < accepted else 0.0)

    def observe_verify(self, rows: int, ms: float) -> None:
        g = self.decay
        self._w, self._x, self._y = g * self._w + 1, g * self._x + rows, g * self._y + ms
        self._xx, self._xy = g * self._xx + rows * rows, g * self._xy + rows * ms

    def observe_draft(self, depth: int, ms: float) -> None:
        if depth > 0:
            per = ms / depth
            self.draft_ms_per_level = per if not self._seen_draft else 0.9 * self.draft_ms_per_level + 0.1 * per
            self._seen_draft = True

    def observe_tokens(self, committed: int) -> None:
        self.tokens_per_cycle = 0.95 * self.tokens_per_cycle + 0.05 * committed

    @property
    def ready(self) -> bool:
        return self._w >= 1.0

    def line(self) -> tuple[float, float]:
        """(a, b) of verify_ms ~ a + b * rows."""
        mx, my = self._x / self._w, self._y / self._w
        var, cov = self._xx / self._w - mx * mx, self._xy / self._w - mx * my
        # Shrink the slope toward the prior; with no spread in rows the prior decides.
        prior_b = self.prior_slope * max(my, 1e-6) / (1 + self.prior_slope * mx)
        b = (cov * self._w + prior_b * self.prior_weight) / (var * self._w + self.prior_weight)
        b = max(b, 0.0)
        return max(my - b * mx, 1e-6), b


@dataclass
class SessionDepth:
    """One session's adaptive depth: its first-level acceptance (a moving
    average, starting from all sessions'), and a probe at depth 1 now and then
    while it runs at 0, so that its acceptance is not frozen by the choice to
    stop drafting."""
    k_max: int
    first: float | None = None         # level 1 kept; None: take all sessions' rate
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
        a, b = costs.line()
        rates = [costs.level_rates[0] if self.first is None else self.first] + costs.level_rates[1:]
        k = best_depth(rates, self.k_max, a, b, costs.draft_ms_per_level, rest_rows,
                       rest_sessions * costs.tokens_per_cycle)
        if k == 0:
            self._zeros += 1
            if self._zeros >= self.probe_every:
                self._zeros = 0
                return 1
        else:
            self._zeros = 0
        return k
