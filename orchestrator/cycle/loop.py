"""The speculate -> verify -> accept loop for one request.

    first = verifier.open(prompt)                  # prefill = first token
    while not done:
        draft = drafter.propose(last outcome, shape)  # a chain or a tree (+ sparse q if sampled)
        kept  = verifier.verify(draft)             # ONE target forward, lossless rule
        stream kept tokens

`run_generation` is that cycle of named steps; what varies plugs in: how the
draft is made (orchestrator/cycle/drafting.py: none, one Propose per cycle, or
pipelined during the previous verify), its depth (orchestrator/cycle/depth.py:
fixed or adaptive), and the state carried between cycles
(orchestrator/cycle/session.py).

EAGLE drafting (spec.features): the verifier returns the target's hidden states
of the tokens each prefill / verify committed, and the loop hands them to the
drafter with the next Propose it makes anyway - the features ride on the two
messages a cycle already sends, no extra round trip (Li et al. 2024).

The clients are injected (a SessionReplicas: grpc in production, anything with the same async
methods in a unit test); this module never imports grpc. So are the trace hooks
(orchestrator/report/tracing.py; no-ops by default): the loop only produces data, a
CycleRecord per cycle, that the edge reports as span attributes and metrics.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from orchestrator.cycle.adaptive import CostModel
from orchestrator.cycle.depth import DepthPolicy, DraftShaper, depth_policy, draft_budget, learn_costs
from orchestrator.cycle.detok import Emit, OutputTracker
from orchestrator.cycle.drafting import Drafting, NoDrafting, PipelinedDrafting, PlainDrafting
from orchestrator.cycle.ports import NO_TRACE, DrafterClient, NoTrace, VerifierClient
from orchestrator.cycle.records import Chunk, CycleRecord, Draft, Stats, Verdict
from orchestrator.cycle.session import CycleState, SessionReplicas
from orchestrator.cycle.spec import ContextLengths, GenerationSpec
from orchestrator.cycle.structured import shape_draft
from orchestrator.spec_config import DRAFTER_METHODS
from specd_core.runtime.grammar import Constraint
from specd_core.telemetry.probe import mark

# The loop's data and ports, importable from here as well as from their modules.
__all__ = [
    "NO_TRACE",
    "Chunk",
    "ContextLengths",
    "CycleRecord",
    "Draft",
    "DrafterClient",
    "NoTrace",
    "SessionReplicas",
    "Stats",
    "Verdict",
    "VerifierClient",
    "draft_budget",
    "run_generation",
]


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def new_stats(spec: GenerationSpec) -> Stats:
    return Stats(
        num_speculative_tokens=spec.shape.depth if spec.shape else 0,
        prompt_tokens=len(spec.prompt_ids),
        completion_tokens=len(spec.resumed),
        method=spec.method,
        adaptive=spec.adaptive,
        resumed_tokens=len(spec.resumed),
    )


def drafting_for(
    spec: GenerationSpec, session_id: str, drafter: DrafterClient | None, shaper: DraftShaper | None
) -> Drafting:
    if drafter is None or shaper is None:
        return NoDrafting()
    if spec.pipeline:
        alone = drafter.alone if spec.pipeline_alone else None
        return PipelinedDrafting(drafter, session_id, shaper, spec.pipeline_alternatives, alone)
    return PlainDrafting(drafter, session_id, shaper, spec.forced_room if spec.method in DRAFTER_METHODS else 0)


def stream(tracker: OutputTracker, stats: Stats, tokens: list[int]) -> Emit:
    """Committed tokens become output (text, end conditions)."""
    emit = tracker.add(tokens)
    stats.completion_tokens = len(tracker.ids)
    return emit


async def open_session(
    replicas: SessionReplicas, spec: GenerationSpec, tracker: OutputTracker, stats: Stats, trace: NoTrace
) -> tuple[CycleState, Emit]:
    """Prefill: the first token is the first output."""
    first, hidden, stats.cached_prompt_tokens = await replicas.open(spec, trace)
    state = CycleState(len(spec.context_ids) + 1, [first], [] if spec.features else None)
    stats.feature_bytes += state.keep_features(hidden)
    return state, stream(tracker, stats, [first])


async def already_ended(spec: GenerationSpec, finish_reason: str) -> AsyncGenerator[Chunk, None]:
    """A resumed request whose resumed tokens already end its output
    (OutputTracker.resume): one last message, no session opened."""
    yield Chunk(Emit(finish_reason=finish_reason), new_stats(spec))


def shape_forced(
    draft: Draft,
    constraint: Constraint,
    spec: GenerationSpec,
    state: CycleState,
    remaining: int,
    contexts: ContextLengths,
) -> None:
    """Structured output: the tokens the constraint forces join the draft, in
    the room that max_new_tokens and both context windows leave."""
    room = draft_budget(spec.forced_room, remaining, state.committed, contexts.target, contexts.drafter)
    shape_draft(draft, constraint, room, cut=spec.method == "ngram")


def commit_cycle(
    state: CycleState, stats: Stats, tracker: OutputTracker, draft: Draft, verdict: Verdict, wall_ms: float
) -> tuple[Emit, CycleRecord]:
    """A verdict's tokens are committed and become output; the cycle's record."""
    stats.feature_bytes += state.commit(draft, verdict)
    emit = stream(tracker, stats, verdict.tokens)
    record = state.last = stats.observe_cycle(draft, verdict, wall_ms)
    return emit, record


async def draft_step(drafting: Drafting, state: CycleState, remaining: int, start: float) -> Draft:
    """This cycle's draft (the time waited for it since the last verdict), and
    the next one started if pipelined."""
    draft = await drafting.draft(state, remaining)
    draft.wait_ms = ms_since(start) if draft.tokens else 0.0
    drafting.draft_ahead(draft, state, remaining)
    return draft


def plan(
    spec: GenerationSpec, replicas: SessionReplicas, contexts: ContextLengths, costs: CostModel
) -> tuple[DepthPolicy, Drafting]:
    """The session's depth policy and its way of drafting. No shape: plain
    decoding, the drafter unused."""
    if spec.shape is None:
        replicas.drafter = None
    drafter = replicas.drafter
    depth = depth_policy(spec.shape.depth if spec.shape else 0, spec.adaptive and drafter is not None, costs)
    shaper = DraftShaper(spec.shape, depth, contexts.target, contexts.drafter, spec.confidence) if spec.shape else None
    return depth, drafting_for(spec, replicas.session_id, drafter, shaper)


async def run_generation(
    spec: GenerationSpec,
    replicas: SessionReplicas,
    tracker: OutputTracker,
    contexts: ContextLengths,
    trace: NoTrace = NO_TRACE,
    costs: CostModel | None = None,
    constraint: Constraint | None = None,
) -> AsyncGenerator[Chunk, None]:
    """Open the session on its replicas, then per cycle: draft, verify,
    commit and stream, learn; close it however the stream ends. costs: the
    orchestrator's shared cost model; it learns from every cycle and, for an
    adaptive request, chooses the depth of the next. constraint: the
    request's structured output, standing at the prompt
    (orchestrator/cycle/structured.py)."""
    costs = costs or CostModel()
    depth, drafting = plan(spec, replicas, contexts, costs)
    drafter, stats = replicas.drafter, new_stats(spec)
    span = None  # the cycle's span (tracing on)
    try:
        state, emit = await open_session(replicas, spec, tracker, stats, trace)
        if constraint is not None:
            constraint.commit(state.unsent)
        last = time.perf_counter()  # a cycle runs from one verdict to the next
        span = trace.start_cycle()
        yield Chunk(emit, stats)
        while emit.finish_reason is None:
            with trace.current(span):  # the draft and verify calls nest under it
                draft = await draft_step(drafting, state, tracker.remaining, last)
                if constraint is not None and drafter is not None:
                    shape_forced(draft, constraint, spec, state, tracker.remaining, contexts)
                verdict = await replicas.verifier.verify(replicas.session_id, draft)
            now = time.perf_counter()
            mark("verdict")
            wall_ms, last = (now - last) * 1e3, now
            if constraint is not None:
                constraint.commit(verdict.tokens)
            emit, record = commit_cycle(state, stats, tracker, draft, verdict, wall_ms)
            depth.observe(record.drafted())  # the session's acceptance: the next depth depends on it
            done, span = span, None
            if emit.finish_reason is None:
                # The next Propose leaves now, before the rest of this cycle's
                # bookkeeping and the client's write: the drafter works
                # meanwhile (docs/overhead.md). The shared cost model learns
                # this cycle after it: a running mean, one cycle late.
                span = trace.start_cycle()
                with trace.current(span):
                    await drafting.prefetch(state, tracker.remaining)
            learn_costs(costs, record.drafted())
            trace.end_cycle(done, record)
            mark("streamed")
            yield Chunk(emit, stats, record)
            mark("resumed")
    finally:
        trace.end_cycle(span)
        try:
            await drafting.drop()
        finally:  # a second cancel may interrupt the drop: the sessions are freed all the same
            await replicas.close(trace)
