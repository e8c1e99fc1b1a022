"""Hung-replica detection as units (orchestrator/fleet/hang.py, clients.py,
recovery.py): the deadline rule; a real client over a fake stream whose
replica can freeze (a slow call within the multiple is answered, a frozen one
makes the replica suspected, its other calls fail at once, a late answer is
dropped, closes wait); the loop's session moving off a suspected replica
exactly as off a lost one; and the probe that brings it back. The same on
real processes is tests/test_hang_services.py."""
import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from orchestrator.config import HangConfig, OrchestratorConfig, add_hang_flags, hang_config_from_args
from orchestrator.cycle.records import Draft
from orchestrator.fleet import clients as clients_module
from orchestrator.fleet.clients import GrpcVerifier, Hung, ServiceError, StreamMux, Unanswered
from orchestrator.fleet.hang import MAX_DEFERRED_CLOSES, MIN_SAMPLES, HangWatch, LatencyWindow, hang_deadline
from orchestrator.fleet.pool import Pool, ReplicaSpec
from orchestrator.fleet.recovery import Recovery
from specd_core.api.v1 import specdec_pb2 as pb
from tests.test_failover_logic import PROMPT, FakeDrafter, FakeVerifier, run, truth

pytestmark = pytest.mark.unit

RULE = HangConfig(floor_s=1.0, multiple=10.0, ceiling_s=4.0, prefill_s_per_token=0.01, probe_s=1.0)


def window_of(seconds, n):
    w = LatencyWindow()
    for _ in range(n):
        w.add(seconds)
    return w


def test_warm_up_with_few_samples_uses_the_floor():
    w = window_of(3.0, MIN_SAMPLES - 1)            # slow calls, but too few to judge by
    assert w.p99() is None
    assert hang_deadline(RULE, w.p99()) == RULE.floor_s
    assert hang_deadline(RULE, w.p99(), prefill_tokens=200) == pytest.approx(RULE.floor_s + 2.0)


def test_the_deadline_follows_the_p99_within_floor_and_ceiling():
    assert hang_deadline(RULE, window_of(0.01, 50).p99()) == RULE.floor_s          # fast: the floor
    assert hang_deadline(RULE, window_of(0.25, 50).p99()) == pytest.approx(2.5)    # 10 x p99
    assert hang_deadline(RULE, window_of(2.0, 50).p99()) == RULE.ceiling_s         # never past the ceiling
    w = window_of(0.1, 99)
    w.add(0.3)                                     # one slow call in 100: the p99 is the 99th value
    assert w.p99() == pytest.approx(0.1)
    w.add(0.3)
    for _ in range(8):                             # the p99 is sorted anew every few samples
        w.add(0.1)
    assert w.p99() == pytest.approx(0.3)


def test_the_watch_suspects_once_recovers_and_bounds_its_closes():
    watch = HangWatch(RULE)
    with watch.prefill(100):
        assert watch.deadline() == pytest.approx(RULE.floor_s + 1.0)
    assert watch.prefilling == 0 and watch.deadline() == RULE.floor_s
    assert watch.suspect("Verify unanswered") and not watch.suspect("again")
    for i in range(MAX_DEFERRED_CLOSES + 5):
        watch.defer_close(f"s{i}")
    taken = watch.deferred()
    assert len(taken) == MAX_DEFERRED_CLOSES and taken[-1] == f"s{MAX_DEFERRED_CLOSES + 4}"
    assert watch.deferred() == []
    watch.recover()
    assert not watch.suspected and watch.suspect("later")


def test_the_config_refuses_nonsense_and_reads_its_flags():
    with pytest.raises(ValueError, match="floor <= ceiling"):
        HangConfig(floor_s=5, ceiling_s=1)
    with pytest.raises(ValueError, match="probe"):
        HangConfig(probe_s=0)
    assert not HangConfig(multiple=0).enabled
    import argparse
    p = argparse.ArgumentParser()
    add_hang_flags(p)
    got = hang_config_from_args(p.parse_args(["--hang-floor", "2", "--hang-ceiling", "7", "--hang-multiple", "4",
                                              "--hang-prefill-per-token", "0.5", "--hang-probe-timeout", "3"]))
    assert got == HangConfig(floor_s=2, multiple=4, ceiling_s=7, prefill_s_per_token=0.5, probe_s=3)
    assert hang_config_from_args(p.parse_args([])) == HangConfig()
    assert OrchestratorConfig(target_dir="t").hang == HangConfig()


class FreezableReplica:
    """The far end of a StreamMux: answers each Verify after `delay` seconds,
    or, while frozen, holds it (answered by `thaw`, late)."""

    def __init__(self):
        self.delay, self.frozen, self.held = 0.0, False, []
        self.replies: asyncio.Queue = asyncio.Queue()

    def answer(self, request):
        self.replies.put_nowait(pb.VerifyStepResponse(responses=[
            pb.VerifyResponse(request_id=request.request_id, token_ids=[7])]))

    def open_stream(self, requests):
        loop = asyncio.get_running_loop()

        async def pump():
            async for step in requests:
                for r in step.requests:
                    if self.frozen:
                        self.held.append(r)
                    else:
                        loop.call_later(self.delay, self.answer, r)

        self.pump = asyncio.ensure_future(pump())

        async def responses():
            while True:
                yield await self.replies.get()
        return responses()

    def thaw(self):
        self.frozen = False
        for r in self.held:
            self.answer(r)
        self.held.clear()


def verifier_over(replica, rule=RULE):
    client = GrpcVerifier("127.0.0.1:9", 60.0, hang=rule)   # never dialled: the stream is the fake's
    client.mux = StreamMux(replica.open_stream, pb.VerifyStep)
    return client


def test_a_slow_call_within_the_multiple_is_answered_a_frozen_one_is_a_hang():
    async def main():
        replica = FreezableReplica()
        client = verifier_over(replica, HangConfig(floor_s=0.3, multiple=10.0, ceiling_s=5.0, probe_s=1.0))
        suspicions = []
        client.on_suspect = lambda: suspicions.append(client.address)
        replica.delay = 0.1
        await asyncio.gather(*(client.verify(f"s{i}", Draft()) for i in range(MIN_SAMPLES)))
        assert client.watch.deadline() == pytest.approx(1.0, rel=0.3)   # 10 x its p99 (~0.1 s)
        replica.delay = 0.6                      # six times its usual: past the floor, within the multiple
        assert (await client.verify("s0", Draft())).tokens == [7]
        assert not client.suspected and not suspicions

        replica.frozen = True
        start = time.monotonic()
        results = await asyncio.gather(*(client.verify(f"s{i}", Draft()) for i in range(3)),
                                       return_exceptions=True)
        took = time.monotonic() - start
        assert all(isinstance(r, Hung) and r.code == grpc.StatusCode.UNAVAILABLE for r in results), results
        assert 0.5 < took < 5.0                  # its deadline (about 1 s), not the 60 s call timeout
        assert client.suspected and suspicions == [client.address]
        with pytest.raises(Hung, match="suspected hung"):
            await client.verify("s9", Draft())   # no waiting on a suspected replica
        await client.close("s1")                 # kept for its recovery, not sent
        assert client.watch.deferred() == ["s1"]

        replica.thaw()                           # the late answers arrive: dropped, nothing breaks
        await asyncio.sleep(0.2)
        assert not client.mux._pending and not replica.pump.done()
        client.watch.recover()
        assert (await client.verify("s0", Draft())).tokens == [7]   # the stream still serves
        client.mux.close()

    asyncio.run(main())


def test_without_detection_a_frozen_call_waits_its_timeout_as_before():
    async def main():
        replica = FreezableReplica()
        client = verifier_over(replica, HangConfig(multiple=0))
        client.timeout = 0.3
        replica.frozen = True
        with pytest.raises(Unanswered) as err:
            await client.verify("s", Draft())
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and client.watch is None
        client.mux.close()

    asyncio.run(main())


class HangingVerifier(FakeVerifier):
    """Hangs (its calls: Hung, as the real client raises them) from call `hang_at` on."""

    def __init__(self, hang_at):
        super().__init__()
        self.hang_at, self.suspected = hang_at, False

    def _call(self, what):
        self.calls += 1
        self.log.append(what)
        if self.suspected or (what != "close" and self.calls >= self.hang_at):
            self.suspected = True
            raise Hung("verifier at h:0 suspected hung: Verify unanswered after 1 s")


def test_a_session_moves_off_a_suspected_replica_as_off_a_lost_one():
    hung, spare = HangingVerifier(hang_at=4), FakeVerifier()
    out, vpool, _ = run([hung, spare], [FakeDrafter(PROMPT)], n=40)
    assert out == truth(PROMPT, 40)[len(PROMPT):]            # exact: nothing lost or repeated
    first, second = vpool.replicas["verifier-0"], vpool.replicas["verifier-1"]
    assert first.suspected and not first.lost                # not lost: it comes back by a probe
    assert vpool.serving() == [second] and vpool.suspected() == [first]
    assert "resume" in spare.log and first.sessions == 0 and second.sessions == 0


class ProbedClient:
    """What Recovery calls on a suspected replica's client."""

    def __init__(self, answers):
        self.suspected, self.active, self.answers, self.recovered = True, 0, answers, False

    async def probe(self, timeout_s):
        if not self.answers:
            raise Unanswered(timeout_s)

    async def recover(self, timeout_s):
        self.suspected, self.recovered = False, True


def test_recovery_probes_the_suspected_and_counts_those_back():
    pool = Pool("verifier")
    asleep, awake = ProbedClient(answers=False), ProbedClient(answers=True)
    pool.add(ReplicaSpec("verifier", "v0", "h:0"), asleep)
    pool.add(ReplicaSpec("verifier", "v1", "h:1"), awake)
    back = []
    asyncio.run(Recovery({"verifier": pool}, 1.0, back.append).tick())
    assert awake.recovered and not asleep.recovered and back == ["verifier"]
    assert [r.spec.name for r in pool.serving()] == ["v1"]


class FakeStub:
    """The verifier's unary methods, recording what they are sent; silent ones time out."""

    def __init__(self, silent=()):
        self.silent, self.sent = set(silent), []

    def _method(self, name):
        async def call(request, timeout, metadata=None):
            self.sent.append((name, request.session_id))
            if request.session_id in self.silent or name in self.silent:
                raise Unanswered(timeout)
            if name == "CloseSession" and request.session_id == "gone":
                raise ServiceError(grpc.StatusCode.NOT_FOUND, "unknown session")
            return pb.OpenVerifySessionResponse(first_token_id=1) if name == "OpenSession" else pb.CloseSessionResponse()
        return call

    def __getattr__(self, name):
        return self._method(name)


def test_the_probe_and_the_deferred_closes_bring_it_back(monkeypatch):
    health = {"status": health_pb2.HealthCheckResponse.NOT_SERVING}

    class Health:
        def __init__(self, channel):
            pass

        async def Check(self, request, timeout, metadata=None):
            assert request.service == "specdec.v1.VerifierService"
            return health_pb2.HealthCheckResponse(status=health["status"])

    monkeypatch.setattr(clients_module.health_pb2_grpc, "HealthStub", Health)

    async def main():
        client = GrpcVerifier("127.0.0.1:9", 60.0, hang=RULE)
        client.stub = stub = FakeStub()
        client._call = lambda method, request, timeout: method(request, timeout)
        client.watch.suspect("Verify unanswered")
        for s in ("moved-1", "gone", "moved-2"):
            await client.close(s)
        assert stub.sent == []                               # nothing sent while suspected
        with pytest.raises(ServiceError, match="health"):
            await client.probe(1.0)                          # not serving yet
        health["status"] = health_pb2.HealthCheckResponse.SERVING
        await client.probe(1.0)
        opened = [s for name, s in stub.sent if name == "OpenSession"]
        assert len(opened) == 1 and opened[0].startswith("hang-probe-")
        assert ("CloseSession", opened[0]) in stub.sent      # the probe session is closed again
        stub.silent = {"moved-2"}
        with pytest.raises(Unanswered):
            await client.recover(1.0)                        # one close unanswered: still suspected
        assert client.suspected and client.watch.deferred() == ["moved-2"]
        client.watch.defer_close("moved-2")
        stub.silent = set()
        await client.recover(1.0)                            # a refused close ("gone") is an answer
        assert not client.suspected
        assert [s for name, s in stub.sent if name == "CloseSession"].count("moved-2") == 2
        await client.aclose()

    asyncio.run(main())
