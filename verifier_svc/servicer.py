"""Thin gRPC shell: proto <-> core calls, errors -> status (specd.grpc_util)."""
from __future__ import annotations

from specd import telemetry
from specd.grpc_util import grpc_errors, stream_call
from specd.wire import dists_from_proto, sampling_from_proto
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

from .core import Verifier
from .metrics import VerifierMetrics

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VerifierService"].full_name


class VerifierServicer(pb_grpc.VerifierServiceServicer):
    def __init__(self, core: Verifier):
        self.core = core
        self.metrics = VerifierMetrics(core)

    @grpc_errors
    def OpenSession(self, request, context):
        with telemetry.server_span("verifier.prefill", grpc_context=context, attributes={
                "specdec.session_id": request.session_id,
                "specdec.prompt_tokens": len(request.prompt_token_ids)} if telemetry.ENABLED else None):
            first = self.core.open_session(request.session_id, list(request.prompt_token_ids),
                                           sampling_from_proto(request.sampling))
        return pb.OpenVerifySessionResponse(first_token_id=first)

    def _verify(self, request) -> pb.VerifyResponse:
        with telemetry.server_span("verifier.verify", request.traceparent) as span:
            result = self.core.verify(request.session_id, list(request.draft_token_ids),
                                      list(request.draft_parents),
                                      dists_from_proto(request.draft_distributions) or None)
            if span is not None:
                telemetry.add_phases(span, "verifier", result.phases)
                span.set_attributes({"specdec.session_id": request.session_id,
                                     "specdec.draft.nodes": len(request.draft_token_ids),
                                     "specdec.accepted_length": result.num_accepted,
                                     "specdec.compute_ms": result.compute_ms})
        self.metrics.observe_verify(len(request.draft_token_ids), result)
        return pb.VerifyResponse(num_accepted=result.num_accepted, token_ids=result.tokens,
                                 accepted_path=result.path, compute_ms=result.compute_ms)

    @grpc_errors
    def Verify(self, request, context):
        return self._verify(request)

    def VerifyStream(self, request_iterator, context):
        for request in request_iterator:
            yield stream_call(self._verify, request, pb.VerifyResponse)

    @grpc_errors
    def CloseSession(self, request, context):
        with telemetry.server_span("verifier.close", grpc_context=context):
            self.core.close_session(request.session_id)
        return pb.CloseSessionResponse()
