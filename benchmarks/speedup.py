"""Batch-1 speedup: specd against speculation off, against Hugging Face
assisted generation with the same pair, and against theory, in alternating
rounds; and what tracing every request costs, at 1 and 8 streams.

    python -m benchmarks.speedup                 # demo pair, cost-scaled target (see benchmarks/README.md)
    python -m benchmarks.speedup --quick         # 3 prompts, 32 tokens, 2 rounds (smoke run; no intervals)

A ratio between systems is a result only when they ran side by side: every
round runs each compared system once on the same prompts (specd with
speculation off and each chain setting through the services, HF assisted
generation and HF target-only decoding in this process), in an order rotated
each round, greedy and at T = 0.8 (seeds fixed per prompt). Each ratio is the
geometric mean of its per-round ratios with a rough 95 % interval
(benchmarks/common.py). The best setting per mode is picked by its point ratio
over off, and its interval's lower bound is checked against --goal-vs-off and
--goal-vs-hf. Tracing (benchmarks/traced.py): a second stack traces every
request to a real OTLP receiver, alternated with the untraced one.

The target is the trained demo target padded to >= 100 M parameters by
function-preserving layers (training/pad_target.py): its logits, hence
acceptance, are those of the trained pair, its cost that of a mid-size model.
Prompts are held-out stdlib files (training/corpus.py split).

Extras, off by default, measure accepted length, not ratios between systems, so
they run once each: --trees (trees vs chains at equal verified tokens, fp32)
and --code-edit (ngram on code-edit prompts).
Writes benchmarks/results/speedup.json (--out) and its .png, prints the tables
(benchmarks/speedup_summary.py makes them from the rounds).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specd.local_stack import Stack
from specd_core.runtime.models import load_model, load_tokenizer

from .common import RESULTS, add_pair_args, cost_scaled_target, heldout_prompts, machine, rotated, utc_now, write_json
from .otlp import UNTRACED_ENV, OtlpSink
from .speedup_summary import (
    CODE_EDIT_MODE,
    HF_ASSISTED,
    HF_TARGET,
    TREE_MODE,
    TREES_FILE,
    Draft,
    Row,
    comparison_table,
    figures,
    goal_lines,
    method,
    plot,
    plot_trees,
    summarise_mode,
    tree_vs_chain,
)
from .traced import TRACED, UNTRACED, tracing_cost, tracing_table
from .tree_search import load_searched

DEFAULT_DRAFTS = ["off", "2", "3", "4", "6"]
# Trees vs chains at equal verified draft tokens per cycle (6, 10, 12, 16), run
# in fp32: in bf16 a 1 M-parameter drafter loses acceptance to rounding, which
# would measure bf16 rather than tree shapes. searched-N: the tree that
# benchmarks/tree_search.py finds for N nodes on calibration prompts (not these).
TREE_DRAFTS = [
    "6",
    "10",
    "12",
    "16",
    "tree-2,1,1",
    "tree-1,1,1,1,2",
    "tree-2,1,1,1,1",
    "tree-1,1,1,1,1,1,1,1,2",
    "searched-6",
    "searched-10",
    "searched-12",
    "searched-16",
    "dyn-10x10",
    "dyn-16x12",
]
CODE_EDIT_DRAFTS = ["off", "ngram-2", "ngram-5", "4"]


# ---------------------------------------------------------------- the systems


def run_specd(stack: Stack, prompts, draft: Draft, mode: str, max_new: int) -> Row:
    row = Row("specd", mode, draft)
    temp = 0.0 if mode == "greedy" else 0.8
    for i, p in enumerate(prompts):
        start = time.perf_counter()
        ids, last = stack.generate(
            prompt_token_ids={"ids": p}, max_new_tokens=max_new, temperature=temp, seed=i, **dict(draft.fields)
        )
        row.seconds += time.perf_counter() - start
        assert last is not None, "a Generate stream ended without a message"
        s = last.stats
        row.tokens += len(ids)
        row.cycles += s.cycles
        row.drafted += s.drafted_tokens
        row.accepted += s.accepted_tokens
        row.draft_ms += s.draft_compute_ms
        row.verify_ms += s.verify_compute_ms
        row.overheads_ms += list(s.cycle_overhead_ms)
        row.outputs.append(ids)
    return row


def run_hf(target, drafter, prompts, mode: str, max_new: int) -> Row:
    row = Row("hf-assisted" if drafter is not None else "hf-target-only", mode, None)
    sampled = {"do_sample": True, "temperature": 0.8, "top_p": 1.0, "top_k": 0}
    kwargs = {"do_sample": False} if mode == "greedy" else sampled
    for i, p in enumerate(prompts):
        torch.manual_seed(i)
        ids = torch.tensor([p])
        start = time.perf_counter()
        out = target.generate(
            ids, assistant_model=drafter, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0, **kwargs
        )
        row.seconds += time.perf_counter() - start
        row.tokens += out.shape[1] - len(p)
        row.outputs.append(out[0, len(p) :].tolist())
    return row


def code_edit_prompts(tokenizer, prompts: list[list[int]]) -> list[list[int]]:
    """'The same code again, with one change' prompts: a held-out snippet, an
    instruction comment, then the snippet's first lines restated, so that the
    continuation (the rest of the snippet) is mostly in the prompt already."""
    out = []
    for p in prompts:
        code = tokenizer.decode(p)
        lines = code.splitlines(keepends=True)
        head = "".join(lines[: max(1, len(lines) // 3)])
        text = f"{code}\n\n# The same code again, with `self` renamed to `this`:\n{head}"
        out.append(tokenizer(text.replace("self", "this"), add_special_tokens=False)["input_ids"])
    return out


def with_off(drafts: list[Draft]) -> list[Draft]:
    """The settings with speculation off first: the baseline every ratio uses."""
    rest = [d for d in drafts if d.label != "off"]
    return [Draft.parse("off"), *rest]


# ---------------------------------------------------------------- the comparison


def compare(
    stack: Stack, hf_pair: tuple[Any, Any], prompts, drafts: list[Draft], mode: str, rounds: int, max_new: int
) -> tuple[dict[str, list[Row]], list[list[str]]]:
    """Every system once per round on the same prompts, in an order rotated
    each round: specd's settings through the stack, HF assisted generation
    and HF target-only decoding in this process. Returns each system's rows
    (one per round) and the order each round ran in."""
    by_label = {d.label: d for d in drafts}
    systems = [d.label for d in drafts] + [HF_ASSISTED, HF_TARGET]
    out: dict[str, list[Row]] = {s: [] for s in systems}
    schedule = []
    for r in range(rounds):
        order = rotated(systems, r)
        schedule.append(order)
        for s in order:
            if s == HF_ASSISTED:
                row = run_hf(*hf_pair, prompts, mode, max_new)
            elif s == HF_TARGET:
                row = run_hf(hf_pair[0], None, prompts, mode, max_new)
            else:
                row = run_specd(stack, prompts, by_label[s], mode, max_new)
            out[s].append(row)
        print(
            f"{mode} round {r + 1}/{rounds}: " + ", ".join(f"{s} {out[s][-1].tokens_per_s:.1f}" for s in systems),
            flush=True,
        )
    return out, schedule


# ---------------------------------------------------------------- extras (one run each)


def run_once(stack: Stack, prompts, drafts: list[Draft], mode: str, max_new: int) -> list[dict]:
    """Each setting once, greedy (accepted length is what these measure, not a
    ratio between systems); `mode` labels the rows."""
    rows = []
    for draft in drafts:
        row = run_specd(stack, prompts, draft, "greedy", max_new)
        row.mode = mode
        rows.append(row)
        print(
            f"{mode} {draft.label}: {row.tokens_per_s:.1f} tok/s (accepted length {row.mean_accepted_length:.2f})",
            flush=True,
        )
    return [
        dict(system="specd", mode=mode, method=method(d), **figures([r], None if i == 0 else rows[:1]))
        for i, (d, r) in enumerate(zip(drafts, rows))
    ]


# ---------------------------------------------------------------- parse


def add_extra_args(ap: argparse.ArgumentParser) -> None:
    """The extras, off by default: each setting run once (accepted length, not ratios)."""
    ap.add_argument(
        "--trees",
        action="store_true",
        help="extra: --tree-drafts once each, greedy, fp32 (trees vs chains by accepted length)",
    )
    ap.add_argument("--tree-drafts", nargs="+", default=TREE_DRAFTS)
    ap.add_argument(
        "--code-edit", action="store_true", help="extra: --code-edit-drafts once each, greedy, on the code-edit prompts"
    )
    ap.add_argument("--code-edit-drafts", nargs="+", default=CODE_EDIT_DRAFTS)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(ap)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="alternating rounds (default 6; 2 with --quick); an interval needs 3 at least",
    )
    ap.add_argument(
        "--drafts",
        nargs="+",
        default=DEFAULT_DRAFTS,
        help="specd settings compared in every mode: off, K (a chain), ngram-K, tree-B1,B2,.., "
        "searched-N, dyn-N[xDEPTH]; off is always added",
    )
    ap.add_argument("--modes", default="greedy,T=0.8", help="comma-separated (greedy, T=0.8); none: no comparison")
    ap.add_argument(
        "--goal-vs-off",
        type=float,
        default=1.9,
        help="the best setting's ratio over off must have its interval's lower bound at least this",
    )
    ap.add_argument("--goal-vs-hf", type=float, default=1.15, help="the same over Hugging Face assisted generation")
    ap.add_argument(
        "--traced-levels",
        nargs="+",
        default=["1", "8"],
        help="concurrent streams at which the tracing cost is measured; none to skip",
    )
    ap.add_argument("--traced-draft", default="4", help="the setting the tracing cost is measured with (greedy)")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16"],
        help="model dtype for every system (bf16 halves the weight traffic of a CPU decode step)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0 = torch default)")
    add_extra_args(ap)
    ap.add_argument("--quick", action="store_true", help="3 prompts, 32 tokens, 2 rounds, chains of 2 and 4")
    ap.add_argument("--out", type=Path, default=RESULTS / "speedup.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.drafts = 3, 32, ["off", "2", "4"]
        args.tree_drafts, args.code_edit_drafts = ["6", "searched-6", "dyn-6x4"], ["off", "ngram-5"]
    args.rounds = args.rounds or (2 if args.quick else 6)
    args.modes = [] if args.modes == "none" else args.modes.split(",")
    args.traced_levels = [] if "none" in args.traced_levels else [int(n) for n in args.traced_levels]
    return args


# ---------------------------------------------------------------- run


def new_result(args: argparse.Namespace, target: Path, prompts: list[list[int]]) -> dict:
    """The result document before anything is measured: the run's meta."""
    return {
        "meta": {
            "machine": machine(processor=True),
            "target": str(target),
            "drafter": str(args.drafter),
            "prompts": len(prompts),
            "dtype": args.dtype,
            "prompt_tokens": args.prompt_tokens,
            "max_new_tokens": args.max_new_tokens,
            "rounds": args.rounds,
            "goal_vs_off": args.goal_vs_off,
            "goal_vs_hf": args.goal_vs_hf,
            "date": utc_now(),
        },
        "comparison": {},
        "schedule": {},
        "tracing": [],
        "extras": [],
        "tree_vs_chain": [],
    }


def round_records(rows: dict[str, list[Row]]) -> dict[str, list[dict]]:
    """Each system's rounds as they were measured (the raw counts behind the ratios)."""
    return {
        s: [
            {
                "tokens": r.tokens,
                "seconds": round(r.seconds, 4),
                "cycles": r.cycles,
                "drafted": r.drafted,
                "accepted": r.accepted,
            }
            for r in rs
        ]
        for s, rs in rows.items()
    }


def run_comparison(
    stack: Stack, target: Path, args: argparse.Namespace, prompts, result: dict, write: Callable[[], None]
) -> None:
    """Every mode's comparison: specd's settings through `stack`, HF's two in
    this process (each warmed up first: first-call costs)."""
    hf_pair = (load_model(str(target), "cpu", args.dtype), load_model(str(args.drafter), "cpu", args.dtype))
    for mode in args.modes:
        run_hf(*hf_pair, prompts[:1], mode, 8)
        run_hf(hf_pair[0], None, prompts[:1], mode, 8)
    drafts = with_off([Draft.parse(d) for d in args.drafts])
    for mode in args.modes:
        rows, result["schedule"][mode] = compare(
            stack, hf_pair, prompts, drafts, mode, args.rounds, args.max_new_tokens
        )
        result["comparison"][mode] = summarise_mode(rows, args.goal_vs_off, args.goal_vs_hf)
        result["comparison"][mode]["rounds"] = round_records(rows)
        write()


def run_trees(target: Path, args: argparse.Namespace, prompts, service_args: tuple[str, ...]) -> list[dict]:
    """The trees extra: the searched trees found first if missing, then every
    tree setting once, fp32: the padded target's logits equal the demo
    target's exactly, so the searched trees (found on the demo target in fp32)
    apply as they are."""
    searched = sorted({int(d[9:]) for d in args.tree_drafts if d.startswith("searched-")})
    if searched and not all(load_searched(TREES_FILE, n, "float32") for n in searched):
        from .tree_search import search

        TREES_FILE.write_text(json.dumps(search(args.target, args.drafter, searched, "float32"), indent=1))
    stack = Stack(str(target), str(args.drafter), ("--dtype", "float32") + service_args[2:], env=UNTRACED_ENV)
    try:
        run_specd(stack, prompts[:1], Draft.parse("2"), "greedy", 8)
        tree_drafts = with_off([Draft.parse(d) for d in args.tree_drafts])
        return run_once(stack, prompts, tree_drafts, TREE_MODE, args.max_new_tokens)
    finally:
        stack.stop()


def run(args: argparse.Namespace) -> dict:
    """The comparison, the tracing cost and the extras, writing the result
    after each part (a failure later keeps what was measured)."""
    target = cost_scaled_target(args.target, args.min_params)
    tok = load_tokenizer(str(args.target))
    prompts = heldout_prompts(tok, args.prompts, args.prompt_tokens, args.max_new_tokens)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = new_result(args, target, prompts)

    def write() -> None:
        write_json(args.out, result)

    # Both stacks are up the whole run (an idle one costs no CPU); only the one
    # measured is driven. The untraced one is untraced even if the shell
    # exports an OTLP endpoint.
    service_args = ("--dtype", args.dtype) + (("--torch-threads", str(args.threads)) if args.threads else ())
    stacks: dict[str, Stack] = {}
    sink = OtlpSink() if args.traced_levels else None
    try:
        stacks[UNTRACED] = Stack(str(target), str(args.drafter), service_args, env=UNTRACED_ENV)
        if sink is not None:
            stacks[TRACED] = Stack(str(target), str(args.drafter), service_args, env=sink.endpoint_env)
        run_specd(stacks[UNTRACED], prompts[:1], Draft.parse("2"), "greedy", 8)  # warm-up: first-call costs
        if args.modes:
            run_comparison(stacks[UNTRACED], target, args, prompts, result, write)
        if sink is not None:
            traced = Draft.parse(args.traced_draft)
            result["tracing"] = tracing_cost(
                stacks,
                sink,
                prompts,
                traced.label,
                dict(traced.fields),
                args.traced_levels,
                args.rounds,
                args.max_new_tokens,
            )
            write()
        if args.code_edit:
            edits = code_edit_prompts(tok, prompts)
            drafts_edit = with_off([Draft.parse(d) for d in args.code_edit_drafts])
            result["extras"] += run_once(stacks[UNTRACED], edits, drafts_edit, CODE_EDIT_MODE, args.max_new_tokens)
            write()
    finally:
        for stack in stacks.values():
            stack.stop()
        if sink is not None:
            sink.stop()
    if args.trees:
        result["extras"] += run_trees(target, args, prompts, service_args)
        result["tree_vs_chain"] = tree_vs_chain(result["extras"])
    write()
    return result


# ---------------------------------------------------------------- report


def report(result: dict, args: argparse.Namespace) -> None:
    """The tables and goals printed, the figures drawn."""
    for mode, summary in result["comparison"].items():
        print(
            f"\n## {mode}: {result['meta']['prompts']} prompts x {args.max_new_tokens} new tokens, "
            f"{args.rounds} rounds "
            "(tok/s over all rounds; ratios: geometric mean of per-round ratios, ~95 % interval)\n"
        )
        print(comparison_table(summary))
    if result["comparison"]:
        print("\n## Goals (the interval's lower bound must clear the goal)\n")
        for mode, summary in result["comparison"].items():
            print("\n".join(goal_lines(mode, summary["best"])))
        plot(result["comparison"], args.out.with_suffix(".png"))
    if result["tracing"]:
        print(f"\n## Tracing at 100 % sampling to an OTLP receiver, {args.rounds} rounds\n")
        print(tracing_table(result["tracing"]))
    report_extras(result, args.out)
    print(f"\nwrote {args.out}" + (f" and {args.out.with_suffix('.png')}" if result["comparison"] else ""))


def report_extras(result: dict, out: Path) -> None:
    if result["extras"]:
        print("\n## Extras (one run each: accepted length, not a ratio between systems)\n")
    for d in result["extras"]:
        print(
            f"{d['mode']} {d['draft']}: {d['tokens_per_s']} tok/s (one run), accepted length "
            f"{d.get('mean_accepted_length')}, greedy = off {d.get('greedy_outputs_equal_off', '')}"
        )
    tree_rows = [d for d in result["extras"] if d["mode"] == TREE_MODE and d["draft"] != "off"]
    if tree_rows:
        plot_trees(tree_rows, out.with_name("trees.png"))
    for t in result["tree_vs_chain"]:
        print(
            f"  {t['nodes']:>3} nodes: best chain {t['best_chain']} {t['chain_accepted_length']:.3f}"
            f" | best tree {t['best_tree']} {t['tree_accepted_length']:.3f}"
            f" -> tree {'beats' if t['tree_beats_chain'] else 'does NOT beat'} chain"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    report(run(args), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
