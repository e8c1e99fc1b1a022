from __future__ import annotations

from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.grpc_util import start_sync_server
from specd_core.runtime.reaper import start_reaper
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier
from verifier_svc.servicer import SERVICE_NAME, VerifierServicer


def start(config: VerifierConfig, core: Verifier | None = None):
    """Load the model (unless given a core), start serving; return (server, port)."""
    core = core or Verifier(config)
    if config.warmup:  # before the server exists: health says SERVING only once warm
        core.warm_up()
    start_reaper(core)  # idle sessions expire (config.session_idle_timeout_s)
    return start_sync_server(
        pb_grpc.add_VerifierServiceServicer_to_server,
        VerifierServicer(core),
        SERVICE_NAME,
        config.host,
        config.port,
        config.grpc_workers,
        config.tls,
        config.max_message_bytes,
    )
