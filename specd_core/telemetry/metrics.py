"""Prometheus metrics shared by the services: the /metrics endpoint and the
vLLM-compatible speculative-decoding counters (`specdec:` prefix instead of `vllm:`).

Each service module declares its own metrics through `metric()`, which returns
the already registered collector when a name is declared twice in one process
(a test or a Ray worker may import more than one service).
"""

from __future__ import annotations

import hmac
import os
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY, Counter, disable_created_metrics, make_wsgi_app, start_http_server
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics import MetricWrapperBase

# Set, every /metrics endpoint specd serves answers only requests that carry
# `Authorization: Bearer <token>` (401 otherwise): on a cluster the endpoints
# bind the node's address, where other tenants of the network may reach them.
# An environment variable rather than a flag, so that one setting reaches every
# process and Ray actor of a deployment (specd/ray_deploy.py passes it on).
METRICS_TOKEN_ENV = "SPECD_METRICS_TOKEN"

# No `*_created` series per counter/histogram (as vLLM): noise for dashboards.
disable_created_metrics()
_made: dict[str, MetricWrapperBase] = {}
_lock = threading.Lock()

# Latency buckets (seconds): vLLM's, with a few below 10 ms for small models.
TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
COUNT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)


def metric(cls, name: str, documentation: str, labelnames=(), **kwargs):
    """The collector `name`, registered once per process."""
    with _lock:
        if name not in _made:
            _made[name] = cls(name, documentation, labelnames, registry=REGISTRY, **kwargs)
        made = _made[name]
    if tuple(made._labelnames) != tuple(labelnames):
        raise ValueError(f"metric {name} is declared with labels {made._labelnames} and {tuple(labelnames)}")
    return made


def count_expired_sessions(table) -> None:
    """Count the sessions a replica's session table closes by itself
    (specd_core/runtime/sessions.py: its `on_expired`), by reason: `idle` (no
    call for session_idle_timeout_s) or `owner` (their orchestrator not heard
    from for owner_timeout_s)."""
    counter = metric(
        Counter,
        "specdec:sessions_expired",
        "Sessions the replica closed by itself: idle (no call for session_idle_timeout_s) or owner "
        "(their orchestrator not heard from for owner_timeout_s).",
        ("reason",),
    )
    table.on_expired = lambda reason, n: counter.labels(reason).inc(n)


def count_prefix_cache(cache) -> None:
    """Count a replica's prefix-cache lookups (specd_core/runtime/prefix_cache.py:
    its `on_query`) in prompt tokens, as vLLM's prefix_cache_queries / _hits:
    hits / queries is the share of prompt tokens not computed. None: off."""
    if cache is None:
        return
    queries = metric(Counter, "specdec:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
    hits = metric(Counter, "specdec:prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).")

    def observe(queried: int, hit: int) -> None:
        queries.inc(queried)
        hits.inc(hit)

    cache.on_query = observe


def serve(port: int, host: str = "127.0.0.1") -> int:
    """Serve /metrics over HTTP on a daemon thread; port 0 = any free port.
    Returns the bound port. With $SPECD_METRICS_TOKEN set, only requests
    bearing that token are answered."""
    token = os.environ.get(METRICS_TOKEN_ENV, "")
    if not token:
        server, _ = start_http_server(port, addr=host)
        return server.server_port
    app = bearer_only(make_wsgi_app(REGISTRY), token)
    httpd = make_server(host, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True, name="metrics").start()
    return httpd.server_port


def bearer_only(app, token: str):
    """A WSGI app that answers 401 unless the request bears `token`."""
    expected = f"Bearer {token}".encode()

    def guarded(environ, start_response):
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        if not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("WWW-Authenticate", "Bearer"), ("Content-Type", "text/plain")])
            return [b"a bearer token is required ($SPECD_METRICS_TOKEN of the deployment)\n"]
        return app(environ, start_response)

    return guarded


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape on the service's stderr."""

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


class SpecDecodeCounters:
    """vLLM's spec-decode counters: drafts, draft tokens, accepted tokens, and
    accepted tokens per draft position (0 = the first draft token)."""

    def __init__(self, labelnames=(), acceptance: bool = True):
        """acceptance=False: only the draft counters (a drafter never learns
        the fate of a session's last draft)."""
        self.drafts = metric(
            Counter, "specdec:spec_decode_num_drafts", "Speculation cycles that verified a non-empty draft.", labelnames
        )
        self.draft_tokens = metric(
            Counter,
            "specdec:spec_decode_num_draft_tokens",
            "Draft tokens (tree nodes) proposed for verification.",
            labelnames,
        )
        self.accepted = self.per_pos = None
        if acceptance:
            self.accepted = metric(
                Counter, "specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted by the verifier.", labelnames
            )
            self.per_pos = metric(
                Counter,
                "specdec:spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens per draft position (0 = depth 1).",
                tuple(labelnames) + ("position",),
            )
        self._children: dict[tuple, tuple] = {}  # label values -> resolved children

    def _for(self, labels: tuple):
        c = self._children.get(labels)
        if c is None:  # first use of these labels: resolve the children once
            if labels:
                c = (
                    self.drafts.labels(*labels),
                    self.draft_tokens.labels(*labels),
                    self.accepted.labels(*labels) if self.accepted else None,
                    [],
                )
            else:
                c = (self.drafts, self.draft_tokens, self.accepted, [])
            self._children[labels] = c
        return c

    def observe(self, draft_tokens: int, accepted: int, labels: tuple = ()) -> None:
        """One verified draft of `draft_tokens` nodes of which `accepted` (a
        root-down path) were kept. An empty draft is no draft."""
        if not draft_tokens:
            return
        drafts, tokens, acc, per_pos = self._for(labels)
        drafts.inc()
        tokens.inc(draft_tokens)
        if accepted:
            acc.inc(accepted)
            if len(per_pos) < accepted:
                assert self.per_pos is not None  # accepted counts come only with acceptance=True
                with _lock:  # sync servers observe from many threads
                    while len(per_pos) < accepted:
                        per_pos.append(self.per_pos.labels(*labels, str(len(per_pos))))
            for i in range(accepted):
                per_pos[i].inc()
