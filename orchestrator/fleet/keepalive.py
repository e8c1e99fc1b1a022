"""Telling the replicas that this orchestrator is alive.

Every session an orchestrator opens carries its session owner's name (the
OpenSession `owner` field; `session_owner_name`: the orchestrator's name, its
process id and a random token. Not to be confused with the owner orchestrator
of a group, orchestrator/fleet/peers.py). A replica closes the
sessions of an owner it has not heard from for its `owner_timeout_s`
(specd_core/runtime/sessions.py): an orchestrator that died (kill -9, its node
lost, killed for memory) cannot close them itself, and one restarted in its
place is a new owner, so they would hold KV until the idle timeout, which must
stay long because a slow client legitimately pauses a stream. Any call of a
session is word from its owner; an orchestrator whose sessions are all paused
(their clients stopped reading, so its loop stopped calling) says it is alive
with a KeepAlive to every replica, at a quarter of the shortest owner timeout
the replicas announce in their answers.

Each replica's keep-alive is its own task: one replica that hangs delays no
other's. A keep-alive that fails is no verdict on the replica (failover judges
from the sessions' own calls); the next round tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Iterable

import grpc

from orchestrator.fleet.clients import ServiceError
from orchestrator.fleet.pool import Pool

log = logging.getLogger(__name__)

ROUNDS_PER_TIMEOUT = 4  # keep-alives per owner timeout: three may be lost or late
UNKNOWN_INTERVAL_S = 1.0  # while a replica has not yet announced its owner timeout
MAX_INTERVAL_S = 10.0  # also the pace when no replica closes sessions of silent owners
MIN_INTERVAL_S = 0.05
CALL_TIMEOUT_S = 10.0


def session_owner_name(name: str) -> str:
    """This process's owner name: the orchestrator's name, its pid and a
    random token (a restarted orchestrator, the same actor, is a new owner:
    its predecessor's sessions are not its own)."""
    return f"{name}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def interval(timeouts: Iterable[float | None]) -> float:
    """The pace of keep-alives, from each replica's announced owner timeout
    (None: not known yet; 0: it never closes an owner's sessions)."""
    paces = [UNKNOWN_INTERVAL_S if t is None else t / ROUNDS_PER_TIMEOUT for t in timeouts if t is None or t > 0]
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, min(paces, default=MAX_INTERVAL_S)))


class KeepAlive:
    """Keep-alives to every replica of the pools that is not lost (each
    client sends its session owner's name)."""

    def __init__(self, pools: dict[str, Pool]):
        self.pools = pools
        self.timeouts: dict[str, float] = {}  # replica name -> the owner timeout it announced
        self._calls: dict[str, asyncio.Future] = {}  # replica name -> its keep-alive in flight
        self._task: asyncio.Task | None = None

    def _replicas(self) -> list:
        return [r for pool in self.pools.values() for r in pool.replicas.values() if not r.lost]

    def round(self) -> None:
        """Send a keep-alive to each replica that has none in flight."""
        for r in self._replicas():
            name = r.spec.name
            if name in self._calls or not hasattr(r.client, "keep_alive"):
                continue
            self._calls[name] = asyncio.ensure_future(self._send(name, r.client))

    async def _send(self, name: str, client) -> None:
        try:
            self.timeouts[name] = await client.keep_alive(CALL_TIMEOUT_S)
        except ServiceError as exc:
            if exc.code == grpc.StatusCode.UNIMPLEMENTED:  # a replica without the owner rule
                self.timeouts[name] = 0.0
            log.debug("keep-alive to %s failed: %s", name, exc.message)
        finally:
            self._calls.pop(name, None)

    def pace(self) -> float:
        """Seconds to the next round (the replicas' announced timeouts)."""
        return interval(self.timeouts.get(r.spec.name) for r in self._replicas())

    def start(self) -> None:
        """Send rounds in the background, on the running loop, until stop()."""

        async def run():
            while True:
                try:
                    self.round()
                except Exception:  # noqa: BLE001 - keep the loop alive; the next round retries
                    log.exception("keep-alive round failed")
                await asyncio.sleep(self.pace())

        self._task = asyncio.ensure_future(run())

    def stop(self) -> None:
        for task in [self._task, *self._calls.values()]:
            if task is not None:
                with contextlib.suppress(Exception):
                    task.cancel()
