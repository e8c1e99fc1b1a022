"""Live scaling of the drafter and verifier pools, apart from each other.

`Scaler.scale(kind, n)` brings a pool to n serving replicas: up by taking back
draining replicas first, then starting new ones through a `Launcher` (on Ray:
specd/ray_deploy.py: RayLauncher, one actor per replica asking for its pool's
resource, so the Ray autoscaler adds nodes when they do not fit); down by
draining. A background task hands drained replicas back to the launcher once
their last session has ended, re-discovers lost replicas (Ray restarts a dead
replica's actor, whose server then listens on a new port: the launcher asks the
actor where it serves now), and applies the optional autoscaling policy.
With several orchestrators only the first has a Scaler; the others follow its
pools, and their sessions count in reaping and autoscaling (peers.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from orchestrator.config import AutoscalePolicy, ReplicaSpec
from orchestrator.fleet.peers import Group
from orchestrator.fleet.pool import Pool
from specd_core.errors import InvalidRequest

log = logging.getLogger(__name__)


class ReplicaGone(Exception):
    """A lost replica will not come back (on Ray: the actor is out of restarts)."""


class Launcher(Protocol):
    async def start(self, kind: str) -> ReplicaSpec: ...  # a new replica, serving
    async def stop(self, spec: ReplicaSpec) -> None: ...  # hand it back
    # Where a lost replica serves now: its (maybe new) spec, None while it is
    # not serving yet (restarting), ReplicaGone when it never will.
    async def locate(self, spec: ReplicaSpec) -> ReplicaSpec | None: ...


class Scaler:
    def __init__(
        self,
        pools: dict[str, Pool],
        launcher: Launcher,
        make_client: Callable,
        max_replicas: int = 64,
        policies: dict[str, AutoscalePolicy] | None = None,
        interval_s: float = 1.0,
        on_change: Callable[[], None] | None = None,
        group: Group | None = None,
    ):
        self.pools, self.launcher, self.make_client = pools, launcher, make_client
        self.max_replicas = max_replicas
        self.policies = policies or {}
        self.interval_s = interval_s
        # Told (synchronously, right after the pools change) whenever a replica
        # comes, goes or moves: the Prometheus targets file follows the pools.
        self.on_change = on_change or (lambda: None)
        # The other orchestrators of the deployment, if any: their sessions
        # count too, and they follow every change (orchestrator/fleet/peers.py).
        self.group = group
        self._lock = asyncio.Lock()  # one scale at a time: counts stay consistent
        self._task: asyncio.Task | None = None
        self._retired: list = []  # clients of lost replicas, closed when unused

    def min_replicas(self, kind: str) -> int:
        return 1 if kind == "verifier" else 0  # no verifier, no output; no drafter = plain decoding

    async def scale(self, kind: str, n: int) -> None:
        if kind not in self.pools:
            raise InvalidRequest(f"unknown pool {kind!r} (pools: {', '.join(self.pools)})")
        lo = self.min_replicas(kind)
        if not (lo <= n <= self.max_replicas):
            raise InvalidRequest(f"{kind}s must be in [{lo}, {self.max_replicas}], got {n}")
        async with self._lock:
            pool = self.pools[kind]
            have = len(pool.serving())
            if n < have:
                for r in pool.drain(have - n):
                    log.info("draining %s (%d sessions)", r.spec.name, r.sessions)
                return
            missing = n - have - len(pool.undrain(n - have))
            if missing > 0:
                started = await asyncio.gather(
                    *(self.launcher.start(kind) for _ in range(missing)), return_exceptions=True
                )
                errors = [s for s in started if isinstance(s, BaseException)]
                for spec in started:
                    if not isinstance(spec, BaseException):
                        pool.add(spec, self.make_client(spec))
                        log.info("%s %s serving at %s on %s", kind, spec.name, spec.address, spec.node)
                self.on_change()
                if errors:
                    raise errors[0]

    async def reap(self) -> None:
        idle_elsewhere = self.group.idle if self.group else (lambda name: True)
        for pool in self.pools.values():
            for r in pool.reap(idle_elsewhere):
                log.info("%s drained: handing it back", r.spec.name)
                self.on_change()
                await r.client.aclose()
                await self.launcher.stop(r.spec)

    async def rediscover(self) -> None:
        """Route to lost replicas again once they serve (at their new address);
        forget the ones gone for good (autoscaling may then start others)."""
        for pool in self.pools.values():
            for r in pool.lost():
                try:
                    spec = await self.launcher.locate(r.spec)
                except ReplicaGone:
                    log.warning("%s %s is gone for good", pool.kind, r.spec.name)
                    pool.remove(r.spec.name)
                    self.on_change()
                    self._retired.append(r.client)
                    continue
                if spec is not None:
                    self._retired.append(pool.revive(r.spec.name, spec, self.make_client(spec)))
                    self.on_change()
                    log.info("%s %s serving again at %s", pool.kind, spec.name, spec.address)
        # Sessions that held an old client release on it; close it once they have.
        for client in [c for c in self._retired if c.active <= 0]:
            self._retired.remove(client)
            await client.aclose()

    async def autoscale(self) -> None:
        for kind, policy in self.policies.items():
            pool = self.pools[kind]
            sessions = sum(r.sessions for r in pool.replicas.values())
            if self.group:  # the other orchestrators' sessions load the pool too
                sessions += self.group.sessions(kind)
            want = max(self.min_replicas(kind), policy.desired(sessions))
            if want != len(pool.serving()) and not self._lock.locked():
                await self.scale(kind, want)

    async def tick(self) -> None:
        """One round of the background work: the other orchestrators' reports
        first (their sessions and losses), the changes then handed to them."""
        if self.group:
            await self.group.refresh()
        await self.reap()
        await self.rediscover()
        await self.autoscale()
        if self.group:
            await self.group.publish()

    def start(self) -> None:
        """Run reaping and autoscaling in the background, on the running loop."""

        async def run():
            while True:
                await asyncio.sleep(self.interval_s)
                try:
                    await self.tick()
                except Exception:  # noqa: BLE001 - keep the loop alive; the next tick retries
                    log.exception("scaling tick failed")

        self._task = asyncio.ensure_future(run())

    def stop(self) -> None:
        if self._task:
            self._task.cancel()
