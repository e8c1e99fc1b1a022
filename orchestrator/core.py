"""The orchestrator core: admits a request and generates it on its fleet.

The edges (orchestrator/edge/) parse a request into a GenerationSpec; the core
admits it (orchestrator/fleet/admission.py), leases the session's replicas from
its fleet (orchestrator/fleet/fleet.py), runs the cycle loop
(orchestrator/cycle/loop.py) and reports it (traces, metrics)."""

from __future__ import annotations

import collections
import contextlib
import uuid
from collections.abc import AsyncGenerator, Callable

from orchestrator.config import OrchestratorConfig
from orchestrator.cycle.adaptive import CostModel
from orchestrator.cycle.detok import OutputTracker
from orchestrator.cycle.loop import already_ended, run_generation
from orchestrator.cycle.ngram_drafter import NgramDrafter
from orchestrator.cycle.ports import DrafterClient
from orchestrator.cycle.records import Chunk
from orchestrator.cycle.session import SessionReplicas
from orchestrator.cycle.spec import GenerationSpec
from orchestrator.fleet.admission import Admission
from orchestrator.fleet.failover import FailoverDrafter, FailoverVerifier
from orchestrator.fleet.fleet import Fleet, initial_replicas
from orchestrator.fleet.peers import OrchestratorReport, Peers, PoolView
from orchestrator.fleet.scaling import Launcher
from orchestrator.model import check_speculation, load_model_facts
from orchestrator.report.metrics import OrchestratorMetrics
from orchestrator.report.tracing import request_trace
from orchestrator.spec_config import DRAFTER_METHODS


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, launcher: Launcher | None = None, peers: Peers | None = None):
        """launcher: starts and stops replicas (on Ray), which makes the pools
        scalable; peers: the other orchestrators of the deployment (on Ray)
        (orchestrator/fleet/fleet.py)."""
        specs = initial_replicas(config)
        self.config = config
        self.model = load_model_facts(config)
        sc = config.speculative.validate()
        check_speculation(config, self.model, any(s.kind == "drafter" for s in specs))
        self.metrics = OrchestratorMetrics()
        self.admission = Admission(config.max_active_requests)
        self.fleet = Fleet(
            config,
            self.admission,
            specs,
            self.model.vocab_size,
            on_send=lambda kind: self.metrics.step_sessions.labels(kind).observe,
            launcher=launcher,
            peers=peers,
            on_hang=self.metrics.hang,
        )
        self.ngram = NgramDrafter(sc.prompt_lookup_max, sc.prompt_lookup_min)
        # Verify / draft costs and acceptance per level, learnt from every cycle
        # (adaptive depth); per method, since ngram and a drafter differ.
        self.costs: collections.defaultdict[str, CostModel] = collections.defaultdict(CostModel)

    async def generate(
        self, make_spec: Callable[[], GenerationSpec], trace_context=None
    ) -> AsyncGenerator[Chunk, None]:
        """Run one request. make_spec: the edge's parsing of it, called once the
        request is admitted and inside its trace, so that a refused request is
        traced with its reason; trace_context: the caller's (from its gRPC metadata)."""
        self.admission.admit()
        session_id = uuid.uuid4().hex
        trace = request_trace(trace_context, self.model.name, session_id)  # no-op unless tracing is on
        metrics = self.metrics.request()
        self.admission.active += 1
        chunk: Chunk | None = None
        used: list[FailoverVerifier | FailoverDrafter] = []
        try:
            spec = make_spec()
            trace.describe(spec)
            loop, used = self._loop(spec, session_id, trace)
            # aclosing: when this generator is closed or cancelled while the loop
            # is suspended at a yield, close the loop NOW so that its `finally`
            # frees the sessions on the replicas; otherwise that waits for the
            # garbage collector and cancelled streams leave sessions open
            # (tests/test_cancellation.py).
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
            self.admission.active -= 1
            for client in used:
                client.release()

    def _loop(
        self, spec: GenerationSpec, session_id: str, trace
    ) -> tuple[AsyncGenerator[Chunk, None], list[FailoverVerifier | FailoverDrafter]]:
        """The request's chunks, and the leases to release at its end. A
        resumed request starts from its resumed tokens: the output and the
        constraint stand after them (a token the constraint forbids:
        InvalidRequest), and where they already end the output it ends at once."""
        m = self.model
        tracker = OutputTracker(
            m.tokenizer, m.eos_ids, spec.max_new_tokens, m.target_ctx - len(spec.prompt_ids), spec.stop
        )
        c = spec.sampling.constraint
        constraint = None if c is None else m.grammar.constraint(c, m.vocab_size)
        if constraint is not None:
            constraint.commit(spec.resumed, "resume_token_ids")
        ended = tracker.resume(list(spec.resumed))
        if ended:
            return already_ended(spec, ended), []
        verifier, drafter, used = self._clients(spec, tracker)
        replicas = SessionReplicas(session_id, verifier, drafter)
        # The cost model is per method: ngram and a drafter differ.
        loop = run_generation(spec, replicas, tracker, m.contexts, trace, self.costs[spec.method], constraint)
        return loop, used

    def _clients(
        self, spec: GenerationSpec, tracker: OutputTracker
    ) -> tuple[FailoverVerifier, DrafterClient | None, list[FailoverVerifier | FailoverDrafter]]:
        """The session's verifier and drafter (None: plain decoding), and the
        leases among them to release at its end. Least-loaded replicas; the
        session keeps them to its end, or until one is lost: then it moves,
        rebuilt from what was committed."""

        def committed() -> list[int]:
            return spec.prompt_ids + tracker.ids

        verifier = self.fleet.verifier(committed)
        if spec.method == "ngram":
            return verifier, self.ngram, [verifier]
        if spec.method in DRAFTER_METHODS:
            # An eagle drafter cannot be rebuilt elsewhere: it needs the target's
            # features of every committed token, which are not kept here.
            drafter = self.fleet.drafter(committed, rebuild=not spec.features)
            return verifier, drafter, [verifier, drafter]
        return verifier, None, [verifier]

    # What the admin API and the other orchestrators ask (servicer.py, specd/ray_deploy.py).

    async def scale(self, counts: dict[str, int]) -> None:
        await self.fleet.scale(counts)

    async def status(self) -> dict:
        return await self.fleet.status()

    def report(self) -> OrchestratorReport:
        return self.fleet.report()

    async def follow(self, view: PoolView, max_active_requests: int) -> None:
        await self.fleet.follow(view, max_active_requests)

    async def aclose(self) -> None:
        await self.fleet.aclose()
        await self.ngram.aclose()
