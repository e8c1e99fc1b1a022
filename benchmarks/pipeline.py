"""Pipelined drafting at batch 1: how much of the draft time the verify hides,
measured from the per-cycle traces.

    python -m benchmarks.pipeline            # demo pair, cost-scaled target, bf16
    python -m benchmarks.pipeline --quick

One stream at a time, greedy, held-out prompts; chains of K = 1..4 with
pipelining off and on, on with each number of pre-drafted alternatives per
depth (--alternatives; 0 = the all-kept branch only). The services export their traces to a real OTLP
receiver in this process, which keeps the `specdec.cycle` spans' attributes.
Per run, from those spans: the draft time a cycle waited for (`draft.wait_ms`),
the Propose calls' own time (`draft.call_ms`), and the cycles whose draft was
made ahead and used. The headline, "draft time hidden", compares the two runs:
1 - (mean wait per drafted cycle, pipelining on) / (mean draft call per drafted
cycle, pipelining off). (The on-run's own 1 - sum(wait) / sum(call) reads higher,
because a pre-draft's call is slowed by running beside the verify.) Also
tokens/s. Writes benchmarks/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from specd.local_stack import Stack
from specd_core.runtime.models import load_tokenizer

from .common import RESULTS, add_pair_args, cost_scaled_target, heldout_prompts, machine, run_main, utc_now
from .otlp import OtlpSink


def from_traces(spans: list[dict]) -> dict:
    """A run's figures from its cycle spans' attributes."""
    drafted = [s for s in spans if s.get("specdec.draft.nodes", 0) > 0]
    call = sum(s["specdec.draft.call_ms"] for s in drafted)
    wait = sum(s["specdec.draft.wait_ms"] for s in drafted)
    return {
        "cycles": len(spans),
        "drafted_cycles": len(drafted),
        "pipelined_cycles": sum(bool(s["specdec.draft.pipelined"]) for s in drafted),
        "alternative_cycles": sum(
            bool(s["specdec.draft.pipelined"]) and s.get("specdec.draft.branch", 0) > 0 for s in drafted
        ),
        "draft_call_ms": round(call, 1),
        "draft_wait_ms": round(wait, 1),
        "hidden_in_run": round(1 - wait / call, 3) if call else 0.0,
        "draft_wait_ms_per_cycle": round(wait / max(1, len(drafted)), 2),
        "verify_ms_per_cycle": round(sum(s["specdec.verify_ms"] for s in spans) / len(spans), 2),
        "draft_call_ms_per_cycle": round(call / max(1, len(drafted)), 2),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(ap)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--alternatives", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "pipeline.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.ks, args.prompts, args.max_new_tokens = [2], 3, 32
    return args


def measure(stack: Stack, sink: OtlpSink, prompts, k: int, alts: int | None, max_new: int) -> tuple[dict, list]:
    """Every prompt once at chain K, pipelining off (alts None) or on with
    `alts` alternatives; the run's row (its traces' figures) and outputs."""
    pipeline = alts is not None
    tokens, cycles, seconds, outs = 0, 0, 0.0, []
    for p in prompts:
        start = time.perf_counter()
        ids, last = stack.generate(
            prompt_token_ids={"ids": p},
            max_new_tokens=max_new,
            num_speculative_tokens=k,
            adaptive_speculation=False,
            pipeline_drafting=pipeline,
            pipeline_alternatives=alts or 0,
        )
        seconds += time.perf_counter() - start
        assert last is not None
        tokens, cycles = tokens + len(ids), cycles + last.stats.cycles
        outs.append(ids)
    row = dict(
        k=k,
        pipeline=pipeline,
        alternatives=alts,
        tokens=tokens,
        seconds=round(seconds, 3),
        stats_cycles=cycles,
        tokens_per_s=round(tokens / seconds, 2),
        **from_traces(sink.take(cycles)),
    )
    return row, outs


def measure_k(stack: Stack, sink: OtlpSink, prompts, k: int, args: argparse.Namespace) -> list[dict]:
    """Chain K with pipelining off, then on with each number of alternatives,
    each compared with off."""
    off, off_outputs = measure(stack, sink, prompts, k, None, args.max_new_tokens)
    print_row(off)
    rows = [off]
    for alts in args.alternatives:
        row, outs = measure(stack, sink, prompts, k, alts, args.max_new_tokens)
        row["hidden"] = round(1 - row["draft_wait_ms_per_cycle"] / off["draft_call_ms_per_cycle"], 3)
        row["speedup_vs_off"] = round(row["tokens_per_s"] / off["tokens_per_s"], 3)
        # Exactness: greedy output must not depend on pipelining.
        same = sum(a == b for a, b in zip(off_outputs, outs))
        row["outputs_equal_to_pipeline_off"] = f"{same}/{len(prompts)}"
        print_row(row)
        rows.append(row)
    return rows


def print_row(row: dict) -> None:
    mode = f"on, {row['alternatives']} alt" if row["pipeline"] else "off"
    print(
        f"K={row['k']} pipeline {mode}: {row['tokens_per_s']:6.1f} tok/s, "
        f"draft wait {row['draft_wait_ms_per_cycle']} of call {row['draft_call_ms_per_cycle']} ms/cycle "
        f"({row['pipelined_cycles']}/{row['drafted_cycles']} cycles pipelined, "
        f"{row['alternative_cycles']} on a rejection branch), "
        f"verify {row['verify_ms_per_cycle']} ms/cycle",
        flush=True,
    )


def run(args: argparse.Namespace) -> dict:
    target = cost_scaled_target(args.target, args.min_params)
    tok = load_tokenizer(str(args.target))
    prompts = heldout_prompts(tok, args.prompts, args.prompt_tokens, args.max_new_tokens)
    sink = OtlpSink(keep="specdec.cycle")
    # Export every 200 ms: each run's spans arrive soon after it.
    env = {**sink.endpoint_env, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    stack = Stack(str(target), str(args.drafter), ("--dtype", args.dtype), env=env)
    rows = []
    try:
        _, warm = stack.generate(prompt_token_ids={"ids": prompts[0]}, max_new_tokens=8, num_speculative_tokens=2)
        assert warm is not None
        sink.take(warm.stats.cycles)
        for k in args.ks:
            rows += measure_k(stack, sink, prompts, k, args)
    finally:
        stack.stop()
        sink.stop()
    meta = {
        "machine": machine(),
        "target": str(target),
        "drafter": str(args.drafter),
        "dtype": args.dtype,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "date": utc_now(),
    }
    return {"meta": meta, "rows": rows}


def report(result: dict, args: argparse.Namespace) -> None:
    rows = result["rows"]
    print(
        "\n| K | pipeline (alternatives) | tok/s | vs off | cycles with a used pre-draft (of them, a rejection "
        "branch) | draft wait / call ms per cycle | draft time hidden (in-run) | verify ms/cycle | output = off |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mode = f"on ({r['alternatives']})" if r["pipeline"] else "off"
        print(
            f"| {r['k']} | {mode} | {r['tokens_per_s']} "
            f"| {r.get('speedup_vs_off', '')} | {r['pipelined_cycles']}/{r['drafted_cycles']} "
            f"({r['alternative_cycles']}) | {r['draft_wait_ms_per_cycle']} / {r['draft_call_ms_per_cycle']} "
            f"| {r.get('hidden', '')} ({r['hidden_in_run']}) | {r['verify_ms_per_cycle']} "
            f"| {r.get('outputs_equal_to_pipeline_off', '')} |"
        )
    print(f"\nwrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
