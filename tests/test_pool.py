"""orchestrator/fleet/pool.py and scaling.py as pure units (a fake launcher; the real
thing on a multi-node Ray cluster is tests/test_cluster_scaling.py)."""
import asyncio

import pytest

from orchestrator.fleet.pool import Pool, ReplicaSpec
from orchestrator.fleet.scaling import AutoscalePolicy, ReplicaGone, Scaler
from specd_core.errors import CapacityExceeded, InvalidRequest

pytestmark = pytest.mark.unit


class FakeClient:
    def __init__(self, spec):
        self.spec, self.active, self.closed = spec, 0, False

    async def aclose(self):
        self.closed = True


class FakeLauncher:
    def __init__(self, fail=False):
        self.started, self.stopped, self.fail = [], [], fail

    async def start(self, kind):
        if self.fail:
            raise TimeoutError(f"{kind} replica not serving")
        spec = ReplicaSpec(kind, f"{kind}-{len(self.started) + 1}", f"127.0.0.1:{9000 + len(self.started)}")
        self.started.append(spec)
        return spec

    async def stop(self, spec):
        self.stopped.append(spec.name)


def pool_of(n, kind="drafter"):
    pool = Pool(kind)
    for i in range(n):
        spec = ReplicaSpec(kind, f"{kind}-{i}", f"h:{i}")
        pool.add(spec, FakeClient(spec))
    return pool


def test_sessions_go_to_the_least_loaded_serving_replica():
    pool = pool_of(3)
    got = [pool.acquire().spec.name for _ in range(6)]
    assert sorted(got) == ["drafter-0", "drafter-0", "drafter-1", "drafter-1", "drafter-2", "drafter-2"]
    pool.replicas["drafter-1"].draining = True
    assert {pool.acquire().spec.name for _ in range(2)} == {"drafter-0", "drafter-2"}
    for r in pool.replicas.values():
        r.draining = True
    with pytest.raises(CapacityExceeded, match="no drafter replica is serving"):
        pool.acquire()


def test_drain_then_reap_only_when_sessions_end():
    pool = pool_of(3)
    busy = pool.acquire()                       # drafter-0 holds a session
    drained = pool.drain(2)
    assert {r.spec.name for r in drained} == {"drafter-1", "drafter-2"}   # the idle ones
    assert {r.spec.name for r in pool.reap()} == {"drafter-1", "drafter-2"}
    assert set(pool.replicas) == {"drafter-0"}
    pool.drain(1)                               # now the busy one: it stays while serving
    assert pool.reap() == [] and "drafter-0" in pool.replicas
    Pool.release(busy)
    assert [r.spec.name for r in pool.reap()] == ["drafter-0"]


def test_scaler_up_down_and_hand_back():
    async def run():
        pools = {"verifier": pool_of(1, "verifier"), "drafter": pool_of(1)}
        launcher = FakeLauncher()
        scaler = Scaler(pools, launcher, FakeClient, max_replicas=8)
        await scaler.scale("drafter", 3)
        assert len(pools["drafter"].serving()) == 3 and len(launcher.started) == 2
        first, session = pools["drafter"].acquire(), pools["drafter"].acquire()   # drafter-0, drafter-1
        await scaler.scale("drafter", 1)        # drains the idle one and, of the busy two, the newest
        assert [r.spec.name for r in pools["drafter"].serving()] == ["drafter-0"]
        await scaler.reap()
        # The replica with a session drains but is not handed back yet.
        assert session.draining and session.spec.name in pools["drafter"].replicas
        assert len(launcher.stopped) == 1
        await scaler.scale("drafter", 2)        # takes the draining one back, starts nothing
        assert not session.draining and len(launcher.started) == 2
        Pool.release(session)
        Pool.release(first)
        await scaler.scale("drafter", 0)        # drafters may go to 0: plain decoding
        await scaler.reap()
        assert pools["drafter"].replicas == {} and len(launcher.stopped) == 3
        for kind, n, needle in [("verifier", 0, r"verifiers must be in \[1, 8\]"),
                                ("drafter", 9, r"drafters must be in \[0, 8\]"), ("medusa", 1, "unknown pool")]:
            with pytest.raises(InvalidRequest, match=needle):
                await scaler.scale(kind, n)
        failing = Scaler(pools, FakeLauncher(fail=True), FakeClient)
        with pytest.raises(TimeoutError):
            await failing.scale("verifier", 2)
        assert len(pools["verifier"].serving()) == 1
    asyncio.run(run())


def test_autoscale_policy():
    p = AutoscalePolicy.parse("1:4:8")
    assert [p.desired(s) for s in (0, 1, 8, 9, 24, 100)] == [1, 1, 1, 2, 3, 4]
    for bad in ("1:4", "4:1:8", "1:4:0", "a:b:c"):
        with pytest.raises(ValueError):
            AutoscalePolicy.parse(bad)

    async def run():
        pools = {"verifier": pool_of(1, "verifier"), "drafter": pool_of(1)}
        scaler = Scaler(pools, FakeLauncher(), FakeClient, policies={"drafter": AutoscalePolicy(1, 3, 2)})
        for _ in range(5):
            pools["drafter"].acquire()
        await scaler.autoscale()                # 5 sessions, 2 per replica -> 3
        assert len(pools["drafter"].serving()) == 3
    asyncio.run(run())


def test_lost_replicas_take_no_sessions_until_revived():
    pool = pool_of(2)
    r0 = pool.acquire()                                   # drafter-0 holds a session
    old = r0.client
    assert Pool.mark_lost(r0, old) and not Pool.mark_lost(r0, old)   # once
    assert [r.spec.name for r in pool.serving()] == ["drafter-1"] and pool.lost() == [r0]
    assert {pool.acquire().spec.name for _ in range(3)} == {"drafter-1"}
    new_spec = ReplicaSpec("drafter", "drafter-0", "h:new")
    assert pool.revive("drafter-0", new_spec, FakeClient(new_spec)) is old
    assert not r0.lost and r0.spec.address == "h:new" and r0.sessions == 0
    # A late failure seen through the old client says nothing about the revived replica.
    assert not Pool.mark_lost(r0, old) and not r0.lost
    Pool.release(r0, old)                                 # the old session leaves on its own client
    assert old.active == 0 and r0.client.active == 0
    assert pool.acquire() is r0                           # routed to again (least loaded)


class LocatingLauncher(FakeLauncher):
    """Where lost replicas serve now: name -> spec, None (restarting) or 'gone'."""

    def __init__(self, where):
        super().__init__()
        self.where = where

    async def locate(self, spec):
        w = self.where.get(spec.name)
        if w == "gone":
            raise ReplicaGone(spec.name)
        return w


def test_scaler_rediscovers_restarted_replicas_at_their_new_address():
    async def run():
        pools = {"verifier": pool_of(1, "verifier"), "drafter": pool_of(3)}
        d = pools["drafter"].replicas
        busy = pools["drafter"].acquire()                 # drafter-0, with a session on its old client
        old = busy.client
        for name in ("drafter-0", "drafter-1", "drafter-2"):
            Pool.mark_lost(d[name], d[name].client)
        moved = ReplicaSpec("drafter", "drafter-0", "h:9999", "node-b")
        launcher = LocatingLauncher({"drafter-0": moved, "drafter-1": None, "drafter-2": "gone"})
        scaler = Scaler(pools, launcher, FakeClient)
        await scaler.rediscover()
        assert not d["drafter-0"].lost and d["drafter-0"].spec == moved and d["drafter-0"].client.spec == moved
        assert d["drafter-1"].lost                        # still restarting: asked again next tick
        assert "drafter-2" not in d                       # out of restarts: forgotten
        assert [r.spec.name for r in pools["drafter"].serving()] == ["drafter-0"]
        assert not old.closed                             # a session still holds it
        Pool.release(busy, old)
        await scaler.rediscover()
        assert old.closed
    asyncio.run(run())
