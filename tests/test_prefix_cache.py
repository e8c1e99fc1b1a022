"""Automatic prefix caching (specd_core/runtime/prefix_cache.py, its use by the
KV pool and LeanSession, the verifier and drafter cores): block names chained
over the tokens and seeded with the model, dtype and salt; references and
least-recently-used eviction in a small pool; no block leaked after random
sequences of opens, prefills, rollbacks and closes (property-based); shared
rows never written; the cores' greedy results with cache hits equal to
theirs with prefix caching off, for chains and trees."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drafter_svc.config import DrafterConfig
from drafter_svc.core import Drafter
from specd_core.errors import CapacityExceeded
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams
from specd_core.runtime.kv_budget import KVPool
from specd_core.runtime.lean import LeanModel
from specd_core.runtime.models import load_model
from specd_core.runtime.prefix_cache import PrefixCache, block_hashes, chain_seed, publish_prefix, reuse_prefix
from specd_core.runtime.propose_call import ProposeCall
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier

pytestmark = pytest.mark.unit

B = 4  # rows per block in the pool tests


def test_names_chain_over_every_block_before():
    seed = chain_seed("m", "float32")
    a = block_hashes(seed, list(range(10)), B)
    assert len(a) == 2  # the partial third block is not named
    assert block_hashes(seed, list(range(8)) + [99, 98], B) == a  # only full blocks count
    b = block_hashes(seed, [7] + list(range(1, 10)), B)  # block 0 differs ...
    assert b[0] != a[0] and b[1] != a[1]  # ... so every later name does too (same tokens in block 1)
    c = block_hashes(seed, list(range(4)) + [0, 0, 0, 0], B)
    assert c[0] == a[0] and c[1] != a[1]


@pytest.mark.parametrize("other", [("m2", "float32", ""), ("m", "bfloat16", ""), ("m", "float32", "tenant-b")])
def test_model_dtype_and_salt_seed_apart(other):
    tokens = list(range(8))
    assert block_hashes(chain_seed(*other), tokens, B)[0] != block_hashes(chain_seed("m", "float32"), tokens, B)[0]
    # The parts are length-prefixed: moving a character between them changes the seed.
    assert chain_seed("ab", "c") != chain_seed("a", "bc")


def pool_with_cache(blocks: int) -> KVPool:
    pool = KVPool(blocks, B, 16, "verifier")
    pool.prefix = PrefixCache("m", "float32")
    return pool


def test_shared_blocks_are_counted_once_and_cached_when_idle():
    pool = pool_with_cache(6)
    names = pool.prefix.names(list(range(8)), B)
    ids = pool.take_blocks(2)
    assert pool.name_blocks(list(zip(ids, names))) == ids
    assert pool.share(names) == ids and pool.used_blocks == 2  # a second holder: no new block
    pool.give_blocks(ids)
    assert pool.used_blocks == 2  # still held by the first
    pool.give_blocks(ids)
    assert pool.used_blocks == 0 and pool.free_blocks == 6 and len(pool.prefix.idle) == 2
    assert pool.share(names) == ids and pool.used_blocks == 2  # idle blocks are found again
    pool.give_blocks(ids)
    pool.check()


def test_a_name_taken_already_leaves_the_block_private():
    pool = pool_with_cache(4)
    names = pool.prefix.names(list(range(4)), B)
    a, b = pool.take_blocks(1), pool.take_blocks(1)
    assert pool.name_blocks([(a[0], names[0])]) == a
    assert pool.name_blocks([(b[0], names[0])]) == []  # computed at the same time: stays b's own
    pool.give_blocks(b)
    assert pool.used_blocks == 1 and b[0] not in pool.prefix
    pool.give_blocks(a)
    pool.check()


def test_idle_blocks_are_evicted_least_recently_used_first():
    pool = pool_with_cache(3)
    chains = [pool.prefix.names([k] * B, B) for k in range(3)]
    for names in chains:  # three one-block prompts, cached, then idle in this order
        ids = pool.take_blocks(1)
        pool.name_blocks([(ids[0], names[0])])
        pool.give_blocks(ids)
    pool.give_blocks(pool.share(chains[0]))  # used again: now the most recent
    got = pool.take_blocks(1)  # no never-used block left: the LRU idle one goes
    assert pool.share(chains[1]) == [] and pool.prefix.evicted_blocks == 1
    assert len(pool.share(chains[0])) == 1 and len(pool.share(chains[2])) == 1
    with pytest.raises(CapacityExceeded):  # held blocks are never evicted
        pool.take_blocks(1)
    pool.give_blocks(got)
    pool.check()


@pytest.fixture(scope="module")
def lean(pairs):
    return LeanModel(load_model(pairs["llama"][0], "cpu"))


def test_shared_rows_are_never_rolled_back_or_compacted(lean):
    pool = pool_with_cache(16)
    prompt = list(range(3, 3 + 3 * B + 1))
    first = lean.new_session(pool=pool)
    assert reuse_prefix(first, prompt, "", len(prompt) - 1) == 0
    first.forward(prompt)
    publish_prefix(first)
    s = lean.new_session(pool=pool)
    assert reuse_prefix(s, prompt, "", len(prompt) - 1) == 3 * B
    s.forward(prompt[3 * B :] + [5, 6])
    with pytest.raises(ValueError, match="shared"):
        s.rollback(3 * B - 1)
    with pytest.raises(ValueError, match="shared"):
        s.compact(2 * B, [1, 2])
    s.rollback(3 * B)
    for x in (first, s):
        x.release()
    assert pool.used_blocks == 0
    pool.check()


def test_a_different_salt_finds_nothing(lean):
    pool = pool_with_cache(16)
    prompt = list(range(3, 3 + 2 * B + 1))
    a = lean.new_session(pool=pool)
    reuse_prefix(a, prompt, "t1", len(prompt) - 1)
    a.forward(prompt)
    publish_prefix(a)
    b, c = lean.new_session(pool=pool), lean.new_session(pool=pool)
    assert reuse_prefix(b, prompt, "t2", len(prompt) - 1) == 0
    assert reuse_prefix(c, prompt, "t1", len(prompt) - 1) == 2 * B
    for x in (a, b, c):
        x.release()
    pool.check()


OPS = st.lists(
    st.tuples(st.sampled_from(["open", "step", "rollback", "close"]), st.integers(0, 7), st.integers(0, 10**6)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_no_block_leaks_under_random_sessions(lean, ops):
    """Sessions open on prompts from a few shared prefixes (reusing what is
    cached, naming what they computed), grow, roll back and close in any
    order in a pool small enough to evict; the pool's books always balance,
    and once all are closed every block is free or idle cached."""
    pool = pool_with_cache(24)
    prefixes = [[3 + k] * (2 * B) + list(range(10, 10 + B)) for k in range(3)]
    sessions: dict[int, object] = {}
    for op, slot, r in ops:
        rng = random.Random(r)
        s = sessions.get(slot)
        try:
            if op == "open" and s is None:
                prompt = rng.choice(prefixes)[: rng.randrange(1, 3 * B + 1)] + [rng.randrange(3, 200)]
                s = sessions[slot] = lean.new_session(pool=pool)
                cached = reuse_prefix(s, prompt, rng.choice(["", "x"]), len(prompt) - 1)
                s.forward(prompt[cached:])
                publish_prefix(s)
            elif op == "step" and s is not None:
                s.forward([rng.randrange(3, 200) for _ in range(rng.randrange(1, B + 2))])
            elif op == "rollback" and s is not None:
                s.rollback(rng.randrange(s.frozen, s.length + 1))
            elif op == "close" and s is not None:
                sessions.pop(slot).release()
        except CapacityExceeded:
            if op == "open":
                sessions.pop(slot).release()  # as the cores do with a refused open
        pool.check()
    for s in sessions.values():
        s.release()
    assert pool.used_blocks == 0
    pool.check()


KW = dict(device="cpu", kv_block_size=8, kv_cache_memory="2MiB", warmup=False)


@pytest.fixture(scope="module")
def verifiers(pairs):
    target, _ = pairs["llama"]
    return Verifier(VerifierConfig(target, **KW)), Verifier(VerifierConfig(target, prefix_caching=False, **KW))


def prompts_sharing_a_prefix(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 200) for _ in range(41)]
    return [prefix + [rng.randrange(3, 200) for _ in range(3 + i)] for i in range(n)]


@pytest.mark.parametrize("parents", [None, [-1, 0, 0, 1, 1, 2]], ids=["chain", "tree"])
def test_verifier_hits_equal_no_caching(verifiers, parents):
    """Greedy first tokens and verify verdicts of sessions whose prompts share a
    prefix: with cache hits exactly what the verifier without prefix caching gives."""
    results = []
    for v in verifiers:
        got = []
        for i, prompt in enumerate(prompts_sharing_a_prefix(3)):
            job = v.prepare_open(f"s{i}", prompt, SamplingParams())
            first = v.verify_batch([job])[0]
            draft = [prompt[-1], first, 7, 8, 9, 10]
            r = v.verify(f"s{i}", draft, parents)
            got.append((first, r.path, r.tokens, v.verify(f"s{i}", [11, 12]).tokens, job.cached))
        for i in range(3):
            v.close_session(f"s{i}")
        v.kv_pool.check()
        assert v.kv_pool.used_blocks == 0
        results.append(got)
    on, off = results
    assert [g[:4] for g in on] == [g[:4] for g in off]
    assert [g[4] for g in on][1:] == [40, 40] and [g[4] for g in off] == [0, 0, 0]


def test_drafter_hits_equal_no_caching(pairs):
    """The draft-model drafter's proposals (a chain, then a static tree) after
    prefills that reused a prefix equal those of a drafter without caching."""
    _, drafter = pairs["llama"]
    out = []
    for on in (True, False):
        d = Drafter(DrafterConfig(drafter, prefix_caching=on, **KW))
        got = []
        for i, prompt in enumerate(prompts_sharing_a_prefix(3, seed=1)):
            d.open_session(f"s{i}", prompt, SamplingParams())
            a = d.propose(ProposeCall(session_id=f"s{i}", accepted_path=[], committed=[], shape=DraftShape.chain(4)))
            tree = DraftShape(branching=(2, 2))
            kept = [a.tree.tokens[0], 9]  # the first draft token kept, then a correction
            b = d.propose(ProposeCall(session_id=f"s{i}", accepted_path=[0], committed=kept, shape=tree))
            got.append((a.tree.tokens, b.tree.tokens, b.tree.parents))
            d.close_session(f"s{i}")
        d.kv_pool.check()
        info = d.info()
        assert info["kv_used_blocks"] == 0 and info["prefix_caching"] is on
        if on:
            assert info["prefix_hit_tokens"] == 2 * 40
        out.append(got)
    assert out[0] == out[1]


def test_features_sessions_compute_every_row(verifiers):
    """A session returning the target's features (EAGLE) needs every prompt
    row's hidden state: it reuses nothing, but caches its blocks for others."""
    v, _ = verifiers
    prompt = prompts_sharing_a_prefix(1, seed=2)[0]
    job = v.prepare_open("h", prompt, SamplingParams(), hidden=True)
    first, hidden = v.verify_batch([job])[0]
    assert job.cached == 0 and hidden.rows == len(prompt)
    again = v.prepare_open("g", prompt, SamplingParams())
    assert v.verify_batch([again])[0] == first and again.cached == 40
    for i in ("h", "g"):
        v.close_session(i)
    v.kv_pool.check()


def test_the_last_prompt_row_is_always_computed(verifiers):
    """A prompt that is a whole number of cached blocks still forwards its last
    row (its logits are the first token's)."""
    v, _ = verifiers
    prompt = [5 + (i % 50) for i in range(32)]
    firsts = []
    for i in range(2):
        job = v.prepare_open(f"w{i}", prompt, SamplingParams())
        firsts.append(v.verify_batch([job])[0])
        assert job.cached == (0 if i == 0 else 24)
    assert firsts[0] == firsts[1]
    for i in range(2):
        v.close_session(f"w{i}")
    assert torch.is_tensor(v.kv_pool.storage.data)
    v.kv_pool.check()


def test_a_next_turn_starts_after_what_the_last_one_generated(verifiers):
    """A session's committed rows - its prompt and the tokens it generated,
    not its drafts - stay cached when it ends: the next turn (that
    conversation plus a new message) starts after them, with the verdicts of
    a verifier without caching."""
    results = []
    for v in verifiers:
        prompt = prompts_sharing_a_prefix(1, seed=3)[0]
        first = v.verify_batch([v.prepare_open("t1", prompt, SamplingParams())])[0]
        tokens = prompt + [first]
        for _ in range(4):
            tokens += v.verify("t1", [9, 10, 11]).tokens
        v.close_session("t1")
        job = v.prepare_open("t2", tokens + [21, 22, 23], SamplingParams())
        second = v.verify_batch([job])[0]
        verdict = v.verify("t2", [second, 5, 6])
        v.close_session("t2")
        v.kv_pool.check()
        results.append((tokens, second, verdict.path, verdict.tokens, job.cached))
    on, off = results
    assert on[:4] == off[:4]
    rows = len(on[0]) - 1  # the first turn's committed rows: all its tokens but the pending last
    assert rows // 8 * 8 > len(prompts_sharing_a_prefix(1, seed=3)[0]) // 8 * 8  # generated rows fill a block
    assert on[4] == rows // 8 * 8 and off[4] == 0
