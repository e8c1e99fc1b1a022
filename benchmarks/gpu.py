"""What a verify forward, a draft level and a cycle cost on a GPU, with a
Llama-3.1-8B target and a Llama-3.2-1B drafter (shapes only: random weights).

    python -m benchmarks.gpu                 # one CUDA device, bf16 (~6 min; --parts picks some)
    python -m benchmarks.gpu --tiny          # the same steps, tiny shapes, on the CPU (the test suite runs this)

1. Verify-forward ms by rows per session (1 = plain decoding, 5 = a chain of
   K = 4) and sessions per forward (1, 8, 32, 64), each session holding
   --context tokens: the lean engine's forward_batch timed in-process,
   eagerly and through CUDA graphs (specd_core/runtime/step_graphs.py) in
   alternating calls.
2. Draft ms per level (one row per session) by sessions, the same way.
3. Whole steps through the services' own cores in-process (as
   benchmarks/engine.py runs them): a verify step of chains K = 4 (greedy
   and sampled) and of a static tree, a draft step of a chain K = 4, by sessions: their ms, operator
   calls and host syncs (counted at the dispatcher), and from torch's
   profiler the device kernels launched, the host's synchronize calls and the
   attention operator and kernels that ran, eagerly and through CUDA graphs;
   then the same steps at the sessions' new lengths (as served), and a verify
   step of chains of depths 1 to 5 across the sessions, under each setting of
   STEP_SETTINGS (attention implementations, key buckets, query heads as
   rows, CUDA graphs) in
   alternating rounds.
4. Through the real services (specd.local_stack), two stacks side by side,
   one with CUDA graphs (the default on CUDA) and one without
   (SPECD_CUDA_GRAPHS=off): tokens/s with speculation off and K = 4 on each,
   and the default (adaptive: the depth, 0 included, chosen by measured
   costs) with graphs, at 1, 8, 32 and 64 concurrent streams, in alternating
   rounds (the ratios' intervals come from them, benchmarks/common.py
   ratio_interval), and the per-cycle overhead (wall time minus draft and
   verify compute; GenerationStats.cycle_overhead_ms).

Acceptance is forced: both models are built to predict the token they read
(benchmarks/synthetic.py), so the drafter copies the target's choice and every
draft is accepted. The K = 4 figures are therefore the best case of a pair
whose drafts always hold; the forward costs are those of the real shapes.
Writes benchmarks/results/gpu.json (or --out) after each part, so that a run
cut short keeps what it measured, and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import platform
import random
import re
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from specd.local_stack import Stack
from specd_core.runtime.attention_backends import ENV as ATTENTION_ENV
from specd_core.runtime.models import Runner, load_model, load_tokenizer
from specd_core.runtime.step_graphs import ENV as GRAPHS_ENV

from . import synthetic
from .common import (
    CACHE,
    DEMO_TARGET,
    RESULTS,
    alternating,
    paired_ratio,
    pct,
    random_prompts,
    random_token_pool,
    ratio_interval,
    run_main,
    utc_now,
    write_json,
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


PARTS = ("forwards", "steps", "streams")


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
    """(engine, [{sessions, rows, ms, ms_graphs, graphs_over_eager}]):
    forward_batch of `rows` new rows for each of `sessions` sessions that
    hold `context` tokens, eagerly and through the step graphs in
    alternating calls (after two untimed calls of each: graphs capture a
    shape when it is met again); median of `reps` each, each call followed
    by a rollback to `context`."""
    from specd_core.runtime.step_graphs import StepGraphs

    runner = Runner(load_model(str(model_dir), device, dtype))
    lean = runner.lean
    modes: dict[str, StepGraphs | None] = {"eager": None}
    if lean is not None:
        modes["graphs"] = StepGraphs(lean, capture=device.startswith("cuda"))
    out = []
    for s in sessions:
        caches = [runner.new_session() for _ in range(s)]
        runner.forward_batch([(c, token_ids[:context], None, None) for c in caches], last_only=True)
        for r in rows:
            items = [(c, token_ids[context : context + r], None, None) for c in caches]
            times: dict[str, list[float]] = {m: [] for m in modes}
            for i in range(reps + 2):
                for mode in alternating(list(modes), i):
                    if lean is not None:
                        lean.graphs = modes[mode]
                    _sync(device)
                    start = time.perf_counter()
                    runner.forward_batch(items)
                    _sync(device)
                    if i >= 2:
                        times[mode].append((time.perf_counter() - start) * 1e3)
                    for c in caches:
                        c.rollback(context)
            row: dict[str, Any] = {"sessions": s, "rows": r, "ms": round(statistics.median(times["eager"]), 3)}
            if "graphs" in times:
                row["ms_graphs"] = round(statistics.median(times["graphs"]), 3)
                row["graphs_over_eager"] = paired_ratio(times["graphs"], times["eager"])
            out.append(row)
            print(
                f"  {model_dir.name}: {s:>3} sessions x {r} rows: {row['ms']:.2f} ms, graphs {row.get('ms_graphs')} ms"
            )
        del caches
    engine = runner.engine
    del runner, modes, lean
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return engine, out


# Attention as the profiler names it: SDPA's backend operators on the host
# (aten::_scaled_dot_product_flash_attention, ..._efficient_attention,
# ..._cudnn_attention) and the device kernels they launch (flash, fmha, ...).
ATTENTION = re.compile(r"flash|fmha|attention|scaled_dot_product|sdpa", re.IGNORECASE)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def profiled(run, device: str) -> dict[str, Any]:
    """One call of `run` under torch's profiler: device kernels launched and
    their summed time (the device's busy time, against the step's wall time:
    a host-bound step keeps the device idle), the host's synchronize calls by
    name, device<->host copies, and the attention operators and kernels by
    name (how many times each ran)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        _sync(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    kernels, kernel_us = 0, 0.0
    copies: Counter[str] = Counter()
    syncs: Counter[str] = Counter()
    attention: Counter[str] = Counter()
    for e in prof.events():
        name = e.name
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if name.startswith("Memcpy"):
                copies["dtoh" if "DtoH" in name else "htod" if "HtoD" in name else "dtod"] += 1
            elif not name.startswith("Memset"):
                kernels += 1
                kernel_us += e.time_range.elapsed_us()
        elif name in SYNC_CALLS:
            syncs[name] += 1
        if ATTENTION.search(name):
            attention[name[:120]] += 1
    return {
        "wall_ms": round(wall_ms, 2),
        "device_kernels": kernels,
        "device_busy_ms": round(kernel_us / 1e3, 2),
        "sync_calls": sum(syncs.values()),
        "sync_calls_by_name": dict(syncs),
        "copies": dict(copies),
        "attention": dict(attention.most_common(6)),
    }


def core_steps(target: Path, drafter: Path, device: str, dtype: str, sessions: list[int], context: int) -> list[dict]:
    """Whole steps through the services' own cores (benchmarks/engine.py's
    verify_steps / draft_steps, random drafts: mostly rejected): per number of
    sessions, a verify step of chains K = 4 (greedy, and sampled: their chains
    decided on the device) and of the static tree and a draft step of a
    chain K = 4, each with its dispatcher counts, min ms of 3 steps,
    and one more step under the profiler."""
    from drafter_svc.config import DrafterConfig
    from drafter_svc.core import Drafter
    from specd_core.rules.draft_shape import DraftShape
    from specd_core.rules.sampling import SamplingParams
    from verifier_svc.config import VerifierConfig
    from verifier_svc.core import Verifier

    from .engine import SAMPLED, TREE, _prompts, draft_steps, verify_steps

    # Byte budgets: both cores share one device, so neither may take a
    # fraction of what is free when it starts.
    common: dict[str, Any] = {"device": device, "dtype": dtype, "warmup": False, "kv_cache_memory": "4GiB"}
    verifier = Verifier(VerifierConfig(model_dir=str(target), **common))
    draft = Drafter(DrafterConfig(model_dir=str(drafter), **common))
    from specd_core.runtime.step_graphs import StepGraphs

    leans = [lean for lean in (verifier.runner.lean, draft.runner.lean) if lean is not None]
    assert len(leans) == 2  # the pair runs lean (Llama-3 RoPE)
    graphs = {id(lean): StepGraphs(lean, capture=device.startswith("cuda")) for lean in leans}
    _set(leans, STEP_SETTINGS["eager"], graphs)  # the counts and the first profile: eager
    params, rows = SamplingParams(), []
    chain = DraftShape.chain(4)
    kinds = {
        "verify_chain": functools.partial(verify_steps, verifier, shape=chain, reps=3),
        "verify_tree": functools.partial(verify_steps, verifier, shape=TREE, reps=3),
        # Sampled sessions of the same prompts: their chains decided on the device.
        "verify_chain_sampled": functools.partial(verify_steps, verifier, shape=chain, reps=3),
        "draft_chain": functools.partial(draft_steps, draft, shape=chain, reps=3),
    }
    for n in sessions:
        ids = [f"c{n}-{i}" for i in range(n)]
        sampled = [f"c{n}-s{i}" for i in range(n)]
        prompts = _prompts(n, context, verifier.vocab_size)
        opens = [verifier.prepare_open(i, p, params) for i, p in zip(ids, prompts)]
        opens += [verifier.prepare_open(i, p, SAMPLED) for i, p in zip(sampled, prompts)]
        for r in verifier.verify_batch(opens):
            assert not isinstance(r, Exception), r
        for i, p in zip(ids, prompts):
            draft.open_session(i, p, params)
        row: dict[str, Any] = {"sessions": n}
        for kind, step in kinds.items():
            row[kind] = step(sampled if kind.endswith("sampled") else ids)
            row[kind]["ms"] = row[kind].pop("host_ms")
        row["verify_chain"]["profile"] = profiled(_one_verify(verifier, ids, chain), device)
        _set(leans, STEP_SETTINGS["graphs"], graphs)
        for _ in range(2):  # a shape is captured when met again (step_graphs.py)
            _one_verify(verifier, ids, chain)()
        row["verify_chain"]["profile_graphs"] = profiled(_one_verify(verifier, ids, chain), device)
        _set(leans, STEP_SETTINGS["eager"], graphs)
        row["attention_settings"] = backend_ab(verifier, draft, ids, 3 if device == "cpu" else 6, device, graphs)
        rows.append(row)
        print(
            f"  {n:>3} sessions: "
            + ", ".join(f"{k} {row[k]['ms']} ms {row[k]['kernel_like']} ops {row[k]['syncs']} syncs" for k in kinds)
            + f"; verify profile {row['verify_chain']['profile']}; attention settings {row['attention_settings']}",
            flush=True,
        )
        for i in ids:
            verifier.close_session(i)
            draft.close_session(i)
        for i in sampled:
            verifier.close_session(i)
    del verifier, draft, kinds, leans, graphs  # the pools and weights go before the services load theirs
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


# The settings the steps compare: (SPECD_ATTENTION_BACKENDS, SPECD_KEY_BUCKET,
# CUDA graphs, SPECD_FOLD_HEADS) - torch's own attention at exact shapes,
# eagerly; the same without cuDNN's implementation; torch's choice with the
# key columns rounded up to blocks of 64 (a new shape once per 64 tokens);
# query heads as rows on any device (on CUDA eager is the grouped call; on a
# CPU the two are the same); and the step graphs
# (specd_core/runtime/step_graphs.py; the default on CUDA).
STEP_SETTINGS: dict[str, tuple[str | None, int, bool, str]] = {
    "eager": (None, 0, False, "auto"),
    "no_cudnn": ("flash,efficient,math", 0, False, "auto"),
    "key_bucket_64": (None, 64, False, "auto"),
    "fold_heads": (None, 0, False, "on"),
    "graphs": (None, 0, True, "auto"),
}


def _set(cores_lean: list, setting: tuple[str | None, int, bool, str], graphs: dict) -> None:
    """Put each lean model under a setting (graphs: each model's StepGraphs, kept across rounds)."""
    from specd_core.runtime.attention_backends import parse_backends

    backends, bucket, graphed, fold = setting
    for lean in cores_lean:
        lean.attention_backends = parse_backends(backends)
        lean.key_bucket = bucket
        lean.graphs = graphs[id(lean)] if graphed else None
        lean.fold_mode = fold


def backend_ab(verifier, draft, ids: list[str], rounds: int, device: str, graphs: dict) -> dict[str, Any]:
    """A verify step of chains K = 4, one of chains of depths 1 to 5 across
    the sessions, and a draft step of a chain K = 4 under each setting, in
    rounds that alternate the order: each step runs at the
    sessions' new lengths, as served steps do (a new shape every step; the
    graphs' shapes change once per key bucket). Per setting the median ms;
    each setting's ratio over eager, paired round by round, with its interval."""
    from specd_core.rules.draft_shape import DraftShape
    from specd_core.runtime.propose_call import ProposeCall

    chain, leans = DraftShape.chain(4), [verifier.runner.lean, draft.runner.lean]
    kinds = ("verify", "verify_mixed", "draft")
    times: dict[str, dict[str, list[float]]] = {k: {s: [] for s in STEP_SETTINGS} for k in kinds}
    committed = iter(range(11, 10**6))
    for r in range(rounds):
        for name in alternating(list(STEP_SETTINGS), r):
            _set(leans, STEP_SETTINGS[name], graphs)
            for kind, run in (
                ("verify", _one_verify(verifier, ids, chain)),
                ("verify_mixed", _mixed_verify(verifier, ids)),
            ):
                _sync(device)
                start = time.perf_counter()
                run()
                _sync(device)
                times[kind][name].append((time.perf_counter() - start) * 1e3)
            jobs = [draft.prepare(ProposeCall(i, [], [next(committed)], chain)) for i in ids]
            start = time.perf_counter()
            draft.propose_batch(jobs)
            _sync(device)
            times["draft"][name].append((time.perf_counter() - start) * 1e3)
    _set(leans, STEP_SETTINGS["eager"], graphs)
    out: dict[str, Any] = {}
    for kind, by in times.items():
        out[kind] = {name: round(statistics.median(ms), 2) for name, ms in by.items()}
        for name in list(STEP_SETTINGS)[1:]:
            out[kind][f"{name}_over_eager"] = paired_ratio(by[name], by["eager"])
    return out


def _mixed_verify(verifier, ids: list[str]):
    """A prepared verify step of chains of depths 1 to 5 across the sessions
    (as adaptive depths differ between sessions), as a call."""
    return _verify_call(verifier, ids, [1 + n % 5 for n in range(len(ids))])


def _one_verify(verifier, ids: list[str], shape):
    """A prepared verify step of chains of `shape` for `ids`, as a call."""
    return _verify_call(verifier, ids, [shape.depth] * len(ids))


def _verify_call(verifier, ids: list[str], depths: list[int]):
    """A prepared verify step of a chain of depths[i] drafts for session ids[i], as a call."""
    jobs = [verifier.prepare(i, list(range(7, 7 + d)), None) for i, d in zip(ids, depths)]
    return lambda: verifier.verify_batch(jobs)


# The stream settings: (stack, request fields). "eager" is a stack whose
# services run without CUDA graphs (SPECD_CUDA_GRAPHS=off), "graphs" one with
# them (the default on CUDA).
STREAM_SETTINGS: dict[str, tuple[str, dict]] = {
    "eager_off": ("eager", {"num_speculative_tokens": 0}),
    "eager_k4": ("eager", {"num_speculative_tokens": 4}),
    "off": ("graphs", {"num_speculative_tokens": 0}),
    "k4": ("graphs", {"num_speculative_tokens": 4}),
    "default": ("graphs", {}),
}
# (name, over): the ratios reported per level.
STREAM_RATIOS = (("off", "eager_off"), ("k4", "eager_k4"), ("k4", "off"), ("default", "off"), ("eager_k4", "eager_off"))


def run_streams(
    stacks: dict[str, Stack],
    prompts: list[list[int]],
    levels: list[int],
    rounds: int,
    seconds: float,
    warmup_s: float,
    max_new: int,
) -> list[dict]:
    """tokens/s of each STREAM_SETTINGS per level, in rounds that alternate
    the order; the STREAM_RATIOS with their intervals."""
    rows = []
    for n in levels:
        got: dict[str, list] = {s: [] for s in STREAM_SETTINGS}
        for r in range(rounds):
            for s in alternating(list(STREAM_SETTINGS), r):
                stack, fields = STREAM_SETTINGS[s]
                address = stacks[stack].orchestrator.address
                got[s].append(run_level(address, prompts, fields, n, max_new, seconds / rounds, warmup_s))
        merged = {s: merge_rounds(parts) for s, parts in got.items()}
        row: dict[str, Any] = {"streams": n}
        for s, m in merged.items():
            row[f"{s}_tokens_per_s"] = m["tokens_per_s"]
            row[f"{s}_draft_depth"] = m["draft_depth"]
        for a, b in STREAM_RATIOS:
            row[f"{a}_vs_{b}"] = round(merged[a]["tokens_per_s"] / merged[b]["tokens_per_s"], 3)
            row[f"{a}_vs_{b}_interval"] = ratio_interval(merged[a], merged[b])
        row["rounds"] = {s: m["rounds_tokens_per_s"] for s, m in merged.items()}
        rows.append(row)
        print(
            f"  {n:>3} streams: "
            + ", ".join(f"{s} {row[f'{s}_tokens_per_s']}" for s in STREAM_SETTINGS)
            + " tok/s; "
            + ", ".join(f"{a}/{b} x{row[f'{a}_vs_{b}']} {row[f'{a}_vs_{b}_interval']}" for a, b in STREAM_RATIOS),
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
    ap.add_argument("--streams", type=int, nargs="+", default=None, help="stream levels (default 1 8 32 64)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds per setting and level")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="which parts to run (default: all; the report prints those that ran)",
    )
    ap.add_argument("--reps", type=int, default=None, help="timed calls per forward cell (default 20, 3 with --tiny)")
    ap.add_argument(
        "--warmup-seconds",
        type=float,
        default=None,
        help="untimed seconds before each stream run (default 3, 1 with --tiny)",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--kv-cache-memory",
        default=None,
        help="each service's KV budget (default 16GiB, 256MiB with --tiny): the verifier and the "
        "drafter share one device, so neither takes a fraction of what is free",
    )
    ap.add_argument(
        "--attention-backends",
        default=None,
        help=f"the services' {ATTENTION_ENV} (specd_core/runtime/attention_backends.py; default: auto)",
    )
    args = ap.parse_args(argv)
    tiny = args.tiny
    args.device = args.device or ("cpu" if tiny else "cuda")
    args.dtype = args.dtype or ("float32" if tiny else "bfloat16")
    args.context = args.context or (24 if tiny else 512)
    args.streams = args.streams or ([1, 2] if tiny else [1, 8, 32, 64])
    args.seconds = args.seconds or (3.0 if tiny else 30.0)
    args.max_new_tokens = args.max_new_tokens or (12 if tiny else 128)
    args.reps = args.reps or (3 if tiny else 20)
    args.warmup_seconds = args.warmup_seconds if args.warmup_seconds is not None else (1.0 if tiny else 3.0)
    args.out = args.out or RESULTS / ("gpu-tiny.json" if tiny else "gpu.json")
    args.kv_cache_memory = args.kv_cache_memory or ("256MiB" if tiny else "16GiB")
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
    started = time.perf_counter()
    target = synthetic.build(target_cfg, base / "target", DEMO_TARGET, torch_dtype, device)
    drafter = synthetic.build(drafter_cfg, base / "drafter", DEMO_TARGET, torch_dtype, device, seed=1)

    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else None
    result: dict[str, Any] = {
        "meta": {
            "device": gpu or f"cpu ({platform.machine()})",
            "dtype": dtype,
            "tiny": tiny,
            "context": context,
            "target": target_cfg.to_diff_dict(),
            "drafter": drafter_cfg.to_diff_dict(),
            "torch": torch.__version__,
            "cuda_graphs": "parts 1-3: eager and graphs side by side; part 4: a stack with and one without",
            "services_attention_backends": args.attention_backends or "auto",
            "acceptance": "forced: both models predict the token they read (benchmarks/synthetic.py)",
            "build_s": round(time.perf_counter() - started, 1),
            "date": utc_now(),
        }
    }

    # Prompt ids: any but the special ones (an EOS would end a copying stream at once).
    rng = random.Random(0)
    pool = random_token_pool(tok)
    token_ids = random_prompts(pool, rng, 1, context + 8)[0]
    prompts = random_prompts(pool, rng, 16, min(context, 128))

    if "forwards" in args.parts:
        levels = levels_for_timing(tiny)
        print("verify forwards (target) ...", flush=True)
        engine_t, result["verify_ms"] = time_forwards(
            target, device, dtype, levels, [1, 5], context, args.reps, token_ids
        )
        print("draft levels (drafter) ...", flush=True)
        engine_d, result["draft_ms"] = time_forwards(drafter, device, dtype, levels, [1], context, args.reps, token_ids)
        result["meta"]["engines"] = {"target": engine_t, "drafter": engine_d}
        write_json(args.out, result)
    if "steps" in args.parts:
        print("whole steps through the cores ...", flush=True)
        result["steps"] = core_steps(target, drafter, device, dtype, levels_for_timing(tiny), min(context, 128))
        write_json(args.out, result)
    if "streams" in args.parts:
        streams_part(args, result, target, drafter, prompts)
    return result


def streams_part(args: argparse.Namespace, result: dict, target: Path, drafter: Path, prompts: list) -> None:
    """Part 4: two stacks side by side, one without CUDA graphs and one with
    (the default on CUDA; "on" on a CPU: padded static steps, the tiny mode's check)."""
    print("streams through the services ...", flush=True)
    service_args = ("--device", args.device, "--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory)
    common_env = {ATTENTION_ENV: args.attention_backends} if args.attention_backends else {}
    stacks: dict[str, Stack] = {}
    try:
        for name, graphs in (("eager", "off"), ("graphs", "auto" if args.device.startswith("cuda") else "on")):
            stacks[name] = Stack(str(target), str(drafter), service_args, env={**common_env, GRAPHS_ENV: graphs})
            # warm-up (and the graphs' first captures)
            run_level(stacks[name].orchestrator.address, prompts, {"num_speculative_tokens": 4}, 2, 8, 1.0, 0.0)
        result["streams"] = []
        for n in args.streams:
            result["streams"] += run_streams(
                stacks, prompts, [n], args.rounds, args.seconds, args.warmup_seconds, args.max_new_tokens
            )
            write_json(args.out, result)
        result["cycle"] = cycle_stats(stacks["graphs"], prompts[:4], args.max_new_tokens)
    finally:
        for stack in stacks.values():
            stack.stop()


def report(result: dict, args: argparse.Namespace) -> None:
    if "verify_ms" in result:
        report_forwards(result)
    if "steps" in result:
        report_steps(result)
    if "streams" in result:
        report_streams(result)
    print(f"wrote {args.out}")


def report_forwards(result: dict) -> None:
    engines = result["meta"]["engines"]
    print(f"\nengines: target {engines['target']}, drafter {engines['drafter']}")
    print("\n| forward | sessions | rows | eager ms | graphs ms | graphs / eager (interval) |")
    print("|---" * 6 + "|")
    for part in ("verify_ms", "draft_ms"):
        for r in result[part]:
            ratio = r.get("graphs_over_eager") or {}
            cells = [part[:-3], r["sessions"], r["rows"], r["ms"], r.get("ms_graphs"), ratio.get("geomean")]
            print("| " + " | ".join(str(c) for c in cells) + f" {ratio.get('interval')} |")


def report_steps(result: dict) -> None:
    print(
        "\n| sessions | verify chain ms | kernel-like ops | host syncs | device kernels | sync calls "
        "| verify tree ms | sampled verify chain ms, syncs | draft chain ms (4 levels) | draft syncs |"
    )
    print("|---" * 10 + "|")
    for r in result["steps"]:
        vc, vt, dc, vs = r["verify_chain"], r["verify_tree"], r["draft_chain"], r["verify_chain_sampled"]
        prof = vc["profile"]
        cells = [
            r["sessions"],
            vc["ms"],
            vc["kernel_like"],
            vc["syncs"],
            prof["device_kernels"],
            prof["sync_calls"],
            vt["ms"],
            f"{vs['ms']}, {vs['syncs']}",
            dc["ms"],
            dc["syncs"],
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print("\n| sessions | verify profile: wall ms, kernels, device busy ms, syncs | the same through graphs |")
    print("|---|---|---|")
    for r in result["steps"]:
        p, g = r["verify_chain"]["profile"], r["verify_chain"]["profile_graphs"]
        cells = [f"{x['wall_ms']}, {x['device_kernels']}, {x['device_busy_ms']}, {x['sync_calls']}" for x in (p, g)]
        print(f"| {r['sessions']} | " + " | ".join(cells) + " |")
    last = result["steps"][-1]
    print(f"attention at {last['sessions']} sessions: {last['verify_chain']['profile']['attention']}")
    others = list(STEP_SETTINGS)[1:]
    for kind in ("verify", "verify_mixed", "draft"):
        print(f"\n{kind} step ms by setting (over eager, interval)")
        print("| sessions | eager | " + " | ".join(others) + " |")
        print("|---" * (2 + len(others)) + "|")
        for r in result["steps"]:
            x = r["attention_settings"][kind]
            cells = [r["sessions"], x["eager"]]
            for name in others:
                ratio = x[f"{name}_over_eager"]
                cells.append(f"{x[name]} ({ratio['geomean']} {ratio['interval']})")
            print("| " + " | ".join(str(c) for c in cells) + " |")


def report_streams(result: dict) -> None:
    cycles = result["cycle"]
    print(f"\ncycle overhead p50 {cycles['overhead_ms_p50']} ms, {cycles['tokens_per_cycle']} tokens per cycle")
    print(
        "\n| streams | "
        + " | ".join(f"{s} tok/s" for s in STREAM_SETTINGS)
        + " | "
        + " | ".join(f"{a} / {b}" for a, b in STREAM_RATIOS)
        + " |"
    )
    print("|---" * (1 + len(STREAM_SETTINGS) + len(STREAM_RATIOS)) + "|")
    for r in result["streams"]:
        cells = [r["streams"], *(r[f"{s}_tokens_per_s"] for s in STREAM_SETTINGS)]
        cells += [f"{r[f'{a}_vs_{b}']} {r[f'{a}_vs_{b}_interval']}" for a, b in STREAM_RATIOS]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report)


def levels_for_timing(tiny: bool) -> list[int]:
    return [1, 4] if tiny else [1, 8, 32, 64]


if __name__ == "__main__":
    raise SystemExit(main())
