"""Thin grpc.aio shell over the orchestrator core."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import grpc

from orchestrator.core import Orchestrator
from orchestrator.cycle.records import Chunk, Stats
from orchestrator.edge.request import spec_for
from orchestrator.fleet.clients import ServiceError
from orchestrator.fleet.fleet import NotScalable
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.grpc_util import status_for
from specd_core.telemetry import tracing

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["OrchestratorService"].full_name
ADMIN_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AdminService"].full_name


# Stats properties sent as the GenerationStats field of the same name.
DERIVED_STATS = ("mean_accepted_length",)
# Stats fields kept off the wire: the total behind mean_accepted_length.
INTERNAL_STATS = ("committed_in_cycles",)


def stats_to_proto(stats: Stats) -> pb.GenerationStats:
    """Every Stats field and derived property to the proto field of the same
    name (tests/test_stats_proto.py checks that the two list the same names)."""
    names = [f.name for f in dataclasses.fields(stats) if f.name not in INTERNAL_STATS] + list(DERIVED_STATS)
    return pb.GenerationStats(**{name: getattr(stats, name) for name in names})


def response_for(chunk: Chunk) -> pb.GenerateResponse:
    r = pb.GenerateResponse(token_ids=chunk.emit.token_ids, text=chunk.emit.text)
    if chunk.emit.finish_reason:
        r.finish_reason = chunk.emit.finish_reason
        r.stats.CopyFrom(stats_to_proto(chunk.stats))
    return r


class OrchestratorServicer(pb_grpc.OrchestratorServiceServicer):
    def __init__(self, core: Orchestrator):
        self.core = core

    async def Generate(self, request, context):
        try:
            parent = tracing.extract(grpc_context=context) if tracing.ENABLED else None
            # aclosing: a client that leaves closes the request's generators at
            # once (their `finally` frees the sessions), not when collected.
            generation = self.core.generate(lambda: spec_for(request, self.core), parent)
            async with contextlib.aclosing(generation) as chunks:
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

    async def _status(self) -> pb.ClusterStatus:
        s = await self.core.status()
        return pb.ClusterStatus(
            replicas=[pb.ReplicaStatus(**r) for r in s["replicas"]],
            active_requests=s["active_requests"],
            scalable=s["scalable"],
            autoscale=s["autoscale"],
            metrics_address=s["metrics_address"],
            orchestrators=[pb.OrchestratorStatus(**o) for o in s["orchestrators"]],
            max_active_requests=s["max_active_requests"],
            answered_by=s["answered_by"],
        )

    async def Status(self, request, context):
        return await self._status()

    async def Scale(self, request, context):
        counts = {
            kind: getattr(request, f"{kind}s")
            for kind in ("verifier", "drafter", "orchestrator")
            if request.HasField(f"{kind}s")
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
        return await self._status()
