"""Placing the system on Ray: model-service replicas and the orchestrator as
detached, named actors, each serving gRPC on its node.

Ray places and supervises the replicas (custom resources `drafter` / `verifier`
put each replica in its pool, so the two pools can be different node types);
the per-cycle hot path is gRPC between the services, never Ray calls.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import ray

from drafter_svc.config import DrafterConfig
from specd import telemetry
from specd.spec_config import SpeculativeConfig
from verifier_svc.config import VerifierConfig

from .config import OrchestratorConfig

log = logging.getLogger(__name__)
NAMESPACE = "specd"
ORCHESTRATOR_NAME = "specd-orchestrator"


@dataclass(frozen=True)
class DeploymentConfig:
    target_dir: str
    drafter_dir: str | None
    port: int = 50051                 # public Generate port
    num_verifiers: int = 1
    num_drafters: int = 1
    device: str = "auto"
    dtype: str = "float32"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    verifier_resource: str = "verifier"   # Ray custom resource of the verifier pool
    drafter_resource: str = "drafter"     # Ray custom resource of the drafter pool
    ready_timeout_s: float = 300.0


@ray.remote(num_cpus=0, max_restarts=3)
class ModelServiceActor:
    """One drafter or verifier replica: loads its model, serves gRPC on this node."""

    def __init__(self, kind: str, config_fields: dict):
        logging.basicConfig(level=logging.INFO)
        telemetry.setup(kind)          # only if OTEL_EXPORTER_OTLP_*ENDPOINT is set
        if kind == "verifier":
            from verifier_svc.server import start
            config = VerifierConfig(**config_fields)
        else:
            from drafter_svc.server import start
            config = DrafterConfig(**config_fields)
        self.server, self.port = start(config)
        self.host = ray.util.get_node_ip_address()

    def address(self) -> str:
        return f"{self.host}:{self.port}"


@ray.remote(num_cpus=0, max_restarts=3)
class OrchestratorActor:
    def __init__(self, config: OrchestratorConfig):
        from .server import BackgroundServer
        logging.basicConfig(level=logging.INFO)
        telemetry.setup("orchestrator")
        self.server = BackgroundServer(config)
        self.host = ray.util.get_node_ip_address()

    def address(self) -> str:
        return f"{self.host}:{self.server.port}"


def _tracing_options() -> dict:
    """The deploying shell's OTEL_* settings for the actors: workers of an
    attached cluster do not inherit this process's environment. Nothing when
    none is set, so untraced deployments are unchanged."""
    env = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
    return {"runtime_env": {"env_vars": env}} if env else {}


def _replica(kind: str, index: int, resource: str, fields: dict):
    return ModelServiceActor.options(
        name=f"specd-{kind}-{index}", namespace=NAMESPACE, lifetime="detached",
        resources={resource: 1}, num_gpus=0, **_tracing_options(),
    ).remote(kind, fields)


def deploy(cfg: DeploymentConfig) -> str:
    """Start replicas and the orchestrator; return the public Generate address.

    Assumes ray.init() was called. Replicas ask for their pool's resource, so on
    a cluster without it they stay pending (the timeout says which)."""
    common = dict(host="0.0.0.0", port=0, device=cfg.device, dtype=cfg.dtype)
    verifiers = [_replica("verifier", i, cfg.verifier_resource, dict(model_dir=cfg.target_dir, **common))
                 for i in range(cfg.num_verifiers)]
    drafters = [_replica("drafter", i, cfg.drafter_resource, dict(model_dir=cfg.drafter_dir, **common))
                for i in range(cfg.num_drafters if cfg.drafter_dir else 0)]
    try:
        v_addrs = ray.get([a.address.remote() for a in verifiers], timeout=cfg.ready_timeout_s)
        d_addrs = ray.get([a.address.remote() for a in drafters], timeout=cfg.ready_timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        raise TimeoutError(
            f"replicas not ready after {cfg.ready_timeout_s}s: does the cluster have the "
            f"'{cfg.verifier_resource}' and '{cfg.drafter_resource}' resources?") from exc
    orch_config = OrchestratorConfig(
        target_dir=cfg.target_dir, drafter_dir=cfg.drafter_dir, port=cfg.port,
        verifier_addresses=v_addrs, drafter_addresses=d_addrs, speculative=cfg.speculative)
    orch = OrchestratorActor.options(name=ORCHESTRATOR_NAME, namespace=NAMESPACE,
                                     lifetime="detached", **_tracing_options()).remote(orch_config)
    return ray.get(orch.address.remote(), timeout=cfg.ready_timeout_s)


def teardown() -> list[str]:
    """Kill every specd actor in the namespace; return their names."""
    killed = []
    for info in ray.util.list_named_actors(all_namespaces=True):
        if info["namespace"] == NAMESPACE and info["name"].startswith("specd-"):
            ray.kill(ray.get_actor(info["name"], namespace=NAMESPACE), no_restart=True)
            killed.append(info["name"])
    return killed
