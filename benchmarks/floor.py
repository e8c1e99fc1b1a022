"""The transport floor: the CPU per session-cycle of the cheapest orchestrators
that can be written on grpc.aio with specd's messages, measured side by side
with specd's own, as benchmarks/orchestrator.py measures it.

    python -m benchmarks.floor                    # off, ngram, draft_model at 32 streams, 4 rounds
    python -m benchmarks.floor --floor-only       # the floors alone
    python -m benchmarks.floor --streams 8 32 --rounds 5
    python -m benchmarks.floor --quick            # smoke run: 8 streams, 16 requests, 1 round

Stand-in services (one process) answer every VerifyStep / ProposeStep part
with a fixed reply (one committed token; three draft tokens) after a
forward's time asleep (`--verify-ms`, `--draft-ms`), batching what is queued
and gathering the other open sessions' parts as specd's batcher does, so
their own CPU is nearly nothing and the steps are as large as specd's.
A floor orchestrator keeps only what an orchestrator that streams each
cycle's tokens must do per session-cycle: its part of one Propose step
(draft_model) and of one Verify step (with four draft tokens for ngram, three
proposed for draft_model), one message per step, and one GenerateResponse
written to the client's stream; per request, it opens and closes the
sessions with the same unary calls. It keeps no statistics, metrics, spans,
depth policy, failover, n-gram lookup or detokenisation (the text is one
fixed character). Two designs:

- coroutine: a coroutine per session runs its cycles and awaits each part's
  reply (the parts of one turn of the event loop leave as one step message,
  answered by position) and writes its response: specd's design;
- driven: no coroutine per session while it runs: one task per service
  sends a step of every session ready for it and, on the reply, writes each
  session's response (awaited in turn) and queues it for its next step. A
  session's handler only opens, waits for its end and closes.

The load generator is benchmarks/orchestrator.py's: one connection per
stream, 64-token requests one after another, the orchestrator's CPU time
(/proc/PID/stat) divided by the cycles. Every round runs each system once,
in an order that rotates, and specd over each floor is the geometric mean
of the per-round ratios with a rough 95 % interval (benchmarks/common.py).
A floor is a lower bound for an orchestrator of its design on the same
machine: what it costs is the transport's and the event loop's, before any
of an orchestrator's own work. Writes benchmarks/results/floor.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc

from .common import RESULTS, paired_ratio, rotated, run_main
from .orchestrator import METHODS, drive, generate, run_requests, tiny_pair
from .stack_probe import cpu_seconds

DRAFT = [11, 12, 13]  # the stand-in drafter's proposal, every time
NGRAM = [11, 12, 13, 14]  # the floor's n-gram draft, every time
TOKEN = 7  # the stand-in verifier's committed token (draft rejected)


# ---- stand-in services (one process, both services on one port) ----


async def forwards(steps, step_s: float, open_sessions):
    """The steps a real service batches into one forward: what arrived while
    the last forward ran, then (as specd_core/runtime/batcher.py gathers) the
    parts of the other open sessions for up to half a forward's time; each
    batch answered after step_s asleep (a forward's time without its CPU)."""
    loop = asyncio.get_running_loop()
    arrived: asyncio.Queue = asyncio.Queue()

    async def read() -> None:
        async for step in steps:
            arrived.put_nowait(step)
        arrived.put_nowait(None)

    reader = asyncio.ensure_future(read())
    ended = False
    try:
        while not ended and (step := await arrived.get()) is not None:
            batch, parts = [step], len(step.requests)
            deadline = loop.time() + step_s / 2
            while parts < open_sessions() or not arrived.empty():
                try:
                    more = (
                        arrived.get_nowait()
                        if not arrived.empty()
                        else await asyncio.wait_for(arrived.get(), deadline - loop.time())
                    )
                except TimeoutError:
                    break
                if more is None:
                    ended = True
                    break
                batch.append(more)
                parts += len(more.requests)
            await asyncio.sleep(step_s)
            yield batch
    finally:
        reader.cancel()


class StandIn:
    """What both stand-ins share: a forward's time and their open sessions."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.sessions = step_s, 0

    def steps(self, steps):
        return forwards(steps, self.step_s, lambda: self.sessions)

    async def CloseSession(self, request, context):
        self.sessions -= 1
        return pb.CloseSessionResponse()


class StandInVerifier(StandIn, pb_grpc.VerifierServiceServicer):
    async def OpenSession(self, request, context):
        self.sessions += 1
        return pb.OpenVerifySessionResponse(first_token_id=TOKEN)

    async def VerifySteps(self, steps, context):
        async for batch in self.steps(steps):
            n = sum(len(step.requests) for step in batch)
            for step in batch:
                yield pb.VerifyStepResponse(
                    responses=[
                        pb.VerifyResponse(request_id=r.request_id, token_ids=[TOKEN], batch_sessions=n)
                        for r in step.requests
                    ]
                )


class StandInDrafter(StandIn, pb_grpc.DrafterServiceServicer):
    async def OpenSession(self, request, context):
        self.sessions += 1
        return pb.OpenDraftSessionResponse()

    async def ProposeSteps(self, steps, context):
        async for batch in self.steps(steps):
            for step in batch:
                yield pb.ProposeStepResponse(
                    responses=[
                        pb.ProposeResponse(request_id=r.request_id, draft_token_ids=DRAFT) for r in step.requests
                    ]
                )


async def serve_services(verify_ms: float, draft_ms: float) -> None:
    server = grpc.aio.server()
    pb_grpc.add_VerifierServiceServicer_to_server(StandInVerifier(verify_ms / 1e3), server)
    pb_grpc.add_DrafterServiceServicer_to_server(StandInDrafter(draft_ms / 1e3), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


# ---- the floor orchestrator ----


class Steps:
    """One bidirectional step stream: parts joined over a turn of the loop
    leave as one message; every part of it waits on one future and reads its
    reply by position."""

    def __init__(self, method, step_cls) -> None:
        self.step_cls = step_cls
        self.queue: asyncio.Queue = asyncio.Queue()
        self.parts: list | None = None
        self.future: asyncio.Future | None = None
        self.sent: asyncio.Queue = asyncio.Queue()  # futures of steps in flight, in order
        asyncio.ensure_future(self._read(method(self._requests())))

    async def _requests(self):
        while True:
            yield await self.queue.get()

    async def _read(self, stream) -> None:
        async for reply in stream:
            self.sent.get_nowait().set_result(reply.responses)

    async def call(self, request):
        if self.parts is None or self.future is None:
            self.parts, self.future = [], asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(self._flush)
        index, future = len(self.parts), self.future
        self.parts.append(request)
        responses = await future
        return responses[index]

    def _flush(self) -> None:
        assert self.parts is not None and self.future is not None
        self._send(self.parts, self.future)
        self.parts = self.future = None

    def _send(self, requests: list, future: asyncio.Future) -> None:
        self.sent.put_nowait(future)
        self.queue.put_nowait(self.step_cls(requests=requests))

    async def step(self, requests: list) -> list:
        """One step message of these parts; its replies, in order."""
        future = asyncio.get_running_loop().create_future()
        self._send(requests, future)
        return await future


class FloorOrchestrator(pb_grpc.OrchestratorServiceServicer):
    def __init__(self, services: str, write_every: int) -> None:
        self.write_every = write_every
        channel = grpc.aio.insecure_channel(services)
        self.verifier = pb_grpc.VerifierServiceStub(channel)
        self.drafter = pb_grpc.DrafterServiceStub(channel)
        self.verify = Steps(self.verifier.VerifySteps, pb.VerifyStep)
        self.propose = Steps(self.drafter.ProposeSteps, pb.ProposeStep)
        self.sessions = 0

    async def open(self, request) -> tuple[str, bool, list[int], pb.GenerateResponse]:
        """A request's sessions opened: its id, whether it drafts with the
        drafter, its n-gram draft and its first response. draft_model: a
        Propose part, then its draft verified; ngram: a fixed draft (the real
        one is looked up in the orchestrator) verified; off: none."""
        self.sessions += 1
        sid = str(self.sessions)
        draft = request.speculative_method == "draft_model"
        ngram = NGRAM if request.speculative_method == "ngram" else []
        opened = await self.verifier.OpenSession(pb.OpenVerifySessionRequest(session_id=sid))
        if draft:
            await self.drafter.OpenSession(pb.OpenDraftSessionRequest(session_id=sid))
        return sid, draft, ngram, pb.GenerateResponse(token_ids=[opened.first_token_id], text="a")

    async def close(self, sid: str, draft: bool) -> None:
        await self.verifier.CloseSession(pb.CloseSessionRequest(session_id=sid))
        if draft:
            await self.drafter.CloseSession(pb.CloseSessionRequest(session_id=sid))

    async def Generate(self, request, context):
        sid, draft, ngram, first = await self.open(request)
        yield first
        cycles = batched = 0
        unsent: list[int] = []
        for _ in range(request.max_new_tokens - 1):
            tokens = ngram
            if draft:
                tokens = list((await self.propose.call(pb.ProposeRequest(session_id=sid))).draft_token_ids)
            verdict = await self.verify.call(pb.VerifyRequest(session_id=sid, draft_token_ids=tokens))
            cycles, batched = cycles + 1, batched + verdict.batch_sessions
            unsent += verdict.token_ids
            if cycles % self.write_every == 0:
                yield pb.GenerateResponse(token_ids=unsent, text="a")
                unsent = []
        await self.close(sid, draft)
        # The text of the last response: the sessions its verify steps held
        # (the stand-in verifier's batch_sessions), summed over its cycles.
        last = pb.GenerateResponse(token_ids=unsent, finish_reason="length", text=str(batched))
        last.stats.cycles = cycles
        yield last


class DrivenSession:
    __slots__ = ("sid", "context", "draft", "tokens", "left", "cycles", "batched", "done")

    def __init__(self, sid: str, context, draft: bool, tokens: list[int], left: int) -> None:
        self.sid, self.context, self.draft, self.tokens, self.left = sid, context, draft, tokens, left
        self.cycles = self.batched = 0
        self.done = asyncio.get_running_loop().create_future()


class StepDriven(FloorOrchestrator):
    """The other design: no coroutine per session during its cycles. One task
    per service sends a step of every session ready for it, and on the reply
    writes each session's response to its client (awaited one after another)
    and hands it on; a session's handler only opens, waits for its end and
    closes. (Writes every cycle: --write-every does not apply.)"""

    def __init__(self, services: str, write_every: int) -> None:
        super().__init__(services, write_every)
        self.queued: dict[str, list[DrivenSession]] = {"propose": [], "verify": []}
        self.waiting: dict[str, asyncio.Future | None] = {"propose": None, "verify": None}
        asyncio.ensure_future(self._drive("propose"))
        asyncio.ensure_future(self._drive("verify"))

    def _queue(self, kind: str, s: DrivenSession) -> None:
        self.queued[kind].append(s)
        waiting = self.waiting[kind]
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    async def _drive(self, kind: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.queued[kind]:
                waiting = self.waiting[kind] = loop.create_future()
                await waiting
            batch, self.queued[kind] = self.queued[kind], []
            if kind == "propose":
                replies = await self.propose.step([pb.ProposeRequest(session_id=s.sid) for s in batch])
                for s, r in zip(batch, replies):
                    s.tokens = list(r.draft_token_ids)
                    self._queue("verify", s)
                continue
            replies = await self.verify.step(
                [pb.VerifyRequest(session_id=s.sid, draft_token_ids=s.tokens) for s in batch]
            )
            for s, r in zip(batch, replies):
                s.cycles, s.batched = s.cycles + 1, s.batched + r.batch_sessions
                await s.context.write(pb.GenerateResponse(token_ids=r.token_ids, text="a"))
                if s.cycles == s.left:
                    s.done.set_result(None)
                else:
                    self._queue("propose" if s.draft else "verify", s)

    async def Generate(self, request, context):
        sid, draft, ngram, first = await self.open(request)
        await context.write(first)
        s = DrivenSession(sid, context, draft, ngram, request.max_new_tokens - 1)
        self._queue("propose" if draft else "verify", s)
        await s.done
        await self.close(sid, draft)
        last = pb.GenerateResponse(finish_reason="length", text=str(s.batched))
        last.stats.cycles = s.cycles
        await context.write(last)


DESIGNS = {"coroutine": FloorOrchestrator, "driven": StepDriven}


async def serve_orchestrator(services: str, write_every: int, design: str) -> None:
    server = grpc.aio.server()
    pb_grpc.add_OrchestratorServiceServicer_to_server(DESIGNS[design](services, write_every), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


# ---- the measurement ----


def start(*args: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.floor", *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


class Floor:
    """The stand-in services and a floor orchestrator of one design, up, with
    one client connection per stream (as benchmarks/orchestrator.py's streams
    have)."""

    def __init__(self, args, streams: int, design: str) -> None:
        self.services, services_port = start("services", str(args.verify_ms), str(args.draft_ms))
        self.orchestrator, port = start("orchestrator", f"127.0.0.1:{services_port}", str(args.write_every), design)
        self.channels = [
            grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(streams)
        ]
        self.stubs = [pb_grpc.OrchestratorServiceStub(c) for c in self.channels]
        for method in args.methods:  # the first calls of each path pay one-off costs
            self.measure(method, streams, streams, 4)

    def measure(self, method: str, streams: int, requests: int, tokens: int) -> tuple[float, float]:
        """CPU ms per session-cycle over `requests` on `streams` connections,
        and the mean number of sessions in the verify step a cycle was in."""
        left, cycles, batched = iter(range(requests)), [], []

        def stream(stub) -> None:
            for n in left:
                last = generate(stub, {"speculative_method": method}, n, tokens)
                assert last.finish_reason == "length" and last.stats.cycles == tokens - 1, "a floor stream ended early"
                cycles.append(last.stats.cycles)
                batched.append(int(last.text))

        before = cpu_seconds(self.orchestrator.pid)
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(stream, self.stubs[:streams]))
        return (cpu_seconds(self.orchestrator.pid) - before) * 1e3 / sum(cycles), sum(batched) / sum(cycles)

    def stop(self) -> None:
        for c in self.channels:
            c.close()
        self.orchestrator.kill()
        self.services.kill()


def measure_specd(driven, method: str, streams: int, requests: int, tokens: int) -> tuple[float, float]:
    """The same for specd's orchestrator (benchmarks/orchestrator.py's run_requests)."""
    r = run_requests(driven.stubs[:streams], driven.probe, METHODS[method], requests, tokens)
    return r["cpu_s"] * 1e3 / r["cycles"], r["cycles"] / max(1, sum(r["steps"]["verifier"]))


def summary(measured: list[tuple[float, float]]) -> dict:
    runs = [ms for ms, _ in measured]
    return {
        "cpu_ms_per_session_cycle": statistics.median(runs),
        "range": [min(runs), max(runs)],
        "mean_verify_batch": statistics.median(b for _, b in measured),
        "runs": runs,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--streams", nargs="+", type=int, default=[32])
    ap.add_argument("--requests", type=int, default=96, help="requests per window (all streams together)")
    ap.add_argument("--tokens", type=int, default=64, help="max_new_tokens per request")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--designs",
        nargs="+",
        default=list(DESIGNS),
        choices=list(DESIGNS),
        help="the floor orchestrators: coroutine (a coroutine per session, as specd's loop), "
        "driven (one task per service drives every session)",
    )
    ap.add_argument("--floor-only", action="store_true", help="the floors alone, without specd's stack beside them")
    ap.add_argument("--verify-ms", type=float, default=5.0, help="the stand-in verifier's time per step (asleep)")
    ap.add_argument("--draft-ms", type=float, default=5.0, help="the stand-in drafter's time per step (asleep)")
    ap.add_argument(
        "--write-every",
        type=int,
        default=1,
        help="coroutine design: write the client a response every N cycles (1: every cycle, as specd "
        "does; more: what the writes cost)",
    )
    ap.add_argument("--out", default=str(RESULTS / "floor.json"))
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 streams, 16 requests, 1 round")
    args = ap.parse_args(argv)
    if args.quick:
        args.streams, args.requests, args.rounds = [8], 16, 1
    return args


def measure_row(floors: dict[str, Floor], driven, method: str, n: int, args: argparse.Namespace) -> dict:
    """Every system at n streams with `method`, in rounds of rotating order;
    each one's summary and, beside specd, specd over each floor."""
    systems = list(floors) + ([] if driven is None else ["specd"])
    measured: dict[str, list] = {s: [] for s in systems}
    requests = max(args.requests, n)
    for r in range(args.rounds):
        for system in rotated(systems, r):
            measured[system].append(
                floors[system].measure(method, n, requests, args.tokens)
                if system in floors
                else measure_specd(driven, method, n, requests, args.tokens)
            )
    row: dict[str, Any] = {"method": method, "streams": n, **{s: summary(m) for s, m in measured.items()}}
    parts = [
        f"{s} {row[s]['cpu_ms_per_session_cycle']:.3f} ms (steps of {row[s]['mean_verify_batch']:.1f})" for s in systems
    ]
    if driven is not None:
        for design in floors:
            ratio = row[f"specd_over_{design}"] = paired_ratio(row["specd"]["runs"], row[design]["runs"])
            parts.append(f"specd / {design} {ratio['geomean']:.2f} (interval {ratio['interval']})")
    print(f"{method:12s} {n:3d} streams: " + "; ".join(parts), flush=True)
    return row


def specd_stack(args: argparse.Namespace, streams: int):
    """specd's stack of the tiny pair, driven as benchmarks/orchestrator.py drives it."""
    target, drafter = tiny_pair()
    stack_args = argparse.Namespace(
        target=target, drafter=drafter, streams=[streams], methods=args.methods, tokens=args.tokens, torch_threads=1
    )
    return drive(stack_args, 1)


def run(args: argparse.Namespace) -> dict:
    streams = max(args.streams)
    floors: dict[str, Floor] = {}
    driven = None
    rows = []
    try:
        for design in args.designs:
            floors[design] = Floor(args, streams, design)
        if not args.floor_only:
            driven = specd_stack(args, streams)
        for n in args.streams:
            for method in args.methods:
                rows.append(measure_row(floors, driven, method, n, args))
    finally:
        for floor in floors.values():
            floor.stop()
        if driven is not None:
            for c in driven.channels:
                c.close()
            driven.stack.stop()
    return {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "args": vars(args),
        "rows": rows,
    }


def report(result: dict, args: argparse.Namespace) -> None:
    print(f"wrote {args.out}")  # each row was printed as it was measured


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["services"]:
        asyncio.run(serve_services(float(sys.argv[2]), float(sys.argv[3])))
    elif sys.argv[1:2] == ["orchestrator"]:
        asyncio.run(serve_orchestrator(sys.argv[2], int(sys.argv[3]), sys.argv[4]))
    else:
        sys.exit(main())
