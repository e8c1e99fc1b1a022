"""A frozen verifier on a Ray deployment (`specd up` with 2 verifiers, the
hang detection set by its flags): the check of tests/test_hang_services.py
there. 8 greedy streams; the verifier actor holding most of them is stopped
(SIGSTOP on its process, found through the actor) until every stream has
ended: each completes equal to target-only greedy within the detection bound
plus one re-prefill; after SIGCONT the replica serves again (Status: not lost),
holds no session by its own count, and the orchestrator actor's suspicion and
recovery counters moved. The actor is not restarted: Ray never saw it die."""
import os
import subprocess
import sys

import grpc
import pytest
import ray

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from tests.test_hang_services import HANG_CEILING_S, HANG_FLOOR_S, cases, freeze_mid_stream, status  # noqa: F401

pytestmark = pytest.mark.cluster

SPECD = [sys.executable, "-m", "specd"]


class OnRay:
    """The deployment as freeze_mid_stream drives it."""

    def __init__(self, address: str, ray_address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.OrchestratorServiceStub(self.channel)
        self.ray_address = ray_address
        reply = pb_grpc.AdminServiceStub(self.channel).Status(pb.StatusRequest(), timeout=30)
        self.metrics_address = reply.orchestrators[0].metrics_address

    def pid(self, replica) -> int:
        """The process of the replica's actor (it serves gRPC itself)."""
        ray.init(address=self.ray_address, namespace="specd", logging_level="WARNING")
        try:
            return ray.get(ray.get_actor(replica.name).pid.remote(), timeout=60)
        finally:
            ray.shutdown()


def test_a_frozen_verifier_on_ray_is_detected_and_its_streams_move(ray_cluster, pairs, cases, tmp_path):
    target, drafter = pairs["llama"]
    env = dict(os.environ, RAY_ADDRESS=ray_cluster, SPECD_HOME=str(tmp_path / "home"))
    up = subprocess.run(SPECD + ["up", "--target", target, "--drafter", drafter, "--verifiers", "2",
                                 "--port", "0", "--http-port", "0", "--num-speculative-tokens", "3",
                                 "--hang-floor", str(HANG_FLOOR_S), "--hang-ceiling", str(HANG_CEILING_S)],
                        env=env, capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stderr
    address = up.stdout.strip().splitlines()[-1]
    try:
        deployment = OnRay(address, ray_cluster)
        assert sorted(n for n, r in status(deployment).items() if r.kind == "verifier") == [
            "specd-verifier-0", "specd-verifier-1"]
        frozen = freeze_mid_stream(deployment, cases, "verifier")
        # The same process at the same address: recovered, not restarted.
        assert status(deployment)[frozen.name].address == frozen.address
        deployment.channel.close()
    finally:
        down = subprocess.run(SPECD + ["down"], env=env, capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stderr
