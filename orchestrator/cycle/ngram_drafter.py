"""The ngram method as a DrafterClient that runs inside the orchestrator.

Why here and not in the drafter service: the orchestrator already holds every
committed token of the session, and prompt lookup needs no model, so drafting
locally saves the Propose round trip (one RPC per cycle instead of two). The
loop does not know the difference: this has the same methods as GrpcDrafter.
"""

from __future__ import annotations

import time

from orchestrator.cycle.records import Draft
from specd_core.rules.ngram import NgramIndex
from specd_core.runtime.propose_call import ProposeCall
from specd_core.telemetry import tracing


class NgramDrafter:
    def __init__(self, n_max: int, n_min: int):
        self.n_max, self.n_min = n_max, n_min
        self.contexts: dict[str, NgramIndex] = {}
        self.active = 0

    async def open(self, session_id: str, prompt_ids: list[int], sampling, *, generated_from: int = 0) -> None:
        # generated_from: the orchestrator's own matcher cuts n-gram drafts
        # (orchestrator/cycle/structured.py); the index needs only the tokens.
        self.contexts[session_id] = NgramIndex(self.n_max, self.n_min, list(prompt_ids))

    async def propose(self, call: ProposeCall) -> Draft:
        # Never ahead / rewind / alternatives / branch: build_spec pipelines
        # draft_model chains only; never hidden: features are eagle's. Never
        # forced_room: the loop cuts and extends an n-gram draft itself
        # (orchestrator/cycle/structured.py).
        start = time.perf_counter()
        index = self.contexts[call.session_id]
        index.extend(call.committed)
        with tracing.span("specdec.draft"):  # in-process: an INTERNAL span, no server side
            tokens = index.propose(call.shape.depth)
        # A chain; children chosen without sampling, so no q travels and the
        # verifier applies the deterministic rule (lossless at any temperature).
        return Draft(tokens, list(range(-1, len(tokens) - 1)), [], (time.perf_counter() - start) * 1e3)

    def alone(self) -> bool:
        return False  # never asked: only draft_model chains are pipelined

    async def close(self, session_id: str) -> None:
        self.contexts.pop(session_id, None)

    async def aclose(self) -> None:
        self.contexts.clear()
