"""Automatic prefix caching through the real services: greedy
outputs of requests that hit the cache equal target-only (chains and trees);
`cached_prompt_tokens` on a second request sharing a prefix, none with a
different `cache_salt`; and a stress run - concurrent streams on shared random
prefixes, 64 at a time, chains, trees and plain decoding mixed, random cancellations, a KV
budget so small that cached blocks are evicted throughout - after which every
output equals target-only and every block is free or cached (the replicas
hold no block: no reference leaked)."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.grpc_util import open_channel
from specd_core.runtime.models import load_model
from tests.test_greedy_exact import MAX_NEW, assert_same_or_near_tie, reference

pytestmark = pytest.mark.services

BLOCK = 8
# Rows are 512 bytes (2 layers x K, V x 2 heads x 16 x 4 bytes; the drafter is
# the target plus noise): 1,536 blocks of 8 rows each, a little more than the
# stress run's 64 streams may hold at once (at most 21 blocks each: 136 prompt
# tokens, 24 new, a draft) and less than its distinct blocks (384 prefixes of
# up to 15 blocks, every prompt's suffix, every stream's generated rows), so
# cached blocks are evicted all the time.
SERVICE_ARGS = ("--kv-block-size", str(BLOCK), "--kv-cache-memory", "6MiB")


@pytest.fixture(scope="module")
def stack(pairs):
    target, drafter = pairs["llama"]
    s = Stack(target, drafter, SERVICE_ARGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def target(pairs):
    return load_model(pairs["llama"][0], "cpu")


def info(address: str, stub_cls) -> pb.ReplicaInfo:
    with open_channel(address) as ch:
        return stub_cls(ch).Info(pb.ReplicaInfoRequest(), timeout=30)


def prompts_on(prefix: list[int], rng: random.Random, n: int) -> list[list[int]]:
    return [prefix + [rng.randrange(3, 380) for _ in range(rng.randrange(1, 12))] for _ in range(n)]


@pytest.mark.parametrize("shape", [dict(num_speculative_tokens=3), dict(tree={"branching": [2, 2, 1]})],
                         ids=["chain", "tree"])
def test_cache_hits_equal_target_only(stack, target, shape):
    rng = random.Random(str(shape))
    prefix = [rng.randrange(3, 380) for _ in range(45)]
    for n, p in enumerate(prompts_on(prefix, rng, 4)):
        got, last = stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW, **shape)
        assert_same_or_near_tie(got, *reference(target, p), f"{shape} prompt {n}")
        # The first request computed the prefix's 5 full blocks; the others reuse them.
        assert last.stats.cached_prompt_tokens == (0 if n == 0 else 40), n


def test_cache_salt_keeps_requests_apart(stack):
    prompt = [random.Random(5).randrange(3, 380) for _ in range(30)]

    def cached(salt: str) -> int:
        _, last = stack.generate(prompt_token_ids={"ids": prompt}, max_new_tokens=2, cache_salt=salt)
        return last.stats.cached_prompt_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # the same prompt, another salt: no hit
    assert cached("tenant-a") == 24  # the same salt: its 3 full blocks (all rows but the last computed)
    assert cached("") == 0


STREAMS, CONCURRENCY = 384, 64
SHAPES = [dict(num_speculative_tokens=3), dict(tree={"branching": [2, 2, 1]}), dict(num_speculative_tokens=0),
          dict(tree={"node_budget": 8, "max_depth": 4, "top_k": 3}), dict(num_speculative_tokens=5)]


async def one(stub, prompt: list[int], rng: random.Random) -> tuple[list[int], bool]:
    """A greedy stream, cancelled after a random number of messages in a third
    of the cases: (the tokens received, whether it ran to its end)."""
    req = pb.GenerateRequest(prompt_token_ids={"ids": prompt}, max_new_tokens=MAX_NEW, **rng.choice(SHAPES))
    stop_after = rng.randint(1, 4) if rng.random() < 0.33 else None
    call, ids, received = stub.Generate(req, timeout=120), [], 0
    async for r in call:
        ids += r.token_ids
        received += 1
        if received == stop_after:
            call.cancel()
            return ids, False
    return ids, True


async def run_streams(address: str, prompts: list[list[int]], seed: int) -> list[tuple[list[int], bool]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.OrchestratorServiceStub(channel)
        gate = asyncio.Semaphore(CONCURRENCY)
        rngs = [random.Random(seed * 1000 + i) for i in range(len(prompts))]

        async def gated(p, r):
            async with gate:
                return await one(stub, p, r)

        return await asyncio.gather(*(gated(p, r) for p, r in zip(prompts, rngs)))


def settled(stack) -> tuple[pb.ReplicaInfo, pb.ReplicaInfo]:
    """The replicas' info once every session is closed (closing runs after a
    cancelled client has left: wait for it, bounded)."""
    deadline = time.monotonic() + 60
    while True:
        v = info(stack.verifier.address, pb_grpc.VerifierServiceStub)
        d = info(stack.drafter_proc.address, pb_grpc.DrafterServiceStub)
        if (v.sessions == d.sessions == 0) or time.monotonic() > deadline:
            return v, d
        time.sleep(0.2)


def test_stress_shared_prefixes_cancellations_and_eviction(stack, target):
    rng = random.Random(34)
    prefixes = [[rng.randrange(3, 380) for _ in range(rng.randrange(24, 121))] for _ in range(384)]
    prompts = [
        rng.choice(prefixes)[: rng.randrange(8, 121)] + [rng.randrange(3, 380) for _ in range(rng.randrange(1, 17))]
        for _ in range(STREAMS)
    ]
    before = info(stack.verifier.address, pb_grpc.VerifierServiceStub)
    results = asyncio.run(run_streams(stack.orchestrator.address, prompts, 34))
    wants = {tuple(p): reference(target, p) for p in prompts}
    ended = 0
    for n, (p, (got, complete)) in enumerate(zip(prompts, results)):
        want, gaps = wants[tuple(p)]
        if complete:
            ended += 1
            assert_same_or_near_tie(got, want, gaps, f"stream {n}")
        else:  # a cancelled stream's tokens are the start of the same output
            assert_same_or_near_tie(got, want[: len(got)], gaps, f"cancelled stream {n}")
    assert STREAMS // 2 <= ended < STREAMS
    v, d = settled(stack)
    print(f"{ended} of {STREAMS} streams ran to their end; verifier: {v.prefix_hit_tokens} of "
          f"{v.prefix_queried_tokens} prompt tokens cached, {v.prefix_evicted_blocks} blocks evicted; "
          f"drafter: {d.prefix_hit_tokens} of {d.prefix_queried_tokens}, {d.prefix_evicted_blocks} evicted")
    for kind, r in (("verifier", v), ("drafter", d)):
        assert r.sessions == 0 and r.kv_used_blocks == 0, (kind, r)  # no reference leaked
        assert r.prefix_caching and r.prefix_idle_blocks == r.prefix_cached_blocks, (kind, r)
    assert v.prefix_hit_tokens > before.prefix_hit_tokens
    assert v.prefix_evicted_blocks > before.prefix_evicted_blocks, v  # the budget forced evictions
    assert d.prefix_evicted_blocks > 0 and d.prefix_hit_tokens > 0, d
    # Still serving, and from the cache.
    got, last = stack.generate(prompt_token_ids={"ids": prompts[0]}, max_new_tokens=MAX_NEW)
    assert_same_or_near_tie(got, *wants[tuple(prompts[0])], "after the stress")
