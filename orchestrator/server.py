"""Serving OrchestratorService: in the foreground (`python -m orchestrator`) or on a
background event-loop thread (inside a Ray actor)."""
from __future__ import annotations

import asyncio
import threading

import grpc

from specd import telemetry
from specd.grpc_util import CHANNEL_OPTIONS, add_health_and_reflection
from specdec.v1 import specdec_pb2_grpc as pb_grpc

from .config import OrchestratorConfig
from .core import Orchestrator
from .servicer import ADMIN_SERVICE_NAME, SERVICE_NAME, AdminServicer, OrchestratorServicer


async def start_async(config: OrchestratorConfig, launcher=None):
    """Start the aio server on the running loop; return (server, port).
    launcher: starts and stops replicas (on Ray), which makes the pools scalable."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    core = Orchestrator(config, launcher)
    pb_grpc.add_OrchestratorServiceServicer_to_server(OrchestratorServicer(core), server)
    pb_grpc.add_AdminServiceServicer_to_server(AdminServicer(core), server)
    add_health_and_reflection(server, [SERVICE_NAME, ADMIN_SERVICE_NAME])
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise RuntimeError(f"could not bind {config.host}:{config.port}")
    await server.start()
    if core.scaler:
        core.scaler.start()
    return server, port


class BackgroundServer:
    """Runs the aio server on its own thread and loop; `port` once started."""

    def __init__(self, config: OrchestratorConfig, launcher=None, startup_timeout_s: float = 120.0):
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(config, launcher), daemon=True,
                                       name="orchestrator")
        self.thread.start()
        if not self._ready.wait(startup_timeout_s):
            raise TimeoutError("orchestrator server did not start")
        if self._error:
            raise self._error

    def _run(self, config, launcher):
        asyncio.set_event_loop(self.loop)
        try:
            self.server, self.port = self.loop.run_until_complete(start_async(config, launcher))
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_until_complete(self.server.wait_for_termination())

    def stop(self, grace_s: float = 5.0) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self.loop).result(grace_s + 5)
        self.thread.join(grace_s + 5)
        telemetry.flush()     # the process may live on (a Ray actor): flush, do not shut down
