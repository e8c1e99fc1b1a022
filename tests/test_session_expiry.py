"""Idle sessions expire. A session without a call for
`session_idle_timeout_s` is closed and its KV cache freed; later calls get
NOT_FOUND saying it expired. The rule on the cores with explicit clocks (no
sleeping), then the real processes with a small timeout.

Sessions of a vanished owner expire: a session opened with an owner (the
orchestrator process that opened it) closes once that owner is not heard from
(a call, a keep-alive) for `owner_timeout_s`; on the session table with a
hand-set clock and on the cores (tests/test_orchestrator_loss.py: real processes)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest

from drafter_svc.config import DrafterConfig
from drafter_svc.core import Drafter
from specd.local_stack import ServiceProcess
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.errors import InvalidRequest, SessionExpired, UnknownSession
from specd_core.net.grpc_util import status_for
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams
from specd_core.runtime.propose_call import ProposeCall
from specd_core.runtime.sessions import SessionTable
from tests.test_metrics import scrape, value
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier


@pytest.mark.unit
def test_verifier_core_expires_only_idle_sessions(pairs):
    target, _ = pairs["llama"]
    core = Verifier(VerifierConfig(model_dir=target, session_idle_timeout_s=100))
    core.open_session("idle", [1, 2, 3], SamplingParams())
    core.open_session("busy", [4, 5, 6, 7], SamplingParams())
    t0 = time.monotonic()
    assert core.expire_idle(t0 + 50) == [] and core.num_sessions == 2       # not yet
    core.sessions._touched["idle"] -= 200                                           # as if untouched for 200 s
    core.verify("busy", [])                                                 # a call keeps a session alive
    assert core.expire_idle(time.monotonic() + 50) == ["idle"]
    # Its KV went with it: what is left is busy's 4 prompt + 2 generated tokens, less the pending one.
    assert core.num_sessions == 1 and core.kv_tokens == 5
    with pytest.raises(SessionExpired) as info:
        core.verify("idle", [3])
    assert "expired" in str(info.value) and "session_idle_timeout_s is 100" in str(info.value)
    assert status_for(info.value)[0] == grpc.StatusCode.NOT_FOUND
    with pytest.raises(SessionExpired):
        core.close_session("idle")
    # An id never seen stays "unknown" (INVALID_ARGUMENT), not "expired".
    with pytest.raises(UnknownSession) as info:
        core.verify("never", [])
    assert not isinstance(info.value, SessionExpired)
    assert status_for(info.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
    # The id may be opened again.
    core.open_session("idle", [1, 2], SamplingParams())
    assert sorted(core.expire_idle(time.monotonic() + 150)) == ["busy", "idle"]
    assert core.num_sessions == 0 and core.kv_tokens == 0


@pytest.mark.unit
def test_timeout_zero_never_expires(pairs):
    _, drafter = pairs["llama"]
    core = Drafter(DrafterConfig(model_dir=drafter, session_idle_timeout_s=0))
    core.open_session("a", [1, 2, 3], SamplingParams())
    assert core.expire_idle(time.monotonic() + 10**9) == [] and core.num_sessions == 1
    core.propose(ProposeCall("a", [], [4], DraftShape.chain(2)))


@pytest.mark.services
def test_services_expire_idle_sessions(pairs):
    target, drafter = pairs["llama"]
    flags = ("--session-idle-timeout-s", "0.5", "--metrics-port", "0")
    with ThreadPoolExecutor(2) as pool:     # started together: each spends seconds importing and loading
        futures = [pool.submit(ServiceProcess, module, "--model", model, *flags)
                   for module, model in (("verifier_svc", target), ("drafter_svc", drafter))]
    procs = [f.result() for f in futures if f.exception() is None]
    try:
        assert len(procs) == 2, [f.exception() for f in futures]
        v = pb_grpc.VerifierServiceStub(grpc.insecure_channel(procs[0].address))
        d = pb_grpc.DrafterServiceStub(grpc.insecure_channel(procs[1].address))
        v.OpenSession(pb.OpenVerifySessionRequest(session_id="s", prompt_token_ids=[1, 2, 3]), timeout=30)
        d.OpenSession(pb.OpenDraftSessionRequest(session_id="s", prompt_token_ids=[1, 2, 3]), timeout=30)
        # Wait (bounded) for the reapers: the sessions go without any call.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
                value(scrape(p.metrics_address), "specdec:active_sessions") for p in procs):
            time.sleep(0.1)
        assert value(scrape(procs[0].metrics_address), "specdec:active_sessions") == 0
        assert value(scrape(procs[0].metrics_address), "specdec:kv_cache_tokens") == 0
        assert value(scrape(procs[1].metrics_address), "specdec:active_sessions") == 0
        for call, req in ((v.Verify, pb.VerifyRequest(session_id="s", draft_token_ids=[4])),
                          (d.Propose, pb.ProposeRequest(session_id="s", committed_token_ids=[4], num_draft_tokens=2))):
            with pytest.raises(grpc.RpcError) as info:
                call(req, timeout=30)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
            assert "expired" in info.value.details()
    finally:
        for p in procs:
            p.stop()


class _Cache:
    def __init__(self):
        self.released = False

    def release(self):
        self.released = True


class _Session:
    def __init__(self):
        self.cache = _Cache()


@pytest.fixture
def clock(monkeypatch):
    """The session table's clock, set by hand: [now]."""
    from specd_core.runtime import sessions
    now = [1000.0]
    monkeypatch.setattr(sessions, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


@pytest.mark.unit
def test_owner_rule_closes_a_silent_owners_sessions_only_past_the_bound(clock):
    """Sessions opened with an owner close once that owner is not heard from (a
    call of one of its sessions, a keep-alive) for owner_timeout_s, not before;
    sessions without an owner keep the idle rule alone."""
    table = SessionTable("verifier", 16, idle_timeout_s=600, owner_timeout_s=30)
    counted = []
    table.on_expired = lambda reason, n: counted.append((reason, n))
    sessions = {sid: _Session() for sid in ("a1", "a2", "b1", "c1", "n1")}
    for sid, owner in (("a1", "A"), ("a2", "A"), ("b1", "B"), ("c1", "C"), ("n1", "")):
        table.add(sid, sessions[sid], owner)
    clock[0] += 20
    assert table.heard("B") == 1          # B's keep-alive: it has one session here
    table.get("c1")                       # a call of C's session is word from C
    clock[0] += 10                        # A silent for exactly the bound: not past it
    assert table.expire_orphans() == [] and len(table) == 5
    clock[0] += 1
    assert sorted(table.expire_orphans()) == ["a1", "a2"]
    assert sessions["a1"].cache.released and sessions["a2"].cache.released and not sessions["b1"].cache.released
    with pytest.raises(SessionExpired) as info:
        table.get("a1")
    assert "owner 'A' was not heard from for 31.0 s" in str(info.value)
    assert "owner_timeout_s is 30" in str(info.value)
    with pytest.raises(SessionExpired):
        table.close("a2")
    clock[0] += 18                        # B and C heard 29 s ago
    assert table.expire_orphans() == [] and len(table) == 3
    clock[0] += 2
    assert sorted(table.expire_orphans()) == ["b1", "c1"]
    clock[0] += 10**5                     # no owner: never closed by this rule, still by the idle one
    assert table.expire_orphans() == [] and "n1" in table
    assert table.expire_idle() == ["n1"] and len(table) == 0
    assert counted == [("owner", 2), ("owner", 2), ("idle", 1)]
    # An owner whose sessions were closed may open again (it was only slow): a fresh start.
    table.add("a3", _Session(), "A")
    clock[0] += 29
    assert table.expire_orphans() == [] and "a3" in table


@pytest.mark.unit
def test_keep_alive_extends_and_a_stalled_replica_pardons(clock):
    table = SessionTable("drafter", 16, idle_timeout_s=0, owner_timeout_s=10)
    table.add("s", _Session(), "O")
    for _ in range(5):                    # keep-alives every 8 s keep it open for 40 s
        clock[0] += 8
        assert table.heard("O") == 1 and table.expire_orphans() == []
    # The replica itself stopped for 60 s: its reaper pardons every owner on waking.
    clock[0] += 60
    table.pardon_owners()
    assert table.expire_orphans() == []
    clock[0] += 11
    assert table.expire_orphans() == ["s"]
    assert table.heard("O") == 0          # known again, nothing of it left
    assert table.heard("") == 0           # no owner: nothing to keep
    with pytest.raises(InvalidRequest):
        table.heard("o" * 300)


@pytest.mark.unit
def test_owner_timeout_zero_never_closes_by_owner(clock):
    table = SessionTable("verifier", 4, idle_timeout_s=0, owner_timeout_s=0)
    table.add("s", _Session(), "O")
    clock[0] += 10**9
    assert table.expire_orphans() == [] and "s" in table


@pytest.mark.unit
def test_cores_close_a_silent_owners_sessions_and_free_their_kv(pairs):
    target, drafter = pairs["llama"]
    v = Verifier(VerifierConfig(model_dir=target, owner_timeout_s=5))
    d = Drafter(DrafterConfig(model_dir=drafter, owner_timeout_s=5))
    v.open_session("s", [1, 2, 3], SamplingParams(), owner="orch:1:ab")
    v.open_session("free", [1, 2, 3], SamplingParams())
    d.open_session("s", [1, 2, 3], SamplingParams(), owner="orch:1:ab")
    assert v.keep_alive("orch:1:ab") == (1, 5.0) and d.keep_alive("orch:1:ab") == (1, 5.0)
    assert v.keep_alive("someone-else") == (0, 5.0)
    later = time.monotonic() + 6
    assert v.expire_orphans(later) == ["s"] and d.expire_orphans(later) == ["s"]
    assert v.num_sessions == 1 and v.kv_tokens == 3 and d.num_sessions == 0   # "free" and its prompt stay
    with pytest.raises(InvalidRequest):
        d.open_session("t", [1, 2], SamplingParams(), owner="x" * 300)
