"""Prometheus metrics of the orchestrator, reported from the loop's data (the
Chunks it yields: a CycleRecord per cycle, Stats at the end; the sessions'
replica leases at the end), labelled by the speculative method that ran.
Created with the Orchestrator (one per process)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from specd_core.runtime.grammar import live_matchers
from specd_core.telemetry.metrics import ITL_BUCKETS, TTFT_BUCKETS, SpecDecodeCounters, metric


class OrchestratorMetrics:
    def __init__(self):
        self.spec = SpecDecodeCounters(("method",))
        self._latencies()
        self._tokens()
        self._fleet()

    def _latencies(self) -> None:
        self.ttft = metric(
            Histogram,
            "specdec:time_to_first_token_seconds",
            "Generate arrival to the first token (the prefill's) being streamed.",
            ("method",),
            buckets=TTFT_BUCKETS,
        )
        self.itl = metric(
            Histogram,
            "specdec:inter_token_latency_seconds",
            "Time between streamed tokens: a message's gap since the previous one, spread "
            "evenly over its tokens (observed once per token after the first).",
            ("method",),
            buckets=ITL_BUCKETS,
        )
        # Its _count is the number of cycles (verify passes after the prefill,
        # plain decode steps included): drafts per cycle = num_drafts / this count.
        self.cycle = metric(
            Histogram,
            "specdec:cycle_latency_seconds",
            "Wall time of one speculation cycle (draft, verify, commit) as the orchestrator saw it.",
            ("method",),
            buckets=ITL_BUCKETS,
        )

    def _tokens(self) -> None:
        self.active = metric(Gauge, "specdec:active_sessions", "Generate streams in progress.")
        metric(
            Gauge, "specdec:grammar_matchers", "Structured-output matchers alive (one per constrained session)."
        ).set_function(live_matchers)
        self.forced = metric(
            Counter,
            "specdec:forced_tokens",
            "Draft tokens the output constraint forced (structured output); also in num_draft_tokens.",
            ("method",),
        )
        self.forced_accepted = metric(
            Counter,
            "specdec:forced_accepted_tokens",
            "Forced draft tokens the verifier kept; also in num_accepted_tokens.",
            ("method",),
        )
        self.prompt_tokens = metric(
            Counter, "specdec:prompt_tokens", "Prompt tokens of finished requests.", ("method",)
        )
        self.generation_tokens = metric(Counter, "specdec:generation_tokens", "Tokens streamed.", ("method",))
        self.success = metric(
            Counter,
            "specdec:request_success",
            "Requests that finished, by finish reason.",
            ("method", "finished_reason"),
        )

    def _fleet(self) -> None:
        self.failovers = metric(
            Counter,
            "specdec:failovers",
            "Sessions moved off a lost replica (kind: the lost replica's pool), counted when the request ends.",
            ("kind",),
        )

        # Hung replicas (orchestrator/fleet/hang.py), by the replica's pool.
        self.hang_events = {
            "suspected": metric(
                Counter,
                "specdec:hang_suspicions",
                "Replicas suspected hung: a call unanswered past its deadline (kind: the replica's pool).",
                ("kind",),
            ),
            "recovered": metric(
                Counter,
                "specdec:hang_recoveries",
                "Suspected replicas back in service: they answered a health check and a probe (kind: pool).",
                ("kind",),
            ),
        }

        # Sessions per Propose / Verify message: how well the sessions on one
        # replica advance in step (orchestrator/fleet/clients.py StreamMux).
        self.step_sessions = metric(
            Histogram,
            "specdec:step_sessions",
            "Sessions whose calls one Propose or Verify message carried (kind: the replica's pool).",
            ("kind",),
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )

    def hang(self, event: str, kind: str) -> None:
        """A replica of pool `kind` was "suspected" hung, or has "recovered"."""
        self.hang_events[event].labels(kind).inc()

    def request(self) -> RequestMetrics:
        return RequestMetrics(self)


class RequestMetrics:
    """One Generate's reporting, from its arrival."""

    def __init__(self, m: OrchestratorMetrics):
        self.m = m
        self.start = time.perf_counter()
        self.last: float | None = None  # when the previous tokens were streamed
        m.active.inc()

    def observe(self, chunk, method: str) -> None:
        m, now, n = self.m, time.perf_counter(), len(chunk.emit.token_ids)
        if self.last is None:
            # The method's children once per request: a labels() lookup takes
            # a lock and hashes the labels, several times per cycle otherwise.
            self.itl, self.cycle, self.tokens = (x.labels(method) for x in (m.itl, m.cycle, m.generation_tokens))
            m.ttft.labels(method).observe(now - self.start)
            self.last = now
        elif n:
            gap = (now - self.last) / n
            for _ in range(n):
                self.itl.observe(gap)
            self.last = now
        if chunk.cycle is not None:
            m.spec.observe(len(chunk.cycle.draft.tokens), chunk.cycle.accepted, (method,))
            self.cycle.observe(chunk.cycle.wall_ms / 1000)
            if chunk.cycle.draft.forced_nodes:
                m.forced.labels(method).inc(len(chunk.cycle.draft.forced_nodes))
                m.forced_accepted.labels(method).inc(chunk.cycle.forced_accepted)
        if n:
            self.tokens.inc(n)
        if chunk.emit.finish_reason:
            m.success.labels(method, chunk.emit.finish_reason).inc()
            m.prompt_tokens.labels(method).inc(chunk.stats.prompt_tokens)

    def done(self, losses: Iterable[tuple[str, int]] = ()) -> None:
        """losses: (pool, replicas of it lost under the session) per leased pool."""
        self.m.active.dec()
        for kind, n in losses:
            if n:
                self.m.failovers.labels(kind).inc(n)
