"""Find the static draft tree with the most tokens per cycle for a node budget,
from the pair's own greedy behaviour on calibration prompts (Sequoia-style:
Chen et al. 2024 choose tree shapes from measured acceptance).

    python -m benchmarks.tree_search --budgets 6 10 16     # writes benchmarks/results/trees.json

Under greedy verification only the nodes on the target's own path matter, so a
tree's accepted length at a position is decided by one number per position:
the rank of the target's next token among the drafter's choices there. One
target continuation and ONE drafter forward over it give every rank; a tree
(a set of rank paths) is then scored by replaying the cycles exactly as the
verifier runs them. A greedy search adds, one node at a time, the node that
raises the replayed tokens per cycle most.

Calibration prompts are held-out files other than the speedup benchmark's
prompts, so the benchmark's tree-vs-chain rows measure the searched tree on
prompts it was not chosen on.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .common import RESULTS, add_pair_args, run_main

Tree = frozenset  # of rank paths (tuples); closed under parents and elder siblings


def tokens_per_cycle(ranks: list[list[int]], tree: Tree) -> float:
    """Replay greedy cycles over each sequence. ranks[s][j] is the rank, in the
    drafter's choices after tokens 0..j-1 of the generated sequence s (with its
    prompt), of the target's token j; token 0 comes from the prefill. A cycle
    after committed token t keeps the longest tree path equal to the ranks of
    tokens t+1, t+2, ..., then emits one more token."""
    tokens = cycles = 0
    for r in ranks:
        t = 0
        while t < len(r) - 1:
            path: tuple[int, ...] = ()
            kept = 0
            while t + 1 + kept < len(r) - 1:  # the last token is the cycle's own, never a draft
                path += (r[t + 1 + kept],)
                if path not in tree:
                    break
                kept += 1
            cycles += 1
            tokens += kept + 1
            t += kept + 1
    return tokens / cycles if cycles else 0.0


def chain(k: int) -> Tree:
    return frozenset((0,) * d for d in range(1, k + 1))


def candidates(tree: Tree, max_rank: int, max_depth: int) -> list[tuple[int, ...]]:
    """Nodes that may join: their parent and elder sibling are in the tree."""
    out = []
    for parent in [()] + sorted(tree):
        if len(parent) >= max_depth:
            continue
        n = sum(1 for p in tree if len(p) == len(parent) + 1 and p[:-1] == parent)
        if n < max_rank:
            out.append(parent + (n,))
    return out


def grow(ranks: list[list[int]], budgets: list[int], max_rank: int = 4, max_depth: int = 16) -> dict[int, Tree]:
    """Greedy search: the best tree at each budget, each extending the last."""
    tree: Tree = frozenset()
    best: dict[int, Tree] = {}
    for n in range(1, max(budgets) + 1):
        node = max(
            candidates(tree, max_rank, max_depth),
            key=lambda c: (tokens_per_cycle(ranks, tree | {c}), -len(c), tuple(-x for x in c)),
        )
        tree = tree | {node}
        if n in budgets:
            best[n] = tree
    return best


def bfs_paths(tree: Tree) -> list[list[int]]:
    """Parents and elder siblings first: the order DraftShape.paths wants."""
    return [list(p) for p in sorted(tree, key=lambda p: (len(p), p))]


@torch.no_grad()
def measure_ranks(target, drafter, prompts, max_new: int) -> list[list[int]]:
    """Per prompt: the target's greedy continuation, then the rank of each of its
    tokens among the drafter's choices at that point (one drafter forward)."""
    from training.evaluate_pair import continue_with_cache

    out = []
    for p in prompts:
        cont = torch.as_tensor(continue_with_cache(target, p, max_new))
        seq = torch.cat([p, cont])
        logits = drafter(input_ids=seq[None]).logits[0, len(p) - 1 : -1].float()
        chosen = logits.gather(1, cont[:, None])
        out.append((logits > chosen).sum(1).tolist())
    return out


def calibration_prompts(tokenizer, n: int, length: int, max_new: int, exclude: int):
    """Held-out prompts that are not among the first `exclude` (the benchmark's)."""
    from training.evaluate_pair import make_prompts

    bench = make_prompts(tokenizer, exclude, length, max_new)
    return [p for p in make_prompts(tokenizer, n, length, max_new) if not any(torch.equal(p, b) for b in bench)]


@dataclass(frozen=True)
class Calibration:
    """The prompts a tree is searched on: `prompts` held-out prompts asked for,
    less those among the first `exclude` (the speedup benchmark's)."""

    prompts: int = 150
    prompt_tokens: int = 96
    max_new: int = 96
    exclude: int = 8


def search(
    target_dir: Path, drafter_dir: Path, budgets: list[int], dtype: str, calib: Calibration = Calibration(), log=print
) -> dict:
    """The best tree per node budget for the pair, from its ranks on the calibration prompts."""
    from specd_core.runtime.models import load_model, load_tokenizer

    tok = load_tokenizer(str(target_dir))
    target, drafter = load_model(str(target_dir), "cpu", dtype), load_model(str(drafter_dir), "cpu", dtype)
    max_new = calib.max_new
    prompts = calibration_prompts(tok, calib.prompts, calib.prompt_tokens, max_new, calib.exclude)
    log(f"tree search: {len(prompts)} calibration prompts x {max_new} tokens ({dtype})")
    ranks = measure_ranks(target, drafter, prompts, max_new)
    trees = grow(ranks, budgets)
    rows = []
    for n in budgets:
        row = {
            "nodes": n,
            "paths": bfs_paths(trees[n]),
            "tree_tokens_per_cycle": round(tokens_per_cycle(ranks, trees[n]), 3),
            "chain_tokens_per_cycle": round(tokens_per_cycle(ranks, chain(n)), 3),
        }
        log(
            f"  {n:>3} nodes: searched tree {row['tree_tokens_per_cycle']} vs chain {row['chain_tokens_per_cycle']}"
            f" tokens/cycle on calibration; {row['paths']}"
        )
        rows.append(row)
    return {
        "target": str(target_dir),
        "drafter": str(drafter_dir),
        "dtype": dtype,
        "calibration_prompts": len(prompts),
        "max_new_tokens": max_new,
        "trees": rows,
    }


def load_searched(path: Path, nodes: int, dtype: str | None = None) -> list[list[int]] | None:
    """The searched tree of `nodes` nodes (found in `dtype`, if given), or None."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if dtype and data.get("dtype") != dtype:
        return None
    for row in data["trees"]:
        if row["nodes"] == nodes:
            return row["paths"]
    return None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(ap, cost_scaled=False)
    ap.add_argument("--budgets", type=int, nargs="+", default=[6, 10, 12, 16])
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="as the benchmark's tree rows (fp32)"
    )
    ap.add_argument("--prompts", type=int, default=150, help="calibration prompts asked for (before exclusion)")
    ap.add_argument("--out", type=Path, default=RESULTS / "trees.json")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    return search(args.target, args.drafter, sorted(args.budgets), args.dtype, Calibration(prompts=args.prompts))


def report(result: dict, args: argparse.Namespace) -> None:
    print(f"wrote {args.out}")  # the search logged each budget's tree as it found it


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
