"""What the loop is given: the replica clients (grpc in production,
specd/orchestrator/clients.py and failover.py; anything with the same async methods
in a unit test) and the trace hooks (specd/orchestrator/tracing.py; no-ops by
default). The loop never imports grpc or OpenTelemetry."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

from specd.rules.draft_shape import DraftShape
from specd.runtime.features import HiddenStates

from .records import CycleRecord, Draft, Verdict


class VerifierClient(Protocol):
    # The first token; hidden=True (spec.features): (first token, HiddenStates of the prompt).
    async def open(self, session_id: str, prompt_ids: list[int], sampling, *, hidden: bool = False) -> Any: ...
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


class NoTrace:
    """The trace hooks of the loop when tracing is off (specd/orchestrator/tracing.py
    has the real ones): `scope` makes the request span current around the
    session calls, `cycle` opens a span per cycle that the draft and verify
    calls nest under, `annotate` puts a cycle's record on it."""

    _null = contextlib.nullcontext()

    def scope(self) -> contextlib.AbstractContextManager:
        return self._null

    def cycle(self) -> contextlib.AbstractContextManager:
        return self._null

    def annotate(self, span, cycle: CycleRecord) -> None:
        pass


NO_TRACE = NoTrace()
