"""What the benchmarks share: the repository's paths, the model pair and its
flags, the prompts, the record of the machine a run was on, and the statistics
of alternating rounds.

Statistics. A ratio between two systems is only a result when both ran side by
side: each round runs every system once, in an order that changes from round
to round (`rotated`, `alternating`), and each ratio is the geometric mean of
its per-round ratios with a rough 95 % interval from their spread
(`log_ratio_interval`, the one `specd bench` reports). A drift of the machine
that a round's systems share cancels in the per-round ratio; the interval says
how much noise is left. Percentiles are linear between order statistics
(`specd bench`'s `percentile`). Both formulas are `specd/bench.py`'s: the
benchmarks use them from here and nowhere else, so the command a user runs and
the benchmarks report the same figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from specd.bench import log_ratio_interval, percentile

T = TypeVar("T")

# ---------------------------------------------------------------- paths

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks/results"
CACHE = ROOT / "benchmarks/.cache"  # built models (the cost-scaled target, synthetic pairs)
DEMO_TARGET = ROOT / "models/demo/target"
DEMO_DRAFTER = ROOT / "models/demo/drafter"
DEFAULT_MIN_PARAMS = 100_000_000


# ---------------------------------------------------------------- the pair


def add_pair_args(ap: argparse.ArgumentParser, cost_scaled: bool = True) -> None:
    """The model pair of a benchmark: the demo pair by default; with
    `cost_scaled`, --min-params, the size the target is padded to
    (`cost_scaled_target`; 0: the target as it is)."""
    ap.add_argument("--target", type=Path, default=DEMO_TARGET)
    ap.add_argument("--drafter", type=Path, default=DEMO_DRAFTER)
    if cost_scaled:
        ap.add_argument("--min-params", type=int, default=DEFAULT_MIN_PARAMS, help="cost-scaled target size")


def cost_scaled_target(target: Path, min_params: int) -> Path:
    """Build (once, cached) the target padded to >= min_params parameters by
    function-preserving layers (training/pad_target.py); prove its logits
    unchanged. Its acceptance is the trained pair's, its cost a larger model's."""
    import torch

    from specd_core.runtime.models import load_model, load_tokenizer
    from training.pad_target import n_params, pad_model

    out = CACHE / f"{target.name}-padded-{min_params // 1_000_000}M"
    if (out / "config.json").exists():
        return out
    src = load_model(str(target), "cpu")
    padded = pad_model(src, min_params)
    x = torch.randint(0, src.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (src(input_ids=x).logits - padded(input_ids=x).logits).abs().max().item()
    assert diff < 1e-4, f"padding changed the logits by {diff}"
    padded.save_pretrained(out)
    load_tokenizer(str(target)).save_pretrained(out)
    print(f"cost-scaled target: {n_params(src):,} -> {n_params(padded):,} params, max |dlogit| {diff:.1e}")
    return out


def pair_target(args: argparse.Namespace) -> Path:
    """The target a benchmark runs: cost-scaled to --min-params, or as it is
    with --min-params 0."""
    return cost_scaled_target(args.target, args.min_params) if args.min_params > 0 else args.target


def heldout_prompts(tokenizer, n: int, length: int, max_new: int) -> list[list[int]]:
    """n held-out prompts of `length` tokens with room for `max_new` more
    (training/evaluate_pair.py: stdlib files the pair was not trained on, the
    same set on every run), as token id lists."""
    from training.evaluate_pair import make_prompts

    return [p.tolist() for p in make_prompts(tokenizer, n, length, max_new)]


def random_token_pool(tokenizer) -> list[int]:
    """Every token id but the special ones: random prompts for a pair that
    copies its input (an EOS would end a stream at once)."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def random_prompts(pool: Sequence[int], rng: random.Random, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` ids drawn from `pool`."""
    return [[rng.choice(pool) for _ in range(length)] for _ in range(n)]


# ---------------------------------------------------------------- the record of a run


def machine(processor: bool = False) -> str:
    """The machine, torch's threads and version, as the results' meta records them."""
    import torch

    cpu = f", {platform.processor() or 'cpu'}" if processor else ""
    return f"{platform.machine()}, {torch.get_num_threads()} torch threads{cpu}; torch {torch.__version__}"


def utc_now(when: float | None = None) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(when))


def pyplot():
    """matplotlib's pyplot on the Agg backend (files, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_main(argv: list[str] | None, parse, run, report, indent: int = 2) -> int:
    """A benchmark's main from its parts: the flags parsed, the run, its result
    written to --out, the report printed."""
    args = parse(argv)
    result = run(args)
    write_json(args.out, result, indent)
    report(result, args)
    return 0


def write_json(path: Path | str, doc: Any, indent: int = 2) -> None:
    """A result file, its folder made if needed (called after each part of a
    long run, so that a failure later keeps what was measured)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + "\n")


# ---------------------------------------------------------------- statistics


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of values, linear between order statistics; 0.0 for none."""
    return percentile(values, 100 * q) if values else 0.0


def rotated(items: Sequence[T], r: int) -> list[T]:
    """Round r's order: the items rotated by r, so that over the rounds each
    system runs in each place (first, last, ...) in turn, and a drift within a
    round does not always weigh on the same one."""
    if not items:
        return []
    k = r % len(items)
    return list(items[k:]) + list(items[:k])


def alternating(items: Sequence[T], r: int) -> list[T]:
    """Round r's order: as given in even rounds, reversed in odd ones (A B C,
    C B A, ...), so that a drift within a level weighs on every item alike."""
    return list(items) if r % 2 == 0 else list(items)[::-1]


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> dict:
    """a over b from paired rounds (a[i] ran in the same round as b[i]): the
    per-round ratios, their geometric mean, and the interval (None with fewer
    than 3 rounds: two ratios say nothing about the spread)."""
    if len(a) != len(b):
        raise ValueError(f"paired rounds differ in number: {len(a)} vs {len(b)}")
    per_round = [x / y for x, y in zip(a, b) if x > 0 and y > 0]
    return {
        "geomean": round(statistics.geometric_mean(per_round), 4) if per_round else None,
        "interval": log_ratio_interval(a, b),
        "rounds": [round(x, 4) for x in per_round],
    }


def ratio_interval(a: dict, b: dict, z: float = 2.0) -> list[float] | None:
    """The interval of a's tokens/s over b's from their `rounds_tokens_per_s`
    (round i of a against round i of b, which ran next to it)."""
    return log_ratio_interval(a["rounds_tokens_per_s"], b["rounds_tokens_per_s"], z)


def best_setting(vs_base: dict[str, dict]) -> str | None:
    """The setting with the highest point ratio (geometric mean) over the base;
    None when there is none."""
    scored = {k: v["geomean"] for k, v in vs_base.items() if v.get("geomean") is not None}
    return max(scored, key=lambda k: scored[k]) if scored else None


def goal_check(ratio: dict, goal: float) -> dict:
    """Whether a ratio's interval clears a goal: its LOWER bound must be at
    least the goal (the point ratio alone does not make the claim). met is
    None when there is no interval (too few rounds to tell)."""
    lower = ratio["interval"][0] if ratio.get("interval") else None
    return {
        "goal": goal,
        "point": ratio.get("geomean"),
        "lower_bound": lower,
        "met": None if lower is None else lower >= goal,
    }


def fmt_ratio(ratio: dict | None) -> str:
    """'1.23 (1.20-1.26)'; the interval as 'no interval' below 3 rounds."""
    if not ratio or ratio.get("geomean") is None:
        return ""
    iv = ratio.get("interval")
    return f"{ratio['geomean']:.3f} ({iv[0]:.3f}-{iv[1]:.3f})" if iv else f"{ratio['geomean']:.3f} (no interval)"


def goal_line(what: str, check: dict) -> str:
    """One line saying plainly whether a goal is met by the interval's lower bound."""
    if check["met"] is None:
        verdict = "NOT ESTABLISHED (no interval: fewer than 3 rounds)"
    elif check["met"]:
        verdict = f"MET (lower bound {check['lower_bound']:.3f} >= {check['goal']})"
    else:
        verdict = f"NOT MET (lower bound {check['lower_bound']:.3f} < {check['goal']})"
    point = "" if check["point"] is None else f"point {check['point']:.3f}, "
    return f"{what}: {point}goal {check['goal']}: {verdict}"


def cell(v: object) -> str:
    """A table cell: blank for None, 3 significant digits for a float."""
    if v is None:
        return ""
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def all_at_once(job: Callable[[int], T], n: int, what: str = "streams") -> tuple[list[T], float]:
    """job(0) .. job(n-1), each in a thread of its own, started together:
    their results in order and the wall time from the first start to the last
    end. Any that failed fail the whole (a round with a failed stream says
    nothing of the system's speed), naming the first error."""
    outs: list = [None] * n

    def run(i: int) -> None:
        try:
            outs[i] = job(i)
        except Exception as e:  # reported below: the round failed
            outs[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    failed = [o for o in outs if isinstance(o, Exception)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {n} {what} failed: {type(failed[0]).__name__}: {failed[0]}")
    return outs, wall
