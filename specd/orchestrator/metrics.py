"""Prometheus metrics of the orchestrator, reported from the loop's data (the
Chunks it yields: a CycleRecord per cycle, Stats at the end); labelled by the
speculative method that ran. Created with the Orchestrator (one per process)."""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram

from specd.telemetry.metrics import ITL_BUCKETS, TTFT_BUCKETS, SpecDecodeCounters, metric


class OrchestratorMetrics:
    def __init__(self):
        self.spec = SpecDecodeCounters(("method",))
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
        self.active = metric(Gauge, "specdec:active_sessions", "Generate streams in progress.")
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
            m.ttft.labels(method).observe(now - self.start)
            self.last = now
        elif n:
            itl, gap = m.itl.labels(method), (now - self.last) / n
            for _ in range(n):
                itl.observe(gap)
            self.last = now
        if chunk.cycle is not None:
            m.spec.observe(len(chunk.cycle.draft.tokens), chunk.cycle.accepted, (method,))
        if n:
            m.generation_tokens.labels(method).inc(n)
        if chunk.emit.finish_reason:
            m.success.labels(method, chunk.emit.finish_reason).inc()
            m.prompt_tokens.labels(method).inc(chunk.stats.prompt_tokens)

    def done(self) -> None:
        self.m.active.dec()
