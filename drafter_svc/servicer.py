"""Thin gRPC shell: proto <-> core calls, errors -> status (specd.grpc_util)."""
from __future__ import annotations

from specd.grpc_util import grpc_errors, stream_call
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from specd.wire import dists_to_proto, sampling_from_proto

from .core import Drafter

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DrafterService"].full_name


class DrafterServicer(pb_grpc.DrafterServiceServicer):
    def __init__(self, core: Drafter):
        self.core = core

    @grpc_errors
    def OpenSession(self, request, context):
        self.core.open_session(request.session_id, list(request.prompt_token_ids),
                               sampling_from_proto(request.sampling))
        return pb.OpenDraftSessionResponse()

    def _propose(self, request) -> pb.ProposeResponse:
        proposal = self.core.propose(request.session_id, request.num_accepted,
                                     list(request.committed_token_ids), request.num_draft_tokens)
        return pb.ProposeResponse(
            draft_token_ids=proposal.token_ids,
            draft_distributions=dists_to_proto(proposal.distributions),
            compute_ms=proposal.compute_ms,
        )

    @grpc_errors
    def Propose(self, request, context):
        return self._propose(request)

    def ProposeStream(self, request_iterator, context):
        for request in request_iterator:
            yield stream_call(self._propose, request, pb.ProposeResponse)

    @grpc_errors
    def CloseSession(self, request, context):
        self.core.close_session(request.session_id)
        return pb.CloseSessionResponse()
