"""The draft heads trained here against each other and the distilled drafter,
on the demo target, through the real services, in alternating rounds.

    python -m benchmarks.heads                 # 5 rounds, 1 and 8 streams, chain K=4 and a 2,2,1,1 tree
    python -m benchmarks.heads --quick         # 2 rounds, 2 prompts, 24 tokens (smoke run)

Methods (each its own local stack: verifier, drafter, orchestrator, all
started before the first round and kept up):
* draft_model: the distilled draft model (models/demo/drafter);
* eagle: specd's own EAGLE head (models/demo/eagle, training/eagle.py);
* eagle3: an EAGLE-3 head in the published format (models/demo/eagle3, training/eagle3.py);
* medusa: Medusa heads in the Medusa authors' layout (models/demo/medusa, training/medusa.py);
* off: target-only decoding, on the draft_model stack (the reference output).

A round runs every (streams, shape) once for every method, the methods in a
rotated order (benchmarks/common.py: rotated), so that each runs first, last
and between over the rounds. At 1 stream the prompts run one after another;
at 8, one stream per prompt, all at once. Greedy, fp32, one torch thread per
service. Reported per cell: aggregate tokens/s, mean accepted length (tokens
committed per verify, bonus included), and each method's tokens/s over the
distilled drafter's and over off, as the geometric mean of the per-round
ratios with an interval. Every output is compared with off's (greedy: they
must be equal). Writes benchmarks/results/heads.json.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from specd.local_stack import Stack
from specd_core.runtime.models import load_tokenizer

from .common import (
    DEMO_DRAFTER,
    DEMO_TARGET,
    RESULTS,
    ROOT,
    all_at_once,
    fmt_ratio,
    heldout_prompts,
    machine,
    paired_ratio,
    rotated,
    run_main,
    utc_now,
    write_json,
)

HEADS = {
    "draft_model": (DEMO_DRAFTER, ()),
    "eagle": (ROOT / "models/demo/eagle", ("--method", "eagle")),
    "eagle3": (ROOT / "models/demo/eagle3", ("--method", "eagle3")),
    "medusa": (ROOT / "models/demo/medusa", ("--method", "medusa")),
}
METHODS = ("off", *HEADS)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per cell (at 8 streams: one per stream)")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="the chain's length")
    ap.add_argument("--tree", default="2,2,1,1", help="the static tree's branching per level")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "heads.json")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.prompts, a.max_new_tokens, a.streams = 2, 2, 24, [1, 2]
    return a


def shapes(a: argparse.Namespace) -> dict[str, dict]:
    return {
        f"chain-{a.k}": {"num_speculative_tokens": a.k},
        f"tree-{a.tree}": {"tree": {"branching": [int(x) for x in a.tree.split(",")]}},
    }


def one_cell(stack: Stack, method: str, prompts: list[list[int]], streams: int, fields: dict, max_new: int) -> dict:
    """Every prompt once (`streams` at a time): tokens/s over the cell's wall
    time, accepted length, and the outputs."""
    if method == "off":
        fields = {"num_speculative_tokens": 0}

    def job(i: int):
        ids, last = stack.generate(
            prompt_token_ids={"ids": prompts[i]}, max_new_tokens=max_new, temperature=0.0, **fields
        )
        assert last is not None
        if method != "off":
            assert last.stats.method == method, f"{method} stack reports {last.stats.method!r}"
        return ids, last.stats

    outs: list = []
    seconds = 0.0
    for start in range(0, len(prompts), streams):
        group = prompts[start : start + streams]
        got, wall = all_at_once(functools.partial(_offset, job, start), len(group))
        outs += got
        seconds += wall
    tokens = sum(len(ids) for ids, _ in outs)
    cycles = sum(s.cycles for _, s in outs)
    committed = sum(round(s.mean_accepted_length * s.cycles) for _, s in outs)
    return {
        "tokens_per_s": tokens / seconds,
        "mean_accepted_length": committed / cycles if cycles else 0.0,
        "drafted": sum(s.drafted_tokens for _, s in outs),
        "accepted": sum(s.accepted_tokens for _, s in outs),
        "outputs": [ids for ids, _ in outs],
    }


def _offset(job, start: int, i: int):
    return job(start + i)


def start_stacks(a: argparse.Namespace) -> dict[str, Stack]:
    args = ("--torch-threads", str(a.threads), "--dtype", "float32")
    stacks: dict[str, Stack] = {}
    try:
        for method, (drafter, extra) in HEADS.items():
            if not (drafter / "config.json").is_file():
                raise SystemExit(f"benchmarks.heads: {drafter} is missing (training/run_all.sh builds it)")
            stacks[method] = Stack(str(DEMO_TARGET), str(drafter), args, orchestrator_args=extra)
    except BaseException:
        for s in stacks.values():
            s.stop()
        raise
    return stacks


def run(a: argparse.Namespace) -> dict:
    prompts = heldout_prompts(load_tokenizer(str(DEMO_TARGET)), a.prompts, a.prompt_tokens, a.max_new_tokens)
    cells = [(n, shape) for n in a.streams for shape in shapes(a)]
    rounds: dict[str, dict[str, list[dict]]] = {f"{n}x{s}": {m: [] for m in METHODS} for n, s in cells}
    stacks = start_stacks(a)
    stacks["off"] = stacks["draft_model"]
    doc: dict = {}
    try:
        for m in HEADS:  # warm-up: each stack's first request pays its lazy starts
            stacks[m].generate(prompt_token_ids={"ids": prompts[0]}, max_new_tokens=8, num_speculative_tokens=2)
        for r in range(a.rounds):
            for n, shape in cells:
                for m in rotated(METHODS, r):
                    got = one_cell(stacks[m], m, prompts, n, shapes(a)[shape], a.max_new_tokens)
                    rounds[f"{n}x{shape}"][m].append(got)
                    print(
                        f"round {r + 1} {n:2d} streams {shape:12s} {m:11s} {got['tokens_per_s']:7.1f} tok/s "
                        f"accepted length {got['mean_accepted_length']:.2f}",
                        flush=True,
                    )
            doc = summarise(a, rounds)
            write_json(a.out, doc)  # what was measured survives a later failure
    finally:
        for m in HEADS:
            stacks[m].stop()
    return doc


def summarise(a: argparse.Namespace, rounds: dict[str, dict[str, list[dict]]]) -> dict:
    cells = {}
    for cell, by_method in rounds.items():
        tps = {m: [x["tokens_per_s"] for x in runs] for m, runs in by_method.items()}
        ref = [x["outputs"] for x in by_method["off"]]
        out = {}
        for m, runs in by_method.items():
            differ = sum(o != w for x, want in zip(runs, ref) for o, w in zip(x["outputs"], want))
            out[m] = {
                "rounds_tokens_per_s": [round(t, 2) for t in tps[m]],
                "mean_accepted_length": round(sum(x["mean_accepted_length"] for x in runs) / len(runs), 3)
                if runs
                else None,
                "drafted": sum(x["drafted"] for x in runs),
                "accepted": sum(x["accepted"] for x in runs),
                "outputs_differing_from_off": differ,
                "vs_draft_model": paired_ratio(tps[m], tps["draft_model"]),
                "vs_off": paired_ratio(tps[m], tps["off"]),
            }
        cells[cell] = out
    return {
        "meta": {
            "when": utc_now(),
            "machine": machine(),
            "rounds": a.rounds,
            "prompts": a.prompts,
            "prompt_tokens": a.prompt_tokens,
            "max_new_tokens": a.max_new_tokens,
            "greedy": True,
            "dtype": "float32",
            "torch_threads_per_service": a.threads,
            "heads": {m: str(d.relative_to(ROOT)) for m, (d, _) in HEADS.items()},
        },
        "cells": cells,
    }


def report(doc: dict, a: argparse.Namespace) -> None:
    print(
        f"\n{'cell':20s} {'method':11s} {'tok/s (median)':>14s} {'acc. length':>11s}  "
        f"{'vs draft_model':>22s}  {'vs off':>22s}  differ"
    )
    for cell, by_method in doc["cells"].items():
        for m, r in by_method.items():
            med = sorted(r["rounds_tokens_per_s"])[len(r["rounds_tokens_per_s"]) // 2]
            acc = "" if m == "off" else f"{r['mean_accepted_length']:.2f}"
            print(
                f"{cell:20s} {m:11s} {med:14.1f} {acc:>11s}  {fmt_ratio(r['vs_draft_model']):>22s}  "
                f"{fmt_ratio(r['vs_off']):>22s}  {r['outputs_differing_from_off']}"
            )
    print(f"-> {a.out}")


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
