"""A real OTLP/gRPC trace receiver for the benchmarks, and the span accounting
that checks every span of a traced run arrived (benchmarks/traced.py); the
receiver also keeps the attributes of the spans of one name
(benchmarks/pipeline.py reads the cycles' from them).

The traced services export to `OtlpSink` over a real socket, so they pay the
full export cost (with no collector listening, exports fail fast and drop
spans, which would understate it). The sink counts spans by name and drops
them. `expected_spans` says how many of each name a set of finished requests
must have produced, from their GenerationStats (the span tree is
docs/tracing.md's "The spans of one Generate"); `missing_spans` compares.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable

# Every sampled request, so that the count of spans can be checked exactly.
TRACED_ENV = {"OTEL_TRACES_SAMPLER": "always_on", "OTEL_SDK_DISABLED": "false"}
# The untraced stack is untraced even when the shell exports an OTLP endpoint.
UNTRACED_ENV = {"OTEL_SDK_DISABLED": "true"}


class OtlpSink:
    """An OTLP/gRPC TraceService on a free local port that counts the spans it
    receives by name (`counts()`, `spans`); of the spans named `keep` it also
    keeps the attributes (`take`), and nothing else of any."""

    def __init__(self, keep: str | None = None):
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc

        sink = self
        self.keep = keep
        self._lock = threading.Lock()
        self._names: Counter = Counter()
        self._kept: list[dict] = []

        class Servicer(tgrpc.TraceServiceServicer):
            def Export(self, request, context):
                spans = [span for r in request.resource_spans for s in r.scope_spans for span in s.spans]
                kept = [_attributes(span) for span in spans if span.name == keep]
                with sink._lock:
                    sink._names.update(span.name for span in spans)
                    sink._kept += kept
                return tpb.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        tgrpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint_env(self) -> dict:
        """The environment that makes the services trace every request to this sink."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.port}", **TRACED_ENV}

    @property
    def spans(self) -> int:
        with self._lock:
            return sum(self._names.values())

    def counts(self) -> Counter:
        """Spans received so far, by name (a copy)."""
        with self._lock:
            return Counter(self._names)

    def wait_for(self, expected: dict[str, int], since: Counter, timeout_s: float = 60.0) -> Counter:
        """The spans received after `since` (an earlier counts()), once every
        expected name has its count, or at the timeout: the services export in
        batches (OTEL_BSP_SCHEDULE_DELAY, 5 s by default), so the last spans of
        a run arrive a few seconds after its last token."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.counts() - since
            if not missing_spans(expected, got) or time.monotonic() > deadline:
                return got
            time.sleep(0.2)

    def take(self, expected: int, timeout_s: float = 30.0) -> list[dict]:
        """The attributes of the kept spans received so far (and forgotten
        here), once `expected` of them are in: the exporters batch, so the last
        ones arrive a little after the streams end."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if len(self._kept) >= expected:
                    break
            time.sleep(0.2)
        with self._lock:
            got, self._kept = self._kept, []
        # A span or two may still be in an exporter's queue; a run whose spans
        # are mostly missing is an error, not a result.
        if not expected * 0.98 <= len(got) <= expected:
            raise RuntimeError(f"expected {expected} {self.keep} spans, received {len(got)}")
        return got

    def stop(self) -> None:
        self.server.stop(0)


def _attributes(span) -> dict:
    """A span's attributes as {key: value} (the value of whichever kind is set)."""

    def value(v):
        return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None

    return {a.key: value(a.value) for a in span.attributes}


def expected_spans(stats: Iterable[dict]) -> dict[str, int]:
    """The fewest spans of each name that these finished requests made, from
    their GenerationStats (as dicts with proto field names): per request its
    `specdec.generate` span and the verifier prefill (client and server side);
    per verify cycle a `specdec.cycle`, its `specdec.verify` client span and
    the verifier's `verifier.verify`; per cycle that verified a draft
    (`drafts`) a `specdec.draft` span, with its drafter's `drafter.propose`
    server span unless the draft came from the orchestrator itself (ngram)."""
    out: Counter = Counter()
    for s in stats:
        cycles, drafts = int(s.get("cycles", 0)), int(s.get("drafts", 0))
        out.update(
            {
                "specdec.generate": 1,
                "specdec.prefill": 1,
                "verifier.prefill": 1,
                "specdec.cycle": cycles,
                "specdec.verify": cycles,
                "verifier.verify": cycles,
                "specdec.draft": drafts,
            }
        )
        if s.get("method") not in ("ngram", "off", ""):
            out["drafter.propose"] += drafts
    return {k: v for k, v in sorted(out.items()) if v}


def missing_spans(expected: dict[str, int], received: dict[str, int]) -> dict[str, int]:
    """Per span name, how many of the expected did not arrive (names with none missing left out)."""
    return {k: n - received.get(k, 0) for k, n in expected.items() if received.get(k, 0) < n}
