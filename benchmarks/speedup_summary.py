"""The batch-1 speedup benchmark's records and what is made of them (pure, but
for the plots): a speculation setting (`Draft`), one system's run over the
prompts of a round (`Row`), each system's figures over its rounds, the ratios
between the systems with their intervals, theory, the best setting and its
goals, trees against chains, and the tables and figures `benchmarks/speedup.py`
prints and draws. The statistics are benchmarks/common.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .common import RESULTS, best_setting, cell, fmt_ratio, goal_check, goal_line, paired_ratio, pct, pyplot
from .costs import expected_tokens_per_cycle, predicted_speedup
from .tree_search import load_searched

TREES_FILE = RESULTS / "trees.json"
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


def method(draft: Draft) -> str:
    """The speculative method a setting runs (GenerationStats.method's values)."""
    if draft.label == "off":
        return "off"
    return "ngram" if draft.label.startswith("ngram-") else "draft_model"


# ---------------------------------------------------------------- summaries


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

    vs_off: dict[str, dict] = {}
    vs_hf: dict[str, dict | None] = {}
    for s in [*settings, HF_ASSISTED, HF_TARGET]:
        r = add(s, "off")
        if r and s in settings:
            vs_off[s] = r
    for s in settings:
        vs_hf[s] = add(s, HF_ASSISTED)
    add(HF_ASSISTED, HF_TARGET)

    add_theory(systems, settings, vs_off)
    best = best_setting(vs_off)
    verdict = None
    if best is not None:
        verdict = {"setting": best, "vs_off": goal_check(vs_off[best], goal_vs_off)}
        hf = vs_hf.get(best)
        if hf:
            verdict["vs_hf_assisted"] = goal_check(hf, goal_vs_hf)
    return {"systems": systems, "ratios": ratios, "best": verdict}


def add_theory(systems: dict[str, dict], settings: list[str], vs_off: dict[str, dict]) -> None:
    """Each setting's predicted speedup and its efficiency (measured over
    predicted), written into its figures."""
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


def goal_lines(mode: str, verdict: dict | None) -> list[str]:
    """What the best setting of a mode achieved against each goal, plainly."""
    if verdict is None:
        return [f"{mode}: no speculative setting measured"]
    lines = [f"{mode}: best setting {verdict['setting']} (by its point ratio over off)"]
    lines.append("  " + goal_line(f"{verdict['setting']} / off", verdict["vs_off"]))
    if "vs_hf_assisted" in verdict:
        lines.append("  " + goal_line(f"{verdict['setting']} / HF assisted", verdict["vs_hf_assisted"]))
    return lines


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
    plt = pyplot()

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
    plt = pyplot()

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


# ---------------------------------------------------------------- tables and figures


def comparison_table(summary: dict) -> str:
    """One mode's systems as a Markdown table: tok/s (all rounds pooled), the
    ratios with their intervals, and the per-cycle figures of specd's settings.
    `summary`: benchmarks.speedup's per-mode summary (systems, ratios)."""
    ratios = {(r["a"], r["b"]): r for r in summary["ratios"]}
    head = (
        "| system | tok/s | x off (interval) | x HF assisted (interval) | x HF target-only (interval) "
        "| accepted length | alpha | predicted x | overhead p50 / p90 ms | verify / draft ms per cycle "
        "| greedy = off |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for name, d in summary["systems"].items():
        cols = [
            name,
            cell(d["tokens_per_s"]),
            fmt_ratio(ratios.get((name, "off"))),
            fmt_ratio(ratios.get((name, "hf-assisted"))),
            fmt_ratio(ratios.get((name, "hf-target-only"))),
            cell(d.get("mean_accepted_length")),
            cell(d.get("alpha")),
            cell(d.get("predicted_speedup")),
            f"{d['overhead_ms_p50']:.2f} / {d['overhead_ms_p90']:.2f}" if "overhead_ms_p50" in d else "",
            f"{d['verify_ms_per_cycle']:.1f} / {d['draft_ms_per_cycle']:.1f}" if "verify_ms_per_cycle" in d else "",
            d.get("greedy_outputs_equal_off", ""),
        ]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)
