"""grpc.aio clients for the drafter and verifier services (the loop's ports)."""
from __future__ import annotations

import grpc

from specd.grpc_util import CHANNEL_OPTIONS
from specd.wire import dists_from_proto, dists_to_proto, sampling_to_proto
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc


class _Client:
    stub_cls = None

    def __init__(self, address: str, timeout_s: float):
        self.address = address
        self.timeout = timeout_s
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = self.stub_cls(self.channel)
        self.active = 0   # sessions this orchestrator has open here (for routing)

    async def close(self, session_id: str) -> None:
        await self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=self.timeout)


class GrpcVerifier(_Client):
    stub_cls = pb_grpc.VerifierServiceStub

    async def open(self, session_id, prompt_ids, sampling) -> int:
        r = await self.stub.OpenSession(pb.OpenVerifySessionRequest(
            session_id=session_id, prompt_token_ids=prompt_ids, sampling=sampling_to_proto(sampling)),
            timeout=self.timeout)
        return r.first_token_id

    async def verify(self, session_id, draft_ids, dists):
        r = await self.stub.Verify(pb.VerifyRequest(
            session_id=session_id, draft_token_ids=draft_ids, draft_distributions=dists_to_proto(dists)),
            timeout=self.timeout)
        return r.num_accepted, list(r.token_ids), r.compute_ms


class GrpcDrafter(_Client):
    stub_cls = pb_grpc.DrafterServiceStub

    async def open(self, session_id, prompt_ids, sampling) -> None:
        await self.stub.OpenSession(pb.OpenDraftSessionRequest(
            session_id=session_id, prompt_token_ids=prompt_ids, sampling=sampling_to_proto(sampling)),
            timeout=self.timeout)

    async def propose(self, session_id, num_accepted, committed, k):
        r = await self.stub.Propose(pb.ProposeRequest(
            session_id=session_id, num_accepted=num_accepted, committed_token_ids=committed,
            num_draft_tokens=k), timeout=self.timeout)
        return list(r.draft_token_ids), dists_from_proto(r.draft_distributions), r.compute_ms
