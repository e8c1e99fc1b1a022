"""The gRPC edge shared by every service: error -> status mapping, server setup
with health checking and reflection, message size limits, and the one place
where servers' ports and clients' channels are made (TLS when configured,
specd_core.net.security; plaintext otherwise), so every link follows the same settings."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import queue
import sys
import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd_core.errors import CapacityExceeded, InvalidRequest, SessionExpired, ShuttingDown, Unsupported
from specd_core.net.security import TlsConfig
from specd_core.telemetry.probe import mark

log = logging.getLogger(__name__)

# A message over the limit fails its call with RESOURCE_EXHAUSTED (gRPC's own
# check, before any of our code runs). 16 MiB is far above any request or
# draft this system sends; the limit bounds what one call can make a server buffer.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


# A service hands each per-cycle message from thread to thread (gRPC's poll
# thread, a stream's reader, the batcher, its sender; in the orchestrator
# gRPC's poller and the asyncio loop). A thread woken while another holds the
# GIL waits until the holder blocks or the interpreter's switch interval
# passes, 5 ms by default: a whole cycle's overhead for one hand-off. The
# Python each thread runs between blocking calls is short, so a short interval
# costs little (docs/overhead.md measures both).
SWITCH_INTERVAL_S = 0.0002


def prefer_latency() -> None:
    """A service process's thread switching, tuned for hand-offs (above)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", max_message_bytes)]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES, reuse_port: bool = False) -> list[tuple[str, int]]:
    """A server's options. gRPC core sets SO_REUSEPORT on its listeners unless
    told not to, so a second server on a port already served would bind it
    without an error and take part of its connections; only orchestrators of
    one deployment share a port on purpose (reuse_port; orchestrator/edge/server.py)."""
    return channel_options(max_message_bytes) + [("grpc.so_reuseport", int(reuse_port))]


# A client's calls to the public API (Generate, Admin) that fail UNAVAILABLE
# before any answer are made again, on a new connection if the old one is gone.
# That covers an orchestrator leaving a group that shares an address: a
# connection the kernel had queued on its listener when it closed is reset,
# and the retry reaches another (a call on an established connection gets
# GOAWAY and moves by itself). gRPC retries a stream only until its first
# response, so no token is sent twice.
RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "specdec.v1.OrchestratorService"}, {"service": "specdec.v1.AdminService"}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.2s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


def bind(server, host: str, port: int, tls: TlsConfig | None) -> int:
    """Add the server's port (TLS when configured); return the bound port."""
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"could not bind {address}")
    return bound


def open_channel(
    address: str,
    tls: TlsConfig | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    aio: bool = False,
    own_connection: bool = False,
    retry_unavailable: bool = False,
):
    """A channel to `address` (TLS when configured); grpc.aio's with aio=True.
    own_connection: a TCP connection of its own; by default channels to one
    address in a process share one (gRPC's global subchannel pool), which
    would put every such channel on the one orchestrator that connection
    reached when several share the address.
    retry_unavailable: a client's calls to the public API are tried again
    (RETRY_SERVICE_CONFIG) when they fail UNAVAILABLE before any answer."""
    mod = grpc.aio if aio else grpc
    options: list = channel_options(max_message_bytes)
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if retry_unavailable:
        options.append(("grpc.service_config", RETRY_SERVICE_CONFIG))
    if tls is None:
        return mod.insecure_channel(address, options=options)
    return mod.secure_channel(address, tls.channel_credentials(), options=options + tls.channel_options())


# A status message travels in a response header (grpc-message), and clients
# refuse headers over 16 KiB: an error that echoed a 100 kB session id would
# reach the client as RESOURCE_EXHAUSTED "received metadata size exceeds hard
# limit", its reason lost. Messages are cut well below that.
MAX_STATUS_MESSAGE = 1000


def _short(message: str) -> str:
    return message if len(message) <= MAX_STATUS_MESSAGE else message[: MAX_STATUS_MESSAGE - 15] + " ...(truncated)"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, SessionExpired):  # before InvalidRequest: it is a subclass
        return grpc.StatusCode.NOT_FOUND, _short(str(exc))
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, _short(str(exc))
    if isinstance(exc, Unsupported):
        return grpc.StatusCode.FAILED_PRECONDITION, _short(str(exc))
    if isinstance(exc, CapacityExceeded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, _short(str(exc))
    if isinstance(exc, ShuttingDown):
        return grpc.StatusCode.UNAVAILABLE, _short(str(exc))
    return grpc.StatusCode.INTERNAL, _short(f"internal error: {type(exc).__name__}: {exc}")


def grpc_errors(method):
    """Servicer-method decorator (sync server): core exceptions -> gRPC status.

    Unexpected exceptions are logged with their traceback and become INTERNAL;
    the server keeps serving other calls either way."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every error must become a status
            code, msg = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method.__name__)
            context.abort(code, msg)

    return wrapper


def error_response(exc: BaseException, response_cls, name: str):
    """A stream message's failure as a response with its `error` field set:
    the stream, which other sessions share, goes on."""
    code, msg = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("%s failed", name, exc_info=exc)
    response = response_cls()
    response.error.code, response.error.message = code.value[0], msg
    return response


def then(future: futures.Future, fn) -> futures.Future:
    """A future of fn(future's result), computed by whichever thread completes
    `future` (a batcher's), so that no thread waits on it; errors pass through."""
    out: futures.Future = futures.Future()

    def done(f: futures.Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except Exception as exc:  # noqa: BLE001 - the caller's future carries every error
            out.set_exception(exc)

    future.add_done_callback(done)
    return out


def close_if_caller_left(core, session_id: str, context) -> None:
    """After an OpenSession: if the caller cancelled (or passed its deadline)
    while the session was being opened, it will never learn that the session
    exists, so it cannot close it; close it here instead of holding its KV cache.
    (The caller also closes what it may have opened; either close may find
    nothing, which is fine. Both cannot miss: the cancel reaches this server
    before the caller's close on the same connection.) The response is still
    returned: nobody reads it."""
    if not context.is_active():
        with contextlib.suppress(InvalidRequest):  # the caller's close got there first
            core.close_session(session_id)


def concurrent_stream(
    start, request_iterator, response_cls, max_pending: int = 1024, step_cls=None, later: Callable | None = None
):
    """Serve a multiplexed bidi stream whose messages belong to many sessions,
    answered as they finish, in any order, matched by request_id.

    start(request) checks a message and hands it to the core's batcher; it
    returns a future of the response (specd_core.net.grpc_util.then) and never
    waits, so the one reader thread keeps reading while earlier messages are in
    a forward, and concurrent sessions' calls reach the batcher together. The
    thread that completes a future (the batcher's) queues its response for this
    generator to send: a message crosses two threads on its way through (reader
    -> batcher -> sender) rather than a worker thread of its own as well, whose
    two wake-ups per message cost about 0.5 ms of a 4 ms cycle overhead at
    batch 1 (docs/overhead.md). Ends once the client has closed its side and
    every message has its answer.

    step_cls: the stream carries steps (ProposeStep / VerifyStep in, step_cls
    out): each message read holds many sessions' requests, started one after
    another so that they reach the batcher together, and each message sent
    holds every answer ready by then. later (the Batcher's): runs a function
    once every result of the batch being answered is set, so that a forward's
    answers are queued as one group and leave as one message - the sessions
    they wake then make their next calls together, one step again."""
    mux = _StreamMux(start, response_cls, max_pending, step_cls, later)
    threading.Thread(target=mux.read, args=(request_iterator,), daemon=True, name=f"{mux.name}-reader").start()
    yield from mux.responses()


class _StreamMux:
    """concurrent_stream's state: the reader thread starts messages, the
    threads completing their futures queue the answers, the stream's generator
    sends them."""

    def __init__(self, start, response_cls, max_pending: int, step_cls, later: Callable | None) -> None:
        self.start, self.response_cls, self.max_pending = start, response_cls, max_pending
        self.step_cls, self.later = step_cls, later
        self.out: queue.Queue = queue.Queue()
        self.name = getattr(start, "__name__", "stream")
        # The probe's event names, made once (specd_core/telemetry/probe.py).
        self.read_event, self.queued_event, self.answered_event, self.sending_event = (
            f"{self.name} {e}" for e in ("read", "queued", "answered", "sending")
        )
        # Messages read but not yet answered; past max_pending a message is refused
        # at once (RESOURCE_EXHAUSTED in its response) so a client that floods the
        # stream cannot grow the batcher's queue without bound.
        self.pending = threading.BoundedSemaphore(max_pending)
        self.ready: list = []  # steps: the answers of the batch now being answered
        self.ready_lock = threading.Lock()

    def answer(self, request_id: int, response) -> None:
        """A started message's response: queued to send; its slot is free."""
        self.send(request_id, response)
        self.pending.release()

    def send(self, request_id: int, response) -> None:
        response.request_id = request_id
        mark(self.answered_event)
        if self.step_cls is None:
            self.out.put(response)
            return
        with self.ready_lock:
            first = not self.ready
            self.ready.append(response)
        if first:
            (self.later or _now)(self.send_ready)

    def send_ready(self) -> None:
        with self.ready_lock:
            answers = self.ready.copy()
            self.ready.clear()
        self.out.put(answers)

    def answered(self, request_id: int):
        def done(future: futures.Future) -> None:
            try:
                response = future.result()
            except Exception as exc:  # noqa: BLE001 - every error must become a status
                response = error_response(exc, self.response_cls, self.name)
            self.answer(request_id, response)

        return done

    def read(self, request_iterator) -> None:
        n = 0
        try:
            for message in request_iterator:
                mark(self.read_event)
                for request in message.requests if self.step_cls is not None else (message,):
                    self.start_one(request)
                    n += 1
        except Exception:  # noqa: BLE001 - the client went away: answer what is in flight, then end
            pass
        self.out.put(n)  # the count of answers to send

    def start_one(self, request) -> None:
        """Start one session's request (each gets exactly one answer)."""
        if not self.pending.acquire(blocking=False):
            refusal = CapacityExceeded(
                f"too many messages in flight on this stream (more than {self.max_pending}); "
                f"wait for answers before sending more"
            )
            self.send(request.request_id, error_response(refusal, self.response_cls, self.name))
            return
        try:
            future = self.start(request)
        except Exception as exc:  # noqa: BLE001 - a bad message fails alone
            self.answer(request.request_id, error_response(exc, self.response_cls, self.name))
            return
        mark(self.queued_event)
        future.add_done_callback(self.answered(request.request_id))

    def responses(self):
        """What the stream sends, until every message read has its answer."""
        sent, total = 0, None
        while total is None or sent < total:
            item = self.out.get()
            if isinstance(item, int):
                total = item
                continue
            if self.step_cls is None:
                mark(self.sending_event)
                yield item
                sent += 1
                continue
            answers, total = self._with_ready_now(list(item), total)
            mark(self.sending_event)
            yield self.step_cls(responses=answers)
            sent += len(answers)

    def _with_ready_now(self, answers: list, total: int | None) -> tuple[list, int | None]:
        """Every answer ready now joins this step (and the count, if it came)."""
        while True:
            try:
                more = self.out.get_nowait()
            except queue.Empty:
                return answers, total
            if isinstance(more, int):
                total = more
            else:
                answers += more


def _now(fn: Callable[[], None]) -> None:
    fn()


def add_health_and_reflection(server, service_names: list[str]) -> health.HealthServicer:
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in service_names + [""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(service_names + [reflection.SERVICE_NAME], server)
    return health_servicer


class DrainingServer:
    """A started sync grpc.Server whose stop() first reports NOT_SERVING on
    every health service (so probes and balancers stop sending work), then
    refuses new calls and gives running ones `grace` seconds."""

    def __init__(self, server, health_servicer: health.HealthServicer):
        self.server, self.health = server, health_servicer

    def stop(self, grace: float | None):
        self.health.enter_graceful_shutdown()
        return self.server.stop(grace)

    def __getattr__(self, name):
        return getattr(self.server, name)


def start_sync_server(
    add_fn,
    servicer,
    service_name: str,
    host: str,
    port: int,
    workers: int,
    tls: TlsConfig | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
):
    """Start a thread-pool gRPC server for one servicer; return (server, bound port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=server_options(max_message_bytes))
    add_fn(servicer, server)
    health_servicer = add_health_and_reflection(server, [service_name])
    bound = bind(server, host, port, tls)
    server.start()
    return DrainingServer(server, health_servicer), bound
