"""Errors the cores raise; the gRPC edge maps each to a status code (specd_core/net/grpc_util.py)."""


class InvalidRequest(ValueError):
    """The caller sent something wrong (maps to INVALID_ARGUMENT)."""


class UnknownSession(InvalidRequest):
    """A session id that this replica does not hold (INVALID_ARGUMENT: it is the
    caller's input that is wrong, and the message names the id)."""


class Unsupported(RuntimeError):
    """The deployment cannot do what the request asks, whatever its input (maps
    to FAILED_PRECONDITION): e.g. structured output over a tokenizer whose
    tokens' text cannot be told apart. The message names why."""


class CapacityExceeded(RuntimeError):
    """A memory or session budget is full (maps to RESOURCE_EXHAUSTED)."""


class ShuttingDown(RuntimeError):
    """The server is draining before it stops: new work is refused (UNAVAILABLE),
    running work finishes."""


class SessionExpired(UnknownSession):
    """A session this replica closed itself after `session_idle_timeout_s` without a
    call (maps to NOT_FOUND: unlike an unknown id, the caller's id was right, the
    session is gone; a client can tell the two apart and open a new session)."""
