"""Structured output through replica loss and cancellation, on real processes
(2 verifiers, 2 drafters, one process each).

A constrained greedy stream loses its drafter and later its verifier
mid-stream (killed with SIGKILL while the other service is frozen, as in
tests/test_failover.py). The rebuilt drafter session and the resumed
verifier session each get a new matcher that consumes the tokens generated
so far, so it stands exactly at the committed tokens: the stream must end
equal to target-only constrained greedy output, token for token. Its
`max_new_tokens` runs out inside the JSON array, so it ends with
finish_reason "length".

Cancelled constrained streams leave no session and no matcher behind
(`specdec:grammar_matchers` on every process back to 0).
"""
import json
import time

import grpc
import llguidance
import llguidance.hf
import pytest

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.runtime.models import load_model, load_tokenizer
from tests.test_failover import finish, frozen, kill, serving, stack, status  # noqa: F401 (stack: a fixture)
from tests.test_metrics import scrape, value
from tests.test_structured_greedy import constrained_greedy, grammar_of
from tests.tiny_models import corpus_lines

pytestmark = pytest.mark.services

MAX_NEW = 120
SCHEMA = json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                     "minItems": 60, "maxItems": 80})
FIELDS = dict(structured_output={"json_schema": SCHEMA}, num_speculative_tokens=3)


@pytest.fixture(scope="module")
def case(pairs):
    """A prompt whose constrained greedy output runs MAX_NEW tokens with no near-tie, and that output."""
    target, _ = pairs["llama"]
    model, tok = load_model(target, "cpu"), load_tokenizer(target)
    grammar = grammar_of("json_schema", SCHEMA)
    lltok = llguidance.hf.from_tokenizer(tok)
    for line in [l for l in corpus_lines() if len(l.strip()) > 30][::89]:
        ids = tok(line)["input_ids"][:24]
        want, gaps = constrained_greedy(model, lltok, grammar, ids, tok.eos_token_id, MAX_NEW)
        if len(want) == MAX_NEW and min(gaps) > 1e-3:
            return ids, want
    pytest.fail("no prompt runs MAX_NEW constrained tokens without a near-tie")


def read(it, got, n):
    while len(got) < n:
        got += next(it).token_ids
    return got


def test_a_constrained_stream_survives_losing_its_drafter_then_its_verifier(stack, case):
    prompt, want = case
    it = stack.stub.Generate(pb.GenerateRequest(prompt_token_ids={"ids": prompt}, max_new_tokens=MAX_NEW, **FIELDS),
                             timeout=120)
    got = read(it, [], 8)
    drafter, d_name = serving(stack, "drafter")
    verifier, v_name = serving(stack, "verifier")
    with frozen(verifier):
        at_drafter_loss = len(got)
        kill(drafter)
    got = read(it, got, at_drafter_loss + 24)  # drafting again on the other drafter
    verifier, v_name = serving(stack, "verifier")
    drafter, _ = serving(stack, "drafter")
    with frozen(drafter):
        at_verifier_loss = len(got)
        kill(verifier)
    got, last = finish(it, got)
    assert at_drafter_loss < at_verifier_loss < MAX_NEW
    assert got == want  # both matchers rebuilt exactly at the committed tokens
    assert last.finish_reason == "length" and last.stats.completion_tokens == MAX_NEW
    st = status(stack)
    assert st[d_name].lost and st[v_name].lost
    assert last.stats.accepted_tokens > 0 and last.stats.forced_tokens > 0


def matchers(stack) -> dict[str, float]:
    procs = [stack.orchestrator, *stack.verifiers, *stack.drafters]
    return {p.metrics_address: value(scrape(p.metrics_address), "specdec:grammar_matchers")
            for p in procs if p.proc.poll() is None}


def test_cancelled_constrained_streams_leave_no_matcher(stack, case):
    prompt, _ = case
    calls = [stack.stub.Generate(pb.GenerateRequest(prompt_token_ids={"ids": prompt}, max_new_tokens=MAX_NEW,
                                                    temperature=0.8, seed=s, **FIELDS), timeout=120)
             for s in range(6)]
    for call in calls:
        next(call)  # the stream is running: its sessions and matchers exist
    assert sum(matchers(stack).values()) > 0
    for call in calls:
        call.cancel()
    for call in calls:
        with pytest.raises(grpc.RpcError):
            for _ in call:
                pass
    deadline = time.monotonic() + 20
    while any(matchers(stack).values()) or any(r.sessions for r in status(stack).values() if not r.lost):
        assert time.monotonic() < deadline, f"matchers left: {matchers(stack)}"
        time.sleep(0.1)
