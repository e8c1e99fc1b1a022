"""The orchestrator's own CPU per session-cycle, and every other process's:
what one orchestrator process can feed, and the figures the capacity model
(benchmarks/simulate.py, docs/capacity.md) is fitted from.

    python -m benchmarks.orchestrator                          # off, ngram, draft_model K=3 at 1, 8, 32, 64 streams
    python -m benchmarks.orchestrator --orchestrators 1 2      # stacks of one and of two orchestrators, in turns
    python -m benchmarks.orchestrator --quick                  # smoke run: 1 and 8 streams, 16 requests

A local stack of a tiny random pair (tests/tiny_models.py, Llama-shaped,
hidden size 64: the services' forwards cost little, so the orchestrator's
share shows; `--target/--drafter` run another pair, e.g. the demo pair),
with its Prometheus metrics on. Each process's idle CPU rate (its threads
with no request) is measured first and reported beside the figures, since
at a low cycle rate it is a part of them. For each method and number of
concurrent streams, every stream (one connection each, as clients have; with
several orchestrators behind one port the kernel spreads the connections)
runs greedy 64-token requests one after another until `--requests` have
finished in all. Over that window:

- the CPU time (user + system, /proc/PID/stat) of every process: each
  orchestrator, verifier and drafter, and this one (the load generator,
  time.process_time), each divided by the verify cycles the requests ran
  (GenerationStats.cycles, summed): its cost per session-cycle. The
  orchestrators' together, inverted, is session-cycles per CPU second: what
  one orchestrator core sustains;
- the services' steps (verify forwards, draft batches: their
  `specdec:*_batch_size` histograms' counts), so that a step's fixed cost and
  a session's cost can be told apart (benchmarks/capacity_fit.py);
- session-cycles per wall second (bounded by the services on 2 cores, not by
  the orchestrator) and each process's share of a core;
- the cores the machine's other processes kept busy meanwhile (/proc/stat
  less the stack's and this process's CPU): on a shared machine, what the
  stack did not have;
- with several orchestrators, how many streams each one held (one 1-token
  request per connection first, seen in their request counters) and the
  cycles each ran.

The services run with one torch thread (`--torch-threads`): each process is
then one core's worth of work at most, as the model has it, and no thread
spins waiting for another on a machine this small.

No ratio between systems is claimed here; `--rounds` repeats each setting
and the table gives the median and the range. With several `--orchestrators`
the stacks are all up at once and take turns in every round (the order
rotating), because the capacity model is fitted on one stack's rows and
checked on another's, and this machine's speed drifts within minutes.
Writes benchmarks/results/orchestrator.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from verifier_svc.config import VerifierConfig

from .common import CACHE, RESULTS, rotated, run_main
from .stack_probe import KINDS, StackProbe, cpu_seconds

METHODS: dict[str, dict] = {
    "off": {"speculative_method": "off"},
    "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 4},
    "draft_model": {"speculative_method": "draft_model", "num_speculative_tokens": 3},
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


def start_stack(target: str, drafter: str, orchestrators: int, torch_threads: int) -> Stack:
    service_args = ("--torch-threads", str(torch_threads)) if torch_threads else ()
    return Stack(target, drafter, service_args=service_args, metrics=True, orchestrators=orchestrators)


def generate(stub, fields: dict, n: int, tokens: int) -> pb.GenerateResponse:
    """One greedy request (the n-th prompt); its last response."""
    last = None
    request = pb.GenerateRequest(prompt=PROMPTS[n % len(PROMPTS)], max_new_tokens=tokens, **fields)
    for response in stub.Generate(request, timeout=120):
        last = response
    assert last is not None, "a Generate stream ended without a response"
    return last


def assign(stubs: list, probe: StackProbe) -> list[int]:
    """Which orchestrator each connection reached: one 1-token request each,
    seen in the orchestrators' request counters (one request at a time)."""
    where = []
    for stub in stubs:
        before = probe.requests()
        generate(stub, METHODS["off"], 0, 1)
        moved = [i for i, (a, b) in enumerate(zip(before, probe.requests())) if b > a]
        where.append(moved[0] if len(moved) == 1 else -1)
    return where


def run_requests(stubs: list, probe: StackProbe, fields: dict, requests: int, tokens: int) -> dict:
    """`requests` greedy requests over the streams (one connection each);
    every process's CPU seconds, the services' steps, the cycles, the wall time."""
    left = iter(range(requests))
    done: list[pb.GenerateResponse] = []

    def stream(stub) -> None:
        for n in left:  # shared: the streams take the next request as each finishes
            done.append(generate(stub, fields, n, tokens))

    before = probe.snapshot()
    with ThreadPoolExecutor(len(stubs)) as pool:
        list(pool.map(stream, stubs))
    window = probe.delta(before, probe.snapshot(end=True))
    cycles = sum(r.stats.cycles for r in done)
    return {
        "cpu_s": sum(window["cpu"]["orchestrator"]),  # every orchestrator's together
        "wall_s": window.pop("wall_s"),
        "cycles": cycles,
        "requests": len(done),
        "tokens": sum(r.stats.completion_tokens for r in done),
        **window,
    }


def per_cycle_ms(runs: list[dict], kind: str) -> float:
    return statistics.median(sum(_list(r["cpu"][kind])) * 1e3 / r["cycles"] for r in runs)


def _list(v) -> list[float]:
    return v if isinstance(v, list) else [v]


def summarise(runs: list[dict]) -> dict:
    per_cycle = [r["cpu_s"] * 1e3 / r["cycles"] for r in runs]
    verify_steps = [sum(r["steps"]["verifier"]) for r in runs]
    draft_steps = [sum(r["steps"]["drafter"]) for r in runs]
    return {
        "cpu_ms_per_session_cycle": statistics.median(per_cycle),  # the orchestrators' together
        "range": [min(per_cycle), max(per_cycle)],
        "session_cycles_per_cpu_s": 1e3 / statistics.median(per_cycle),
        "session_cycles_per_wall_s": statistics.median(r["cycles"] / r["wall_s"] for r in runs),
        "orchestrator_core_share": statistics.median(r["cpu_s"] / r["wall_s"] for r in runs),
        "cpu_ms_per_session_cycle_by_process": {k: per_cycle_ms(runs, k) for k in (*KINDS, "client")},
        "core_share_by_process": {
            k: [statistics.median(_list(r["cpu"][k])[i] / r["wall_s"] for r in runs) for i in range(len(_list(v)))]
            for k, v in runs[0]["cpu"].items()
        },
        "others_cores": statistics.median(r["others_cores"] for r in runs),
        "mean_verify_batch": sum(r["cycles"] for r in runs) / max(1, sum(verify_steps)),
        "mean_draft_batch": sum(r["cycles"] for r in runs) / max(1, sum(draft_steps)) if any(draft_steps) else None,
        "runs": runs,
    }


def idle_shares(probe: StackProbe, seconds: float = 5.0) -> dict[str, list[float]]:
    """Each process's CPU share of a core with no request."""
    pids = {k: [p.proc.pid for p in procs] for k, procs in probe.procs.items()}
    before = {k: [cpu_seconds(p) for p in ps] for k, ps in pids.items()}
    time.sleep(seconds)
    return {k: [(cpu_seconds(p) - c) / seconds for p, c in zip(ps, before[k])] for k, ps in pids.items()}


@dataclass
class Driven:
    """One stack under test: its probe and one connection per stream."""

    orchestrators: int
    stack: Stack
    probe: StackProbe
    channels: list
    stubs: list
    where: list[int]  # per connection, the orchestrator it reached
    idle: dict[str, list[float]]


def drive(args, orchestrators: int) -> Driven:
    stack = start_stack(args.target, args.drafter, orchestrators, args.torch_threads)
    probe = StackProbe(stack)
    # A connection each (channels to one address share one by default).
    channels = [stack.connect() for _ in range(max(args.streams))]
    stubs = [pb_grpc.OrchestratorServiceStub(c) for c in channels]
    where = assign(stubs, probe) if orchestrators > 1 else [0] * len(stubs)
    for method in args.methods:  # warm every path once: first calls pay one-off costs
        run_requests(stubs[:2], probe, METHODS[method], 4, args.tokens)
    return Driven(orchestrators, stack, probe, channels, stubs, where, {})


def row_of(d: Driven, method: str, n: int, runs: list[dict]) -> dict:
    split = [d.where[:n].count(i) for i in range(d.orchestrators)]
    row = {
        "method": method,
        "streams": n,
        "orchestrators": d.orchestrators,
        "streams_per_orchestrator": split,
        **summarise(runs),
    }
    by = row["cpu_ms_per_session_cycle_by_process"]
    print(
        f"{d.orchestrators} orch. {method:12s} {n:3d} streams: {row['session_cycles_per_wall_s']:.0f} "
        "session-cycles/s; CPU ms per session-cycle: "
        + ", ".join(f"{k} {v:.3f}" for k, v in by.items())
        + f"; mean verify batch {row['mean_verify_batch']:.1f}; streams per orchestrator {split}; "
        f"other processes kept {row['others_cores']:.2f} cores busy",
        flush=True,
    )
    return row


def measure(args) -> tuple[list[dict], dict]:
    """Every method × stream count on a stack of each number of orchestrators.
    The stacks are up together and take turns, round by round, in an order
    that rotates: this machine's speed drifts by 10-40 % within minutes, and
    the model is fitted on one stack's rows to predict the others'."""
    driven: list[Driven] = []
    try:
        for n in args.orchestrators:
            driven.append(drive(args, n))
        for d in driven:  # with every stack up: each one's idle cost beside the others
            d.idle = idle_shares(d.probe)
            print(
                f"{d.orchestrators} orchestrator(s); idle: " + ", ".join(f"{k} {max(v):.1%}" for k, v in d.idle.items())
            )
        rows = []
        turn = 0
        for method in args.methods:
            for n in args.streams:
                runs: dict[int, list[dict]] = {d.orchestrators: [] for d in driven}
                for _ in range(args.rounds):
                    for d in rotated(driven, turn):
                        runs[d.orchestrators].append(
                            run_requests(d.stubs[:n], d.probe, METHODS[method], max(args.requests, n), args.tokens)
                        )
                    turn += 1
                rows += [row_of(d, method, n, runs[d.orchestrators]) for d in driven]
    finally:
        for d in driven:
            for c in d.channels:
                c.close()
            d.stack.stop()
    return rows, {d.orchestrators: d.idle for d in driven}


def print_table(rows: list[dict], rounds: int) -> None:
    print(
        "\n| orchestrators | method | streams | orchestrator CPU per session-cycle (ms) | session-cycles per CPU "
        "second | session-cycles per wall second | orchestrators' share of a core (each) | "
        "verifier / drafter / client CPU per session-cycle (ms) | mean verify batch |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["range"]
        spread = f" ({lo:.3f}–{hi:.3f})" if rounds > 1 else ""
        shares = " + ".join(f"{s:.0%}" for s in r["core_share_by_process"]["orchestrator"])
        by = r["cpu_ms_per_session_cycle_by_process"]
        print(
            f"| {r['orchestrators']} | {r['method']} | {r['streams']} | {r['cpu_ms_per_session_cycle']:.3f}{spread} | "
            f"{r['session_cycles_per_cpu_s']:.0f} | {r['session_cycles_per_wall_s']:.0f} | {shares} | "
            f"{by['verifier']:.3f} / {by['drafter']:.3f} / {by['client']:.3f} | {r['mean_verify_batch']:.1f} |"
        )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument(
        "--orchestrators",
        nargs="+",
        type=int,
        default=[1],
        help="run the sweep on a stack of each many orchestrators (one port each), the stacks taking turns",
    )
    ap.add_argument("--requests", type=int, default=64, help="requests per setting (all streams together)")
    ap.add_argument("--tokens", type=int, default=64, help="max_new_tokens per request")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--torch-threads", type=int, default=1, help="torch threads per service (0: torch's default)")
    ap.add_argument("--target", default="", help="target directory (default: a tiny random Llama pair)")
    ap.add_argument("--drafter", default="")
    ap.add_argument("--out", default=str(RESULTS / "orchestrator.json"))
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 and 8 streams, 16 requests each")
    args = ap.parse_args(argv)
    if args.quick:
        args.streams, args.requests, args.rounds = [1, 8], 16, 1
    if not args.target:
        args.target, args.drafter = tiny_pair()
    if len(set(args.orchestrators)) != len(args.orchestrators):
        ap.error("--orchestrators: each number once")
    return args


def run(args: argparse.Namespace) -> dict:
    rows, idle = measure(args)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "target": args.target,
        "drafter": args.drafter,
        "tokens": args.tokens,
        "requests": args.requests,
        "rounds": args.rounds,
        "torch_threads": args.torch_threads,
        # The services' batching as they ran (their defaults): the model's max_batch and gather window.
        "max_batch_sessions": VerifierConfig.max_batch_sessions,
        "batch_wait_fraction": VerifierConfig.batch_wait_fraction,
        "orchestrator_idle_core_share": max(max(i["orchestrator"]) for i in idle.values()),
        "idle_core_share": {str(n): i for n, i in idle.items()},
    }
    return {"meta": meta, "rows": rows}


def report(result: dict, args: argparse.Namespace) -> None:
    print_table(result["rows"], args.rounds)
    idle = result["meta"]["orchestrator_idle_core_share"]
    print(f"\norchestrator idle: {idle:.1%} of a core (included above)\nwrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
