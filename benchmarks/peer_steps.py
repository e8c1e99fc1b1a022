"""One engine step of specd and of vLLM's CPU build on the same target and
CPU: how a step's time grows with the number of sessions in it.

    python -m benchmarks.peer_steps                          # 1/8/32/64 sessions, 3 rounds, ~6 min
    python -m benchmarks.peer_steps --sessions 1 64 --rounds 5
    python -m benchmarks.peer_steps --dtype float32 --out benchmarks/results/peer_steps_fp32.json

The target: benchmarks/engine.py's 32-layer shape (Llama-3.1-8B's structure
at a tiny width, untied head) with 8 query / 2 KV heads of 32 dims,
the pair `benchmarks.peer_vllm --pair engine` serves. First the benchmark
asks vLLM for a step of engine.py's own target (32 / 8 heads of 8 dims) and
records its answer (vLLM 0.32's CPU attention takes no head dim of 8).

Two steps for each number of sessions, every session past a 64-token prompt:
  decode  one row per session (its next token);
  5 rows  five rows per session over its cached context: for specd the
          verify of a chain of K = 4 random drafts (verifier_svc.core
          .Verifier.verify_batch: plan, forward, acceptance; the verifier's
          core in this process); for vLLM, which cannot be made to verify a
          given draft, five new tokens of requests whose first 64 are in its
          prefix cache (one LLMEngine.step() with every request added
          before it: schedule, forward, sampling, outputs;
          benchmarks/peer_steps_worker.py, in vLLM's own virtualenv and process).
vLLM's decode step is one LLMEngine.step() of requests past their prompts.
Both run one thread on this machine's CPU (vLLM binds its own core), weights
in --dtype (bfloat16 as benchmarks.engine; float32 is what specd serves on a CPU);
vLLM set up as benchmarks.peer_vllm sets it up (the same virtualenv), or one
line saying why not and exit 0.

A step's time is the median of --reps steps. Each round measures every point
of both systems (vLLM first in even rounds, specd first in odd ones; one
untimed round before). Printed: ms per step, each system's 64-over-1 (last
over first) ratio from its own steps of the same rounds, and specd over vLLM
per point, with intervals.

Writes benchmarks/results/peer_steps.json (or --out) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from specd_core.rules.sampling import SamplingParams
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier

from .common import CACHE, RESULTS, ROOT, alternating, fmt_ratio, machine, paired_ratio, utc_now
from .peer_vllm import VLLM_VENV, ensure_vllm, main_or_skip

WORKER = Path(__file__).with_name("peer_steps_worker.py")
CONTEXT = 64  # the worker's too
KINDS = {"decode": 1, "5 rows": 5}


class VllmSteps:
    """The worker process: one JSON line asked, one answered."""

    def __init__(self, python: Path, model: Path, max_sessions: int, dtype: str, timeout: float):
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout carries the answers only
        env.pop("PYTHONPATH", None)
        self.log = CACHE / "peer_steps" / f"vllm-{model.parent.name}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._err = open(self.log, "w")  # noqa: SIM115 - the worker writes it until close()
        self.proc = subprocess.Popen(
            [str(python), str(WORKER), str(model), str(max_sessions), dtype],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=env,
        )
        self.timeout = timeout
        first = self._answer()
        if "error" in first:
            self.close()
            raise RuntimeError(first["error"])

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.timeout
        while select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            line = self.proc.stdout.readline()
            if not line:
                return {"error": f"vLLM's worker ended (exit {self.proc.wait()}); log {self.log}"}
            if line.startswith("{"):
                return json.loads(line)
        return {"error": f"no answer in {self.timeout:.0f} s; log {self.log}"}

    def step_ms(self, sessions: int, rows: int, reps: int) -> list[float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"sessions": sessions, "rows": rows, "reps": reps}) + "\n")
        self.proc.stdin.flush()
        got = self._answer()
        if "error" in got:
            raise RuntimeError(f"vLLM, {sessions} sessions x {rows} rows: {got['error']}")
        return got["ms"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


class SpecdSteps:
    """The verifier's core in this process, as benchmarks.engine runs it."""

    def __init__(self, model: Path, dtype: str):
        cfg = VerifierConfig(model_dir=str(model), device="cpu", dtype=dtype, warmup=False, torch_threads=1)
        self.verifier = Verifier(cfg)
        self.rng = random.Random(0)
        self.names = iter(range(10**9))

    def step_ms(self, sessions: int, rows: int, reps: int) -> list[float]:
        v = self.verifier
        ids = [f"s{next(self.names)}" for _ in range(sessions)]
        prompts = [[self.rng.randrange(3, 4000) for _ in range(CONTEXT)] for _ in ids]
        for r in v.verify_batch([v.prepare_open(i, p, SamplingParams()) for i, p in zip(ids, prompts)]):
            assert not isinstance(r, Exception), r
        times = []
        for rep in range(reps + 1):  # the first untimed, as vLLM's first decode step
            jobs = [v.prepare(i, [self.rng.randrange(3, 4000) for _ in range(rows - 1)], None) for i in ids]
            start = time.perf_counter()
            for r in v.verify_batch(jobs):
                assert not isinstance(r, Exception), r
            if rep:
                times.append((time.perf_counter() - start) * 1e3)
        for i in ids:
            v.close_session(i)
        return times


def vllm_refusal(python: Path, model: Path, dtype: str, timeout: float) -> str | None:
    """What vLLM answers when asked to load `model` and run one decode step
    (None: it did; it loads a model its attention cannot run and fails at
    the first step)."""
    try:
        steps = VllmSteps(python, model, 1, dtype, timeout)
    except RuntimeError as e:
        return str(e)[-300:]
    try:
        steps.step_ms(1, 1, 1)
    except RuntimeError as e:
        return str(e)[-300:]
    finally:
        steps.close()
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    from .versus import engine_pair

    python, version, _ = ensure_vllm(args.vllm_venv, install=not args.no_install)
    torch.set_num_threads(1)
    own_target, _ = engine_pair()
    target, _ = engine_pair("engine_pair_hd32", num_attention_heads=8, num_key_value_heads=2)
    print(f"vLLM {version}; asking it to load {own_target} (head dim 8) ...", flush=True)
    refused = vllm_refusal(python, own_target, args.dtype, args.start_timeout)
    print(f"  {refused or 'loaded'}", flush=True)
    print(f"loading {target} in vLLM (its compile: a minute or two) and in specd ...", flush=True)
    vllm = VllmSteps(python, target, max(args.sessions), args.dtype, args.start_timeout)
    points = [(n, kind) for kind in KINDS for n in args.sessions]
    ms: dict[str, dict] = {s: {f"{n} {k}": [] for n, k in points} for s in ("vLLM", "specd")}
    try:
        systems: dict[str, VllmSteps | SpecdSteps] = {"vLLM": vllm, "specd": SpecdSteps(target, args.dtype)}
        for r in range(-1, args.rounds):
            for name in alternating(list(systems), max(r, 0)):
                for n, kind in points:
                    got = systems[name].step_ms(n, KINDS[kind], args.reps if r >= 0 else 1)
                    if r >= 0:
                        ms[name][f"{n} {kind}"].append(statistics.median(got))
            print(f"  round {r + 1 if r >= 0 else 'warm-up'} done", flush=True)
    finally:
        vllm.close()
    return {
        "when": utc_now(),
        "machine": machine(processor=True),
        "vllm": version,
        "target": str(target.relative_to(ROOT)),
        "vllm_on_engine_target": refused or "loaded",
        "dtype": args.dtype,
        "context": CONTEXT,
        "rounds": args.rounds,
        "reps": args.reps,
        "step_ms": {s: {p: [round(x, 2) for x in v] for p, v in d.items()} for s, d in ms.items()},
        **summaries(ms, args.sessions),
    }


def summaries(ms: dict[str, dict[str, list[float]]], sessions: list[int]) -> dict[str, Any]:
    """Per system and kind the last count's steps over the first's (paired by
    round); per point specd's over vLLM's."""
    first, last = sessions[0], sessions[-1]
    growth = {s: {k: paired_ratio(d[f"{last} {k}"], d[f"{first} {k}"]) for k in KINDS} for s, d in ms.items()}
    specd_over_vllm = {p: paired_ratio(ms["specd"][p], ms["vLLM"][p]) for p in ms["specd"]}
    return {"last_over_first": growth, "specd_over_vllm": specd_over_vllm}


def report(result: dict, args: argparse.Namespace) -> None:
    print(f"\nvLLM on engine.py's target (head dim 8): {result['vllm_on_engine_target']}")
    print(f"target: {result['target']}, {result['dtype']}; ms per step (median of rounds); {result['machine']}")
    print("| sessions | step | vLLM ms | specd ms | specd / vLLM |")
    print("|---|---|---|---|---|")
    for p, v in result["step_ms"]["specd"].items():
        n, kind = p.split(" ", 1)
        vl = statistics.median(result["step_ms"]["vLLM"][p])
        print(f"| {n} | {kind} | {vl:.1f} | {statistics.median(v):.1f} | {fmt_ratio(result['specd_over_vllm'][p])} |")
    first, last = args.sessions[0], args.sessions[-1]
    for s, d in result["last_over_first"].items():
        print(f"{s}: {last} sessions over {first}: " + ", ".join(f"{k} {fmt_ratio(r)}" for k, r in d.items()))
    print(f"\nwritten to {args.out}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peer_steps", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="both systems' weights")
    ap.add_argument("--reps", type=int, default=5, help="steps per point and round (their median)")
    ap.add_argument("--vllm-venv", type=Path, default=VLLM_VENV, help="vLLM's own virtualenv (made if missing)")
    ap.add_argument("--no-install", action="store_true", help="skip rather than install vLLM")
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds vLLM may take to load or answer")
    ap.add_argument("--out", type=Path, default=RESULTS / "peer_steps.json")
    args = ap.parse_args(argv)
    args.sessions = sorted(set(args.sessions))
    return args


def main(argv: list[str] | None = None) -> int:
    return main_or_skip("peer_steps", argv, parse, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
