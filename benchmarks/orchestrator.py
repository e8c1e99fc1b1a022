"""The orchestrator's own CPU per session-cycle: what one orchestrator process
can feed, whatever the pools hold.

    python -m benchmarks.orchestrator                          # off, ngram, draft_model K=3 at 1, 8, 32 streams
    python -m benchmarks.orchestrator --streams 8 32 64 --requests 96
    python -m benchmarks.orchestrator --quick                  # smoke run: 1 and 8 streams, 16 requests

A local stack of a tiny random pair (tests/tiny_models.py, Llama-shaped,
hidden size 64: the services' forwards cost little, so the orchestrator's
share shows; `--target/--drafter` run another pair, e.g. the demo pair).
The orchestrator's idle CPU rate (its threads with no request) is measured
first and reported beside the figures, since at a low cycle rate it is a
part of them. For each method and number of
concurrent streams, every stream runs greedy 64-token requests one after
another until `--requests` have finished in all; the orchestrator process's
CPU time (user + system, from /proc/PID/stat) over that window is divided by
the verify cycles the requests ran (GenerationStats.cycles, summed). That is
the cost the orchestrator pays per session per cycle: two messages, a
coroutine step, stats, detokenisation. Its inverse, session-cycles per CPU
second, is what one orchestrator core sustains. Also reported: the cycles
per wall second the stack reached (bounded by the services on 2 cores, not
by the orchestrator) and the orchestrator's CPU share of one core.

No ratio between systems is claimed here, so there are no alternating
rounds; `--rounds` repeats each setting and the table gives the median and
the range. Writes benchmarks/results/orchestrator.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specd.ops.local_stack import Stack

from .speedup import CACHE, RESULTS

METHODS = {
    "off": dict(speculative_method="off"),
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=4),
    "draft_model": dict(speculative_method="draft_model", num_speculative_tokens=3),
}
PROMPTS = [
    "def read_config(path):",
    "class Stack:\n    def __init__(self):",
    "import os\n\n\ndef walk(root):",
    "for i in range(10):",
]


def tiny_pair() -> tuple[str, str]:
    """A tiny random Llama pair (built once into benchmarks/.cache)."""
    from tests.tiny_models import build_pair

    root = CACHE / "orchestrator-tiny"
    target, drafter = root / "llama-target", root / "llama-drafter"
    if not (target / "config.json").exists() or not (drafter / "config.json").exists():
        return tuple(str(p) for p in build_pair(root, "llama"))  # type: ignore[return-value]
    return str(target), str(drafter)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(stack: Stack, fields: dict, streams: int, requests: int, tokens: int) -> dict:
    """`requests` greedy requests over `streams` concurrent streams; the
    orchestrator's CPU seconds, the cycles they ran, the wall time."""
    left = iter(range(requests))
    cycles: list[int] = []

    def stream(_: int) -> None:
        for n in left:  # shared: the streams take the next request as each finishes
            _, last = stack.generate(prompt=PROMPTS[n % len(PROMPTS)], max_new_tokens=tokens, **fields)
            cycles.append(last.stats.cycles)

    pid = stack.orchestrator.proc.pid
    cpu0, wall0 = cpu_seconds(pid), time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(stream, range(streams)))
    cpu, wall = cpu_seconds(pid) - cpu0, time.perf_counter() - wall0
    return {"cpu_s": cpu, "wall_s": wall, "cycles": sum(cycles), "requests": len(cycles)}


def summarise(runs: list[dict]) -> dict:
    per_cycle = [r["cpu_s"] * 1e3 / r["cycles"] for r in runs]
    return {
        "cpu_ms_per_session_cycle": statistics.median(per_cycle),
        "range": [min(per_cycle), max(per_cycle)],
        "session_cycles_per_cpu_s": 1e3 / statistics.median(per_cycle),
        "session_cycles_per_wall_s": statistics.median(r["cycles"] / r["wall_s"] for r in runs),
        "orchestrator_core_share": statistics.median(r["cpu_s"] / r["wall_s"] for r in runs),
        "runs": runs,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=64, help="requests per setting (all streams together)")
    ap.add_argument("--tokens", type=int, default=64, help="max_new_tokens per request")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--target", default="", help="target directory (default: a tiny random Llama pair)")
    ap.add_argument("--drafter", default="")
    ap.add_argument("--out", default=str(RESULTS / "orchestrator.json"))
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 and 8 streams, 16 requests each")
    args = ap.parse_args(argv)
    if args.quick:
        args.streams, args.requests, args.rounds = [1, 8], 16, 1
    if not args.target:
        args.target, args.drafter = tiny_pair()
    stack = Stack(args.target, args.drafter)
    rows = []
    try:
        pid = stack.orchestrator.proc.pid
        cpu0 = cpu_seconds(pid)
        time.sleep(5)
        idle = (cpu_seconds(pid) - cpu0) / 5
        print(f"orchestrator idle: {idle:.1%} of a core", flush=True)
        for method in args.methods:  # warm every path once: first calls pay one-off costs
            run(stack, METHODS[method], 2, 4, args.tokens)
        for method in args.methods:
            for n in args.streams:
                runs = [run(stack, METHODS[method], n, max(args.requests, n), args.tokens) for _ in range(args.rounds)]
                row = {"method": method, "streams": n, **summarise(runs)}
                rows.append(row)
                print(f"{method:12s} {n:3d} streams: {row['cpu_ms_per_session_cycle']:.3f} ms CPU per session-cycle, "
                      f"{row['session_cycles_per_wall_s']:.0f} session-cycles/s, "
                      f"orchestrator at {row['orchestrator_core_share']:.0%} of a core", flush=True)
    finally:
        stack.stop()
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "target": args.target, "drafter": args.drafter, "tokens": args.tokens,
            "requests": args.requests, "rounds": args.rounds, "orchestrator_idle_core_share": idle}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print("\n| method | streams | orchestrator CPU per session-cycle (ms) | session-cycles per CPU second | "
          "session-cycles per wall second | orchestrator's share of a core |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["range"]
        spread = f" ({lo:.3f}–{hi:.3f})" if args.rounds > 1 else ""
        print(f"| {r['method']} | {r['streams']} | {r['cpu_ms_per_session_cycle']:.3f}{spread} | "
              f"{r['session_cycles_per_cpu_s']:.0f} | {r['session_cycles_per_wall_s']:.0f} | "
              f"{r['orchestrator_core_share']:.0%} |")
    print(f"\norchestrator idle: {idle:.1%} of a core (included above)\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
