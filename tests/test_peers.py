"""Several orchestrators of one deployment as pure units (orchestrator/fleet/peers.py):
the admission shares, Status merged over every orchestrator's report, a follower
taking the owner's replica list, and the owner's scaler with followers (fakes
that hold real Pools; the real thing on Ray is tests/test_orchestrators_ray.py):
a drained replica is handed back only once no orchestrator can still use it, a
loss a follower found is located by the owner and handed back revived, the
number of orchestrators scales with the shares re-split, autoscaling counts
every orchestrator's sessions; `specd status` prints a line per orchestrator."""
import asyncio

import pytest

from orchestrator.fleet.peers import (
    Group,
    OrchestratorReport,
    PoolView,
    ReplicaEntry,
    admission_shares,
    follow,
    merge_status,
)
from orchestrator.fleet.pool import Pool, ReplicaSpec
from orchestrator.fleet.scaling import AutoscalePolicy, Scaler
from specd_core.errors import InvalidRequest
from tests.test_pool import FakeClient, FakeLauncher, LocatingLauncher, pool_of

pytestmark = pytest.mark.unit


def test_admission_shares_sum_to_the_total_and_differ_by_at_most_one():
    assert admission_shares(1024, 1) == [1024]
    assert admission_shares(10, 3) == [4, 3, 3]
    assert admission_shares(3, 3) == [1, 1, 1]
    for total in range(1, 40):
        for n in range(1, total + 1):
            shares = admission_shares(total, n)
            assert sum(shares) == total and max(shares) - min(shares) <= 1 and min(shares) >= 1
    for total, n in ((4, 5), (4, 0)):
        with pytest.raises(ValueError):
            admission_shares(total, n)


def report(name, index, **kw):
    return OrchestratorReport(name=name, index=index, address="10.0.0.1:50051", pid=100 + index, **kw)


def test_status_merges_every_orchestrator_owner_first():
    status = {"replicas": [{"name": "v-0", "sessions": 1}, {"name": "d-0", "sessions": 1}], "active_requests": 1,
              "metrics_address": "m1", "scalable": True, "autoscale": {}}
    reports = [
        report("o-1", 1, active_requests=1, max_active_requests=5, sessions={"v-0": 1, "d-0": 1}),
        report("o", 0, active_requests=1, max_active_requests=5, sessions={"v-0": 1, "d-0": 1}),
        report("o-2", 2, active_requests=2, max_active_requests=3, draining=True, sessions={"v-0": 2}),
    ]
    merged = merge_status(status, reports, "o-1")
    assert [o["name"] for o in merged["orchestrators"]] == ["o", "o-1", "o-2"]
    assert [o["owner"] for o in merged["orchestrators"]] == [True, False, False]
    assert merged["orchestrators"][2]["draining"] and merged["orchestrators"][0]["pid"] == 100
    assert {r["name"]: r["sessions"] for r in merged["replicas"]} == {"v-0": 4, "d-0": 2}
    assert merged["active_requests"] == 4
    assert merged["max_active_requests"] == 10          # the serving ones' shares: the draining one takes no more
    assert merged["answered_by"] == "o-1" and merged["metrics_address"] == "m1"


def specs(*names):
    return [ReplicaSpec(n.split("-")[0], n, f"h:{i}") for i, n in enumerate(names)]


def test_a_follower_takes_the_owners_list():
    pools = {"verifier": Pool("verifier"), "drafter": Pool("drafter")}
    v0, d0, d1 = specs("verifier-0", "drafter-0", "drafter-1")
    assert follow(pools, PoolView(1, (ReplicaEntry(v0), ReplicaEntry(d0))), FakeClient) == []
    session = pools["drafter"].acquire()                 # drafter-0
    old = session.client
    moved = ReplicaSpec("drafter", "drafter-0", "h:moved")
    replaced = follow(pools, PoolView(2, (ReplicaEntry(v0), ReplicaEntry(moved, revision=1),
                                          ReplicaEntry(d1, draining=True))), FakeClient)
    d = pools["drafter"].replicas
    assert replaced == [old]                             # revived: a new client; the session releases on the old
    assert d["drafter-0"].spec == moved and d["drafter-0"].client is not old and d["drafter-0"].revision == 1
    assert d["drafter-1"].draining and pools["drafter"].serving() == [d["drafter-0"]]
    d["drafter-0"].lost = True                           # its own loss stays its own until the owner revives it
    follow(pools, PoolView(3, (ReplicaEntry(v0), ReplicaEntry(moved, revision=1))), FakeClient)
    assert "drafter-1" not in d and d["drafter-0"].lost  # dropped by the owner (reaped)
    follow(pools, PoolView(4, (ReplicaEntry(v0), ReplicaEntry(moved, revision=2))), FakeClient)
    assert not d["drafter-0"].lost


class Follower:
    """Another orchestrator: real pools following the owner's views."""

    def __init__(self, name, index, view=None, share=0):
        self.name, self.index, self.share = name, index, share
        self.pools = {"verifier": Pool("verifier"), "drafter": Pool("drafter")}
        self.version, self.active, self.draining = -1, 0, False
        if view is not None:
            self.follow(view, share)

    def follow(self, view, share):
        follow(self.pools, view, FakeClient)
        self.version, self.share = view.version, share

    def report(self):
        return OrchestratorReport(
            self.name, self.index, active_requests=self.active, max_active_requests=self.share,
            draining=self.draining, view_version=self.version,
            sessions={r.spec.name: r.sessions for p in self.pools.values() for r in p.replicas.values()},
            lost={r.spec.name: r.revision for p in self.pools.values() for r in p.lost()})


class FakePeers:
    def __init__(self):
        self.followers: dict[str, Follower] = {}
        self.silent: set[str] = set()                    # listed, not answering
        self.started, self.retired = [], []
        self.streams_done = asyncio.Event()              # a retiring follower's streams end

    async def reports(self):
        return {n: None if n in self.silent else f.report() for n, f in self.followers.items()}

    async def follow(self, name, view, share):
        self.followers[name].follow(view, share)

    async def start(self, index, view, share):
        self.started.append(index)
        self.followers[f"o-{index}"] = Follower(f"o-{index}", index, view, share)

    async def retire(self, name):
        self.followers[name].draining = True
        await self.streams_done.wait()
        del self.followers[name]
        self.retired.append(name)


def owner_with(peers, pools, total=10, **scaler_kw):
    own = {"share": total}

    def own_report():
        return OrchestratorReport("o", 0, active_requests=0, max_active_requests=own["share"])

    group = Group(peers, pools, own_report, total, lambda n: own.update(share=n))
    launcher = scaler_kw.pop("launcher", FakeLauncher())
    return Scaler(pools, launcher, FakeClient, group=group, **scaler_kw), group, own


def test_a_drained_replica_is_handed_back_only_when_no_orchestrator_can_use_it():
    async def run():
        pools = {"verifier": pool_of(1, "verifier"), "drafter": pool_of(2)}
        peers = FakePeers()
        scaler, group, _ = owner_with(peers, pools)
        peers.followers["o-1"] = f = Follower("o-1", 1)
        await scaler.tick()                              # it gets the list
        assert set(f.pools["drafter"].replicas) == {"drafter-0", "drafter-1"} and f.version == group.version
        await scaler.scale("drafter", 1)                 # drains drafter-1 (idle on the owner, the newest)
        assert pools["drafter"].replicas["drafter-1"].draining
        # The follower's last report (0 sessions there) predates the drain: it could
        # still open one there, so the replica stays until it reports on the new list.
        await scaler.tick()
        assert "drafter-1" in pools["drafter"].replicas and f.pools["drafter"].replicas["drafter-1"].draining
        f.pools["drafter"].replicas["drafter-1"].client.active = 1   # a session it opened before the drain
        await scaler.tick()
        assert "drafter-1" in pools["drafter"].replicas
        f.pools["drafter"].replicas["drafter-1"].client.active = 0
        peers.silent.add("o-1")                          # not answering: it might hold a session
        await scaler.tick()
        assert "drafter-1" in pools["drafter"].replicas
        peers.silent.clear()
        await scaler.tick()
        assert "drafter-1" not in pools["drafter"].replicas and scaler.launcher.stopped == ["drafter-1"]
        assert "drafter-1" not in f.pools["drafter"].replicas   # the same tick hands the new list on
        # A drain between reading the reports and reaping: they predate it.
        await scaler.scale("drafter", 2)
        await scaler.tick()
        await group.refresh()
        await scaler.scale("drafter", 1)
        await scaler.reap()
        assert len(pools["drafter"].replicas) == 2
    asyncio.run(run())


def test_a_loss_a_follower_finds_is_located_by_the_owner():
    async def run():
        pools = {"verifier": pool_of(1, "verifier"), "drafter": pool_of(1)}
        moved = ReplicaSpec("drafter", "drafter-0", "h:moved")
        peers = FakePeers()
        scaler, group, _ = owner_with(peers, pools, launcher=LocatingLauncher({"drafter-0": moved}))
        peers.followers["o-1"] = f = Follower("o-1", 1)
        await scaler.tick()
        lost = f.pools["drafter"].replicas["drafter-0"]
        assert Pool.mark_lost(lost, lost.client)         # its call failed UNAVAILABLE; the owner saw nothing
        await scaler.tick()                              # reported, located, revived, handed back
        r = pools["drafter"].replicas["drafter-0"]
        assert r.spec == moved and r.revision == 1 and not r.lost
        assert lost.spec == moved and not lost.lost and lost.revision == 1
        await scaler.tick()                              # the old report is no news
        assert not r.lost and r.revision == 1
    asyncio.run(run())


def test_orchestrators_scale_and_the_shares_follow():
    async def run():
        pools = {"verifier": pool_of(1, "verifier"), "drafter": pool_of(1)}
        peers = FakePeers()
        _, group, own = owner_with(peers, pools, total=10)
        await group.scale(3)
        assert peers.started == [1, 2] and own["share"] == 4
        assert {n: f.share for n, f in peers.followers.items()} == {"o-1": 3, "o-2": 3}
        assert all(f.version == group.version and "drafter-0" in f.pools["drafter"].replicas
                   for f in peers.followers.values())
        peers.followers["o-1"].active = 2                # o-2 is the least loaded: it leaves
        await group.scale(2)
        await asyncio.sleep(0)
        assert peers.followers["o-2"].draining and group.retiring() == {"o-2"}
        assert own["share"] + peers.followers["o-1"].share == 10   # the leaving one's share is re-split
        await group.scale(3)                             # its name is still taken while it drains
        assert peers.started == [1, 2, 3]
        assert own["share"] + peers.followers["o-1"].share + peers.followers["o-3"].share == 10
        peers.streams_done.set()
        await asyncio.sleep(0.01)
        assert peers.retired == ["o-2"] and group.retiring() == set()
        for bad in (0, 11):                              # the owner stays; each needs a share of at least 1
            with pytest.raises(InvalidRequest):
                await group.scale(bad)
    asyncio.run(run())


def test_autoscaling_counts_every_orchestrators_sessions():
    async def run():
        pools = {"verifier": pool_of(1, "verifier"), "drafter": pool_of(1)}
        peers = FakePeers()
        scaler, _, _ = owner_with(peers, pools, policies={"drafter": AutoscalePolicy(1, 4, 2)})
        peers.followers["o-1"] = f = Follower("o-1", 1)
        await scaler.tick()
        for _ in range(5):
            f.pools["drafter"].acquire()                 # 5 sessions elsewhere, none on the owner
        await scaler.tick()
        assert len(pools["drafter"].serving()) == 3
        assert len(f.pools["drafter"].serving()) == 3    # and the follower routes over them at once
    asyncio.run(run())


def test_specd_status_prints_a_line_per_orchestrator(capsys):
    from specd.cli import print_status
    from specd_core.api.v1 import specdec_pb2 as pb

    status = pb.ClusterStatus(
        replicas=[pb.ReplicaStatus(kind="verifier", name="specd-verifier-0", sessions=16)],
        active_requests=16, scalable=True, max_active_requests=40, answered_by="specd-orchestrator-1",
        orchestrators=[
            pb.OrchestratorStatus(name="specd-orchestrator", address="10.0.0.5:50051", pid=11, active_requests=7,
                                  max_active_requests=40, owner=True, metrics_address="10.0.0.5:9000"),
            pb.OrchestratorStatus(name="specd-orchestrator-1", address="10.0.0.5:50051", pid=12, active_requests=9,
                                  max_active_requests=20, draining=True)])
    print_status(status)
    out = capsys.readouterr().out.splitlines()
    assert "active requests: 16 of 40" in out
    first = next(line for line in out if line.startswith("specd-orchestrator (owner)"))
    second = next(line for line in out if line.startswith("specd-orchestrator-1 "))
    assert "7/40" in first and "serving" in first and "10.0.0.5:9000" in first
    assert "9/20" in second and "draining" in second and " 12 " in second
    assert "answered by specd-orchestrator-1" in out[-1]
