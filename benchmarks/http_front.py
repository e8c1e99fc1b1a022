"""What the OpenAI-compatible HTTP front adds to latency: time to first token and
inter-token latency through HTTP (the official `openai` SDK, streaming) against
gRPC `Generate`, for the same workload through the same services.

    python -m benchmarks.http_front            # 1 and 8 streams, 8 rounds (~12 min on 2 cores)
    python -m benchmarks.http_front --quick    # a smoke run

One Stack (verifier, drafter, orchestrator) serves both fronts. Per level, n
streams in flight all along (each worker starts its next request when its last
one ends; its first request, started with all the others', is not counted),
greedy, K = 4, the demo's held-out prompts; the fronts alternate within each
round (gRPC HTTP, HTTP gRPC, ...), so a drift of the machine's
speed weighs on both alike. Per request: time to first token (the first
message carrying text) and inter-token latency as vLLM's benchmarks define
TPOT, (last token's arrival - first token's) / (tokens - 1); the two fronts
stream the same messages, so both measures mean the same on each. Per round and
front: the medians over its requests; the result is HTTP over gRPC per round,
with an interval from the rounds (benchmarks/common.py: log_ratio_interval).

Writes benchmarks/results/http_front.json and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import grpc

from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.runtime.models import load_tokenizer

from .common import (
    RESULTS,
    add_pair_args,
    alternating,
    heldout_prompts,
    log_ratio_interval,
    machine,
    pair_target,
    run_main,
    utc_now,
)

FRONTS = ("grpc", "http")


def grpc_request(address: str):
    """One streaming request through gRPC: (ttft s, itl s or None, tokens)."""
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.OrchestratorServiceStub(channel)

    def run(prompt: list[int], max_new: int, k: int):
        start = time.perf_counter()
        first: float | None = None
        last: float | None = None
        tokens = 0
        for r in stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=pb.PromptTokenIds(ids=prompt), max_new_tokens=max_new, num_speculative_tokens=k
            ),
            timeout=600,
        ):
            if r.token_ids:
                last = time.perf_counter()
                first = first or last
                tokens += len(r.token_ids)
        assert first is not None and last is not None, "a stream without a token"
        return first - start, (last - first) / (tokens - 1) if tokens > 1 else None, tokens

    return run, channel.close


def http_request(base_url: str, model: str):
    """One streaming request through the OpenAI-compatible API, with the
    official SDK as a user would call it."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)

    def run(prompt: list[int], max_new: int, k: int):
        start = time.perf_counter()
        first: float | None = None
        last: float | None = None
        tokens = 0
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_new,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"num_speculative_tokens": k},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                last = time.perf_counter()
                first = first or last
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        assert first is not None and last is not None, "a stream without a token"
        return first - start, (last - first) / (tokens - 1) if tokens > 1 else None, tokens

    return run, client.close


def run_level(make, prompts, n: int, requests_per_stream: int, max_new: int, k: int) -> dict:
    """n workers, each running 1 + requests_per_stream requests back to back.
    Each worker's first request is not counted: the n of them start together,
    so their prefills queue behind each other, which measures the burst, not
    the front; after it the streams' phases spread as they would in service."""
    ttft, itl, errors = [], [], []
    lock = threading.Lock()

    def worker(w: int):
        run, close = make()
        try:
            for i in range(1 + requests_per_stream):
                t, g, _ = run(prompts[(w * requests_per_stream + i) % len(prompts)], max_new, k)
                if i == 0:
                    continue
                with lock:
                    ttft.append(t)
                    if g is not None:
                        itl.append(g)
        except Exception as exc:  # noqa: BLE001 - reported after the level
            errors.append(repr(exc))
        finally:
            close()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} workers failed, e.g. {errors[0]}")
    return {"requests": len(ttft), "ttft_ms": 1e3 * statistics.median(ttft), "itl_ms": 1e3 * statistics.median(itl)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(ap)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=5, help="counted requests per stream per round and front")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "http_front.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.max_new_tokens, args.min_params = 3, 1, 16, 0
    return args


def level_row(n: int, got: dict[str, list[dict]]) -> dict:
    """One level's fronts over their rounds: each measure's median per front,
    HTTP over gRPC (the median of the per-round ratios) with its interval."""
    row: dict = {"streams": n}
    for measure in ("ttft_ms", "itl_ms"):
        g, h = ([p[measure] for p in got[f]] for f in FRONTS)
        row[f"grpc_{measure}"] = round(statistics.median(g), 2)
        row[f"http_{measure}"] = round(statistics.median(h), 2)
        ratios = [b / a for a, b in zip(g, h)]
        row[f"http_over_grpc_{measure}"] = round(statistics.median(ratios), 3)
        row[f"http_over_grpc_{measure}_interval"] = log_ratio_interval(h, g)
        row[f"rounds_grpc_{measure}"] = [round(x, 2) for x in g]
        row[f"rounds_http_{measure}"] = [round(x, 2) for x in h]
    return row


def run(args: argparse.Namespace) -> dict:
    target = pair_target(args)
    tok = load_tokenizer(str(args.target))
    prompts = heldout_prompts(tok, 32, args.prompt_tokens, args.max_new_tokens)
    stack = Stack(str(target), str(args.drafter), ("--dtype", args.dtype), http=True)
    makers = {
        "grpc": lambda: grpc_request(stack.orchestrator.address),
        "http": lambda: http_request(stack.openai_base_url, Path(target).name),
    }
    rows = []
    try:
        for front in FRONTS:  # warm-up: first forwards, connections, imports
            run_level(makers[front], prompts, 2, 1, 8, args.k)
        for n in args.levels:
            got: dict[str, list[dict]] = {f: [] for f in FRONTS}
            for r in range(args.rounds):
                for front in alternating(FRONTS, r):
                    got[front].append(run_level(makers[front], prompts, n, args.requests, args.max_new_tokens, args.k))
            rows.append(level_row(n, got))
            report_level(rows[-1])
    finally:
        stack.stop()
    meta = {
        "machine": machine(),
        "target": str(target),
        "drafter": str(args.drafter),
        "dtype": args.dtype,
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "requests_per_stream": args.requests,
        "date": utc_now(),
    }
    return {"meta": meta, "rows": rows}


def report_level(row: dict) -> None:
    n = row["streams"]
    print(
        f"x{n:<2} ttft p50 grpc {row['grpc_ttft_ms']:.1f} ms, http {row['http_ttft_ms']:.1f} ms "
        f"(http/grpc {row['http_over_grpc_ttft_ms']} {row['http_over_grpc_ttft_ms_interval']}); "
        f"itl p50 grpc {row['grpc_itl_ms']:.2f} ms, http {row['http_itl_ms']:.2f} ms "
        f"(http/grpc {row['http_over_grpc_itl_ms']} {row['http_over_grpc_itl_ms_interval']})",
        flush=True,
    )


def report(result: dict, args: argparse.Namespace) -> None:
    print(f"wrote {args.out}")  # each level's figures were printed as it ended


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
