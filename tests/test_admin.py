"""The admin API on a real orchestrator process run without Ray: Status reports
the fixed pools and the sessions on them; Scale is refused with
FAILED_PRECONDITION (there is no launcher), and the service goes on serving."""

import json

import grpc
import pytest

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc

pytestmark = pytest.mark.services


def test_status_and_scale_without_ray(stacks):
    stack = stacks["llama"]
    admin = pb_grpc.AdminServiceStub(stack.channel)
    status = admin.Status(pb.StatusRequest(), timeout=10)
    assert {(r.kind, r.name, r.address) for r in status.replicas} == {
        ("verifier", "verifier-0", stack.verifier.address), ("drafter", "drafter-0", stack.drafter_proc.address)}
    assert not status.scalable and all(r.sessions == 0 and not r.draining for r in status.replicas)
    # Started by hand: no metrics endpoint is known to the orchestrator.
    assert status.metrics_address == "" and not any(r.metrics_address for r in status.replicas)

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


def test_status_reports_each_replicas_engine_model_and_kv(pairs, capsys):
    """Status carries what each replica reports of itself: engine (a verifier
    forced onto the Hugging Face fallback says hf), architecture, dtype and
    its KV budget and use; `specd status` prints them and notes the fallback."""
    from specd.cli import main
    from specd.local_stack import Stack

    target, drafter = pairs["llama"]
    stack = Stack(target, drafter, verifier_args=("--engine", "hf", "--kv-cache-memory", "4MiB"))
    try:
        admin = pb_grpc.AdminServiceStub(stack.channel)
        replicas = {r.kind: r for r in admin.Status(pb.StatusRequest(), timeout=10).replicas}
        v, d = replicas["verifier"], replicas["drafter"]
        assert (v.engine, d.engine) == ("hf", "lean")
        assert v.architecture == d.architecture == "LlamaForCausalLM" and v.model_type == "llama"
        assert v.dtype == d.dtype == "float32"
        assert 0 < v.kv_capacity_bytes <= 4 * 2**20 and v.kv_capacity_tokens > 0 and v.kv_used_tokens == 0
        assert d.kv_capacity_tokens > 0 and d.kv_used_tokens == 0
        # While a stream runs its sessions hold blocks on both; afterwards none.
        used = set()
        for _ in stack.stub.Generate(pb.GenerateRequest(prompt="def f(x):", max_new_tokens=60,
                                                        num_speculative_tokens=2), timeout=60):
            s = admin.Status(pb.StatusRequest(), timeout=10)
            used.add(tuple(sorted((r.kind, r.kv_used_tokens > 0) for r in s.replicas)))
        assert (("drafter", True), ("verifier", True)) in used, used
        assert all(r.kv_used_tokens == 0 for r in admin.Status(pb.StatusRequest(), timeout=10).replicas)
        assert main(["status", "--address", stack.orchestrator.address]) == 0
        out = capsys.readouterr().out
        assert "ENGINE" in out and "KV TOKENS" in out and "PREFIX HITS" in out and f"0/{v.kv_capacity_tokens} (0%)" in out
        assert "note: verifier-0 runs the Hugging Face fallback engine for llama" in out and "docs/models.md" in out
        assert "METRICS" in out and "orchestrator metrics" not in out   # none known (started by hand)
        assert "drafter-0 drafts with draft_model: a draft model\n" in out
        assert "CUDA graphs" not in out  # off on a CPU unless asked for
        assert main(["metrics-targets", "--address", stack.orchestrator.address]) == 0
        assert json.loads(capsys.readouterr().out) == []
    finally:
        stack.stop()
