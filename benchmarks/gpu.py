"""What a verify forward, a draft level and a cycle cost on a GPU, with a
Llama-3.1-8B target and a Llama-3.2-1B drafter (shapes only: random weights).

    python -m benchmarks.gpu                 # one CUDA device, bf16 (~5 min, half of it building the pair)
    python -m benchmarks.gpu --tiny          # the same steps, tiny shapes, on the CPU (the test suite runs this)

1. Verify-forward ms by rows per session (1 = plain decoding, 5 = a chain of
   K = 4) and sessions per forward (1, 8, 32), each session holding
   --context tokens: the lean engine's forward_batch timed in-process.
2. Draft ms per level (one row per session) by sessions, the same way.
3. Through the real services (specd.local_stack): tokens/s with
   speculation off and with K = 4 at 1, 8 and 32 concurrent streams, in
   alternating rounds (the ratio's interval comes from them,
   benchmarks/common.py ratio_interval), and the per-cycle overhead (wall time
   minus draft and verify compute; GenerationStats.cycle_overhead_ms).

Acceptance is forced: both models are built to predict the token they read
(benchmarks/synthetic.py), so the drafter copies the target's choice and every
draft is accepted. The K = 4 figures are therefore the best case of a pair
whose drafts always hold; the forward costs are those of the real shapes.
Writes benchmarks/results/gpu.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from specd.local_stack import Stack
from specd_core.runtime.models import Runner, load_model, load_tokenizer

from . import synthetic
from .common import (
    CACHE,
    DEMO_TARGET,
    RESULTS,
    alternating,
    pct,
    random_prompts,
    random_token_pool,
    ratio_interval,
    run_main,
    utc_now,
)
from .load import merge_rounds, run_level

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


# (target, drafter) shapes: Llama-3.1-8B and Llama-3.2-1B as published, and
# tiny versions of the same structure.
SHAPES: dict[bool, tuple[dict[str, Any], dict[str, Any]]] = {
    False: (
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "tie_word_embeddings": False,
        },
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "tie_word_embeddings": True,
        },
    ),
    True: (
        {
            "hidden_size": 64,
            "intermediate_size": 224,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "tie_word_embeddings": False,
        },
        {
            "hidden_size": 32,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
        },
    ),
}


def pair_configs(tiny: bool, vocab: int) -> tuple[LlamaConfig, LlamaConfig]:
    """(target, drafter) of SHAPES (vocab aside: the pair shares the demo
    tokenizer, its rows padded to 128,256 for the published shapes)."""
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "rope_parameters": LLAMA3_ROPE,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }
    target, drafter = SHAPES[tiny]
    return LlamaConfig(**target, **common), LlamaConfig(**drafter, **common)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_forwards(
    model_dir: Path,
    device: str,
    dtype: str,
    sessions: list[int],
    rows: list[int],
    context: int,
    reps: int,
    token_ids: list[int],
) -> tuple[str, list[dict]]:
    """(engine, [{sessions, rows, ms}]): forward_batch of `rows` new rows for
    each of `sessions` sessions that hold `context` tokens; median of `reps`
    (after one untimed call), each followed by a rollback to `context`."""
    runner = Runner(load_model(str(model_dir), device, dtype))
    out = []
    for s in sessions:
        caches = [runner.new_session() for _ in range(s)]
        runner.forward_batch([(c, token_ids[:context], None, None) for c in caches], last_only=True)
        for r in rows:
            items = [(c, token_ids[context : context + r], None, None) for c in caches]
            times = []
            for i in range(reps + 1):
                _sync(device)
                start = time.perf_counter()
                runner.forward_batch(items)
                _sync(device)
                if i:
                    times.append((time.perf_counter() - start) * 1e3)
                for c in caches:
                    c.rollback(context)
            out.append({"sessions": s, "rows": r, "ms": round(statistics.median(times), 3)})
            print(f"  {model_dir.name}: {s:>3} sessions x {r} rows: {out[-1]['ms']:.2f} ms", flush=True)
        del caches
    engine = runner.engine
    del runner
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return engine, out


def run_streams(
    stack: Stack,
    prompts: list[list[int]],
    levels: list[int],
    rounds: int,
    seconds: float,
    warmup_s: float,
    max_new: int,
) -> list[dict]:
    """tokens/s off vs K = 4 per level, in rounds that alternate the order."""
    settings = {"off": {"num_speculative_tokens": 0}, "K=4": {"num_speculative_tokens": 4}}
    rows = []
    for n in levels:
        got: dict[str, list] = {s: [] for s in settings}
        for r in range(rounds):
            for s in alternating(list(settings), r):
                got[s].append(
                    run_level(stack.orchestrator.address, prompts, settings[s], n, max_new, seconds / rounds, warmup_s)
                )
        merged = {s: merge_rounds(parts) for s, parts in got.items()}
        row = {
            "streams": n,
            "off_tokens_per_s": merged["off"]["tokens_per_s"],
            "k4_tokens_per_s": merged["K=4"]["tokens_per_s"],
            "k4_vs_off": round(merged["K=4"]["tokens_per_s"] / merged["off"]["tokens_per_s"], 3),
            "k4_vs_off_interval": ratio_interval(merged["K=4"], merged["off"]),
            "k4_draft_depth": merged["K=4"]["draft_depth"],
            "rounds": {s: m["rounds_tokens_per_s"] for s, m in merged.items()},
        }
        rows.append(row)
        print(
            f"  {n:>3} streams: off {row['off_tokens_per_s']} tok/s, K=4 {row['k4_tokens_per_s']} tok/s, "
            f"x{row['k4_vs_off']} {row['k4_vs_off_interval']}",
            flush=True,
        )
    return rows


def cycle_stats(stack: Stack, prompts: list[list[int]], max_new: int) -> dict:
    """Per-cycle overhead and tokens per cycle of single K = 4 streams."""
    overheads, cycles, tokens = [], 0, 0
    for p in prompts:
        ids, last = stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=max_new, num_speculative_tokens=4)
        assert last is not None
        overheads += list(last.stats.cycle_overhead_ms)
        cycles += last.stats.cycles
        tokens += len(ids)
    # One sampled stream: its draws take the device's distributions to the
    # sessions' CPU generators, a path greedy streams never run.
    sampled, _ = stack.generate(
        prompt_token_ids={"ids": prompts[0]}, max_new_tokens=max_new, num_speculative_tokens=4, temperature=0.8, seed=1
    )
    return {
        "overhead_ms_p50": round(pct(overheads, 0.5), 3),
        "overhead_ms_p90": round(pct(overheads, 0.9), 3),
        "tokens_per_cycle": round(tokens / max(cycles, 1), 2),
        "sampled_tokens": len(sampled),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with the defaults of the mode (GPU, or --tiny on the CPU) filled in."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU in float32 (a smoke run)")
    ap.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    ap.add_argument("--dtype", default=None, help="default: bfloat16, or float32 with --tiny")
    ap.add_argument("--context", type=int, default=None, help="tokens each timed session holds (default 512)")
    ap.add_argument("--streams", type=int, nargs="+", default=None, help="stream levels (default 1 8 32)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds per setting and level")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    tiny = args.tiny
    args.device = args.device or ("cpu" if tiny else "cuda")
    args.dtype = args.dtype or ("float32" if tiny else "bfloat16")
    args.context = args.context or (24 if tiny else 512)
    args.streams = args.streams or ([1, 2] if tiny else [1, 8, 32])
    args.seconds = args.seconds or (3.0 if tiny else 30.0)
    args.max_new_tokens = args.max_new_tokens or (12 if tiny else 128)
    args.out = args.out or RESULTS / ("gpu-tiny.json" if tiny else "gpu.json")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device is visible: run with --tiny for the CPU smoke run")
    return args


def run(args: argparse.Namespace) -> dict:
    tiny, device, dtype, context = args.tiny, args.device, args.dtype, args.context
    tok = load_tokenizer(str(DEMO_TARGET))
    target_cfg, drafter_cfg = pair_configs(tiny, len(tok) if tiny else 128256)
    torch_dtype = getattr(torch, dtype)
    base = CACHE / ("gpu-pair-tiny" if tiny else "gpu-pair")
    print("building the pair (random weights, forced acceptance) ...", flush=True)
    target = synthetic.build(target_cfg, base / "target", DEMO_TARGET, torch_dtype, device)
    drafter = synthetic.build(drafter_cfg, base / "drafter", DEMO_TARGET, torch_dtype, device, seed=1)

    # Prompt ids: any but the special ones (an EOS would end a copying stream at once).
    rng = random.Random(0)
    pool = random_token_pool(tok)
    token_ids = random_prompts(pool, rng, 1, context + 8)[0]
    prompts = random_prompts(pool, rng, 16, min(context, 128))

    reps = 3 if tiny else 20
    print("verify forwards (target) ...", flush=True)
    engine_t, verify = time_forwards(target, device, dtype, levels_for_timing(tiny), [1, 5], context, reps, token_ids)
    print("draft levels (drafter) ...", flush=True)
    engine_d, draft = time_forwards(drafter, device, dtype, levels_for_timing(tiny), [1], context, reps, token_ids)

    print("streams through the services ...", flush=True)
    stack = Stack(str(target), str(drafter), ("--device", device, "--dtype", dtype))
    try:
        run_level(stack.orchestrator.address, prompts, {"num_speculative_tokens": 4}, 2, 8, 1.0, 0.0)  # warm-up
        streams = run_streams(
            stack, prompts, args.streams, args.rounds, args.seconds, 1.0 if tiny else 3.0, args.max_new_tokens
        )
        cycles = cycle_stats(stack, prompts[:4], args.max_new_tokens)
    finally:
        stack.stop()

    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else None
    meta = {
        "device": gpu or f"cpu ({platform.machine()})",
        "dtype": dtype,
        "tiny": tiny,
        "context": context,
        "target": target_cfg.to_diff_dict(),
        "drafter": drafter_cfg.to_diff_dict(),
        "engines": {"target": engine_t, "drafter": engine_d},
        "torch": torch.__version__,
        "acceptance": "forced: both models predict the token they read (benchmarks/synthetic.py)",
        "date": utc_now(),
    }
    return {"meta": meta, "verify_ms": verify, "draft_ms": draft, "streams": streams, "cycle": cycles}


def report(result: dict, args: argparse.Namespace) -> None:
    engines, cycles = result["meta"]["engines"], result["cycle"]
    print(
        f"\nengines: target {engines['target']}, drafter {engines['drafter']}; cycle overhead p50 "
        f"{cycles['overhead_ms_p50']} ms, {cycles['tokens_per_cycle']} tokens per cycle"
    )
    print("| streams | off tok/s | K=4 tok/s | K=4 / off (interval) |")
    print("|---|---|---|---|")
    for r in result["streams"]:
        print(
            f"| {r['streams']} | {r['off_tokens_per_s']} | {r['k4_tokens_per_s']} | {r['k4_vs_off']} "
            f"{r['k4_vs_off_interval']} |"
        )
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report)


def levels_for_timing(tiny: bool) -> list[int]:
    return [1, 4] if tiny else [1, 8, 32]


if __name__ == "__main__":
    raise SystemExit(main())
