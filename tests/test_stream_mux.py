"""The multiplexed stream server (specd_core/net/grpc_util.py: concurrent_stream)
as a unit: messages answered as their futures complete, in any order, each
with its request id; a message whose start fails, or one over the in-flight
limit, gets an error response and the stream goes on."""
from __future__ import annotations

import threading
from concurrent.futures import Future

import grpc
import pytest

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.errors import InvalidRequest
from specd_core.net.grpc_util import concurrent_stream, then

pytestmark = pytest.mark.unit


def test_answers_arrive_in_completion_order_with_their_ids():
    futures: dict[int, Future] = {}
    started = threading.Event()

    def start(request):
        if request.session_id == "bad":
            raise InvalidRequest("session id 'bad' is refused")
        f: Future = Future()
        futures[request.request_id] = f
        if len(futures) == 2:
            started.set()
        return then(f, lambda tokens: pb.VerifyResponse(token_ids=tokens))

    requests = [pb.VerifyRequest(session_id=s, request_id=i) for i, s in ((1, "a"), (2, "bad"), (3, "c"))]
    out = concurrent_stream(start, iter(requests), pb.VerifyResponse)
    first = next(out)  # the bad message is answered at once
    assert first.request_id == 2 and first.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "'bad'" in first.error.message
    assert started.wait(5)
    futures[3].set_result([7])
    futures[1].set_exception(RuntimeError("forward failed"))
    second, third = next(out), next(out)
    assert (second.request_id, list(second.token_ids)) == (3, [7])
    assert third.request_id == 1 and third.error.code == grpc.StatusCode.INTERNAL.value[0]
    assert "forward failed" in third.error.message
    assert list(out) == []  # the client closed its side and all are answered: the stream ends


def test_messages_over_the_in_flight_limit_are_refused_alone():
    pending: list[Future] = []

    def start(request):
        pending.append(Future())
        return then(pending[-1], lambda _: pb.VerifyResponse(num_accepted=1))

    requests = [pb.VerifyRequest(session_id="s", request_id=i) for i in range(1, 5)]
    out = concurrent_stream(start, iter(requests), pb.VerifyResponse, max_pending=2)
    refused = [next(out), next(out)]
    assert sorted(r.request_id for r in refused) == [3, 4]
    assert all(r.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] for r in refused)
    for f in pending:
        f.set_result(None)
    rest = list(out)
    assert sorted(r.request_id for r in rest) == [1, 2] and all(r.num_accepted == 1 for r in rest)


def test_a_step_in_and_a_batch_of_answers_out_are_one_message_each():
    """Steps (VerifyStep in, VerifyStepResponse out): every part of a step is
    started, and the answers a batch completes together, deferred to its end
    by `later` as the Batcher does, leave as one message."""
    futures: dict[int, Future] = {}
    deferred: list = []

    def start(request):
        futures[request.request_id] = Future()
        return then(futures[request.request_id], lambda tokens: pb.VerifyResponse(token_ids=tokens))

    step = pb.VerifyStep(requests=[pb.VerifyRequest(session_id=f"s{i}", request_id=i) for i in range(1, 6)])
    out = concurrent_stream(start, iter([step]), pb.VerifyResponse, step_cls=pb.VerifyStepResponse,
                            later=deferred.append)
    import queue

    sent: queue.Queue = queue.Queue()
    consumer = threading.Thread(target=lambda: [sent.put(m) for m in out] and sent.put(None), daemon=True)
    consumer.start()  # the generator's first next() starts its reader thread
    wait = threading.Event()
    for _ in range(100):  # the reader thread starts every part
        if len(futures) == 5:
            break
        wait.wait(0.05)
    assert len(futures) == 5
    for i in (3, 1, 5, 2):  # one batch completes four of them...
        futures[i].set_result([i])
    assert len(deferred) == 1 and sent.empty()  # ...and their message waits for the batch's end
    deferred.pop()()
    first = sent.get(timeout=5)
    assert sorted(r.request_id for r in first.responses) == [1, 2, 3, 5]
    assert all(list(r.token_ids) == [r.request_id] for r in first.responses)
    futures[4].set_result([4])
    deferred.pop()()
    assert [r.request_id for r in sent.get(timeout=5).responses] == [4]
    consumer.join(5)
    assert sent.get(timeout=5) is None  # all answered, the client done: the stream ends


def test_calls_made_in_one_loop_turn_leave_as_one_step():
    """The orchestrator's side (StreamMux): calls made by many tasks in the same
    turn of the event loop go out as ONE ProposeStep; a later call opens the
    next step; a step not answered in time fails every call in it."""
    import asyncio

    from orchestrator.fleet.clients import ServiceError, StreamMux

    sent: list = []

    async def main():
        replies: asyncio.Queue = asyncio.Queue()

        def open_stream(requests):
            async def responses():
                async for step in requests:
                    sent.append(step)
                    if step.requests[0].session_id != "silent":
                        await replies.put(pb.ProposeStepResponse(responses=[
                            pb.ProposeResponse(request_id=r.request_id, draft_token_ids=[len(r.session_id)])
                            for r in step.requests]))
                    while not replies.empty():
                        yield await replies.get()
            return responses()

        mux = StreamMux(open_stream, pb.ProposeStep)
        seen: list[int] = []
        mux.on_send = seen.append
        first = await asyncio.gather(*(mux.call(pb.ProposeRequest(session_id="s" * n), 5.0) for n in range(1, 9)))
        assert [list(r.draft_token_ids) for r in first] == [[n] for n in range(1, 9)]
        second = await mux.call(pb.ProposeRequest(session_id="t"), 5.0)
        assert list(second.draft_token_ids) == [1]
        with pytest.raises(ServiceError) as err:
            await asyncio.gather(*(mux.call(pb.ProposeRequest(session_id="silent"), 0.2) for _ in range(3)))
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert seen == [8, 1, 3]
        mux.close()

    asyncio.run(main())
    assert [len(step.requests) for step in sent] == [8, 1, 3]


@pytest.mark.parametrize("details, lost", [("Internal error from Core", True),
                                           ("internal error: RuntimeError: forward failed", False)])
def test_a_stream_broken_inside_grpc_is_a_lost_replica(details, lost):
    """A replica killed while a message is on its way ends the aio stream
    with INTERNAL "Internal error from Core" (grpc's, not the replica's)
    instead of UNAVAILABLE now and then: its calls fail as lost (the session moves),
    while an INTERNAL status the replica sent stays what it said."""
    import asyncio

    from orchestrator.fleet.clients import ServiceError, StreamMux
    from orchestrator.fleet.failover import is_lost

    async def main():
        def open_stream(requests):
            async def responses():
                async for _ in requests:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               details=details)
                yield  # an async generator that never answers
            return responses()

        mux = StreamMux(open_stream, pb.ProposeStep)
        with pytest.raises(ServiceError) as err:
            await mux.call(pb.ProposeRequest(session_id="s"), 5.0)
        mux.close()
        return err.value

    error = asyncio.run(main())
    assert is_lost(error) is lost, (error.code, error.message)
    assert lost or error.message == details
