"""What decides an engine step's speed on a GPU, measured on the CPU: operator
calls, host syncs and host time per verify step and per draft level, by the
number of sessions in the step.

    python -m benchmarks.engine                  # 1/8/32/64 sessions, ~3 min
    python -m benchmarks.engine --sessions 1 8   # fewer points

The target has Llama-3.1-8B's structure (32 layers, 32 query and 8 KV heads,
llama3 RoPE, untied head, bf16 weights) at a tiny width, so the arithmetic is
near zero and what remains is what a GPU pays as well: one launch per
operator and a stall per host sync. The drafter is the target's first
`--drafter-layers` layers (the same weights, a shorter stack). Both run
through the services' own cores (verifier_svc.core.Verifier,
drafter_svc.core.Drafter) in-process, so the count covers everything a step
does around its forward: admission, masks, acceptance, compaction.

Counted per step with a torch dispatch mode (every ATen operator that runs)
and wrappers on the tensor methods that read device memory from the host:
- `ops`: every ATen operator call;
- `kernel-like`: those that would launch work on a device (views, reshapes,
  slices and other metadata-only operators left out);
- `syncs`: reads of tensor data by the host (.item(), .tolist(), .cpu(),
  .numpy(), a tensor's truth value or int(): each waits for the device);
- `uploads`: tensors made from host data (torch.tensor(...)): on CUDA a copy
  from pageable memory, which the host waits for too.
Host time is the step's wall time on the CPU, the minimum of --reps steps
run without the counters (each step is a real one: sessions advance and the
cache grows). Beside each verify step, its arithmetic floor
(`arithmetic_floor`): the same rows' matrix products and attention alone
(torch's batched products), and the products alone: the least any engine's
step costs on this machine.

Verify steps: chains of K = 4 (5 rows per session) and a static tree
(branching 2, 2: 6 nodes, 7 rows), greedy; and the same chains and trees of
sampled sessions (temperature 0.8, drafts chosen without sampling). The sampled
sessions' uniforms come from their host generators (on any device): their
operators and reads are not counted. Draft steps: a chain of K = 4 (its 4 levels
and the forward of the committed tokens); per level = per step / 4.

Writes benchmarks/results/engine.json (or --out) and prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from drafter_svc.config import DrafterConfig
from drafter_svc.core import Drafter
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams
from specd_core.runtime.propose_call import ProposeCall
from verifier_svc import batch as verifier_batch
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier

from .common import RESULTS, machine, run_main, utc_now
from .gpu import LLAMA3_ROPE

# Operators that only make a new view of existing memory (or copy nothing):
# they cost host time but launch no device work.
METADATA_OPS = {
    "view",
    "_unsafe_view",
    "reshape",
    "alias",
    "as_strided",
    "expand",
    "transpose",
    "t",
    "permute",
    "unsqueeze",
    "squeeze",
    "select",
    "slice",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "detach",
    "lift_fresh",
    "_local_scalar_dense",
    "empty",
    "empty_strided",
    "unfold",
    "narrow",
    "diagonal",
}

TARGET_SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
TREE = DraftShape(branching=(2, 2))
SAMPLED = SamplingParams(temperature=0.8, seed=3)
KINDS = ("verify_chain", "verify_tree", "verify_chain_sampled", "verify_tree_sampled", "draft_chain", "draft_tree")


class OpCounter(TorchDispatchMode):
    """Counts ATen operators by name while active, and host reads of tensor data."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


_HOST_READS = ("tolist", "numpy", "cpu")


@contextlib.contextmanager
def counting():
    """(OpCounter, Counter of host reads by method) for the block's duration.
    .item() / int() / bool() reach the dispatcher as _local_scalar_dense;
    .tolist(), .numpy() and .cpu() (a no-op on CPU tensors) do not, so they are
    wrapped here."""
    reads: Counter[str] = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}
    counter = OpCounter()

    def wrap(name, fn):
        def wrapped(self, *a, **k):
            if not counter.paused:
                reads[name] += 1
            return fn(self, *a, **k)

        return wrapped

    # A sampled session's uniforms come from its generator on the host, on
    # any device: neither their operator nor their read is the device's.
    host_uniforms = getattr(verifier_batch, "uniforms", None)  # None: a checkout from before them

    def uncounted_uniforms(*a, **k):
        assert host_uniforms is not None
        counter.paused = True
        try:
            return host_uniforms(*a, **k)
        finally:
            counter.paused = False

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    if host_uniforms is not None:
        verifier_batch.uniforms = uncounted_uniforms
    try:
        with counter as ops:
            yield ops, reads
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        if host_uniforms is not None:
            verifier_batch.uniforms = host_uniforms


def summarize(ops: Counter, reads: Counter) -> dict[str, int]:
    total = sum(ops.values())
    kernel_like = sum(n for name, n in ops.items() if name not in METADATA_OPS)
    syncs = ops["_local_scalar_dense"] + sum(reads.values())
    return {"ops": total, "kernel_like": kernel_like, "syncs": syncs, "uploads": ops["lift_fresh"]}


def build_pair(root: Path, drafter_layers: int, vocab: int = 4096, **shape: Any) -> tuple[Path, Path]:
    """The 32-layer target and its first-layers drafter, saved as bf16
    checkpoints; `shape` overrides TARGET_SHAPE's fields."""
    torch.manual_seed(0)
    config = LlamaConfig(
        **{**TARGET_SHAPE, **shape},
        vocab_size=vocab,
        rope_parameters=LLAMA3_ROPE,
        max_position_embeddings=16384,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    target = LlamaForCausalLM(config).bfloat16()
    target.save_pretrained(root / "target")
    config.num_hidden_layers = drafter_layers
    drafter = LlamaForCausalLM(config).bfloat16()
    drafter.load_state_dict(target.state_dict(), strict=False)  # the first layers, embeddings and head
    drafter.save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()


def counted_and_timed(step, reps: int) -> dict[str, Any]:
    """One step run under the counters, then `reps` timed without them (the
    dispatch mode slows every operator); `step()` prepares a step's calls
    (untimed) and returns the call that runs it."""
    run = step()
    with counting() as (ops, reads):
        results = run()
    counts = summarize(ops.ops, reads)
    times = []
    for _ in range(reps):
        run = step()
        start = time.perf_counter()
        results += run()
        times.append(time.perf_counter() - start)
    failed = [r for r in results if isinstance(r, Exception)]
    assert not failed, failed[0]
    return {**counts, "host_ms": round(min(times) * 1e3, 2)}


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sessions: int, nkv: int) -> torch.Tensor:
    """Attention of every session's query rows over its own keys in two
    batched products: q (sessions * rows, nh * hd), session-major; k
    (sessions * nkv, hd, keys), already scaled; v (sessions * nkv, keys, hd).
    A query head's KV head is head // (nh / nkv), as in grouped-query attention.
    Returns (sessions * rows, nh * hd)."""
    hd = v.shape[-1]
    n, g = q.shape[0], q.shape[1] // hd // nkv
    rows = n // sessions
    q = q.reshape(sessions, rows, nkv, g, hd).permute(0, 2, 3, 1, 4).reshape(sessions * nkv, g * rows, hd)
    probs = torch.softmax(torch.bmm(q, k), dim=-1)
    y = torch.bmm(probs, v).view(sessions, nkv, g, rows, hd)
    return y.permute(0, 3, 1, 2, 4).reshape(n, nkv * g * hd)


def _product(a: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    return a @ w if transposed else F.linear(a, w)


def _floor_step(x, ws, transposed, k, v, head, sessions, nkv, q_width, attention=True) -> torch.Tensor:
    """The floor's forward: per layer the q/k/v, output, gate/up and down
    products, attention (unless `attention` is False: the queries pass
    through) and residual adds; then the LM head over every row."""
    for w in ws:
        y = _product(x, w["qkv"], transposed)[:, :q_width]
        if attention:
            y = grouped_attention(y, k, v, sessions, nkv)
        x = x + _product(y, w["o"], transposed)
        gate, up = _product(x, w["gate_up"], transposed).chunk(2, dim=-1)
        x = x + _product(F.silu(gate) * up, w["down"], transposed)
    return F.linear(x, head)


def arithmetic_floor(
    sessions: int, rows: int, keys: int, reps: int, vocab: int = 4096, attention: bool = True
) -> float:
    """The least this CPU spends on a verify step's arithmetic, in ms (min of
    `reps`): the target's matrix products and attention for `sessions` x `rows`
    query rows over `keys` keys each, one operator per product for all
    sessions, in bf16 like the engine, and nothing else - no norms, RoPE,
    cache writes or key gathers, masks, acceptance or sampling. Weights are
    random, in whichever of the two layouts (out, in) / (in, out) multiplies
    faster here. attention=False: the matrix products alone.

    The products are a floor for any engine on this machine. The attention
    part is one implementation's cost, torch's batched products: at a head
    dim of 8 it is mostly a fixed cost per (session, KV head) block, not
    arithmetic (64 sessions x 32 heads x 5 rows x 69 keys are ~11 MFLOP), so
    a kernel made for such blocks could cost far less."""
    c, inter, layers = TARGET_SHAPE["hidden_size"], TARGET_SHAPE["intermediate_size"], TARGET_SHAPE["num_hidden_layers"]
    nh, nkv = TARGET_SHAPE["num_attention_heads"], TARGET_SHAPE["num_key_value_heads"]
    hd, n = c // nh, sessions * rows
    bf = torch.bfloat16
    gen = torch.Generator().manual_seed(3)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(bf)

    x0 = rand(n, c)
    k, v = rand(sessions * nkv, hd, keys) * hd**-0.5, rand(sessions * nkv, keys, hd)
    sizes = {"qkv": ((nh + 2 * nkv) * hd, c), "o": (c, nh * hd), "gate_up": (2 * inter, c), "down": (c, inter)}
    out_in = [{name: rand(*shape) for name, shape in sizes.items()} for _ in range(layers)]
    head = rand(vocab, c)
    best = float("inf")
    for transposed in (False, True):
        ws = [{name: w.t().contiguous() if transposed else w for name, w in layer.items()} for layer in out_in]
        step = functools.partial(_floor_step, x0, ws, transposed, k, v, head, sessions, nkv, nh * hd, attention)
        step()  # untimed: first-call allocations
        for _ in range(reps):
            start = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - start)
    return round(best * 1e3, 2)


def tree_parents(shape: DraftShape) -> list[int]:
    """A static shape's parent list (node order of its paths; -1 = the root)."""
    paths = list(shape.static_paths)
    return [paths.index(p[:-1]) if len(p) > 1 else -1 for p in paths]


def verify_steps(verifier: Verifier, ids: list[str], shape: DraftShape, reps: int) -> dict[str, Any]:
    """Counts and min host time of one verify step of every session in `ids`
    (drafts of `shape`, random tokens: mostly rejected, like a poor drafter)."""
    parents = tree_parents(shape) if not shape.is_chain else None
    n = len(parents) if parents else shape.depth
    g = torch.Generator().manual_seed(2)

    def step():
        jobs = [
            verifier.prepare(i, torch.randint(1, verifier.vocab_size, (n,), generator=g).tolist(), parents) for i in ids
        ]
        return lambda: verifier.verify_batch(jobs)

    return counted_and_timed(step, reps)


def draft_steps(drafter: Drafter, ids: list[str], shape: DraftShape, reps: int) -> dict[str, Any]:
    """Counts and min host time of one propose step (drafts of `shape`) of
    every session in `ids`, each after one committed token (its draft rejected)."""
    tokens = itertools.count(7)

    def step():
        committed = [next(tokens)]
        jobs = [drafter.prepare(ProposeCall(i, [], committed, shape)) for i in ids]
        return lambda: drafter.propose_batch(jobs)

    return counted_and_timed(step, reps)


def measure(args: argparse.Namespace, target: Path, drafter_dir: Path) -> list[dict[str, Any]]:
    """One row per number of sessions: verify (chain, tree) and draft counts."""
    common = {"device": "cpu", "dtype": "bfloat16", "warmup": False, "torch_threads": args.threads}
    verifier = Verifier(VerifierConfig(model_dir=str(target), **common))
    drafter = Drafter(DrafterConfig(model_dir=str(drafter_dir), **common))
    params = SamplingParams()
    rows, names = [], itertools.count()
    for n in args.sessions:
        ids = [f"s{next(names)}" for _ in range(n)]
        sampled = [f"s{next(names)}" for _ in range(n)]  # the same prompts, sampled
        prompts = _prompts(n, args.context, verifier.vocab_size)
        opens = [verifier.prepare_open(i, p, params) for i, p in zip(ids, prompts)]
        opens += [verifier.prepare_open(i, p, SAMPLED) for i, p in zip(sampled, prompts)]
        for r in verifier.verify_batch(opens):
            assert not isinstance(r, Exception), r
        for i, p in zip(ids, prompts):
            drafter.open_session(i, p, params)
        row = {
            "sessions": n,
            "verify_chain": verify_steps(verifier, ids, DraftShape.chain(4), args.reps),
            "verify_tree": verify_steps(verifier, ids, TREE, args.reps),
            "verify_chain_sampled": verify_steps(verifier, sampled, DraftShape.chain(4), args.reps),
            "verify_tree_sampled": verify_steps(verifier, sampled, TREE, args.reps),
            "draft_chain": draft_steps(drafter, ids, DraftShape.chain(4), args.reps),
            "draft_tree": draft_steps(drafter, ids, TREE, args.reps),
        }
        for kind, shape_rows in (("verify_chain", 5), ("verify_tree", 1 + len(tree_parents(TREE)))):
            row[kind]["floor_ms"] = arithmetic_floor(n, shape_rows, args.context + shape_rows, args.reps)
            row[kind]["products_ms"] = arithmetic_floor(
                n, shape_rows, args.context + shape_rows, args.reps, attention=False
            )
        rows.append(row)
        print(
            f"  {n:>3} sessions: "
            + ", ".join(f"{k} {v['kernel_like']} ops {v['host_ms']} ms" for k, v in row.items() if k != "sessions"),
            flush=True,
        )
        for i in ids:  # the next point starts from empty caches
            verifier.close_session(i)
            drafter.close_session(i)
        for i in sampled:
            verifier.close_session(i)
    return rows


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per session")
    ap.add_argument("--reps", type=int, default=3, help="steps per measurement (host time: their minimum)")
    ap.add_argument("--drafter-layers", type=int, default=4)
    # One thread: at these widths no operator is worth splitting, and idle
    # OpenMP workers spinning beside other processes make host times noisy.
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    ap.add_argument("--out", type=Path, default=RESULTS / "engine.json")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = build_pair(Path(tmp), args.drafter_layers)
        rows = measure(args, target, drafter)
    first, last = rows[0], rows[-1]
    ratios = {
        kind: {
            "kernel_like": round(last[kind]["kernel_like"] / first[kind]["kernel_like"], 2),
            "host_ms": round(last[kind]["host_ms"] / first[kind]["host_ms"], 2),
            # The floor at the last point over this engine's step at the
            # first; the products alone are what no engine can go below here.
            **(
                {
                    "floor_over_first_host_ms": round(last[kind]["floor_ms"] / first[kind]["host_ms"], 2),
                    "products_over_first_host_ms": round(last[kind]["products_ms"] / first[kind]["host_ms"], 2),
                }
                if "floor_ms" in last[kind]
                else {}
            ),
        }
        for kind in KINDS
    }
    result = {
        "when": utc_now(),
        "machine": machine(),
        "torch": torch.__version__,
        "target": {**TARGET_SHAPE, "dtype": "bfloat16", "context": args.context},
        "drafter_layers": args.drafter_layers,
        "rows": rows,
        f"ratio_{last['sessions']}_to_{first['sessions']}": ratios,
    }
    return result


def report(result: dict, args: argparse.Namespace) -> None:
    for kind, what in (
        ("verify_chain", "verify, chain K=4"),
        ("verify_tree", "verify, tree 2x2"),
        ("verify_chain_sampled", "verify, chain K=4, sampled (temperature 0.8)"),
        ("verify_tree_sampled", "verify, tree 2x2, sampled (temperature 0.8)"),
        ("draft_chain", "draft, chain K=4 (one step: 4 levels)"),
        ("draft_tree", "draft, tree 2x2 (one step: 1 level forwarded)"),
    ):
        floor = "floor_ms" in result["rows"][0][kind]
        head = "| sessions | kernel-like ops | all ops | host syncs | uploads | host ms (min) |"
        print(f"\n{what}\n{head}" + (" arithmetic floor ms | its products alone ms |" if floor else ""))
        print("|---" * (8 if floor else 6) + "|")
        for r in result["rows"]:
            c = r[kind]
            cells = [r["sessions"], c["kernel_like"], c["ops"], c["syncs"], c["uploads"], c["host_ms"]]
            cells += [c["floor_ms"], c["products_ms"]] if floor else []
            print("| " + " | ".join(str(v) for v in cells) + " |")
    for key, ratios in result.items():
        if key.startswith("ratio_"):
            print(f"\n{key}:")
            for kind, r in ratios.items():
                print(f"  {kind}: " + ", ".join(f"{name} {value}x" for name, value in r.items()))
    print(f"\nwritten to {args.out}")


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
