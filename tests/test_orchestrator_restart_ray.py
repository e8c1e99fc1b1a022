"""An orchestrator killed on a real Ray cluster (`specd up --orchestrators 2`,
the replicas' owner timeout T = 8 s): SIGKILL of the first orchestrator's
process (its pid from Status) while greedy streams run on both.

- Ray restarts it: Status lists it again with a new pid, at the shared address,
  still the owner; the Prometheus targets file lists its new /metrics address
  beside the other's; a connection the kernel hands it is answered.
- The replicas drop the dead process's sessions within 1.25 T (+ slack for a
  loaded machine): each replica then holds no more sessions than the live
  orchestrators report on it.
- The streams it carried broke; the others end exact (target-only greedy), and
  at the end no replica holds a session.
"""
import os
import signal
import threading
import time

import grpc
import pytest

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.grpc_util import open_channel
from specd_core.runtime.models import load_model
from tests.test_cluster_scaling import greedy_check, long_pair, specd, wait_for  # noqa: F401
from tests.test_greedy_exact import assert_same_or_near_tie
from tests.test_orchestrators_ray import (
    FIRST,
    SECOND,
    channel_on,
    corpus_prompts,
    fresh_status,
    orchestrator_targets,
    placed_streams,
    up_two,
)

pytestmark = pytest.mark.cluster

STREAMS, TOKENS = 8, 1200   # the streams hold 200 short of their end until the restart is seen
T = 8.0             # the replicas' owner timeout
SLACK_S = 15.0      # Ray and a loaded machine, on top of the 1.25 T bound


def replica_sessions(replica) -> int:
    """What a replica says it holds (its Info), every orchestrator's sessions."""
    stub_cls = pb_grpc.VerifierServiceStub if replica.kind == "verifier" else pb_grpc.DrafterServiceStub
    with grpc.insecure_channel(replica.address) as ch:
        return stub_cls(ch).Info(pb.ReplicaInfoRequest(), timeout=30).sessions


def live_status(address) -> pb.ClusterStatus:
    """Status on a new connection; again if it was refused: a connection the
    kernel queued on the killed orchestrator's socket is reset
    (docs/operations.md), as happens to any client at that moment."""
    for _ in range(20):
        try:
            return fresh_status(address)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            time.sleep(0.2)
    return fresh_status(address)


def orphans(address) -> dict:
    """Per replica, its own count less the sessions the orchestrators that
    answer report on it. Read in that order while sessions only end, so a
    positive value is a session no live orchestrator holds."""
    replicas = live_status(address).replicas
    held = {r.name: replica_sessions(r) for r in replicas}
    reported = {r.name: r.sessions for r in live_status(address).replicas}
    return {name: held[name] - reported.get(name, 0) for name in held}


def test_a_killed_orchestrator_restarts_and_its_sessions_close(ray_cluster, long_pair, tmp_path):
    target, _ = long_pair
    env, address, targets_file = up_two(ray_cluster, long_pair, tmp_path, "--owner-timeout-s", str(T))
    prompts = corpus_prompts(target, STREAMS, 29)
    streams, release = [], threading.Event()
    try:
        before = {o.name: o for o in fresh_status(address).orchestrators}
        assert set(before) == {FIRST, SECOND}
        streams = placed_streams(address, prompts, TOKENS, release)
        wait_for(lambda: all(st.tokens for st in streams), "first tokens of every stream")
        on = {o.name: o.active_requests for o in fresh_status(address).orchestrators}
        assert on[FIRST] > 0 and on[SECOND] > 0, on

        os.kill(before[FIRST].pid, signal.SIGKILL)
        killed = time.monotonic()
        first = orphans(address)
        print(f"[{time.monotonic() - killed:5.1f}s] sessions per replica no live orchestrator holds: {first}",
              flush=True)
        assert sum(first.values()) > 0, "the dead orchestrator's sessions were gone at once"
        wait_for(lambda: not any(n > 0 for n in orphans(address).values()),
                 "the replicas to close the dead orchestrator's sessions", 1.25 * T + SLACK_S)
        print(f"[{time.monotonic() - killed:5.1f}s] no orphaned session left", flush=True)

        def restarted():
            now = {o.name: o for o in live_status(address).orchestrators}
            return FIRST in now and now[FIRST].pid != before[FIRST].pid
        wait_for(restarted, "the orchestrator to restart", 180)
        print(f"[{time.monotonic() - killed:5.1f}s] restarted", flush=True)
        now = {o.name: o for o in live_status(address).orchestrators}
        assert (now[FIRST].address, now[FIRST].owner) == (address, True)
        assert now[FIRST].metrics_address and now[FIRST].metrics_address != before[FIRST].metrics_address
        wait_for(lambda: orchestrator_targets(targets_file) == {
            FIRST: now[FIRST].metrics_address, SECOND: now[SECOND].metrics_address}, "the targets file", 60)
        # A connection the kernel hands to the restarted one.
        with channel_on(address, FIRST, lambda a: open_channel(a, own_connection=True)) as ch:
            ids = [t for r in pb_grpc.OrchestratorServiceStub(ch).Generate(
                pb.GenerateRequest(prompt="def f(x):", max_new_tokens=4), timeout=120) for t in r.token_ids]
        assert len(ids) == 4

        release.set()
        for st in streams:
            st.join(900)
        wait_for(lambda: not any(replica_sessions(r) for r in live_status(address).replicas),
                 "every replica to hold 0 sessions", 60)
    finally:
        release.set()
        for st in streams:
            st.join(900)
        down = specd(["down"], env)
    assert down.returncode == 0, down.stderr

    broken = [st for st in streams if st.error is not None]
    assert len(broken) == on[FIRST], [st.error for st in broken]
    model = load_model(target, "cpu")
    for i, st in enumerate(streams):
        if st.error is None:
            assert len(st.tokens) == TOKENS, f"stream {i}: {len(st.tokens)} tokens"
        want, gaps = greedy_check(model, st.prompt, st.tokens)
        assert_same_or_near_tie(st.tokens, want, gaps, f"stream {i}")
