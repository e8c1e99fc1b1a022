"""The spans of one Generate: a request span with the GenAI semantic-convention
attributes, and a span per cycle carrying the loop's CycleRecord as `specdec.*`
attributes. The loop only calls the hooks (`scope`, `start_cycle`, `current`, `end_cycle`); when
tracing is off it gets no-op hooks (`OFF`) and none of this runs.

Context is made current only around awaits that never cross a `yield` of the
loop (an async generator): a context attached across a yield would leak into
the consumer's code and could be detached from another task.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from orchestrator.cycle.ports import NoTrace
from orchestrator.cycle.records import CycleRecord
from specd_core.telemetry import tracing


def cycle_attributes(c: CycleRecord, method: str) -> dict:
    depth = c.depth
    return {
        "specdec.cycle.index": c.index,
        "specdec.method": method,
        "specdec.draft.depth": depth,  # K of a chain; 0 = plain decode
        "specdec.draft.nodes": len(c.draft.tokens),  # tree nodes verified (= K for a chain)
        "specdec.accepted_length": c.accepted,
        "specdec.committed_tokens": len(c.verdict.tokens),  # accepted + correction/bonus
        "specdec.bonus_token": c.bonus,
        "specdec.accepted_per_position": [1] * c.accepted + [0] * (depth - c.accepted),
        "specdec.draft_ms": c.draft.compute_ms,
        "specdec.verify_ms": c.verdict.compute_ms,
        "specdec.wall_ms": c.wall_ms,
        "specdec.overhead_ms": c.overhead_ms,
        # Pipelined drafting: this cycle's draft was made during the previous
        # verify; the Propose call's wall time and how much of it the cycle waited.
        "specdec.draft.pipelined": c.draft.ahead,
        "specdec.draft.call_ms": c.draft.call_ms,
        "specdec.draft.wait_ms": c.draft.wait_ms,
        # Which pre-drafted outcome it was: 0 = all kept + guessed bonus, i > 0 =
        # the ahead call's i-th alternative (a rejection outcome or bonus guess).
        "specdec.draft.branch": c.draft.branch,
        # The drafter's stopping threshold this cycle (0 = off) and the nodes
        # it left without the children the shape gave them.
        "specdec.draft.min_confidence": c.draft.min_confidence,
        "specdec.draft.confidence_pruned": c.draft.pruned,
        # Structured output: draft nodes the constraint forced (q = 1; no
        # drafter level spent on them) and how many of them were kept.
        "specdec.draft.forced_tokens": len(c.draft.forced_nodes),
        "specdec.draft.forced_accepted": c.forced_accepted,
    }


class NoRequestTrace(NoTrace):
    """Tracing off: the loop's no-op hooks plus the edge's."""

    def describe(self, spec) -> None:
        pass

    def finish(self, chunk, error: BaseException | None = None) -> None:
        pass


OFF = NoRequestTrace()


class RequestTrace(NoTrace):
    def __init__(self, parent_context, attributes: dict):
        self.span = tracing.tracer.start_span(
            "specdec.generate", context=parent_context, kind=SpanKind.SERVER, attributes=attributes
        )
        self.method = ""

    def describe(self, spec) -> None:
        """What was asked, once the request is validated."""
        self.method = spec.method
        if spec.sampling.seed < 2**63:  # OTLP ints are int64; seeds are uint64
            self.span.set_attribute("gen_ai.request.seed", spec.sampling.seed)
        self.span.set_attributes(
            {
                "gen_ai.request.max_tokens": spec.max_new_tokens,
                "gen_ai.request.temperature": spec.sampling.temperature,
                "gen_ai.request.top_p": spec.sampling.top_p,
                "gen_ai.request.top_k": spec.sampling.top_k,
                "gen_ai.usage.input_tokens": len(spec.prompt_ids),
                "specdec.method": spec.method,
                "specdec.draft.depth": spec.shape.depth if spec.shape else 0,
            }
        )

    def scope(self):
        return trace.use_span(self.span, end_on_exit=False, record_exception=False, set_status_on_exception=False)

    def start_cycle(self):
        return tracing.tracer.start_span("specdec.cycle", context=trace.set_span_in_context(self.span))

    def current(self, span):
        return trace.use_span(span, end_on_exit=False) if span is not None else self._null

    def end_cycle(self, span, cycle: CycleRecord | None = None) -> None:
        """cycle None: the stream ended before the cycle did (its span is closed as it is)."""
        if span is None:
            return
        if cycle is not None:
            span.set_attributes(cycle_attributes(cycle, self.method))
        span.end()

    def finish(self, chunk, error: BaseException | None = None) -> None:
        """End the request span with what was produced (chunk: the last one, if any)."""
        if chunk is not None:
            s = chunk.stats
            self.span.set_attributes(
                {
                    "gen_ai.usage.output_tokens": s.completion_tokens,
                    "specdec.cycles": s.cycles,
                    "specdec.drafted_tokens": s.drafted_tokens,
                    "specdec.accepted_tokens": s.accepted_tokens,
                    "specdec.mean_accepted_length": s.mean_accepted_length,
                }
            )
            if chunk.emit.finish_reason:
                self.span.set_attribute("gen_ai.response.finish_reasons", [chunk.emit.finish_reason])
        if error is not None:
            self.span.set_attribute("error.type", type(error).__name__)
            self.span.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
            if isinstance(error, Exception):  # not GeneratorExit / CancelledError: the client left
                self.span.record_exception(error)
        self.span.end()


def request_trace(parent_context, model: str, session_id: str) -> NoRequestTrace | RequestTrace:
    """A RequestTrace when tracing is on, else the no-op hooks."""
    if not tracing.ENABLED:
        return OFF
    return RequestTrace(
        parent_context,
        {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": model,
            "specdec.session_id": session_id,
        },
    )
