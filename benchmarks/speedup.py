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
(benchmarks/ratios.py). The best setting per mode is picked by its point ratio
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
Writes benchmarks/results/speedup.json (--out) and its .png, prints the tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specd.bench import percentile
from specd.local_stack import Stack
from specd_core.runtime.models import load_model, load_tokenizer

from .costs import expected_tokens_per_cycle, predicted_speedup
from .otlp import UNTRACED_ENV, OtlpSink
from .ratios import best_setting, comparison_table, goal_check, goal_line, paired_ratio, rotated, tracing_table
from .tree_search import load_searched

ROOT = Path(__file__).resolve().parents[1]
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
RESULTS = ROOT / "benchmarks/results"
TREES_FILE = RESULTS / "trees.json"
CACHE = ROOT / "benchmarks/.cache"
HF_ASSISTED, HF_TARGET = "hf-assisted", "hf-target-only"
TREE_MODE = "greedy fp32 trees"
CODE_EDIT_MODE = "greedy code-edit"


@dataclass(frozen=True)
class Draft:
    """One speculation setting of the benchmark: a chain of K or a tree."""

    label: str  # "off", "chain-4", "tree-3,1,1", "dyn-6"
    fields: tuple = ()  # GenerateRequest fields, as (name, value) pairs

    @staticmethod
    def parse(text: str) -> Draft:
        if text in ("0", "off"):
            return Draft("off", (("num_speculative_tokens", 0),))
        if text.startswith("ngram-"):
            return Draft(text, (("speculative_method", "ngram"), ("num_speculative_tokens", int(text[6:]))))
        if text.startswith("tree-"):
            return Draft(text, (("tree", {"branching": [int(x) for x in text[5:].split(",")]}),))
        if text.startswith("searched-"):
            paths = load_searched(TREES_FILE, int(text[9:]))
            if paths is None:
                raise SystemExit(
                    f"{text}: no {text[9:]}-node tree in {TREES_FILE}; run python -m benchmarks.tree_search"
                )
            return Draft(text, (("tree", {"paths": [{"ranks": p} for p in paths]}),))
        if text.startswith("dyn-"):
            n, _, depth = text[4:].partition("x")
            return Draft(text, (("tree", {"node_budget": int(n), "max_depth": int(depth or 6)}),))
        return Draft(f"chain-{int(text)}", (("num_speculative_tokens", int(text)),))

    @property
    def nodes(self) -> int:
        """Draft tokens verified per cycle (the most, for a dynamic tree)."""
        f = dict(self.fields)
        if "tree" in f:
            t = f["tree"]
            if "node_budget" in t:
                return t["node_budget"]
            if "paths" in t:
                return len(t["paths"])
            total, level = 0, 1
            for b in t["branching"]:
                level *= b
                total += level
            return total
        return f["num_speculative_tokens"]


@dataclass
class Row:
    system: str  # "specd" | "hf-assisted" | "hf-target-only"
    mode: str  # "greedy" | "T=0.8" (+ " code-edit" for the code-edit prompt set)
    draft: Draft | None  # specd's setting; None for HF
    tokens: int = 0
    seconds: float = 0.0
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    overheads_ms: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted + self.cycles) / self.cycles if self.cycles else 0.0


def cost_scaled_target(target: Path, min_params: int) -> Path:
    """Build (once, cached) the padded target; prove its logits unchanged."""
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


def run_specd(stack: Stack, prompts, draft: Draft, mode: str, max_new: int) -> Row:
    row = Row("specd", mode, draft)
    temp = 0.0 if mode == "greedy" else 0.8
    for i, p in enumerate(prompts):
        start = time.perf_counter()
        ids, last = stack.generate(
            prompt_token_ids={"ids": p}, max_new_tokens=max_new, temperature=temp, seed=i, **dict(draft.fields)
        )
        row.seconds += time.perf_counter() - start
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


def add_pair_args(ap) -> None:
    """The model pair of a benchmark: the demo pair, the target cost-scaled."""
    ap.add_argument("--target", type=Path, default=ROOT / "models/demo/target")
    ap.add_argument("--drafter", type=Path, default=ROOT / "models/demo/drafter")
    ap.add_argument("--min-params", type=int, default=100_000_000, help="cost-scaled target size")


def pct(values, q) -> float:
    """The q-quantile (0..1) of values, linear between order statistics; 0.0 for none."""
    return percentile(values, 100 * q) if values else 0.0


def method(draft: Draft) -> str:
    """The speculative method a setting runs (GenerationStats.method's values)."""
    if draft.label == "off":
        return "off"
    return "ngram" if draft.label.startswith("ngram-") else "draft_model"


# ---------------------------------------------------------------- the comparison


def compare(
    stack: Stack, hf_pair, prompts, drafts: list[Draft], mode: str, rounds: int, max_new: int
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


def pooled(rows: list[Row]) -> Row:
    """A system's rows (its rounds) summed into one."""
    out = Row(rows[0].system, rows[0].mode, rows[0].draft)
    for r in rows:
        out.tokens += r.tokens
        out.seconds += r.seconds
        out.cycles += r.cycles
        out.drafted += r.drafted
        out.accepted += r.accepted
        out.draft_ms += r.draft_ms
        out.verify_ms += r.verify_ms
        out.overheads_ms += r.overheads_ms
        out.outputs += r.outputs
    return out


def figures(rows: list[Row], off: list[Row] | None) -> dict:
    """One system over its rounds: tokens/s (all rounds pooled, and per round);
    for specd the per-cycle figures (accepted length with the bonus token,
    alpha, overhead percentiles, verify and draft compute); and, greedy, how
    many of its outputs equal speculation off's on the same prompt in the same
    round (`off`: off's rows; None for off itself)."""
    p = pooled(rows)
    d: dict = {
        "tokens": p.tokens,
        "seconds": round(p.seconds, 3),
        "tokens_per_s": round(p.tokens_per_s, 2),
        "rounds_tokens_per_s": [round(r.tokens_per_s, 3) for r in rows],
    }
    if p.draft is not None:
        d.update(draft=p.draft.label, nodes=p.draft.nodes)
    if p.cycles:
        d.update(
            cycles=p.cycles,
            mean_accepted_length=round(p.mean_accepted_length, 3),
            alpha=round(p.alpha, 4) if p.drafted else None,
            overhead_ms_p50=round(pct(p.overheads_ms, 0.5), 3),
            overhead_ms_p90=round(pct(p.overheads_ms, 0.9), 3),
            verify_ms_per_cycle=round(p.verify_ms / p.cycles, 2),
            draft_ms_per_cycle=round(p.draft_ms / p.cycles, 2),
        )
    if off is not None and p.mode.startswith("greedy"):
        pairs = [(a, b) for r, o in zip(rows, off) for a, b in zip(r.outputs, o.outputs)]
        d["greedy_outputs_equal_off"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    return d


def summarise_mode(by_system: dict[str, list[Row]], goal_vs_off: float, goal_vs_hf: float) -> dict:
    """One mode's systems (rows per round, paired by round) into figures per
    system, ratios with intervals (every system over off; each specd setting
    over HF assisted; HF assisted over HF target-only), theory, and the best
    setting by its point ratio over off with its goals checked on the
    intervals' lower bounds."""
    off = by_system["off"]
    systems = {name: figures(rows, None if name == "off" else off) for name, rows in by_system.items()}
    settings = [s for s in by_system if s not in ("off", HF_ASSISTED, HF_TARGET)]
    ratios = []

    def add(a: str, b: str) -> dict | None:
        if a not in systems or b not in systems:
            return None
        ratios.append(
            {"a": a, "b": b, **paired_ratio(systems[a]["rounds_tokens_per_s"], systems[b]["rounds_tokens_per_s"])}
        )
        return ratios[-1]

    vs_off, vs_hf = {}, {}
    for s in [*settings, HF_ASSISTED, HF_TARGET]:
        r = add(s, "off")
        if r and s in settings:
            vs_off[s] = r
    for s in settings:
        vs_hf[s] = add(s, HF_ASSISTED)
    add(HF_ASSISTED, HF_TARGET)

    # Theory (docs/rules.md, "Expected tokens per cycle and predicted
    # speedup"): tokens per cycle / cycle cost in target steps, from the
    # measured costs. Two tokens-per-cycle inputs: the i.i.d. formula from the
    # per-token acceptance (chains only; it assumes independent acceptances,
    # which real text is not), and the measured tokens per cycle. Efficiency
    # uses the latter, so it isolates what the model leaves out: network,
    # orchestration.
    t1 = systems["off"].get("verify_ms_per_cycle")
    for s in settings:
        d = systems[s]
        if not t1 or "mean_accepted_length" not in d:
            continue
        t_cycle = (d["verify_ms_per_cycle"], t1, d["draft_ms_per_cycle"])
        pred = predicted_speedup(d["mean_accepted_length"], *t_cycle)
        d["predicted_speedup"] = round(pred, 3)
        if vs_off[s]["geomean"]:
            d["efficiency"] = round(vs_off[s]["geomean"] / pred, 3)
        if s.startswith(("chain-", "ngram-")) and d.get("alpha") is not None:
            iid = expected_tokens_per_cycle(d["alpha"], d["nodes"])
            d.update(
                expected_tokens_per_cycle=round(iid, 3),
                predicted_speedup_iid=round(predicted_speedup(iid, *t_cycle), 3),
            )

    best = best_setting(vs_off)
    verdict = None
    if best is not None:
        verdict = {"setting": best, "vs_off": goal_check(vs_off[best], goal_vs_off)}
        if vs_hf.get(best):
            verdict["vs_hf_assisted"] = goal_check(vs_hf[best], goal_vs_hf)
    return {"systems": systems, "ratios": ratios, "best": verdict}


def goal_lines(mode: str, verdict: dict | None) -> list[str]:
    """What the best setting of a mode achieved against each goal, plainly."""
    if verdict is None:
        return [f"{mode}: no speculative setting measured"]
    lines = [f"{mode}: best setting {verdict['setting']} (by its point ratio over off)"]
    lines.append("  " + goal_line(f"{verdict['setting']} / off", verdict["vs_off"]))
    if "vs_hf_assisted" in verdict:
        lines.append("  " + goal_line(f"{verdict['setting']} / HF assisted", verdict["vs_hf_assisted"]))
    return lines


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
        dict(system="specd", mode=mode, method=method(r.draft), **figures([r], None if i == 0 else rows[:1]))
        for i, r in enumerate(rows)
    ]


def tree_vs_chain(summary: list[dict]) -> list[dict]:
    """Per number of verified draft tokens: the best chain's and the best tree's
    mean accepted length (greedy)."""
    out = []
    rows = [
        d
        for d in summary
        if d["system"] == "specd" and d["mode"] == TREE_MODE and d["draft"] != "off" and d["method"] == "draft_model"
    ]
    for n in sorted({d["nodes"] for d in rows}):
        chains = [d for d in rows if d["nodes"] == n and d["draft"].startswith("chain-")]
        trees = [d for d in rows if d["nodes"] == n and not d["draft"].startswith("chain-")]
        if chains and trees:
            c = max(chains, key=lambda d: d["mean_accepted_length"])
            t = max(trees, key=lambda d: d["mean_accepted_length"])
            out.append(
                {
                    "nodes": n,
                    "best_chain": c["draft"],
                    "chain_accepted_length": c["mean_accepted_length"],
                    "best_tree": t["draft"],
                    "tree_accepted_length": t["mean_accepted_length"],
                    "tree_beats_chain": t["mean_accepted_length"] > c["mean_accepted_length"],
                }
            )
    return out


def plot_trees(trees_rows: list[dict], path: Path) -> None:
    """Mean accepted length against draft nodes: chains as a line, trees as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    chains = sorted((d["nodes"], d["mean_accepted_length"]) for d in trees_rows if d["draft"].startswith("chain-"))
    ax.plot(*zip(*chains), "k-o", label="chain (K = nodes)")
    for kind, marker in (("tree-", "s"), ("searched-", "*"), ("dyn-", "^")):
        pts = [(d["nodes"], d["mean_accepted_length"]) for d in trees_rows if d["draft"].startswith(kind)]
        if pts:
            ax.plot(
                *zip(*pts),
                marker,
                ls="",
                ms=9,
                label={
                    "tree-": "static tree (branching)",
                    "searched-": "searched tree (paths)",
                    "dyn-": "dynamic tree",
                }[kind],
            )
    ax.set_xlabel("draft tokens verified per cycle")
    ax.set_ylabel("mean accepted length (tokens / cycle)")
    ax.set_title("Trees vs chains, demo pair, greedy, held-out prompts (fp32)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(comparison: dict, path: Path) -> None:
    """Each system's tokens/s over speculation off per mode, with the rounds'
    interval as error bars, and the predicted speedup as crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    modes = list(comparison)
    names = [n for n in comparison[modes[0]]["systems"] if n != "off"]
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        vs_off = {r["a"]: r for r in comparison[mode]["ratios"] if r["b"] == "off"}
        xs = [j + i * width for j in range(len(names))]
        ys = [vs_off[n]["geomean"] if n in vs_off else 0.0 for n in names]
        err = [
            [y - (vs_off[n]["interval"] or [y, y])[0] if n in vs_off else 0.0 for n, y in zip(names, ys)],
            [(vs_off[n]["interval"] or [y, y])[1] - y if n in vs_off else 0.0 for n, y in zip(names, ys)],
        ]
        ax.bar(xs, ys, width, yerr=err, capsize=3, label=f"measured ({mode})", color=f"C{i}")
        pred = [(x, comparison[mode]["systems"][n].get("predicted_speedup")) for x, n in zip(xs, names)]
        pred = [(x, p) for x, p in pred if p]
        if pred:
            ax.plot(*zip(*pred), "kx", label="theory" if i == 0 else None)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=30, fontsize=8)
    ax.set_ylabel("tokens/s over speculation off (batch 1)")
    ax.set_title("specd vs off and HF, cost-scaled demo target, alternating rounds (~95 % interval)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def with_off(drafts: list[Draft]) -> list[Draft]:
    """The settings with speculation off first: the baseline every ratio uses."""
    rest = [d for d in drafts if d.label != "off"]
    return [Draft.parse("off"), *rest]


def main(argv=None) -> int:
    from training.evaluate_pair import make_prompts

    from .traced import TRACED, UNTRACED, tracing_cost

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
    ap.add_argument("--quick", action="store_true", help="3 prompts, 32 tokens, 2 rounds, chains of 2 and 4")
    ap.add_argument("--out", type=Path, default=RESULTS / "speedup.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.drafts = 3, 32, ["off", "2", "4"]
        args.tree_drafts, args.code_edit_drafts = ["6", "searched-6", "dyn-6x4"], ["off", "ngram-5"]
    args.rounds = args.rounds or (2 if args.quick else 6)
    modes = [] if args.modes == "none" else args.modes.split(",")
    levels = [] if "none" in args.traced_levels else [int(n) for n in args.traced_levels]

    target = cost_scaled_target(args.target, args.min_params)
    tok = load_tokenizer(str(args.target))
    prompts = [p.tolist() for p in make_prompts(tok, args.prompts, args.prompt_tokens, args.max_new_tokens)]
    drafts = with_off([Draft.parse(d) for d in args.drafts])
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict = {
        "meta": {
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"{platform.processor() or 'cpu'}; torch {torch.__version__}",
            "target": str(target),
            "drafter": str(args.drafter),
            "prompts": len(prompts),
            "dtype": args.dtype,
            "prompt_tokens": args.prompt_tokens,
            "max_new_tokens": args.max_new_tokens,
            "rounds": args.rounds,
            "goal_vs_off": args.goal_vs_off,
            "goal_vs_hf": args.goal_vs_hf,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "comparison": {},
        "schedule": {},
        "tracing": [],
        "extras": [],
        "tree_vs_chain": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # after each part, so a failure later keeps what was measured
        args.out.write_text(json.dumps(result, indent=2))

    # Both stacks are up the whole run (an idle one costs no CPU); only the one
    # measured is driven. The untraced one is untraced even if the shell
    # exports an OTLP endpoint.
    service_args = ("--dtype", args.dtype) + (("--torch-threads", str(args.threads)) if args.threads else ())
    stacks: dict[str, Stack] = {}
    sink = OtlpSink() if levels else None
    try:
        stacks[UNTRACED] = Stack(str(target), str(args.drafter), service_args, env=UNTRACED_ENV)
        if sink is not None:
            stacks[TRACED] = Stack(str(target), str(args.drafter), service_args, env=sink.endpoint_env)
        run_specd(stacks[UNTRACED], prompts[:1], Draft.parse("2"), "greedy", 8)  # warm-up: first-call costs
        if modes:
            hf_pair = (load_model(str(target), "cpu", args.dtype), load_model(str(args.drafter), "cpu", args.dtype))
            for mode in modes:
                run_hf(*hf_pair, prompts[:1], mode, 8)
                run_hf(hf_pair[0], None, prompts[:1], mode, 8)
            for mode in modes:
                rows, result["schedule"][mode] = compare(
                    stacks[UNTRACED], hf_pair, prompts, drafts, mode, args.rounds, args.max_new_tokens
                )
                result["comparison"][mode] = summarise_mode(rows, args.goal_vs_off, args.goal_vs_hf)
                result["comparison"][mode]["rounds"] = {
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
                write()
        if sink is not None:
            traced = Draft.parse(args.traced_draft)
            result["tracing"] = tracing_cost(
                stacks, sink, prompts, traced.label, dict(traced.fields), levels, args.rounds, args.max_new_tokens
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
        searched = sorted({int(d[9:]) for d in args.tree_drafts if d.startswith("searched-")})
        if searched and not all(load_searched(TREES_FILE, n, "float32") for n in searched):
            from .tree_search import search

            TREES_FILE.write_text(json.dumps(search(args.target, args.drafter, searched, "float32"), indent=1))
        # fp32: the padded target's logits equal the demo target's exactly, so the
        # searched trees (found on the demo target in fp32) apply as they are.
        stack = Stack(str(target), str(args.drafter), ("--dtype", "float32") + service_args[2:], env=UNTRACED_ENV)
        try:
            run_specd(stack, prompts[:1], Draft.parse("2"), "greedy", 8)
            tree_drafts = with_off([Draft.parse(d) for d in args.tree_drafts])
            result["extras"] += run_once(stack, prompts, tree_drafts, TREE_MODE, args.max_new_tokens)
        finally:
            stack.stop()
        result["tree_vs_chain"] = tree_vs_chain(result["extras"])
        write()
    write()

    for mode, summary in result["comparison"].items():
        print(
            f"\n## {mode}: {len(prompts)} prompts x {args.max_new_tokens} new tokens, {args.rounds} rounds "
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
    if result["extras"]:
        print("\n## Extras (one run each: accepted length, not a ratio between systems)\n")
    for d in result["extras"]:
        print(
            f"{d['mode']} {d['draft']}: {d['tokens_per_s']} tok/s (one run), accepted length "
            f"{d.get('mean_accepted_length')}, greedy = off {d.get('greedy_outputs_equal_off', '')}"
        )
    tree_rows = [d for d in result["extras"] if d["mode"] == TREE_MODE and d["draft"] != "off"]
    if tree_rows:
        plot_trees(tree_rows, args.out.with_name("trees.png"))
    for t in result["tree_vs_chain"]:
        print(
            f"  {t['nodes']:>3} nodes: best chain {t['best_chain']} {t['chain_accepted_length']:.3f}"
            f" | best tree {t['best_tree']} {t['tree_accepted_length']:.3f}"
            f" -> tree {'beats' if t['tree_beats_chain'] else 'does NOT beat'} chain"
        )
    print(f"\nwrote {args.out}" + (f" and {args.out.with_suffix('.png')}" if result["comparison"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
