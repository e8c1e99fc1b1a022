"""What batching buys per model family: tokens/s of 8 concurrent streams over
one stream, through the real services, for a pair of each family's structure.

    python -m benchmarks.batching                         # every structure in BENCH_FAMILIES, K = 4 (~1 min each)
    python -m benchmarks.batching --families llama3 gemma2 --streams 1 8 --rounds 6

Each family's pair is random-initialised with its real config fields (RoPE
type, norms, soft-capping, windows ...; tests/tiny_models.py) at a size where a
forward costs more than the service around it (target 8 layers of width 512,
drafter 2 of 256), with acceptance forced (benchmarks/synthetic.py: both
models predict the token they read), so every stream drafts and keeps K
tokens per cycle. The levels run in alternating rounds on one stack and the
ratio gets an interval from the rounds (benchmarks/common.py ratio_interval).
Writes benchmarks/results/batching.json and prints a table with each
replica's engine (lean: one forward for all sessions; hf: one per session).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from specd.local_stack import Stack
from specd_core.runtime.models import Runner, load_model, load_tokenizer

from . import synthetic
from .common import (
    CACHE,
    DEMO_TARGET,
    RESULTS,
    alternating,
    machine,
    random_prompts,
    random_token_pool,
    ratio_interval,
    utc_now,
    write_json,
)
from .load import merge_rounds, run_level

TOKENIZER = DEMO_TARGET


def family_pair(family: str, vocab: int, eos_id: int):
    """(target config, drafter config) of `family` at the benchmark's size."""
    # The families' real config fields live with the test models (run from the
    # repository root, as every benchmark is).
    from tests.tiny_models import scaled_config

    target = scaled_config(family, vocab, eos_id, hidden=512, layers=8, heads=8, kv_heads=2)
    drafter = scaled_config(family, vocab, eos_id, hidden=256, layers=2, heads=4, kv_heads=2)
    return target, drafter


def engine_of(model_dir: Path) -> str:
    return Runner(load_model(str(model_dir), "cpu")).engine


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    from tests.tiny_models import BENCH_FAMILIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(BENCH_FAMILIES))
    ap.add_argument("--streams", type=int, nargs=2, default=[1, 8], metavar=("FEW", "MANY"))
    ap.add_argument("--k", type=int, default=4, help="draft tokens per cycle (0: speculation off)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=40.0, help="measured seconds per level, split over the rounds")
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=RESULTS / "batching.json")
    return ap.parse_args(argv)


def measure_family(family: str, tok, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """One family's pair built (cached), its stack up, the two levels in
    alternating rounds; its row."""
    few, many = args.streams
    fields = {"num_speculative_tokens": args.k}
    target_cfg, drafter_cfg = family_pair(family, len(tok), tok.eos_token_id)
    base = CACHE / f"batching-{family}"
    target = synthetic.build(target_cfg, base / "target", TOKENIZER, torch.float32, "cpu")
    drafter = synthetic.build(drafter_cfg, base / "drafter", TOKENIZER, torch.float32, "cpu", seed=1)
    engines = {"target": engine_of(target), "drafter": engine_of(drafter)}
    stack = Stack(str(target), str(drafter), ("--dtype", args.dtype))
    try:
        run_level(stack.orchestrator.address, prompts, fields, 2, 8, 1.0, 0.0)  # warm-up
        got: dict[int, list] = {few: [], many: []}
        for r in range(args.rounds):
            for n in alternating((few, many), r):
                got[n].append(
                    run_level(
                        stack.orchestrator.address,
                        prompts,
                        fields,
                        n,
                        args.max_new_tokens,
                        args.seconds / args.rounds,
                        args.warmup_s,
                    )
                )
    finally:
        stack.stop()
    a, b = merge_rounds(got[many]), merge_rounds(got[few])
    row = {
        "family": family,
        "engines": engines,
        f"tokens_per_s_{few}": b["tokens_per_s"],
        f"tokens_per_s_{many}": a["tokens_per_s"],
        "ratio": round(a["tokens_per_s"] / b["tokens_per_s"], 3),
        "ratio_interval": ratio_interval(a, b),
        "draft_depth": a["draft_depth"],
        "rounds": {few: b["rounds_tokens_per_s"], many: a["rounds_tokens_per_s"]},
    }
    print(
        f"{family:>14}: {few} stream(s) {b['tokens_per_s']} tok/s, {many} streams {a['tokens_per_s']} tok/s, "
        f"x{row['ratio']} {row['ratio_interval']}  engines {engines}",
        flush=True,
    )
    return row


def run(args: argparse.Namespace) -> dict:
    tok = load_tokenizer(str(TOKENIZER))
    prompts = random_prompts(random_token_pool(tok), random.Random(0), 16, 64)
    result: dict = {
        "meta": {
            "machine": machine(),
            "dtype": args.dtype,
            "k": args.k,
            "max_new_tokens": args.max_new_tokens,
            "rounds": args.rounds,
            "seconds": args.seconds,
            "acceptance": "forced: both models predict the token they read",
            "date": utc_now(),
        },
        "rows": [],
    }
    for family in args.families:
        result["rows"].append(measure_family(family, tok, prompts, args))
        write_json(args.out, result)  # after every family: a failure later keeps what was measured
    return result


def report(result: dict, args: argparse.Namespace) -> None:
    few, many = args.streams
    print(f"\n| family | engines (target, drafter) | {few} stream tok/s | {many} streams tok/s | ratio (interval) |")
    print("|---|---|---|---|---|")
    for r in result["rows"]:
        iv = f" ({r['ratio_interval'][0]:.2f}-{r['ratio_interval'][1]:.2f})" if r["ratio_interval"] else ""
        print(
            f"| {r['family']} | {r['engines']['target']}, {r['engines']['drafter']} | {r[f'tokens_per_s_{few}']} "
            f"| {r[f'tokens_per_s_{many}']} | {r['ratio']}{iv} |"
        )
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    report(run(args), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
