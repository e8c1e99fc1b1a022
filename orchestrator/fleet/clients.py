"""grpc.aio clients for the drafter and verifier services (the loop's ports).

Open and close are unary calls; the per-cycle Propose and Verify go over one
long-lived bidirectional stream per replica, shared by all sessions and matched
by request_id (`StreamMux`): a message on an open stream costs about half a
unary round trip, and the cycle makes two of them. The stream carries steps:
the calls that sessions make in one turn of the event loop leave as ONE message
(ProposeStep / VerifyStep), and the replica answers a step's parts in as few
messages as they finish in. Sessions woken by one reply all make their next
call in the same turn, so sessions on the same replicas advance in lockstep,
one message per replica per step, with no waiting added: a step is whatever is
ready when the loop comes round. The per-message cost (grpc's write and read,
the wake-ups) is then paid once per step rather than once per session.

Tracing (specd_core.telemetry.tracing, a no-op unless configured): each call is a CLIENT
span; unary calls carry its traceparent in metadata, stream messages in their
`traceparent` field (stream metadata is sent once, for all sessions).

Hung replicas (orchestrator/fleet/hang.py): each call's deadline follows the
replica's measured latencies; past it the replica is suspected, the call and
every Propose / Verify in flight there fail as a lost replica's (`Hung`,
UNAVAILABLE; an open in flight fails at its own deadline),
later calls fail at once, closes wait for its recovery (`probe`, `recover`),
and an answer that comes after all is dropped (its request is no longer pending).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.config import HangConfig
from orchestrator.cycle.records import Draft, Opened, Verdict
from orchestrator.fleet.hang import HangWatch
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.grpc_util import MAX_MESSAGE_BYTES, open_channel
from specd_core.net.security import TlsConfig
from specd_core.net.wire import (
    dists_from_proto,
    dists_to_proto,
    hidden_from_proto,
    propose_to_proto,
    sampling_to_proto,
)
from specd_core.runtime.propose_call import ProposeCall
from specd_core.telemetry import tracing
from specd_core.telemetry.probe import mark

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """A replica refused or failed a call; carries the grpc status to pass on."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Unanswered(ServiceError):
    """No answer within the call's own deadline."""

    def __init__(self, timeout: float):
        super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED, f"the replica did not answer within {timeout:g} s")


class Hung(ServiceError):
    """The replica is suspected hung: its calls fail as a lost replica's
    (UNAVAILABLE, so the session moves), but it is not lost: it comes back
    once it answers a probe, at the same address."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


_CODES = {c.value[0]: c for c in grpc.StatusCode}

# What grpc.aio's client call reports when an operation on the call failed in
# grpc's core rather than with a status from the server: a replica killed while
# a message was on its way to it can end the stream this way instead of with
# UNAVAILABLE (seen in a chaos run). The replica said nothing (its own errors
# carry its message), so it is a lost connection: the session moves on.
CORE_FAILURE = "Internal error from Core"


def service_error(exc: grpc.aio.AioRpcError) -> ServiceError:
    """A failed call as what the replica (or the way to it) said."""
    code, details = exc.code(), exc.details()
    if code == grpc.StatusCode.INTERNAL and details == CORE_FAILURE:
        return ServiceError(grpc.StatusCode.UNAVAILABLE, f"the call to the replica broke ({CORE_FAILURE})")
    return ServiceError(code, details or str(code))


class StreamMux:
    """Many in-flight requests over one bidi stream, answered in any order.

    The stream opens on first use and reopens after it breaks; a break fails
    every request in flight with the stream's status. Messages go out through
    the stream's own request iterator, fed by a queue, never written by the
    caller's task: a caller cancelled in the middle of a write (its client
    left) would cancel the stream that every session shares."""

    def __init__(self, open_stream: Callable[[AsyncIterator], Any], step_cls: Any = None) -> None:
        self._open_stream = open_stream
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._queue: asyncio.Queue | None = None
        # step_cls (pb.ProposeStep / pb.VerifyStep): the stream carries steps;
        # the calls of one loop turn gather in _step until the turn's end.
        self._step_cls = step_cls
        self._step: _Message | None = None
        self.on_send: Callable[[int], None] | None = None  # each message's number of calls (a metric)

    async def call(self, request, timeout: float):
        queue = self._queue if self._queue is not None else self._start()
        loop = asyncio.get_running_loop()
        request.request_id = next(self._ids)
        future = loop.create_future()
        self._pending[request.request_id] = future
        mark("send", type(request).__name__)
        if self._step_cls is None:
            message = _Message([request], [future])
            self._send(queue, message, None, timeout)
        elif self._step is None or self._step.queue is not queue:
            # The first call of this turn (or on a stream reopened during it):
            # the step leaves once the turn is over.
            message = self._step = _Message([request], [future], queue)
            loop.call_soon(self._send, queue, message, self._step_cls, timeout)
        else:
            message = self._step
            message.requests.append(request)
            message.futures.append(future)
            message.left += 1
        try:
            response = await future
            mark("woken")
        finally:
            message.left -= 1
            if not message.left and message.expiry is not None:
                message.expiry.cancel()
            self._pending.pop(request.request_id, None)
        if response.HasField("error"):
            raise ServiceError(_CODES.get(response.error.code, grpc.StatusCode.UNKNOWN), response.error.message)
        return response

    def _send(self, queue: asyncio.Queue, message: _Message, step_cls, timeout: float) -> None:
        """A message on its way, one timer for all its calls. (Had the stream
        broken since they were made, their futures have already failed.)"""
        if message is self._step:
            self._step = None
        if self.on_send is not None:
            self.on_send(len(message.requests))
        queue.put_nowait(step_cls(requests=message.requests) if step_cls is not None else message.requests[0])
        if message.left:
            # The timeout fails the futures themselves; asyncio.wait_for would
            # add a waiter and callbacks per call, and on Python 3.11 it can
            # turn the caller's cancellation into a TimeoutError (a client's
            # deadline, seen as an internal error).
            message.expiry = asyncio.get_running_loop().call_later(timeout, _expire, message.futures, timeout)

    def _start(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._queue = queue

        async def requests():
            while (item := await queue.get()) is not None:
                yield item

        self._reader = asyncio.ensure_future(self._read(self._open_stream(requests()), queue))
        return queue

    async def _read(self, stream, queue) -> None:
        error: Exception = ServiceError(grpc.StatusCode.UNAVAILABLE, "stream to the replica ended")
        try:
            async for message in stream:
                mark("received")
                for response in message.responses if self._step_cls is not None else (message,):
                    future = self._pending.get(response.request_id)
                    if future is not None and not future.done():
                        future.set_result(response)
        except grpc.aio.AioRpcError as exc:
            error = service_error(exc)
        except asyncio.CancelledError:
            raise
        if self._queue is queue:
            self._queue = None  # next call opens a fresh stream
        self.fail_pending(error)

    def fail_pending(self, error: Exception) -> None:
        """Fail every request in flight; an answer that comes for one later is dropped."""
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        if self._queue is not None:
            self._queue.put_nowait(None)
            self._queue = None


class _Message:
    """The calls one message carries (one call, or a step's), until answered."""

    __slots__ = ("requests", "futures", "queue", "left", "expiry")

    def __init__(self, requests: list, futures: list[asyncio.Future], queue: asyncio.Queue | None = None) -> None:
        self.requests, self.futures, self.queue = requests, futures, queue  # queue: the stream a step is for
        self.left = len(futures)  # grows while a step gathers; calls not yet answered
        self.expiry: asyncio.TimerHandle | None = None


def _expire(futures: list[asyncio.Future], timeout: float) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(Unanswered(timeout))


class _Client:
    stub_cls: ClassVar[type[Any]]  # the service's generated stub class
    service = ""  # the grpc service name, for span attributes and its health check
    kind = ""  # "verifier" | "drafter"
    mux: StreamMux  # the subclass's per-cycle stream
    # Who opens the sessions (this orchestrator's incarnation): the replica
    # closes them if it stops hearing from it (orchestrator/fleet/keepalive.py).
    session_owner = ""

    def __init__(
        self,
        address: str,
        timeout_s: float,
        tls: TlsConfig | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        hang: HangConfig | None = None,
    ):
        self.address = address
        self.timeout = timeout_s  # every call's longest wait
        self.channel = open_channel(address, tls, max_message_bytes, aio=True)
        self.stub = self.stub_cls(self.channel)
        self.active = 0  # sessions this orchestrator has open here (for routing)
        # Hung-replica detection (None: off; every call waits `timeout`).
        self.watch = HangWatch(hang) if hang is not None and hang.enabled else None
        self.on_suspect: Callable[[], None] | None = None  # told when newly suspected (a metric)

    def _span_attributes(self, rpc_method: str) -> dict:
        return {
            "rpc.system": "grpc",
            "rpc.service": self.service,
            "rpc.method": rpc_method,
            "server.address": self.address,
        }

    @property
    def suspected(self) -> bool:
        return self.watch is not None and self.watch.suspected

    def _deadline(self) -> float:
        return self.timeout if self.watch is None else min(self.timeout, self.watch.deadline())

    def _refuse_if_suspected(self) -> None:
        if self.watch is not None and self.watch.suspected:
            raise Hung(f"{self.kind} at {self.address} is suspected hung ({self.watch.reason})")

    def _suspect(self, rpc_method: str, timeout: float) -> Hung:
        """A call went unanswered past its deadline: the replica is suspected,
        and its Propose / Verify calls in flight fail now rather than each at its own."""
        assert self.watch is not None
        reason = f"{rpc_method} unanswered after {timeout:.3g} s"
        error = Hung(f"{self.kind} at {self.address} suspected hung: {reason}")
        if self.watch.suspect(reason):
            log.warning(
                "%s at %s suspected hung (%s): its sessions move, none go there", self.kind, self.address, reason
            )
            self.mux.fail_pending(error)
            if self.on_suspect is not None:
                self.on_suspect()
        return error

    async def _call(self, method, request, timeout: float):
        """One unary call; its failure as a ServiceError (Unanswered past `timeout`)."""
        try:
            return await method(request, timeout=timeout, metadata=tracing.outgoing_metadata())
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise Unanswered(timeout) from None
            raise service_error(exc) from None

    async def _unary(self, method, request, span_name: str, rpc_method: str, prompt_tokens: int = 0):
        """prompt_tokens: an open's, allowed for in every deadline while it runs
        (an open's own time, growing with the prompt, is not a sample)."""
        self._refuse_if_suspected()
        with tracing.client_span(span_name, attributes=self._span_attributes(rpc_method) if tracing.ENABLED else None):
            if self.watch is None:
                return await self._call(method, request, self.timeout)
            with self.watch.prefill(prompt_tokens):
                timeout, start = self._deadline(), time.perf_counter()
                try:
                    response = await self._call(method, request, timeout)
                except Unanswered:
                    raise self._suspect(rpc_method, timeout) from None
            if not prompt_tokens:
                self.watch.answered(time.perf_counter() - start)
            return response

    async def _stream(self, request, span_name: str, rpc_method: str):
        self._refuse_if_suspected()
        with tracing.client_span(span_name, request, self._span_attributes(rpc_method) if tracing.ENABLED else None):
            timeout, start = self._deadline(), time.perf_counter()
            try:
                response = await self.mux.call(request, timeout)
            except Unanswered:
                if self.watch is None:
                    raise
                raise self._suspect(rpc_method, timeout) from None
            if self.watch is not None:
                self.watch.answered(time.perf_counter() - start)
            return response

    async def close(self, session_id: str) -> None:
        """On a suspected replica the close waits for its recovery (`recover`)."""
        if self.watch is not None and self.watch.suspected:
            self.watch.defer_close(session_id)
            return
        await self._unary(
            self.stub.CloseSession, pb.CloseSessionRequest(session_id=session_id), "specdec.close", "CloseSession"
        )

    def _probe_open(self, session_id: str):
        """The OpenSession request of a probe: one token, greedy."""
        raise NotImplementedError

    async def probe(self, timeout_s: float) -> None:
        """Raise a ServiceError unless the replica answers again: its health check
        says SERVING and a one-token probe session opens (or is refused: an answer
        too) and closes, each within timeout_s. The open goes through the model."""
        health = health_pb2_grpc.HealthStub(self.channel)
        r = await self._call(health.Check, health_pb2.HealthCheckRequest(service=self.service), timeout_s)
        if r.status != health_pb2.HealthCheckResponse.SERVING:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"its health check says {r.status}")
        session_id = f"hang-probe-{uuid.uuid4().hex}"
        try:
            await self._call(self.stub.OpenSession, self._probe_open(session_id), timeout_s)
        except Unanswered:
            assert self.watch is not None
            self.watch.defer_close(session_id)  # it may open the session when it wakes
            raise
        except ServiceError as exc:
            if exc.code == grpc.StatusCode.UNAVAILABLE:
                raise
            return  # refused (full, draining...): it answered, and holds nothing
        await self._call(self.stub.CloseSession, pb.CloseSessionRequest(session_id=session_id), timeout_s)

    async def recover(self, timeout_s: float) -> None:
        """After a probe answered: close the sessions it kept for requests that
        moved away, then take sessions again. A close it does not answer keeps
        it suspected (the close is kept for the next try)."""
        assert self.watch is not None
        closes = self.watch.deferred()
        results = await asyncio.gather(
            *(self._call(self.stub.CloseSession, pb.CloseSessionRequest(session_id=s), timeout_s) for s in closes),
            return_exceptions=True,
        )
        # Refusals (already expired, never opened) are answers: only silence keeps it suspected.
        silent = [s for s, r in zip(closes, results) if isinstance(r, Unanswered)]
        for session_id in silent:
            self.watch.defer_close(session_id)
        if silent:
            raise Unanswered(timeout_s)
        self.watch.recover()

    async def info(self, timeout_s: float) -> dict:
        """The replica's ReplicaInfo as a dict (engine, model, KV budget...)."""
        r = await self._untraced(self.stub.Info, pb.ReplicaInfoRequest(), timeout_s)
        return {f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields}

    async def keep_alive(self, timeout_s: float) -> float:
        """Tell the replica that this orchestrator (`session_owner`) is alive; returns
        the replica's owner_timeout_s (orchestrator/fleet/keepalive.py)."""
        r = await self._untraced(self.stub.KeepAlive, pb.KeepAliveRequest(owner=self.session_owner), timeout_s)
        return r.owner_timeout_s

    @staticmethod
    async def _untraced(method, request, timeout_s: float):
        """A housekeeping call (no span, its own deadline)."""
        try:
            return await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise service_error(exc) from None

    async def aclose(self) -> None:
        await self.channel.close()


class GrpcVerifier(_Client):
    stub_cls = pb_grpc.VerifierServiceStub
    service = "specdec.v1.VerifierService"
    kind = "verifier"

    def __init__(self, address: str, timeout_s: float, **channel):
        super().__init__(address, timeout_s, **channel)
        self.mux = StreamMux(self.stub.VerifySteps, pb.VerifyStep)

    async def open(self, session_id, prompt_ids, sampling, resume: bool = False, *, hidden=False, generated_from=0):
        """resume: re-prefill all committed tokens, sample nothing (returns None).
        hidden: the session returns the target's features (EAGLE; layer ids:
        those layers' states side by side, EAGLE-3), with the first token in
        the result (an `Opened`). generated_from: with
        structured output, where the generated tokens of a resume start."""
        r = await self._unary(
            self.stub.OpenSession,
            pb.OpenVerifySessionRequest(
                session_id=session_id,
                prompt_token_ids=prompt_ids,
                sampling=sampling_to_proto(sampling),
                resume=resume,
                return_hidden_states=bool(hidden),
                hidden_layers=hidden if isinstance(hidden, tuple) else (),
                generated_from=generated_from,
                owner=self.session_owner,
            ),
            "specdec.prefill",
            "OpenSession",
            prompt_tokens=len(prompt_ids),
        )
        first = None if resume else r.first_token_id
        features = hidden_from_proto(r.hidden_states, r.HasField("hidden_states")) if hidden else None
        return Opened(first, features, r.cached_prompt_tokens)

    def _probe_open(self, session_id: str):
        return pb.OpenVerifySessionRequest(session_id=session_id, prompt_token_ids=[0], sampling=pb.SamplingParams())

    async def verify(self, session_id, draft: Draft) -> Verdict:
        r = await self._stream(
            pb.VerifyRequest(
                session_id=session_id,
                draft_token_ids=draft.tokens,
                draft_parents=draft.parents,
                draft_distributions=dists_to_proto(draft.row_dists),
            ),
            "specdec.verify",
            "VerifySteps",
        )
        return Verdict(
            list(r.accepted_path),
            list(r.token_ids),
            r.compute_ms,
            r.batch_sessions,
            r.batch_tokens,
            hidden_from_proto(r.hidden_states, r.HasField("hidden_states")),
            r.batch_id,
        )


class GrpcDrafter(_Client):
    stub_cls = pb_grpc.DrafterServiceStub
    service = "specdec.v1.DrafterService"
    kind = "drafter"

    def __init__(self, address: str, timeout_s: float, target_vocab_size: int = 0, **channel):
        super().__init__(address, timeout_s, **channel)
        self.mux = StreamMux(self.stub.ProposeSteps, pb.ProposeStep)
        # Every session tells the drafter the target's rows, so that it proposes
        # only ids the verifier has (padded pairs; drafter_svc/vocab.py).
        self.target_vocab_size = target_vocab_size

    async def open(self, session_id, prompt_ids, sampling, *, generated_from=0) -> None:
        """generated_from: with structured output, where the generated tokens
        of a rebuilt session start in prompt_ids."""
        await self._unary(
            self.stub.OpenSession,
            pb.OpenDraftSessionRequest(
                session_id=session_id,
                prompt_token_ids=prompt_ids,
                sampling=sampling_to_proto(sampling),
                target_vocab_size=self.target_vocab_size,
                generated_from=generated_from,
                owner=self.session_owner,
            ),
            "specdec.draft_prefill",
            "OpenSession",
            prompt_tokens=len(prompt_ids),
        )

    def _probe_open(self, session_id: str):
        return pb.OpenDraftSessionRequest(
            session_id=session_id,
            prompt_token_ids=[0],
            sampling=pb.SamplingParams(),
            target_vocab_size=self.target_vocab_size,
        )

    async def propose(self, call: ProposeCall) -> Draft:
        r = await self._stream(propose_to_proto(call), "specdec.draft", "ProposeSteps")
        return Draft(
            list(r.draft_token_ids),
            list(r.draft_parents),
            dists_from_proto(r.draft_distributions),
            r.compute_ms,
            r.batch_tokens,
            r.guessed_token_id if r.HasField("guessed_token_id") else None,
            branches=[(b.kept, b.token_id, _chain(b)) for b in r.branches],
            confidences=list(r.draft_confidences),
            pruned=r.confidence_pruned,
            forced_nodes=list(r.forced_nodes),
        )


def _chain(b: pb.AheadBranch) -> Draft:
    tokens = b.draft_token_ids
    return Draft(
        list(tokens),
        list(range(-1, len(tokens) - 1)),
        dists_from_proto(b.draft_distributions),
        confidences=list(b.draft_confidences),
        pruned=b.confidence_pruned,
    )
