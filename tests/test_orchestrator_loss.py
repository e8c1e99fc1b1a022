"""An orchestrator that dies leaks no session on the replicas.

Every session an orchestrator opens carries its owner (the orchestrator process);
each replica closes the sessions of an owner it has not heard from (a call, a
keep-alive) for its owner_timeout_s. Here:

- unit: the keep-alive sender's pace and rounds (orchestrator/fleet/keepalive.py);
  the session table's rule itself is in tests/test_session_expiry.py.
- services, on real processes (a verifier, a drafter, an orchestrator; the
  replicas' owner timeout T = 2 s): a live orchestrator whose sessions are all
  paused keeps them (its streams wait on a frozen verifier for 3 T; the drafter
  hears only keep-alives, and the verifier, itself stopped, pardons on waking),
  and the streams end exact; then an orchestrator killed with SIGKILL mid-stream:
  both replicas are back to 0 sessions within 1.25 T (+ slack for a loaded
  machine), counted as `owner` expiries, and a new orchestrator serves exactly.
"""
import asyncio
import signal
import time

import grpc
import pytest

from orchestrator.config import ReplicaSpec
from orchestrator.fleet.clients import ServiceError
from orchestrator.fleet.keepalive import MAX_INTERVAL_S, MIN_INTERVAL_S, UNKNOWN_INTERVAL_S, KeepAlive, interval
from orchestrator.fleet.pool import Pool
from specd.local_stack import ServiceProcess, Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.runtime.models import load_model, load_tokenizer
from tests.test_cluster_scaling import greedy_check, long_pair  # noqa: F401  (a fixture)
from tests.test_failover import frozen
from tests.test_greedy_exact import assert_same_or_near_tie
from tests.test_metrics import scrape, value
from tests.tiny_models import corpus_lines

T = 2.0            # the replicas' owner timeout in the services tests
SLACK_S = 5.0      # scheduling on a loaded machine, on top of the 1.25 T bound
STREAMS, MAX_NEW = 3, 1500


@pytest.mark.unit
def test_keepalive_pace_follows_the_replicas_timeouts():
    assert interval([]) == MAX_INTERVAL_S                  # no replica: nothing to keep
    assert interval([None]) == UNKNOWN_INTERVAL_S          # not told yet: ask again soon
    assert interval([30.0]) == 7.5                         # a quarter of the owner timeout
    assert interval([30.0, 2.0, None]) == 0.5              # the shortest one rules
    assert interval([0.0]) == MAX_INTERVAL_S               # a replica that never closes by owner
    assert interval([600.0]) == MAX_INTERVAL_S and interval([0.01]) == MIN_INTERVAL_S


class _Replica:
    def __init__(self, answer=3.0, error=None, hang=False):
        self.active, self.calls = 0, 0
        self.answer, self.error, self.hang = answer, error, hang

    async def keep_alive(self, timeout_s):
        self.calls += 1
        if self.hang:
            await asyncio.sleep(3600)
        if self.error:
            raise self.error
        return self.answer


@pytest.mark.unit
def test_keepalive_rounds_reach_every_replica_and_a_hung_one_delays_no_other():
    async def scenario():
        pools = {"verifier": Pool("verifier"), "drafter": Pool("drafter")}
        fakes = {"ok": _Replica(3.0), "hung": _Replica(hang=True), "lost": _Replica(),
                 "old": _Replica(error=ServiceError(grpc.StatusCode.UNIMPLEMENTED, "no KeepAlive"))}
        for name, fake in fakes.items():
            pools["verifier" if name != "old" else "drafter"].add(ReplicaSpec("verifier", name, "a:1"), fake)
        pools["verifier"].replicas["lost"].lost = True
        keep = KeepAlive(pools)
        assert keep.pace() == UNKNOWN_INTERVAL_S
        keep.round()
        await asyncio.sleep(0.05)
        assert {n: f.calls for n, f in fakes.items()} == {"ok": 1, "hung": 1, "lost": 0, "old": 1}
        assert keep.timeouts == {"ok": 3.0, "old": 0.0}    # an old replica: no owner rule there
        assert keep.pace() == 0.75                         # min(3 / 4, the hung one's unknown 1 s)
        keep.round()
        await asyncio.sleep(0.05)
        assert {n: f.calls for n, f in fakes.items()} == {"ok": 2, "hung": 1, "lost": 0, "old": 2}
        keep.stop()                                        # the hung call is cancelled too
        await asyncio.sleep(0.05)
        assert not keep._calls

    asyncio.run(scenario())


def replica_sessions(proc, kind) -> int:
    """The sessions a replica holds, as it says itself (Info)."""
    stub_cls = pb_grpc.VerifierServiceStub if kind == "verifier" else pb_grpc.DrafterServiceStub
    with grpc.insecure_channel(proc.address) as ch:
        return stub_cls(ch).Info(pb.ReplicaInfoRequest(), timeout=30).sessions


def owner_expiries(proc) -> float:
    return value(scrape(proc.metrics_address), "specdec:sessions_expired_total", reason="owner")


@pytest.fixture(scope="module")
def stack(long_pair):
    target, drafter = long_pair
    # Hang detection off: these tests freeze the only verifier for longer than
    # its floor to hold streams open, which it would (rightly) call a hang and
    # end the streams; it is tested in test_hang_services.py.
    s = Stack(target, drafter, ("--owner-timeout-s", str(T)), metrics=True,
              orchestrator_args=("--hang-multiple", "0"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def prompts(long_pair):
    tok = load_tokenizer(long_pair[0])
    lines = [line for line in corpus_lines() if len(line.strip()) > 30]
    return [tok(lines[i * 31])["input_ids"][:24] for i in range(STREAMS)]


def open_streams(stub, prompts, max_new=MAX_NEW) -> list:
    """Greedy streams, each past its first message (its sessions are open)."""
    its = [stub.Generate(pb.GenerateRequest(prompt_token_ids={"ids": p}, max_new_tokens=max_new,
                                            num_speculative_tokens=3), timeout=300) for p in prompts]
    return [(it, list(next(it).token_ids)) for it in its]


def check_greedy(model, prompt, got, context):
    want, gaps = greedy_check(model, prompt, got)
    assert_same_or_near_tie(got, want, gaps, context)


@pytest.mark.services
def test_a_live_orchestrators_paused_sessions_stay_open(stack, prompts, long_pair):
    """Streams paused for 3 T (their verifier frozen): the drafter hears only the
    orchestrator's keep-alives and keeps the sessions; the thawed verifier does
    not count its own stop against the orchestrator. Every stream ends exact."""
    streams = open_streams(stack.stub, prompts)
    with frozen(stack.verifier):
        time.sleep(3 * T)
        assert replica_sessions(stack.drafter_proc, "drafter") == STREAMS
    model = load_model(long_pair[0], "cpu")
    for n, ((it, got), prompt) in enumerate(zip(streams, prompts)):
        for r in it:
            got += r.token_ids
        assert len(got) == MAX_NEW, f"stream {n}: {len(got)} tokens"      # no EOS in this model
        check_greedy(model, prompt, got, f"stream {n}")
    assert owner_expiries(stack.verifier) == owner_expiries(stack.drafter_proc) == 0


@pytest.mark.services
def test_replicas_close_a_killed_orchestrators_sessions_within_the_bound(stack, prompts, long_pair):
    """SIGKILL of the orchestrator with streams open (their verifier frozen, so
    none can end first): within 1.25 T of the last word the replicas can have
    had from it (+ slack), both hold 0 sessions; then a new orchestrator on
    the same replicas serves exactly."""
    target, drafter = long_pair
    streams = open_streams(stack.stub, prompts)
    with frozen(stack.verifier):
        assert replica_sessions(stack.drafter_proc, "drafter") == STREAMS
        stack.orchestrator.proc.kill()
        assert stack.orchestrator.proc.wait(30) == -signal.SIGKILL
    gone = time.monotonic()                     # the verifier thawed: the later of its and the drafter's last word
    replicas = ((stack.verifier, "verifier"), (stack.drafter_proc, "drafter"))
    while any(replica_sessions(p, kind) for p, kind in replicas):
        assert time.monotonic() - gone < 1.25 * T + SLACK_S, "the dead orchestrator's sessions are still open"
        time.sleep(0.1)
    print(f"both replicas closed them {time.monotonic() - gone:.1f} s after the kill")
    assert owner_expiries(stack.verifier) == owner_expiries(stack.drafter_proc) == STREAMS
    for it, _ in streams:
        with pytest.raises(grpc.RpcError) as info:
            list(it)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    args = ["--target", target, "--drafter", drafter, "--verifier-address", stack.verifier.address,
            "--drafter-address", stack.drafter_proc.address]
    new = ServiceProcess("orchestrator", *args)
    try:
        with grpc.insecure_channel(new.address) as ch:
            streams = open_streams(pb_grpc.OrchestratorServiceStub(ch), prompts, max_new=64)
            model = load_model(target, "cpu")
            for n, ((it, got), prompt) in enumerate(zip(streams, prompts)):
                got += [t for r in it for t in r.token_ids]
                assert len(got) == 64
                check_greedy(model, prompt, got, f"new orchestrator, stream {n}")
    finally:
        new.stop()


@pytest.mark.services   # binds (for a moment) two free ports
def test_the_first_orchestrator_is_created_with_fixed_ports():
    """Ray restarts a dead orchestrator with its creation arguments: "any free
    port" is chosen before, so that the restarted one serves the same address."""
    ray_deploy = pytest.importorskip("specd.ray_deploy")
    from specd.deploy_config import DeploymentConfig
    cfg = DeploymentConfig(target_dir="/t", drafter_dir=None, port=0, http_port=-1)
    orch = ray_deploy.fixed_ports(ray_deploy.orchestrator_config(cfg, []))
    assert orch.port > 0 and orch.http_port > 0 and orch.port != orch.http_port
    for port, http_port in ((1234, 0), (1234, 8080)):
        cfg = DeploymentConfig(target_dir="/t", drafter_dir=None, port=port, http_port=http_port)
        orch = ray_deploy.fixed_ports(ray_deploy.orchestrator_config(cfg, []))
        assert (orch.port, orch.http_port) == (port, http_port)
