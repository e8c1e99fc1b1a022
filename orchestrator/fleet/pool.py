"""Replica pools: which drafter / verifier replica takes a new session.

A pool routes each new session to its least-loaded serving replica, or, with
prefix routing (orchestrator/fleet/prefix_routing.py), to the one this
orchestrator sent the longest prefix of its prompt to, while that one is not
too busy (`acquire`); the session then stays on that replica to its end (the
verifier holds its KV cache, the drafter its own). Scaling down drains: a draining replica takes no new
sessions and is handed back (`reap`) once its last session has ended. A lost
replica (a call to it failed with UNAVAILABLE: orchestrator/fleet/failover.py) takes
no new sessions until it is found serving again (`revive`: on Ray the actor
restarts, often at a new port) or is known gone for good (`remove`). A
suspected replica (its calls went unanswered past their deadline: its client's
HangWatch, orchestrator/fleet/hang.py) takes no new sessions until it answers a
probe (orchestrator/fleet/recovery.py). Pure
bookkeeping, no grpc and no Ray: the scaler (orchestrator/fleet/scaling.py) starts
and stops the replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config import ReplicaSpec
from orchestrator.fleet.prefix_routing import PrefixRouting
from specd_core.errors import CapacityExceeded


@dataclass
class Replica:
    spec: ReplicaSpec
    client: Any  # GrpcVerifier | GrpcDrafter (tests: anything with .active)
    draining: bool = False
    lost: bool = False  # a call failed with UNAVAILABLE; not routed to until revived
    added: int = 0  # order of arrival: ties drain the newest first
    # Bumped each time it is revived (a new client, maybe a new address): other
    # orchestrators follow the owner's list by it (orchestrator/fleet/peers.py).
    revision: int = 0

    @property
    def sessions(self) -> int:
        return self.client.active

    @property
    def suspected(self) -> bool:
        """Suspected hung (a client without hang detection never is)."""
        return bool(getattr(self.client, "suspected", False))


@dataclass
class Pool:
    kind: str
    replicas: dict[str, Replica] = field(default_factory=dict)
    _arrivals: int = 0
    # None: every new session goes to the least-loaded replica.
    routing: PrefixRouting | None = None

    def add(self, spec: ReplicaSpec, client) -> Replica:
        if spec.name in self.replicas:
            raise ValueError(f"{self.kind} replica {spec.name} is already in the pool")
        self._arrivals += 1
        r = self.replicas[spec.name] = Replica(spec, client, added=self._arrivals)
        return r

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas.values() if not r.draining and not r.lost and not r.suspected]

    def acquire(self, prompt: Sequence[int] | None = None, salt: str = "") -> Replica:
        """A serving replica for a new session, with one more session counted on it.

        Without a prompt (or prefix routing): the least-loaded one (the oldest
        on ties). With both: of the replicas that may take one more session for
        their cache (`PrefixRouting.within`: then at most bound x the
        least-loaded one's sessions + slack), the one this pool sent the
        longest prefix of the prompt to, at least one chunk (the least loaded
        on ties); none: the least-loaded one. The prompt is recorded as sent to
        the chosen replica."""
        serving = self.serving()
        if not serving:
            raise CapacityExceeded(f"no {self.kind} replica is serving (all are draining or lost, or none is deployed)")
        r = least = min(serving, key=lambda r: (r.sessions, r.added))
        routing = self.routing
        if routing is not None and prompt is not None:
            names = routing.table.names(prompt, salt)
            if names:
                matched = {c.spec.name: routing.table.matched_names(c.spec.name, names) for c in serving}
                best = min(
                    (c for c in serving if c is least or routing.within(c.sessions, least.sessions)),
                    key=lambda c: (-matched[c.spec.name], c.sessions, c.added),
                )
                if matched[best.spec.name] > 0:
                    r = best
                routing.table.record_names(r.spec.name, names)
        r.client.active += 1
        return r

    def forget(self, name: str) -> None:
        """The replica's prefix cache is gone (lost, restarted, removed): route
        no prompt there for it."""
        if self.routing is not None:
            self.routing.table.forget(name)

    @staticmethod
    def release(replica: Replica, client=None) -> None:
        """client: the one the session was acquired on, if the replica's client
        may have been swapped since (revive); its count is the one to lower."""
        (client or replica.client).active -= 1

    @staticmethod
    def mark_lost(replica: Replica, client) -> bool:
        """Stop routing to a replica whose call through `client` failed as lost.
        A failure on a client already swapped by `revive` says nothing about the
        revived replica. Returns whether it was newly marked."""
        if replica.client is not client or replica.lost:
            return False
        replica.lost = True
        return True

    def lost(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.lost]

    def suspected(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.suspected and not r.lost]

    def revive(self, name: str, spec: ReplicaSpec, client):
        """A lost replica serves again, maybe at a new address: route to it through
        `client`. Returns the old client (sessions still holding it release on it,
        then it can be closed)."""
        r = self.replicas[name]
        old, r.spec, r.client, r.lost = r.client, spec, client, False
        r.revision += 1
        self.forget(name)  # a restarted replica caches nothing yet
        return old

    def mark_lost_at(self, name: str, revision: int) -> bool:
        """Another orchestrator found this replica lost at `revision`: stop
        routing to it unless it has been revived since. Returns whether it was
        newly marked."""
        r = self.replicas.get(name)
        if r is None or r.revision != revision or r.lost:
            return False
        r.lost = True
        self.forget(name)
        return True

    def remove(self, name: str) -> Replica:
        """A replica gone for good (on Ray: out of restarts)."""
        self.forget(name)
        return self.replicas.pop(name)

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

    def reap(self, idle_elsewhere: Callable[[str], bool] = lambda name: True) -> list[Replica]:
        """Remove and return the draining replicas whose sessions have all ended
        (idle_elsewhere: also those of the other orchestrators, by replica name)."""
        done = [r for r in self.replicas.values() if r.draining and r.sessions == 0 and idle_elsewhere(r.spec.name)]
        for r in done:
            del self.replicas[r.spec.name]
            self.forget(r.spec.name)
        return done
