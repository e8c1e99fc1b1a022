"""OpenTelemetry tracing for every service: setup from the standard OTEL_*
variables, W3C `traceparent` propagation, and the few span helpers the edges use.

Tracing is on only when an OTLP endpoint is configured
(OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) and
OTEL_SDK_DISABLED is not true. The SDK itself reads OTEL_SERVICE_NAME,
OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG) (default_sampler), OTEL_BSP_* and
OTEL_EXPORTER_OTLP_* (headers, timeout, insecure). When off, every helper here
returns a shared no-op context manager after one flag test: no span objects,
no context switches on the hot path.

Propagation: unary calls carry `traceparent` in gRPC metadata. The per-cycle
Propose/Verify messages travel on long-lived bidirectional streams shared by
all sessions, so call metadata (sent once per stream) cannot carry a per-cycle
context; those messages carry it in their own `traceparent` field.

Cores never call this module; they return timing data (`specd_core.runtime.phases`) that the
servicers turn into child spans (`add_phases`).
"""

from __future__ import annotations

import contextlib
import logging
import os

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

ENABLED = False  # set by setup(); read at call time, never imported by value
tracer = trace.get_tracer("specd")  # a proxy: real once setup() installs a provider
_provider = None
_propagator = TraceContextTextMapPropagator()
_NULL = contextlib.nullcontext()  # reusable: what every helper returns when off
_TRUE = ("1", "true", "yes", "on")


def configured() -> bool:
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup(default_service_name: str) -> bool:
    """Install a TracerProvider exporting over OTLP/gRPC if the environment asks
    for one; return whether tracing is on. Idempotent per process."""
    global ENABLED, _provider
    if _provider is not None or not configured():
        return ENABLED
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()  # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    _provider = TracerProvider(resource=resource, sampler=default_sampler())
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(_provider)
    ENABLED = True
    log.info("tracing on: service.name=%s", resource.attributes.get(SERVICE_NAME))
    return True


def default_sampler():
    """OTEL_TRACES_SAMPLER when set (the SDK reads it and its _ARG); else
    parent-based trace-id ratio at OTEL_TRACES_SAMPLER_ARG (1.0 when unset).
    Parent-based keeps whole requests: the orchestrator decides once per
    request (or follows its caller's traceparent) and every span below it,
    the drafter's and verifier's too, follows that decision. So
    OTEL_TRACES_SAMPLER_ARG=0.05 alone traces 5 % of requests, whole."""
    if os.environ.get("OTEL_TRACES_SAMPLER"):
        return None
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    raw = os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
    try:
        ratio = float(raw)
    except ValueError:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a ratio in [0, 1], got {raw!r}") from None
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a ratio in [0, 1], got {raw!r}")
    return ParentBased(TraceIdRatioBased(ratio))


def shutdown() -> None:
    """Export what is queued and stop (a service's graceful exit)."""
    if _provider is not None:
        _provider.shutdown()


def flush(timeout_ms: int = 5000) -> None:
    if _provider is not None:
        _provider.force_flush(timeout_ms)


# -- propagation -------------------------------------------------------------


def traceparent() -> str:
    """The current span's W3C traceparent ('' when off or no span)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent", "")


def outgoing_metadata():
    """gRPC call metadata carrying the current context; None when off."""
    if not ENABLED:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return tuple(carrier.items()) or None


def extract(traceparent_value: str = "", grpc_context=None):
    """The remote parent context from a message field or from the call's
    metadata (the field wins); None when there is neither."""
    if traceparent_value:
        return _propagator.extract({"traceparent": traceparent_value})
    if grpc_context is not None:
        carrier = {k: v for k, v in grpc_context.invocation_metadata() if k in _propagator.fields}
        if carrier:
            return _propagator.extract(carrier)
    return None


# -- spans ---------------------------------------------------------------------


def server_span(name: str, traceparent_value: str = "", grpc_context=None, attributes=None):
    """A SERVER span (current inside the `with`) under the caller's context."""
    if not ENABLED:
        return _NULL
    return tracer.start_as_current_span(
        name, context=extract(traceparent_value, grpc_context), kind=SpanKind.SERVER, attributes=attributes
    )


def start_server_span(name: str, traceparent_value: str = "", attributes=None):
    """A SERVER span under the caller's context that the caller ends (None
    when off): for a stream message answered on another thread, so that the
    span's bookkeeping can wait until the answer is on its way (end_span)."""
    if not ENABLED:
        return None
    return tracer.start_span(name, context=extract(traceparent_value), kind=SpanKind.SERVER, attributes=attributes)


def end_span(span, error: BaseException | None = None, attributes=None) -> None:
    """End a span from start_server_span, recording the call's error (as a
    `with` span would) and its attributes."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        span.record_exception(error)
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


def end_call_span(span, done, prefix: str, attributes) -> None:
    """End a stream call's server span from its finished batch future: the
    result's phases as events and attributes(result) on success, the error
    otherwise."""
    if span is None:
        return
    error = done.exception()
    if error is not None:
        end_span(span, error)
        return
    result = done.result()
    add_phases(span, prefix, result.phases)
    end_span(span, None, attributes(result))


@contextlib.contextmanager
def _client_span(name, message, attributes):
    with tracer.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes) as span:
        if message is not None:
            message.traceparent = traceparent()
        yield span


def client_span(name: str, message=None, attributes=None):
    """A CLIENT span (child of the current one); its traceparent goes into
    `message.traceparent` when a message is given (a stream message)."""
    if not ENABLED:
        return _NULL
    return _client_span(name, message, attributes)


def span(name: str, attributes=None):
    """An INTERNAL child of the current span."""
    if not ENABLED:
        return _NULL
    return tracer.start_as_current_span(name, attributes=attributes)


def add_phases(parent, prefix: str, phases) -> None:
    """Report a core call's timed phases ((name, start_ns, end_ns), wall clock)
    as events on its span, each at its start with its duration. Events, not
    child spans: a span costs the SDK tens of microseconds to build and more to
    encode for export, and the phases were five of a cycle's ten spans
    (docs/tracing.md, "Overhead")."""
    for name, start_ns, end_ns in phases:
        parent.add_event(f"{prefix}.{name}", {"specdec.phase_ms": (end_ns - start_ns) / 1e6}, timestamp=start_ns)
