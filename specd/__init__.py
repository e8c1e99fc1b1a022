"""specd: speculative decoding served as separate drafter and verifier services.

The repository's top-level packages are layers; each imports only the ones
listed before it (docs/architecture.md draws the graph):

    specd_core    what the three services share, itself layered: errors, rules
                  (the pure rules that keep output exact), runtime (models and
                  how they run), telemetry, api (the generated gRPC stubs of
                  proto package specdec.v1), net (the gRPC edge)
    drafter_svc, verifier_svc, orchestrator
                  the three services: a core object and a thin servicer each;
                  `python -m drafter_svc` etc.
    specd         this package: the `specd` command, the Ray cluster and
                  deployment, local process stacks for tests and benchmarks
"""

__version__ = "0.1.0"
