"""What tracing every request costs, in alternating rounds (part of
`python -m benchmarks.speedup`).

Two stacks of the same pair are up the whole time: one untraced, one tracing
every request (OTEL_TRACES_SAMPLER=always_on) to a real OTLP/gRPC receiver in
this process (benchmarks/otlp.py). Per level of concurrency (n streams in
flight, `specd bench`'s closed loop, specd/bench.py `run_streams`), each
round drives each stack once with the same requests, only one at a time, in an
order rotated each round. The result is traced / untraced tokens/s as the
geometric mean of the per-round ratios with its interval (benchmarks/common.py).

After each traced round the run waits until every span it must have produced
has arrived (the count per span name follows from the requests' stats:
benchmarks/otlp.py `expected_spans`), and fails if any is missing. The wait
also keeps the traced stack's last exports out of the next untraced round.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import grpc

from specd import bench
from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc

from .common import cell, fmt_ratio, paired_ratio, percentile, rotated
from .otlp import OtlpSink, expected_spans, missing_spans

TRACED, UNTRACED = "traced", "untraced"


def drive(
    address: str, requests: Sequence, n: int, count: int
) -> tuple[list[bench.RequestRecord], tuple[float, float]]:
    """`count` requests with n streams in flight, one connection per worker
    (as clients have); the records and the window from the first start to the
    last token (`specd bench`'s round)."""
    channels = [grpc.insecure_channel(address) for _ in range(n)]
    stubs = [pb_grpc.OrchestratorServiceStub(c) for c in channels]
    which = itertools.count()
    t0 = time.perf_counter()
    try:
        records = bench.run_streams(
            lambda req: stubs[next(which) % n].Generate(req, timeout=1800), requests, n, count=count
        )
    finally:
        for c in channels:
            c.close()
    t1 = max((r.arrivals[-1][0] for r in records if r.arrivals), default=time.perf_counter())
    return records, (t0, t1 + 1e-9)


def check_spans(sink: OtlpSink, records: Sequence[bench.RequestRecord], since, timeout_s: float = 60.0) -> dict:
    """Wait for the spans these finished requests must have produced; raise
    naming what is missing. Returns the expected and received counts by name."""
    expected = expected_spans(r.stats for r in records if r.stats is not None)
    received = sink.wait_for(expected, since, timeout_s)
    missing = missing_spans(expected, received)
    if missing:
        raise RuntimeError(
            f"traced run: spans missing after {timeout_s:.0f} s: {missing} "
            f"(expected at least {expected}, received {dict(received)})"
        )
    return {"expected": expected, "received": dict(sorted(received.items()))}


def overheads(rounds) -> list[float]:
    """The per-cycle overheads (GenerationStats.cycle_overhead_ms) of a level's finished requests."""
    return [float(x) for recs, _ in rounds for r in recs if r.stats for x in r.stats.get("cycle_overhead_ms", [])]


def level_row(n: int, setting: str, count: int, got: dict[str, list], spans: list[dict]) -> dict:
    """One level's result: each stack's summary over its rounds, traced /
    untraced with its interval, and the span counts per traced round."""
    out: dict = {"streams": n, "setting": setting, "requests_per_round": count}
    for name, rounds in got.items():
        s = bench.level_summary(rounds)
        ovh = overheads(rounds)
        if ovh:
            s["overhead_ms_p50"] = round(percentile(ovh, 50), 3)
            s["overhead_ms_p90"] = round(percentile(ovh, 90), 3)
        out[name] = s
    out["ratio"] = paired_ratio(out[TRACED]["rounds_tokens_per_s"], out[UNTRACED]["rounds_tokens_per_s"])
    # Checked: the names expected_spans counts (received of those vs expected);
    # all: every span received, the phases and closes included.
    out["spans_expected"] = sum(sum(s["expected"].values()) for s in spans)
    out["spans_received_checked"] = sum(s["received"].get(k, 0) for s in spans for k in s["expected"])
    out["spans_received_all"] = sum(sum(s["received"].values()) for s in spans)
    out["spans_per_round"] = spans
    return out


def tracing_cost(
    stacks: dict[str, Stack],
    sink: OtlpSink,
    prompts: Sequence[list[int]],
    setting: str,
    fields: dict,
    levels: Sequence[int],
    rounds: int,
    max_new: int,
) -> list[dict]:
    """The traced and untraced stacks in alternating rounds at each level; one row per level."""
    requests = [
        pb.GenerateRequest(prompt_token_ids=pb.PromptTokenIds(ids=p), max_new_tokens=max_new, **fields) for p in prompts
    ]
    since = sink.counts()
    warm, _ = drive(stacks[TRACED].orchestrator.address, requests[:1], 1, 1)  # first-call costs, both stacks
    drive(stacks[UNTRACED].orchestrator.address, requests[:1], 1, 1)
    check_spans(sink, warm, since)
    out = []
    for n in levels:
        # Batch 1: each prompt once a round; more streams: twice as many requests
        # as streams, so that most of a round runs at n (as `specd bench`).
        count = len(requests) if n == 1 else max(len(requests), 2 * n)
        got: dict[str, list] = {UNTRACED: [], TRACED: []}
        spans = []
        for r in range(rounds):
            for name in rotated([UNTRACED, TRACED], r):
                since = sink.counts()
                recs, window = drive(stacks[name].orchestrator.address, requests, n, count)
                got[name].append((recs, window))
                if name == TRACED:
                    spans.append({"round": r, **check_spans(sink, recs, since)})
            tps = {k: bench.round_summary(*v[-1])["tokens_per_s"] for k, v in got.items()}
            print(
                f"tracing x{n} round {r + 1}/{rounds}: untraced {tps[UNTRACED]:.1f}, traced {tps[TRACED]:.1f} tok/s, "
                f"spans {sum(spans[-1]['received'].values())} (expected >= {sum(spans[-1]['expected'].values())})",
                flush=True,
            )
        out.append(level_row(n, setting, count, got, spans))
    return out


def tracing_table(rows: Sequence[dict]) -> str:
    """The tracing cost per level: traced / untraced tokens/s with its interval,
    the per-cycle overhead of both, and the spans received of the names checked
    against the count expected (all spans received in brackets)."""
    lines = [
        "| streams | setting | untraced tok/s | traced tok/s | traced / untraced (interval) "
        "| overhead p50 untraced / traced ms | spans received / expected (all received) |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in rows:
        lines.append(
            f"| {t['streams']} | {t['setting']} | {t['untraced']['tokens_per_s']:.1f} "
            f"| {t['traced']['tokens_per_s']:.1f} "
            f"| {fmt_ratio(t['ratio'])} | {cell(t['untraced'].get('overhead_ms_p50'))} / "
            f"{cell(t['traced'].get('overhead_ms_p50'))} | {t['spans_received_checked']} / {t['spans_expected']} "
            f"({t['spans_received_all']}) |"
        )
    return "\n".join(lines)
