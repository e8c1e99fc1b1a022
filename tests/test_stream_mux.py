"""The multiplexed stream server (specd/net/grpc_util.py: concurrent_stream)
as a unit: messages answered as their futures complete, in any order, each
with its request id; a message whose start fails, or one over the in-flight
limit, gets an error response and the stream goes on."""
from __future__ import annotations

import threading
from concurrent.futures import Future

import grpc
import pytest

from specd.api.v1 import specdec_pb2 as pb
from specd.errors import InvalidRequest
from specd.net.grpc_util import concurrent_stream, then

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
