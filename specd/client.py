"""Generate that resumes by itself, for users' own code (and `specd generate`).

    from specd.client import stream_generate
    from specd_core.api.v1 import specdec_pb2 as pb

    stream = stream_generate("localhost:50051", pb.GenerateRequest(prompt="def f(x):", max_new_tokens=256))
    for response in stream:          # GenerateResponse messages, as from the stub
        print(response.text, end="", flush=True)
    print(f"\\n[{stream.resumes} resumes]")

A stream that breaks - UNAVAILABLE (the orchestrator serving it died, the
connection was reset) or an end without the last message (the one with
finish_reason) - is sent again with GenerateRequest.resume_token_ids set to
every token id received so far; any orchestrator behind the address
continues after them and sends only what follows, so the responses iterated
hold each token once and none is lost. Between tries it waits `backoff`
seconds, doubled per try that brought no new token, at most `max_backoff`;
after `retries` such tries in a row it raises the last error. Other errors
(INVALID_ARGUMENT, DEADLINE_EXCEEDED, ...) are raised at once: resending
would meet them again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.grpc_util import open_channel
from specd_core.net.security import TlsConfig

# The codes of a stream that broke rather than failed: the server (or the way
# to it) went away; another orchestrator can go on from what was received.
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


class StreamBroken(Exception):
    """A Generate stream ended without its last message, and resending it did not help."""


@dataclass(frozen=True)
class ResumePolicy:
    retries: int = 5  # tries in a row that bring no new token before giving up (0: never resume)
    backoff: float = 0.25  # seconds before the first resend; doubled per try without progress
    max_backoff: float = 8.0

    def delay(self, failures: int) -> float:
        """The wait before the resend after `failures` tries in a row without a new token."""
        return min(self.max_backoff, self.backoff * 2 ** (failures - 1))


def resend(request: pb.GenerateRequest, received: list[int]) -> pb.GenerateRequest:
    """The request again, resuming after `received` (after any ids it resumed from itself)."""
    again = pb.GenerateRequest()
    again.CopyFrom(request)
    again.resume_token_ids.extend(received)
    return again


class ResumingStream:
    """The responses of one Generate, resent after each break (iterate it
    once). `received`: every token id so far; `resumes`: the resends."""

    def __init__(
        self,
        call: Callable[[pb.GenerateRequest], Iterable[pb.GenerateResponse]],
        request: pb.GenerateRequest,
        policy: ResumePolicy = ResumePolicy(),
        sleep: Callable[[float], None] = time.sleep,
        on_close: Callable[[], None] | None = None,
    ):
        """call: one Generate (e.g. a stub's, with its timeout and metadata);
        on_close: run when the iteration ends (closes a channel opened for it)."""
        self.call, self.request, self.policy, self.sleep = call, request, policy, sleep
        self.on_close = on_close
        self.received: list[int] = []
        self.resumes = 0

    def __iter__(self) -> Iterator[pb.GenerateResponse]:
        try:
            yield from self._tries()
        finally:
            if self.on_close is not None:
                self.on_close()

    def _tries(self) -> Iterator[pb.GenerateResponse]:
        failures = 0
        while True:
            before = len(self.received)
            error = yield from self._one(resend(self.request, self.received) if self.resumes else self.request)
            if error is None:
                return
            failures = 1 if len(self.received) > before else failures + 1
            if failures > self.policy.retries:
                raise error
            self.sleep(self.policy.delay(failures))
            self.resumes += 1

    def _one(self, request: pb.GenerateRequest):
        """One Generate's responses; None once it finished, else the error that broke it."""
        responses = self.call(request)
        finished = False
        try:
            for r in responses:
                self.received += r.token_ids
                finished = finished or bool(r.finish_reason)
                yield r
        except grpc.RpcError as exc:
            if finished:  # the last message came: the stream is whole
                return None
            if exc.code() not in RESUMABLE:
                raise
            return exc
        finally:
            cancel = getattr(responses, "cancel", None)
            if cancel is not None:  # the caller stopped early: end the call (a no-op once it ended)
                cancel()
        if finished:
            return None
        return StreamBroken(f"the Generate stream ended without its last message after {len(self.received)} tokens")


def stream_generate(
    target: str | grpc.Channel,
    request: pb.GenerateRequest,
    *,
    retries: int = ResumePolicy.retries,
    backoff: float = ResumePolicy.backoff,
    max_backoff: float = ResumePolicy.max_backoff,
    timeout: float | None = None,
    metadata=None,
    tls: TlsConfig | None = None,
) -> ResumingStream:
    """Generate on `target` (an address, or a channel of the caller's),
    resumed after each break (the module says how). timeout: each try's
    deadline; metadata: each call's (e.g. the bearer token); tls: for an
    address (plaintext without it)."""
    if isinstance(target, str):
        channel = open_channel(target, tls, retry_unavailable=True)
        on_close: Callable[[], None] | None = channel.close
    else:
        channel, on_close = target, None
    stub = pb_grpc.OrchestratorServiceStub(channel)
    policy = ResumePolicy(retries, backoff, max_backoff)
    return ResumingStream(
        lambda r: stub.Generate(r, timeout=timeout, metadata=metadata), request, policy, on_close=on_close
    )
