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
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

import grpc

from orchestrator.cycle.records import Draft, Verdict
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


class ServiceError(Exception):
    """A replica refused or failed a call; carries the grpc status to pass on."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


_CODES = {c.value[0]: c for c in grpc.StatusCode}


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
            error = ServiceError(exc.code(), exc.details() or str(exc.code()))
        except asyncio.CancelledError:
            raise
        if self._queue is queue:
            self._queue = None  # next call opens a fresh stream
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
            future.set_exception(
                ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the replica did not answer within {timeout:g} s")
            )


class _Client:
    stub_cls: ClassVar[type[Any]]  # the service's generated stub class
    service = ""  # the grpc service name, for span attributes
    mux: StreamMux  # the subclass's per-cycle stream
    # Who opens the sessions (this orchestrator's incarnation): the replica
    # closes them if it stops hearing from it (orchestrator/fleet/keepalive.py).
    session_owner = ""

    def __init__(
        self, address: str, timeout_s: float, tls: TlsConfig | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES
    ):
        self.address = address
        self.timeout = timeout_s
        self.channel = open_channel(address, tls, max_message_bytes, aio=True)
        self.stub = self.stub_cls(self.channel)
        self.active = 0  # sessions this orchestrator has open here (for routing)

    def _span_attributes(self, rpc_method: str) -> dict:
        return {
            "rpc.system": "grpc",
            "rpc.service": self.service,
            "rpc.method": rpc_method,
            "server.address": self.address,
        }

    async def _unary(self, method, request, span_name: str, rpc_method: str):
        with tracing.client_span(span_name, attributes=self._span_attributes(rpc_method) if tracing.ENABLED else None):
            try:
                return await method(request, timeout=self.timeout, metadata=tracing.outgoing_metadata())
            except grpc.aio.AioRpcError as exc:
                raise ServiceError(exc.code(), exc.details() or str(exc.code())) from None

    async def _stream(self, request, span_name: str, rpc_method: str):
        with tracing.client_span(span_name, request, self._span_attributes(rpc_method) if tracing.ENABLED else None):
            return await self.mux.call(request, self.timeout)

    async def close(self, session_id: str) -> None:
        await self._unary(
            self.stub.CloseSession, pb.CloseSessionRequest(session_id=session_id), "specdec.close", "CloseSession"
        )

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
            raise ServiceError(exc.code(), exc.details() or str(exc.code())) from None

    async def aclose(self) -> None:
        await self.channel.close()


class GrpcVerifier(_Client):
    stub_cls = pb_grpc.VerifierServiceStub
    service = "specdec.v1.VerifierService"

    def __init__(self, address: str, timeout_s: float, **channel):
        super().__init__(address, timeout_s, **channel)
        self.mux = StreamMux(self.stub.VerifySteps, pb.VerifyStep)

    async def open(self, session_id, prompt_ids, sampling, resume: bool = False, *, hidden=False, generated_from=0):
        """resume: re-prefill all committed tokens, sample nothing (returns None).
        hidden: the session returns the target's features (EAGLE); then the
        result is (first token, the prompt's features). generated_from: with
        structured output, where the generated tokens of a resume start."""
        r = await self._unary(
            self.stub.OpenSession,
            pb.OpenVerifySessionRequest(
                session_id=session_id,
                prompt_token_ids=prompt_ids,
                sampling=sampling_to_proto(sampling),
                resume=resume,
                return_hidden_states=hidden,
                generated_from=generated_from,
                owner=self.session_owner,
            ),
            "specdec.prefill",
            "OpenSession",
        )
        first = None if resume else r.first_token_id
        if hidden:
            return first, hidden_from_proto(r.hidden_states, r.HasField("hidden_states"))
        return first

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
