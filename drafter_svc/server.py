from __future__ import annotations

from drafter_svc.config import DrafterConfig
from drafter_svc.core import Drafter
from drafter_svc.eagle import make_drafter
from drafter_svc.servicer import SERVICE_NAME, DrafterServicer
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.service_main import serve_model_core


def start(config: DrafterConfig, core: Drafter | None = None):
    """Load the model (unless given a core), start serving; return (server, port)."""
    core = core or make_drafter(config)
    return serve_model_core(
        core, config, pb_grpc.add_DrafterServiceServicer_to_server, DrafterServicer(core), SERVICE_NAME
    )
