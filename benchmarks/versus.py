"""This checkout against an earlier commit, through the real services: the
same concurrent greedy streams sent to both, in alternating rounds, aggregate
tokens/s and whether the outputs are identical (or sampled streams,
--temperature, new seeds each round, the same for both: identical only
where both commits draw alike; the first round's are compared).

    python -m benchmarks.versus                          # 64 streams, 32-layer tiny-width pair, vs e571d85
    python -m benchmarks.versus --pair demo --streams 1 8
    python -m benchmarks.versus --against <commit> --quick
    python -m benchmarks.versus --against HEAD --against-flags="--max-batch-sessions 32"   # one setting

The earlier commit is checked out once as a git worktree under
benchmarks/.cache/versus/ and runs from there with this virtualenv's Python
(its packages first on the path, so its own code serves); each system is its
own `Stack` (verifier, drafter and orchestrator processes: the local stack of
that commit) started once and kept for all rounds, both up at the same time,
idle while the other runs; each takes one untimed round first. A round sends, for each number of streams, the
same prompts to each system in turn (the order alternating between rounds),
all streams at once, each one Generate of --max-new-tokens tokens; its
tokens/s is every stream's tokens over the wall time from the first send to
the last end. Ratios come from paired rounds with an interval
(benchmarks/common.py). Speculation runs at each system's defaults (what a
user gets), or --speculative-tokens K for both.

Pairs: `engine` is benchmarks/engine.py's 32-layer Llama-3.1-8B-shaped target
(32/8 heads, hidden 256) with its first 4 layers as the drafter, bf16
checkpoints with the demo tokenizer, random prompts; `demo` is
models/demo/, held-out prompts.

Writes benchmarks/results/versus_<pair>.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import grpc

from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.runtime.models import load_tokenizer

from .common import (
    CACHE,
    DEMO_DRAFTER,
    DEMO_TARGET,
    ROOT,
    all_at_once,
    alternating,
    fmt_ratio,
    goal_check,
    goal_line,
    heldout_prompts,
    machine,
    paired_ratio,
    random_prompts,
    random_token_pool,
    run_main,
    utc_now,
)

BASE_COMMIT = "e571d85"

# Run inside a checkout (cwd and first on sys.path): start that commit's
# local stack, print its orchestrator's address, serve until stdin closes.
# specd is installed in editable mode, and its finder resolves a module the
# checkout lacks (an older layout's) to this checkout's file: the stack module
# is chosen by the files in the checkout, and a module loaded from elsewhere
# is refused, so that each commit runs its own code.
HOST = """
import importlib, json, os, sys
tree = os.path.realpath(os.getcwd())
name = next(n for n in ("specd.local_stack", "specd.ops.local_stack")
            if os.path.exists(os.path.join(tree, *n.split(".")) + ".py"))
mod = importlib.import_module(name)
if not os.path.realpath(mod.__file__).startswith(tree + os.sep):
    sys.exit(f"{name} was loaded from {mod.__file__}, not from {tree}")
a = json.loads(sys.argv[1])
stack = mod.Stack(a["target"], a["drafter"], tuple(a["service_args"]))
print("ADDRESS " + stack.orchestrator.address, flush=True)
sys.stdin.read()
stack.stop()
"""


def checkout(commit: str) -> Path:
    """A worktree of `commit` under benchmarks/.cache/versus/ (made once)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    tree = CACHE / "versus" / sha[:12]
    if not (tree / ".git").exists():
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=True)
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), sha], cwd=ROOT, check=True)
    return tree


class Host:
    """One system's stack, run from its own source tree."""

    def __init__(self, name: str, tree: Path, target: Path, drafter: Path, service_args: list[str]):
        self.name = name
        spec = {"target": str(target), "drafter": str(drafter), "service_args": service_args}
        env = {**__import__("os").environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOST, json.dumps(spec)],
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.stdin = self.proc.stdin
        lines = []
        for line in self.proc.stdout:
            if line.startswith("ADDRESS "):
                self.address = line.split()[1]
                break
            lines.append(line)
        else:
            raise RuntimeError(f"{name}'s stack did not start:\n" + "".join(lines[-40:]))
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # keep its pipe drained
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.OrchestratorServiceStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        self.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def generate(
    stub, prompt: list[int], max_new: int, k: int | None, temperature: float = 0.0, seed: int = 0
) -> list[int]:
    request = pb.GenerateRequest(prompt_token_ids=pb.PromptTokenIds(ids=prompt), max_new_tokens=max_new)
    if k is not None:
        request.num_speculative_tokens = k
    if temperature:
        request.temperature, request.seed = temperature, seed
    ids: list[int] = []
    for r in stub.Generate(request, timeout=1800):
        ids += r.token_ids
    return ids


def one_round(
    host: Host, prompts: list[list[int]], max_new: int, k: int | None, temperature: float = 0.0, seeds: int = 0
) -> tuple[float, list[list[int]]]:
    """All prompts at once, one stream each (sampled: stream i seeded
    seeds + i): (tokens/s, each stream's tokens)."""
    try:
        outs, wall = all_at_once(
            lambda i: generate(host.stub, prompts[i], max_new, k, temperature, seeds + i), len(prompts)
        )
    except RuntimeError as e:
        raise RuntimeError(f"{host.name}: {e}") from None
    return sum(len(o) for o in outs) / wall, outs


def engine_pair(name: str = "engine_pair", **shape) -> tuple[Path, Path]:
    """benchmarks/engine.py's pair (its shape overridden by `shape`) with the
    demo tokenizer, built once and cached under `name`."""
    from .engine import build_pair
    from .prefix_cache import with_tokenizer

    root = CACHE / name
    if not (root / "drafter" / "config.json").exists():
        target, drafter = build_pair(root, 4, **shape)
        for d in (target, drafter):
            with_tokenizer(d)
    return root / "target", root / "drafter"


def prompts_for(args: argparse.Namespace, n: int, target: Path) -> list[list[int]]:
    tok = load_tokenizer(str(target))
    if args.pair == "demo":
        return heldout_prompts(tok, n, args.prompt_tokens, args.max_new_tokens)
    return random_prompts(random_token_pool(tok), random.Random(n), n, args.prompt_tokens)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.versus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default=BASE_COMMIT, help="the earlier commit")
    ap.add_argument("--pair", choices=["engine", "demo"], default="engine")
    ap.add_argument("--streams", type=int, nargs="+", default=[64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both services' dtype")
    ap.add_argument("--speculative-tokens", type=int, default=None, help="K for both (default: each one's default)")
    ap.add_argument(
        "--torch-threads", type=int, default=0, help="torch threads per service, both (0: torch's default; Ray gives 1)"
    )
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="sampled streams, new seeds each round (default 0: greedy)"
    )
    ap.add_argument(
        "--against-flags",
        default="",
        help="more flags for the earlier commit's model services only (e.g. --against HEAD with another setting)",
    )
    ap.add_argument("--goal", type=float, default=None, help="the ratio this checkout should reach (lower bound)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.streams, args.rounds, args.max_new_tokens = [min(args.streams), 2 * min(args.streams)], 2, 16
    args.out = args.out or ROOT / "benchmarks" / "results" / f"versus_{args.pair}.json"
    return args


def run(args: argparse.Namespace) -> dict:
    target, drafter = engine_pair() if args.pair == "engine" else (DEMO_TARGET, DEMO_DRAFTER)
    there = checkout(args.against)
    flags = ["--dtype", args.dtype, *(["--torch-threads", str(args.torch_threads)] if args.torch_threads else [])]
    hosts = [Host("this checkout", ROOT, target, drafter, flags)]
    try:
        hosts.append(Host(args.against, there, target, drafter, flags + shlex.split(args.against_flags)))
        levels = []
        for n in args.streams:
            prompts = prompts_for(args, n, target)
            for h in hosts:  # warm-up, a whole round: first forwards, thread pools, connections, adaptive depth
                one_round(h, prompts, args.max_new_tokens, args.speculative_tokens, args.temperature)
            tps: dict[str, list[float]] = {h.name: [] for h in hosts}
            outputs: dict[str, list[list[int]]] = {}
            differ = 0
            for r in range(args.rounds):
                for h in alternating(hosts, r):
                    # Sampled rounds draw new seeds each round (both systems the
                    # same ones): two commits that draw differently take different
                    # paths from one seed, and only over many do they cost alike.
                    seeds = (r + 1) * 100_000
                    rate, outs = one_round(
                        h, prompts, args.max_new_tokens, args.speculative_tokens, args.temperature, seeds
                    )
                    tps[h.name].append(rate)
                    first = outputs.setdefault(h.name, outs)
                    if not args.temperature:
                        differ += sum(a != b for a, b in zip(first, outs))  # across rounds of one system
                print(f"  {n} streams, round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in tps.items()))
            ours, theirs = (outputs[h.name] for h in hosts)
            levels.append(
                {
                    "streams": n,
                    "tokens_per_s": tps,
                    "ratio": paired_ratio(tps[hosts[0].name], tps[hosts[1].name]),
                    "streams_with_different_output": sum(a != b for a, b in zip(ours, theirs)),
                    "outputs_changed_between_rounds": differ,
                }
            )
    finally:
        for h in hosts:
            h.stop()
    return {
        "when": utc_now(),
        "machine": machine(),
        "against": args.against,
        "against_flags": args.against_flags,
        "pair": args.pair,
        "dtype": args.dtype,
        "torch_threads": args.torch_threads or "default",
        "max_new_tokens": args.max_new_tokens,
        "prompt_tokens": args.prompt_tokens,
        "speculative_tokens": args.speculative_tokens,
        "temperature": args.temperature,
        "levels": levels,
    }


def report(result: dict, args: argparse.Namespace) -> None:
    against = " ".join(filter(None, (result["against"], result.get("against_flags"))))
    print(f"\n| streams | this checkout tok/s | {against} tok/s | ratio (interval) | streams with different output |")
    print("|---|---|---|---|---|")
    for lv in result["levels"]:
        ours, theirs = lv["tokens_per_s"].values()
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        print(
            f"| {lv['streams']} | {med(ours):.0f} | {med(theirs):.0f} | {fmt_ratio(lv['ratio'])} "
            f"| {lv['streams_with_different_output']} of {lv['streams']} |"
        )
        if args.goal is not None:
            print(goal_line(f"{lv['streams']} streams >= {args.goal}x {against}", goal_check(lv["ratio"], args.goal)))
    print(f"\nwritten to {args.out}")


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
