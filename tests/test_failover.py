"""Replica loss on real processes: 2 verifiers + 2 drafters (one OS process each) and
an orchestrator; a replica serving a long greedy stream is killed with SIGKILL
mid-stream, and the stream must complete equal to target-only greedy output,
no token lost or repeated.

"Mid-stream" without timing: after some tokens arrived, the OTHER service of
the session is frozen (SIGSTOP), so the stream cannot move on while the replica
is killed and reaped; then it is thawed. The orchestrator marks a replica lost
only when a call to it fails, so `lost` in the admin status proves that the
stream went on past the kill and failed over. The tests run in file order on
one stack: drafter loss (one drafter left), verifier loss, then drafter loss
with no drafter left. The orchestrator's `specdec:failovers` counter counts
each move.
"""
import os
import signal
import time
from contextlib import contextmanager

import pytest
import torch

from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.runtime.models import load_model, load_tokenizer
from tests.tiny_models import corpus_lines

pytestmark = pytest.mark.services

MAX_NEW = 160          # long enough that the stream is far from its end when frozen
ARRIVED = 8            # tokens read before the kill


@pytest.fixture(scope="module")
def stack(pairs):
    target, drafter = pairs["llama"]
    s = Stack(target, drafter, verifiers=2, drafters=2, metrics=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cases(pairs):
    """Prompts whose target-only greedy output runs the full MAX_NEW tokens (no
    early EOS) with no near-tie on the way (so equality is exact), and that output."""
    target, _ = pairs["llama"]
    model, tok = load_model(target, "cpu"), load_tokenizer(target)
    lines = [l for l in corpus_lines() if len(l.strip()) > 30]
    found = []
    for line in lines[::97]:
        ids = tok(line)["input_ids"][:24]
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        want = out.sequences[0, len(ids):].tolist()
        gap = min(float(torch.topk(l[0], 2).values.diff().abs()) for l in out.logits)
        if len(want) == MAX_NEW and gap > 1e-3:
            found.append((ids, want))
        if len(found) == 3:
            return found
    pytest.fail("no prompt of the tiny corpus runs MAX_NEW tokens without a near-tie")


def status(stack) -> dict:
    """replica name -> ReplicaStatus."""
    admin = pb_grpc.AdminServiceStub(stack.channel)
    return {r.name: r for r in admin.Status(pb.StatusRequest(), timeout=30).replicas}


def serving(stack, kind):
    """(process, replica name) of the `kind` replica holding the one open session."""
    procs = {p.address: p for p in (stack.verifiers if kind == "verifier" else stack.drafters)}
    busy = [r for r in status(stack).values() if r.kind == kind and r.sessions == 1]
    assert len(busy) == 1, f"expected one {kind} with the session, got {busy}"
    return procs[busy[0].address], busy[0].name


@contextmanager
def frozen(proc):
    os.kill(proc.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)


def kill(proc):
    proc.proc.kill()
    assert proc.proc.wait(30) == -signal.SIGKILL       # really died, by this signal


def start(stack, prompt):
    """Open a greedy stream; return (iterator, the token ids of the first responses)."""
    it = stack.stub.Generate(pb.GenerateRequest(prompt_token_ids={"ids": prompt}, max_new_tokens=MAX_NEW,
                                                num_speculative_tokens=3), timeout=120)
    got = []
    while len(got) < ARRIVED:
        got += next(it).token_ids
    return it, got


def finish(it, got):
    last = None
    for r in it:
        got += r.token_ids
        last = r
    return got, last


def failovers_reach(stack, kind, n, timeout_s=10.0) -> bool:
    """Whether the orchestrator's failover counter for `kind` reaches n (counted
    as the request ends, just after its last message went out) and stays there."""
    from tests.test_metrics import scrape, value
    deadline = time.monotonic() + timeout_s
    while (got := value(scrape(stack.orchestrator.metrics_address), "specdec:failovers_total", kind=kind)) < n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return got == n


def test_drafter_killed_mid_stream(stack, cases):
    prompt, want = cases[0]
    alive = [p for p in stack.drafters if p.proc.poll() is None]
    assert len(alive) == 2
    it, got = start(stack, prompt)
    drafter, name = serving(stack, "drafter")
    verifier, _ = serving(stack, "verifier")
    with frozen(verifier):                 # the stream waits for this verifier every cycle
        arrived = len(got)
        kill(drafter)
    got, last = finish(it, got)
    assert arrived < MAX_NEW
    assert got == want                     # complete, exact: nothing lost or repeated
    assert last.finish_reason == "length" and last.stats.completion_tokens == MAX_NEW
    assert status(stack)[name].lost        # the stream called the dead drafter and moved on
    assert last.stats.accepted_tokens > 0  # drafts were kept: a real speculative stream
    assert failovers_reach(stack, "drafter", 1) and failovers_reach(stack, "verifier", 0)


def test_verifier_killed_mid_stream(stack, cases):
    prompt, want = cases[1]
    it, got = start(stack, prompt)
    verifier, name = serving(stack, "verifier")
    drafter, _ = serving(stack, "drafter")
    with frozen(drafter):                  # the stream waits for this drafter every cycle
        arrived = len(got)
        kill(verifier)
    got, last = finish(it, got)
    assert arrived < MAX_NEW
    assert got == want                     # re-prefilled elsewhere: nothing lost or repeated
    assert last.finish_reason == "length" and last.stats.completion_tokens == MAX_NEW
    st = status(stack)
    assert st[name].lost and sum(not r.lost for r in st.values() if r.kind == "verifier") == 1
    assert failovers_reach(stack, "verifier", 1) and failovers_reach(stack, "drafter", 1)


def test_drafter_killed_with_no_spare_continues_as_plain_decoding(stack, cases):
    prompt, want = cases[2]
    it, got = start(stack, prompt)
    drafter, name = serving(stack, "drafter")
    verifier, _ = serving(stack, "verifier")
    for spare in stack.drafters:           # any other live drafter dies first, unnoticed
        if spare is not drafter and spare.proc.poll() is None:
            kill(spare)
    with frozen(verifier):
        arrived = len(got)
        kill(drafter)
    got, last = finish(it, got)
    assert arrived < MAX_NEW
    assert got == want
    assert last.finish_reason == "length"
    st = status(stack)
    assert st[name].lost and all(r.lost for r in st.values() if r.kind == "drafter")
    # A new request still runs (plain decoding, no drafter left) and is exact.
    again, _ = finish(*start(stack, prompt))
    assert again == want
    # One more move (the stream's drafter); none for the request that found no drafter.
    assert failovers_reach(stack, "drafter", 2) and failovers_reach(stack, "verifier", 1)
