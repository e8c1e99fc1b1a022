"""Placing the system on Ray: model-service replicas and the orchestrator as
detached, named actors, each serving gRPC on its node.

Ray places and supervises the replicas (custom resources `drafter` / `verifier`
put each replica in its pool, so the two pools can be different node types);
the per-cycle hot path is gRPC between the services, never Ray calls. The
orchestrator actor holds a `RayLauncher`, so it can start and stop replicas
itself when asked to scale (`specd scale`, or its autoscaling policy).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from drafter_svc.config import DrafterConfig
from orchestrator.config import OrchestratorConfig, ReplicaSpec
from orchestrator.fleet.peers import OrchestratorReport, PoolView
from orchestrator.fleet.scaling import ReplicaGone
from specd import ray_cluster
from specd.deploy_config import NOT_FOR_REPLICAS, DeploymentConfig, shared_fields
from specd_core.net.auth import TOKENS_ENV
from specd_core.net.grpc_util import prefer_latency
from specd_core.runtime.attention_backends import ENV as ATTENTION_ENV
from specd_core.runtime.attention_backends import FOLD_ENV, KEY_BUCKET_ENV
from specd_core.runtime.head_formats import PUBLISHED, head_format
from specd_core.runtime.hub import resolve_model
from specd_core.runtime.step_graphs import ENV as GRAPHS_ENV
from specd_core.telemetry import metrics, tracing
from verifier_svc.config import VerifierConfig

log = logging.getLogger(__name__)
NAMESPACE = "specd"
ORCHESTRATOR_NAME = "specd-orchestrator"
# Starts the one-line cause an actor's failed start hands back (`startup_error`).
STARTUP_MARK = "specd startup failed: "


class DeployError(RuntimeError):
    """An actor failed to start (its cause in one line), or did not in time."""


class StartupFailed(RuntimeError):
    """Raised by an actor's __init__ in place of what stopped its start: the
    message is that error in one line, after STARTUP_MARK."""


def one_line(exc: BaseException, limit: int = 400) -> str:
    """`Type: message` on one line (a multi-line message joined), at most `limit` characters."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _starting():
    """Context for an actor's __init__: whatever stops it comes back to the
    deployer as StartupFailed, the error in one line. Ray hands the
    deployer an actor's creation error only as text (the remote traceback,
    inside RayActorError's message); the mark lets `startup_error` find the
    cause in it, rather than print a traceback wall."""

    @contextlib.contextmanager
    def guard():
        try:
            yield
        except Exception as exc:
            raise StartupFailed(STARTUP_MARK + one_line(exc)) from None

    return guard()


def startup_error(exc: BaseException) -> str:
    """The cause of an actor's failed start, from the RayActorError a call on
    it raised: the line `_starting` marked, else the error's last line (a
    process that died without raising, e.g. killed for memory)."""
    text = str(exc)
    at = text.rfind(STARTUP_MARK)
    if at >= 0:
        return text[at + len(STARTUP_MARK) :].splitlines()[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


@ray.remote(num_cpus=0)
class ModelServiceActor:
    """One drafter or verifier replica: loads its model, serves gRPC on this node."""

    def __init__(self, kind: str, config_fields: dict, metrics_port: int = 0):
        with _starting():
            self._start(kind, config_fields)
            # The service registered its metrics (its servicer); serve them here.
            self._metrics_port = metrics.serve(metrics_port, self.bound_host)

    def _start(self, kind: str, config_fields: dict) -> None:
        logging.basicConfig(level=logging.INFO)
        tracing.setup(kind)  # only if OTEL_EXPORTER_OTLP_*ENDPOINT is set
        prefer_latency()
        # The services default to loopback, which the orchestrator on another
        # node could not reach: bind this node's IP unless told otherwise.
        config_fields = dict(config_fields, host=config_fields.get("host") or ray.util.get_node_ip_address())
        # A repo id resolves here, into this node's cache (checked on the head before deploying).
        resolved = resolve_model(config_fields["model_dir"], allow_pickle=config_fields["allow_pickle_weights"])
        config_fields["model_dir"] = resolved.path
        if config_fields.get("target_dir"):  # a head's target, resolved here too
            config_fields["target_dir"] = resolve_model(
                config_fields["target_dir"], allow_pickle=config_fields["allow_pickle_weights"]
            ).path
        config: VerifierConfig | DrafterConfig
        if kind == "verifier":
            from verifier_svc.core import Verifier
            from verifier_svc.server import start as start_verifier

            config = VerifierConfig(**config_fields)
            verifier = Verifier(config)
            self.server, self.port = start_verifier(config, verifier)
            self._info = verifier.info
        else:
            from drafter_svc.eagle import make_drafter
            from drafter_svc.server import start as start_drafter

            config = DrafterConfig(**config_fields)
            drafter = make_drafter(config)
            self.server, self.port = start_drafter(config, drafter)
            self._info = drafter.info
        # The address the orchestrator dials: the bound host, or this node's IP
        # when bound to every interface.
        self.bound_host = config.host
        self.host = dial_host(config.host)

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def metrics_address(self) -> str:
        """Its Prometheus /metrics endpoint (host:port)."""
        return f"{self.host}:{self._metrics_port}"

    def node(self) -> str:
        """The Ray node id: several nodes may share one IP (tests, big hosts)."""
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        """Its process (tests kill it to check the restart)."""
        return os.getpid()

    def info(self) -> dict:
        """Its engine, model, dtype and KV budget (the service's Info)."""
        return self._info()


def dial_host(bound: str) -> str:
    """The address others reach a server bound to `bound` at: this node's IP
    when it is bound to every interface."""
    return ray.util.get_node_ip_address() if bound in ("0.0.0.0", "::", "") else bound


def orchestrator_name(index: int) -> str:
    """The first orchestrator keeps the name a deployment of one always had."""
    return ORCHESTRATOR_NAME if index == 0 else f"{ORCHESTRATOR_NAME}-{index}"


def _is_orchestrator(name: str) -> bool:
    return name == ORCHESTRATOR_NAME or re.fullmatch(rf"{ORCHESTRATOR_NAME}-\d+", name) is not None


async def _on_loop(fn, *args):
    return fn(*args)


# Threads serving an orchestrator actor's Ray calls (`max_concurrency`): a
# peer's report or a new replica list must get through while a long call (a
# Scale, a drain) waits on another.
ORCHESTRATOR_CONCURRENCY = 16


@ray.remote(num_cpus=0)
class OrchestratorActor:
    """One orchestrator of the deployment (orchestrator/fleet/peers.py): the
    first (index 0) scales the pools and the number of orchestrators; every
    one serves the deployment's one address (SO_REUSEPORT). Its Ray methods
    are how the others reach it; each runs on the server's event loop.

    Ray restarts it when its process dies (DeploymentConfig.orchestrator_max_restarts),
    with the arguments it was created with: its ports are fixed numbers by
    then (`fixed_ports`), so it serves the same address again. The restarted
    process is a new session owner (orchestrator/fleet/keepalive.py): the
    replicas close the dead one's sessions within their owner_timeout_s."""

    def __init__(self, config: OrchestratorConfig, deployment: DeploymentConfig, view: PoolView | None = None):
        from orchestrator.edge.server import BackgroundServer

        with _starting():
            logging.basicConfig(level=logging.INFO)
            tracing.setup("orchestrator")
            prefer_latency()
            node_ip = ray.util.get_node_ip_address()
            self.host = dial_host(config.host)  # where clients reach Generate and the HTTP API
            context = ray.get_runtime_context()
            name = orchestrator_name(config.index)
            # A first orchestrator restarted by Ray finds its port held by the
            # others: it joins them (the check that the port is free was made
            # when the deployment started).
            share = "join" if config.index > 0 or context.was_current_actor_reconstructed else "first"
            # Served before the core starts: it reports the address (Status, the targets file).
            self._metrics = f"{node_ip}:{metrics.serve(deployment.metrics_port, node_ip)}"
            config = dataclasses.replace(
                config,
                name=name,
                node=context.get_node_id(),
                public_host=self.host,
                share_ports=share,
                metrics_address=self._metrics,
            )
            self.peers = RayPeers(deployment, name, context.get_node_id())
            launcher = RayLauncher(deployment) if config.index == 0 else None
            self.server = BackgroundServer(config, launcher, self.peers)
            http = self.server.serving.http
            # What a new orchestrator is given: these ports, to join.
            self.peers.template = dataclasses.replace(
                config,
                port=self.server.port,
                http_port=http.port if http else 0,
                share_ports="join",
                metrics_targets_file=None,  # the first one writes it
                verifier_addresses=[],
                drafter_addresses=[],
            )
            if view is not None:  # a follower: the owner's list as it is now
                self.server.call(self.server.serving.core.follow(view, config.max_active_requests))

    def address(self) -> str:
        return f"{self.host}:{self.server.port}"

    def report(self) -> OrchestratorReport:
        """How it stands (peers' Status, the owner's tick)."""
        return self.server.call(_on_loop(self.server.serving.core.report))

    def follow(self, view: PoolView, max_active_requests: int) -> None:
        """The owner's replica list and this one's share of the admission limit."""
        self.server.call(self.server.serving.core.follow(view, max_active_requests))

    def scale(self, counts: dict) -> None:
        """A Scale another orchestrator received (this is the first one)."""
        self.server.call(self.server.serving.core.scale(counts))

    def retire(self) -> None:
        """Stop listening, let the running streams end, stop (scaled down)."""
        self.server.call(self.server.serving.retire())

    def metrics_address(self) -> str:
        """Its Prometheus /metrics endpoint (host:port)."""
        return self._metrics

    def http_address(self) -> str:
        """The HTTP API's base URL, scheme://host:port ('' = off)."""
        http = self.server.serving.http
        return f"{http.scheme}://{self.host}:{http.port}" if http else ""


def _actor_env(extra_env: tuple[str, ...] = ()) -> dict:
    """The deploying shell's OTEL_* settings, its metrics token (and the named variables) for the
    actors: workers of an attached cluster do not inherit this process's
    environment. Nothing when none is set, so untraced deployments are unchanged."""
    passed = (*extra_env, metrics.METRICS_TOKEN_ENV)
    env = {k: v for k, v in os.environ.items() if k.startswith("OTEL_") or k in passed}
    return {"runtime_env": {"env_vars": env}} if env else {}


def _published(cfg: DeploymentConfig) -> bool:
    return head_format(cfg.drafter_dir) in PUBLISHED


def replica_fields(cfg: DeploymentConfig, kind: str) -> dict:
    """The replica's service config fields: those it shares with the
    deployment by name, its model, any free port, and its host (None: the
    actor's node IP)."""
    config_cls = VerifierConfig if kind == "verifier" else DrafterConfig
    return {
        **shared_fields(cfg, config_cls, exclude=NOT_FOR_REPLICAS),
        # A repo id pinned to its commit, resolved on the replica's node; else the directory.
        "model_dir": (cfg.target_model or cfg.target_dir)
        if kind == "verifier"
        else (cfg.drafter_model or cfg.drafter_dir),
        # A published head names no target (specd's own names its own): it is
        # given the deployment's, whose embedding (and LM head) it shares.
        **({"target_dir": cfg.target_model or cfg.target_dir} if kind == "drafter" and _published(cfg) else {}),
        "host": cfg.replica_host,
        "port": 0,
    }


def orchestrator_config(cfg: DeploymentConfig, replicas: list[ReplicaSpec]) -> OrchestratorConfig:
    """The first orchestrator's config: the fields it shares with the deployment
    by name, the replicas started, and the deployment's admission limit (its
    share of which the first one then hands out)."""
    return OrchestratorConfig(
        **shared_fields(cfg, OrchestratorConfig),
        replicas=replicas,
        admission_total=cfg.max_active_requests,
    )


def fixed_ports(config: OrchestratorConfig) -> OrchestratorConfig:
    """The config with "any free port" (gRPC 0, HTTP -1) replaced by free
    ports chosen now. Ray restarts a dead orchestrator with the arguments it
    was created with, and the restarted one must serve the address clients
    were given. Called on the node the first orchestrator is pinned to (the
    one running `specd up`); the actor checks again that they are free."""
    from orchestrator.edge.server import address_family

    wanted = (config.port == 0) + (config.http_port < 0)
    free = ray_cluster.free_ports(wanted, config.host, address_family(config.host))  # two different ports
    port = free.pop(0) if config.port == 0 else config.port
    http_port = free.pop(0) if config.http_port < 0 else config.http_port
    return dataclasses.replace(config, port=port, http_port=http_port)


def _replica(cfg: DeploymentConfig, kind: str, name: str):
    """One replica actor, asking for one unit of its pool's resource."""
    resource = cfg.verifier_resource if kind == "verifier" else cfg.drafter_resource
    # Restarted with the same arguments after its process dies; its new server
    # listens on a new port, which the orchestrator asks for (RayLauncher.locate).
    # At run time @ray.remote made the class an ActorClass (with .options);
    # mypy keeps a decorated class's own type: a class decorator cannot change it.
    return ModelServiceActor.options(  # type: ignore[attr-defined]
        name=name,
        namespace=NAMESPACE,
        lifetime="detached",
        max_restarts=cfg.replica_max_restarts,
        resources={resource: 1},
        num_gpus=cfg.replica_gpus,
        **_actor_env((ATTENTION_ENV, KEY_BUCKET_ENV, FOLD_ENV, GRAPHS_ENV)),
    ).remote(kind, replica_fields(cfg, kind), cfg.metrics_port)


def _not_ready(cfg: DeploymentConfig, kind: str) -> TimeoutError:
    resource = cfg.verifier_resource if kind == "verifier" else cfg.drafter_resource
    return TimeoutError(
        f"{kind} replica not serving after {cfg.ready_timeout_s}s: does the cluster have "
        f"(or can its autoscaler add) a node with free '{resource}' resource"
        + (f" and {cfg.replica_gpus} GPU" if cfg.replica_gpus else "")
        + "?"
    )


class RayLauncher:
    """Starts replicas as detached Ray actors and kills them when handed back
    (orchestrator.scaling.Launcher). Runs inside the orchestrator actor."""

    def __init__(self, cfg: DeploymentConfig):
        self.cfg = cfg
        # Names in use (the first replicas, started by deploy()) are skipped.
        self._taken = {
            info["name"] for info in ray.util.list_named_actors(all_namespaces=True) if info["namespace"] == NAMESPACE
        }

    def _new_name(self, kind: str) -> str:
        i = 0
        while f"specd-{kind}-{i}" in self._taken:
            i += 1
        name = f"specd-{kind}-{i}"
        self._taken.add(name)
        return name

    async def start(self, kind: str) -> ReplicaSpec:
        name = self._new_name(kind)
        actor = _replica(self.cfg, kind, name)
        try:
            address, node, metrics_address = await asyncio.wait_for(_where(actor), self.cfg.ready_timeout_s)
        except asyncio.TimeoutError:
            ray.kill(actor, no_restart=True)  # do not leave a pending actor behind
            raise _not_ready(self.cfg, kind) from None
        except ray.exceptions.RayActorError as exc:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise DeployError(
                f"{kind} replica {name} ({replica_fields(self.cfg, kind)['model_dir']}) failed to start: "
                f"{startup_error(exc)}"
            ) from None
        for line in fallback_warnings([(kind, name, await _wait(actor.info.remote()))]):
            log.warning(line)
        return ReplicaSpec(kind, name, address, node, metrics_address)

    async def stop(self, spec: ReplicaSpec) -> None:
        # Off the event loop: ray.get_actor asks the cluster's control store and
        # can block for seconds on a busy machine, which would stall every
        # stream and RPC this orchestrator serves meanwhile.
        await asyncio.to_thread(_kill, spec.name)

    async def locate(self, spec: ReplicaSpec) -> ReplicaSpec | None:
        """Ask a lost replica's actor where it serves: Ray restarts a dead actor
        (max_restarts) and the new server has a new port. A call to a restarting
        actor waits for it; a short wait here keeps the scaler's tick short, the
        next tick asks again."""
        try:
            actor = await asyncio.to_thread(ray.get_actor, spec.name, namespace=NAMESPACE)  # blocks: see stop
        except ValueError:
            raise ReplicaGone(f"no actor named {spec.name}") from None
        try:
            address, node, metrics_address = await asyncio.wait_for(_where(actor), self.cfg.locate_timeout_s)
        except asyncio.TimeoutError:
            return None
        except ray.exceptions.ActorDiedError as exc:  # out of restarts (or killed for good)
            raise ReplicaGone(str(exc)) from None
        except ray.exceptions.RayActorError:  # restarting, unreachable for now
            return None
        return ReplicaSpec(spec.kind, spec.name, address, node, metrics_address)


def _wait(ref):
    return asyncio.wrap_future(ref.future())


class RayPeers:
    """The other orchestrators of the deployment, as named Ray actors
    (orchestrator/fleet/peers.py: Peers). Runs inside an orchestrator actor."""

    def __init__(self, cfg: DeploymentConfig, own_name: str, node_id: str, report_timeout_s: float = 2.0):
        self.cfg, self.own, self.node_id = cfg, own_name, node_id
        self.report_timeout_s = report_timeout_s
        self.template: OrchestratorConfig | None = None  # a new orchestrator's config, less its index
        self._handles: dict[str, Any] = {}
        self._listing: asyncio.Future | None = None  # the named actors being listed (one call at a time)
        self._listed: list[str] = []  # the other orchestrators as last listed

    def _handle(self, name: str):
        if name not in self._handles:
            self._handles[name] = ray.get_actor(name, namespace=NAMESPACE)
        return self._handles[name]

    async def reports(self) -> dict[str, OrchestratorReport | None]:
        """Every other orchestrator's report, None for one that did not answer.
        Bounded in time: Status waits on it, and Ray's control plane can be
        slow for seconds while actors come and go (then the orchestrators
        listed last are asked)."""
        names = await self._others()

        async def report(name: str) -> OrchestratorReport | None:
            try:
                return await asyncio.wait_for(self._report(name), self.report_timeout_s)
            except Exception:  # noqa: BLE001 - starting, restarting or gone: no answer this time
                self._handles.pop(name, None)  # a new actor may take the name
                return None

        return dict(zip(names, await asyncio.gather(*(report(n) for n in names))))

    async def _others(self) -> list[str]:
        if self._listing is None or self._listing.done():
            self._listing = asyncio.ensure_future(asyncio.to_thread(_named_actors))
            self._listing.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, never raised
        try:
            listed = await asyncio.wait_for(asyncio.shield(self._listing), self.report_timeout_s)
        except Exception:  # noqa: BLE001 - slow or failing: the last list stands
            return self._listed
        self._listed = sorted(n for n in listed if _is_orchestrator(n) and n != self.own)
        return self._listed

    async def _report(self, name: str) -> OrchestratorReport:
        handle = await asyncio.to_thread(self._handle, name)  # ray.get_actor blocks: not on the event loop
        return await _wait(handle.report.remote())

    async def follow(self, name: str, view: PoolView, max_active_requests: int) -> None:
        await asyncio.wait_for(_wait(self._handle(name).follow.remote(view, max_active_requests)), 30)

    async def scale(self, counts: dict[str, int]) -> None:
        try:
            await _wait(self._handle(ORCHESTRATOR_NAME).scale.remote(counts))
        except ray.exceptions.RayTaskError as exc:  # the owner's own error (InvalidRequest, TimeoutError, ...)
            cause = getattr(exc, "cause", None)
            raise (cause if isinstance(cause, Exception) else exc) from None

    async def start(self, index: int, view: PoolView, max_active_requests: int) -> None:
        assert self.template is not None, "set once this orchestrator serves"
        name = orchestrator_name(index)
        config = dataclasses.replace(
            self.template,
            index=index,
            max_active_requests=max_active_requests,
            replicas=[e.spec for e in view.replicas],
        )
        # Beside this one, on the node clients reach (the ports are this node's).
        actor = OrchestratorActor.options(  # type: ignore[attr-defined]  # an ActorClass at run time (see _replica)
            name=name,
            namespace=NAMESPACE,
            lifetime="detached",
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False),
            max_concurrency=ORCHESTRATOR_CONCURRENCY,
            max_restarts=self.cfg.orchestrator_max_restarts,
            **_actor_env((TOKENS_ENV,)),
        ).remote(config, self.cfg, view)
        try:
            await asyncio.wait_for(_wait(actor.address.remote()), self.cfg.ready_timeout_s)
        except Exception as exc:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            if isinstance(exc, ray.exceptions.RayActorError):
                raise DeployError(f"orchestrator {name} failed to start: {startup_error(exc)}") from None
            if isinstance(exc, asyncio.TimeoutError):
                raise TimeoutError(f"orchestrator {name} did not serve within {self.cfg.ready_timeout_s}s") from None
            raise
        log.info("orchestrator %s serving", name)

    async def retire(self, name: str) -> None:
        actor = self._handle(name)
        try:
            await _wait(actor.retire.remote())
        finally:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            self._handles.pop(name, None)


def _where(actor):
    """(gRPC address, node, metrics address) of a replica actor, once it serves."""
    return asyncio.gather(
        _wait(actor.address.remote()), _wait(actor.node.remote()), _wait(actor.metrics_address.remote())
    )


def _named_actors() -> set[str]:
    return {info["name"] for info in ray.util.list_named_actors(all_namespaces=True) if info["namespace"] == NAMESPACE}


def fallback_warnings(infos: list[tuple[str, str, dict]]) -> list[str]:
    """A warning per replica (kind, name, its info) that runs the Hugging Face
    fallback engine: it serves correctly but slower than the lean forward."""
    return [
        f"warning: {kind} replica {name} runs the Hugging Face fallback engine (hf) for model type "
        f"{info.get('model_type') or '?'} ({info.get('architecture') or '?'}): slower than the lean "
        "engine; docs/models.md lists the models the lean engine supports"
        for kind, name, info in infos
        if info.get("engine") == "hf"
    ]


def deploy(cfg: DeploymentConfig, warn: Callable[[str], None] | None = None) -> str:
    """Start replicas and the orchestrator; return the public Generate address.
    warn: told a line per replica on the Hugging Face fallback engine.

    Assumes ray.init() was called. Replicas ask for their pool's resource, so on
    a cluster without it they stay pending (the timeout says which). When
    anything fails to start, every actor this call started is killed (on an
    attached cluster nothing of the failed deployment stays) and DeployError
    (or the TimeoutError) says what failed, with the actor's own error."""
    before = _named_actors()
    handles: list = []
    try:
        return _deploy(cfg, handles, warn)
    except BaseException:
        # Its handles, and any replica its orchestrator had launched by name.
        for actor in handles:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            for name in _named_actors() - before:
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        raise


def _ready(refs: list, timeout_s: float, what: str, not_ready: Exception) -> list:
    """ray.get of an actor's first calls: its results, or the reason it did not start."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise not_ready from None
    except ray.exceptions.RayActorError as exc:
        raise DeployError(f"{what} failed to start: {startup_error(exc)}") from None


def _deploy(cfg: DeploymentConfig, handles: list, warn: Callable[[str], None] | None) -> str:
    specs = _start_replicas(cfg, handles, warn)
    # Pinned to the node that runs `specd up` (the head, in deploy/cluster.yaml):
    # an actor asking for no resources could land anywhere, and clients are told
    # to reach Generate on the head.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    orch = OrchestratorActor.options(  # type: ignore[attr-defined]  # an ActorClass at run time (see _replica)
        name=ORCHESTRATOR_NAME,
        namespace=NAMESPACE,
        lifetime="detached",
        scheduling_strategy=here,
        max_concurrency=ORCHESTRATOR_CONCURRENCY,
        max_restarts=cfg.orchestrator_max_restarts,
        **_actor_env((TOKENS_ENV,)),
    ).remote(fixed_ports(orchestrator_config(cfg, specs)), cfg)
    handles.append(orch)
    not_ready = TimeoutError(f"the orchestrator did not start within {cfg.ready_timeout_s}s")
    address = _ready([orch.address.remote()], cfg.ready_timeout_s, "the orchestrator", not_ready)[0]
    if cfg.num_orchestrators > 1:
        _start_other_orchestrators(cfg, orch)
    return address


def _start_replicas(cfg: DeploymentConfig, handles: list, warn: Callable[[str], None] | None) -> list[ReplicaSpec]:
    """The first replicas of each pool (their handles appended to `handles`),
    once all serve; a warning per replica on the fallback engine."""
    actors = [("verifier", f"specd-verifier-{i}") for i in range(cfg.num_verifiers)]
    actors += [("drafter", f"specd-drafter-{i}") for i in range(cfg.num_drafters if cfg.drafter_dir else 0)]
    for kind, name in actors:
        handles.append(_replica(cfg, kind, name))
    specs, infos = [], []
    for (kind, name), actor in zip(actors, handles):
        address, node, info, metrics_address = _ready(
            [actor.address.remote(), actor.node.remote(), actor.info.remote(), actor.metrics_address.remote()],
            cfg.ready_timeout_s,
            f"{kind} replica {name} ({replica_fields(cfg, kind)['model_dir']})",
            _not_ready(cfg, kind),
        )
        specs.append(ReplicaSpec(kind, name, address, node, metrics_address))
        infos.append((kind, name, info))
    if warn is not None:
        for line in fallback_warnings(infos):
            warn(line)
    return specs


def _start_other_orchestrators(cfg: DeploymentConfig, first) -> None:
    """The first orchestrator starts the others (on its ports) as for `specd scale`."""
    not_ready = TimeoutError(f"the orchestrators did not start within {cfg.ready_timeout_s}s")
    try:
        _ready(
            [first.scale.remote({"orchestrator": cfg.num_orchestrators})],
            2 * cfg.ready_timeout_s,
            "the orchestrators",
            not_ready,
        )
    except ray.exceptions.RayTaskError as exc:
        raise DeployError(f"the orchestrators failed to start: {one_line(getattr(exc, 'cause', exc))}") from None


def orchestrator_http_address(timeout_s: float = 30.0) -> str:
    """The deployed orchestrator's HTTP API base URL ('' = off)."""
    actor = ray.get_actor(ORCHESTRATOR_NAME, namespace=NAMESPACE)
    return str(ray.get(actor.http_address.remote(), timeout=timeout_s))


def teardown() -> list[str]:
    """Kill every specd actor in the namespace; return their names."""
    killed = []
    for info in ray.util.list_named_actors(all_namespaces=True):
        if info["namespace"] == NAMESPACE and info["name"].startswith("specd-"):
            ray.kill(ray.get_actor(info["name"], namespace=NAMESPACE), no_restart=True)
            killed.append(info["name"])
    return killed


def _kill(name: str) -> None:
    """Kill a replica's actor for good (nothing when it is gone already)."""
    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
