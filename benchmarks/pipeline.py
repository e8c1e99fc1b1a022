"""Pipelined drafting at batch 1: how much of the draft time the verify hides,
measured from the per-cycle traces.

    python -m benchmarks.pipeline            # demo pair, cost-scaled target, bf16
    python -m benchmarks.pipeline --quick

One stream at a time, greedy, held-out prompts; chains of K = 1..4 with
pipelining off and on, on with each number of pre-drafted alternatives per
depth (--alternatives; 0 = the all-kept branch only). The services export their traces to a real OTLP
receiver in this process, which keeps the `specdec.cycle` spans' attributes.
Per run, from those spans: the draft time a cycle waited for (`draft.wait_ms`),
the Propose calls' own time (`draft.call_ms`), and the cycles whose draft was
made ahead and used. The headline, "draft time hidden", compares the two runs:
1 - (mean wait per drafted cycle, pipelining on) / (mean draft call per drafted
cycle, pipelining off). (The on-run's own 1 - sum(wait) / sum(call) reads higher,
because a pre-draft's call is slowed by running beside the verify.) Also
tokens/s. Writes benchmarks/results/pipeline.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import threading
import time
from pathlib import Path

import torch

from specd.local_stack import Stack
from specd_core.runtime.models import load_tokenizer

from .speedup import RESULTS, add_pair_args, cost_scaled_target


class CycleSpanSink:
    """A real OTLP/gRPC trace receiver that keeps the cycle spans' attributes."""

    def __init__(self):
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc

        sink = self
        self.cycles: list[dict] = []
        self.lock = threading.Lock()

        def value(v):
            return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None

        class Servicer(tgrpc.TraceServiceServicer):
            def Export(self, request, context):
                got = [{a.key: value(a.value) for a in span.attributes}
                       for r in request.resource_spans for s in r.scope_spans for span in s.spans
                       if span.name == "specdec.cycle"]
                with sink.lock:
                    sink.cycles += got
                return tpb.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        tgrpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def take(self, expected: int, timeout_s: float = 30.0) -> list[dict]:
        """The cycle spans received so far, once `expected` of them are in (the
        exporters batch, so the last ones arrive a little after the streams end)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.cycles) >= expected:
                    break
            time.sleep(0.2)
        with self.lock:
            got, self.cycles = self.cycles, []
        # A span or two may still be in an exporter's queue; a run whose spans
        # are mostly missing is an error, not a result.
        if not expected * 0.98 <= len(got) <= expected:
            raise RuntimeError(f"expected {expected} cycle spans, received {len(got)}")
        return got

    def stop(self):
        self.server.stop(0)


def from_traces(spans: list[dict]) -> dict:
    drafted = [s for s in spans if s.get("specdec.draft.nodes", 0) > 0]
    call = sum(s["specdec.draft.call_ms"] for s in drafted)
    wait = sum(s["specdec.draft.wait_ms"] for s in drafted)
    return dict(cycles=len(spans), drafted_cycles=len(drafted),
                pipelined_cycles=sum(bool(s["specdec.draft.pipelined"]) for s in drafted),
                alternative_cycles=sum(bool(s["specdec.draft.pipelined"]) and s.get("specdec.draft.branch", 0) > 0
                                       for s in drafted),
                draft_call_ms=round(call, 1), draft_wait_ms=round(wait, 1),
                hidden_in_run=round(1 - wait / call, 3) if call else 0.0,
                draft_wait_ms_per_cycle=round(wait / max(1, len(drafted)), 2),
                verify_ms_per_cycle=round(sum(s["specdec.verify_ms"] for s in spans) / len(spans), 2),
                draft_call_ms_per_cycle=round(call / max(1, len(drafted)), 2))


def main(argv=None) -> int:
    from training.evaluate_pair import make_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(ap)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--alternatives", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "pipeline.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.ks, args.prompts, args.max_new_tokens = [2], 3, 32

    target = cost_scaled_target(args.target, args.min_params)
    tok = load_tokenizer(str(args.target))
    prompts = [p.tolist() for p in make_prompts(tok, args.prompts, args.prompt_tokens, args.max_new_tokens)]
    sink = CycleSpanSink()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.port}", "OTEL_TRACES_SAMPLER": "always_on",
           "OTEL_BSP_SCHEDULE_DELAY": "200"}     # export every 200 ms: each run's spans arrive soon after it
    stack = Stack(str(target), str(args.drafter), ("--dtype", args.dtype), env=env)
    rows = []
    try:
        _, warm = stack.generate(prompt_token_ids={"ids": prompts[0]}, max_new_tokens=8, num_speculative_tokens=2)
        sink.take(warm.stats.cycles)
        for k in args.ks:
            outputs, off = {}, None
            for alts in (None, *args.alternatives):       # None: pipelining off
                pipeline = alts is not None
                tokens, cycles, seconds, outs = 0, 0, 0.0, []
                for p in prompts:
                    start = time.perf_counter()
                    ids, last = stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=args.max_new_tokens,
                                               num_speculative_tokens=k, adaptive_speculation=False,
                                               pipeline_drafting=pipeline, pipeline_alternatives=alts or 0)
                    seconds += time.perf_counter() - start
                    tokens, cycles = tokens + len(ids), cycles + last.stats.cycles
                    outs.append(ids)
                outputs[alts] = outs
                row = dict(k=k, pipeline=pipeline, alternatives=alts, tokens=tokens, seconds=round(seconds, 3),
                           stats_cycles=cycles, tokens_per_s=round(tokens / seconds, 2),
                           **from_traces(sink.take(cycles)))
                if pipeline:
                    row["hidden"] = round(1 - row["draft_wait_ms_per_cycle"] / off["draft_call_ms_per_cycle"], 3)
                    row["speedup_vs_off"] = round(row["tokens_per_s"] / off["tokens_per_s"], 3)
                    # Exactness: greedy output must not depend on pipelining.
                    same = sum(a == b for a, b in zip(outputs[None], outs))
                    row["outputs_equal_to_pipeline_off"] = f"{same}/{len(prompts)}"
                else:
                    off = row
                rows.append(row)
                print(f"K={k} pipeline {f'on, {alts} alt' if pipeline else 'off'}: {row['tokens_per_s']:6.1f} tok/s, "
                      f"draft wait {row['draft_wait_ms_per_cycle']} of call {row['draft_call_ms_per_cycle']} ms/cycle "
                      f"({row['pipelined_cycles']}/{row['drafted_cycles']} cycles pipelined, "
                      f"{row['alternative_cycles']} on a rejection branch), "
                      f"verify {row['verify_ms_per_cycle']} ms/cycle", flush=True)
    finally:
        stack.stop()
        sink.stop()

    meta = dict(machine=f"{platform.machine()}, {torch.get_num_threads()} torch threads; torch {torch.__version__}",
                target=str(target), drafter=str(args.drafter), dtype=args.dtype, prompts=len(prompts),
                max_new_tokens=args.max_new_tokens, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print("\n| K | pipeline (alternatives) | tok/s | vs off | cycles with a used pre-draft (of them, a rejection "
          "branch) | draft wait / call ms per cycle | draft time hidden (in-run) | verify ms/cycle | output = off |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mode = f"on ({r['alternatives']})" if r["pipeline"] else "off"
        print(f"| {r['k']} | {mode} | {r['tokens_per_s']} "
              f"| {r.get('speedup_vs_off', '')} | {r['pipelined_cycles']}/{r['drafted_cycles']} "
              f"({r['alternative_cycles']}) | {r['draft_wait_ms_per_cycle']} / {r['draft_call_ms_per_cycle']} "
              f"| {r.get('hidden', '')} ({r['hidden_in_run']}) | {r['verify_ms_per_cycle']} "
              f"| {r.get('outputs_equal_to_pipeline_off', '')} |")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
