"""The fleet one orchestrator runs its sessions on: the verifier and drafter
pools and their clients, failover routing of a session's calls, scaling (the
owner's), the other orchestrators of the deployment (peers), the Prometheus
targets file, and the Status it all reports. The core (orchestrator/core.py)
holds one and asks it for a session's replicas; the edges and the process
around it (Ray) ask it to scale, follow, report."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable

from orchestrator.config import OrchestratorConfig, ReplicaSpec
from orchestrator.fleet.admission import Admission
from orchestrator.fleet.clients import GrpcDrafter, GrpcVerifier, ServiceError
from orchestrator.fleet.discovery import TargetsFile
from orchestrator.fleet.failover import FailoverDrafter, FailoverVerifier
from orchestrator.fleet.keepalive import KeepAlive, session_owner_name
from orchestrator.fleet.peers import Group, OrchestratorReport, Peers, PoolView, follow, merge_status
from orchestrator.fleet.pool import Pool
from orchestrator.fleet.prefix_routing import routing_from
from orchestrator.fleet.recovery import Recovery
from orchestrator.fleet.scaling import Launcher, Scaler

log = logging.getLogger(__name__)
# ReplicaInfo fields (the replica's own report) that Status passes on in ReplicaStatus.
REPLICA_INFO_FIELDS = (
    "model",
    "engine",
    "architecture",
    "model_type",
    "dtype",
    "kv_capacity_tokens",
    "kv_used_tokens",
    "kv_capacity_bytes",
    "kv_used_bytes",
    "prefix_queried_tokens",
    "prefix_hit_tokens",
    "drafting",
    "cuda_graphs",
)
# Status waits this long for a replica's Info: a stuck replica must not stall it.
INFO_TIMEOUT_S = 2.0


class NotScalable(RuntimeError):
    """Scale asked of an orchestrator that has no launcher (FAILED_PRECONDITION)."""


def initial_replicas(config: OrchestratorConfig) -> list[ReplicaSpec]:
    """The replicas the configuration names: at least one verifier."""
    specs = (
        list(config.replicas)
        + [ReplicaSpec("verifier", f"verifier-{i}", a) for i, a in enumerate(config.verifier_addresses)]
        + [ReplicaSpec("drafter", f"drafter-{i}", a) for i, a in enumerate(config.drafter_addresses)]
    )
    if not any(s.kind == "verifier" for s in specs):
        raise ValueError("at least one verifier address is needed")
    return specs


class Fleet:
    def __init__(
        self,
        config: OrchestratorConfig,
        admission: Admission,
        specs: list[ReplicaSpec],
        vocab_size: int,
        on_send: Callable[[str], Callable[[int], None]] | None = None,
        launcher: Launcher | None = None,
        peers: Peers | None = None,
        on_hang: Callable[[str, str], None] | None = None,
    ):
        """specs: the replicas to start with (initial_replicas); admission: the
        orchestrator's own (its report shows it; the owner sets its share);
        vocab_size: the target's rows, the ids a drafter may propose; on_send:
        told each message's number of calls, per pool (a metric); launcher:
        starts and stops replicas (on Ray), which makes the pools scalable;
        peers: the other orchestrators of the deployment (on Ray), of which
        the first (config.index 0) scales and the others follow it
        (orchestrator/fleet/peers.py); on_hang: told (event, pool) when a
        replica is "suspected" hung and when it has "recovered" (metrics)."""
        self.config, self.admission, self.peers = config, admission, peers
        self.vocab_size, self.on_send = vocab_size, on_send
        self.on_hang = on_hang or (lambda event, kind: None)
        # Who opens this process's sessions (their `owner` field; not the
        # owner orchestrator of a group): the replicas close them when they
        # stop hearing from it (orchestrator/fleet/keepalive.py).
        self.session_owner = session_owner_name(config.name)
        # Each pool with its own prefix routing table: both kinds cache prefixes.
        self.pools = {kind: Pool(kind, routing=routing_from(config)) for kind in ("verifier", "drafter")}
        self.keepalive = KeepAlive(self.pools)
        for spec in specs:
            self.pools[spec.kind].add(spec, self.client_for(spec))
        # Every /metrics endpoint for Prometheus, rewritten on each pool change.
        self.targets = (
            TargetsFile(config.metrics_targets_file, self.pools, config.metrics_address)
            if config.metrics_targets_file
            else None
        )
        on_change = self.targets.update if self.targets else None
        # Where clients reach this orchestrator (all of a deployment share it)
        # and its HTTP API's base URL: set once the servers are bound (server.py).
        self.address, self.http_address = "", ""
        self.view_version = 0  # the owner's replica list it follows (peers.PoolView)
        self._replaced: list = []  # clients of replicas the owner revived or dropped, closed when unused
        owner = config.index == 0
        # The owner of a deployment of several: the others' reports, views and shares.
        self.group = self._group(peers, on_change) if peers is not None and owner else None
        if self.targets and self.group:
            self.targets.orchestrators = self._orchestrator_metrics
        # Scaling needs a launcher (on Ray) and is the owner's alone; without
        # one the pools are fixed (or follow the owner's).
        self.scaler = self._scaler(launcher, on_change) if launcher and owner else None
        # Every orchestrator probes the replicas it suspects (each finds its own).
        self.recovery = (
            Recovery(self.pools, config.hang.probe_s, lambda kind: self.on_hang("recovered", kind))
            if config.hang.enabled
            else None
        )

    def _group(self, peers: Peers, on_change: Callable[[], None] | None) -> Group:
        total = self.config.admission_total or self.admission.limit
        return Group(peers, self.pools, self.report, total, self._set_share, on_change=on_change)

    def _scaler(self, launcher: Launcher, on_change: Callable[[], None] | None) -> Scaler:
        config = self.config
        return Scaler(
            self.pools,
            launcher,
            self.client_for,
            config.max_replicas,
            config.autoscale,
            on_change=on_change,
            group=self.group,
        )

    def client_for(self, spec: ReplicaSpec):
        config, timeout = self.config, self.config.rpc_timeout_s
        channel = {"tls": config.tls, "max_message_bytes": config.max_message_bytes, "hang": config.hang}
        client: GrpcVerifier | GrpcDrafter
        if spec.kind == "verifier":
            client = GrpcVerifier(spec.address, timeout, **channel)
        else:
            client = GrpcDrafter(spec.address, timeout, self.vocab_size, **channel)
        if self.on_send is not None:
            client.mux.on_send = self.on_send(spec.kind)
        client.on_suspect = lambda: self.on_hang("suspected", spec.kind)
        client.session_owner = self.session_owner
        return client

    def has_drafter(self) -> bool:
        """A drafter replica takes new sessions, or may again (a lost one)."""
        return any(not r.draining for r in self.pools["drafter"].replicas.values())

    def verifier(self, committed: Callable[[], list[int]]) -> FailoverVerifier:
        """A session's verifier: the least-loaded replica or one that likely
        caches its prompt's prefix (Pool.acquire), kept to the session's end or
        until lost; then the session moves, rebuilt from `committed`."""
        return FailoverVerifier(self.pools["verifier"], committed, self.config.max_failovers)

    def drafter(self, committed: Callable[[], list[int]], rebuild: bool) -> FailoverDrafter:
        """A session's drafter, as `verifier`; rebuild: whether a lost one can be
        replaced mid-session (not when it needs features not kept here)."""
        return FailoverDrafter(self.pools["drafter"], committed, self.config.max_failovers, rebuild=rebuild)

    def start(self) -> None:
        """The background work: keep-alives to the replicas, probing
        suspected ones; an owner that scales also reaps, re-discovers and
        autoscales."""
        self.keepalive.start()
        if self.scaler:
            self.scaler.start()
        if self.recovery:
            self.recovery.start()

    async def scale(self, counts: dict[str, int]) -> None:
        """Bring each named pool ("verifier", "drafter") to that many serving
        replicas, and ("orchestrator") the orchestrators taking new streams
        (admin API). A follower hands the call to the owner."""
        if self.scaler is None and self.peers is not None:
            await self.peers.scale(counts)
            return
        if self.scaler is None:
            raise NotScalable(
                "scaling needs the orchestrator deployed on Ray (`specd up`); this one serves "
                "a fixed list of replica addresses"
            )
        try:
            for kind in ("verifier", "drafter"):  # verifiers first: they hold what makes output
                if kind in counts:
                    await self.scaler.scale(kind, counts[kind])
            if "orchestrator" in counts:
                if self.group is None:
                    raise NotScalable("scaling the orchestrators needs them deployed on Ray (`specd up`)")
                await self.group.scale(counts["orchestrator"])
        finally:
            if self.group:  # the others route over the new pools at once
                await self.group.publish()

    def report(self) -> OrchestratorReport:
        """This orchestrator as Status lists it and its peers read it."""
        a, config = self.admission, self.config
        return OrchestratorReport(
            name=config.name,
            index=config.index,
            address=self.address,
            http_address=self.http_address,
            metrics_address=config.metrics_address,
            node=config.node,
            pid=os.getpid(),
            active_requests=a.active,
            max_active_requests=a.limit,
            draining=a.retiring or a.draining,
            view_version=self.view_version,
            sessions={r.spec.name: r.sessions for p in self.pools.values() for r in p.replicas.values()},
            lost={r.spec.name: r.revision for p in self.pools.values() for r in p.lost()},
        )

    async def follow(self, view: PoolView, max_active_requests: int) -> None:
        """A follower takes the owner's replica list and its share of the limit;
        clients earlier lists replaced are closed once no session holds them."""
        self._replaced += follow(self.pools, view, self.client_for)
        self.view_version, self.admission.limit = view.version, max_active_requests
        for client in [c for c in self._replaced if c.active <= 0]:
            self._replaced.remove(client)
            await client.aclose()

    def _set_share(self, n: int) -> None:
        self.admission.limit = n

    def _orchestrator_metrics(self) -> list[tuple[str, str]]:
        """(name, /metrics address) of every orchestrator (the targets file's)."""
        assert self.group is not None
        return [(self.config.name, self.config.metrics_address)] + [
            (r.name, r.metrics_address) for r in sorted(self.group.known.values(), key=lambda r: r.index)
        ]

    async def status(self) -> dict:
        """Pools, replicas and what each replica reports of itself (its Info,
        asked of all at once; one that does not answer within
        INFO_TIMEOUT_S, or is lost, shows no engine and no KV figures), and
        every orchestrator of the deployment (asked at the same time)."""
        replicas = [r for pool in self.pools.values() for r in pool.replicas.values()]
        reports: dict[str, OrchestratorReport | None] = {}
        if self.peers is not None:
            reports, *infos = await asyncio.gather(self.peers.reports(), *(_info(r) for r in replicas))
        else:
            infos = list(await asyncio.gather(*(_info(r) for r in replicas)))
        retiring = self.group.retiring() if self.group else set()
        others = [
            dataclasses.replace(r, draining=r.draining or r.name in retiring) for r in reports.values() if r is not None
        ]
        return merge_status(self._own_status(replicas, infos), [self.report(), *others], self.config.name)

    def _own_status(self, replicas: list, infos: list[dict]) -> dict:
        scales = self.scaler is not None or self.peers is not None
        return {
            "replicas": [_replica_status(r, info) for r, info in zip(replicas, infos)],
            "active_requests": self.admission.active,
            "metrics_address": self.config.metrics_address,
            "scalable": scales,
            "autoscale": {  # the owner applies them; every orchestrator of the deployment has them
                k: f"{p.min_replicas}:{p.max_replicas}:{p.target_sessions}"
                for k, p in (self.config.autoscale.items() if scales else ())
            },
        }

    async def aclose(self) -> None:
        self.keepalive.stop()
        if self.scaler:
            self.scaler.stop()
        if self.recovery:
            self.recovery.stop()
        for pool in self.pools.values():
            for r in pool.replicas.values():
                await r.client.aclose()


def _replica_status(r, info: dict) -> dict:
    return {
        "kind": r.spec.kind,
        "name": r.spec.name,
        "address": r.spec.address,
        "node": r.spec.node,
        "sessions": r.sessions,
        "draining": r.draining,
        "lost": r.lost or r.suspected,  # either way it takes no sessions until it serves again
        "metrics_address": r.spec.metrics_address,
        **{k: info[k] for k in REPLICA_INFO_FIELDS if k in info},
    }


async def _info(replica) -> dict:
    if replica.lost or replica.suspected or not hasattr(replica.client, "info"):
        return {}
    try:
        return await replica.client.info(INFO_TIMEOUT_S)
    except ServiceError as exc:
        log.info("%s %s did not report its info: %s", replica.spec.kind, replica.spec.name, exc.message)
        return {}
