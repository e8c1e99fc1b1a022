"""The speculate -> verify -> accept loop for one request.

    first = verifier.open(prompt)                 # prefill = first token
    while not done:
        draft = drafter.propose(last outcome, K)  # K tokens (+ sparse q if sampled)
        kept  = verifier.verify(draft)            # ONE target forward, lossless rule
        stream kept tokens

The clients are injected (grpc in production, anything with the same async
methods in a unit test); this module never imports grpc.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from .detok import Emit, OutputTracker
from .request import GenerationSpec


class VerifierClient(Protocol):
    async def open(self, session_id: str, prompt_ids: list[int], sampling) -> int: ...
    async def verify(self, session_id: str, draft_ids: list[int], dists) -> tuple[int, list[int], float]: ...
    async def close(self, session_id: str) -> None: ...


class DrafterClient(Protocol):
    async def open(self, session_id: str, prompt_ids: list[int], sampling) -> None: ...
    async def propose(self, session_id: str, num_accepted: int, committed: list[int], k: int): ...
    async def close(self, session_id: str) -> None: ...


@dataclass
class Stats:
    cycles: int = 0            # verify passes after the prefill
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    committed_in_cycles: int = 0
    num_speculative_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_compute_ms: float = 0.0
    verify_compute_ms: float = 0.0
    cycles_wall_ms: float = 0.0
    cycle_overhead_ms: list[float] = field(default_factory=list)   # wall - compute, per cycle

    def observe_cycle(self, drafted: int, accepted: int, committed: int,
                      wall_ms: float, draft_ms: float, verify_ms: float) -> None:
        self.cycles += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.committed_in_cycles += committed
        self.draft_compute_ms += draft_ms
        self.verify_compute_ms += verify_ms
        self.cycles_wall_ms += wall_ms
        self.cycle_overhead_ms.append(wall_ms - draft_ms - verify_ms)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify pass, the correction/bonus token included."""
        return self.committed_in_cycles / self.cycles if self.cycles else 0.0


@dataclass
class Chunk:
    emit: Emit
    stats: Stats


def draft_budget(k: int, remaining: int, committed: int, target_ctx: int, drafter_ctx: int) -> int:
    """Draft tokens this cycle: K, less near the end of max_new_tokens (a cycle
    commits up to k+1) or of either model's context (the verifier forwards
    positions up to committed+k-1; the drafter up to committed+k-2)."""
    return max(0, min(k, remaining - 1, target_ctx - committed - 1, drafter_ctx - committed + 1))


async def run_generation(spec: GenerationSpec, session_id: str, verifier: VerifierClient,
                         drafter: DrafterClient | None, tracker: OutputTracker,
                         target_ctx: int, drafter_ctx: int) -> AsyncIterator[Chunk]:
    stats = Stats(num_speculative_tokens=spec.num_speculative_tokens, prompt_tokens=len(spec.prompt_ids))
    use_drafter = drafter is not None and spec.num_speculative_tokens > 0
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
        # proposal, and how many of that proposal were kept.
        unsent, kept_of_last_draft = [results[0]], 0
        while emit.finish_reason is None:
            k = draft_budget(spec.num_speculative_tokens, tracker.remaining, committed, target_ctx,
                             drafter_ctx) if use_drafter else 0
            start = time.perf_counter()
            draft, dists, draft_ms = [], [], 0.0
            if k > 0:
                draft, dists, draft_ms = await drafter.propose(session_id, kept_of_last_draft, unsent, k)
                unsent = []
            num_accepted, new_tokens, verify_ms = await verifier.verify(session_id, draft, dists)
            wall_ms = (time.perf_counter() - start) * 1e3
            if k > 0:
                kept_of_last_draft = num_accepted
            unsent += new_tokens
            stats.observe_cycle(len(draft), num_accepted, len(new_tokens), wall_ms, draft_ms, verify_ms)
            committed += len(new_tokens)
            emit = tracker.add(new_tokens)
            stats.completion_tokens = len(tracker.ids)
            yield Chunk(emit, stats)
    finally:
        # Free the session everywhere, also when the client went away mid-stream.
        await asyncio.gather(*(c.close(session_id) for c in opened), return_exceptions=True)
