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
TRAFFIC = [
    (dict(num_speculative_tokens=3), "draft_model"),
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

    from specd.api.v1 import specdec_pb2 as pb
    from specd.api.v1 import specdec_pb2_grpc as pb_grpc

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
