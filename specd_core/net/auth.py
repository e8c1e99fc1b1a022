"""Bearer-token authentication of the orchestrator's public API.

Clients send gRPC metadata (or, to the HTTP API, a header) `authorization: Bearer <token>`; the server accepts
the tokens listed in a file (one per line; blank lines and `#` comments
skipped) and/or in `SPECD_AUTH_TOKENS` (comma-separated). Comparison is
constant-time (`hmac.compare_digest`) against every token, so the time taken
says nothing about how much of a token was right or which one matched.
Health checks stay open: load balancers and probes carry no token.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import grpc

from specd_core.net.security import SecurityConfigError

TOKENS_ENV = "SPECD_AUTH_TOKENS"  # server side: accepted tokens, comma-separated
CLIENT_TOKEN_ENV = "SPECD_TOKEN"  # client side (the specd CLI): the token to send
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def load_tokens(path: str | None, env_value: str | None = None) -> tuple[str, ...]:
    """Tokens from a file and/or an env value; () = authentication off.

    A file given but holding no token is an error: an empty list must not
    silently turn authentication off."""
    tokens: list[str] = []
    if path:
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise SecurityConfigError(f"auth tokens file {path}: no such file") from None
        except OSError as exc:
            raise SecurityConfigError(f"auth tokens file {path}: cannot read it ({exc.strerror or exc})") from None
        file_tokens = [t.strip() for t in text.splitlines() if t.strip() and not t.strip().startswith("#")]
        if not file_tokens:
            raise SecurityConfigError(f"auth tokens file {path}: holds no token (one per line)")
        tokens += file_tokens
    if env_value:
        tokens += [t.strip() for t in env_value.split(",") if t.strip()]
    return tuple(tokens)


def tokens_from_env_and_file(path: str | None) -> tuple[str, ...]:
    return load_tokens(path, os.environ.get(TOKENS_ENV))


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends (nothing without a token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def check_metadata(metadata, tokens: tuple[str, ...]) -> str | None:
    """None when the call carries an accepted token, else why not."""
    values = [v for k, v in (metadata or ()) if k == "authorization"]
    value = values[0] if values else None
    return check_authorization(value.decode() if isinstance(value, bytes) else value, tokens)


def check_authorization(value: str | None, tokens: tuple[str, ...], carrier: str = "metadata") -> str | None:
    """None when an `authorization` value (gRPC metadata, an HTTP header)
    holds an accepted bearer token, else why not."""
    if not value:
        return f"missing bearer token: send {carrier} 'authorization: Bearer <token>'"
    scheme, _, presented = value.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return f"malformed authorization {carrier}: expected 'Bearer <token>'"
    presented_b = presented.strip().encode()
    ok = False
    for token in tokens:  # no early exit: every token is compared
        ok |= hmac.compare_digest(presented_b, token.encode())
    return None if ok else "invalid bearer token"


def _denial(handler, message: str):
    """A handler of the same shape as `handler` that fails with UNAUTHENTICATED
    (grpc.aio calls a handler by its request/response streaming kinds)."""

    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(
        deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Every method but health checks needs a valid token (UNAUTHENTICATED otherwise)."""

    def __init__(self, tokens: tuple[str, ...]):
        if not tokens:
            raise ValueError("BearerTokenInterceptor needs at least one token")
        self.tokens = tokens

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        why = check_metadata(handler_call_details.invocation_metadata, self.tokens)
        return handler if why is None else _denial(handler, why)
