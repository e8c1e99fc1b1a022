"""Several orchestrators of one deployment, serving one address.

They share the gRPC and HTTP ports (SO_REUSEPORT: the kernel hands each new
connection to one of them; orchestrator/edge/server.py) and the replica pools.
Only the first, the *owner*, changes the pools: it scales them (`specd scale`,
autoscaling), hands drained replicas back and locates lost ones again, so that
no two orchestrators start or stop the same replica. The others *follow*: after
every change the owner hands each a `PoolView` (the replicas, which of them are
draining, the revision of each) and its share of the admission limit; each
routes its own sessions to the least-loaded replica it knows, as one alone does.

Each scaling tick the owner reads every other orchestrator's `OrchestratorReport`:

* its sessions per replica: a draining replica is handed back only once no
  orchestrator has a session on it, as reported by orchestrators that hold the
  current view (so none can still open one there); the autoscaler counts every
  orchestrator's sessions;
* the replicas it found lost: the owner stops routing to them too and locates them;
* the view it holds: one that missed a change (started since, restarted) is
  handed the current one.

Pure bookkeeping: how orchestrators reach each other is a `Peers`
implementation (on Ray, actor calls: specd/ray_deploy.py: RayPeers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from orchestrator.config import ReplicaSpec
from orchestrator.fleet.pool import Pool
from specd_core.errors import InvalidRequest

log = logging.getLogger(__name__)


def admission_shares(total: int, n: int) -> list[int]:
    """The deployment's limit of concurrent streams split over n orchestrators:
    shares that differ by at most one and sum to `total` (the first ones take
    the remainder). Every orchestrator needs at least one."""
    if not 1 <= n <= total:
        raise ValueError(f"cannot split {total} concurrent requests over {n} orchestrators (1 <= n <= {total})")
    base, extra = divmod(total, n)
    return [base + (i < extra) for i in range(n)]


@dataclass(frozen=True)
class ReplicaEntry:
    spec: ReplicaSpec
    draining: bool = False
    revision: int = 0  # the owner's Replica.revision: a follower revives its copy when it grows


@dataclass(frozen=True)
class PoolView:
    """The owner's replicas, as the other orchestrators are to route over them.
    Not in it: which replicas are lost (each orchestrator finds that out by its
    own calls and reports it)."""

    version: int
    replicas: tuple[ReplicaEntry, ...] = ()


def entries(pools: dict[str, Pool]) -> tuple[ReplicaEntry, ...]:
    return tuple(
        ReplicaEntry(r.spec, r.draining, r.revision) for pool in pools.values() for r in pool.replicas.values()
    )


def follow(pools: dict[str, Pool], view: PoolView, make_client: Callable) -> list[Any]:
    """Bring a follower's pools to the owner's view: new replicas added,
    revived ones (a higher revision: restarted, maybe at a new address) routed
    to through a new client, draining flags copied, replicas the owner no longer
    lists removed. Returns the clients replaced or removed: sessions still
    holding one release on it; close it once they have."""
    old: list[Any] = []
    listed = set()
    for e in view.replicas:
        pool = pools[e.spec.kind]
        listed.add(e.spec.name)
        r = pool.replicas.get(e.spec.name)
        if r is None:
            r = pool.add(e.spec, make_client(e.spec))
        elif e.revision != r.revision:
            old.append(pool.revive(e.spec.name, e.spec, make_client(e.spec)))
        r.revision, r.draining = e.revision, e.draining
    for pool in pools.values():
        for name in [n for n in pool.replicas if n not in listed]:
            old.append(pool.remove(name).client)
    return old


@dataclass(frozen=True)
class OrchestratorReport:
    """One orchestrator, as it reports itself (Status lists each; the owner
    reads the others' every tick)."""

    name: str  # its Ray actor name (specd-orchestrator, specd-orchestrator-1, ...)
    index: int  # 0: the owner
    address: str = ""  # host:port of its gRPC server (shared with the others)
    http_address: str = ""  # its HTTP API's base URL ("" = off)
    metrics_address: str = ""  # its /metrics host:port ("" = unknown)
    node: str = ""
    pid: int = 0
    active_requests: int = 0
    max_active_requests: int = 0  # its share of the deployment's limit
    draining: bool = False  # leaving: no longer listening, ends with its streams
    view_version: int = 0  # the owner's PoolView it routes over
    sessions: dict[str, int] = field(default_factory=dict)  # replica name -> its sessions there
    lost: dict[str, int] = field(default_factory=dict)  # replica name -> revision it found lost at


class Peers(Protocol):
    """How an orchestrator reaches the other orchestrators of its deployment."""

    # Every other orchestrator by name; None: it did not answer in time.
    async def reports(self) -> dict[str, OrchestratorReport | None]: ...

    # Hand a follower the owner's view and its share of the admission limit.
    async def follow(self, name: str, view: PoolView, max_active_requests: int) -> None: ...

    # A follower hands a Scale to the owner (only the owner changes anything).
    async def scale(self, counts: dict[str, int]) -> None: ...

    # A new orchestrator with that index, on the same ports; returns once it serves.
    async def start(self, index: int, view: PoolView, max_active_requests: int) -> None: ...

    # Make it stop listening, wait for its streams to end, then stop it.
    async def retire(self, name: str) -> None: ...


def merge_status(status: dict, reports: list[OrchestratorReport], answered_by: str) -> dict:
    """One orchestrator's status (its pools) with every orchestrator's report,
    its own included: sessions per replica and active requests summed, the
    limit made of the serving orchestrators' shares, one entry each, the owner first."""
    everyone = sorted(reports, key=lambda r: r.index)
    for replica in status["replicas"]:
        replica["sessions"] = sum(r.sessions.get(replica["name"], 0) for r in everyone)
    return {
        **status,
        "active_requests": sum(r.active_requests for r in everyone),
        "max_active_requests": sum(r.max_active_requests for r in everyone if not r.draining),
        "orchestrators": [
            {
                "name": r.name,
                "address": r.address,
                "node": r.node,
                "pid": r.pid,
                "active_requests": r.active_requests,
                "max_active_requests": r.max_active_requests,
                "draining": r.draining,
                "metrics_address": r.metrics_address,
                "http_address": r.http_address,
                "owner": r.index == 0,
            }
            for r in everyone
        ],
        "answered_by": answered_by,
    }


class Group:
    """The owner's side: the other orchestrators, what each last reported,
    the view and share each should hold, and scaling their number."""

    def __init__(
        self,
        peers: Peers,
        pools: dict[str, Pool],
        own: Callable[[], OrchestratorReport],
        total: int,
        set_own_share: Callable[[int], None],
        max_orchestrators: int = 64,
        on_change: Callable[[], None] | None = None,
    ):
        self.peers, self.pools, self.own = peers, pools, own
        self.total = total  # the deployment's max_active_requests
        self.set_own_share = set_own_share
        self.max_orchestrators = max_orchestrators
        # Told after each refresh: the Prometheus targets file lists every orchestrator.
        self.on_change = on_change or (lambda: None)
        self.version = 0
        self._entries = entries(pools)
        self.reports: dict[str, OrchestratorReport | None] = {}  # this tick's
        self.known: dict[str, OrchestratorReport] = {}  # the last answer of each one listed
        self._retiring: dict[str, asyncio.Task] = {}

    def view(self) -> PoolView:
        now = entries(self.pools)
        if now != self._entries:
            self.version, self._entries = self.version + 1, now
        return PoolView(self.version, now)

    async def refresh(self) -> None:
        """Read every other orchestrator's report; take over the losses they found."""
        self.view()  # the version the reports are compared with
        self.reports = await self.peers.reports()
        self.known = {n: r or self.known[n] for n, r in self.reports.items() if r or n in self.known}
        for report in self.known.values():
            for name, revision in report.lost.items():
                for pool in self.pools.values():
                    if pool.mark_lost_at(name, revision):
                        log.info("%s found %s %s lost: locating it", report.name, pool.kind, name)
        self.on_change()

    def idle(self, name: str) -> bool:
        """No other orchestrator has a session on replica `name`, by the reports
        of this tick, all made on the current view (so none can open one there
        while it drains). One that did not answer keeps the replica."""
        self.view()  # a drain since the reports were read makes them all out of date
        return all(
            r is not None and r.view_version == self.version and r.sessions.get(name, 0) == 0
            for r in self.reports.values()
        )

    def sessions(self, kind: str) -> int:
        """The other orchestrators' sessions on a pool (autoscaling counts them all)."""
        names = set(self.pools[kind].replicas)
        return sum(n for r in self.known.values() for name, n in r.sessions.items() if name in names)

    def serving(self) -> list[OrchestratorReport]:
        """The orchestrators taking new streams, the owner first, by index."""
        others = [r for n, r in self.known.items() if not r.draining and n not in self._retiring]
        return [self.own(), *sorted(others, key=lambda r: r.index)]

    def shares(self) -> dict[str, int]:
        serving = self.serving()
        return dict(zip((r.name for r in serving), admission_shares(self.total, len(serving))))

    async def publish(self) -> None:
        """Hand the current view and share to every orchestrator that holds
        another (pool changes reach the others at once, not at the next tick)."""
        view, shares = self.view(), self.shares()
        self.set_own_share(shares[self.own().name])
        stale = {
            name: shares.get(name, r.max_active_requests)
            for name, r in self.reports.items()
            if r is not None
            and (r.view_version != view.version or r.max_active_requests != shares.get(name, r.max_active_requests))
        }
        # Their reports are not updated here: sessions they report before taking
        # a drain in say nothing about after (see idle); the next refresh tells.
        results = await asyncio.gather(
            *(self.peers.follow(name, view, share) for name, share in stale.items()), return_exceptions=True
        )
        for name, result in zip(stale, results):
            if isinstance(result, BaseException):
                log.warning("could not hand orchestrator %s the replica list: %s", name, result)

    async def scale(self, n: int) -> None:
        """Bring the orchestrators taking new streams to n (the owner stays).
        Up: new ones on the same ports, returning once they serve. Down: the
        least loaded stop listening at once and leave when their streams have
        ended (in the background). Shares are split anew either way."""
        if not 1 <= n <= self.max_orchestrators:
            raise InvalidRequest(f"orchestrators must be in [1, {self.max_orchestrators}], got {n}")
        if n > self.total:
            raise InvalidRequest(
                f"{n} orchestrators cannot share a limit of {self.total} concurrent requests (each needs one)"
            )
        await self.refresh()
        serving = self.serving()
        if n < len(serving):
            # Least loaded first, its drain ends soonest; newest on ties.
            for r in sorted(serving[1:], key=lambda r: (r.active_requests, -r.index))[: len(serving) - n]:
                self._retire(r.name)
        elif n > len(serving):
            taken = {r.index for r in (self.own(), *self.known.values())}
            new = [i for i in range(1, self.max_orchestrators + len(taken)) if i not in taken][: n - len(serving)]
            final = sorted([r.index for r in serving] + new)
            share = dict(zip(final, admission_shares(self.total, n)))
            view = self.view()
            started = await asyncio.gather(*(self.peers.start(i, view, share[i]) for i in new), return_exceptions=True)
            await self.refresh()
            errors = [s for s in started if isinstance(s, BaseException)]
            if errors:
                await self.publish()
                raise errors[0]
        await self.publish()

    def _retire(self, name: str) -> None:
        log.info("orchestrator %s: draining, then leaving", name)

        async def retire() -> None:
            try:
                await self.peers.retire(name)
                log.info("orchestrator %s drained and stopped", name)
            except Exception:  # noqa: BLE001 - logged; its actor may be gone already
                log.exception("retiring orchestrator %s failed", name)
            finally:
                self._retiring.pop(name, None)
                self.known.pop(name, None)
                self.reports.pop(name, None)
                self.on_change()

        self._retiring[name] = asyncio.ensure_future(retire())

    def retiring(self) -> set[str]:
        return set(self._retiring)
