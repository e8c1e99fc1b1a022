"""Serving OrchestratorService over gRPC and the OpenAI-compatible HTTP API on
one event loop: in the foreground (`python -m orchestrator`) or on a
background event-loop thread (inside a Ray actor)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import uvicorn
from grpc_health.v1.health import HealthServicer

from orchestrator.config import OrchestratorConfig
from orchestrator.core import Orchestrator
from orchestrator.edge.openai_api import create_app
from orchestrator.edge.servicer import ADMIN_SERVICE_NAME, SERVICE_NAME, AdminServicer, OrchestratorServicer
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.auth import BearerTokenInterceptor, tokens_from_env_and_file
from specd_core.net.grpc_util import add_health_and_reflection, bind, server_options
from specd_core.telemetry import tracing

log = logging.getLogger(__name__)


# An orchestrator scaled down lets its running streams finish; one still
# running after this long (far longer than max_new_tokens_limit tokens take)
# is cancelled.
RETIRE_GRACE_S = 3600.0


class _Uvicorn(uvicorn.Server):
    def capture_signals(self):
        # The process's owner handles SIGTERM (`python -m orchestrator`,
        # a Ray actor): it drains gRPC and HTTP together (Serving.drain_and_stop).
        return contextlib.nullcontext()


SHARE_PORTS = ("", "first", "join")  # OrchestratorConfig.share_ports


def address_family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def claim_port(host: str, port: int, what: str) -> int:
    """The port a group's first orchestrator is to share, checked free: bound
    for a moment WITHOUT SO_REUSEPORT, which fails while any server listens
    there (sharing or not), so a group never joins an unrelated server. Port
    0: a free one. Returns the port."""
    with socket.socket(address_family(host), socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # old connections' TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve {what} on {host}:{port}: {exc.strerror}") from None
        return probe.getsockname()[1]


class HttpServer:
    """uvicorn serving the OpenAI-compatible API as a task on the running loop,
    the gRPC server's: one process, one loop, one generation core."""

    def __init__(self, app, config: OrchestratorConfig):
        # Bound here, not by uvicorn: the port is known at once (port -1: any
        # free one) and a port in use fails the start with its OSError.
        port = max(config.http_port, 0)
        try:
            if config.share_ports == "first":
                port = claim_port(config.host, port, "the HTTP API")
            self.sock = socket.create_server(
                (config.host, port), family=address_family(config.host), reuse_port=bool(config.share_ports)
            )
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot serve the HTTP API on {config.host}:{config.http_port}: {exc.strerror} "
                "(--http-port: another port, or 0 for no HTTP API)",
            ) from None
        self.port = self.sock.getsockname()[1]
        self.scheme = "https" if config.tls else "http"
        self.server = _Uvicorn(
            uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", **tls_kwargs(config.tls))
        )
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():  # failed to start (e.g. a certificate uvicorn cannot load)
                self.task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self, grace_s: float) -> None:
        """Close the listener; running responses get grace_s, then are cancelled
        (a cancelled stream closes its generator: sessions freed)."""
        if self.task is None:
            return
        self.server.config.timeout_graceful_shutdown = math.ceil(grace_s)
        self.server.should_exit = True
        await self.task


def tls_kwargs(tls) -> dict:
    """uvicorn's TLS settings from the gRPC side's: the same certificate, key
    and CA, and client certificates required exactly when gRPC requires them."""
    if tls is None:
        return {}
    return {
        "ssl_certfile": tls.cert,
        "ssl_keyfile": tls.key,
        "ssl_ca_certs": tls.ca,
        "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_NONE,
    }


@dataclass
class Serving:
    """A started orchestrator server and what its shutdown needs."""

    server: grpc.aio.Server
    port: int
    core: Orchestrator
    health: HealthServicer
    http: HttpServer | None = None  # the OpenAI-compatible API; None = off

    @property
    def http_url(self) -> str:
        """scheme://host:port of the HTTP API as bound ('' = off)."""
        if self.http is None:
            return ""
        return f"{self.http.scheme}://{self.core.config.host}:{self.http.port}"

    async def retire(self, grace_s: float = RETIRE_GRACE_S) -> None:
        """Leave the orchestrators sharing this address: stop listening at once
        (the kernel hands new connections to the others), tell connected
        clients (HTTP/2 GOAWAY: their channels open a new connection for their
        next call, which reaches another; idle HTTP keep-alive connections are
        closed), let running streams run to their end (at most grace_s), then stop."""
        self.health.enter_graceful_shutdown()
        self.core.admission.retiring = True
        await asyncio.gather(self.server.stop(grace_s), *([self.http.stop(grace_s)] if self.http else []))
        await self.core.aclose()

    async def drain_and_stop(self, grace_s: float) -> None:
        """Graceful shutdown: health NOT_SERVING (balancers stop sending), new
        Generate calls refused with UNAVAILABLE (the core's admission is `draining`), running
        streams given up to grace_s to finish; then the server stops. One of
        several sharing the address retires instead: its clients' next calls
        go to the others rather than being refused."""
        if self.core.config.share_ports:
            await self.retire(grace_s)
            return
        self.health.enter_graceful_shutdown()
        self.core.admission.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        # Polled: streams end inside the core's generator, which knows no server.
        while self.core.admission.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.core.admission.active:
            log.warning(
                "shutdown grace (%.1fs) over: cancelling %d running stream(s)", grace_s, self.core.admission.active
            )
        left = max(0.5, deadline - loop.time())
        await asyncio.gather(self.server.stop(left), *([self.http.stop(left)] if self.http else []))


async def start_async(config: OrchestratorConfig, launcher=None, peers=None) -> Serving:
    """Start the aio server on the running loop.
    launcher: starts and stops replicas (on Ray), which makes the pools scalable;
    peers: the other orchestrators of the deployment (orchestrator/fleet/peers.py)."""
    if config.tls:
        config.tls.check(server=True)  # before loading anything, naming the bad file
    tokens = tokens_from_env_and_file(config.auth_tokens_file)
    if not tokens and not config.host.startswith("127."):
        log.warning(
            "no auth tokens configured: anyone who reaches %s:%s can generate and scale", config.host, config.port
        )
    if config.share_ports not in SHARE_PORTS:
        raise ValueError(f"share_ports must be one of {SHARE_PORTS}, got {config.share_ports!r}")
    if config.share_ports == "join" and (config.port == 0 or config.http_port < 0):
        raise ValueError("joining a group needs its ports: --port and --http-port as its first bound them")
    server = grpc.aio.server(
        options=server_options(config.max_message_bytes, reuse_port=bool(config.share_ports)),
        interceptors=[BearerTokenInterceptor(tokens)] if tokens else None,
    )
    core = Orchestrator(config, launcher, peers)
    pb_grpc.add_OrchestratorServiceServicer_to_server(OrchestratorServicer(core), server)
    pb_grpc.add_AdminServiceServicer_to_server(AdminServicer(core), server)
    health_servicer = add_health_and_reflection(server, [SERVICE_NAME, ADMIN_SERVICE_NAME])
    port = config.port
    if config.share_ports == "first":
        port = claim_port(config.host, port, "Generate")
    port = bind(server, config.host, port, config.tls)
    http = None
    if config.http_port:
        name = config.served_model_name or Path(config.target_dir).name
        http = HttpServer(create_app(core, name, tokens), config)
    await server.start()
    if http:
        await http.start()
    host = config.public_host or config.host
    core.fleet.address = f"{host}:{port}"
    core.fleet.http_address = f"{http.scheme}://{host}:{http.port}" if http else ""
    core.fleet.start()
    return Serving(server, port, core, health_servicer, http)


class BackgroundServer:
    """Runs the aio server on its own thread and loop; `port` once started."""

    def __init__(self, config: OrchestratorConfig, launcher=None, peers=None, startup_timeout_s: float = 120.0):
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, args=(config, launcher, peers), daemon=True, name="orchestrator"
        )
        self.thread.start()
        if not self._ready.wait(startup_timeout_s):
            raise TimeoutError("orchestrator server did not start")
        if self._error:
            raise self._error

    def _run(self, config, launcher, peers):
        asyncio.set_event_loop(self.loop)
        try:
            self.serving = self.loop.run_until_complete(start_async(config, launcher, peers))
            self.server, self.port = self.serving.server, self.serving.port
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        # Until stop(): the loop outlives the gRPC server while a retiring
        # orchestrator's HTTP streams and closing calls finish.
        self.loop.run_forever()

    def call(self, coro, timeout_s: float | None = None):
        """Run a coroutine on the server's loop (from another thread: a Ray
        actor's method) and return its result: the core is the loop's alone."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self, grace_s: float = 5.0) -> None:
        self.call(self.serving.drain_and_stop(grace_s), grace_s + 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(grace_s + 5)
        tracing.flush()  # the process may live on (a Ray actor): flush, do not shut down
