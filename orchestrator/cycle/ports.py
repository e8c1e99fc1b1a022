"""What the loop is given: the replica clients (grpc in production,
orchestrator/fleet/clients.py and failover.py; anything with the same async methods
in a unit test) and the trace hooks (orchestrator/report/tracing.py; no-ops by
default). The loop never imports grpc or OpenTelemetry."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

from orchestrator.cycle.records import CycleRecord, Draft, Verdict
from specd_core.runtime.propose_call import ProposeCall


class VerifierClient(Protocol):
    # The first token; hidden=True (spec.features): (first token, HiddenStates of the prompt);
    # hidden as layer ids: those layers' states side by side (EAGLE-3, spec.feature_layers).
    # generated_from: with structured output, where generated tokens start in
    # prompt_ids (a resumed request's; the constraint consumes them).
    async def open(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling,
        *,
        hidden: bool | tuple[int, ...] = False,
        generated_from: int = 0,
    ) -> Any: ...
    async def verify(self, session_id: str, draft: Draft) -> Verdict: ...
    async def close(self, session_id: str) -> None: ...


class DrafterClient(Protocol):
    async def open(self, session_id: str, prompt_ids: list[int], sampling, *, generated_from: int = 0) -> None: ...
    # The call's fields are ProposeRequest's (specd_core/net/wire.py converts).
    async def propose(self, call: ProposeCall) -> Draft: ...
    async def close(self, session_id: str) -> None: ...
    # Whether the session is the one session this orchestrator has open on the
    # replica (pipelined drafting's "auto" drafts ahead only then).
    def alone(self) -> bool: ...


class NoTrace:
    """The trace hooks of the loop when tracing is off (orchestrator/report/tracing.py
    has the real ones): `scope` makes the request span current around the
    session calls; `start_cycle` opens a cycle's span (None here), `current`
    makes it current around the draft and verify calls that nest under it,
    `end_cycle` puts the cycle's record on it and ends it. A cycle's span is
    opened before its Propose leaves, which is during the previous cycle."""

    _null = contextlib.nullcontext()

    def scope(self) -> contextlib.AbstractContextManager:
        return self._null

    def start_cycle(self) -> Any:
        return None

    def current(self, span) -> contextlib.AbstractContextManager:
        return self._null

    def end_cycle(self, span, cycle: CycleRecord | None = None) -> None:
        pass


NO_TRACE = NoTrace()
