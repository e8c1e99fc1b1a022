"""Per-cycle traces across the three services.

A real OTLP/gRPC receiver (opentelemetry-proto's TraceService) runs in this
process; the verifier, drafter and orchestrator run as real processes exporting
to it (OTEL_EXPORTER_OTLP_ENDPOINT). One Generate must give one trace, spanning
all three services, with a span per cycle whose draft/verify client spans
parent the drafter's and verifier's server spans.
"""
import collections
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from specd.local_stack import Stack
from specd_core.telemetry import tracing

PROMPT = {"ids": [40, 41, 42, 43, 44, 45]}
MAX_NEW = 20


def _value(v):
    """An OTLP AnyValue as a Python value."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects exported spans as dicts: service, name, ids, kind, attributes."""

    def __init__(self):
        self.spans, self.lock = [], threading.Lock()

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(dict(service=resource.get("service.name"), name=s.name, trace=s.trace_id.hex(),
                                    id=s.span_id.hex(), parent=s.parent_span_id.hex(), kind=s.kind,
                                    start=s.start_time_unix_nano, end=s.end_time_unix_nano,
                                    attrs={a.key: _value(a.value) for a in s.attributes},
                                    events={e.name: {a.key: _value(a.value) for a in e.attributes}
                                            for e in s.events}))
        with self.lock:
            self.spans += got
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    r = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(r, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    r.endpoint = f"http://127.0.0.1:{port}"
    yield r
    server.stop(0)


@pytest.fixture(scope="module")
def traced_stack(pairs, receiver):
    target, drafter = pairs["llama"]
    stack = Stack(target, drafter, env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                                        "OTEL_BSP_SCHEDULE_DELAY": "200"})
    yield stack
    stack.stop()


def _generate_traced(stack, receiver, **fields):
    """Run one Generate under a client trace context; wait for its spans."""
    trace_id, client_span = f"{time.time_ns():032x}"[-32:], "00f067aa0ba902b7"
    tp = f"00-{trace_id}-{client_span}-01"
    ids, last = stack.generate(metadata=(("traceparent", tp),), prompt_token_ids=PROMPT,
                               max_new_tokens=MAX_NEW, **fields)
    s = last.stats
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        spans = receiver.trace(trace_id)
        names = collections.Counter(x["name"] for x in spans)
        if (names["specdec.generate"] == 1 and names["specdec.cycle"] >= s.cycles
                and names["verifier.verify"] >= s.cycles and names["drafter.propose"] >= s.drafts
                and names["verifier.close"] and names["drafter.close"]):
            break
        time.sleep(0.1)
    return ids, last, spans, client_span


def _one(spans, name):
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, (name, len(found))
    return found[0]


def _children(spans, parent, name):
    return [s for s in spans if s["parent"] == parent["id"] and s["name"] == name]


# Plain drafting (a lone greedy chain would by default draft ahead, a second
# draft span in a cycle: tests/test_pipeline.py).
@pytest.mark.parametrize("fields", [dict(num_speculative_tokens=3, pipeline_drafting=False),
                                    dict(tree={"branching": [2, 2, 1]})], ids=["chain3", "tree221"])
@pytest.mark.services
def test_one_generate_is_one_trace_across_services(fields, traced_stack, receiver):
    ids, last, spans, client_span = _generate_traced(traced_stack, receiver, **fields)
    s = last.stats
    assert last.finish_reason == "length" and len(ids) == MAX_NEW
    assert s.cycles > 1 and s.drafts > 0

    # One trace id (the client's), all three services in it.
    assert {x["service"] for x in spans} == {"orchestrator", "drafter", "verifier"}

    # The request span: child of the caller's span, GenAI attributes.
    request = _one(spans, "specdec.generate")
    assert request["parent"] == client_span and request["service"] == "orchestrator"
    a = request["attrs"]
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == Path(traced_stack.target).name     # the target's dir name
    assert a["gen_ai.request.max_tokens"] == MAX_NEW and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == len(PROMPT["ids"])
    assert a["gen_ai.usage.output_tokens"] == len(ids)
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["specdec.cycles"] == s.cycles

    # Prefill: orchestrator client span -> verifier server span, under the request.
    prefill = _one(spans, "specdec.prefill")
    assert prefill["parent"] == request["id"]
    assert _one(spans, "verifier.prefill")["parent"] == prefill["id"]
    assert _one(spans, "drafter.prefill")["parent"] == _one(spans, "specdec.draft_prefill")["id"]

    # A span per cycle, children of the request span.
    cycles = sorted((x for x in spans if x["name"] == "specdec.cycle"), key=lambda x: x["attrs"]["specdec.cycle.index"])
    assert len(cycles) == s.cycles
    assert all(c["parent"] == request["id"] for c in cycles)
    assert [c["attrs"]["specdec.cycle.index"] for c in cycles] == list(range(s.cycles))

    committed, accepted_pos = 0, [0] * s.num_speculative_tokens
    for c in cycles:
        ca = c["attrs"]
        for key in ("specdec.method", "specdec.draft.depth", "specdec.draft.nodes", "specdec.accepted_length",
                    "specdec.bonus_token", "specdec.accepted_per_position", "specdec.draft_ms",
                    "specdec.verify_ms", "specdec.wall_ms", "specdec.overhead_ms"):
            assert key in ca, key
        assert ca["specdec.method"] == "draft_model"
        n, depth = ca["specdec.accepted_length"], ca["specdec.draft.depth"]
        per_pos = ca["specdec.accepted_per_position"] if depth else []
        assert per_pos == [1] * n + [0] * (depth - n)
        for i, x in enumerate(per_pos):
            accepted_pos[i] += x
        if "branching" not in fields.get("tree", {}):
            assert ca["specdec.bonus_token"] == (depth > 0 and n == depth)   # a chain's leaf is its end
        committed += n + 1                                     # the kept path + correction/bonus

        # cycle -> specdec.verify (client) -> verifier.verify (server)
        (verify,) = _children(spans, c, "specdec.verify")
        (server,) = _children(spans, verify, "verifier.verify")
        assert server["service"] == "verifier" and server["attrs"]["specdec.accepted_length"] == n
        # The call's phases are events on its span, each with its duration.
        assert not [x for x in spans if x["parent"] == server["id"]]
        assert set(server["events"]) == {"verifier.forward", "verifier.accept", "verifier.compact"}
        assert all(e["specdec.phase_ms"] >= 0 for e in server["events"].values())
        assert server["events"]["verifier.forward"]["specdec.phase_ms"] > 0
        # cycle -> specdec.draft (client) -> drafter.propose (server), when the cycle drafted
        drafts = _children(spans, c, "specdec.draft")
        assert len(drafts) == (1 if depth else 0)
        for d in drafts:
            (propose,) = _children(spans, d, "drafter.propose")
            assert propose["service"] == "drafter"
            assert propose["attrs"]["specdec.draft.nodes"] == ca["specdec.draft.nodes"]
            assert set(propose["events"]) == {"drafter.forward", "drafter.tree"}

    # Accepted lengths plus one correction/bonus per cycle = the streamed tokens
    # after the prefill's.
    assert committed == len(ids) - 1
    assert accepted_pos == list(s.accepted_per_position)
    assert sum(c["attrs"]["specdec.accepted_length"] for c in cycles) == s.accepted_tokens


@pytest.mark.unit
def test_tracing_is_off_without_an_endpoint(monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert not tracing.configured()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    assert tracing.configured()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.configured()
    # Off: the helpers hand back one shared no-op context, no span objects.
    assert not tracing.ENABLED
    assert tracing.client_span("x") is tracing.server_span("y", "00-ab-cd-01") is tracing.span("z")
    assert tracing.outgoing_metadata() is None


@pytest.mark.unit
def test_cycle_record_and_attributes():
    """The per-cycle data the loop produces (pure): depth, bonus vs correction,
    per-position acceptance, in Stats and in the cycle span's attributes."""
    from orchestrator.cycle.loop import Draft, Stats, Verdict
    from orchestrator.report.tracing import cycle_attributes

    tree = Draft(tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 2], compute_ms=1.0)   # 0 -> 2 -> 3, and 1
    stats = Stats(num_speculative_tokens=3, method="draft_model")
    leaf = stats.observe_cycle(tree, Verdict([0, 2, 3], [5, 7, 8, 9], 2.0), wall_ms=4.0)
    inner = stats.observe_cycle(tree, Verdict([0, 2], [5, 7, 1], 2.0), wall_ms=4.0)
    plain = stats.observe_cycle(Draft(), Verdict([], [3], 1.0), wall_ms=2.0)
    assert (leaf.depth, leaf.bonus, inner.bonus, plain.depth, plain.bonus) == (3, True, False, 0, False)
    assert stats.drafts == 2 and stats.accepted_per_position == [2, 2, 1]
    a = cycle_attributes(inner, "draft_model")
    assert a["specdec.cycle.index"] == 1 and a["specdec.draft.nodes"] == 4 and a["specdec.draft.depth"] == 3
    assert a["specdec.accepted_per_position"] == [1, 1, 0] and a["specdec.committed_tokens"] == 3
    assert a["specdec.overhead_ms"] == 1.0 and a["specdec.bonus_token"] is False


@pytest.mark.unit
def test_default_sampler_is_parent_based_ratio(monkeypatch):
    """Without OTEL_TRACES_SAMPLER: parent-based trace-id ratio at
    OTEL_TRACES_SAMPLER_ARG (all when unset), so a request is traced whole or
    not at all; with it, the SDK's own choice; a bad ratio is refused by name."""
    from opentelemetry.sdk.trace.sampling import Decision
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    monkeypatch.delenv("OTEL_TRACES_SAMPLER_ARG", raising=False)
    every = tracing.default_sampler()
    assert "ParentBased" in every.get_description() and "1.0" in every.get_description()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.0")
    none = tracing.default_sampler()
    root = none.should_sample(None, 0x1234, "specdec.generate")
    assert root.decision == Decision.DROP  # ratio 0: no request is traced ...

    def under(sampled: bool):
        flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
        parent = NonRecordingSpan(SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=flags))
        return none.should_sample(set_span_in_context(parent), 0x1234, "verifier.verify").decision

    # ... but a span follows its parent's decision: a sampled request is kept whole.
    assert under(True) == Decision.RECORD_AND_SAMPLE and under(False) == Decision.DROP
    for bad in ("1.5", "-0.1", "half"):
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", bad)
        with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER_ARG"):
            tracing.default_sampler()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    assert tracing.default_sampler() is None  # the SDK reads it
