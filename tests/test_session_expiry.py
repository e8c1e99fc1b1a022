"""Idle sessions expire. A session without a call for
`session_idle_timeout_s` is closed and its KV cache freed; later calls get
NOT_FOUND saying it expired. The rule on the cores with explicit clocks (no
sleeping), then the real processes with a small timeout."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from drafter_svc.config import DrafterConfig
from drafter_svc.core import Drafter
from specd.local_stack import ServiceProcess
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.errors import SessionExpired, UnknownSession
from specd_core.net.grpc_util import status_for
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams
from specd_core.runtime.propose_call import ProposeCall
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
