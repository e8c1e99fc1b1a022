"""After known traffic, the Prometheus endpoints of the
orchestrator, the drafter and the verifier (real processes, scraped over HTTP)
count exactly what the requests' final stats say.

The stack is the session's metered one (tests/conftest.py), which other modules
also drive: counters are compared as their increase over this test's traffic
(scraped idle before and after it), gauges as they are once idle."""
import collections
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.services

PROMPT = {"ids": [40, 41, 42, 43, 44]}
# (fields, method that runs): chains, a static and a dynamic tree, sampling, ngram, off.
# Nothing drafted ahead (pipeline_drafting off; a lone greedy stream would by
# default): the drafter's counts then equal the drafts verified.
TRAFFIC = [
    (dict(num_speculative_tokens=3, pipeline_drafting=False), "draft_model"),
    (dict(num_speculative_tokens=5, temperature=0.8, seed=3), "draft_model"),
    (dict(tree={"branching": [2, 2, 1]}), "draft_model"),
    (dict(tree={"node_budget": 6, "max_depth": 4}), "draft_model"),
    (dict(speculative_method="ngram", num_speculative_tokens=3), "ngram"),
    (dict(num_speculative_tokens=0), "off"),
]


def scrape(address: str) -> dict:
    """{(sample name, frozenset(labels)): value} of one /metrics endpoint."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def increase(after: dict, before: dict) -> dict:
    """Each sample's increase from one scrape to a later one (for counters)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def wait_idle(stack, timeout_s=20.0) -> tuple[dict, dict, dict]:
    """Scrape all three once their sessions are closed (closing runs after the
    last message of a stream has gone out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = [scrape(p.metrics_address) for p in (stack.orchestrator, stack.drafter_proc, stack.verifier)]
        if all(value(g, "specdec:active_sessions") == 0 for g in got) or time.monotonic() > deadline:
            return tuple(got)
        time.sleep(0.1)


def test_metrics_count_the_request_stats(metered):
    stack = metered
    assert all(p.metrics_address for p in (stack.orchestrator, stack.drafter_proc, stack.verifier))
    before = wait_idle(stack)
    stats = collections.defaultdict(list)
    for fields, method in TRAFFIC:
        ids, last = stack.generate(prompt_token_ids=PROMPT, max_new_tokens=16, **fields)
        assert last.stats.method == method and len(ids) == last.stats.completion_tokens
        stats[method].append(last.stats)
    after = wait_idle(stack)
    orch, drafter, verifier = (increase(a, b) for a, b in zip(after, before))

    def total(method, key):
        return sum(getattr(s, key) for s in stats[method])

    def per_pos(method):
        out = collections.Counter()
        for s in stats[method]:
            for i, n in enumerate(s.accepted_per_position):
                out[i] += n
        return out

    every = [s for ss in stats.values() for s in ss]
    assert sum(total(m, "accepted_tokens") for m in stats) > 0        # drafts were really kept
    # Orchestrator: per method.
    for method in stats:
        assert value(orch, "specdec:spec_decode_num_drafts_total", method=method) == total(method, "drafts")
        assert value(orch, "specdec:spec_decode_num_draft_tokens_total", method=method) == \
            total(method, "drafted_tokens")
        assert value(orch, "specdec:spec_decode_num_accepted_tokens_total", method=method) == \
            total(method, "accepted_tokens")
        for pos, n in per_pos(method).items():
            assert value(orch, "specdec:spec_decode_num_accepted_tokens_per_pos_total",
                         method=method, position=str(pos)) == n
        n = len(stats[method])
        assert value(orch, "specdec:time_to_first_token_seconds_count", method=method) == n
        # One inter-token latency per streamed token after the first.
        assert value(orch, "specdec:inter_token_latency_seconds_count", method=method) == \
            total(method, "completion_tokens") - n
        assert value(orch, "specdec:generation_tokens_total", method=method) == total(method, "completion_tokens")
        assert value(orch, "specdec:prompt_tokens_total", method=method) == total(method, "prompt_tokens")
        assert value(orch, "specdec:request_success_total", method=method, finished_reason="length") == n
    assert value(orch, "specdec:spec_decode_num_drafts_total", method="off") == 0

    # Verifier: every method's drafts went through it.
    assert value(verifier, "specdec:spec_decode_num_drafts_total") == sum(s.drafts for s in every)
    assert value(verifier, "specdec:spec_decode_num_draft_tokens_total") == sum(s.drafted_tokens for s in every)
    assert value(verifier, "specdec:spec_decode_num_accepted_tokens_total") == sum(s.accepted_tokens for s in every)
    for pos, n in sum((per_pos(m) for m in stats), collections.Counter()).items():
        assert value(verifier, "specdec:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == n
    cycles = sum(s.cycles for s in every)
    # Every session-cycle is in exactly one forward; concurrent ones may share it.
    assert value(verifier, "specdec:verify_batch_size_sum") == cycles
    assert 0 < value(verifier, "specdec:verify_batch_size_count") <= cycles
    assert value(verifier, "specdec:verify_forward_tokens_sum") == cycles + sum(s.drafted_tokens for s in every)

    # Drafter: only draft_model requests reach it; it counts what it proposed.
    assert value(drafter, "specdec:spec_decode_num_drafts_total") == total("draft_model", "drafts")
    assert value(drafter, "specdec:spec_decode_num_draft_tokens_total") == total("draft_model", "drafted_tokens")

    # Everything closed: no sessions, no KV in use (the gauges themselves).
    for samples in after:
        assert value(samples, "specdec:active_sessions") == 0
    assert value(after[2], "specdec:kv_cache_tokens") == 0
    assert value(after[2], "specdec:kv_cache_usage") == 0


def test_gauges_see_open_sessions(metered):
    """While a session is open the verifier's gauges show it; they fall back after."""
    import grpc

    from specd_core.api.v1 import specdec_pb2 as pb
    from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc

    v = pb_grpc.VerifierServiceStub(grpc.insecure_channel(metered.verifier.address))
    v.OpenSession(pb.OpenVerifySessionRequest(session_id="m1", prompt_token_ids=[1, 2, 3, 4]), timeout=30)
    try:
        during = scrape(metered.verifier.metrics_address)
        assert value(during, "specdec:active_sessions") == 1
        assert value(during, "specdec:kv_cache_tokens") == 4       # the prompt; the first token is pending
        assert 0 < value(during, "specdec:kv_cache_usage") < 1e-3
    finally:
        v.CloseSession(pb.CloseSessionRequest(session_id="m1"), timeout=30)
    after = scrape(metered.verifier.metrics_address)
    assert value(after, "specdec:active_sessions") == 0 and value(after, "specdec:kv_cache_tokens") == 0


def exported_series(text: str) -> set[str]:
    """The series names a /metrics text can hold, from its `# TYPE` lines: a
    counter X is X_total, a histogram X_bucket / X_sum / X_count, a gauge X.
    (A labelled metric with no sample yet still has its TYPE line.)"""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count", ""),
                "gauge": ("",), "untyped": ("",), "info": ("_info",)}
    out = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if kind == "counter":             # the classic text format names a counter's family with _total
                name = name.removesuffix("_total")
            out |= {name + s for s in suffixes[kind]}
    return out


def unexported(exprs, exported: set[str]) -> list[tuple[str, str]]:
    """(panel, series) of every series a query selects that no service exports."""
    from tests.test_deploy_files import selector_names
    return sorted({(title, n) for title, expr in exprs for n in selector_names(expr) if n not in exported})


def test_dashboard_queries_only_exported_metrics(metered):
    """Every series deploy/grafana/specd.json queries is one the orchestrator,
    drafter or verifier really exports (after a Generate), with the suffix its
    type gives it in the exposition (a counter queried without `_total`, a
    histogram without `_bucket` or a misspelt name is caught)."""
    from tests.test_deploy_files import dashboard_exprs

    ids, last = metered.generate(prompt_token_ids=PROMPT, max_new_tokens=8, num_speculative_tokens=3)
    assert len(ids) == 8 and last.stats.drafts > 0
    wait_idle(metered)
    exported = set()
    for p in (metered.orchestrator, metered.drafter_proc, metered.verifier):
        exported |= exported_series(urllib.request.urlopen(f"http://{p.metrics_address}/metrics", timeout=10)
                                    .read().decode())
    # The metrics the dashboard was built on exist (a sanity check of the scrape itself).
    assert {"specdec:cycle_latency_seconds_bucket", "specdec:failovers_total", "specdec:kv_cache_usage",
            "specdec:active_sessions", "specdec:verify_batch_size_count"} <= exported
    exprs = dashboard_exprs()
    assert len(exprs) >= 12
    assert unexported(exprs, exported) == []
    # What the check catches: a misspelt name, a counter without its suffix.
    bad = [("t", "rate(specdec:spec_decode_num_draft_token_total[1m])"),
           ("t", "rate(specdec:spec_decode_num_drafts[1m])")]
    assert len(unexported(bad, exported)) == 2
