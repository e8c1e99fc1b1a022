"""The gRPC edge shared by every service: error -> status mapping, server setup
with health checking and reflection, message size limits."""
from __future__ import annotations

import functools
import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .errors import CapacityExceeded, InvalidRequest

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, CapacityExceeded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def grpc_errors(method):
    """Servicer-method decorator (sync server): core exceptions -> gRPC status.

    Unexpected exceptions are logged with their traceback and become INTERNAL;
    the server keeps serving other calls either way."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every error must become a status
            code, msg = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method.__name__)
            context.abort(code, msg)
    return wrapper


def stream_call(handler, request, response_cls):
    """One message of a multiplexed stream: run handler(request) and echo the
    request_id; an error goes into the response's `error` field instead of
    ending the stream that other sessions share."""
    try:
        response = handler(request)
    except Exception as exc:  # noqa: BLE001 - every error must become a status
        code, msg = status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", handler.__name__)
        response = response_cls()
        response.error.code, response.error.message = code.value[0], msg
    response.request_id = request.request_id
    return response


def add_health_and_reflection(server, service_names: list[str]) -> health.HealthServicer:
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in service_names + [""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(service_names + [reflection.SERVICE_NAME], server)
    return health_servicer


def start_sync_server(add_fn, servicer, service_name: str, host: str, port: int, workers: int):
    """Start a thread-pool gRPC server for one servicer; return (server, bound port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=CHANNEL_OPTIONS)
    add_fn(servicer, server)
    add_health_and_reflection(server, [service_name])
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    server.start()
    return server, bound
