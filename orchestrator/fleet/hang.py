"""Hung replicas: each call's deadline, from the replica's own latencies, and
whether the replica is suspected of hanging.

A replica that hangs (a wedged GPU kernel, a deadlock, a paused VM, SIGSTOP)
neither answers nor refuses: its TCP connections stay open, so grpc fails no
call; only a deadline notices. A fixed deadline must be long enough for the
slowest healthy call anywhere, so it notices late; this one follows the
replica's measured pace:

    deadline = clamp(multiple * p99, floor_s, ceiling_s) + prefill_s_per_token * tokens

p99: over the last WINDOW calls the replica answered (Propose, Verify, Close;
not opens, whose time grows with the prompt), unknown below MIN_SAMPLES (then
the floor alone); tokens: the prompt tokens of the opens in flight to it from
this orchestrator (a prefill delays the steps batched behind it, and the open
itself). A slow batch within `multiple` times the usual is not a hang; a call
past its deadline makes the replica suspected (`HangWatch`): it takes no new
sessions, its calls fail at once as a lost replica's do (its sessions move,
orchestrator/fleet/failover.py), and the closes of the sessions it still holds
wait (bounded) until it answers a probe again (orchestrator/fleet/recovery.py).
Pure: no grpc, no clock (callers pass durations).
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Iterator

from orchestrator.config import HangConfig

WINDOW = 256  # answered calls the p99 is taken over
MIN_SAMPLES = 20  # fewer answered calls: the floor alone (a p99 of a few calls says little)
RECOMPUTE_EVERY = 8  # new samples between two sorts of the window
MAX_DEFERRED_CLOSES = 4096  # sessions to close on a suspected replica; past it the oldest are dropped


class LatencyWindow:
    """The durations of a replica's last WINDOW answered calls, and their p99."""

    def __init__(self, size: int = WINDOW) -> None:
        self._samples: collections.deque[float] = collections.deque(maxlen=size)
        self._p99: float | None = None
        self._stale = 0  # samples added since _p99 was computed

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self._stale += 1

    def p99(self) -> float | None:
        """None below MIN_SAMPLES. Sorted afresh every RECOMPUTE_EVERY samples
        (a deadline is asked for each message; the window moves slowly)."""
        n = len(self._samples)
        if n < MIN_SAMPLES:
            return None
        if self._p99 is None or self._stale >= RECOMPUTE_EVERY:
            ordered = sorted(self._samples)
            self._p99, self._stale = ordered[min(n - 1, math.ceil(0.99 * n) - 1)], 0
        return self._p99


def hang_deadline(rule: HangConfig, p99: float | None, prefill_tokens: int = 0) -> float:
    """Seconds a call may go unanswered before its replica is suspected hung."""
    base = rule.floor_s if p99 is None else min(rule.ceiling_s, max(rule.floor_s, rule.multiple * p99))
    return base + rule.prefill_s_per_token * prefill_tokens


class HangWatch:
    """One replica client's: its latencies, the opens in flight to it, whether
    it is suspected, and the sessions to close once it answers again."""

    def __init__(self, rule: HangConfig) -> None:
        self.rule = rule
        self.window = LatencyWindow()
        self.prefilling = 0  # prompt tokens of the opens in flight
        self.suspected = False
        self.reason = ""  # why it was last suspected
        self._closes: collections.deque[str] = collections.deque(maxlen=MAX_DEFERRED_CLOSES)

    def deadline(self) -> float:
        return hang_deadline(self.rule, self.window.p99(), self.prefilling)

    def answered(self, seconds: float) -> None:
        self.window.add(seconds)

    @contextlib.contextmanager
    def prefill(self, tokens: int) -> Iterator[None]:
        """An open of `tokens` prompt tokens in flight: every deadline meanwhile allows for it."""
        self.prefilling += tokens
        try:
            yield
        finally:
            self.prefilling -= tokens

    def suspect(self, reason: str) -> bool:
        """A call went unanswered past its deadline. Returns whether newly suspected."""
        if self.suspected:
            return False
        self.suspected, self.reason = True, reason
        return True

    def defer_close(self, session_id: str) -> None:
        """A session to close once the replica answers again (bounded: a replica
        suspected for long under heavy traffic must not grow this without end;
        its own idle expiry frees what is dropped here)."""
        self._closes.append(session_id)

    def deferred(self) -> list[str]:
        """The sessions to close, taken (the recovery sends them before the
        replica serves again)."""
        out = list(self._closes)
        self._closes.clear()
        return out

    def recover(self) -> None:
        self.suspected, self.reason = False, ""
