"""Two orchestrators behind ONE address on a real Ray cluster (`specd up
--orchestrators 2`): both bind the same gRPC and HTTP ports (SO_REUSEPORT) and
the kernel hands each new connection to one of them.

- 16 greedy streams at once, each on a TCP connection of its own, land on both:
  Status (asked of either) lists both orchestrators with their sessions, the
  sessions summed per replica; the admission shares sum to the configured total;
  the Prometheus targets file lists both.
- `specd scale --orchestrators 1` while they run: the removed orchestrator is
  seen draining with streams still running, stops listening (a new call on a
  connection it held goes to the first one: GOAWAY), lets them finish and leaves;
  the first one then holds the whole limit. No stream breaks and every stream's
  tokens equal target-only greedy decoding. The streams wait 200 tokens short
  of their end until the drain has been seen (tests/held_stream.py).
"""
import json
import os
import threading
import time

import pytest

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.grpc_util import open_channel
from specd_core.runtime.models import load_model, load_tokenizer
from tests.held_stream import HeldStream, open_held_channel
from tests.test_cluster_scaling import _named_actors, greedy_check, long_pair, specd, wait_for  # noqa: F401
from tests.test_greedy_exact import assert_same_or_near_tie
from tests.tiny_models import corpus_lines

pytestmark = pytest.mark.cluster

STREAMS, TOKENS, LIMIT = 16, 600, 40      # each stream holds 200 short of its end until released
FIRST, SECOND = "specd-orchestrator", "specd-orchestrator-1"


def status(channel) -> pb.ClusterStatus:
    return pb_grpc.AdminServiceStub(channel).Status(pb.StatusRequest(), timeout=30)


def fresh_status(address) -> pb.ClusterStatus:
    with open_channel(address, own_connection=True) as ch:
        return status(ch)


def channel_on(address, orchestrator, open_fn=open_held_channel):
    """A channel (a connection of its own, from open_fn) that `orchestrator`
    answers: the kernel hands each new connection to one of the sockets
    sharing the address by a hash, so a test that needs a given one asks
    which one answered and tries again."""
    for _ in range(100):
        ch = open_fn(address)
        if status(ch).answered_by == orchestrator:
            return ch
        ch.close()
    pytest.fail(f"100 connections and none answered by {orchestrator}")


def placed_streams(address, prompts, max_new, release, **kw) -> list:
    """HeldStreams alternating between the two orchestrators (8 streams on
    connections of their own all landed on one now and then, and a test of
    both had nothing to test)."""
    return [HeldStream(address, prompt, max_new, release, channel=channel_on(address, (FIRST, SECOND)[i % 2]), **kw)
            for i, prompt in enumerate(prompts)]


def orchestrator_targets(targets_file) -> dict:
    """Orchestrator name -> its /metrics address, as the targets file lists them."""
    return {g["labels"]["specd_replica"]: g["targets"][0] for g in json.loads(targets_file.read_text())
            if g["labels"]["specd_kind"] == "orchestrator"}


def listed_orchestrators(targets_file) -> set:
    return set(orchestrator_targets(targets_file))


def up_two(ray_cluster, long_pair, tmp_path, *flags):
    """`specd up --orchestrators 2` (any free ports) on the shared head: its
    environment (for `specd down`), the one address and the targets file."""
    target, drafter = long_pair
    env = dict(os.environ, RAY_ADDRESS=ray_cluster, SPECD_HOME=str(tmp_path / "home"))
    up = specd(["up", "--target", target, "--drafter", drafter, "--port", "0", "--http-port", "-1",
                "--orchestrators", "2", *flags], env)
    assert up.returncode == 0, up.stderr
    return env, up.stdout.strip().splitlines()[-1], tmp_path / "home" / "prometheus_targets.json"


def corpus_prompts(target, n, step) -> list:
    tok = load_tokenizer(target)
    lines = [line for line in corpus_lines() if len(line.strip()) > 30]
    return [tok(lines[i * step])["input_ids"] for i in range(n)]


def test_two_orchestrators_one_address_scale_down_while_streaming(ray_cluster, long_pair, tmp_path):
    target, drafter = long_pair
    env, address, targets_file = up_two(ray_cluster, long_pair, tmp_path, "--max-active-requests", str(LIMIT))
    prompts = corpus_prompts(target, STREAMS, 23)
    streams, held, release = [], [], threading.Event()
    try:
        s = fresh_status(address)
        assert [(o.name, o.address, o.max_active_requests, o.owner) for o in s.orchestrators] == [
            (FIRST, address, LIMIT // 2, True), (SECOND, address, LIMIT // 2, False)]
        assert s.orchestrators[0].pid != s.orchestrators[1].pid and s.max_active_requests == LIMIT
        assert listed_orchestrators(targets_file) == {FIRST, SECOND}
        # Connections held open on the second orchestrator, for a call after it leaves.
        held = [channel_on(address, SECOND, lambda a: open_channel(a, own_connection=True)) for _ in range(2)]

        t0 = time.monotonic()
        streams = placed_streams(address, prompts, TOKENS, release, timeout=600)
        wait_for(lambda: all(st.tokens for st in streams), "first tokens of every stream")
        s = fresh_status(address)
        on = {o.name: o.active_requests for o in s.orchestrators}
        print(f"[{time.monotonic() - t0:5.1f}s] streams per orchestrator {on}, by {s.answered_by}", flush=True)
        assert on[FIRST] > 0 and on[SECOND] > 0 and sum(on.values()) == s.active_requests == STREAMS
        assert {r.kind: r.sessions for r in s.replicas} == {"verifier": STREAMS, "drafter": STREAMS}

        out = specd(["scale", "--orchestrators", "1"], env)
        assert out.returncode == 0, out.stderr
        assert "draining" in out.stdout and SECOND in out.stdout, out.stdout
        s = fresh_status(address)
        by = {o.name: o for o in s.orchestrators}
        print(f"[{time.monotonic() - t0:5.1f}s] after the scale: "
              f"{[(o.name, o.active_requests, o.draining) for o in s.orchestrators]}", flush=True)
        assert by[FIRST].max_active_requests == s.max_active_requests == LIMIT and not by[FIRST].draining
        assert by[SECOND].draining and by[SECOND].active_requests > 0, "its streams ended before the scale"
        # A connection to the leaving orchestrator: its next call goes to the first one.
        for ch in held:
            assert status(ch).answered_by == FIRST
            ids = [t for r in pb_grpc.OrchestratorServiceStub(ch).Generate(
                pb.GenerateRequest(prompt="def f(x):", max_new_tokens=4), timeout=120) for t in r.token_ids]
            assert len(ids) == 4

        release.set()
        for st in streams:
            st.join(600)
        print(f"[{time.monotonic() - t0:5.1f}s] streams done", flush=True)
        wait_for(lambda: len(fresh_status(address).orchestrators) == 1, "the drained orchestrator to leave", 60)
        assert SECOND not in _named_actors(ray_cluster)
        s = fresh_status(address)
        assert s.max_active_requests == LIMIT and s.active_requests == 0
        assert listed_orchestrators(targets_file) == {FIRST}
    finally:
        release.set()
        for st in streams:
            st.join(600)
        for ch in held:
            ch.close()
        down = specd(["down"], env)
    assert down.returncode == 0, down.stderr

    model = load_model(target, "cpu")
    for i, st in enumerate(streams):
        assert st.error is None, f"stream {i} broke: {st.error}"
        assert len(st.tokens) == TOKENS, f"stream {i}: {len(st.tokens)} tokens"      # no EOS in this model
        want, gaps = greedy_check(model, st.prompt, st.tokens)
        assert_same_or_near_tie(st.tokens, want, gaps, f"stream {i}")
