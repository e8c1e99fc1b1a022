"""Thin grpc.aio shell over the orchestrator core."""

from __future__ import annotations

import contextlib
import logging

import grpc

from specd.api.v1 import specdec_pb2 as pb
from specd.api.v1 import specdec_pb2_grpc as pb_grpc
from specd.net.grpc_util import status_for
from specd.telemetry import tracing

from .clients import ServiceError
from .core import NotScalable, Orchestrator

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["OrchestratorService"].full_name
ADMIN_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AdminService"].full_name


def response_for(chunk) -> pb.GenerateResponse:
    r = pb.GenerateResponse(token_ids=chunk.emit.token_ids, text=chunk.emit.text)
    if chunk.emit.finish_reason:
        s = chunk.stats
        r.finish_reason = chunk.emit.finish_reason
        r.stats.CopyFrom(
            pb.GenerationStats(
                cycles=s.cycles,
                drafted_tokens=s.drafted_tokens,
                accepted_tokens=s.accepted_tokens,
                mean_accepted_length=s.mean_accepted_length,
                prompt_tokens=s.prompt_tokens,
                completion_tokens=s.completion_tokens,
                num_speculative_tokens=s.num_speculative_tokens,
                draft_compute_ms=s.draft_compute_ms,
                verify_compute_ms=s.verify_compute_ms,
                cycles_wall_ms=s.cycles_wall_ms,
                cycle_overhead_ms=s.cycle_overhead_ms,
                method=s.method,
                drafts=s.drafts,
                accepted_per_position=s.accepted_per_position,
                adaptive=s.adaptive,
                pipelined_drafts=s.pipelined_drafts,
                draft_wait_ms=s.draft_wait_ms,
                draft_call_ms=s.draft_call_ms,
                feature_bytes=s.feature_bytes,
                pipelined_alternative_drafts=s.pipelined_alternative_drafts,
            )
        )
    return r


class OrchestratorServicer(pb_grpc.OrchestratorServiceServicer):
    def __init__(self, core: Orchestrator):
        self.core = core

    async def Generate(self, request, context):
        try:
            parent = tracing.extract(grpc_context=context) if tracing.ENABLED else None
            # aclosing: a client that leaves closes the request's generators at
            # once (their `finally` frees the sessions), not when collected.
            async with contextlib.aclosing(self.core.generate(request, parent)) as chunks:
                async for chunk in chunks:
                    yield response_for(chunk)
        except ServiceError as exc:  # an internal service refused: pass its reason on
            await context.abort(exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001 - every error must become a status
            code, msg = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("Generate failed")
            await context.abort(code, msg)


class AdminServicer(pb_grpc.AdminServiceServicer):
    """Pools and scaling (`specd status`, `specd scale`)."""

    def __init__(self, core: Orchestrator):
        self.core = core

    def _status(self) -> pb.ClusterStatus:
        s = self.core.status()
        return pb.ClusterStatus(
            replicas=[pb.ReplicaStatus(**r) for r in s["replicas"]],
            active_requests=s["active_requests"],
            scalable=s["scalable"],
            autoscale=s["autoscale"],
        )

    async def Status(self, request, context):
        return self._status()

    async def Scale(self, request, context):
        counts = {
            kind: getattr(request, f"{kind}s") for kind in ("verifier", "drafter") if request.HasField(f"{kind}s")
        }
        try:
            await self.core.scale(counts)
        except NotScalable as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except TimeoutError as exc:  # a new replica did not serve in time (message names the resource)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except Exception as exc:  # noqa: BLE001 - every error must become a status
            code, msg = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("Scale failed")
            await context.abort(code, msg)
        return self._status()
