"""Prefix routing as pure units: the table of prompt prefixes sent to each
replica (orchestrator/fleet/prefix_routing.py) and the rule of Pool.acquire
that uses it, with fake clients (the real services: tests/test_prefix_routing_services.py)."""

import asyncio
import random

import grpc
import pytest

from orchestrator.config import OrchestratorConfig, ReplicaSpec
from orchestrator.fleet.clients import ServiceError
from orchestrator.fleet.failover import FailoverDrafter, FailoverVerifier
from orchestrator.fleet.pool import Pool
from orchestrator.fleet.prefix_routing import PrefixRouting, PrefixTable, routing_from
from specd_core.rules.sampling import SamplingParams

pytestmark = pytest.mark.unit

C = 16  # the table's chunk


def tokens(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(n)]


class FakeClient:
    def __init__(self):
        self.active = 0
        self.opened = []

    async def open(self, session_id, prompt_ids, sampling, **kw):
        self.opened.append(list(prompt_ids))
        return 0


def pool_of(n, routing=True, **rule):
    pool = Pool("verifier", routing=PrefixRouting(**rule) if routing else None)
    for i in range(n):
        spec = ReplicaSpec("verifier", f"v{i}", f"h:{i}")
        pool.add(spec, FakeClient())
    return pool


def load(pool, **sessions):
    for name, n in sessions.items():
        pool.replicas[name].client.active = n


# ---- the table


def test_whole_chunks_of_the_leading_tokens_match():
    t = PrefixTable()
    p = tokens(1, 100)  # 6 whole chunks
    assert t.matched("a", p) == 0
    t.record("a", p)
    assert t.matched("a", p) == 6 * C
    assert t.matched("a", p[:50]) == 3 * C  # its whole chunks
    assert t.matched("a", p[:15]) == 0  # not one whole chunk
    assert t.matched("a", p[:96] + tokens(2, 40)) == 6 * C  # a longer prompt on the same prefix
    assert t.matched("a", p[:40] + [p[40] + 1] + p[41:]) == 2 * C  # up to the chunk that differs
    assert t.matched("a", [p[0] + 1] + p[1:]) == 0  # chained: a first token that differs matches nothing
    assert t.matched("b", p) == 0  # another replica
    # A chunk's name stands for its whole prefix: the same tokens elsewhere do not match.
    assert t.matched("a", tokens(3, 16) + p[16:]) == 0


def test_salts_never_match_each_other():
    t = PrefixTable()
    p = tokens(4, 64)
    t.record("a", p, "tenant-1")
    assert t.matched("a", p, "tenant-1") == 64
    assert t.matched("a", p, "tenant-2") == 0
    assert t.matched("a", p, "") == 0
    t.record("a", p)
    assert t.matched("a", p) == 64 and t.matched("a", p, "tenant-2") == 0


def test_each_replica_keeps_a_bounded_lru():
    t = PrefixTable(capacity=10)
    old, new = tokens(5, 6 * C), tokens(6, 6 * C)
    t.record("a", old)
    t.record("a", new)  # 12 names: the oldest two go
    assert t.size("a") == 10
    # The old prompt's tail went first: its head still matches, no orphaned tail.
    assert t.matched("a", old) == 4 * C and t.matched("a", new) == 6 * C
    t.record("a", old[: 2 * C])  # its head, used again, is the most recent now
    t.record("a", tokens(7, 8 * C))  # 8 new names push out the least recent 8
    assert t.matched("a", old) == 2 * C and t.matched("a", new) == 0
    t.record("b", tokens(8, 40 * C))  # a prompt longer than the capacity keeps its head
    assert t.size("b") == 10 and t.matched("b", tokens(8, 40 * C)) == 10 * C
    assert t.size("a") == 10  # replicas apart


def test_forgetting_a_replica():
    t = PrefixTable()
    p = tokens(9, 64)
    t.record("a", p)
    t.record("b", p)
    t.forget("a")
    t.forget("nobody")
    assert t.matched("a", p) == 0 and t.matched("b", p) == 64


def test_a_pool_forgets_replicas_whose_cache_is_gone():
    pool = pool_of(3)
    p = tokens(10, 64)
    for name in ("v0", "v1", "v2"):
        pool.routing.table.record(name, p)
    old = pool.replicas["v0"].client
    assert Pool.mark_lost(pool.replicas["v0"], old)
    pool.revive("v0", ReplicaSpec("verifier", "v0", "h:9"), FakeClient())  # a restarted process
    assert pool.routing.table.matched("v0", p) == 0
    pool.remove("v1")
    assert pool.routing.table.matched("v1", p) == 0
    assert pool.mark_lost_at("v2", 0)  # another orchestrator found it lost
    assert pool.routing.table.matched("v2", p) == 0
    pool.routing.table.record("v0", p)
    pool.replicas["v0"].draining = True
    assert [r.spec.name for r in pool.reap()] == ["v0"]  # handed back
    assert pool.routing.table.matched("v0", p) == 0


def test_a_lease_that_loses_its_replica_forgets_it():
    pool = pool_of(2)
    p = tokens(11, 64)

    async def run():
        v = FailoverVerifier(pool, lambda: p)
        await v.open("s", p, SamplingParams())
        held = v.lease.held.spec.name
        assert pool.routing.table.matched(held, p) == 64
        v.lease.lose("s", ServiceError(grpc.StatusCode.UNAVAILABLE, "gone"))
        await asyncio.sleep(0)  # its background close
        assert pool.routing.table.matched(held, p) == 0

    asyncio.run(run())


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="bound >= 0"):
        PrefixRouting(bound=-0.5)
    with pytest.raises(ValueError, match="slack >= 0"):
        PrefixRouting(slack=-1)
    with pytest.raises(ValueError, match="--prefix-routing-bound >= 0"):
        OrchestratorConfig(target_dir="t", prefix_routing_bound=-1)


# ---- the rule


def test_the_longest_match_wins():
    pool = pool_of(3)
    p = tokens(12, 200)
    pool.routing.table.record("v1", p[:64])
    pool.routing.table.record("v2", p[:160])
    load(pool, v0=2, v1=3, v2=4)
    assert pool.acquire(p).spec.name == "v2"  # the busiest, within 1.5 x 2 + 2
    # The prompt is recorded there: the whole of it matches now.
    assert pool.routing.table.matched("v2", p) == 192
    assert pool.acquire(tokens(13, 200)).spec.name == "v0"  # no match anywhere: least loaded
    assert pool.acquire(p[:15]).spec.name in {"v0", "v1"}  # under one chunk: by load


def test_ties_on_the_match_go_to_the_least_loaded():
    pool = pool_of(3)
    p = tokens(14, 80)
    for name in ("v0", "v1"):
        pool.routing.table.record(name, p)
    load(pool, v0=3, v1=1, v2=0)
    assert pool.acquire(p).spec.name == "v1"  # not v2, the least loaded, which has no match
    load(pool, v0=1, v1=1)
    assert pool.acquire(p).spec.name == "v0"  # equal load: the oldest


def test_the_bound_is_respected():
    pool = pool_of(2, bound=1.5, slack=2)
    p = tokens(15, 80)
    pool.routing.table.record("v0", p)
    load(pool, v0=4, v1=2)  # 4 + 1 <= 1.5 * 2 + 2
    assert pool.acquire(p).spec.name == "v0"
    assert pool.replicas["v0"].sessions == 5
    # 5 + 1 > 1.5 * 2 + 2: load wins, and the other replica caches the prefix from now on.
    assert pool.acquire(p).spec.name == "v1"
    assert pool.routing.table.matched("v1", p) == 80
    # A holder past the bound leaves the next-longest holder within it in play.
    pool3 = pool_of(3, bound=1.5, slack=2)
    pool3.routing.table.record("v0", p)
    pool3.routing.table.record("v1", p[:32])
    load(pool3, v0=9, v1=3, v2=2)
    assert pool3.acquire(p).spec.name == "v1"
    load(pool3, v0=9, v1=5, v2=2)
    assert pool3.acquire(p).spec.name == "v2"


def test_a_popular_prefix_spreads_once_the_bound_is_hit():
    """100 sessions, 90 % of them on one long prefix, sessions ending at random:
    every session routed for its cache leaves its replica within bound x the
    other's + slack, and the popular prefix spreads over both replicas."""
    bound, slack = 1.5, 2
    pool = pool_of(2, bound=bound, slack=slack)
    rng = random.Random(16)
    popular = tokens(17, 300)
    open_sessions, routed = [], {"v0": 0, "v1": 0}
    for i in range(100):
        if open_sessions and rng.random() < 0.4:  # a random session ends
            Pool.release(open_sessions.pop(rng.randrange(len(open_sessions))))
        shared = rng.random() < 0.9
        prompt = popular + tokens(1000 + i, rng.randrange(1, 40)) if shared else tokens(2000 + i, 200)
        r = pool.acquire(prompt)
        open_sessions.append(r)
        other = next(x for x in pool.replicas.values() if x is not r)
        # The replica that took it stays within the bound of the other (only
        # sessions ending can leave one further ahead; new ones then go to the other).
        assert r.sessions <= bound * other.sessions + slack, (i, r.spec.name, r.sessions, other.sessions)
        if shared:
            routed[r.spec.name] += 1
    print(f"popular prefix sessions per replica: {routed}")
    assert min(routed.values()) >= 0.3 * sum(routed.values()), routed  # spread, not pinned
    for name in ("v0", "v1"):
        assert pool.routing.table.matched(name, popular) == 288  # both cache it


def test_off_means_the_least_loaded():
    pool = pool_of(2, routing=False)
    p = tokens(18, 80)
    load(pool, v0=0, v1=1)
    assert pool.acquire(p).spec.name == "v0"
    assert pool.acquire(p).spec.name in {"v0", "v1"}
    load(pool, v0=5, v1=1)
    assert pool.acquire(p).spec.name == "v1"
    off = OrchestratorConfig(target_dir="t", prefix_routing=False)
    assert routing_from(off) is None
    on = routing_from(OrchestratorConfig(target_dir="t", prefix_routing_bound=2, prefix_routing_slack=0))
    assert on is not None and (on.bound, on.slack) == (2, 0)


def test_without_a_prompt_the_least_loaded_as_before():
    pool = pool_of(3)
    pool.routing.table.record("v2", tokens(19, 80))
    got = [pool.acquire().spec.name for _ in range(6)]
    assert sorted(got) == ["v0", "v0", "v1", "v1", "v2", "v2"]


def test_sessions_open_on_the_replica_holding_their_prefix():
    """FailoverVerifier.open and FailoverDrafter.open route by the prompt and
    the sampling's cache_salt."""
    p = tokens(20, 64)
    salted = SamplingParams(cache_salt="t1")
    for cls in (FailoverVerifier, FailoverDrafter):
        pool = pool_of(2)
        pool.routing.table.record("v1", p, "t1")
        load(pool, v0=0, v1=1)
        s = cls(pool, lambda: p)
        asyncio.run(s.open("a", p, salted))
        assert s.lease.held.spec.name == "v1", cls
        s = cls(pool, lambda: p)
        asyncio.run(s.open("b", p, SamplingParams()))  # another salt: no match, by load
        assert s.lease.held.spec.name == "v0", cls
