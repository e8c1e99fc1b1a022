from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.fleet.pool import ReplicaSpec
from orchestrator.fleet.scaling import AutoscalePolicy
from orchestrator.spec_config import SpeculativeConfig
from specd_core.net.grpc_util import MAX_MESSAGE_BYTES
from specd_core.net.security import TlsConfig


@dataclass(frozen=True)
class OrchestratorConfig:
    target_dir: str  # the verifier's model dir (tokenizer + context length)
    drafter_dir: str | None = None  # None: no drafter, speculation off
    host: str = "127.0.0.1"  # loopback; another address needs credentials (specd_core/net/exposure.py)
    port: int = 50051  # public Generate port; 0 = any free port
    # The OpenAI-compatible HTTP API (docs/http.md) on the same host: 0 = off,
    # -1 = any free port (tests, where several orchestrators run at once).
    http_port: int = 8000
    served_model_name: str | None = None  # the HTTP API's model name; None = the target directory's name
    verifier_addresses: list[str] = field(default_factory=list)  # named verifier-0, verifier-1, ...
    drafter_addresses: list[str] = field(default_factory=list)  # named drafter-0, ...
    replicas: list[ReplicaSpec] = field(default_factory=list)  # named replicas (Ray deployments)
    autoscale: dict[str, AutoscalePolicy] = field(default_factory=dict)  # per pool, optional
    max_replicas: int = 64  # per pool, for `specd scale`
    default_max_new_tokens: int = 128  # when a request leaves it unset
    max_new_tokens_limit: int = 4096  # requests above it: INVALID_ARGUMENT
    # Method, K, tree, ngram settings and the limits requests cannot exceed.
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    rpc_timeout_s: float = 60.0  # per internal call
    # Replacements of a lost verifier (and, apart, drafter) per request before
    # it fails (verifier) or goes on without a drafter (orchestrator/fleet/failover.py).
    max_failovers: int = 3
    # TLS for the public server AND the channels to the replicas (the same
    # cert/key/CA; see specd_core.net.security). None = plaintext everywhere.
    tls: TlsConfig | None = None
    # Bearer tokens for the public API (one per line; $SPECD_AUTH_TOKENS adds
    # more). No file and no env tokens = no authentication.
    auth_tokens_file: str | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES  # per message, every link; over it: RESOURCE_EXHAUSTED
    shutdown_grace_s: float = 30.0  # after SIGTERM: running streams get this long to finish
    # Generate streams at once; past it a new one is RESOURCE_EXHAUSTED at once
    # (admission control: each stream holds sessions and a slot in every forward).
    # With several orchestrators this is its share of the deployment's limit,
    # `admission_total` (0: this one alone), which the owner splits anew when
    # their number changes (peers.admission_shares).
    max_active_requests: int = 1024
    admission_total: int = 0
    # Where this orchestrator's own Prometheus /metrics is served (host:port),
    # reported by Status; "" when unknown (`specd up` sets it).
    metrics_address: str = ""
    # Orchestrators of one deployment serve one address: each binds the gRPC and
    # HTTP ports with SO_REUSEPORT and the kernel spreads new connections over
    # them (docs/operations.md#several-orchestrators-one-address). "": alone (a port in use
    # fails the start); "first": the group's first, which checks that the ports
    # are free (so an unrelated server is never joined) and binds them so that
    # others can; "join": binds the ports the group's first holds.
    share_ports: str = ""
    # Several orchestrators of one deployment (on Ray; orchestrator/fleet/peers.py):
    # the first (index 0) scales the pools, the others follow its replica list.
    name: str = "orchestrator"  # as Status lists it (on Ray its actor's name)
    index: int = 0
    node: str = ""  # where it runs (the Ray node), for Status
    public_host: str = ""  # the host Status reports it at ("": `host`)
    # Prometheus file_sd JSON listing every /metrics endpoint of the deployment,
    # rewritten on every pool change (specd_core/telemetry/discovery.py); None = none.
    metrics_targets_file: str | None = None


def add_http_flags(p) -> None:
    """The HTTP API's flags (docs/http.md), of `python -m orchestrator` and `specd up`."""
    p.add_argument(
        "--http-port",
        type=int,
        default=OrchestratorConfig.http_port,
        help="serve the OpenAI-compatible HTTP API on this port (0 = off; -1 = any free port)",
    )
    p.add_argument("--served-model-name", help="the HTTP API's model name (default: the target directory's name)")
