"""Multi-turn chat traffic with prefix caching on and off: conversations run
concurrently, each turn sending the whole conversation so far (as chat and
agent clients do), in alternating rounds.

    python -m benchmarks.multi_turn            # 8 conversations x 6 turns, 3 rounds
    python -m benchmarks.multi_turn --quick

Two stacks of the same pair (specd.local_stack.Stack: verifier, drafter and
orchestrator processes), one with prefix caching and one with
`--no-prefix-caching`, both up for the whole run and idle while the other
runs. A round runs the conversations on one stack, then (order alternating
between rounds) on the other: each conversation's turn t sends its first
user message, every reply generated so far and the next user message (user
messages of --user-tokens random ids, fixed per conversation and round
across the two stacks), --reply-tokens greedy tokens, the reply appended to
the conversation; conversations run all at once, their turns one after
another. Per stack and round: generated tokens/s (all turns' tokens over the
round's wall time), time to first token per turn (p50, p90 over the round's
turns), and the hit rate (cached prompt tokens / prompt tokens, from each
turn's GenerationStats). Each round uses fresh random user messages, so a
round does not hit what an earlier one cached. The greedy replies of the two
stacks are compared (caching must not change them).

The pair is benchmarks/engine.py's 32-layer Llama-3.1-8B-shaped target
(hidden 256) with its first 4 layers as the drafter, with the demo
tokenizer; served in float32 on the CPU.

Writes benchmarks/results/multi_turn.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb

from .common import RESULTS, all_at_once, alternating, machine, paired_ratio, pct, run_main, utc_now
from .versus import engine_pair

SYSTEMS = ("caching on", "caching off")


def turn(stub, prompt: list[int], max_new: int) -> dict:
    """One greedy Generate: its tokens, TTFT (ms) and the stats' prompt / cached counts."""
    request = pb.GenerateRequest(prompt_token_ids=pb.PromptTokenIds(ids=prompt), max_new_tokens=max_new)
    start, ttft, ids, stats = time.perf_counter(), None, [], None
    for r in stub.Generate(request, timeout=1800):
        if ttft is None and r.token_ids:
            ttft = (time.perf_counter() - start) * 1e3
        ids += r.token_ids
        if r.finish_reason:
            stats = r.stats
    assert ttft is not None and stats is not None, "the stream ended without tokens or stats"
    return {"ids": ids, "ttft_ms": ttft, "prompt": stats.prompt_tokens, "cached": stats.cached_prompt_tokens}


def conversations(stack: Stack, users: list[list[list[int]]], max_new: int) -> dict:
    """Every conversation at once, turn after turn: their turns' records and the wall time."""

    def talk(c: int) -> list[dict]:
        so_far: list[int] = []
        records = []
        for message in users[c]:
            so_far += message
            t = turn(stack.stub, so_far, max_new)
            so_far += t["ids"]
            records.append(t)
        return records

    records, wall = all_at_once(talk, len(users), "conversations")
    turns = [t for conv in records for t in conv]
    return {
        "wall_s": round(wall, 3),
        "tokens_per_s": round(sum(len(t["ids"]) for t in turns) / wall, 2),
        "ttft_p50_ms": round(pct([t["ttft_ms"] for t in turns], 0.5), 1),
        "ttft_p90_ms": round(pct([t["ttft_ms"] for t in turns], 0.9), 1),
        "prompt_tokens": sum(t["prompt"] for t in turns),
        "cached_prompt_tokens": sum(t["cached"] for t in turns),
        "replies": [[t["ids"] for t in conv] for conv in records],
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.multi_turn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-tokens", type=int, default=96, help="tokens of each user message")
    ap.add_argument("--reply-tokens", type=int, default=32, help="greedy tokens generated per turn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default="1GiB", help="each replica's KV budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "multi_turn.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.rounds, args.reply_tokens = 2, 3, 2, 8
    return args


def run(args: argparse.Namespace) -> dict:
    target, drafter = engine_pair()
    flags = ("--device", "cpu", "--kv-cache-memory", args.kv_cache_memory)
    # Long prefills of 32 layers on a shared 2-core CPU outlast the default
    # hang detection's floor: a slow answer here is not a hung replica.
    hang = ("--hang-floor", "120", "--hang-ceiling", "600")
    stacks: dict[str, Stack] = {}
    try:
        stacks[SYSTEMS[0]] = Stack(str(target), str(drafter), flags, orchestrator_args=hang)
        stacks[SYSTEMS[1]] = Stack(str(target), str(drafter), (*flags, "--no-prefix-caching"), orchestrator_args=hang)
        rng = random.Random(args.seed)

        def users() -> list[list[list[int]]]:
            return [
                [[rng.randrange(3, 4096) for _ in range(args.user_tokens)] for _ in range(args.turns)]
                for _ in range(args.conversations)
            ]

        for s in stacks.values():  # warm-up round, not timed
            conversations(s, users(), args.reply_tokens)
        rounds: list[dict] = []
        for r in range(args.rounds):
            messages = users()
            row: dict = {}
            for name in alternating(SYSTEMS, r):
                row[name] = conversations(stacks[name], messages, args.reply_tokens)
            row["replies_differ"] = sum(
                a != b for ca, cb in zip(*(row[n]["replies"] for n in SYSTEMS)) for a, b in zip(ca, cb)
            )
            print(
                f"  round {r + 1}: "
                + ", ".join(
                    f"{n} {row[n]['tokens_per_s']} tok/s, TTFT p50 {row[n]['ttft_p50_ms']} ms" for n in SYSTEMS
                ),
                flush=True,
            )
            rounds.append(row)
    finally:
        for s in stacks.values():
            s.stop()
    for row in rounds:
        for n in SYSTEMS:
            del row[n]["replies"]
    on, off = ([row[n]["tokens_per_s"] for row in rounds] for n in SYSTEMS)
    ttft_on, ttft_off = ([row[n]["ttft_p50_ms"] for row in rounds] for n in SYSTEMS)
    return {
        "when": utc_now(),
        "machine": machine(),
        "conversations": args.conversations,
        "turns": args.turns,
        "user_tokens": args.user_tokens,
        "reply_tokens": args.reply_tokens,
        "rounds": rounds,
        "tokens_per_s_on_over_off": paired_ratio(on, off),
        "ttft_p50_on_over_off": paired_ratio(ttft_on, ttft_off),
        "hit_rate": {
            n: round(
                sum(row[n]["cached_prompt_tokens"] for row in rounds)
                / max(1, sum(row[n]["prompt_tokens"] for row in rounds)),
                4,
            )
            for n in SYSTEMS
        },
        "replies_differ": sum(row["replies_differ"] for row in rounds),
    }


def report(result: dict, args: argparse.Namespace) -> None:
    print("\n| round | system | tokens/s | TTFT p50 ms | TTFT p90 ms | cached / prompt tokens |")
    print("|---|---|---|---|---|---|")
    for i, row in enumerate(result["rounds"], 1):
        for n in SYSTEMS:
            c = row[n]
            print(
                f"| {i} | {n} | {c['tokens_per_s']} | {c['ttft_p50_ms']} | {c['ttft_p90_ms']} "
                f"| {c['cached_prompt_tokens']:,} / {c['prompt_tokens']:,} |"
            )
    tp, tt = result["tokens_per_s_on_over_off"], result["ttft_p50_on_over_off"]
    print(f"\ntokens/s on / off: {tp['geomean']} {tp['interval']}; TTFT p50 on / off: {tt['geomean']} {tt['interval']}")
    print(f"hit rate: {result['hit_rate']}; replies that differ between the two: {result['replies_differ']}")
    print(f"written to {args.out}")


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
