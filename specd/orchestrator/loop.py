"""The speculate -> verify -> accept loop for one request.

    first = verifier.open(prompt)                  # prefill = first token
    while not done:
        draft = drafter.propose(last outcome, shape)  # a chain or a tree (+ sparse q if sampled)
        kept  = verifier.verify(draft)             # ONE target forward, lossless rule
        stream kept tokens

EAGLE drafting (spec.features): the verifier returns the target's hidden states
of the tokens each prefill / verify committed, and the loop hands them to the
drafter with the next Propose it makes anyway - the features ride on the two
messages a cycle already sends, no extra round trip (Li et al. 2024).

Pipelined drafting (spec.pipeline; PEARL's post-verify, Liu et al. 2024): while
the verifier checks a chain, the drafter already drafts the next one assuming
the whole chain is kept and the bonus token is its own guess. When the verdict
bears that out the next cycle verifies that draft at once; otherwise it is
dropped (the drafter rewinds) and a fresh draft is made. Output is exact either
way: a pre-draft is used only when its assumed prefix is the committed one, and
its tokens were drawn independently of the verifier's randomness.
With spec.pipeline_alternatives the drafter also pre-drafts likely rejection
outcomes (d1..dj kept, its next choice at j+1 as the correction) and further
bonus guesses; whichever branch the verdict matches is verified at once
(specd/drafter/branches.py), and the next Propose names it (`branch`).

The clients are injected (grpc in production, anything with the same async
methods in a unit test); this module never imports grpc. So are the trace hooks
(specd/orchestrator/tracing.py; no-ops by default): the loop only produces data, a
CycleRecord per cycle, that the edge reports as span attributes and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from specd.rules.draft_shape import DraftShape
from specd.runtime.features import HiddenStates

from .adaptive import CostModel, SessionDepth
from .detok import Emit, OutputTracker
from .request import GenerationSpec


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)  # tree nodes (a chain: parents i-1)
    parents: list[int] = field(default_factory=list)
    row_dists: list = field(default_factory=list)  # sampled children only: q per tree row
    compute_ms: float = 0.0  # of the drafter batch it ran in
    batch_tokens: int = 0  # draft nodes of that batch (0: unknown, this draft alone)
    guess: int | None = None  # an ahead draft: the bonus token it assumed
    call_ms: float = 0.0  # the Propose call's wall time, as the orchestrator saw it
    wait_ms: float = 0.0  # of the cycle's wall time, spent waiting for this draft
    ahead: bool = False  # drafted during the previous verify (pipelined)
    # An ahead draft: the other outcomes it pre-drafted, (kept, correction or
    # bonus token, the chain after it); this draft itself assumes all kept + guess.
    branches: list[tuple[int, int, Draft]] = field(default_factory=list)
    branch: int = 0  # a pipelined draft: its branch (0 = all kept + guess, i = branches[i-1])


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, root-down
    tokens: list[int]  # path tokens + correction or bonus
    compute_ms: float = 0.0
    batch_sessions: int = 1  # sessions in the verify forward it ran in
    batch_tokens: int = 0  # rows of that forward (0: unknown)
    hidden: HiddenStates | None = None  # spec.features: the target's features of the committed tokens


class VerifierClient(Protocol):
    # hidden=True (spec.features): returns (first token, HiddenStates of the prompt)
    async def open(self, session_id: str, prompt_ids: list[int], sampling, *, hidden: bool = False) -> int: ...
    async def verify(self, session_id: str, draft: Draft) -> Verdict: ...
    async def close(self, session_id: str) -> None: ...


class DrafterClient(Protocol):
    async def open(self, session_id: str, prompt_ids: list[int], sampling) -> None: ...
    # alternatives (ahead calls) / branch (the call after one): ProposeRequest's
    # ahead_alternatives / ahead_branch; sent only when not 0.
    async def propose(
        self,
        session_id: str,
        accepted_path: list[int],
        committed: list[int],
        shape: DraftShape,
        *,
        ahead: bool = False,
        rewind: bool = False,
        hidden: HiddenStates | None = None,
        alternatives: int = 0,
        branch: int = 0,
    ) -> Draft: ...
    async def close(self, session_id: str) -> None: ...


@dataclass
class CycleRecord:
    """One cycle as data, for whoever reports it (trace attributes, Prometheus)."""

    index: int  # 0-based verify cycle
    draft: Draft
    verdict: Verdict
    wall_ms: float  # the cycle as the orchestrator saw it

    @property
    def accepted(self) -> int:
        return len(self.verdict.path)

    @property
    def depth(self) -> int:
        """Draft depth (a chain: K; 0 = a plain decode step)."""
        depths: list[int] = []
        for p in self.draft.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return max(depths, default=0)

    @property
    def bonus(self) -> bool:
        """The extra token is a bonus (the path reached a leaf), not a correction."""
        return bool(self.verdict.path) and self.verdict.path[-1] not in self.draft.parents

    @property
    def overhead_ms(self) -> float:
        # A pipelined draft's compute ran during the previous cycle, not in this wall time.
        draft_ms = 0.0 if self.draft.ahead else self.draft.compute_ms
        return self.wall_ms - draft_ms - self.verdict.compute_ms


@dataclass
class Stats:
    cycles: int = 0  # verify passes after the prefill
    drafted_tokens: int = 0  # draft tokens (tree nodes) verified
    accepted_tokens: int = 0
    committed_in_cycles: int = 0
    num_speculative_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    method: str = "off"
    draft_compute_ms: float = 0.0
    verify_compute_ms: float = 0.0
    cycles_wall_ms: float = 0.0
    cycle_overhead_ms: list[float] = field(default_factory=list)  # wall - compute, per cycle
    drafts: int = 0  # cycles that verified a non-empty draft (vLLM's num_drafts)
    # Per draft position (0 = depth 1): cycles whose accepted path reached it.
    accepted_per_position: list[int] = field(default_factory=list)
    adaptive: bool = False  # the depth was chosen per cycle
    pipelined_drafts: int = 0  # cycles that verified a draft made during the previous verify
    pipelined_alternative_drafts: int = 0  # ... from a branch other than the all-kept one
    draft_wait_ms: float = 0.0  # of the cycles' wall time, waiting for drafts
    draft_call_ms: float = 0.0  # the used drafts' Propose calls' own wall time
    feature_bytes: int = 0  # spec.features: hidden-state bytes carried (prefill + cycles)

    def __post_init__(self):
        self.accepted_per_position = self.accepted_per_position or [0] * self.num_speculative_tokens

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify pass, the correction/bonus token included."""
        return self.committed_in_cycles / self.cycles if self.cycles else 0.0

    def observe_cycle(self, draft: Draft, verdict: Verdict, wall_ms: float) -> CycleRecord:
        self.cycles += 1
        self.drafts += bool(draft.tokens)
        self.drafted_tokens += len(draft.tokens)
        self.accepted_tokens += len(verdict.path)
        for i in range(len(verdict.path)):
            if i == len(self.accepted_per_position):  # a path deeper than K: never, but be safe
                self.accepted_per_position.append(0)
            self.accepted_per_position[i] += 1
        self.committed_in_cycles += len(verdict.tokens)
        self.draft_compute_ms += draft.compute_ms
        self.verify_compute_ms += verdict.compute_ms
        self.cycles_wall_ms += wall_ms
        self.pipelined_drafts += draft.ahead
        self.pipelined_alternative_drafts += draft.ahead and draft.branch > 0
        self.draft_wait_ms += draft.wait_ms
        self.draft_call_ms += draft.call_ms
        record = CycleRecord(self.cycles - 1, draft, verdict, wall_ms)
        self.cycle_overhead_ms.append(record.overhead_ms)
        return record


@dataclass
class Chunk:
    emit: Emit
    stats: Stats
    cycle: CycleRecord | None = None  # the cycle that produced it (None: the prefill)


class NoTrace:
    """The trace hooks of the loop when tracing is off (specd/orchestrator/tracing.py
    has the real ones): `scope` makes the request span current around the
    session calls, `cycle` opens a span per cycle that the draft and verify
    calls nest under, `annotate` puts a cycle's record on it."""

    _null = contextlib.nullcontext()

    def scope(self):
        return self._null

    def cycle(self):
        return self._null

    def annotate(self, span, cycle: CycleRecord) -> None:
        pass


NO_TRACE = NoTrace()


def draft_budget(k: int, remaining: int, committed: int, target_ctx: int, drafter_ctx: int) -> int:
    """Draft depth this cycle: k, less near the end of max_new_tokens (a cycle
    commits up to depth+1) or of either model's context (the verifier forwards
    positions up to committed+depth-1; the drafter up to committed+depth-2)."""
    return max(0, min(k, remaining - 1, target_ctx - committed - 1, drafter_ctx - committed + 1))


def ahead_branch(draft: Draft, verdict: Verdict, ahead: Draft) -> int | None:
    """The branch of the ahead draft whose assumed verdict on `draft` (a chain)
    is the real one: 0 = all kept with the guessed bonus, i = ahead.branches[i-1]
    (kept tokens, then that correction or bonus); None = none. Depends on the
    verdict alone, which keeps sampling exact. (An empty ahead draft - a drafter
    rebuilt elsewhere mid-call makes none - holds nothing.)"""
    if not ahead.tokens:
        return None
    outcome = (len(verdict.path), verdict.tokens[-1])
    if outcome == (len(draft.tokens), ahead.guess):
        return 0
    return next((i + 1 for i, (kept, token, _) in enumerate(ahead.branches) if (kept, token) == outcome), None)


def branch_draft(ahead: Draft, index: int) -> Draft:
    """Branch `index` of an ahead draft as the draft to verify (timings are the
    ahead call's: all its branches were drafted together)."""
    if index == 0:
        pre = ahead
    else:
        pre = ahead.branches[index - 1][2]
        pre.compute_ms, pre.batch_tokens, pre.call_ms = ahead.compute_ms, ahead.batch_tokens, ahead.call_ms
    pre.ahead, pre.branch, pre.branches = True, index, []
    return pre


def after_ahead(rewind: bool, branch: int) -> dict:
    """What the next Propose tells the drafter about its last ahead call."""
    return {"rewind": True} if rewind else {"branch": branch} if branch else {}


def keep_features(pending: list[HiddenStates], got: HiddenStates | None) -> int:
    """Queue the verifier's features for the next Propose; their size in bytes."""
    if got is None:
        raise RuntimeError("the verifier returned no hidden states for a session that asked for them")
    pending.append(got)
    return len(got.data)


async def timed_propose(drafter: DrafterClient, *args, **kwargs) -> Draft:
    start = time.perf_counter()
    draft = await drafter.propose(*args, **kwargs)
    draft.call_ms = (time.perf_counter() - start) * 1e3
    return draft


async def run_generation(
    spec: GenerationSpec,
    session_id: str,
    verifier: VerifierClient,
    drafter: DrafterClient | None,
    tracker: OutputTracker,
    target_ctx: int,
    drafter_ctx: int,
    trace: NoTrace = NO_TRACE,
    costs: CostModel | None = None,
) -> AsyncIterator[Chunk]:
    """costs: the orchestrator's shared cost model; it learns from every cycle
    and, for an adaptive request, chooses the depth of the next."""
    shape = spec.shape
    stats = Stats(
        num_speculative_tokens=shape.depth if shape else 0,
        prompt_tokens=len(spec.prompt_ids),
        method=spec.method,
        adaptive=spec.adaptive,
    )
    use_drafter = drafter is not None and shape is not None
    costs = costs or CostModel()
    depth = SessionDepth(shape.depth) if spec.adaptive and use_drafter else None
    rest_rows, rest_sessions = 0, 0  # the other sessions of this session's last verify forward
    opened, ahead = [], None  # ahead: a task, the next cycle's draft made during this verify
    try:
        # spec.features: the target's hidden states not yet sent to the drafter.
        feats: list[HiddenStates] = []
        want = {"hidden": True} if spec.features else {}
        opens = [verifier.open(session_id, spec.prompt_ids, spec.sampling, **want)]
        if use_drafter:
            opens.append(drafter.open(session_id, spec.prompt_ids, spec.sampling))
        # Until the opens answer, count them as opened: a client that leaves now
        # cancels them here, but a replica may already have opened the session.
        opened = [verifier, drafter][: len(opens)]
        with trace.scope():
            results = await asyncio.gather(*opens, return_exceptions=True)
        opened = [c for c, r in zip([verifier, drafter], results) if not isinstance(r, BaseException)]
        for r in results:
            if isinstance(r, BaseException):
                raise r
        if spec.features:
            results[0], prompt_feats = results[0]
            stats.feature_bytes += keep_features(feats, prompt_feats)
        committed = len(spec.prompt_ids) + 1
        emit = tracker.add([results[0]])
        stats.completion_tokens = len(tracker.ids)
        yield Chunk(emit, stats)
        # What the drafter has not heard of yet: tokens committed since its last
        # proposal, and the path of that proposal that was kept; `rewind`: its
        # last (ahead) proposal guessed wrong and is to be undone.
        # `branch`: its last (ahead) proposal held, in this branch.
        unsent, kept_path, rewind, branch = [results[0]], [], False, 0
        draft = verdict = None

        def next_shape(committed: int, remaining: int) -> DraftShape | None:
            k = depth.choose(costs, rest_rows, rest_sessions) if depth else shape.depth
            cut = shape.truncated(draft_budget(k, remaining, committed, target_ctx, drafter_ctx))
            # A wide tree's nodes are rows too: fewer levels near the context's end.
            return cut.fit(target_ctx - committed, drafter_ctx - committed) if cut is not None else None

        while emit.finish_reason is None:
            with trace.cycle() as span:  # the draft and verify calls nest under it
                start = time.perf_counter()
                pre = None
                if ahead is not None:
                    pre, ahead = await ahead, None
                    if (hit := ahead_branch(draft, verdict, pre)) is not None:
                        pre, branch, unsent = branch_draft(pre, hit), hit, []  # the drafter has those tokens
                    else:
                        pre, rewind = None, True
                if pre is not None:
                    draft = pre
                elif use_drafter and (cycle_shape := next_shape(committed, tracker.remaining)) is not None:
                    extra = {"hidden": HiddenStates.concat(feats)} if spec.features else {}
                    draft = await timed_propose(
                        drafter, session_id, kept_path, unsent, cycle_shape, **after_ahead(rewind, branch), **extra
                    )
                    unsent, rewind, branch, feats = [], False, 0, []
                else:
                    draft = Draft()
                draft.wait_ms = (time.perf_counter() - start) * 1e3 if draft.tokens else 0.0
                if spec.pipeline and draft.tokens:
                    # Assume every draft token kept plus a bonus: what the next cycle would start from
                    # (a branch that keeps fewer commits fewer tokens, so the same shape fits it).
                    n = len(draft.tokens) + 1
                    if (shape_after := next_shape(committed + n, tracker.remaining - n)) is not None:
                        alts = {"alternatives": spec.pipeline_alternatives} if spec.pipeline_alternatives else {}
                        ahead = asyncio.ensure_future(
                            timed_propose(
                                drafter,
                                session_id,
                                list(range(n - 1)),
                                draft.tokens,
                                shape_after,
                                ahead=True,
                                **after_ahead(False, branch),
                                **alts,
                            )
                        )
                        branch = 0
                verdict = await verifier.verify(session_id, draft)
                if spec.features:
                    stats.feature_bytes += keep_features(feats, verdict.hidden)
                if draft.tokens:
                    kept_path = verdict.path
                unsent += verdict.tokens
                committed += len(verdict.tokens)
                emit = tracker.add(verdict.tokens)
                cycle = stats.observe_cycle(draft, verdict, (time.perf_counter() - start) * 1e3)
                trace.annotate(span, cycle)
                rows = len(draft.tokens) + 1
                costs.observe_verify(verdict.batch_tokens or rows, verdict.batch_sessions or 1, verdict.compute_ms)
                costs.observe_draft(draft.batch_tokens or len(draft.tokens), draft.compute_ms)
                costs.observe_tokens(len(verdict.tokens))
                # A pre-draft's compute ran beside an earlier verify: only the draft waited for counts.
                costs.observe_cycle(cycle.wall_ms, verdict.compute_ms, 0.0 if draft.ahead else draft.compute_ms)
                if depth:
                    depth.observe(cycle.depth, cycle.accepted, costs)
                elif cycle.depth:
                    costs.observe_levels(cycle.depth, cycle.accepted)  # fixed-K sessions teach the rates too
                rest_rows = max(0, verdict.batch_tokens - rows)
                rest_sessions = max(0, verdict.batch_sessions - 1)
            stats.completion_tokens = len(tracker.ids)
            yield Chunk(emit, stats, cycle)
    finally:
        if ahead is not None:  # the stream ended during a verify: drop the pre-draft
            ahead.cancel()
            await asyncio.gather(ahead, return_exceptions=True)
        # Free the session everywhere, also when the client went away mid-stream.
        with trace.scope():  # shield: a second cancel must not stop the closes half-way
            await asyncio.shield(asyncio.gather(*(c.close(session_id) for c in opened), return_exceptions=True))
