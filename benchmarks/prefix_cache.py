"""Automatic prefix caching: time to first token
of a request whose long prefix an earlier request served, against a cold
request of the same length, on the same running system.

    python -m benchmarks.prefix_cache                # 7 pairs, a 1,500-token prefix
    python -m benchmarks.prefix_cache --pairs 3      # quicker

The target has Llama-3.1-8B's structure at a tiny width (32 layers, 32 query
and 8 KV heads, llama3 RoPE; benchmarks/engine.py's `build_pair`), the
drafter its first 4 layers; both with the demo pair's tokenizer, served as
real processes (specd.local_stack.Stack: verifier, drafter, orchestrator on
ports), asked over gRPC. Each round draws a fresh random prefix P and
primes it (P + a suffix, not timed); then it times, in an order that
alternates between rounds, a WARM request (P + another suffix) and a COLD
one (a never-seen prefix of P's length + a suffix): time from sending the
Generate to its first message with a token. The figures are the medians of
each over the rounds, their ratio, the per-round ratios (paired, as every
benchmark's; benchmarks/common.py), and the warm requests'
`GenerationStats.cached_prompt_tokens`.

Goal: warm TTFT <= 0.3 x cold, and >= 1,024 cached tokens on the
warm request. Writes benchmarks/results/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import DEMO_TARGET, RESULTS, alternating, machine, paired_ratio, run_main, utc_now
from benchmarks.engine import TARGET_SHAPE, build_pair
from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb

GOAL_RATIO = 0.3
GOAL_CACHED = 1024


def with_tokenizer(model_dir: Path) -> None:
    """The demo pair's tokenizer (4,096 ids, as the built models' vocabulary)."""
    for f in DEMO_TARGET.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, model_dir / f.name)


def first_token_ms(stub, prompt: list[int], max_new: int, salt: str = "") -> tuple[float, int]:
    """(ms to the first message carrying a token, the stream's cached_prompt_tokens)."""
    request = pb.GenerateRequest(
        prompt_token_ids=pb.PromptTokenIds(ids=prompt), max_new_tokens=max_new, temperature=0.0, cache_salt=salt
    )
    start, ttft, cached = time.perf_counter(), None, -1
    for r in stub.Generate(request, timeout=300):
        if ttft is None and r.token_ids:
            ttft = (time.perf_counter() - start) * 1e3
        if r.finish_reason:
            cached = r.stats.cached_prompt_tokens
    assert ttft is not None, "the stream carried no token"
    return ttft, cached


def rounds(stub, args: argparse.Namespace) -> list[dict]:
    """Each round: prime a fresh prefix, then its warm and a cold request in turn."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 4096) for _ in range(n)]

    out = []
    for r in range(args.pairs + 1):  # round 0 warms the stack up and is left out
        prefix = tokens(args.prefix)
        first_token_ms(stub, prefix + tokens(args.suffix), args.max_new)  # primes the prefix
        timed = {}
        for kind in alternating(["warm", "cold"], r):
            prompt = (prefix if kind == "warm" else tokens(args.prefix)) + tokens(args.suffix)
            timed[kind] = first_token_ms(stub, prompt, args.max_new)
        row = {"round": r, **{f"{k}_ms": round(v[0], 2) for k, v in timed.items()}}
        row |= {f"{k}_cached": v[1] for k, v in timed.items()}
        print(row, flush=True)
        if r:
            out.append(row)
    return out


def summary(rows: list[dict]) -> dict:
    warm, cold = [r["warm_ms"] for r in rows], [r["cold_ms"] for r in rows]
    ratio = statistics.median(warm) / statistics.median(cold)
    cached = min(r["warm_cached"] for r in rows)
    return {
        "warm_ttft_ms_median": round(statistics.median(warm), 2),
        "cold_ttft_ms_median": round(statistics.median(cold), 2),
        "ratio_of_medians": round(ratio, 4),
        "paired_ratio": paired_ratio(warm, cold),
        "warm_cached_prompt_tokens_min": cached,
        "cold_cached_prompt_tokens_max": max(r["cold_cached"] for r in rows),
        "goal": {
            "ratio": GOAL_RATIO,
            "cached": GOAL_CACHED,
            "met": ratio <= GOAL_RATIO and cached >= GOAL_CACHED,
        },
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prefix_cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=7, help="timed rounds (one warm and one cold request each)")
    ap.add_argument("--prefix", type=int, default=1500, help="tokens of the shared prefix")
    ap.add_argument("--suffix", type=int, default=16, help="tokens after it, different in every request")
    ap.add_argument("--max-new", type=int, default=4, help="tokens generated per request")
    ap.add_argument("--drafter-layers", type=int, default=4)
    ap.add_argument("--kv-cache-memory", default="1GiB", help="each replica's KV budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "prefix_cache.json")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = build_pair(Path(tmp), args.drafter_layers)
        for d in (target, drafter):
            with_tokenizer(d)
        flags = ("--device", "cpu", "--kv-cache-memory", args.kv_cache_memory)
        # A cold 1,500-token prefill of 32 layers takes seconds on a shared
        # 2-core CPU, past the default hang detection's floor (8 s) when the
        # machine is busy: a slow answer here is not a hung replica.
        hang = ("--hang-floor", "120", "--hang-ceiling", "600")
        stack = Stack(str(target), str(drafter), flags, orchestrator_args=hang)
        try:
            rows = rounds(stack.stub, args)
        finally:
            stack.stop()
    return {
        "when": utc_now(),
        "machine": machine(),
        "target": {**TARGET_SHAPE, "checkpoint_dtype": "bfloat16", "served_dtype": "float32 (CPU default)"},
        "drafter_layers": args.drafter_layers,
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "max_new_tokens": args.max_new,
        "kv_block_tokens": 64,
        "rows": rows,
        **summary(rows),
    }


def report(result: dict, args: argparse.Namespace) -> None:
    print(
        f"\nTTFT, {result['prefix_tokens']}-token prefix served before vs a cold one "
        f"(median of {len(result['rows'])} pairs run alternately):"
    )
    print(f"  warm {result['warm_ttft_ms_median']} ms, cold {result['cold_ttft_ms_median']} ms")
    print(f"  ratio of medians {result['ratio_of_medians']} (paired: {result['paired_ratio']['geomean']})")
    print(f"  cached_prompt_tokens on the warm requests: >= {result['warm_cached_prompt_tokens_min']}")
    g = result["goal"]
    print(f"  goal ratio <= {g['ratio']} and cached >= {g['cached']}: {'MET' if g['met'] else 'NOT MET'}")
    print(f"\nwritten to {args.out}")


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
