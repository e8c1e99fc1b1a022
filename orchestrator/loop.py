"""The speculate -> verify -> accept loop for one request.

    first = verifier.open(prompt)                  # prefill = first token
    while not done:
        draft = drafter.propose(last outcome, shape)  # a chain or a tree (+ sparse q if sampled)
        kept  = verifier.verify(draft)             # ONE target forward, lossless rule
        stream kept tokens

The clients are injected (grpc in production, anything with the same async
methods in a unit test); this module never imports grpc.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from specd.draft_shape import DraftShape

from .detok import Emit, OutputTracker
from .request import GenerationSpec


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)     # tree nodes (a chain: parents i-1)
    parents: list[int] = field(default_factory=list)
    row_dists: list = field(default_factory=list)        # sampled children only: q per tree row
    compute_ms: float = 0.0


@dataclass
class Verdict:
    path: list[int]          # accepted node indices, root-down
    tokens: list[int]        # path tokens + correction or bonus
    compute_ms: float = 0.0


class VerifierClient(Protocol):
    async def open(self, session_id: str, prompt_ids: list[int], sampling) -> int: ...
    async def verify(self, session_id: str, draft: Draft) -> Verdict: ...
    async def close(self, session_id: str) -> None: ...


class DrafterClient(Protocol):
    async def open(self, session_id: str, prompt_ids: list[int], sampling) -> None: ...
    async def propose(self, session_id: str, accepted_path: list[int], committed: list[int],
                      shape: DraftShape) -> Draft: ...
    async def close(self, session_id: str) -> None: ...


@dataclass
class Stats:
    cycles: int = 0            # verify passes after the prefill
    drafted_tokens: int = 0    # draft tokens (tree nodes) verified
    accepted_tokens: int = 0
    committed_in_cycles: int = 0
    num_speculative_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    method: str = "off"
    draft_compute_ms: float = 0.0
    verify_compute_ms: float = 0.0
    cycles_wall_ms: float = 0.0
    cycle_overhead_ms: list[float] = field(default_factory=list)   # wall - compute, per cycle

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify pass, the correction/bonus token included."""
        return self.committed_in_cycles / self.cycles if self.cycles else 0.0

    def observe_cycle(self, draft: Draft, verdict: Verdict, wall_ms: float) -> None:
        self.cycles += 1
        self.drafted_tokens += len(draft.tokens)
        self.accepted_tokens += len(verdict.path)
        self.committed_in_cycles += len(verdict.tokens)
        self.draft_compute_ms += draft.compute_ms
        self.verify_compute_ms += verdict.compute_ms
        self.cycles_wall_ms += wall_ms
        self.cycle_overhead_ms.append(wall_ms - draft.compute_ms - verdict.compute_ms)


@dataclass
class Chunk:
    emit: Emit
    stats: Stats


def draft_budget(k: int, remaining: int, committed: int, target_ctx: int, drafter_ctx: int) -> int:
    """Draft depth this cycle: k, less near the end of max_new_tokens (a cycle
    commits up to depth+1) or of either model's context (the verifier forwards
    positions up to committed+depth-1; the drafter up to committed+depth-2)."""
    return max(0, min(k, remaining - 1, target_ctx - committed - 1, drafter_ctx - committed + 1))


async def run_generation(spec: GenerationSpec, session_id: str, verifier: VerifierClient,
                         drafter: DrafterClient | None, tracker: OutputTracker,
                         target_ctx: int, drafter_ctx: int) -> AsyncIterator[Chunk]:
    shape = spec.shape
    stats = Stats(num_speculative_tokens=shape.depth if shape else 0, prompt_tokens=len(spec.prompt_ids),
                  method=spec.method)
    use_drafter = drafter is not None and shape is not None
    opened = []
    try:
        opens = [verifier.open(session_id, spec.prompt_ids, spec.sampling)]
        if use_drafter:
            opens.append(drafter.open(session_id, spec.prompt_ids, spec.sampling))
        results = await asyncio.gather(*opens, return_exceptions=True)
        opened = [c for c, r in zip([verifier, drafter], results) if not isinstance(r, BaseException)]
        for r in results:
            if isinstance(r, BaseException):
                raise r
        committed = len(spec.prompt_ids) + 1
        emit = tracker.add([results[0]])
        stats.completion_tokens = len(tracker.ids)
        yield Chunk(emit, stats)
        # What the drafter has not heard of yet: tokens committed since its last
        # proposal, and the path of that proposal that was kept.
        unsent, kept_path = [results[0]], []
        while emit.finish_reason is None:
            start = time.perf_counter()
            cycle_shape = shape.truncated(draft_budget(shape.depth, tracker.remaining, committed, target_ctx,
                                                       drafter_ctx)) if use_drafter else None
            draft = Draft()
            if cycle_shape is not None:
                draft = await drafter.propose(session_id, kept_path, unsent, cycle_shape)
                unsent = []
            verdict = await verifier.verify(session_id, draft)
            if cycle_shape is not None:
                kept_path = verdict.path
            unsent += verdict.tokens
            committed += len(verdict.tokens)
            emit = tracker.add(verdict.tokens)
            stats.observe_cycle(draft, verdict, (time.perf_counter() - start) * 1e3)
            stats.completion_tokens = len(tracker.ids)
            yield Chunk(emit, stats)
    finally:
        # Free the session everywhere, also when the client went away mid-stream.
        await asyncio.gather(*(c.close(session_id) for c in opened), return_exceptions=True)
