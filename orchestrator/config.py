"""The orchestrator's settings: `OrchestratorConfig`, and the records it holds
of the fleet - the replicas it is given (`ReplicaSpec`) and the autoscaling
policy of a pool (`AutoscalePolicy`). Plain data at the bottom of the
orchestrator's layers: the fleet (orchestrator/fleet/) acts on them. Each
OrchestratorConfig field's metadata is its `python -m orchestrator` flag, or
why it has none (specd_core/net/flags.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from orchestrator.spec_config import SpeculativeConfig, add_speculative_flags, speculative_config_from_args
from specd_core.net.flags import flag, flag_group, not_flag
from specd_core.net.grpc_util import MAX_MESSAGE_BYTES
from specd_core.net.security import TlsConfig, tls_from_args
from specd_core.net.service_config import add_server_tls_flags

HTTP_PORT_HELP = "serve the OpenAI-compatible HTTP API on this port (0 = off; -1 = any free port)"
SERVED_MODEL_NAME_HELP = "the HTTP API's model name (default: the target directory's name)"
AUTH_TOKENS_FILE_HELP = (
    "bearer tokens the public API accepts, one per line "
    "($SPECD_AUTH_TOKENS adds comma-separated ones); default: no authentication"
)
MAX_MESSAGE_BYTES_HELP = "largest gRPC message on every link (over it: RESOURCE_EXHAUSTED)"
HOST_HELP = (
    "interface Generate and the HTTP API listen on (default loopback: this machine only); "
    "another address needs bearer tokens or mutual TLS, or --insecure"
)
INSECURE_HELP = "serve Generate and the HTTP API beyond loopback without tokens or mutual TLS (a warning says so)"
# Prefix routing's defaults (orchestrator/fleet/prefix_routing.py).
DEFAULT_PREFIX_ROUTING_BOUND = 1.5
DEFAULT_PREFIX_ROUTING_SLACK = 2
PREFIX_ROUTING_HELP = (
    "route each new session to the least-loaded replica only, not to the one that likely caches its prompt's prefix"
)
NO_PREFIX_ROUTING = {"name": "--no-prefix-routing", "action": "store_false", "dest": "prefix_routing"}
PREFIX_ROUTING_BOUND_HELP = (
    "prefix routing: a replica caching a session's prefix takes it only while it then holds at most "
    "BOUND x the least-loaded replica's sessions + SLACK"
)
PREFIX_ROUTING_SLACK_HELP = "prefix routing: the SLACK of --prefix-routing-bound (>= 0)"
ON_RAY = "set per orchestrator by the Ray deployment (specd/ray_deploy.py)"
FIXED = "fixed: no command sets it"


@dataclass(frozen=True)
class ReplicaSpec:
    """A running replica as the orchestrator learns of it."""

    kind: str  # "verifier" | "drafter"
    name: str  # unique in the deployment (the Ray actor name on Ray)
    address: str  # host:port of its gRPC server
    node: str = ""  # where it runs (Ray node), for status
    # host:port of its Prometheus /metrics ("" if unknown); on Ray a restarted
    # replica serves it at a new port, like its gRPC server.
    metrics_address: str = ""


@dataclass(frozen=True)
class AutoscalePolicy:
    """Replicas for a pool from its load: enough that each serves about
    `target_sessions` sessions, within [min_replicas, max_replicas]."""

    min_replicas: int = 1
    max_replicas: int = 4
    target_sessions: int = 8

    def desired(self, sessions: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, math.ceil(sessions / self.target_sessions)))

    @staticmethod
    def parse(text: str) -> AutoscalePolicy:
        """'MIN:MAX:TARGET_SESSIONS', e.g. '1:8:4'."""
        try:
            lo, hi, target = (int(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"want MIN:MAX:TARGET_SESSIONS like 1:8:4, got {text!r}") from None
        if not (0 <= lo <= hi and target >= 1):
            raise ValueError(f"want 0 <= MIN <= MAX and TARGET_SESSIONS >= 1, got {text!r}")
        return AutoscalePolicy(lo, hi, target)


@dataclass(frozen=True)
class HangConfig:
    """When a replica that answers nothing is taken for hung (orchestrator/fleet/hang.py):
    a call's deadline is `multiple` times the p99 of that replica's recent
    answered calls, within [floor_s, ceiling_s], plus `prefill_s_per_token`
    for each prompt token of the opens in flight to it. multiple 0 = off
    (every call waits `rpc_timeout_s`)."""

    floor_s: float = 5.0  # also the deadline until enough calls are measured
    multiple: float = 10.0
    ceiling_s: float = 30.0
    prefill_s_per_token: float = 0.002
    probe_s: float = 5.0  # a suspected replica's health check and probe call must answer within it

    def __post_init__(self) -> None:
        if not (0 < self.floor_s <= self.ceiling_s and self.multiple >= 0 and self.prefill_s_per_token >= 0):
            raise ValueError(
                "hang detection wants 0 < floor <= ceiling, multiple >= 0 and prefill per token >= 0, got "
                f"floor {self.floor_s:g}, ceiling {self.ceiling_s:g}, multiple {self.multiple:g}, "
                f"prefill per token {self.prefill_s_per_token:g}"
            )
        if self.probe_s <= 0:
            raise ValueError(f"the hang probe's timeout must be > 0, got {self.probe_s:g}")

    @property
    def enabled(self) -> bool:
        return self.multiple > 0


# flag -> HangConfig field
_HANG_FLAGS = {
    "--hang-floor": ("floor_s", "seconds a call to a replica may take before it is suspected hung, at least"),
    "--hang-multiple": ("multiple", "a call's deadline: this many times the replica's recent p99 (0 = no detection)"),
    "--hang-ceiling": ("ceiling_s", "seconds a call may take before its replica is suspected hung, at most"),
    "--hang-prefill-per-token": ("prefill_s_per_token", "seconds added to the deadline per prompt token prefilling"),
    "--hang-probe-timeout": ("probe_s", "seconds a suspected replica gets to answer its health check and probe"),
}


def add_hang_flags(parser) -> None:
    """Hung-replica detection (`python -m orchestrator`, `specd up`)."""
    g = parser.add_argument_group("hung-replica detection (docs/operations.md#hung-replicas)")
    defaults = HangConfig()
    for name, (attr, help_) in _HANG_FLAGS.items():
        g.add_argument(name, type=float, metavar="X", help=f"{help_} (default {getattr(defaults, attr):g})")


def hang_config_from_args(args) -> HangConfig:
    given = {attr: v for name, (attr, _) in _HANG_FLAGS.items() if (v := getattr(args, _dest(name), None)) is not None}
    return HangConfig(**given)


def _dest(flag_name: str) -> str:
    return flag_name.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class OrchestratorConfig:
    # the verifier's model dir (tokenizer + context length)
    # (`python -m orchestrator` resolves a repo id to its Hugging Face cache directory)
    target_dir: str = field(
        metadata=flag("target model dir or repo id (tokenizer, context length)", name="--target", required=True)
    )
    # None: no drafter, speculation off
    drafter_dir: str | None = field(default=None, metadata=flag("drafter model dir or repo id", name="--drafter"))
    # Loopback: this machine only. Another address needs credentials (tokens or
    # mutual TLS) or `insecure` (specd_core/net/exposure.py checks at start).
    host: str = field(default="127.0.0.1", metadata=flag(HOST_HELP))
    insecure: bool = field(default=False, metadata=flag(INSECURE_HELP, action="store_true"))
    port: int = field(default=50051, metadata=flag())  # public Generate port; 0 = any free port
    # The OpenAI-compatible HTTP API (docs/http.md) on the same host: 0 = off,
    # -1 = any free port (tests, where several orchestrators run at once).
    http_port: int = field(default=8000, metadata=flag(HTTP_PORT_HELP))
    # the HTTP API's model name; None = the target directory's name
    served_model_name: str | None = field(default=None, metadata=flag(SERVED_MODEL_NAME_HELP))
    # named verifier-0, verifier-1, ...
    verifier_addresses: list[str] = field(
        default_factory=list, metadata=flag(name="--verifier-address", action="append", required=True)
    )
    # named drafter-0, ...
    drafter_addresses: list[str] = field(default_factory=list, metadata=flag(name="--drafter-address", action="append"))
    # named replicas (Ray deployments)
    replicas: list[ReplicaSpec] = field(default_factory=list, metadata=not_flag(ON_RAY))
    # per pool, optional
    autoscale: dict[str, AutoscalePolicy] = field(
        default_factory=dict, metadata=not_flag("on Ray only: `specd up --autoscale-verifiers/--autoscale-drafters`")
    )
    max_replicas: int = field(default=64, metadata=not_flag(FIXED))  # per pool, for `specd scale`
    default_max_new_tokens: int = field(default=128, metadata=not_flag(FIXED))  # when a request leaves it unset
    max_new_tokens_limit: int = field(default=4096, metadata=not_flag(FIXED))  # requests above it: INVALID_ARGUMENT
    # Method, K, tree, ngram settings and the limits requests cannot exceed.
    speculative: SpeculativeConfig = field(
        default_factory=SpeculativeConfig, metadata=flag_group(add_speculative_flags, speculative_config_from_args)
    )
    rpc_timeout_s: float = field(default=60.0, metadata=not_flag(FIXED))  # per internal call
    # Replacements of a lost verifier (and, apart, drafter) per request before
    # it fails (verifier) or goes on without a drafter (orchestrator/fleet/failover.py).
    max_failovers: int = field(default=3, metadata=not_flag(FIXED))
    # Prefix routing (orchestrator/fleet/prefix_routing.py, docs/prefix_caching.md#routing):
    # a new session goes to the replica this orchestrator sent the longest
    # prefix of its prompt to (its KV blocks are likely cached there), unless
    # that replica would then hold more than bound x the least-loaded one's
    # sessions + slack; then to the least-loaded one. Off: by load alone.
    prefix_routing: bool = field(default=True, metadata=flag(PREFIX_ROUTING_HELP, **NO_PREFIX_ROUTING))
    prefix_routing_bound: float = field(default=DEFAULT_PREFIX_ROUTING_BOUND, metadata=flag(PREFIX_ROUTING_BOUND_HELP))
    prefix_routing_slack: int = field(default=DEFAULT_PREFIX_ROUTING_SLACK, metadata=flag(PREFIX_ROUTING_SLACK_HELP))
    # A replica whose call goes unanswered past its deadline is suspected hung:
    # its sessions move as from a lost one (orchestrator/fleet/hang.py).
    hang: HangConfig = field(default_factory=HangConfig, metadata=flag_group(add_hang_flags, hang_config_from_args))
    # TLS for the public server AND the channels to the replicas (the same
    # cert/key/CA; see specd_core.net.security). None = plaintext everywhere.
    tls: TlsConfig | None = field(default=None, metadata=flag_group(add_server_tls_flags, tls_from_args))
    # Bearer tokens for the public API (one per line; $SPECD_AUTH_TOKENS adds
    # more). No file and no env tokens = no authentication.
    auth_tokens_file: str | None = field(default=None, metadata=flag(AUTH_TOKENS_FILE_HELP))
    # per message, every link; over it: RESOURCE_EXHAUSTED
    max_message_bytes: int = field(default=MAX_MESSAGE_BYTES, metadata=flag(MAX_MESSAGE_BYTES_HELP))
    # after SIGTERM: running streams get this long to finish
    shutdown_grace_s: float = field(
        default=30.0, metadata=flag("seconds running streams get to finish after SIGTERM", name="--shutdown-grace")
    )
    # Generate streams at once; past it a new one is RESOURCE_EXHAUSTED at once
    # (admission control: each stream holds sessions and a slot in every forward).
    # With several orchestrators this is its share of the deployment's limit,
    # `admission_total` (0: this one alone), which the owner splits anew when
    # their number changes (peers.admission_shares).
    max_active_requests: int = field(
        default=1024, metadata=flag("concurrent Generate streams; past it RESOURCE_EXHAUSTED")
    )
    admission_total: int = field(default=0, metadata=not_flag(ON_RAY))
    # Where this orchestrator's own Prometheus /metrics is served (host:port),
    # reported by Status; "" when unknown (`specd up` sets it).
    metrics_address: str = field(default="", metadata=not_flag("known once served (--metrics-port)"))
    # Orchestrators of one deployment serve one address: each binds the gRPC and
    # HTTP ports with SO_REUSEPORT and the kernel spreads new connections over
    # them (docs/operations.md#several-orchestrators-one-address). "": alone (a port in use
    # fails the start); "first": the group's first, which checks that the ports
    # are free (so an unrelated server is never joined) and binds them so that
    # others can; "join": binds the ports the group's first holds.
    share_ports: str = field(
        default="",
        metadata=flag(
            "serve --port and --http-port together with other orchestrators of this deployment "
            "(SO_REUSEPORT: the kernel spreads connections over them): first = the group's first, "
            "which checks the ports are free; join = one more on the ports the first holds",
            choices=["first", "join"],
        ),
    )
    # Several orchestrators of one deployment (on Ray; orchestrator/fleet/peers.py):
    # the first (index 0) scales the pools, the others follow its replica list.
    name: str = field(default="orchestrator", metadata=not_flag(ON_RAY))  # as Status lists it (its actor's name)
    index: int = field(default=0, metadata=not_flag(ON_RAY))
    node: str = field(default="", metadata=not_flag(ON_RAY))  # where it runs (the Ray node), for Status
    public_host: str = field(default="", metadata=not_flag(ON_RAY))  # the host Status reports it at ("": `host`)
    # Prometheus file_sd JSON listing every /metrics endpoint of the deployment,
    # rewritten on every pool change (specd_core/telemetry/discovery.py); None = none.
    metrics_targets_file: str | None = field(
        default=None, metadata=not_flag("on Ray only: `specd up --metrics-targets-file`")
    )

    def __post_init__(self) -> None:
        if not (self.prefix_routing_bound >= 0 and self.prefix_routing_slack >= 0):
            raise ValueError(
                f"prefix routing wants --prefix-routing-bound >= 0 and --prefix-routing-slack >= 0, got "
                f"{self.prefix_routing_bound:g} and {self.prefix_routing_slack}"
            )
