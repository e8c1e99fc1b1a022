"""The deployment `specd up` places on Ray (specd/ray_deploy.py deploys it).

Each field's metadata is its `specd up` flag, or why it has none
(specd_core/net/flags.py); the CLI builds the config from the parsed flags by
the same fields. The orchestrator's and the replicas' configs take the fields
they share with it by name (`shared_fields`). Imports no Ray: the CLI builds
its parser from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from orchestrator.config import (
    AUTH_TOKENS_FILE_HELP,
    DEFAULT_PREFIX_ROUTING_BOUND,
    DEFAULT_PREFIX_ROUTING_SLACK,
    HOST_HELP,
    HTTP_PORT_HELP,
    INSECURE_HELP,
    MAX_MESSAGE_BYTES_HELP,
    NO_PREFIX_ROUTING,
    PREFIX_ROUTING_BOUND_HELP,
    PREFIX_ROUTING_HELP,
    PREFIX_ROUTING_SLACK_HELP,
    SERVED_MODEL_NAME_HELP,
    AutoscalePolicy,
    HangConfig,
    add_hang_flags,
    hang_config_from_args,
)
from orchestrator.spec_config import SpeculativeConfig, add_speculative_flags, speculative_config_from_args
from specd.demo import DEMO_TARGET
from specd_core.net.flags import flag, flag_group, not_flag
from specd_core.net.grpc_util import MAX_MESSAGE_BYTES
from specd_core.net.security import TlsConfig, tls_from_args
from specd_core.net.service_config import DTYPES, ENGINES, add_server_tls_flags
from specd_core.runtime.hub import PICKLE_HINT

TARGETS_FILE_NAME = "prometheus_targets.json"  # in $SPECD_HOME unless --metrics-targets-file
FIXED = "fixed: no flag sets it"
RESOLVED = "set by `specd up` from --target / --drafter (a repo id at the commit it resolved to)"


def add_autoscale_flags(p) -> None:
    p.add_argument(
        "--autoscale-verifiers",
        metavar="MIN:MAX:TARGET",
        help="autoscale the verifier pool: about TARGET sessions per replica, MIN..MAX replicas",
    )
    p.add_argument("--autoscale-drafters", metavar="MIN:MAX:TARGET", help="autoscale the drafter pool likewise")


def autoscale_from_args(args) -> dict[str, AutoscalePolicy]:
    """The pools' policies (ValueError naming a bad one)."""
    return {
        kind: AutoscalePolicy.parse(text)
        for kind, text in (("verifier", args.autoscale_verifiers), ("drafter", args.autoscale_drafters))
        if text
    }


@dataclass(frozen=True)
class DeploymentConfig:
    # Directories, or Hugging Face repo ids that `specd up` resolves on this
    # node into the Hugging Face cache (specd_core/runtime/hub.py).
    target_dir: str = field(
        metadata=flag(
            "target model: a dir or a Hugging Face repo id (default: the demo)",
            name="--target",
            default=str(DEMO_TARGET),
        )
    )
    drafter_dir: str | None = field(
        metadata=flag(
            "drafter model: a dir or a Hugging Face repo id (default: the config's `model`, else the demo drafter; "
            "'' = none)",
            name="--drafter",
        )
    )
    target_revision: str | None = field(
        default=None, metadata=flag("with a repo id --target: a branch, tag or commit (or org/name@rev)")
    )
    drafter_revision: str | None = field(
        default=None, metadata=flag("with a repo id --drafter: a branch, tag or commit")
    )
    # The replicas' models as each node resolves them into its own Hugging
    # Face cache (`org/name@commit`); "": the directories above, which must
    # then exist on every node.
    target_model: str = field(default="", metadata=not_flag(RESOLVED))
    drafter_model: str = field(default="", metadata=not_flag(RESOLVED))
    # Load .bin/.pt weights where a model has no safetensors (every replica).
    allow_pickle_weights: bool = field(
        default=False, metadata=flag(f"models without safetensors: {PICKLE_HINT}", action="store_true")
    )
    # Where Generate and the HTTP API listen on the orchestrator's node:
    # loopback unless given; another address needs credentials or `insecure`
    # (specd_core/net/exposure.py, checked by `specd up`).
    host: str = field(default="127.0.0.1", metadata=flag(HOST_HELP))
    insecure: bool = field(default=False, metadata=flag(INSECURE_HELP, action="store_true"))
    num_verifiers: int = field(default=1, metadata=flag("verifier replicas", name="--verifiers"))
    num_drafters: int = field(default=1, metadata=flag("drafter replicas", name="--drafters"))
    # Orchestrators serving the one address (SO_REUSEPORT), all on the node
    # that runs `specd up`; the first scales the pools (orchestrator/fleet/peers.py).
    num_orchestrators: int = field(
        default=1,
        metadata=flag(
            "orchestrator processes serving the one Generate / HTTP address on this node (SO_REUSEPORT: "
            "the kernel spreads client connections over them; a connection stays on one)",
            name="--orchestrators",
        ),
    )
    # Concurrent Generate streams of the whole deployment, split over the orchestrators.
    max_active_requests: int = field(
        default=1024,
        metadata=flag(
            "concurrent Generate streams of the deployment, split evenly over the orchestrators; "
            "past its share an orchestrator answers RESOURCE_EXHAUSTED"
        ),
    )
    device: str = field(default="auto", metadata=flag("auto | cpu | cuda"))
    dtype: str = field(
        default="default",
        metadata=flag(
            "model weights dtype in every replica "
            "(auto: the checkpoint's own; default: float32 on a CPU, auto on a GPU)",
            choices=DTYPES,
        ),
    )
    engine: str = field(  # every replica
        default="auto",
        metadata=flag("every replica's forward: auto = lean where the model is supported, else hf", choices=ENGINES),
    )
    kv_cache_memory: str = field(  # each replica's KV budget (specd_core/runtime/kv_budget.py)
        default="auto",
        metadata=flag(
            "each replica's KV cache budget: bytes (512MiB, 4GiB) or a fraction in (0, 1] of the "
            "memory free after loading its weights (auto: 0.85 on CUDA, 0.5 on a CPU)"
        ),
    )
    kv_block_size: int = field(default=64, metadata=flag("tokens per block of the KV budget"))
    # Every replica's automatic prefix caching (specd_core/runtime/prefix_cache.py).
    prefix_caching: bool = field(
        default=True,
        metadata=flag(
            "every replica prefills each prompt whole (no reuse of cached KV blocks of identical prompt prefixes)",
            name="--no-prefix-caching",
            action="store_false",
            dest="prefix_caching",
        ),
    )
    # The orchestrators' prefix routing (orchestrator/fleet/prefix_routing.py):
    # a new session to the replica that likely caches its prompt's prefix, within a bound on load.
    prefix_routing: bool = field(default=True, metadata=flag(PREFIX_ROUTING_HELP, **NO_PREFIX_ROUTING))
    prefix_routing_bound: float = field(default=DEFAULT_PREFIX_ROUTING_BOUND, metadata=flag(PREFIX_ROUTING_BOUND_HELP))
    prefix_routing_slack: int = field(default=DEFAULT_PREFIX_ROUTING_SLACK, metadata=flag(PREFIX_ROUTING_SLACK_HELP))
    # Every replica closes the sessions of an orchestrator it has not heard
    # from for this long (one that died; specd_core/runtime/sessions.py).
    owner_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "each replica closes the sessions of an orchestrator not heard from (calls, keep-alives) "
            "for this long (0 = never)"
        ),
    )
    replica_gpus: float = field(default=0.0, metadata=flag("GPUs each replica asks Ray for (1 on GPU pools; 0 = CPU)"))
    autoscale: dict[str, AutoscalePolicy] = field(  # per pool, optional
        default_factory=dict, metadata=flag_group(add_autoscale_flags, autoscale_from_args)
    )
    ready_timeout_s: float = field(  # a replica that does not serve by then is an error
        default=300.0,
        metadata=flag(
            "seconds a replica may take to serve (scaling onto a new GPU node takes minutes)", name="--ready-timeout"
        ),
    )
    # Bearer tokens of the public API (read on the head node).
    auth_tokens_file: str | None = field(default=None, metadata=flag(AUTH_TOKENS_FILE_HELP))
    max_message_bytes: int = field(default=MAX_MESSAGE_BYTES, metadata=flag(MAX_MESSAGE_BYTES_HELP))
    # Where replicas listen: None = their Ray node's IP, the address the
    # orchestrator (possibly on another node) dials; not 0.0.0.0, so a replica
    # is not reachable on interfaces the cluster does not use.
    replica_host: str | None = field(
        default=None, metadata=flag("interface the replicas listen on (default: each one's Ray node IP)")
    )
    # Every actor's Prometheus /metrics port, on its node's address: 0 = any
    # free port (a fixed one fits only one specd actor per node).
    metrics_port: int = field(
        default=0,
        metadata=flag(
            "every actor's Prometheus /metrics port on its node (default 0: any free port; "
            "a fixed port fits only one specd actor per node)"
        ),
    )
    # The Prometheus file_sd JSON the orchestrator keeps up to date (on the node
    # that ran `specd up`); None = none.
    metrics_targets_file: str | None = field(
        default=None,
        metadata=flag(
            "Prometheus file_sd JSON of every /metrics endpoint, kept up to date by the orchestrator "
            f"(default: $SPECD_HOME/{TARGETS_FILE_NAME}, SPECD_HOME defaulting to ~/.specd)",
            metavar="PATH",
        ),
    )
    # TLS on every link: the replicas' servers, the orchestrator's public server
    # and its channels to the replicas. Paths must exist on every node.
    tls: TlsConfig | None = field(default=None, metadata=flag_group(add_server_tls_flags, tls_from_args))
    port: int = field(default=50051, metadata=flag("public Generate port (0 = any free)"))
    # The OpenAI-compatible HTTP API (0 = off; -1 = any free port).
    http_port: int = field(default=8000, metadata=flag(HTTP_PORT_HELP))
    # Its model name (None: the target directory's name).
    served_model_name: str | None = field(default=None, metadata=flag(SERVED_MODEL_NAME_HELP))
    speculative: SpeculativeConfig = field(
        default_factory=SpeculativeConfig, metadata=flag_group(add_speculative_flags, speculative_config_from_args)
    )
    # Hung-replica detection, the orchestrators' (orchestrator/fleet/hang.py).
    hang: HangConfig = field(default_factory=HangConfig, metadata=flag_group(add_hang_flags, hang_config_from_args))
    # Ray custom resources of the pools (deploy/cluster.yaml's node types).
    verifier_resource: str = field(default="verifier", metadata=not_flag("the pool's Ray resource (deploy/)"))
    drafter_resource: str = field(default="drafter", metadata=not_flag("the pool's Ray resource (deploy/)"))
    # Ray restarts a dead replica this often over the deployment's life
    # (then it is gone); -1 = always. Bounded by default so that a replica that
    # dies at every start does not loop for ever.
    replica_max_restarts: int = field(default=3, metadata=flag("times Ray restarts a dead replica (-1 = always)"))
    # Ray restarts a dead orchestrator this often; it serves the same ports again.
    orchestrator_max_restarts: int = field(
        default=3, metadata=flag("times Ray restarts a dead orchestrator (-1 = always)")
    )
    # Per scaler tick, asking a lost replica where it serves.
    locate_timeout_s: float = field(default=2.0, metadata=not_flag(FIXED))


# Fields a deployment shares by name with a replica's config that mean
# something else there: the deployment's public host and port (a replica
# listens on replica_host, any free port) and its target (a drafter's
# target_dir is its EAGLE head's).
NOT_FOR_REPLICAS = ("host", "port", "target_dir")


def shared_fields(cfg: DeploymentConfig, config_cls, exclude: tuple[str, ...] = ()) -> dict:
    """The deployment's values of the fields config_cls has by the same name."""
    names = {f.name for f in dataclasses.fields(config_cls)} - set(exclude)
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name in names}
