"""Hung replicas on real processes: 2 verifiers + 2 drafters (one OS process
each) and an orchestrator whose hang detection is set for the test (a call
unanswered for HANG_FLOOR_S to HANG_CEILING_S, by the replica's measured pace,
makes its replica suspected). 8 greedy streams run; once each has tokens, a
replica holding some of their sessions is frozen with SIGSTOP and kept frozen
until every stream has ended. A frozen process keeps its TCP connections open,
so grpc fails nothing: without detection the streams on it would wait for it
until their own deadline (CLIENT_DEADLINE_S) and fail. With it, each stream
completes equal to target-only greedy, its longest silence within the
detection bound plus one re-prefill (PREFILL_ALLOWANCE_S on this loaded
machine). Then SIGCONT: the replica answers the orchestrator's probe and
serves again (Status: not lost), holding no session (its own Info: the closes
of the moved sessions were sent on its recovery), and the suspicion and
recovery counters moved. First a verifier, then a drafter."""
import os
import signal
import threading
import time

import grpc
import pytest
import torch

from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.runtime.models import load_model, load_tokenizer
from tests.test_metrics import scrape, value
from tests.tiny_models import corpus_lines

pytestmark = pytest.mark.services

STREAMS = 8
MAX_NEW = 120               # long enough that every stream is mid-way when a replica freezes
ARRIVED = 6                 # tokens each stream has before the freeze
HANG_FLOOR_S, HANG_CEILING_S = 2.0, 5.0
CLIENT_DEADLINE_S = 120.0
PREFILL_ALLOWANCE_S = 10.0  # one re-prefill of a tiny model's prompt on a busy 2-core machine, with room
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def stack(pairs):
    target, drafter = pairs["llama"]
    s = Stack(target, drafter, verifiers=2, drafters=2, metrics=True,
              orchestrator_args=("--hang-floor", str(HANG_FLOOR_S), "--hang-ceiling", str(HANG_CEILING_S),
                                 "--hang-probe-timeout", "5"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cases(pairs):
    """STREAMS prompts whose target-only greedy output runs the full MAX_NEW
    tokens with no near-tie on the way (so equality is exact), and that output."""
    target, _ = pairs["llama"]
    model, tok = load_model(target, "cpu"), load_tokenizer(target)
    found = []
    for line in [l for l in corpus_lines() if len(l.strip()) > 30][::23]:
        ids = tok(line)["input_ids"][:24]
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        want = out.sequences[0, len(ids):].tolist()
        gap = min(float(torch.topk(l[0], 2).values.diff().abs()) for l in out.logits)
        if len(want) == MAX_NEW and gap > NEAR_TIE:
            found.append((ids, want))
        if len(found) == STREAMS:
            return found
    pytest.fail(f"fewer than {STREAMS} prompts of the tiny corpus run MAX_NEW tokens without a near-tie")


class Local:
    """The stack as freeze_mid_stream drives it (tests/test_hang_ray.py has the Ray one)."""

    def __init__(self, stack):
        self.stack, self.channel, self.stub = stack, stack.channel, stack.stub
        self.metrics_address = stack.orchestrator.metrics_address

    def pid(self, replica) -> int:
        procs = {p.address: p for p in (*self.stack.verifiers, *self.stack.drafters)}
        return procs[replica.address].proc.pid


class Stream(threading.Thread):
    """One Generate stream; the arrival time of each message, every token, any error."""

    def __init__(self, deployment, prompt):
        super().__init__(daemon=True)
        self.stub, self.prompt = deployment.stub, prompt
        self.tokens, self.times, self.error, self.last = [], [], None, None
        self.start()

    def run(self):
        try:
            for r in self.stub.Generate(pb.GenerateRequest(
                    prompt_token_ids={"ids": self.prompt}, max_new_tokens=MAX_NEW, num_speculative_tokens=3),
                    timeout=CLIENT_DEADLINE_S):
                self.tokens += r.token_ids
                self.times.append(time.monotonic())
                self.last = r
        except grpc.RpcError as e:
            self.error = f"{e.code().name}: {e.details()}"

    def longest_silence(self, since: float) -> float:
        """The longest wait for a message after `since` (the freeze)."""
        after = [since] + [t for t in self.times if t > since]
        return max(b - a for a, b in zip(after, after[1:])) if len(after) > 1 else 0.0


def status(deployment) -> dict:
    admin = pb_grpc.AdminServiceStub(deployment.channel)
    return {r.name: r for r in admin.Status(pb.StatusRequest(), timeout=30).replicas}


def own_sessions(replica) -> int:
    """The sessions a replica holds by its own count (of every orchestrator)."""
    kind = replica.kind
    with grpc.insecure_channel(replica.address) as ch:
        stub = pb_grpc.VerifierServiceStub(ch) if kind == "verifier" else pb_grpc.DrafterServiceStub(ch)
        return stub.Info(pb.ReplicaInfoRequest(), timeout=30).sessions


def counter(deployment, name, kind) -> float:
    return value(scrape(deployment.metrics_address), f"specdec:{name}_total", kind=kind)


def wait_for(predicate, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def freeze_mid_stream(deployment, cases, kind):
    """8 streams; freeze a `kind` replica holding some of them until all have
    ended; check them; thaw it and check it is back, holding nothing.
    Returns the frozen replica's Status entry from before the freeze."""
    # The first of the pool: the streams spread evenly (least loaded), so it
    # takes half of them. Its process is found first, so that the freeze
    # follows the streams' first tokens at once (on Ray that takes seconds).
    busy = min((r for r in status(deployment).values() if r.kind == kind), key=lambda r: r.name)
    assert not busy.lost
    pid = deployment.pid(busy)
    streams = [Stream(deployment, prompt) for prompt, _ in cases]
    wait_for(lambda: all(len(s.tokens) >= ARRIVED or s.error for s in streams), "every stream's first tokens")
    frozen_at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        for s in streams:
            s.join(CLIENT_DEADLINE_S + 10)
        ended_at = time.monotonic()
        st = status(deployment)[busy.name]
        assert st.lost and st.sessions == 0      # suspected while frozen: takes no sessions, holds none of ours
    finally:
        os.kill(pid, signal.SIGCONT)
    silences = []
    for (prompt, want), s in zip(cases, streams):
        assert s.error is None, s.error
        assert s.tokens == want                  # complete, exact: nothing lost or repeated
        assert s.last.finish_reason == "length" and s.last.stats.completion_tokens == MAX_NEW
        silences.append(s.longest_silence(frozen_at))
    print(f"{kind} frozen: each stream's longest silence {[round(x, 2) for x in silences]} s")
    # The freeze hit its streams mid-way (their calls waited at least the floor)...
    assert sum(x >= 0.9 * HANG_FLOOR_S for x in silences) >= STREAMS // 4, silences
    # ...and none waited past the detection bound plus one re-prefill (without
    # detection they would have waited until CLIENT_DEADLINE_S and failed).
    assert max(silences) < HANG_CEILING_S + PREFILL_ALLOWANCE_S, silences
    assert ended_at - frozen_at < CLIENT_DEADLINE_S / 2
    assert counter(deployment, "hang_suspicions", kind) == 1
    # Thawed: it answers the probe and serves again, the moved sessions closed.
    wait_for(lambda: not status(deployment)[busy.name].lost, f"{busy.name} back in service", timeout=30)
    assert counter(deployment, "hang_recoveries", kind) == 1
    wait_for(lambda: own_sessions(busy) == 0, f"{busy.name} holding no session", timeout=30)
    assert status(deployment)[busy.name].sessions == 0
    # Back in service, and a new stream is exact.
    prompt, want = cases[0]
    s = Stream(deployment, prompt)
    s.join(CLIENT_DEADLINE_S)
    assert s.error is None and s.tokens == want
    return busy


def test_a_frozen_verifier_is_detected_and_its_streams_move(stack, cases):
    freeze_mid_stream(Local(stack), cases, "verifier")


def test_a_frozen_drafter_is_detected_and_its_streams_rebuild(stack, cases):
    local = Local(stack)
    freeze_mid_stream(local, cases, "drafter")
    assert counter(local, "hang_suspicions", "verifier") == 1    # the verifiers were left alone
