"""Suspected replicas back in service: every PROBE_INTERVAL_S each replica
suspected hung (orchestrator/fleet/hang.py) is probed: its health check and a
one-token probe session must answer within `probe_s` (clients.py: `probe`).
One that answers first gets the closes of the sessions it kept for requests
that moved away, then takes new sessions again (`recover`). A replica found
lost meanwhile (a call failed UNAVAILABLE: its process is gone) is the
scaler's (orchestrator/fleet/scaling.py), not probed here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from orchestrator.fleet.clients import ServiceError
from orchestrator.fleet.pool import Pool, Replica

log = logging.getLogger(__name__)
PROBE_INTERVAL_S = 1.0


class Recovery:
    def __init__(self, pools: dict[str, Pool], probe_s: float, on_recover: Callable[[str], None] | None = None):
        self.pools, self.probe_s = pools, probe_s
        self.on_recover = on_recover or (lambda kind: None)  # told each recovery, by pool (a metric)
        self._task: asyncio.Task | None = None

    async def tick(self) -> None:
        """Probe every suspected replica, all at once (each bounded by probe_s)."""
        suspected = [(kind, r) for kind, pool in self.pools.items() for r in pool.suspected()]
        await asyncio.gather(*(self._try(kind, r) for kind, r in suspected))

    async def _try(self, kind: str, replica: Replica) -> None:
        client = replica.client
        try:
            await client.probe(self.probe_s)
            await client.recover(self.probe_s)
        except ServiceError as exc:
            log.debug("%s %s still suspected: %s", kind, replica.spec.name, exc.message)
            return
        log.info("%s %s at %s answers again: back in service", kind, replica.spec.name, replica.spec.address)
        self.on_recover(kind)

    def start(self) -> None:
        async def run():
            while True:
                await asyncio.sleep(PROBE_INTERVAL_S)
                try:
                    await self.tick()
                except Exception:  # noqa: BLE001 - keep probing; the next tick retries
                    log.exception("probing suspected replicas failed")

        self._task = asyncio.ensure_future(run())

    def stop(self) -> None:
        if self._task:
            self._task.cancel()
