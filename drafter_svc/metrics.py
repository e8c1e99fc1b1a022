"""Prometheus metrics of a drafter replica: what it proposed. Acceptance is
counted where it is decided (the verifier, the orchestrator): the drafter never
hears the fate of a session's last draft. Created when the server starts."""
from __future__ import annotations

from prometheus_client import Gauge

from specd.metrics import SpecDecodeCounters, metric


class DrafterMetrics:
    def __init__(self, core):
        self.spec = SpecDecodeCounters(acceptance=False)
        metric(Gauge, "specdec:active_sessions", "Open sessions.").set_function(lambda: core.num_sessions)

    def observe_proposal(self, proposal) -> None:
        self.spec.observe(len(proposal.tree.tokens), 0)
