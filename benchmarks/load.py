"""Throughput under load: 1 ... 32 concurrent Generate streams through the same
services, for speculation off, fixed K and adaptive depth; and the same fixed K
with batching off (one session per verify forward) to show what batching buys.

    python -m benchmarks.load                # demo pair, cost-scaled target, bf16 (~45 min)
    python -m benchmarks.load --quick        # 1, 4 streams, fewer tokens

Per setting and concurrency (n streams in flight all along, each worker
starting a new stream when its last one ends; measured over --seconds, in
rounds that alternate the settings' order, each after a warm-up): total
tokens/s, time to first token (p50), inter-token latency (p50, p99; a message
of n tokens counts as n gaps of its wait / n) and the mean draft depth. Only
ratios within one run are results, each with an interval from its rounds.
Writes benchmarks/results/load.json and load.png and prints a table.

Prompts of 96 tokens, 128 new tokens by default. Every stream's prefill joins
a verify forward, and batching cannot shrink a prefill (it is already a forward
of many rows), so the shorter the outputs, the smaller the batching gain: at 16
streams it measured 2.78x with 64 new tokens and 3.07x with 128 (same run).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import grpc

from specd import bench
from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.runtime.models import load_tokenizer

from .common import (
    RESULTS,
    add_pair_args,
    alternating,
    cost_scaled_target,
    heldout_prompts,
    machine,
    pct,
    pyplot,
    ratio_interval,
    run_main,
    utc_now,
)

SETTINGS = {  # GenerateRequest fields per setting
    "off": {"num_speculative_tokens": 0},
    "fixed K=2": {"num_speculative_tokens": 2},
    "fixed K=4": {"num_speculative_tokens": 4},
    "adaptive (K<=4)": {"num_speculative_tokens": 4, "adaptive_speculation": True},
}
UNBATCHED = "fixed K=4, unbatched"


def run_level(
    address: str, prompts, fields: dict, n: int, max_new: int, seconds: float = 20.0, warmup_s: float = 3.0
) -> dict:
    """n streams in flight all along: n workers each run streams back to back
    (prompts round-robin) for warmup_s + seconds; then the streams still
    running are cancelled. Only the measured `seconds` after the warm-up count:
    tokens/s is the tokens that arrived in it / seconds, so the start-up burst
    (n prefills at once) and the end (streams finishing one by one, the level
    draining to fewer streams) are not what is measured. Time to first token:
    the streams that started in the window; inter-token latency: the gaps in
    it (a message of k tokens counts as k gaps of its wait / k). The loop and
    the latency figures are `specd bench`'s (specd/bench.py)."""
    requests = [
        pb.GenerateRequest(prompt_token_ids=pb.PromptTokenIds(ids=p), max_new_tokens=max_new, **fields) for p in prompts
    ]
    channels = [grpc.insecure_channel(address) for _ in range(n)]  # one connection per worker, as clients have
    stubs = [pb_grpc.OrchestratorServiceStub(c) for c in channels]
    which = itertools.count()
    t0 = time.perf_counter()
    window = (t0 + warmup_s, t0 + warmup_s + seconds)
    try:
        records = bench.run_streams(
            lambda req: stubs[next(which) % n].Generate(req, timeout=1800), requests, n, until=window[1]
        )
    finally:
        for c in channels:
            c.close()
    ttft, itl = bench.latencies(records, window)
    tokens = bench.round_summary(records, window)["tokens"]
    done = [r.stats for r in records if r.stats and int(r.stats.get("cycles", 0))]
    drafted, cycles = (sum(int(s.get(k, 0)) for s in done) for k in ("drafted_tokens", "cycles"))
    return {
        "streams": n,
        "requests": len(records),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": round(tokens / seconds, 2),
        # None: no stream started in the window (streams longer than it)
        "ttft_ms_p50": round(1e3 * pct(ttft, 0.5), 1) if ttft else None,
        "itl_ms_p50": round(1e3 * pct(itl, 0.5), 2),
        "itl_ms_p99": round(1e3 * pct(itl, 0.99), 2),
        # What adaptive chose (fixed K: K, cut near max_new_tokens)
        "draft_depth": round(drafted / cycles, 2) if cycles else None,
    }


def merge_rounds(parts: list[dict]) -> dict:
    """One row from a level's rounds: tokens over the summed time; latencies
    as the mean of the rounds' (None where no round had one)."""

    def mean(key):
        vals = [p[key] for p in parts if p[key] is not None]
        return round(statistics.fmean(vals), 2) if vals else None

    tokens, seconds = sum(p["tokens"] for p in parts), sum(p["seconds"] for p in parts)
    return {
        "streams": parts[0]["streams"],
        "requests": sum(p["requests"] for p in parts),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": round(tokens / seconds, 2),
        "ttft_ms_p50": mean("ttft_ms_p50"),
        "itl_ms_p50": mean("itl_ms_p50"),
        "itl_ms_p99": mean("itl_ms_p99"),
        "draft_depth": mean("draft_depth"),
        "rounds_tokens_per_s": [p["tokens_per_s"] for p in parts],
    }


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for setting in dict.fromkeys(r["setting"] for r in rows):
        pts = [(r["streams"], r["tokens_per_s"], r["itl_ms_p50"]) for r in rows if r["setting"] == setting]
        xs = [p[0] for p in pts]
        style = "--" if "unbatched" in setting else "-"
        ax.plot(xs, [p[1] for p in pts], style, marker="o", label=setting)
        ax2.plot(xs, [p[2] for p in pts], style, marker="o", label=setting)
    for a, title, ylabel in (
        (ax, "total throughput", "tokens/s (all streams)"),
        (ax2, "inter-token latency p50", "ms"),
    ):
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrent streams")
        a.set_ylabel(ylabel)
        a.set_title(title)
        a.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle("specd under load (cost-scaled demo target, bf16, 2-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(ap)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--unbatched-levels",
        type=int,
        nargs="*",
        default=[1, 4, 16],
        help="levels run again with one session per verify forward",
    )
    ap.add_argument(
        "--seconds",
        type=float,
        default=80.0,
        help="measured time per setting and level, split over the rounds (each after --warmup-s)",
    )
    ap.add_argument("--rounds", type=int, default=8, help="rounds per level, settings in alternating order")
    ap.add_argument("--warmup-s", type=float, default=2.0, help="time per round before the measurement")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "load.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.levels, args.max_new_tokens, args.unbatched_levels, args.seconds, args.rounds = [1, 4], 24, [4], 5.0, 1
    return args


def measure_level(stacks: dict[str, Stack], prompts, n: int, args: argparse.Namespace) -> list[dict]:
    """Every setting at n streams (and K = 4 unbatched, if this level has it),
    in rounds of alternating order: a drift of the machine's speed during a
    level then weighs on every setting alike. One row per setting."""
    runs = [("batched", setting) for setting in SETTINGS]
    if n in args.unbatched_levels and "unbatched" in stacks:
        runs.append(("unbatched", "fixed K=4"))
    got: dict[tuple[str, str], list[dict]] = {run: [] for run in runs}
    for r in range(args.rounds):
        for kind, setting in alternating(runs, r):
            got[kind, setting].append(
                run_level(
                    stacks[kind].orchestrator.address,
                    prompts,
                    SETTINGS[setting],
                    n,
                    args.max_new_tokens,
                    args.seconds / args.rounds,
                    args.warmup_s,
                )
            )
    rows = []
    for (kind, setting), parts in got.items():
        row = merge_rounds(parts)
        row["setting"] = setting if kind == "batched" else UNBATCHED
        rows.append(row)
        ttft = "–" if row["ttft_ms_p50"] is None else f"{row['ttft_ms_p50']:.1f}"
        print(
            f"{row['setting']:>22} x{n:<3} {row['tokens_per_s']:7.1f} tok/s  ttft p50 {ttft:>7} ms  itl p50/p99 "
            f"{row['itl_ms_p50']}/{row['itl_ms_p99']} ms  depth {row['draft_depth']}  rounds "
            f"{[p['tokens_per_s'] for p in parts]}",
            flush=True,
        )
    return rows


def summarise(rows: list[dict], levels: list[int]) -> list[dict]:
    """Goals per level: adaptive vs the best of off / fixed K; the batching
    gain. Each ratio with an interval from the rounds' spread: the machine's
    speed drifts by 10-20 % within minutes, so one round's ratio says little."""
    summary = []
    for n in levels:
        at = {r["setting"]: r for r in rows if r["streams"] == n}
        best = max((s for s in at if s in ("off", "fixed K=2", "fixed K=4")), key=lambda s: at[s]["tokens_per_s"])
        d = {
            "streams": n,
            "best_fixed": best,
            "best_fixed_tokens_per_s": at[best]["tokens_per_s"],
            "adaptive_tokens_per_s": at["adaptive (K<=4)"]["tokens_per_s"],
            "adaptive_vs_best": round(at["adaptive (K<=4)"]["tokens_per_s"] / at[best]["tokens_per_s"], 3),
            "adaptive_vs_best_interval": ratio_interval(at["adaptive (K<=4)"], at[best]),
        }
        if UNBATCHED in at:
            d["batching_gain_fixed_K4"] = round(at["fixed K=4"]["tokens_per_s"] / at[UNBATCHED]["tokens_per_s"], 3)
            d["batching_gain_interval"] = ratio_interval(at["fixed K=4"], at[UNBATCHED])
        summary.append(d)
    return summary


def run(args: argparse.Namespace) -> dict:
    target = cost_scaled_target(args.target, args.min_params)
    tok = load_tokenizer(str(args.target))
    prompts = heldout_prompts(tok, 32, args.prompt_tokens, args.max_new_tokens)
    service_args = ("--dtype", args.dtype)
    rows = []
    # Both stacks up at once (an idle one costs no CPU), a level's settings run
    # one after another: the figures compared are minutes apart at most, not
    # the whole benchmark (this machine drifts by 10-20 % over that).
    stacks = {"batched": Stack(str(target), str(args.drafter), service_args)}
    if args.unbatched_levels:
        stacks["unbatched"] = Stack(
            str(target), str(args.drafter), service_args, verifier_args=("--max-batch-sessions", "1")
        )
    try:
        for stack in stacks.values():
            run_level(stack.orchestrator.address, prompts, SETTINGS["fixed K=2"], 2, 8, 2.0, 0.0)  # warm-up
        for n in args.levels:
            rows += measure_level(stacks, prompts, n, args)
    finally:
        for stack in stacks.values():
            stack.stop()
    meta = {
        "machine": machine(),
        "target": str(target),
        "drafter": str(args.drafter),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "prompt_tokens": args.prompt_tokens,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "warmup_s": args.warmup_s,
        "date": utc_now(),
    }
    return {"meta": meta, "rows": rows, "summary": summarise(rows, args.levels)}


def report(result: dict, args: argparse.Namespace) -> None:
    out = args.out
    plot(result["rows"], out.with_suffix(".png"))

    def span(d, key):
        return f" ({d[key][0]:.2f}-{d[key][1]:.2f})" if d.get(key) else ""

    print(
        "\n| streams | best of off / fixed | its tok/s | adaptive tok/s | adaptive / best (interval) "
        "| batching gain, K=4 (interval) |"
    )
    print("|---|---|---|---|---|---|")
    for d in result["summary"]:
        gain = (
            f"{d['batching_gain_fixed_K4']}{span(d, 'batching_gain_interval')}" if "batching_gain_fixed_K4" in d else ""
        )
        print(
            f"| {d['streams']} | {d['best_fixed']} | {d['best_fixed_tokens_per_s']} | {d['adaptive_tokens_per_s']} "
            f"| {d['adaptive_vs_best']}{span(d, 'adaptive_vs_best_interval')} | {gain} |"
        )
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
