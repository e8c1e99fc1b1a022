"""Prometheus metrics of a verifier replica, reported by its servicer from the
core's results; gauges read the core when scraped (no hot-path cost).
Created when the server starts (one service per process)."""

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


class VerifierMetrics:
    def __init__(self, core):
        self.spec = SpecDecodeCounters()
        count_expired_sessions(core.sessions)
        count_prefix_cache(core.kv_pool.prefix)
        self.batch_size = metric(
            Histogram,
            "specdec:verify_batch_size",
            "Sessions per verify forward (their calls batched together).",
            buckets=COUNT_BUCKETS,
        )
        self.forward_tokens = metric(
            Histogram,
            "specdec:verify_forward_tokens",
            "Tokens per verify forward: the pending token plus the draft's nodes.",
            buckets=COUNT_BUCKETS,
        )
        metric(Gauge, "specdec:active_sessions", "Open sessions.").set_function(lambda: core.num_sessions)
        metric(
            Gauge, "specdec:grammar_matchers", "Structured-output matchers alive (one per constrained session)."
        ).set_function(live_matchers)
        metric(Gauge, "specdec:kv_cache_tokens", "KV cache tokens in use, over all sessions.").set_function(
            lambda: core.kv_tokens
        )
        metric(
            Gauge,
            "specdec:kv_cache_usage",
            "KV budget blocks held by sessions / all blocks (--kv-cache-memory); 1 = full "
            "(vLLM's kv_cache_usage_perc).",
        ).set_function(lambda: core.kv_pool.used_blocks / max(1, core.kv_pool.total_blocks))

    def observe_verify(self, draft_tokens: int, result) -> None:
        self.spec.observe(draft_tokens, result.num_accepted)

    def observe_batch(self, jobs) -> None:
        verifies = [j for j in jobs if hasattr(j, "tree")]  # not the prefills that shared the forward
        if verifies:
            self.batch_size.observe(len(verifies))
            self.forward_tokens.observe(sum(len(j.tree.tokens) + 1 for j in verifies))
