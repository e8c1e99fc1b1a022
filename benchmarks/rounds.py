"""Batch-1 ratios with an interval: specd settings and Hugging Face assisted
generation in alternating rounds on the same prompts.

    python -m benchmarks.rounds                      # off, chain K=4, HF assisted; 6 rounds
    python -m benchmarks.rounds --drafts off 4 6 --rounds 8

`benchmarks.speedup` runs every system once, one after the other, so a drift of
the machine or a leftover process between two runs decides their ratio. Here
each round runs every system once, back to back, in a rotated order, and each
ratio gets an interval from its per-round ratios (benchmarks.load.ratio_interval):
a drift that the systems of a round share cancels, and the interval says how
much is left. Same pair, prompts and dtype as benchmarks.speedup.
Writes benchmarks/results/rounds.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specd.ops.local_stack import Stack
from specd.runtime.models import load_model, load_tokenizer

from .load import ratio_interval
from .speedup import RESULTS, Draft, add_pair_args, cost_scaled_target, run_hf, run_specd

HF = "hf-assisted"


def run_rounds(stack: Stack, hf_pair, prompts, drafts: list[Draft], rounds: int, max_new: int) -> dict[str, list]:
    """tokens/s per setting and round; the order rotates each round so no
    setting always runs first (or right after the same neighbour)."""
    settings = [d.label for d in drafts] + [HF]
    by_label = {d.label: d for d in drafts}
    out: dict[str, list] = {s: [] for s in settings}
    for r in range(rounds):
        order = settings[r % len(settings) :] + settings[: r % len(settings)]
        for s in order:
            if s == HF:
                row = run_hf(*hf_pair, prompts, "greedy", max_new)
            else:
                row = run_specd(stack, prompts, by_label[s], "greedy", max_new)
            out[s].append(row)
        print(f"round {r + 1}: " + ", ".join(f"{s} {out[s][-1].tokens_per_s:.1f}" for s in settings), flush=True)
    return out


def summarise(rows: dict[str, list]) -> dict:
    settings = {
        s: {
            "rounds_tokens_per_s": [round(r.tokens_per_s, 2) for r in rs],
            "tokens_per_s": round(statistics.fmean(r.tokens_per_s for r in rs), 2),
        }
        for s, rs in rows.items()
    }
    for s, rs in rows.items():
        if s != HF and rs[0].cycles:
            acc = sum(r.accepted for r in rs) + sum(r.cycles for r in rs)
            settings[s]["mean_accepted_length"] = round(acc / sum(r.cycles for r in rs), 3)
    ratios = {}
    for s in settings:
        for base in ("off", HF):
            if s not in ("off", HF) and base in settings:
                a, b = settings[s], settings[base]
                per_round = [x / y for x, y in zip(a["rounds_tokens_per_s"], b["rounds_tokens_per_s"])]
                ratios[f"{s} / {base}"] = {
                    "geomean": round(statistics.geometric_mean(per_round), 3),
                    "interval": ratio_interval(a, b),
                }
    return {"settings": settings, "ratios": ratios}


def main(argv=None) -> int:
    from training.evaluate_pair import make_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(ap)
    ap.add_argument("--drafts", nargs="+", default=["off", "4"], help="specd settings (as benchmarks.speedup)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=RESULTS / "rounds.json")
    args = ap.parse_args(argv)

    target = cost_scaled_target(args.target, args.min_params)
    tok = load_tokenizer(str(args.target))
    prompts = [p.tolist() for p in make_prompts(tok, args.prompts, args.prompt_tokens, args.max_new_tokens)]
    drafts = [Draft.parse(d) for d in args.drafts]
    hf_pair = (load_model(str(target), "cpu", args.dtype), load_model(str(args.drafter), "cpu", args.dtype))
    stack = Stack(str(target), str(args.drafter), ("--dtype", args.dtype))
    try:
        run_specd(stack, prompts[:1], Draft.parse("2"), "greedy", 8)  # warm-up: first-call costs
        run_hf(*hf_pair, prompts[:1], "greedy", 8)
        rows = run_rounds(stack, hf_pair, prompts, drafts, args.rounds, args.max_new_tokens)
    finally:
        stack.stop()
    result = summarise(rows)
    result["meta"] = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads; torch {torch.__version__}",
        "target": str(target),
        "drafter": str(args.drafter),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    args.out.write_text(json.dumps(result, indent=2))
    print("| setting | tok/s (mean of rounds) | accepted length |\n|---|---|---|")
    for s, d in result["settings"].items():
        print(f"| {s} | {d['tokens_per_s']} | {d.get('mean_accepted_length', '')} |")
    print("\n| ratio | geometric mean | ~95 % interval |\n|---|---|---|")
    for name, d in result["ratios"].items():
        print(f"| {name} | {d['geomean']} | {d['interval']} |")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
