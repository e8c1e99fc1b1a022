"""Admission control: how many Generate streams this orchestrator takes at
once, and whether it takes new ones at all. Each stream holds sessions on the
replicas and a slot in every forward, so past the limit a new one is refused
at once (RESOURCE_EXHAUSTED) rather than queued. With several orchestrators
the limit is this one's share of the deployment's, which the owner splits
anew when their number changes (peers.admission_shares)."""

from __future__ import annotations

from dataclasses import dataclass

from specd_core.errors import CapacityExceeded, ShuttingDown


@dataclass
class Admission:
    limit: int  # streams at once: OrchestratorConfig.max_active_requests, or the share handed to it
    active: int = 0  # streams running now
    draining: bool = False  # shutting down: new requests refused, running ones finish
    retiring: bool = False  # leaving a group: no longer listening, running streams finish

    def admit(self) -> None:
        """Refuse a request when shutting down or at the concurrency limit."""
        if self.draining:
            raise ShuttingDown("the orchestrator is shutting down and takes no new requests; retry on another instance")
        if self.active >= self.limit:
            raise CapacityExceeded(f"orchestrator is at its limit of {self.limit} concurrent requests; retry later")
