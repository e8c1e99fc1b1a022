"""EAGLE head vs the distilled draft model on the demo pair.

    python -m benchmarks.eagle                  # 8 held-out prompts, 96 tokens, K = 2, 4, 6
    python -m benchmarks.eagle --quick          # 2 prompts, 32 tokens (smoke run)

Both methods run through the real services against the same target
(models/demo/target, fp32, NOT the cost-scaled one: the head reads this
target's features), greedy, a fixed chain of K per request (no adaptive depth),
on the held-out prompts the other benchmarks use (training.evaluate_pair).
Reported per method and K: mean accepted length (tokens committed per verify,
bonus included), per-position acceptance, tokens/s; for eagle also the feature
payload per cycle (bytes) and its serialisation cost (verifier: tensor -> fp16
bytes -> proto; drafter: proto -> bytes -> tensor), timed here on payloads of
the measured size. The features ride on the Propose / Verify messages a cycle
sends anyway (tests/test_eagle.py counts the calls), so there is no extra round
trip. Writes benchmarks/results/eagle.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.net.wire import hidden_from_proto, hidden_to_proto
from specd_core.runtime.features import HiddenStates
from specd_core.runtime.models import load_tokenizer

from .common import RESULTS, ROOT, add_pair_args, heldout_prompts, run_main


def run_setting(stack: Stack, prompts, fields: dict, max_new: int, hidden: int) -> dict:
    """One setting of one method over the prompts: its figures."""
    tokens = cycles = committed = drafted = accepted = feature_bytes = 0
    seconds = 0.0
    per_position: list[int] = []
    overhead: list[float] = []
    prompt_bytes = 0
    for p in prompts:
        start = time.perf_counter()
        ids, last = stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=max_new, temperature=0.0, **fields)
        seconds += time.perf_counter() - start
        assert last is not None
        s = last.stats
        tokens += len(ids)
        cycles += s.cycles
        committed += round(s.mean_accepted_length * s.cycles)
        drafted += s.drafted_tokens
        accepted += s.accepted_tokens
        feature_bytes += s.feature_bytes
        prompt_bytes += 2 * len(p) * hidden if s.feature_bytes else 0
        overhead += list(s.cycle_overhead_ms)
        per_position = [
            a + b for a, b in zip(per_position or [0] * len(s.accepted_per_position), s.accepted_per_position)
        ]
    out = {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "cycles": cycles,
        "drafted": drafted,
        "accepted": accepted,
        "mean_accepted_length": round(committed / cycles, 3),
        "acceptance_per_position": [round(a / cycles, 3) for a in per_position],
        "cycle_overhead_ms_median": round(statistics.median(overhead), 3) if overhead else 0.0,
    }
    if feature_bytes:
        out.update(
            feature_bytes_total=feature_bytes,
            prefill_feature_bytes=prompt_bytes,
            feature_bytes_per_cycle=round((feature_bytes - prompt_bytes) / cycles, 1),
        )
    return out


@torch.no_grad()
def drafter_agreement(target_dir: Path, drafter_dir: Path, seq_len: int = 256) -> float:
    """Teacher-forced top-1 agreement of the draft model with the target on the
    windows training/eagle.py evaluates the head on (a token-only drafter's
    agreement is the same at every draft level when tokens are teacher-forced)."""
    from specd_core.runtime.models import load_model
    from training.eagle import heldout_ids, heldout_windows

    w = heldout_windows(heldout_ids(load_tokenizer(str(target_dir))), seq_len)
    t = load_model(str(target_dir), "cpu")(input_ids=w).logits.argmax(-1)
    d = load_model(str(drafter_dir), "cpu")(input_ids=w).logits.argmax(-1)
    # The head's level 1 predicts x_{t+2} from x_<=t+1: positions 1.. of these logits.
    return float((t[:, 1:] == d[:, 1:]).float().mean())


def head_top1(head: Path) -> list[float]:
    """The head's held-out top-1 per draft level, from its training record."""
    info = json.loads((head / "train_info.json").read_text()) if (head / "train_info.json").exists() else {}
    fin = info.get("final_heldout", {})
    return [round(fin[k], 4) for k in ("top1", "top1_2", "top1_3", "top1_4") if k in fin]


def serialisation_ms(rows: int, hidden: int, reps: int = 2000) -> dict:
    """Per cycle: the verifier's tensor -> fp16 bytes -> VerifyResponse bytes,
    and the drafter's ProposeRequest bytes -> tensor (the orchestrator only
    copies the bytes field from one message to the other)."""
    h = torch.randn(rows, hidden) * 8
    t0 = time.perf_counter()
    for _ in range(reps):
        wire = pb.VerifyResponse(hidden_states=hidden_to_proto(HiddenStates.encode(h))).SerializeToString()
    enc = (time.perf_counter() - t0) / reps * 1e3
    t0 = time.perf_counter()
    for _ in range(reps):
        msg = pb.VerifyResponse.FromString(wire)
        req = pb.ProposeRequest(hidden_states=msg.hidden_states).SerializeToString()
    relay = (time.perf_counter() - t0) / reps * 1e3
    t0 = time.perf_counter()
    for _ in range(reps):
        m = pb.ProposeRequest.FromString(req)
        hidden_from_proto(m.hidden_states, True).decode()
    dec = (time.perf_counter() - t0) / reps * 1e3
    return {
        "rows": rows,
        "payload_bytes": 2 * rows * hidden,
        "verifier_encode_ms": round(enc, 4),
        "orchestrator_relay_ms": round(relay, 4),
        "drafter_decode_ms": round(dec, 4),
        "total_ms": round(enc + relay + dec, 4),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(ap, cost_scaled=False)
    ap.add_argument("--head", type=Path, default=ROOT / "models/demo/eagle")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument(
        "--trees",
        nargs="*",
        default=["2,2,1,1", "dyn-10x6"],
        help="also these trees (static branching or dyn-NODESxDEPTH) for both methods",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "eagle.json")
    a = ap.parse_args(argv)
    if a.quick:
        a.prompts, a.max_new_tokens, a.trees = 2, 32, ["2,1"]
    return a


def settings(a: argparse.Namespace) -> list[tuple[str, dict]]:
    """(label, GenerateRequest fields): off, a chain per K, each tree."""
    out: list[tuple[str, dict]] = [("off", {"num_speculative_tokens": 0})]
    out += [(f"chain-{k}", {"num_speculative_tokens": int(k)}) for k in a.ks.split(",")]
    for t in a.trees:
        if t.startswith("dyn-"):
            n, _, d = t[4:].partition("x")
            out.append((t, {"tree": {"node_budget": int(n), "max_depth": int(d or 6)}}))
        else:
            out.append((f"tree-{t}", {"tree": {"branching": [int(x) for x in t.split(",")]}}))
    return out


def measure(a: argparse.Namespace, prompts: list[list[int]], hidden: int) -> dict[str, dict]:
    """Per setting, per method (draft_model, eagle) through its own stack."""
    args = ("--torch-threads", str(a.threads), "--dtype", "float32")
    results: dict[str, dict] = {}
    for method, drafter, extra in (("draft_model", a.drafter, ()), ("eagle", a.head, ("--method", "eagle"))):
        stack = Stack(str(a.target), str(drafter), args, orchestrator_args=extra)
        try:
            stack.generate(prompt_token_ids={"ids": prompts[0]}, max_new_tokens=8, num_speculative_tokens=2)  # warm-up
            for label, fields in settings(a):
                if label == "off" and method == "eagle":
                    continue
                r = results.setdefault(label, {})[method] = run_setting(
                    stack, prompts, fields, a.max_new_tokens, hidden
                )
                print(
                    f"{method:11s} {label:10s} accepted length {r['mean_accepted_length']:.2f} "
                    f"{r['tokens_per_s']:6.1f} tok/s"
                    + (
                        f"  features {r['feature_bytes_per_cycle']:.0f} B/cycle"
                        if "feature_bytes_per_cycle" in r
                        else ""
                    ),
                    flush=True,
                )
        finally:
            stack.stop()
    return results


def run(a: argparse.Namespace) -> dict:
    """Both methods measured, the serialisation timed at the measured payload
    and at a prefill's, the teacher-forced agreement of each."""
    tok = load_tokenizer(str(a.target))
    prompts = heldout_prompts(tok, a.prompts, a.prompt_tokens, a.max_new_tokens)
    head_cfg = json.loads((a.head / "config.json").read_text())
    hidden = head_cfg["hidden_size"]
    results = measure(a, prompts, hidden)
    rows = [results[k]["eagle"]["feature_bytes_per_cycle"] / (2 * hidden) for k in results if "eagle" in results[k]]
    return {
        "setup": {
            "target": str(a.target.relative_to(ROOT)),
            "drafter": str(a.drafter.relative_to(ROOT)),
            "head": str(a.head.relative_to(ROOT)),
            "prompts": a.prompts,
            "prompt_tokens": a.prompt_tokens,
            "max_new_tokens": a.max_new_tokens,
            "greedy": True,
            "dtype": "float32",
            "torch_threads": a.threads,
            "machine": platform.machine(),
            "torch": torch.__version__,
            "head_training": head_cfg.get("training", "done"),
        },
        "results": results,
        "serialisation_per_cycle": serialisation_ms(max(1, round(statistics.mean(rows))), hidden),
        "serialisation_prefill": serialisation_ms(a.prompt_tokens, hidden, 500),
        "teacher_forced_top1": {
            "draft_model": round(drafter_agreement(a.target, a.drafter), 4),
            "eagle_per_level": head_top1(a.head),
        },
    }


def report(result: dict, a: argparse.Namespace) -> None:
    ser, ser_max = result["serialisation_per_cycle"], result["serialisation_prefill"]
    print(f"\n{'setting':10s} {'draft_model':>12s} {'eagle':>8s}   (mean accepted length)")
    for label, r in result["results"].items():
        if "eagle" in r:
            print(
                f"{label:10s} {r['draft_model']['mean_accepted_length']:12.2f} "
                f"{r['eagle']['mean_accepted_length']:8.2f}"
            )
    print(
        f"features: {ser['payload_bytes']} B/cycle (mean), serialisation {ser['total_ms']:.3f} ms/cycle; "
        f"prefill {ser_max['payload_bytes']} B, {ser_max['total_ms']:.3f} ms -> {a.out}"
    )


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parse, run, report)


if __name__ == "__main__":
    raise SystemExit(main())
