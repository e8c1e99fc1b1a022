"""Overload. With the verifier's budget at N sessions, N+5
concurrent Generate streams: exactly the 5 in excess get RESOURCE_EXHAUSTED with
a clear message, and the N complete with target-only greedy output. Also the
KV budget (--kv-cache-memory), and the orchestrator's own admission bound.

Deterministic, not timed: the client holds the admitted streams open by not
reading them over a channel with a tiny HTTP/2 window (256 bytes, no window
growth), so the server cannot send their later tokens and no admitted stream
can finish (and free its session) while the others are being refused."""
from __future__ import annotations

import functools
import itertools
import time
from pathlib import Path

import grpc
import openai
import pytest
import torch

from specd.local_stack import ServiceProcess, Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.services

N = 4
MAX_NEW = 200           # far more bytes of responses than the held window lets through
HOLD = [("grpc.http2.lookahead_bytes", 256), ("grpc.http2.bdp_probe", 0)]
KV_BLOCK, KV_BLOCKS = 16, 19  # the KV budget test's verifier: 304 tokens


@functools.cache
def _target(target_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(target_dir).eval()


def reference(target_dir: str, prompt: list[int], n: int) -> list[int]:
    """Target-only greedy decoding (Hugging Face), stopping at EOS like the service."""
    return list(_reference(target_dir, tuple(prompt), n))


@functools.cache
def _reference(target_dir: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    with torch.no_grad():
        out = _target(target_dir).generate(torch.tensor([list(prompt)]), do_sample=False, max_new_tokens=n,
                                           pad_token_id=0)
    return tuple(out[0, len(prompt):].tolist())


def running_prompts(target_dir: str, candidates, k: int, n: int = MAX_NEW) -> list[list[int]]:
    """The first k candidate prompts whose greedy continuation does not stop at
    EOS within n tokens: a stream that ended early would free its session and
    let a later request in, which is not what these tests are about.
    Candidates are decoded only until k are found (each is a decode of n tokens)."""
    out = list(itertools.islice((p for p in candidates if len(reference(target_dir, p, n)) == n), k))
    assert len(out) == k, "not enough prompts that run to max_new_tokens"
    return out


def wait_sessions(address: str, want: int, timeout_s: float = 30.0) -> float:
    """The verifier's live sessions once they reach `want` (closing runs after a
    stream's last message), or whatever they are at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = value(scrape(address), "specdec:active_sessions")
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def first_or_error(call):
    """(first response, None) or (None, RpcError)."""
    try:
        return next(call), None
    except grpc.RpcError as e:
        return None, e


class TargetOnly(Stack):
    """A verifier (with metrics) and an orchestrator decoding without a drafter."""

    def __init__(self, target: str, *verifier_args: str, orchestrator_args: tuple[str, ...] = ()):
        self.target, self.drafter, self.drafter_proc, self.drafters = target, None, None, []
        self.verifier = ServiceProcess("verifier_svc", "--model", target, "--metrics-port", "0", *verifier_args)
        self.verifiers = [self.verifier]
        self.orchestrator = ServiceProcess("orchestrator", "--target", target, "--verifier-address",
                                           self.verifier.address, "--method", "off", *orchestrator_args)
        self.orchestrators = [self.orchestrator]
        self.channel = grpc.insecure_channel(self.orchestrator.address)
        self.stub = pb_grpc.OrchestratorServiceStub(self.channel)


@pytest.fixture(scope="module")
def budget_stack(pairs):
    target, drafter = pairs["llama"]
    s = Stack(target, drafter, metrics=True, verifier_args=("--max-sessions", str(N)))
    yield s
    s.stop()


def test_session_budget_refuses_exactly_the_excess(budget_stack, pairs):
    s = budget_stack
    prompts = running_prompts(s.target, ([40 + i, 60 + i, 80 + i, 100 + i] for i in range(100)), N + 5)
    channel = grpc.insecure_channel(s.orchestrator.address, options=HOLD)
    stub = pb_grpc.OrchestratorServiceStub(channel)
    # All N+5 at once (a mix of chains, a tree and plain decoding, all greedy).
    shapes = [dict(num_speculative_tokens=3), dict(tree={"branching": [2, 1]}), dict(num_speculative_tokens=0)]
    calls = [stub.Generate(pb.GenerateRequest(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW,
                                              **shapes[i % 3]), timeout=120)
             for i, p in enumerate(prompts)]
    firsts = [first_or_error(c) for c in calls]
    refused = [e for _, e in firsts if e is not None]
    assert len(refused) == 5, [(e.code(), e.details()) for e in refused]
    for e in refused:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
        assert f"limit of {N} sessions" in e.details(), e.details()
    # The N admitted streams are running (held), each with its verifier session.
    assert value(scrape(s.verifier.metrics_address), "specdec:active_sessions") == N
    for (first, err), call, prompt in zip(firsts, calls, prompts):
        if err is not None:
            continue
        ids = list(first.token_ids) + [t for r in call for t in r.token_ids]
        assert ids == reference(s.target, prompt, MAX_NEW), prompt
    channel.close()
    assert wait_sessions(s.verifier.metrics_address, 0) == 0
    # With room again, a new request is served.
    ids, last = s.generate(prompt_token_ids={"ids": prompts[0]}, max_new_tokens=8)
    assert ids == reference(s.target, prompts[0], 8)


@pytest.fixture(scope="module")
def target_only(pairs):
    """One target-only stack for the KV budget (verifier) and the admission
    bound (orchestrator): each test stays below the other's limit (the KV test
    runs 2 requests at once, the admission test's prompts are 4 tokens)."""
    target, _ = pairs["llama"]
    from specd_core.runtime.models import Runner, load_model
    budget = KV_BLOCKS * KV_BLOCK * Runner(load_model(target, "cpu")).kv_row_bytes
    s = TargetOnly(target, "--kv-cache-memory", f"{budget}B", "--kv-block-size", str(KV_BLOCK),
                   orchestrator_args=("--max-active-requests", "2", "--http-port", "-1"))
    yield s
    s.stop()


def test_kv_budget_refuses_a_prompt_that_does_not_fit(target_only):
    s = target_only
    target = s.target
    assert wait_sessions(s.verifier.metrics_address, 0) == 0
    channel = grpc.insecure_channel(s.orchestrator.address, options=HOLD)
    stub = pb_grpc.OrchestratorServiceStub(channel)
    long_prompt = running_prompts(target, ([7 + (i * j) % 50 for i in range(200)] for j in range(1, 50)), 1, 50)[0]
    other = [9 + i % 40 for i in range(150)]
    held = stub.Generate(pb.GenerateRequest(prompt_token_ids={"ids": long_prompt}, max_new_tokens=50),
                         timeout=120)
    first, err = first_or_error(held)
    assert err is None, err
    # 200+ tokens cached (13+ blocks of 16); 150 more (10 blocks) would pass the budget of 19.
    with pytest.raises(grpc.RpcError) as info:
        s.generate(prompt_token_ids={"ids": other}, max_new_tokens=4)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV budget full" in info.value.details() and "of 304 tokens" in info.value.details()
    # The running stream is not harmed; once it ends, the same request fits.
    ids = list(first.token_ids) + [t for r in held for t in r.token_ids]
    assert ids == reference(target, long_prompt, 50)
    assert wait_sessions(s.verifier.metrics_address, 0) == 0
    ids, _ = s.generate(prompt_token_ids={"ids": other}, max_new_tokens=4)
    assert ids == reference(target, other, 4)
    channel.close()


def test_orchestrator_admission_bound(target_only):
    """--max-active-requests: past it Generate is RESOURCE_EXHAUSTED before any
    replica is asked (the verifier here has room for many more)."""
    s = target_only
    target = s.target
    assert wait_sessions(s.verifier.metrics_address, 0) == 0
    channel = grpc.insecure_channel(s.orchestrator.address, options=HOLD)
    stub = pb_grpc.OrchestratorServiceStub(channel)
    prompts = running_prompts(target, ([40 + i, 60 + i, 80 + i, 100 + i] for i in range(100)), 3)
    calls = [stub.Generate(pb.GenerateRequest(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW),
                           timeout=120) for p in prompts]
    firsts = [first_or_error(c) for c in calls]
    errors = [e for _, e in firsts if e is not None]
    assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit of 2 concurrent requests" in errors[0].details()
    # The same bound over the OpenAI-compatible API while both streams are held:
    # 429 in OpenAI's error shape (the SDK's RateLimitError), streaming or not.
    client = openai.OpenAI(base_url=s.orchestrator.http_url + "/v1", api_key="unused", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=Path(target).name, prompt=[40, 41, 42], max_tokens=4, stream=stream)
        assert info.value.status_code == 429 and info.value.body["type"] == "rate_limit_error", info.value.body
        assert "limit of 2 concurrent requests" in info.value.body["message"]
    client.close()
    for (first, err), call in zip(firsts, calls):
        if err is None:
            assert len(first.token_ids) + sum(len(r.token_ids) for r in call) == MAX_NEW
    channel.close()
