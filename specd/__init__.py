"""specd: speculative decoding served as separate drafter and verifier services.

The subpackages are layers; each imports only the ones listed before it
(docs/architecture.md draws the graph):

    errors        the exceptions every layer raises (imports nothing)
    rules         the pure rules that keep output exact: sampling, acceptance,
                  token trees, draft shapes, n-gram lookup (no grpc, no model)
    runtime       models and how they run: loading, the lean engine, sessions
                  and KV caches, the batcher, the EAGLE head (no grpc)
    telemetry     tracing (OpenTelemetry) and Prometheus metrics
    api           the generated gRPC stubs of the wire API (proto package specdec.v1)
    net           the gRPC edge: status mapping, servers and channels, TLS,
                  bearer tokens, proto <-> dataclass conversion
    drafter, verifier, orchestrator
                  the three services: a core object and a thin servicer each
    ops           operations: the `specd` CLI, the Ray cluster and deployment,
                  local process stacks for tests and benchmarks
"""

__version__ = "0.1.0"
