"""Batch-1 speedup benchmark: specd vs target-only decoding through the same
services, vs Hugging Face assisted generation, vs theory.

    python -m benchmarks.speedup                 # demo pair, cost-scaled target
    python -m benchmarks.speedup --quick         # fewer prompts / tokens (smoke run)

Everything is measured in ONE run on the same machine, so only ratios are
reported as results. The target is the trained demo target padded to >= 100 M
parameters by function-preserving layers (training/pad_target.py): its logits,
hence acceptance, are those of the trained pair, its cost that of a mid-size
model. Prompts are held-out stdlib files (training/corpus.py split).
Writes benchmarks/results/speedup.json and speedup.png and prints a table.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specd.ops.local_stack import Stack
from specd.runtime.models import load_model, load_tokenizer

from .costs import expected_tokens_per_cycle, predicted_speedup
from .tree_search import load_searched

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DRAFTS = ["off", "2", "3", "4", "6", "10"]
# Trees vs chains at equal verified draft tokens per cycle (6, 10, 12, 16), run
# in fp32: in bf16 a 1 M-parameter drafter loses acceptance to rounding, which
# would measure bf16 rather than tree shapes. searched-N: the tree that
# benchmarks/tree_search.py finds for N nodes on calibration prompts (not these).
TREE_DRAFTS = ["6", "10", "12", "16", "tree-2,1,1", "tree-1,1,1,1,2", "tree-2,1,1,1,1", "tree-1,1,1,1,1,1,1,1,2",
               "searched-6", "searched-10", "searched-12", "searched-16", "dyn-10x10", "dyn-16x12"]
RESULTS = ROOT / "benchmarks/results"
TREES_FILE = RESULTS / "trees.json"
CACHE = ROOT / "benchmarks/.cache"


@dataclass(frozen=True)
class Draft:
    """One speculation setting of the benchmark: a chain of K or a tree."""
    label: str               # "off", "chain-4", "tree-3,1,1", "dyn-6"
    fields: tuple = ()       # GenerateRequest fields, as (name, value) pairs

    @staticmethod
    def parse(text: str) -> "Draft":
        if text in ("0", "off"):
            return Draft("off", (("num_speculative_tokens", 0),))
        if text.startswith("ngram-"):
            return Draft(text, (("speculative_method", "ngram"), ("num_speculative_tokens", int(text[6:]))))
        if text.startswith("tree-"):
            return Draft(text, (("tree", {"branching": [int(x) for x in text[5:].split(",")]}),))
        if text.startswith("searched-"):
            paths = load_searched(TREES_FILE, int(text[9:]))
            if paths is None:
                raise SystemExit(f"{text}: no {text[9:]}-node tree in {TREES_FILE}; run python -m benchmarks.tree_search")
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
    system: str              # "specd" | "hf-assisted" | "hf-target-only"
    mode: str                # "greedy" | "T=0.8" (+ " code-edit" for the code-edit prompt set)
    draft: Draft | None      # specd's setting; None for HF
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
        ids, last = stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=max_new,
                                   temperature=temp, seed=i, **dict(draft.fields))
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
    kwargs = dict(do_sample=False) if mode == "greedy" else dict(do_sample=True, temperature=0.8, top_p=1.0, top_k=0)
    for i, p in enumerate(prompts):
        torch.manual_seed(i)
        ids = torch.tensor([p])
        start = time.perf_counter()
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new, min_new_tokens=max_new,
                              pad_token_id=0, **kwargs)
        row.seconds += time.perf_counter() - start
        row.tokens += out.shape[1] - len(p)
        row.outputs.append(out[0, len(p):].tolist())
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


class OtlpSink:
    """A real OTLP/gRPC trace receiver that counts and drops spans, so that the
    traced services pay the full export cost (a missing collector would make
    exports fail fast and understate it)."""

    def __init__(self):
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc

        sink = self
        self.spans = 0

        class Servicer(tgrpc.TraceServiceServicer):
            def Export(self, request, context):
                sink.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                return tpb.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        tgrpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self):
        self.server.stop(0)


def pct(values, q) -> float:
    return float(torch.tensor(values).quantile(q)) if values else 0.0


def summarise(rows: list[Row]) -> list[dict]:
    """One dict per row with the derived figures (speedups, theory, overhead)."""
    out = []
    for r in rows:
        base = next(b for b in rows if b.system == "specd" and b.mode == r.mode and b.draft.label == "off")
        d = dict(system=r.system, mode=r.mode, draft=r.draft.label if r.draft else "",
                 nodes=r.draft.nodes if r.draft else None, tokens=r.tokens, seconds=round(r.seconds, 3),
                 tokens_per_s=round(r.tokens_per_s, 2),
                 speedup_vs_target_only=round(r.tokens_per_s / base.tokens_per_s, 3))
        if r.system == "specd":
            t1 = base.verify_ms / base.cycles
            d["method"] = "ngram" if r.draft.label.startswith("ngram-") else (
                "off" if r.draft.label == "off" else "draft_model")
            d.update(alpha=round(r.alpha, 4), mean_accepted_length=round(r.mean_accepted_length, 3),
                     overhead_ms_p50=round(pct(r.overheads_ms, 0.5), 3),
                     overhead_ms_p90=round(pct(r.overheads_ms, 0.9), 3),
                     verify_ms_per_cycle=round(r.verify_ms / r.cycles, 2),
                     draft_ms_per_cycle=round(r.draft_ms / r.cycles, 2))
            if r.draft.label != "off":
                chain = r.draft.label.startswith(("chain-", "ngram-"))
                # Theory (docs/rules.md, "Expected tokens per cycle and predicted
                # speedup"): tokens per cycle / cycle cost in target steps,
                # from the measured costs. Two tokens-per-cycle inputs: the i.i.d.
                # formula from the per-token acceptance (chains only; it assumes
                # independent acceptances, which real text is not), and the
                # measured tokens per cycle. Efficiency uses the latter, so it
                # isolates what the model leaves out: network, orchestration.
                t_cycle = (r.verify_ms / r.cycles, t1, r.draft_ms / r.cycles)
                pred = predicted_speedup(r.mean_accepted_length, *t_cycle)
                d.update(predicted_speedup=round(pred, 3),
                         efficiency=round(d["speedup_vs_target_only"] / pred, 3))
                if chain:
                    iid = expected_tokens_per_cycle(r.alpha, r.draft.nodes)
                    d.update(expected_tokens_per_cycle=round(iid, 3),
                             predicted_speedup_iid=round(predicted_speedup(iid, *t_cycle), 3))
                if r.mode.startswith("greedy"):
                    same = sum(a == b for a, b in zip(r.outputs, base.outputs))
                    d["greedy_outputs_equal_target_only"] = f"{same}/{len(base.outputs)}"
        out.append(d)
    for d in out:   # specd vs HF assisted on the same pair, same mode
        hf = next((x for x in out if x["system"] == "hf-assisted" and x["mode"] == d["mode"]), None)
        if hf and d["system"] == "specd" and d["draft"] != "off":
            d["vs_hf_assisted"] = round(d["tokens_per_s"] / hf["tokens_per_s"], 3)
    return out


def table(summary: list[dict]) -> str:
    cols = ["system", "mode", "draft", "nodes", "tokens_per_s", "speedup_vs_target_only", "vs_hf_assisted", "alpha",
            "mean_accepted_length", "expected_tokens_per_cycle", "predicted_speedup_iid", "predicted_speedup",
            "efficiency",
            "overhead_ms_p50", "overhead_ms_p90", "greedy_outputs_equal_target_only", "tracing_cost"]
    short = ["system", "mode", "draft", "nodes", "tok/s", "speedup", "vs HF", "alpha", "acc.len", "E[len] iid",
             "pred. iid", "pred.",
             "effic.", "ovh p50 ms", "ovh p90 ms", "= target-only", "trace cost"]
    lines = ["| " + " | ".join(short) + " |", "|" + "---|" * len(cols)]
    for d in summary:
        lines.append("| " + " | ".join("" if d.get(c) is None else str(d.get(c)) for c in cols) + " |")
    return "\n".join(lines)


TREE_MODE = "greedy fp32 trees"


def tree_vs_chain(summary: list[dict]) -> list[dict]:
    """Per number of verified draft tokens: the best chain's and the best tree's
    mean accepted length (greedy)."""
    out = []
    rows = [d for d in summary if d["system"] == "specd" and d["mode"] == TREE_MODE and d["draft"] != "off"
            and d["method"] == "draft_model"]
    for n in sorted({d["nodes"] for d in rows}):
        chains = [d for d in rows if d["nodes"] == n and d["draft"].startswith("chain-")]
        trees = [d for d in rows if d["nodes"] == n and not d["draft"].startswith("chain-")]
        if chains and trees:
            c = max(chains, key=lambda d: d["mean_accepted_length"])
            t = max(trees, key=lambda d: d["mean_accepted_length"])
            out.append(dict(nodes=n, best_chain=c["draft"], chain_accepted_length=c["mean_accepted_length"],
                            best_tree=t["draft"], tree_accepted_length=t["mean_accepted_length"],
                            tree_beats_chain=t["mean_accepted_length"] > c["mean_accepted_length"]))
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
            ax.plot(*zip(*pts), marker, ls="", ms=9, label={"tree-": "static tree (branching)",
                    "searched-": "searched tree (paths)", "dyn-": "dynamic tree"}[kind])
    ax.set_xlabel("draft tokens verified per cycle")
    ax.set_ylabel("mean accepted length (tokens / cycle)")
    ax.set_title("Trees vs chains, demo pair, greedy, held-out prompts (fp32)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    modes = sorted({d["mode"] for d in summary})
    labels = [d["draft"] for d in summary if d["system"] == "specd" and d["mode"] == modes[0]]
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        rows = {d["draft"]: d for d in summary if d["mode"] == mode and d["system"] == "specd"}
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, [rows[l]["tokens_per_s"] if l in rows else 0 for l in labels], width,
               label=f"specd measured ({mode})", color=f"C{i}")
        base = rows["off"]["tokens_per_s"]
        ax.plot([x for x, l in zip(xs, labels) if rows.get(l, {}).get("predicted_speedup")],
                [base * rows[l]["predicted_speedup"] for l in labels if rows.get(l, {}).get("predicted_speedup")],
                "kx", label="theory" if i == 0 else None)
        hf = next((d for d in summary if d["system"] == "hf-assisted" and d["mode"] == mode), None)
        if hf:
            ax.axhline(hf["tokens_per_s"], color=f"C{i}", ls=":", label=f"HF assisted ({mode})")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=30, fontsize=8)
    ax.set_ylabel("tokens/s (batch 1)")
    ax.set_title("specd speedup, cost-scaled demo target")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_pair_args(ap) -> None:
    """The model pair of a benchmark: the demo pair, the target cost-scaled."""
    ap.add_argument("--target", type=Path, default=ROOT / "models/demo/target")
    ap.add_argument("--drafter", type=Path, default=ROOT / "models/demo/drafter")
    ap.add_argument("--min-params", type=int, default=100_000_000, help="cost-scaled target size")


def main(argv=None) -> int:
    from training.evaluate_pair import make_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(ap)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--drafts", nargs="+", default=DEFAULT_DRAFTS,
                    help="specd settings: off, K (a chain), tree-B1,B2,.. (static tree), dyn-N[xDEPTH] (dynamic)")
    ap.add_argument("--sampled-drafts", nargs="+", default=["off", "3", "4", "6", "tree-2,1,1", "dyn-6x4"],
                    help="settings run at temperature 0.8 (default: a subset of --drafts)")
    ap.add_argument("--modes", default="greedy,T=0.8")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="model dtype for every system (bf16 halves the weight traffic of a CPU decode step)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0 = torch default)")
    ap.add_argument("--tree-drafts", nargs="+", default=TREE_DRAFTS,
                    help="settings run greedy in fp32 for the tree-vs-chain table; none to skip")
    ap.add_argument("--traced-drafts", nargs="+", default=["off", "4"],
                    help="settings re-run (greedy) with tracing on at 100%% sampling; none to skip")
    ap.add_argument("--code-edit-drafts", nargs="+", default=["off", "ngram-2", "ngram-5", "4"],
                    help="settings run (greedy) on the code-edit prompts; none to skip")
    ap.add_argument("--quick", action="store_true", help="3 prompts, 32 tokens, a few drafts")
    ap.add_argument("--out", type=Path, default=RESULTS / "speedup.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.drafts = 3, 32, ["off", "3", "tree-2,1,1", "dyn-6"]
        args.code_edit_drafts = ["off", "ngram-5"]
        args.tree_drafts = ["6", "searched-6", "dyn-6x4"]
        args.sampled_drafts = ["off", "3"]
        args.traced_drafts = ["off", "3"]

    target = cost_scaled_target(args.target, args.min_params)
    tok = load_tokenizer(str(args.target))
    prompts = [p.tolist() for p in make_prompts(tok, args.prompts, args.prompt_tokens, args.max_new_tokens)]
    edits = code_edit_prompts(tok, prompts)
    drafts = [Draft.parse(d) for d in args.drafts]
    if drafts[0].label != "off":
        drafts.insert(0, Draft.parse("off"))       # the baseline every ratio uses
    modes = args.modes.split(",")

    rows: list[Row] = []
    service_args = ("--dtype", args.dtype) + (("--torch-threads", str(args.threads)) if args.threads else ())
    stack = Stack(str(target), str(args.drafter), service_args)
    try:
        run_specd(stack, prompts[:1], Draft.parse("2"), "greedy", 8)   # warm-up: first-call costs
        sampled = [Draft.parse(d) for d in args.sampled_drafts]
        if sampled[0].label != "off":
            sampled.insert(0, Draft.parse("off"))
        for mode in modes:
            for draft in drafts if mode == "greedy" else sampled:
                rows.append(run_specd(stack, prompts, draft, mode, args.max_new_tokens))
                print(f"specd {mode} {draft.label}: {rows[-1].tokens_per_s:.1f} tok/s "
                      f"(accepted length {rows[-1].mean_accepted_length:.2f})", flush=True)
        edit_drafts = [Draft.parse(d) for d in args.code_edit_drafts if d != "none"]
        if edit_drafts and edit_drafts[0].label != "off":
            edit_drafts.insert(0, Draft.parse("off"))
        for draft in edit_drafts:
            row = run_specd(stack, edits, draft, "greedy", args.max_new_tokens)
            row.mode = "greedy code-edit"
            rows.append(row)
            print(f"specd code-edit {draft.label}: {row.tokens_per_s:.1f} tok/s "
                  f"(accepted length {row.mean_accepted_length:.2f})", flush=True)
    finally:
        stack.stop()

    searched = sorted({int(d[9:]) for d in args.tree_drafts if d.startswith("searched-")})
    if searched and not all(load_searched(TREES_FILE, n, "float32") for n in searched):
        from .tree_search import search
        TREES_FILE.write_text(json.dumps(search(args.target, args.drafter, searched, "float32"), indent=1))
    tree_drafts = [Draft.parse(d) for d in args.tree_drafts if d != "none"]
    if tree_drafts:
        # fp32: the padded target's logits equal the demo target's exactly, so the
        # searched trees (found on the demo target in fp32) apply as they are.
        tree_args = ("--dtype", "float32") + service_args[2:]
        stack = Stack(str(target), str(args.drafter), tree_args)
        try:
            run_specd(stack, prompts[:1], Draft.parse("2"), "greedy", 8)
            for draft in [Draft.parse("off")] + tree_drafts:
                row = run_specd(stack, prompts, draft, "greedy", args.max_new_tokens)
                row.mode = TREE_MODE
                rows.append(row)
                print(f"specd fp32 {draft.label}: {row.tokens_per_s:.1f} tok/s "
                      f"(accepted length {row.mean_accepted_length:.2f})", flush=True)
        finally:
            stack.stop()

    traced = [Draft.parse(d) for d in args.traced_drafts if d != "none"]
    if traced:
        if traced[0].label != "off":
            traced.insert(0, Draft.parse("off"))
        sink = OtlpSink()
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.port}", "OTEL_TRACES_SAMPLER": "always_on"}
        stack = Stack(str(target), str(args.drafter), service_args, env=env)
        try:
            run_specd(stack, prompts[:1], Draft.parse("2"), "greedy", 8)
            for draft in traced:
                row = run_specd(stack, prompts, draft, "greedy", args.max_new_tokens)
                row.mode = "greedy traced"
                rows.append(row)
                print(f"specd traced {draft.label}: {row.tokens_per_s:.1f} tok/s", flush=True)
        finally:
            stack.stop()
            sink.stop()
        print(f"spans received by the OTLP sink: {sink.spans}")

    # Hugging Face assisted generation with the same pair, in one process.
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_target = load_model(str(target), "cpu", args.dtype)
    hf_drafter = load_model(str(args.drafter), "cpu", args.dtype)
    run_hf(hf_target, hf_drafter, prompts[:1], "greedy", 8)
    for mode in modes:
        rows.append(run_hf(hf_target, hf_drafter, prompts, mode, args.max_new_tokens))
        print(f"hf-assisted {mode}: {rows[-1].tokens_per_s:.1f} tok/s", flush=True)
    rows.append(run_hf(hf_target, None, prompts, "greedy", args.max_new_tokens))

    summary = summarise(rows)
    meta = dict(machine=f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
                        f"{platform.processor() or 'cpu'}; torch {torch.__version__}",
                target=str(target), drafter=str(args.drafter), prompts=len(prompts), dtype=args.dtype,
                prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    trees = tree_vs_chain(summary)
    for d in summary:   # tracing cost: traced tokens/s vs the same setting untraced
        if d["mode"] == "greedy traced":
            plain = next((x for x in summary if x["mode"] == "greedy" and x["draft"] == d["draft"]), None)
            if plain:
                d["tracing_cost"] = round(1 - d["tokens_per_s"] / plain["tokens_per_s"], 3)
    args.out.write_text(json.dumps(dict(meta=meta, rows=summary, tree_vs_chain=trees), indent=2))
    plot(summary, args.out.with_suffix(".png"))
    tree_rows = [d for d in summary if d["mode"] == TREE_MODE and d["draft"] != "off"]
    if tree_rows:
        plot_trees(tree_rows, args.out.with_name("trees.png"))
    print(table(summary))
    if trees:
        print("\nTree vs chain at equal verified draft tokens per cycle (greedy, mean accepted length):")
        for t in trees:
            print(f"  {t['nodes']:>3} nodes: best chain {t['best_chain']} {t['chain_accepted_length']:.3f}"
                  f" | best tree {t['best_tree']} {t['tree_accepted_length']:.3f}"
                  f" -> tree {'beats' if t['tree_beats_chain'] else 'does NOT beat'} chain")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
