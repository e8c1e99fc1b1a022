from __future__ import annotations

from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.service_main import serve_model_core
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier
from verifier_svc.servicer import SERVICE_NAME, VerifierServicer


def start(config: VerifierConfig, core: Verifier | None = None):
    """Load the model (unless given a core), start serving; return (server, port)."""
    core = core or Verifier(config)
    return serve_model_core(
        core, config, pb_grpc.add_VerifierServiceServicer_to_server, VerifierServicer(core), SERVICE_NAME
    )
