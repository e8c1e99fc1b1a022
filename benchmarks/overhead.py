"""Where a cycle's own cost goes: a timeline of one batch-1 stream through the
three services, step by step (docs/overhead.md).

    python -m benchmarks.overhead                  # demo pair, chain K=4, greedy
    python -m benchmarks.overhead --quick          # a smoke run
    python -m benchmarks.overhead --floor          # also the transport's own floor

The services run with SPECD_PROBE_DIR set (specd_core/telemetry/probe.py): each
process appends timestamped events (a message read, queued for a forward, the
forward, answered, sent; the orchestrator's sends, receipts and verdicts) to
its own file, on the one monotonic clock all processes share. A cycle runs from
one verdict to the next; for every step between two events the median over
all cycles is reported, with where it runs. Steps that are not the two
forwards are the cycle's overhead; their sum is compared with the services'
own figure, GenerationStats.cycle_overhead_ms (wall - draft compute - verify
compute), whose median is the headline. The probes cost a few microseconds each,
so the profile's sum runs a little above an unprobed run's overhead.

Writes benchmarks/results/overhead.json and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from specd.local_stack import Stack
from specd_core.runtime.models import load_tokenizer

from .common import RESULTS, add_pair_args, heldout_prompts, machine, run_main, utc_now


def read_events(directory: Path) -> list[tuple[float, str]]:
    events = []
    for f in directory.glob("*.events"):
        for line in f.read_text().splitlines():
            t, _, name = line.partition(" ")
            events.append((float(t), name))
    return sorted(events)


# A cycle's critical path at batch 1, in order: from a verdict, the next
# Propose out, drafted, back; the Verify out, verified, back; the next verdict.
CHAIN = (
    "verdict",
    "send ProposeRequest",
    "_propose read",
    "_propose queued",
    "_propose forward",
    "_propose forwarded",
    "_propose answered",
    "_propose sending",
    "received",
    "woken",
    "send VerifyRequest",
    "_verify read",
    "_verify queued",
    "_verify forward",
    "_verify forwarded",
    "_verify answered",
    "_verify sending",
    "received",
    "woken",
    "verdict",
)
# Beside it, on the orchestrator: the cycle's bookkeeping up to its chunk, and
# the chunk's write to the client (the Generate stream), which the next
# Propose overlaps.
SIDE = ("streamed", "resumed")


def cycles(events: list[tuple[float, str]]) -> list[dict]:
    """Per cycle (verdict to verdict, with a Verify between: a request's first
    cycle starts at its prefill instead and is left out), the time of each
    CHAIN event (the first after the one before it) and of the SIDE events."""
    verdicts = [i for i, (_, n) in enumerate(events) if n == "verdict"]
    out = []
    for a, b in zip(verdicts, verdicts[1:]):
        span = events[a : b + 1]
        times, j = [], 0
        for t, name in span:
            if j < len(CHAIN) and name == CHAIN[j]:
                times.append(t)
                j += 1
        if j < len(CHAIN):
            continue  # not a full cycle (a request's end, a cycle without a draft)
        side = {name: t for t, name in span if name in SIDE}
        out.append({"chain": times, "side": side})
    return out


def profile(found: list[dict]) -> dict:
    """Median ms per step of the chain, where it is spent, and the side steps."""
    rows = []
    for i in range(1, len(CHAIN)):
        values = [(c["chain"][i] - c["chain"][i - 1]) * 1e3 for c in found]
        step = (CHAIN[i - 1], CHAIN[i])
        rows.append(
            {"from": step[0], "to": step[1], "where": where(step), "ms_p50": round(statistics.median(values), 4)}
        )
    side = {}
    for name, start in (
        ("bookkeeping before the chunk (verdict -> streamed)", None),
        ("client write (streamed -> resumed)", "streamed"),
    ):
        end = "streamed" if start is None else "resumed"
        values = [
            (c["side"][end] - (c["chain"][0] if start is None else c["side"][start])) * 1e3
            for c in found
            if end in c["side"] and (start is None or start in c["side"])
        ]
        if values:
            side[name] = round(statistics.median(values), 4)
    walls = [(c["chain"][-1] - c["chain"][0]) * 1e3 for c in found]
    return {
        "cycles": len(found),
        "wall_ms_p50": round(statistics.median(walls), 3),
        "steps": rows,
        "side_steps_ms_p50": side,
        "steps_sum_ms": round(sum(r["ms_p50"] for r in rows), 3),
        "overhead_steps_sum_ms": round(sum(r["ms_p50"] for r in rows if r["where"] != "forward"), 3),
        "forward_steps_ms": round(sum(r["ms_p50"] for r in rows if r["where"] == "forward"), 3),
    }


def where(step: tuple[str, str]) -> str:
    """Which process (or the wire between two) a step is spent in."""
    a, b = step
    if a.endswith(" forward") and b.endswith(" forwarded"):
        return "forward"
    role = {"_propose": "drafter", "_verify": "verifier"}
    ra, rb = a.split(" ")[0], b.split(" ")[0]
    if ra in role and rb in role:
        return role[ra]
    if ra in role or rb in role:
        return "wire"
    return "orchestrator"


def _floor_server(port_out, gap_s: float) -> None:
    """A VerifyStream-like service with nothing in it: specd's stream server
    (concurrent_stream), each message answered after `gap_s` on a worker
    thread (the forward's place: the server's threads idle meanwhile)."""
    from concurrent import futures

    import grpc

    from specd_core.api.v1 import specdec_pb2 as pb
    from specd_core.net.grpc_util import concurrent_stream, prefer_latency

    prefer_latency()
    pool = futures.ThreadPoolExecutor(1)

    def answer() -> pb.VerifyResponse:
        start = time.perf_counter()
        time.sleep(gap_s)
        return pb.VerifyResponse(token_ids=[1], compute_ms=(time.perf_counter() - start) * 1e3)

    def stream(requests, context):
        messages = (pb.VerifyRequest.FromString(r) for r in requests)
        for response in concurrent_stream(lambda _: pool.submit(answer), messages, pb.VerifyResponse):
            yield response.SerializeToString()

    handler = grpc.method_handlers_generic_handler("floor.Floor", {"S": grpc.stream_stream_rpc_method_handler(stream)})
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handler,))
    port_out.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def transport_floor(gap_ms: float, messages: int = 400) -> float:
    """Median round trip minus the server's `compute`, in ms, of one message
    at a time over a stream from an asyncio client (the orchestrator's side)
    to the stream server above: what any cycle pays per message on this
    machine, before any of specd's own work."""
    import asyncio
    import multiprocessing

    import grpc

    from specd_core.api.v1 import specdec_pb2 as pb

    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=_floor_server, args=(ports, gap_ms / 1e3), daemon=True)
    proc.start()
    port = ports.get(timeout=60)

    async def run() -> float:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream("/floor.Floor/S")()
            msg = pb.VerifyRequest(session_id="s", draft_token_ids=[1, 2, 3, 4]).SerializeToString()
            times = []
            for _ in range(messages):
                start = time.perf_counter()
                await call.write(msg)
                r = pb.VerifyResponse.FromString(await call.read())
                times.append((time.perf_counter() - start) * 1e3 - r.compute_ms)
            await call.done_writing()
        return statistics.median(times[messages // 10 :])

    try:
        return asyncio.run(run())
    finally:
        proc.kill()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(ap, cost_scaled=False)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--k", type=int, default=4, help="chain length")
    ap.add_argument("--method", default="draft_model", choices=["draft_model", "ngram"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--label", default="", help="what this profile is of (kept in the JSON)")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also measure the transport's floor: an empty stream server's round trip, busy and idle between messages",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "overhead.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens = 2, 32
    return args


def run(args: argparse.Namespace) -> dict:
    """The probed stream and its profile (and the transport's floor, with --floor)."""
    tok = load_tokenizer(str(args.target))
    prompts = heldout_prompts(tok, args.prompts, 96, args.max_new_tokens)
    with tempfile.TemporaryDirectory(prefix="specd-probe-") as probe_dir:
        stack = Stack(str(args.target), str(args.drafter), ("--dtype", args.dtype), env={"SPECD_PROBE_DIR": probe_dir})
        overheads = []
        try:
            stack.generate(prompt_token_ids={"ids": prompts[0]}, max_new_tokens=8, num_speculative_tokens=2)
            start = time.time()
            for p in prompts:
                _, last = stack.generate(
                    prompt_token_ids={"ids": p},
                    max_new_tokens=args.max_new_tokens,
                    num_speculative_tokens=args.k,
                    speculative_method=args.method,
                )
                assert last is not None
                overheads += list(last.stats.cycle_overhead_ms)
        finally:
            stack.stop()
            events = read_events(Path(probe_dir))
    # The warm-up request's cycles come first: keep as many as were measured.
    result = profile(cycles(events)[-len(overheads) :])
    result["overhead_ms_p50"] = round(statistics.median(overheads), 3)
    # statistics.quantiles' exclusive method, not common.pct's linear one: kept
    # so that a new profile compares with the recorded one (docs/overhead.md).
    result["overhead_ms_p90"] = round(statistics.quantiles(overheads, n=10)[-1], 3)
    result["meta"] = {
        "label": args.label,
        "machine": machine(),
        "target": str(args.target),
        "drafter": str(args.drafter),
        "dtype": args.dtype,
        "method": args.method,
        "k": args.k,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "date": utc_now(start),
    }
    if args.floor:
        # Idle 10 ms between messages, as a drafter is while the verifier
        # computes (and the other way round): threads sleep, wake-ups cost.
        result["transport_floor_ms_p50"] = {
            "busy (no gap)": round(transport_floor(0.0), 3),
            "idle 10 ms between messages": round(transport_floor(10.0, 200), 3),
        }
    return result


def report(result: dict, args: argparse.Namespace) -> None:
    print(f"| step | where | ms (p50 over {result['cycles']} cycles) |\n|---|---|---|")
    for r in result["steps"]:
        print(f"| {r['from']} -> {r['to']} | {r['where']} | {r['ms_p50']:.3f} |")
    for name, ms in result["side_steps_ms_p50"].items():
        print(f"| beside it: {name} | orchestrator | {ms:.3f} |")
    print(
        f"\nsum of steps {result['steps_sum_ms']} ms (cycle wall p50 {result['wall_ms_p50']} ms); "
        f"forwards {result['forward_steps_ms']} ms; everything else {result['overhead_steps_sum_ms']} ms"
    )
    print(
        f"cycle_overhead_ms (the services' own figure): p50 {result['overhead_ms_p50']} ms, "
        f"p90 {result['overhead_ms_p90']} ms"
    )
    for name, ms in result.get("transport_floor_ms_p50", {}).items():
        print(f"transport floor, one message's round trip minus compute, {name}: {ms} ms")
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
