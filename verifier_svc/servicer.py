"""Thin gRPC shell: proto <-> core calls, errors -> status (specd_core.net.grpc_util)."""

from __future__ import annotations

import functools
from concurrent.futures import Future

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.grpc_util import close_if_caller_left, concurrent_stream, grpc_errors, then
from specd_core.net.wire import dists_from_proto, hidden_to_proto, sampling_from_proto
from specd_core.runtime.batcher import Batcher, Split
from specd_core.telemetry import tracing
from specd_core.telemetry.probe import probed
from verifier_svc.ahead import run_ahead
from verifier_svc.batch import VerifyJob
from verifier_svc.core import Verifier
from verifier_svc.metrics import VerifierMetrics

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VerifierService"].full_name


def verify_response(result) -> pb.VerifyResponse:
    return pb.VerifyResponse(
        num_accepted=result.num_accepted,
        token_ids=result.tokens,
        accepted_path=result.path,
        compute_ms=result.compute_ms,
        batch_sessions=result.batch_sessions,
        batch_tokens=result.batch_tokens,
        batch_id=result.batch_id,
        hidden_states=hidden_to_proto(result.hidden),
    )


class VerifierServicer(pb_grpc.VerifierServiceServicer):
    def __init__(self, core: Verifier):
        self.core = core
        self.metrics = VerifierMetrics(core)
        self.batcher = Batcher(
            probed(core.verify_batch, "_verify"),
            core.config.max_batch_sessions,
            "verify",
            self.metrics.observe_batch,
            core.config.max_queued_calls,
            core.active_sessions,
            core.config.batch_wait_fraction,
            functools.partial(run_ahead, core),
        )
        self.batcher.split = Split(lambda job: isinstance(job, VerifyJob), core.batch_share)

    @grpc_errors
    def OpenSession(self, request, context):
        with tracing.server_span(
            "verifier.prefill",
            grpc_context=context,
            attributes={
                "specdec.session_id": request.session_id,
                "specdec.prompt_tokens": len(request.prompt_token_ids),
            }
            if tracing.ENABLED
            else None,
        ):
            # Through the batcher: concurrent prefills share a forward (with verifies too).
            job = self.core.prepare_open(
                request.session_id,
                list(request.prompt_token_ids),
                sampling_from_proto(request.sampling),
                resume=request.resume,
                hidden=tuple(request.hidden_layers) or request.return_hidden_states,
                generated_from=request.generated_from,
                owner=request.owner,
            )
            first = self.batcher.submit(job).result()
        close_if_caller_left(self.core, request.session_id, context)
        first, hidden = first if request.return_hidden_states else (first, None)
        return pb.OpenVerifySessionResponse(
            first_token_id=first or 0, hidden_states=hidden_to_proto(hidden), cached_prompt_tokens=job.cached
        )

    def _verify(self, request) -> Future:
        """Check a Verify and queue it for the next forward; a future of the
        response. The span and metrics are done after the response is queued
        to be sent (a callback registered after the one that answers)."""
        span = tracing.start_server_span("verifier.verify", request.traceparent)
        try:
            job = self.core.prepare(
                request.session_id,
                list(request.draft_token_ids),
                list(request.draft_parents),
                dists_from_proto(request.draft_distributions) or None,
            )
            result = self.batcher.submit(job)
        except Exception as exc:
            tracing.end_span(span, exc)
            raise
        response = then(result, verify_response)
        result.add_done_callback(lambda done: self.batcher.later(lambda: self._verified(request, done, span)))
        return response

    def _verified(self, request, done: Future, span) -> None:
        if done.exception() is None:
            self.metrics.observe_verify(len(request.draft_token_ids), done.result())
        tracing.end_call_span(
            span,
            done,
            "verifier",
            lambda result: {
                "specdec.session_id": request.session_id,
                "specdec.draft.nodes": len(request.draft_token_ids),
                "specdec.accepted_length": result.num_accepted,
                "specdec.compute_ms": result.compute_ms,
                "specdec.batch_sessions": result.batch_sessions,
            },
        )

    @grpc_errors
    def Verify(self, request, context):
        return self._verify(request).result()

    def VerifyStream(self, request_iterator, context):
        """Messages of many sessions, answered as they finish (by request_id)."""
        yield from concurrent_stream(
            self._verify, request_iterator, pb.VerifyResponse, self.core.config.max_queued_calls
        )

    def VerifySteps(self, request_iterator, context):
        """As VerifyStream, a step of many sessions' messages per message."""
        yield from concurrent_stream(
            self._verify,
            request_iterator,
            pb.VerifyResponse,
            self.core.config.max_queued_calls,
            pb.VerifyStepResponse,
            self.batcher.later,
        )

    @grpc_errors
    def CloseSession(self, request, context):
        with tracing.server_span("verifier.close", grpc_context=context):
            self.core.close_session(request.session_id)
        return pb.CloseSessionResponse()

    @grpc_errors
    def Info(self, request, context):
        """Its engine, model, dtype and KV budget (AdminService Status shows them)."""
        return pb.ReplicaInfo(**self.core.info())

    @grpc_errors
    def KeepAlive(self, request, context):
        """An orchestrator is alive: its sessions here stay open (owner_timeout_s)."""
        sessions, timeout = self.core.keep_alive(request.owner)
        return pb.KeepAliveResponse(sessions=sessions, owner_timeout_s=timeout)
