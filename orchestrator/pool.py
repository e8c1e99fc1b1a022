"""Replica pools: which drafter / verifier replica takes a new session.

A pool routes each new session to its least-loaded serving replica; the session
then stays on that replica to its end (the verifier holds its KV cache, the
drafter its own). Scaling down drains: a draining replica takes no new
sessions and is handed back (`reap`) once its last session has ended. Pure
bookkeeping, no grpc and no Ray: the scaler (orchestrator/scaling.py) starts
and stops the replicas.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specd.errors import CapacityExceeded


@dataclass(frozen=True)
class ReplicaSpec:
    """A running replica as the orchestrator learns of it."""
    kind: str          # "verifier" | "drafter"
    name: str          # unique in the deployment (the Ray actor name on Ray)
    address: str       # host:port of its gRPC server
    node: str = ""     # where it runs (Ray node), for status


@dataclass
class Replica:
    spec: ReplicaSpec
    client: Any                  # GrpcVerifier | GrpcDrafter (tests: anything with .active)
    draining: bool = False
    added: int = 0               # order of arrival: ties drain the newest first

    @property
    def sessions(self) -> int:
        return self.client.active


@dataclass
class Pool:
    kind: str
    replicas: dict[str, Replica] = field(default_factory=dict)
    _arrivals: int = 0

    def add(self, spec: ReplicaSpec, client) -> Replica:
        if spec.name in self.replicas:
            raise ValueError(f"{self.kind} replica {spec.name} is already in the pool")
        self._arrivals += 1
        r = self.replicas[spec.name] = Replica(spec, client, added=self._arrivals)
        return r

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas.values() if not r.draining]

    def acquire(self) -> Replica:
        """The least-loaded serving replica, with one more session counted on it."""
        serving = self.serving()
        if not serving:
            raise CapacityExceeded(f"no {self.kind} replica is serving (all are draining or none is deployed)")
        r = min(serving, key=lambda r: (r.sessions, r.added))
        r.client.active += 1
        return r

    @staticmethod
    def release(replica: Replica) -> None:
        replica.client.active -= 1

    def drain(self, n: int) -> list[Replica]:
        """Stop routing to n serving replicas: the least loaded (newest first on
        ties), so that draining ends soonest."""
        chosen = sorted(self.serving(), key=lambda r: (r.sessions, -r.added))[:n]
        for r in chosen:
            r.draining = True
        return chosen

    def undrain(self, n: int) -> list[Replica]:
        """Scaling up: take back up to n draining replicas first (they are warm)."""
        chosen = sorted((r for r in self.replicas.values() if r.draining), key=lambda r: -r.sessions)[:n]
        for r in chosen:
            r.draining = False
        return chosen

    def reap(self) -> list[Replica]:
        """Remove and return the draining replicas whose sessions have all ended."""
        done = [r for r in self.replicas.values() if r.draining and r.sessions == 0]
        for r in done:
            del self.replicas[r.spec.name]
        return done
