"""Thin gRPC shell: proto <-> core calls, errors -> status (specd_core.net.grpc_util)."""

from __future__ import annotations

from concurrent.futures import Future

from drafter_svc.core import Drafter
from drafter_svc.metrics import DrafterMetrics
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.grpc_util import close_if_caller_left, concurrent_stream, grpc_errors, then
from specd_core.net.wire import dists_to_proto, propose_from_proto, sampling_from_proto
from specd_core.rules.draft_shape import DraftShape
from specd_core.runtime.batcher import Batcher
from specd_core.telemetry import tracing
from specd_core.telemetry.probe import probed

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DrafterService"].full_name


def propose_response(proposal) -> pb.ProposeResponse:
    tree = proposal.tree
    return pb.ProposeResponse(
        draft_token_ids=tree.tokens,
        draft_parents=tree.parents,
        draft_distributions=dists_to_proto(tree.row_dists),
        compute_ms=proposal.compute_ms,
        batch_sessions=proposal.batch_sessions,
        batch_tokens=proposal.batch_tokens,
        guessed_token_id=proposal.guess,
        draft_confidences=tree.confidences,
        confidence_pruned=tree.pruned,
        forced_nodes=tree.forced,
        branches=[
            pb.AheadBranch(
                kept=b.kept,
                token_id=b.token,
                draft_token_ids=b.tree.tokens,
                draft_distributions=dists_to_proto(b.tree.row_dists),
                draft_confidences=b.tree.confidences,
                confidence_pruned=b.tree.pruned,
            )
            for b in proposal.branches
        ],
    )


class DrafterServicer(pb_grpc.DrafterServiceServicer):
    def __init__(self, core: Drafter):
        self.core = core
        self.metrics = DrafterMetrics(core)
        self.batcher = Batcher(
            probed(core.propose_batch, "_propose"),
            core.config.max_batch_sessions,
            "propose",
            self.metrics.observe_batch,
            max_queued=core.config.max_queued_calls,
            active_sessions=core.active_sessions,
            wait_fraction=core.config.batch_wait_fraction,
        )

    @grpc_errors
    def OpenSession(self, request, context):
        with tracing.server_span(
            "drafter.prefill",
            grpc_context=context,
            attributes={
                "specdec.session_id": request.session_id,
                "specdec.prompt_tokens": len(request.prompt_token_ids),
            }
            if tracing.ENABLED
            else None,
        ):
            self.core.open_session(
                request.session_id,
                list(request.prompt_token_ids),
                sampling_from_proto(request.sampling),
                request.target_vocab_size,
                generated_from=request.generated_from,
                owner=request.owner,
            )
        close_if_caller_left(self.core, request.session_id, context)
        return pb.OpenDraftSessionResponse()

    def _propose(self, request) -> Future:
        """Check a Propose and queue it for the next drafting batch; a future of
        the response. The span and metrics are done after the response is
        queued to be sent (a callback registered after the one that answers)."""
        span = tracing.start_server_span("drafter.propose", request.traceparent)
        try:
            call = propose_from_proto(request, self.core.config.max_draft_tokens)
            job = self.core.prepare(call)
            proposal = self.batcher.submit(job)
        except Exception as exc:
            tracing.end_span(span, exc)
            raise
        response = then(proposal, propose_response)
        proposal.add_done_callback(
            lambda done: self.batcher.later(lambda: self._proposed(request, call.shape, done, span))
        )
        return response

    def _proposed(self, request, shape: DraftShape, done: Future, span) -> None:
        if done.exception() is None:
            self.metrics.observe_proposal(done.result())
        tracing.end_call_span(
            span,
            done,
            "drafter",
            lambda proposal: {
                "specdec.session_id": request.session_id,
                "specdec.draft.depth": shape.depth,
                "specdec.draft.nodes": len(proposal.tree.tokens),
                "specdec.compute_ms": proposal.compute_ms,
                "specdec.batch_sessions": proposal.batch_sessions,
                "specdec.draft.ahead": request.ahead,
                "specdec.draft.rewind": request.rewind,
                "specdec.draft.ahead_branch": request.ahead_branch,
                "specdec.draft.branches": 1 + len(proposal.branches) if request.ahead else 0,
                "specdec.draft.min_confidence": shape.min_confidence,
                "specdec.draft.confidence_pruned": proposal.tree.pruned,
            },
        )

    @grpc_errors
    def Propose(self, request, context):
        return self._propose(request).result()

    def ProposeStream(self, request_iterator, context):
        """Messages of many sessions, answered as they finish (by request_id)."""
        yield from concurrent_stream(
            self._propose, request_iterator, pb.ProposeResponse, self.core.config.max_queued_calls
        )

    def ProposeSteps(self, request_iterator, context):
        """As ProposeStream, a step of many sessions' messages per message."""
        yield from concurrent_stream(
            self._propose,
            request_iterator,
            pb.ProposeResponse,
            self.core.config.max_queued_calls,
            pb.ProposeStepResponse,
            self.batcher.later,
        )

    @grpc_errors
    def CloseSession(self, request, context):
        with tracing.server_span("drafter.close", grpc_context=context):
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
