"""Replica loss mid-stream: the session moves to another replica.

The orchestrator holds every committed token (prompt + what it streamed), so a
lost replica's state can be rebuilt anywhere:

* verifier lost -> the session is re-prefilled on another verifier from the
  committed tokens (`OpenSession(resume)`: the cache holds all but the last,
  which is pending, nothing is sampled) and the failed Verify is sent again:
  the draft was made for exactly that state. None left -> the stream fails with
  UNAVAILABLE and says so.
* drafter lost -> another drafter is opened on the committed tokens but the
  last and asked for a first proposal (empty accepted path, the last token), as
  after a normal open. None left -> the session goes on as plain target
  decoding (empty drafts, K = 0), and takes a drafter again once one serves
  (on Ray, the restarted replica).
* drafter full (a Propose is RESOURCE_EXHAUSTED: its KV budget, or its queue)
  -> the session closes its drafter session and goes on as plain target
  decoding. A verifier that is full mid-stream ends the request with
  RESOURCE_EXHAUSTED and its message (which names the KV budget): the target
  is not optional.

No token is lost or repeated: the loop adds tokens to the stream only after a
Verify returned, so a cycle whose Verify failed committed nothing, and the
rebuilt state is exactly the streamed one. Under greedy the output equals an
uninterrupted run (the re-prefill's logits equal the incremental ones up to
float rounding, as in tests/test_cores.py). Under sampling it keeps the
target's distribution, but the random stream differs: a rebuilt session gets a
fresh seed derived from (seed, committed length), since replaying the draws
that made the earlier tokens would correlate the new ones with them.

"Lost" = a call failed with UNAVAILABLE: the process is gone, refuses
connections, or the stream shared by its sessions broke. The replica is marked
lost in its pool (no new sessions) until the scaler finds it serving again
(orchestrator/fleet/scaling.py). A replica suspected hung (a call unanswered
past its deadline, orchestrator/fleet/hang.py) fails its calls the same way
(`Hung`, UNAVAILABLE) and its sessions move alike; it is not marked lost: it
serves again, at the same address, once it answers a probe
(orchestrator/fleet/recovery.py), and the closes of its moved sessions wait
for that. Each session replaces each kind at most
`max_failovers` times, so a flapping cluster cannot keep a stream looping.

FailoverVerifier / FailoverDrafter have the loop's client interfaces
(ports.VerifierClient / DrafterClient), so the loop does not know about any of
this; the committed tokens come from the caller (`committed()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import grpc

from orchestrator.cycle.records import Draft, Verdict
from orchestrator.fleet.clients import Hung, ServiceError
from orchestrator.fleet.pool import Pool, Replica
from specd_core.errors import CapacityExceeded
from specd_core.runtime.propose_call import ProposeCall

log = logging.getLogger(__name__)
_MASK64 = (1 << 64) - 1
_background: set[asyncio.Task] = set()  # best-effort closes, referenced until done


def is_lost(exc: BaseException) -> bool:
    """A call failed because the replica (or the stream to it) is gone."""
    return isinstance(exc, ServiceError) and exc.code == grpc.StatusCode.UNAVAILABLE


def generated_after(sampling, prompt_len: int) -> dict:
    """A rebuilt session's open keywords: with structured output, where its
    generated tokens start (its constraint consumes them, and stands exactly
    at the committed tokens); nothing otherwise."""
    return {"generated_from": prompt_len} if sampling.constraint is not None else {}


def reseeded(sampling, committed: int):
    """Sampling params for a session rebuilt after `committed` tokens: the seed
    mixed with the length (splitmix64), a stream independent of the draws that
    made the tokens so far and the same on every rebuild at that length."""
    z = (sampling.seed + 0x9E3779B97F4A7C15 * (committed + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return dataclasses.replace(sampling, seed=(z ^ (z >> 31)) >> 1)  # 63 bits, as request seeds


def _close_quietly(client, session_id: str) -> None:
    """Free the session on a replica marked lost, in the background: a broken
    stream does not always mean a dead process, and then it still holds KV.
    (A suspected replica's client keeps the close until the replica recovers.)"""

    async def close():
        with contextlib.suppress(Exception):  # the replica is likely gone; nothing to do
            await client.close(session_id)

    task = asyncio.ensure_future(close())
    _background.add(task)
    task.add_done_callback(_background.discard)


class _Lease:
    """One session's replica of one pool: acquired, lost, replaced, released."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.replica: Replica | None = None
        self.client: Any = None  # the replica's client when acquired (revive may swap the replica's since)
        self.failovers = 0  # replacements, bounded by max_failovers (refused rebuilds count too)
        self.losses = 0  # replicas of this pool lost under the session (each one a failover; metrics)

    @property
    def held(self) -> Replica:
        """The leased replica (between acquire and release)."""
        if self.replica is None:
            raise RuntimeError(f"no {self.pool.kind} replica is leased")
        return self.replica

    def acquire(self, prompt: list[int] | None = None, sampling=None) -> None:
        """A serving replica (CapacityExceeded when none): the least loaded, or
        with the prompt (and its sampling's cache_salt) one that likely caches
        its prefix (Pool.acquire)."""
        salt = getattr(sampling, "cache_salt", "") or ""
        self.replica = self.pool.acquire(prompt, salt)
        self.client = self.replica.client

    def release(self) -> None:
        if self.replica is not None:
            Pool.release(self.replica, self.client)
            self.replica = self.client = None

    def lose(self, session_id: str, exc: ServiceError) -> None:
        r, client = self.held, self.client
        if not isinstance(exc, Hung) and Pool.mark_lost(r, client):
            self.pool.forget(r.spec.name)  # a restart finds its cache empty
            log.warning(
                "%s %s at %s lost (%s): no new sessions go there",
                self.pool.kind,
                r.spec.name,
                r.spec.address,
                exc.message,
            )
        self.release()
        self.failovers += 1
        self.losses += 1
        _close_quietly(client, session_id)


class FailoverVerifier:
    """A session's verifier, re-prefilled on another replica when lost."""

    def __init__(self, pool: Pool, committed: Callable[[], list[int]], max_failovers: int = 3):
        self.lease, self.committed, self.max_failovers = _Lease(pool), committed, max_failovers
        self.sampling = None
        # The target's features the session returns (EAGLE: True, EAGLE-3: layer ids): so must a resumed one.
        self.hidden: bool | tuple[int, ...] = False
        self.prompt_len = 0  # a resumed constrained session's generated tokens start here
        self._last_loss = ""

    async def open(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling,
        *,
        hidden: bool | tuple[int, ...] = False,
        generated_from: int = 0,
    ):
        """generated_from: a resumed request's generated tokens start there in prompt_ids."""
        self.sampling, self.hidden, self.prompt_len = sampling, hidden, generated_from or len(prompt_ids)
        more = {"generated_from": generated_from} if generated_from else {}
        try:
            self.lease.acquire(prompt_ids, sampling)
        except CapacityExceeded:  # none deployed or all draining: RESOURCE_EXHAUSTED; lost ones: UNAVAILABLE
            pool = self.lease.pool
            out = [f"{r.spec.name} lost" for r in pool.lost()] + [
                f"{r.spec.name} suspected hung" for r in pool.suspected()
            ]
            if not out:
                raise
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                (
                    f"no verifier is serving: {', '.join(out)} (on Ray a restarted one serves again once found; "
                    "a suspected one once it answers a probe)"
                ),
            ) from None
        while True:
            try:
                return await self.lease.client.open(
                    session_id, prompt_ids, sampling, **({"hidden": hidden} if hidden else {}), **more
                )
            except ServiceError as exc:
                self._lose_or_raise(session_id, exc)
            self._next(prompt_ids)

    async def verify(self, session_id: str, draft: Draft) -> Verdict:
        while True:
            try:
                return await self.lease.client.verify(session_id, draft)
            except ServiceError as exc:
                self._lose_or_raise(session_id, exc)
            await self._resume(session_id)

    async def close(self, session_id: str) -> None:
        if self.lease.client is not None:
            await self.lease.client.close(session_id)

    def release(self) -> None:
        self.lease.release()

    async def _resume(self, session_id: str) -> None:
        """Re-prefill the committed tokens on the next serving verifier."""
        while True:
            tokens = self.committed()
            self._next(tokens)
            try:
                await self.lease.client.open(
                    session_id,
                    tokens,
                    reseeded(self.sampling, len(tokens)),
                    resume=True,
                    **({"hidden": self.hidden} if self.hidden else {}),
                    **generated_after(self.sampling, self.prompt_len),
                )
            except ServiceError as exc:
                self._lose_or_raise(session_id, exc)
                continue
            log.info(
                "session %s resumed on verifier %s after %d tokens",
                session_id,
                self.lease.held.spec.name,
                len(tokens),
            )
            return

    def _lose_or_raise(self, session_id: str, exc: ServiceError) -> None:
        if not is_lost(exc):
            raise exc
        spec = self.lease.held.spec
        self._last_loss = f"{spec.name} at {spec.address}: {exc.message}"
        self.lease.lose(session_id, exc)
        if self.lease.failovers > self.max_failovers:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                (
                    f"verifier replicas lost {self.lease.failovers} times during this request (last "
                    f"{self._last_loss}); giving up"
                ),
            ) from exc

    def _next(self, prompt: list[int]) -> None:
        """The next serving verifier for a session prefilling `prompt`."""
        try:
            self.lease.acquire(prompt, self.sampling)
        except CapacityExceeded:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                (
                    f"the verifier serving this request was lost ({self._last_loss}) and no other verifier "
                    "is serving; the stream cannot continue"
                ),
            ) from None


class FailoverDrafter:
    """A session's drafter, rebuilt on another replica when lost; with none
    left, empty drafts (plain target decoding) until one serves again."""

    def __init__(self, pool: Pool, committed: Callable[[], list[int]], max_failovers: int = 3, rebuild: bool = True):
        self.lease, self.committed, self.max_failovers = _Lease(pool), committed, max_failovers
        self.rebuild = rebuild  # False: a lost drafter is not replaced (plain decoding from then on)
        self.sampling = None
        self.opened = False  # the leased replica holds the session
        self.fresh = False  # ... rebuilt from the committed tokens, no proposal yet
        self.base = 0  # ... from that many of them (the rest go with its first proposal)
        self.opening = None  # the client of an open in flight (its session may exist already)
        self.prompt_len = 0  # a rebuilt constrained session's generated tokens start here

    async def open(self, session_id: str, prompt_ids: list[int], sampling, *, generated_from: int = 0) -> None:
        """generated_from: a resumed request's generated tokens start there in prompt_ids."""
        self.sampling, self.prompt_len = sampling, generated_from or len(prompt_ids)
        more = {"generated_from": generated_from} if generated_from else {}
        await self._open_any(session_id, prompt_ids, sampling, rebuild=False, more=more)

    async def propose(self, call: ProposeCall) -> Draft:
        """A rebuilt drafter has no earlier proposal: its first one starts from
        the last committed token, nothing to rewind, and it cannot draft ahead
        of a chain it never made (an empty draft instead)."""
        session_id = call.session_id
        while True:
            if not self.opened and not (
                self.rebuild
                and self.lease.failovers <= self.max_failovers
                and self.lease.pool.serving()
                and await self._open_any(session_id, None, None, rebuild=True)
            ):
                return Draft()  # no drafter: a plain decode step
            if self.fresh:
                if call.ahead:
                    return Draft()
                # From base on: normally just the last token; more if tokens were
                # committed since the rebuild (a concurrent, pipelined verify).
                call = dataclasses.replace(
                    call, accepted_path=[], committed=self.committed()[self.base :], rewind=False, branch=0
                )
            try:
                draft = await self.lease.client.propose(call)
            except ServiceError as exc:
                if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._give_up(session_id, exc)
                    return Draft()
                if not is_lost(exc):
                    raise
                self._lose(session_id, exc)
                continue
            self.fresh = False
            return draft

    async def close(self, session_id: str) -> None:
        # Also when the open was cut short (the client left during it): the
        # replica may have opened the session, or will, and a close that comes
        # first leaves a note its open obeys (tests/test_cancellation.py).
        client = self.lease.client if self.opened else self.opening
        if client is not None:
            await client.close(session_id)

    def release(self) -> None:
        self.lease.release()

    def alone(self) -> bool:
        """The session is the only one this orchestrator has open on its replica."""
        return self.opened and self.lease.client is not None and self.lease.client.active <= 1

    def _lose(self, session_id: str, exc: ServiceError) -> None:
        self.lease.lose(session_id, exc)
        self.opened = self.fresh = False

    def _give_up(self, session_id: str, exc: ServiceError) -> None:
        """The drafter is full (its KV budget or queue): the drafter is optional,
        so the session goes on as plain target decoding rather than failing,
        and frees what it held there (a rebuild elsewhere would likely meet
        the same load; this session drafts no more)."""
        log.warning(
            "drafter %s refused session %s (%s): plain decoding from here",
            self.lease.held.spec.name,
            session_id,
            exc.message,
        )
        client = self.lease.client
        self.lease.release()
        _close_quietly(client, session_id)
        self.opened = self.fresh = self.rebuild = False

    async def _open_any(self, session_id: str, prompt_ids, sampling, rebuild: bool, more: dict | None = None) -> bool:
        """Open the session on a serving drafter (Pool.acquire: the least loaded
        or one that likely caches the prompt's prefix), past lost ones.
        rebuild: from the committed tokens (all but the last), with a fresh seed.
        more: the open's other keywords. False: no drafter left (or too many
        lost) - go on without one."""
        while self.lease.failovers <= self.max_failovers:
            if rebuild:
                tokens = self.committed()
                prompt_ids, sampling = tokens[:-1], reseeded(self.sampling, len(tokens))
                self.base = len(prompt_ids)
                more = generated_after(self.sampling, self.prompt_len)
            try:
                self.lease.acquire(prompt_ids, sampling)
            except CapacityExceeded:
                return False
            try:
                self.opening = self.lease.client
                await self.lease.client.open(session_id, prompt_ids, sampling, **(more or {}))
            except ServiceError as exc:
                self.opening = None
                if is_lost(exc):
                    self._lose(session_id, exc)
                    continue
                if not rebuild:
                    raise
                # The drafter is optional: a replacement that refuses (e.g. full)
                # is not worth ending the stream for.
                log.warning(
                    "drafter %s refused to rebuild session %s (%s): plain decoding",
                    self.lease.held.spec.name,
                    session_id,
                    exc.message,
                )
                self.lease.release()
                self.lease.failovers += 1  # bounded like losses: no retry every cycle
                return False
            self.opened, self.fresh, self.opening = True, rebuild, None
            if rebuild:
                log.info(
                    "session %s moved to drafter %s after %d tokens",
                    session_id,
                    self.lease.held.spec.name,
                    len(self.committed()),
                )
            return True
        return False
