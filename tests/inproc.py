"""A verifier and a drafter in the test's own process, each a real gRPC server
on a real loopback port, and the orchestrator as its own process: what
specd.ops.local_stack.Stack runs as three processes, with one interpreter
start instead of three. For tests that start a stack per model (one per
family) and would otherwise spend most of their time starting processes.

The orchestrator stays a process because Prometheus collectors are per
process: it declares the spec-decode counters with a `method` label, the
drafter without one."""

from __future__ import annotations

from specd.api.v1 import specdec_pb2 as pb
from specd.api.v1 import specdec_pb2_grpc as pb_grpc
from specd.drafter.config import DrafterConfig
from specd.drafter.server import make_drafter
from specd.drafter.server import start as start_drafter
from specd.net.grpc_util import open_channel
from specd.ops.local_stack import ServiceProcess
from specd.verifier.config import VerifierConfig
from specd.verifier.core import Verifier
from specd.verifier.server import start as start_verifier


class InProcessStack:
    def __init__(self, target: str, drafter: str | None, **verifier_fields):
        vcfg = VerifierConfig(model_dir=target, host="127.0.0.1", port=0, **verifier_fields)
        self.verifier = Verifier(vcfg)  # the cores, for tests that look inside
        self.verifier_server, vport = start_verifier(vcfg, self.verifier)
        self.servers = [self.verifier_server]
        drafter_addresses = []
        if drafter:
            dcfg = DrafterConfig(model_dir=drafter, host="127.0.0.1", port=0)
            self.drafter = make_drafter(dcfg)
            self.drafter_server, dport = start_drafter(dcfg, self.drafter)
            self.servers.append(self.drafter_server)
            drafter_addresses = [f"127.0.0.1:{dport}"]
        args = ["--target", target, "--verifier-address", f"127.0.0.1:{vport}"]
        if drafter:
            args += ["--drafter", drafter, "--drafter-address", drafter_addresses[0]]
        try:
            self.orchestrator = ServiceProcess("specd.orchestrator", *args)
        except Exception:
            for s in self.servers:
                s.stop(None)
            raise
        self.channel = open_channel(self.orchestrator.address, None)
        self.stub = pb_grpc.OrchestratorServiceStub(self.channel)
        self.admin = pb_grpc.AdminServiceStub(self.channel)

    def generate(self, **fields) -> tuple[list[int], pb.GenerateResponse | None]:
        """One Generate: (all token ids, the final response)."""
        ids: list[int] = []
        last = None
        for r in self.stub.Generate(pb.GenerateRequest(**fields), timeout=120):
            ids += r.token_ids
            last = r
        return ids, last

    def stop(self) -> None:
        self.channel.close()
        self.orchestrator.stop()
        for s in self.servers:
            s.stop(None)
