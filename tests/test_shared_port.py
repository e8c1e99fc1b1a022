"""Several orchestrator processes on ONE address without Ray
(`Stack(..., orchestrators=2)`: `python -m orchestrator --share-ports
first|join`, SO_REUSEPORT on the gRPC and the HTTP port), over the same replicas.

- New connections spread over both (each reports its own pid in Status), gRPC
  and HTTP alike, and every one streams target-only greedy output.
- Nothing else can take the port: neither another group's first orchestrator
  nor a plain one (gRPC's own default would have let a second server bind it).
- SIGTERM to one of them: it stops listening, its running stream ends normally,
  and the next call on a connection it held reaches the other one (GOAWAY).
"""
import os
import signal
import time
import urllib.request

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specd.local_stack import ServiceProcess, Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.runtime.models import load_model, load_tokenizer
from tests.test_cluster_scaling import greedy_check, long_pair  # noqa: F401  (a fixture)
from tests.test_greedy_exact import assert_same_or_near_tie, prompts

pytestmark = pytest.mark.services

CONNECTIONS = 16       # all on one of two orchestrators by chance: 2 / 2**16


@pytest.fixture(scope="module")
def group(long_pair):
    target, drafter = long_pair
    stack = Stack(target, drafter, orchestrators=2, http=True, metrics=True)
    yield stack
    stack.stop()


def answered_by(channel) -> int:
    """The pid of the orchestrator a channel's connection reached (off Ray,
    Status lists the answering orchestrator alone)."""
    status = pb_grpc.AdminServiceStub(channel).Status(pb.StatusRequest(), timeout=10)
    assert len(status.orchestrators) == 1
    return status.orchestrators[0].pid


def generate(channel, prompt, n):
    return [t for r in pb_grpc.OrchestratorServiceStub(channel).Generate(pb.GenerateRequest(
        prompt_token_ids=pb.PromptTokenIds(ids=prompt), max_new_tokens=n, num_speculative_tokens=3), timeout=120)
        for t in r.token_ids]


def test_connections_spread_over_both_and_stream_exactly(group, long_pair):
    pids = {o.proc.pid for o in group.orchestrators}
    assert len(group.orchestrators) == 2 and len(pids) == 2 and group.orchestrator is group.orchestrators[0]
    assert len({o.address for o in group.orchestrators}) == 1 and len({o.http_url for o in group.orchestrators}) == 1
    model, tok = load_model(long_pair[0], "cpu"), load_tokenizer(long_pair[0])
    ps = prompts(tok, CONNECTIONS)
    seen = set()
    for i, p in enumerate(ps):
        with group.connect() as ch:
            seen.add(answered_by(ch))
            got = generate(ch, p, 24)
        want, gaps = greedy_check(model, p, got)
        assert_same_or_near_tie(got, want, gaps, f"connection {i}")
    assert seen == pids


def requests_done(address: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "specdec:request_success_total")


def test_http_connections_spread_over_both(group):
    before = [requests_done(o.metrics_address) for o in group.orchestrators]
    for _ in range(CONNECTIONS):        # each request on a connection of its own
        r = httpx2.post(group.openai_base_url + "/completions", timeout=120,
                        json={"model": os.path.basename(group.target), "prompt": "def f(x):", "max_tokens": 4})
        assert r.status_code == 200, r.text
    served = [requests_done(o.metrics_address) - b for o, b in zip(group.orchestrators, before)]
    assert sum(served) == CONNECTIONS and min(served) > 0, served


def test_nothing_else_can_take_the_port(group):
    port = int(group.orchestrator.address.rsplit(":", 1)[1])
    common = ("--target", group.target, "--verifier-address", group.verifier.address, "--num-speculative-tokens", "0")
    # The orchestrator's default host is loopback, where the group listens.
    with pytest.raises(RuntimeError, match=f"cannot serve Generate on 127.0.0.1:{port}: Address already in use"):
        ServiceProcess("orchestrator", *common, "--share-ports", "first", port=port)
    with pytest.raises(RuntimeError, match="Failed to bind to address"):
        ServiceProcess("orchestrator", *common, port=port)


def test_sigterm_moves_new_calls_to_the_other(group, long_pair):
    """Last in the module: it stops one of the two."""
    first, second = group.orchestrators
    channels = [group.connect() for _ in range(CONNECTIONS)]
    try:
        on_second = [ch for ch in channels if answered_by(ch) == second.proc.pid]
        assert on_second
        ch = on_second[0]
        stream = pb_grpc.OrchestratorServiceStub(ch).Generate(pb.GenerateRequest(
            prompt_token_ids=pb.PromptTokenIds(ids=[40, 41, 42]), max_new_tokens=400, num_speculative_tokens=3),
            timeout=120)
        got = list(next(stream).token_ids)
        os.kill(second.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not any("orchestrator draining" in line for line in second.lines):
            assert time.monotonic() < deadline, "no drain"
            time.sleep(0.05)
        # A new call on a connection the leaving one held reaches the other.
        assert answered_by(on_second[-1]) == first.proc.pid
        assert len(generate(on_second[-1], [50, 51], 4)) == 4
        for r in stream:                  # the running stream ends normally
            got += r.token_ids
        assert len(got) == 400
        want, gaps = greedy_check(load_model(long_pair[0], "cpu"), [40, 41, 42], got)
        assert_same_or_near_tie(got, want, gaps, "the stream on the leaving orchestrator")
        assert second.proc.wait(30) == 0
        with group.connect() as fresh:
            assert answered_by(fresh) == first.proc.pid
    finally:
        for c in channels:
            c.close()
