"""1,000 Generate streams through a real orchestrator,
verifier and drafter, cancelled at random points (seeded): before the first
token, mid-stream, by a short client deadline, or run to the end; many at once.
Afterwards every service reports zero live sessions and the verifier's KV usage
is zero.

Cancellation points are counted in messages received, not in time, except for
the deadlines (whatever they cut, the outcome must be the same: no session left)."""
from __future__ import annotations

import asyncio
import collections
import random
import time

import grpc
import pytest

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.services

STREAMS = 1000
CONCURRENCY = 24
SETTINGS = [dict(num_speculative_tokens=3), dict(tree={"branching": [2, 1]}), dict(num_speculative_tokens=0),
            dict(speculative_method="ngram", num_speculative_tokens=2),
            dict(num_speculative_tokens=2, temperature=0.8, seed=5)]


async def one(stub, rng: random.Random, outcomes: collections.Counter) -> None:
    req = pb.GenerateRequest(prompt_token_ids={"ids": [rng.randrange(1, 384) for _ in range(rng.randint(1, 12))]},
                             max_new_tokens=rng.randint(2, 24), **rng.choice(SETTINGS))
    kind = rng.choices(["before_first", "mid_stream", "deadline", "complete"], [3, 4, 2, 1])[0]
    call = stub.Generate(req, timeout=rng.uniform(0.002, 0.05) if kind == "deadline" else 120)
    try:
        if kind == "before_first":
            for _ in range(rng.randint(0, 3)):       # let the request get as far as the open, or not
                await asyncio.sleep(0)
            call.cancel()
            outcomes[kind] += 1
            return
        stop_after = rng.randint(1, 6) if kind == "mid_stream" else None
        received = 0
        async for _ in call:
            received += 1
            if received == stop_after:
                call.cancel()
                outcomes["mid_stream"] += 1
                return
        outcomes["completed"] += 1
    except grpc.aio.AioRpcError as e:
        assert e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), (e.code(), e.details())
        outcomes[e.code().name] += 1
    except asyncio.CancelledError:
        outcomes["cancelled_while_reading"] += 1


async def run_all(address: str) -> collections.Counter:
    rng = random.Random(9)
    outcomes: collections.Counter = collections.Counter()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.OrchestratorServiceStub(channel)
        gate = asyncio.Semaphore(CONCURRENCY)
        rngs = [random.Random(rng.random()) for _ in range(STREAMS)]

        async def gated(r):
            async with gate:
                await one(stub, r, outcomes)
        await asyncio.gather(*(gated(r) for r in rngs))
    return outcomes


def live_state(stack) -> dict:
    v, d = scrape(stack.verifier.metrics_address), scrape(stack.drafter_proc.metrics_address)
    status = pb_grpc.AdminServiceStub(stack.channel).Status(pb.StatusRequest(), timeout=10)
    return {"verifier sessions": value(v, "specdec:active_sessions"),
            "verifier kv tokens": value(v, "specdec:kv_cache_tokens"),
            "drafter sessions": value(d, "specdec:active_sessions"),
            "orchestrator requests": status.active_requests,
            "orchestrator replica sessions": sum(r.sessions for r in status.replicas)}


def test_1000_cancelled_streams_leave_nothing_behind(metered):
    start = time.monotonic()
    outcomes = asyncio.run(run_all(metered.orchestrator.address))
    print(f"{STREAMS} streams in {time.monotonic() - start:.1f} s: {dict(outcomes)}")
    assert sum(outcomes.values()) == STREAMS
    # Every kind of ending really happened, many times.
    for kind in ("before_first", "mid_stream", "completed"):
        assert outcomes[kind] >= 50, outcomes
    assert outcomes["DEADLINE_EXCEEDED"] >= 20, outcomes
    # Closing runs after the client has left: wait (bounded) for it to settle.
    deadline = time.monotonic() + 60
    while any(live_state(metered).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    state = live_state(metered)
    assert not any(state.values()), state
    # The services still serve.
    ids, last = metered.generate(prompt_token_ids={"ids": [40, 41, 42]}, max_new_tokens=6)
    assert len(ids) == 6 and last.finish_reason == "length"
