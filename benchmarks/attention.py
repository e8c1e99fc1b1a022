"""Which attention call a lean engine step should make, measured on a device.

    python -m benchmarks.attention                   # the demo target on the CPU (~2 min, most of it compiling)
    python -m benchmarks.attention --device cuda     # the same candidates on a GPU
    python -m benchmarks.attention --quick           # two steps, 3 reps

A step of S sessions x R rows (decode: R = 1; a chain of K = 4: R = 5), each
session holding C cached tokens, is planned by the engine itself
(specd_core/runtime/lean_step.py: its paged pool, block tables and masks).
Then each candidate computes that step's attention in every layer of the
model:

- `gather`: the engine's call (LeanModel._attend): each session's keys and
  values gathered from its blocks by one index, then one SDPA call for all
  sessions (on a CPU with each KV head's query heads as one block of rows,
  lean_step.fold_heads);
- `grouped`: the same with SDPA's grouped-query call, a block per query head
  (the engine's call on CUDA; the same as `gather` where a model has as many
  KV heads as query heads);
- `in_place`: one SDPA call per session over its blocks where they lie (a
  session's blocks are consecutive here, as they usually are);
- `flex`: torch's flex_attention, compiled, over the whole pool with a block
  mask that shows each query its own session's blocks: paged attention with
  no gather. Its keys and values are laid out as flex_attention takes them
  (one (heads, rows, dim) plane each, made once, outside the timing: the
  layout a pool built for it would have); its block mask is built per step
  (`mask_ms`), since sessions come and go between steps.

Each candidate's output is checked against `gather`'s (`max_diff`). A step's
time is the median over --reps of every layer's attention in turn, each
layer's cache in its own memory, so that keys come from memory as in a
forward rather than from a warm cache. The candidates run one after another
within each rep, in an order rotated from rep to rep, so each one's ratio
over `gather` is paired rep by rep,
with its interval (`*_over_gather`). flex_attention's first call per shape
compiles (`compile_s`).

Writes benchmarks/results/attention.json (or --out) and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specd_core.runtime import lean_step
from specd_core.runtime.kv_budget import DEFAULT_BLOCK_ROWS, KVPool
from specd_core.runtime.lean import LeanModel
from specd_core.runtime.models import Runner, load_model
from specd_core.runtime.paged_kv import NULL_BLOCK

from .common import DEMO_TARGET, RESULTS, machine, paired_ratio, run_main, utc_now

# (sessions, rows per session, cached tokens per session)
SHAPES = [(1, 1, 300), (8, 1, 100), (8, 1, 300), (8, 5, 300), (8, 5, 1000), (32, 1, 300), (32, 5, 150)]
QUICK_SHAPES = [(8, 1, 100), (8, 5, 300)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Case:
    """One step's sessions, plan and queries on the engine's own pool."""

    def __init__(self, lean: LeanModel, sessions: int, rows: int, context: int, seed: int = 0):
        self.lean, self.rows = lean, rows
        g = torch.Generator().manual_seed(seed)
        # A pool of its own: its sessions take their blocks in runs, one after
        # another, with the free room the pool's placement looks for around a run.
        blocks = 2 * sessions * -(-(context + rows) // DEFAULT_BLOCK_ROWS) + 8
        pool = KVPool(blocks, DEFAULT_BLOCK_ROWS, lean.kv_row_bytes, "attention")
        self.sessions = [lean.new_session(pool=pool) for _ in range(sessions)]
        prompts = [torch.randint(5, lean.vocab_size - 1, (context,), generator=g).tolist() for _ in self.sessions]
        lean.forward_batch([(s, p, None, None) for s, p in zip(self.sessions, prompts)], last_only=True)
        items = [(s, [7] * rows, None, None) for s in self.sessions]
        # The gathered batch for every shape: the engine would read sessions
        # whose blocks lie in one run in place by itself (lean_step.in_place),
        # which is the `in_place` candidate here.
        engine_choice, lean_step.in_place = lean_step.in_place, lambda model, entries: []
        try:
            self.step = lean_step.plan(lean, items, False)
            self.unfolded = lean_step.plan(lean, items, False, fold=False).groups[0]
        finally:
            lean_step.in_place = engine_choice
        assert len(self.step.groups) == 1, "sessions of one size make one group"
        self.group = self.step.groups[0]
        self.layers = self.step.data.shape[0]
        n = self.step.data.shape[1]
        self.data = [self.step.data[i].view(n, -1) for i in range(self.layers)]
        q = torch.randn(sessions * rows, lean.n_heads, lean.head_dim, generator=g)
        self.q = q.to(lean.device, lean.kv_dtype)
        # Every storage row the prefill did not write gets finite values: the step's own rows
        # (each query sees its own key; a forward writes them before attending) and the
        # rest of the sessions' blocks, which the candidates read masked (flex whole blocks).
        # Left as allocated they hold whatever memory was reused, NaN or infinity included,
        # and a masked NaN still makes a NaN output. The null blocks stay as they are.
        kept = torch.zeros(n, dtype=torch.bool)
        kept[: NULL_BLOCK * DEFAULT_BLOCK_ROWS] = True
        kept[[s.slot(j) for s in self.sessions for j in range(context)]] = True
        fill = (~kept).nonzero().squeeze(1).to(lean.device)
        with torch.inference_mode():  # the pool is an inference tensor
            for d in self.data:
                d[fill] = torch.randn(len(fill), d.shape[1], generator=g).to(d)
        self.runs = [range(s.slot(0), s.slot(0) + e.end) for s, e in zip(self.sessions, self.step.entries)]
        for s, e, run in zip(self.sessions, self.step.entries, self.runs):  # consecutive blocks: one range
            assert s.slot(e.end - 1) == run.stop - 1

    def release(self) -> None:
        for s in self.sessions:
            s.release()

    def gather(self, layer: int) -> torch.Tensor:
        return self.lean._attend(self.data[layer], self.q, self.group, 0)

    def grouped(self, layer: int) -> torch.Tensor:
        return self.lean._attend(self.data[layer], self.q, self.unfolded, 0)

    def in_place(self, layer: int) -> torch.Tensor:
        """The engine's own call for each session alone, over its rows where they lie."""
        g, rows = self.group, self.rows
        ys = []
        for j, run in enumerate(self.runs):
            mask = g.masks[0]
            lone = g._replace(
                size=1, q_index=None, keys=[run], masks=[None if mask is None else mask[j : j + 1, :, :, : len(run)]]
            )
            ys.append(self.lean._attend(self.data[layer], self.q[j * rows : (j + 1) * rows], lone, 0))
        return torch.cat(ys)


class Flex:
    """flex_attention over the pool: K and V planes per layer, a block mask per step."""

    def __init__(self, case: Case):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        lean, step = case.lean, case.step
        self.case = case
        self.create_block_mask = torch.compile(create_block_mask)
        self.attend = torch.compile(flex_attention, dynamic=False)
        n, nkv, hd = step.data.shape[1], lean.n_kv, lean.head_dim
        planes = [case.data[i].view(n, 2, nkv, hd).permute(1, 2, 0, 3) for i in range(case.layers)]
        self.k = [p[0].contiguous()[None] for p in planes]  # (1, nkv, N, hd)
        self.v = [p[1].contiguous()[None] for p in planes]
        self.q = case.q.view(1, -1, lean.n_heads, hd).transpose(1, 2)  # (1, nh, S*R, hd)
        self.mask = None

    def build_mask(self):
        """Which physical rows each query sees: its session's blocks, up to its own row."""
        case = self.case
        b = case.sessions[0].block_rows
        n = case.step.data.shape[1]
        owner = torch.full((n // b,), -1, dtype=torch.long)
        logical = torch.zeros(n // b, dtype=torch.long)
        for j, s in enumerate(case.sessions):
            owner[s.table] = j
            logical[s.table] = torch.arange(len(s.table))
        q_session = torch.arange(len(case.sessions)).repeat_interleave(case.rows)
        q_row = torch.tensor([e.start + r for e in case.step.entries for r in range(case.rows)])
        device = case.q.device
        owner, logical, q_session, q_row = (t.to(device) for t in (owner, logical, q_session, q_row))

        def shown(b_, h_, qi, kv):
            block = kv // b
            return (owner[block] == q_session[qi]) & (logical[block] * b + kv % b <= q_row[qi])

        return self.create_block_mask(shown, 1, 1, len(q_row), n, device=device)

    def __call__(self, layer: int) -> torch.Tensor:
        lean = self.case.lean
        gqa = lean.n_heads != lean.n_kv  # query heads share each KV head (Llama-3's 32 over 8)
        y = self.attend(self.q, self.k[layer], self.v[layer], block_mask=self.mask, scale=lean.scale, enable_gqa=gqa)
        return y.transpose(1, 2).reshape(-1, lean.n_heads * lean.head_dim)


def measure(lean: LeanModel, shape: tuple[int, int, int], reps: int, with_flex: bool = True) -> dict:
    sessions, rows, context = shape
    case = Case(lean, sessions, rows, context)
    device = case.q.device
    flex = Flex(case)
    candidates: dict[str, Callable[[int], torch.Tensor]] = {
        "gather": case.gather,
        "grouped": case.grouped,
        "in_place": case.in_place,
        **({"flex": flex} if with_flex else {}),
    }
    start = time.perf_counter()
    if with_flex:
        flex.mask = flex.build_mask()
    got = {name: attend(0) for name, attend in candidates.items()}
    want = got["gather"]
    sync(device)
    compile_s = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in candidates}
    mask_ms: list[float] = []
    for rep in range(reps):
        # The order rotated each rep, so that each candidate takes each place
        # as often: one that runs right after another finds keys warm in cache.
        names = list(candidates)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            attend = candidates[name]
            sync(device)
            t = time.perf_counter()
            for layer in range(case.layers):
                attend(layer)
            sync(device)
            times[name].append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        if with_flex:
            flex.build_mask()
        sync(device)
        mask_ms.append((time.perf_counter() - t) * 1e3)
    case.release()
    out: dict[str, Any] = {
        "sessions": sessions,
        "rows": rows,
        "context": context,
        "layers": case.layers,
        "compile_s": round(compile_s, 1),
        "mask_ms": round(statistics.median(mask_ms), 3),
    }
    for name in candidates:
        out[f"{name}_ms"] = round(statistics.median(times[name]), 3)
        out[f"{name}_max_diff"] = float((got[name].float() - want.float()).abs().max())
    for name in list(candidates)[1:]:  # over the gather, rep by rep (they ran side by side)
        out[f"{name}_over_gather"] = paired_ratio(times[name], times["gather"])
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEMO_TARGET), help="a target checkpoint directory (default: the demo target)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument(
        "--shape",
        type=int,
        nargs=3,
        action="append",
        metavar=("SESSIONS", "ROWS", "CONTEXT"),
        help="a step to measure (repeatable; default: the table's seven)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: a service's setting under Ray)")
    p.add_argument(
        "--no-flex",
        action="store_true",
        help="leave flex_attention out (its compiling is most of a run; torch's code for some shapes fails to build)",
    )
    p.add_argument("--quick", action="store_true", help="two steps, 3 reps (results/attention_quick.json)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.shape = 3, args.shape or [list(s) for s in QUICK_SHAPES]
    args.out = args.out or RESULTS / ("attention_quick.json" if args.quick else "attention.json")
    return args


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lean = Runner(load_model(args.model, args.device, args.dtype)).lean
    if lean is None:
        raise SystemExit(f"{args.model}: the lean engine does not cover this model")
    rows = []
    for shape in args.shape or SHAPES:
        rows.append(measure(lean, shape, args.reps, not args.no_flex))
        print(rows[-1], flush=True)
    return {
        "meta": {
            "model": args.model,
            "device": args.device,
            "dtype": args.dtype,
            "kv_dtype": str(lean.kv_dtype).removeprefix("torch."),
            "machine": machine(processor=True),
            "when": utc_now(),
            "reps": args.reps,
            "threads": args.threads,
        },
        "steps": rows,
    }


def report(result: dict, args: argparse.Namespace) -> None:
    print(
        f"\nattention of a whole step, all layers, ms (median of {result['meta']['reps']}); {result['meta']['machine']}"
    )
    print(
        "| sessions x rows | context | gather | grouped (over gather) | in place (over gather) "
        "| flex (over gather; its mask) | max diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in result["steps"]:
        diff = max(r[k] for k in r if k.endswith("_max_diff"))
        flex = f"{r['flex_ms']:.2f} ({ratio(r['flex_over_gather'])}; {r['mask_ms']:.2f})" if "flex_ms" in r else "-"
        print(
            f"| {r['sessions']} x {r['rows']} | {r['context']} | {r['gather_ms']:.2f} "
            f"| {r['grouped_ms']:.2f} ({ratio(r['grouped_over_gather'])}) "
            f"| {r['in_place_ms']:.2f} ({ratio(r['in_place_over_gather'])}) "
            f"| {flex} | {diff:.1e} |"
        )


def ratio(paired: dict) -> str:
    """A paired ratio as `g (lo-hi)`, or `g` without an interval (fewer than 3 reps)."""
    if paired["interval"] is None:
        return f"{paired['geomean']:.2f}"
    lo, hi = paired["interval"]
    return f"{paired['geomean']:.2f} ({lo:.2f}-{hi:.2f})"


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
