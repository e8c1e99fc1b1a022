"""The OpenAI-compatible HTTP API (docs/http.md): a thin FastAPI shell over the
same generation core as gRPC (`Orchestrator.generate`). Routes, the bearer
token check and the error handlers live here; what requests and responses
hold is orchestrator/edge/openai_protocol.py.

A request's generator is always closed when the request ends, however it ends
(aclosing, as the gRPC servicer does): a client that leaves frees its sessions
on every replica at once. The first chunk is awaited before the response
starts, so a refusal (bad input, admission, draining) is an HTTP status and not
an event inside a 200 stream; while waiting, a client that disconnects cancels
the request. After the stream began, an error is one `data: {"error": ...}` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.core import Orchestrator
from orchestrator.cycle.records import Chunk
from orchestrator.edge.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidField,
    StreamChunks,
    completion_response,
    error_body,
    field_error,
    http_status,
    to_generate_request,
    validation_error,
)
from orchestrator.edge.request import spec_for
from orchestrator.fleet.clients import ServiceError
from specd_core.errors import InvalidRequest
from specd_core.net.auth import check_authorization
from specd_core.net.grpc_util import status_for
from specd_core.telemetry import tracing

log = logging.getLogger(__name__)
T = TypeVar("T")
# Keep-alive comments on a quiet stream (sse-starlette's ping), so that proxies
# do not time out a long prefill.
PING_S = 15


class HttpError(Exception):
    """A refusal of the HTTP edge itself (auth, unknown model)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ClientGone(Exception):
    """The client disconnected before its response started."""


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def exception_error(exc: BaseException, req=None) -> tuple[int, str, str | None, str | None]:
    """(HTTP status, message, param, code) for any exception of a request."""
    if isinstance(exc, HttpError):
        return exc.status, exc.message, exc.param, exc.code
    if isinstance(exc, InvalidRequest) and not isinstance(exc, InvalidField):
        exc = field_error(exc, req)
    if isinstance(exc, InvalidField):
        return 400, str(exc), exc.param, exc.code
    if isinstance(exc, ServiceError):  # a replica refused or failed: its status, as gRPC passes it on
        return http_status(exc.code), exc.message, None, None
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("request failed", exc_info=exc)
    return http_status(code), message, None, None


async def until_disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: every
    further message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`, cancelled (its generator closed by the cancellation) if the
    client disconnects first; then ClientGone."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request's task cancelled (server shutdown): the work goes too
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task  # its generator closed before this returns
        raise ClientGone
    return task.result()


def create_app(core: Orchestrator, served_model_name: str, tokens: tuple[str, ...] = ()) -> FastAPI:
    """The app; tokens: the bearer tokens accepted (none: no authentication)."""
    app = FastAPI(title="specd", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    models_body = models_list(served_model_name, int(time.time()), core.model.target_ctx)

    async def authorize(request: Request) -> None:
        if tokens:
            why = check_authorization(request.headers.get("authorization"), tokens, "header")
            if why is not None:
                raise HttpError(401, why)

    @app.get("/health")
    async def health() -> Response:
        if core.admission.draining:
            return error_response(503, "draining: the orchestrator is shutting down")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> JSONResponse:
        return JSONResponse(models_body)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await generate(core, served_model_name, request, body, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await generate(core, served_model_name, request, body, chat=True)

    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal in the OpenAI error shape."""

    @app.exception_handler(HttpError)
    async def on_http_error(request: Request, exc: HttpError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        param, message, code = validation_error(list(exc.errors()))
        return error_response(400, message, param, code)

    @app.exception_handler(StarletteHTTPException)
    async def on_starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths and methods: the same error shape as everything else.
        return error_response(exc.status_code, str(exc.detail))


def models_list(served_model_name: str, created: int, max_model_len: int) -> dict:
    """GET /v1/models: the one model served."""
    model = {
        "id": served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "specd",
        "max_model_len": max_model_len,
    }
    return {"object": "list", "data": [model]}


def check_model(model: str | None, served_model_name: str) -> None:
    if model is not None and model != served_model_name:
        raise HttpError(
            404,
            f"the model {model!r} does not exist: this server serves {served_model_name!r} (GET /v1/models)",
            "model",
            "model_not_found",
        )


async def generate(
    core: Orchestrator, model: str, request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool
) -> Response:
    """A completion: the whole response, or its stream once the first chunk is in."""
    check_model(body.model, model)
    try:
        proto = to_generate_request(body)
    except InvalidRequest as exc:
        status, message, param, code = exception_error(exc, body)
        return error_response(status, message, param, code)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    parent = tracing.extract(request.headers.get("traceparent", "")) if tracing.ENABLED else None
    chunks = core.generate(lambda: spec_for(proto, core), parent)
    try:
        if not body.stream:
            return JSONResponse(await unless_disconnected(request, collect(chunks, rid, model, chat)))
        first = await unless_disconnected(request, anext(chunks))
    except ClientGone:
        return Response(status_code=499)
    except Exception as exc:  # noqa: BLE001 - every error must become a status
        await chunks.aclose()
        status, message, param, code = exception_error(exc, body)
        return error_response(status, message, param, code)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    fmt = StreamChunks(rid, int(time.time()), model, chat, include_usage)
    return EventSourceResponse(
        events(chunks, first, fmt, body),
        ping=PING_S,
        sep="\n",
        # Closes the generator should the stream end before iterating it
        # (a disconnect at once); otherwise a no-op, events() closed it.
        background=BackgroundTask(chunks.aclose),
    )


async def collect(chunks: AsyncGenerator[Chunk, None], rid: str, model: str, chat: bool) -> dict:
    """A non-streaming response: every chunk's text, the last one's stats."""
    texts: list[str] = []
    async with contextlib.aclosing(chunks):
        chunk = None
        async for chunk in chunks:
            texts.append(chunk.emit.text)
    assert chunk is not None  # the core yields at least the prefill's chunk
    return completion_response(
        rid, int(time.time()), model, chat, "".join(texts), chunk.stats, chunk.emit.finish_reason
    )


async def events(
    chunks: AsyncGenerator[Chunk, None], first: Chunk, fmt: StreamChunks, req
) -> AsyncGenerator[str, None]:
    """SSE data: a chunk per piece of output, usage if asked, then [DONE]; an
    error ends the stream with an error event instead."""
    async with contextlib.aclosing(chunks):
        chunk = first
        try:
            while True:
                body = fmt.chunk(chunk.emit.text, chunk.emit.finish_reason, chunk.stats)
                if body is not None:
                    yield json.dumps(body)
                if chunk.emit.finish_reason is not None:
                    break
                chunk = await anext(chunks)
        except StopAsyncIteration:
            pass
        except Exception as exc:  # noqa: BLE001 - the status line is gone: the error is an event
            status, message, param, code = exception_error(exc, req)
            yield json.dumps(error_body(status, message, param, code))
            return
    if fmt.include_usage:
        yield json.dumps(fmt.usage_chunk(chunk.stats))
    yield "[DONE]"
