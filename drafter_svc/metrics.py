"""Prometheus metrics of a drafter replica: what it proposed. Acceptance is
counted where it is decided (the verifier, the orchestrator): the drafter never
hears the fate of a session's last draft. Created when the server starts."""

from __future__ import annotations

from prometheus_client import Gauge, Histogram

from specd_core.runtime.grammar import live_matchers
from specd_core.telemetry.metrics import (
    COUNT_BUCKETS,
    SpecDecodeCounters,
    count_expired_sessions,
    count_prefix_cache,
    metric,
)


class DrafterMetrics:
    def __init__(self, core):
        self.spec = SpecDecodeCounters(acceptance=False)
        count_expired_sessions(core.sessions)
        count_prefix_cache(core.kv_pool.prefix)
        metric(Gauge, "specdec:active_sessions", "Open sessions.").set_function(lambda: core.num_sessions)
        metric(
            Gauge, "specdec:grammar_matchers", "Structured-output matchers alive (one per constrained session)."
        ).set_function(live_matchers)
        self.batch_size = metric(
            Histogram,
            "specdec:propose_batch_size",
            "Sessions per draft batch (their Propose calls drafted together).",
            buckets=COUNT_BUCKETS,
        )

    def observe_proposal(self, proposal) -> None:
        self.spec.observe(len(proposal.tree.tokens), 0)

    def observe_batch(self, jobs) -> None:
        self.batch_size.observe(len(jobs))
