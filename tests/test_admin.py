"""The admin API on a real orchestrator process run without Ray: Status reports
the fixed pools and the sessions on them; Scale is refused with
FAILED_PRECONDITION (there is no launcher), and the service goes on serving."""

import grpc
import pytest

from specd.api.v1 import specdec_pb2 as pb
from specd.api.v1 import specdec_pb2_grpc as pb_grpc

pytestmark = pytest.mark.services


def test_status_and_scale_without_ray(stacks):
    stack = stacks["llama"]
    admin = pb_grpc.AdminServiceStub(stack.channel)
    status = admin.Status(pb.StatusRequest(), timeout=10)
    assert {(r.kind, r.name, r.address) for r in status.replicas} == {
        ("verifier", "verifier-0", stack.verifier.address), ("drafter", "drafter-0", stack.drafter_proc.address)}
    assert not status.scalable and all(r.sessions == 0 and not r.draining for r in status.replicas)

    # A running stream is counted on both replicas while it runs (polled as it streams).
    seen = set()
    for r in stack.stub.Generate(pb.GenerateRequest(prompt="def f(x):", max_new_tokens=200,
                                                    num_speculative_tokens=2), timeout=60):
        during = admin.Status(pb.StatusRequest(), timeout=10)
        seen.add((during.active_requests, tuple(sorted((x.kind, x.sessions) for x in during.replicas))))
    assert (1, (("drafter", 1), ("verifier", 1))) in seen, seen
    assert all(r.sessions == 0 for r in admin.Status(pb.StatusRequest(), timeout=10).replicas)

    with pytest.raises(grpc.RpcError) as e:
        admin.Scale(pb.ScaleRequest(drafters=2), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "needs the orchestrator deployed on Ray" in \
        e.value.details()
    ids, last = stack.generate(prompt="def f(x):", max_new_tokens=4)
    assert len(ids) == 4
