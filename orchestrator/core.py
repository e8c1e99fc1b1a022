"""The orchestrator core: validates a request, routes it to replicas, runs the loop."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path

from transformers import AutoConfig

from orchestrator.config import OrchestratorConfig
from orchestrator.cycle.adaptive import CostModel
from orchestrator.cycle.detok import OutputTracker
from orchestrator.cycle.loop import run_generation
from orchestrator.cycle.ngram_drafter import NgramDrafter
from orchestrator.cycle.ports import DrafterClient, NoTrace
from orchestrator.cycle.records import Chunk
from orchestrator.edge.request import GenerationSpec, build_spec
from orchestrator.fleet.clients import GrpcDrafter, GrpcVerifier, ServiceError
from orchestrator.fleet.failover import FailoverDrafter, FailoverVerifier
from orchestrator.fleet.peers import Group, OrchestratorReport, Peers, PoolView, follow, merge_status
from orchestrator.fleet.pool import Pool, ReplicaSpec
from orchestrator.fleet.scaling import Launcher, Scaler
from orchestrator.pair import check_pair
from orchestrator.report.metrics import OrchestratorMetrics, TargetsFile
from orchestrator.report.tracing import request_trace
from orchestrator.spec_config import DRAFTER_METHODS
from specd_core.errors import CapacityExceeded, ShuttingDown
from specd_core.runtime.eagle_head import is_head_dir
from specd_core.runtime.grammar import Constraint, GrammarEngine
from specd_core.runtime.grammar import eos_ids as grammar_eos_ids
from specd_core.runtime.models import context_length, load_tokenizer

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
)
# Status waits this long for a replica's Info: a stuck replica must not stall it.
INFO_TIMEOUT_S = 2.0


def eos_ids(config) -> set[int]:
    ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}


class NotScalable(RuntimeError):
    """Scale asked of an orchestrator that has no launcher (FAILED_PRECONDITION)."""


def initial_replicas(config: OrchestratorConfig) -> list[ReplicaSpec]:
    return (
        list(config.replicas)
        + [ReplicaSpec("verifier", f"verifier-{i}", a) for i, a in enumerate(config.verifier_addresses)]
        + [ReplicaSpec("drafter", f"drafter-{i}", a) for i, a in enumerate(config.drafter_addresses)]
    )


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, launcher: Launcher | None = None, peers: Peers | None = None):
        """launcher: starts and stops replicas (on Ray), which makes the pools
        scalable; peers: the other orchestrators of the deployment (on Ray), of
        which the first (config.index 0) scales and the others follow it
        (orchestrator/fleet/peers.py)."""
        specs = initial_replicas(config)
        if not any(s.kind == "verifier" for s in specs):
            raise ValueError("at least one verifier address is needed")
        self.config = config
        self.model_name = Path(config.target_dir).name  # gen_ai.request.model
        self.tokenizer = load_tokenizer(config.target_dir)
        target_cfg = AutoConfig.from_pretrained(config.target_dir)
        # The target's embedding rows (padding included): the ids a prompt may
        # hold and drafters may propose; the verifier checks the same bound.
        self.vocab_size = target_cfg.vocab_size
        self.target_ctx = context_length(target_cfg)
        self.eos_ids = eos_ids(target_cfg)
        self._grammar_eos = grammar_eos_ids(target_cfg, self.tokenizer)
        self._grammar: GrammarEngine | None = None  # built on the first structured-output request
        self.drafter_ctx = self.target_ctx
        # What the drafter pool serves: an EAGLE head directory (method eagle,
        # on the target's features) or a draft model.
        self.drafter_method = "eagle" if config.drafter_dir and is_head_dir(config.drafter_dir) else "draft_model"
        if self.drafter_method == "eagle":
            pass  # the head uses the target's vocabulary and context
        elif config.drafter_dir:
            # Decided on the tokenizers, not on the embedding rows: padded tables
            # differ in size over the same tokens (specd_core/rules/vocab.py), and the
            # drafter proposes only ids the target has (drafter_svc/vocab.py).
            check_pair(config.target_dir, config.drafter_dir, self.tokenizer)
            self.drafter_ctx = context_length(AutoConfig.from_pretrained(config.drafter_dir))
        self.metrics = OrchestratorMetrics()
        self.pools = {"verifier": Pool("verifier"), "drafter": Pool("drafter")}
        for spec in specs:
            self.pools[spec.kind].add(spec, self.client_for(spec))
        sc = config.speculative.validate()
        if sc.method in DRAFTER_METHODS and sc.num_speculative_tokens and not self.pools["drafter"].replicas:
            raise ValueError(f"speculative_config.method is {sc.method} but no drafter replica is deployed")
        if sc.method in DRAFTER_METHODS and config.drafter_dir and sc.method != self.drafter_method:
            raise ValueError(
                f"speculative_config.method is {sc.method} but the drafter {config.drafter_dir} "
                f"is for {self.drafter_method}"
            )
        # Every /metrics endpoint for Prometheus, rewritten on each pool change.
        self.targets = (
            TargetsFile(config.metrics_targets_file, self.pools, config.metrics_address)
            if config.metrics_targets_file
            else None
        )
        self.peers = peers
        self.max_active_requests = config.max_active_requests  # this orchestrator's share (admission)
        # Where clients reach it (all orchestrators of a deployment share it) and
        # its HTTP API's base URL: set once the servers are bound (server.py).
        self.address, self.http_address = "", ""
        self.view_version = 0  # the owner's replica list it follows (peers.PoolView)
        self._replaced: list = []  # clients of replicas the owner revived or dropped, closed when unused
        # The owner of a deployment of several: the others' reports, views and shares.
        self.group = (
            Group(
                peers,
                self.pools,
                self.report,
                config.admission_total or config.max_active_requests,
                self._set_share,
                on_change=self.targets.update if self.targets else None,
            )
            if peers is not None and config.index == 0
            else None
        )
        if self.targets and self.group:
            self.targets.orchestrators = self._orchestrator_metrics
        # Scaling needs a launcher (on Ray) and is the owner's alone; without
        # one the pools are fixed (or follow the owner's).
        self.scaler = (
            Scaler(
                self.pools,
                launcher,
                self.client_for,
                config.max_replicas,
                config.autoscale,
                on_change=self.targets.update if self.targets else None,
                group=self.group,
            )
            if launcher and config.index == 0
            else None
        )
        self.ngram = NgramDrafter(sc.prompt_lookup_max, sc.prompt_lookup_min)
        self.active_requests = 0
        self.draining = False  # set on shutdown: new requests refused, running ones finish
        self.retiring = False  # leaving a group: no longer listening, running streams finish
        # Verify / draft costs and acceptance per level, learnt from every cycle
        # (adaptive depth); per method, since ngram and a drafter differ.
        self.costs: collections.defaultdict[str, CostModel] = collections.defaultdict(CostModel)

    @property
    def grammar(self) -> GrammarEngine:
        """Structured output over the target's tokenizer (specd_core/runtime/grammar.py)."""
        if self._grammar is None:
            self._grammar = GrammarEngine(self.tokenizer, self._grammar_eos)
        return self._grammar

    def client_for(self, spec: ReplicaSpec):
        tls, limit = self.config.tls, self.config.max_message_bytes
        client: GrpcVerifier | GrpcDrafter
        if spec.kind == "verifier":
            client = GrpcVerifier(spec.address, self.config.rpc_timeout_s, tls=tls, max_message_bytes=limit)
        else:
            client = GrpcDrafter(
                spec.address, self.config.rpc_timeout_s, self.vocab_size, tls=tls, max_message_bytes=limit
            )
        client.mux.on_send = self.metrics.step_sessions.labels(spec.kind).observe
        return client

    async def generate(self, request, trace_context=None) -> AsyncGenerator[Chunk, None]:
        """Run one request; trace_context: the caller's (from its gRPC metadata)."""
        self._admit()
        session_id = uuid.uuid4().hex
        trace = request_trace(trace_context, self.model_name, session_id)  # no-op unless tracing is on
        metrics = self.metrics.request()
        self.active_requests += 1
        chunk: Chunk | None = None
        used: list[FailoverVerifier | FailoverDrafter] = []
        try:
            spec = self._spec(request)
            trace.describe(spec)
            tracker = OutputTracker(
                self.tokenizer, self.eos_ids, spec.max_new_tokens, self.target_ctx - len(spec.prompt_ids), spec.stop
            )
            verifier, drafter, used = self._clients(spec, tracker)
            c = spec.sampling.constraint
            constraint = None if c is None else self.grammar.constraint(c, self.vocab_size)
            # aclosing: when this generator is closed or cancelled while the loop
            # is suspended at a yield, close the loop NOW so that its `finally`
            # frees the sessions on the replicas; otherwise that waits for the
            # garbage collector and cancelled streams leave sessions open
            # (tests/test_cancellation.py).
            loop = self._loop(spec, session_id, verifier, drafter, tracker, trace, constraint)
            async with contextlib.aclosing(loop) as chunks:
                async for chunk in chunks:
                    metrics.observe(chunk, spec.method)
                    yield chunk
        except BaseException as exc:  # also the client leaving (GeneratorExit, CancelledError)
            trace.finish(chunk, exc)
            raise
        else:
            trace.finish(chunk)
        finally:
            metrics.done((c.lease.pool.kind, c.lease.losses) for c in used)
            self.active_requests -= 1
            for client in used:
                client.release()

    def _admit(self) -> None:
        """Refuse a request when shutting down or at the concurrency limit."""
        if self.draining:
            raise ShuttingDown("the orchestrator is shutting down and takes no new requests; retry on another instance")
        if self.active_requests >= self.max_active_requests:
            raise CapacityExceeded(
                f"orchestrator is at its limit of {self.max_active_requests} concurrent requests; retry later"
            )

    def _spec(self, request) -> GenerationSpec:
        # Lost drafters count: they may be back (restarted) before the session
        # needs them, and without one it runs as plain decoding anyway.
        return build_spec(
            request,
            self.config,
            self.tokenizer,
            self.vocab_size,
            self.target_ctx,
            has_drafter=any(not r.draining for r in self.pools["drafter"].replicas.values()),
            drafter_method=self.drafter_method,
            compile_constraint=lambda c: self.grammar.compile(c),
        )

    def _clients(
        self, spec: GenerationSpec, tracker: OutputTracker
    ) -> tuple[FailoverVerifier, DrafterClient | None, list[FailoverVerifier | FailoverDrafter]]:
        """The session's verifier and drafter (None: plain decoding), and the
        leases among them to release at its end. Least-loaded replicas; the
        session keeps them to its end, or until one is lost: then it moves,
        rebuilt from what was committed."""

        def committed() -> list[int]:
            return spec.prompt_ids + tracker.ids

        verifier = FailoverVerifier(self.pools["verifier"], committed, self.config.max_failovers)
        if spec.method == "ngram":
            return verifier, self.ngram, [verifier]
        if spec.method in DRAFTER_METHODS:
            # An eagle drafter cannot be rebuilt elsewhere: it needs the target's
            # features of every committed token, which are not kept here.
            drafter = FailoverDrafter(
                self.pools["drafter"], committed, self.config.max_failovers, rebuild=not spec.features
            )
            return verifier, drafter, [verifier, drafter]
        return verifier, None, [verifier]

    def _loop(
        self,
        spec: GenerationSpec,
        session_id: str,
        verifier: FailoverVerifier,
        drafter: DrafterClient | None,
        tracker: OutputTracker,
        trace: NoTrace,
        constraint: Constraint | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        # The cost model is per method: ngram and a drafter differ.
        costs = self.costs[spec.method]
        return run_generation(
            spec, session_id, verifier, drafter, tracker, self.target_ctx, self.drafter_ctx, trace, costs, constraint
        )

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
        return OrchestratorReport(
            name=self.config.name,
            index=self.config.index,
            address=self.address,
            http_address=self.http_address,
            metrics_address=self.config.metrics_address,
            node=self.config.node,
            pid=os.getpid(),
            active_requests=self.active_requests,
            max_active_requests=self.max_active_requests,
            draining=self.retiring or self.draining,
            view_version=self.view_version,
            sessions={r.spec.name: r.sessions for p in self.pools.values() for r in p.replicas.values()},
            lost={r.spec.name: r.revision for p in self.pools.values() for r in p.lost()},
        )

    async def follow(self, view: PoolView, max_active_requests: int) -> None:
        """A follower takes the owner's replica list and its share of the limit;
        clients earlier lists replaced are closed once no session holds them."""
        self._replaced += follow(self.pools, view, self.client_for)
        self.view_version, self.max_active_requests = view.version, max_active_requests
        for client in [c for c in self._replaced if c.active <= 0]:
            self._replaced.remove(client)
            await client.aclose()

    def _set_share(self, n: int) -> None:
        self.max_active_requests = n

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
            reports, *infos = await asyncio.gather(self.peers.reports(), *(self._info(r) for r in replicas))
        else:
            infos = list(await asyncio.gather(*(self._info(r) for r in replicas)))
        retiring = self.group.retiring() if self.group else set()
        others = [
            dataclasses.replace(r, draining=r.draining or r.name in retiring) for r in reports.values() if r is not None
        ]
        return merge_status(self._own_status(replicas, infos), [self.report(), *others], self.config.name)

    def _own_status(self, replicas: list, infos: list[dict]) -> dict:
        return {
            "replicas": [
                {
                    "kind": r.spec.kind,
                    "name": r.spec.name,
                    "address": r.spec.address,
                    "node": r.spec.node,
                    "sessions": r.sessions,
                    "draining": r.draining,
                    "lost": r.lost,
                    "metrics_address": r.spec.metrics_address,
                    **{k: info[k] for k in REPLICA_INFO_FIELDS if k in info},
                }
                for r, info in zip(replicas, infos)
            ],
            "active_requests": self.active_requests,
            "metrics_address": self.config.metrics_address,
            "scalable": self.scaler is not None or self.peers is not None,
            "autoscale": {  # the owner applies them; every orchestrator of the deployment has them
                k: f"{p.min_replicas}:{p.max_replicas}:{p.target_sessions}"
                for k, p in (self.config.autoscale.items() if self.scaler or self.peers else ())
            },
        }

    @staticmethod
    async def _info(replica) -> dict:
        if replica.lost or not hasattr(replica.client, "info"):
            return {}
        try:
            return await replica.client.info(INFO_TIMEOUT_S)
        except ServiceError as exc:
            log.info("%s %s did not report its info: %s", replica.spec.kind, replica.spec.name, exc.message)
            return {}

    async def aclose(self) -> None:
        if self.scaler:
            self.scaler.stop()
        for pool in self.pools.values():
            for r in pool.replicas.values():
                await r.client.aclose()
        await self.ngram.aclose()
