"""Structured output: what drafting the tokens a JSON schema forces buys.

    python -m benchmarks.structured            # demo pair, cost-scaled target, 6 rounds of 10 requests
    python -m benchmarks.structured --quick    # smoke run: 2 rounds of 5 requests, 96 tokens (no intervals)

Three systems on the same JSON-schema requests (benchmarks/json_schemas.py:
ten schemas, each with its prompt; request j is schema j mod 10 with seed j):

* forced-on: method draft_model, chain of --k, forced-token drafting on (the
  default): the tokens the schema forces (a key's `": "`, the next key,
  closing brackets, an enum's tail) join the chain with q = 1 wherever they
  fall, within the drafter's chain (riding in the forward of the token
  before them) and after its last token, besides its K (docs/structured.md);
* forced-off: the same with `forced_drafting=False`: the drafter drafts
  every position itself, forced ones included (its q masked to one token);
* spec-off: `speculative_method="off"`, plain constrained decoding through
  the same services.

Every round runs each system once on all the requests, one at a time (batch
1), in an order rotated each round (benchmarks/common.py), greedy and at
T = 0.8. Per system: mean accepted length (tokens committed per verify, the
bonus included: sum over requests of GenerationStats.mean_accepted_length x
cycles / sum of cycles), alpha, tokens/s (completion tokens / wall time of
the requests), forced tokens drafted and kept, the share of outputs that end
with EOS ("stop") and how many of those parse and satisfy their schema
(`jsonschema`, when installed), and greedy, how many outputs equal
spec-off's. Ratios of tokens/s and of accepted length between the systems are
geometric means of per-round ratios with a rough 95 % interval (none below 3
rounds). Writes benchmarks/results/structured.json (--out), prints the tables.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb

from .common import RESULTS, add_pair_args, fmt_ratio, machine, pair_target, paired_ratio, rotated, utc_now, write_json
from .json_schemas import SCHEMAS, SchemaPrompt
from .otlp import UNTRACED_ENV

ON, OFF, SPEC_OFF = "forced-on", "forced-off", "spec-off"
SYSTEMS = (ON, OFF, SPEC_OFF)
# (a, b): a's figures over b's.
RATIOS = ((ON, OFF), (ON, SPEC_OFF), (OFF, SPEC_OFF))


def system_fields(system: str, k: int) -> dict:
    """GenerateRequest fields of a system. The drafting systems name K, so
    their depth is fixed: an adaptive depth would be chosen from costs the
    orchestrator learns from every request, the other systems' included."""
    if system == SPEC_OFF:
        return {"speculative_method": "off"}
    out: dict = {"speculative_method": "draft_model", "num_speculative_tokens": k}
    if system == OFF:
        out["forced_drafting"] = False
    return out


@dataclass(frozen=True)
class Request:
    schema: SchemaPrompt
    prompt: str
    seed: int


def make_requests(n: int) -> list[Request]:
    """n requests cycling over the schemas; past the first ten, the prompt gets
    a numbered line first, so that a greedy repeat of a schema is not the very
    same request."""
    out = []
    for j in range(n):
        s = SCHEMAS[j % len(SCHEMAS)]
        lap = j // len(SCHEMAS)
        out.append(Request(s, s.prompt if lap == 0 else f"# example {lap + 1}\n{s.prompt}", j))
    return out


def validator():
    """(schema, value) -> None or the first error's message; None when
    jsonschema is not installed (it is in the `test` extra)."""
    try:
        import jsonschema
    except ImportError:
        return None

    def check(schema: dict, value) -> str | None:
        err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(value))
        return None if err is None else err.message

    return check


@dataclass
class Row:
    """One system's requests in one round, summed."""

    system: str
    tokens: int = 0
    seconds: float = 0.0
    cycles: int = 0
    committed: int = 0  # tokens committed by verify passes (mean accepted length x cycles)
    drafted: int = 0
    accepted: int = 0
    forced: int = 0
    forced_accepted: int = 0
    requests: int = 0
    stopped: int = 0
    parsed: int = 0  # stopped outputs that are JSON
    valid: int = 0  # ... and satisfy their schema (jsonschema installed)
    invalid: list[str] = field(default_factory=list)  # what failed, for the JSON file
    cut: list[str] = field(default_factory=list)  # schemas of the outputs that ran to max_new_tokens
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.committed / self.cycles if self.cycles else 0.0


def run_system(stack: Stack, system: str, requests: list[Request], temperature: float, args, check) -> Row:
    row = Row(system)
    extra = system_fields(system, args.k)
    for q in requests:
        req = pb.GenerateRequest(
            prompt=q.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=temperature,
            seed=q.seed,
            structured_output=pb.StructuredOutput(json_schema=q.schema.text),
            **extra,
        )
        ids, text, last = [], "", None
        start = time.perf_counter()
        for r in stack.stub.Generate(req, timeout=600):
            ids += r.token_ids
            text += r.text
            last = r
        row.seconds += time.perf_counter() - start
        assert last is not None, "a Generate stream ended without a message"
        s = last.stats
        row.requests += 1
        row.tokens += s.completion_tokens
        row.cycles += s.cycles
        row.committed += round(s.mean_accepted_length * s.cycles)
        row.drafted += s.drafted_tokens
        row.accepted += s.accepted_tokens
        row.forced += s.forced_tokens
        row.forced_accepted += s.forced_accepted
        row.outputs.append(ids)
        if last.finish_reason != "stop":
            row.cut.append(q.schema.name)
            continue
        row.stopped += 1
        # The texts concatenated are the output without the EOS (the final
        # message flushes what the detokenizer held back).
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            row.invalid.append(f"{q.schema.name} seed {q.seed}: not JSON ({exc}): {text!r}")
            continue
        row.parsed += 1
        if check is None:
            continue
        error = check(q.schema.schema, value)
        if error is None:
            row.valid += 1
        else:
            row.invalid.append(f"{q.schema.name} seed {q.seed}: {error}: {text!r}")
    return row


def compare(stack: Stack, requests: list[Request], temperature: float, args, check):
    """Each system once per round on the same requests, in an order rotated
    each round; each system's rows (one per round) and the rounds' orders."""
    rows: dict[str, list[Row]] = {s: [] for s in SYSTEMS}
    schedule = []
    for r in range(args.rounds):
        order = rotated(SYSTEMS, r)
        schedule.append(order)
        for s in order:
            rows[s].append(run_system(stack, s, requests, temperature, args, check))
        print(
            f"T={temperature:g} round {r + 1}/{args.rounds}: "
            + ", ".join(f"{s} {rows[s][-1].tokens_per_s:.1f} tok/s" for s in SYSTEMS),
            flush=True,
        )
    return rows, schedule


def figures(rows: list[Row], spec_off: list[Row] | None, greedy: bool) -> dict:
    """One system over its rounds (pooled), with its per-round figures; greedy,
    how many of its outputs equal spec-off's on the same request in the same
    round (spec_off: spec-off's rows, None for spec-off itself)."""
    total = Row(rows[0].system)
    for r in rows:
        for f in fields(Row):
            if f.name != "system":  # counts add up, lists concatenate
                setattr(total, f.name, getattr(total, f.name) + getattr(r, f.name))
    d: dict = {
        "requests": total.requests,
        "tokens": total.tokens,
        "seconds": round(total.seconds, 3),
        "tokens_per_s": round(total.tokens_per_s, 2),
        "cycles": total.cycles,
        "mean_accepted_length": round(total.mean_accepted_length, 3),
        "alpha": round(total.accepted / total.drafted, 4) if total.drafted else None,
        "drafted_tokens": total.drafted,
        "accepted_tokens": total.accepted,
        "forced_tokens": total.forced,
        "forced_accepted": total.forced_accepted,
        "stop_share": round(total.stopped / total.requests, 4) if total.requests else None,
        "stopped": total.stopped,
        "parsed": total.parsed,
        "valid": total.valid,
        "invalid": total.invalid,
        "length_finishes": dict(Counter(total.cut)),
        "rounds_tokens_per_s": [round(r.tokens_per_s, 3) for r in rows],
        "rounds_mean_accepted_length": [round(r.mean_accepted_length, 4) for r in rows],
    }
    if greedy and spec_off is not None:
        pairs = [(a, b) for r, o in zip(rows, spec_off) for a, b in zip(r.outputs, o.outputs)]
        d["greedy_outputs_equal_spec_off"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    return d


def summarise(rows: dict[str, list[Row]], greedy: bool) -> dict:
    systems = {s: figures(rs, None if s == SPEC_OFF else rows[SPEC_OFF], greedy) for s, rs in rows.items()}
    ratios = []
    for a, b in RATIOS:
        ratios.append(
            {
                "a": a,
                "b": b,
                "tokens_per_s": paired_ratio(systems[a]["rounds_tokens_per_s"], systems[b]["rounds_tokens_per_s"]),
                "mean_accepted_length": paired_ratio(
                    systems[a]["rounds_mean_accepted_length"], systems[b]["rounds_mean_accepted_length"]
                ),
            }
        )
    return {"systems": systems, "ratios": ratios}


def systems_table(summary: dict) -> str:
    head = (
        "| system | tok/s | mean accepted length | alpha | forced tokens (kept) | stop share "
        "| stopped: JSON / schema-valid | greedy = spec-off |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for name, d in summary["systems"].items():
        alpha = "" if d["alpha"] is None else f"{d['alpha']:.3f}"
        lines.append(
            f"| {name} | {d['tokens_per_s']:.1f} | {d['mean_accepted_length']:.3f} | {alpha} "
            f"| {d['forced_tokens']} ({d['forced_accepted']}) | {d['stop_share']:.3f} "
            f"| {d['stopped']}: {d['parsed']} / {d['valid']} | {d.get('greedy_outputs_equal_spec_off', '')} |"
        )
    return "\n".join(lines)


def ratios_table(summary: dict) -> str:
    lines = ["| ratio | tok/s (interval) | mean accepted length (interval) |", "|---|---|---|"]
    for r in summary["ratios"]:
        lines.append(
            f"| {r['a']} / {r['b']} | {fmt_ratio(r['tokens_per_s'])} | {fmt_ratio(r['mean_accepted_length'])} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(ap)
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds; an interval needs 3 at least")
    ap.add_argument("--requests", type=int, default=10, help="requests per system per round (schema j mod 10)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="drafter tokens per chain (forced-on may append more)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="model dtype (fp32 by default: on a CPU without bf16 matmul units, verifying K + 1 rows "
        "costs far more than one in bf16; see benchmarks/README.md)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0 = torch default)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 5 requests, 96 new tokens")
    ap.add_argument("--out", type=Path, default=RESULTS / "structured.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.max_new_tokens = 2, 5, 96
    if args.rounds < 1 or args.requests < 1:
        ap.error("--rounds and --requests must be at least 1")
    return args


def round_records(rows: dict[str, list[Row]]) -> dict[str, list[dict]]:
    """Each system's rounds as they were measured (the counts behind the ratios)."""
    keys = ("tokens", "cycles", "committed", "forced", "forced_accepted")
    return {
        s: [{k: getattr(r, k) for k in keys} | {"seconds": round(r.seconds, 4), "stopped": r.stopped} for r in rs]
        for s, rs in rows.items()
    }


def warm_up(stack: Stack, k: int) -> None:
    """Every schema once through all three services, so that no round pays a
    grammar's compilation (each service compiles a distinct schema once) or
    the first calls' costs."""
    for s in SCHEMAS:
        stack.generate(
            prompt=s.prompt,
            max_new_tokens=8,
            structured_output={"json_schema": s.text},
            num_speculative_tokens=k,
        )


def run(args: argparse.Namespace) -> dict:
    """Every temperature's rounds, writing the result after each (a failure
    later keeps what was measured)."""
    # --min-params 0: the demo target as it is (a 7 M-parameter model: cheap
    # verifies, so the drafter's cost weighs more than on a real pair).
    target = pair_target(args)
    requests = make_requests(args.requests)
    check = validator()
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict = {
        "meta": {
            "machine": machine(processor=True),
            "target": str(target),
            "drafter": str(args.drafter),
            "dtype": args.dtype,
            "k": args.k,
            "requests": len(requests),
            "schemas": sorted({q.schema.name for q in requests}),
            "max_new_tokens": args.max_new_tokens,
            "rounds": args.rounds,
            "schema_validation": check is not None,
            "date": utc_now(),
        },
        "modes": {},
    }
    service_args = ("--dtype", args.dtype) + (("--torch-threads", str(args.threads)) if args.threads else ())
    stack = Stack(str(target), str(args.drafter), service_args, env=UNTRACED_ENV)
    try:
        warm_up(stack, args.k)
        for t in args.temperatures:
            rows, schedule = compare(stack, requests, t, args, check)
            mode = "greedy" if t == 0 else f"T={t:g}"
            result["modes"][mode] = {
                "temperature": t,
                **summarise(rows, greedy=t == 0),
                "schedule": schedule,
                "rounds": round_records(rows),
            }
            write_json(args.out, result)
    finally:
        stack.stop()
    return result


def report(result: dict, args: argparse.Namespace) -> None:
    for mode, m in result["modes"].items():
        print(
            f"\n## {mode}: {result['meta']['requests']} JSON-schema requests x {args.max_new_tokens} max new tokens, "
            f"K = {args.k}, {args.rounds} rounds "
            "(pooled over rounds; ratios: geometric mean of per-round ratios, ~95 % interval)\n"
        )
        print(systems_table(m))
        print()
        print(ratios_table(m))
        cut = {name: d["length_finishes"] for name, d in m["systems"].items() if d["length_finishes"]}
        if cut:
            print(f"\nran to max_new_tokens (per system, schema): {cut}")
        bad = [x for d in m["systems"].values() for x in d["invalid"]]
        if bad:
            print(f"\n{len(bad)} stopped outputs failed JSON or schema checks, e.g. {bad[0]}")
    print(f"\nwrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    report(run(args), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
