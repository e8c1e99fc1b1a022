"""Capacity of the orchestrator tier: a discrete-event model of the serving
path (benchmarks/capacity_sim.py) with costs fitted from
benchmarks/orchestrator.py's measurements (benchmarks/capacity_fit.py);
docs/capacity.md explains the model and its assumptions.

    python -m benchmarks.simulate                       # 250 ... 2,000 streams, 1 ... 8 orchestrators, GPU services
    python -m benchmarks.simulate --table               # the same as Markdown
    python -m benchmarks.simulate --check results.json  # fit on the 1-orchestrator rows, predict the others

--check (validation): per method, the costs of every process (orchestrator,
verifier, drafter, the load generator) are fitted from the rows measured with
one orchestrator, and the model, placed as the benchmark ran (every process
on the machine's cores, the services' batching as they ran, each row's own
requests, cycles per request and streams per orchestrator), predicts the
session-cycles per second of the rows measured with more. It prints predicted
vs measured and the relative error against the goal (--goal, 15 %); the rows
predicted take no part in the fit. The 1-orchestrator rows are printed too,
marked in-sample. Two more figures are fitted on those rows alone: the
machine's slowdown per core of other processes' load (each window's own
load, measured, is then modelled: those cores taken from the machine, every
process slowed; --quiet: none) and the timing noise (every step's work ×
a gamma draw of mean 1; the coefficient of variation that predicts the
1-orchestrator rows best; --jitter: given), each prediction the mean of a
fixed set of seeds.

Extrapolation (default): the orchestrator's costs fitted from --results
(--method's 1-orchestrator rows), the services' forward times given as
assumptions (flags below: GPU-like, each replica on its own device, only the
orchestrators sharing the head node's --head-cores), steady state; per
number of streams and orchestrators: session-cycles/s, tokens/s, each
orchestrator's busy share of a core, the verifier's, and the bottleneck.

--transport: "batched" (one message per replica per step carries every ready
session) or "per_session" (a message per session's call, as the gRPC streams
before batched messages). Measurements made with the per-session transport
are checked with --transport per_session.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from .capacity_fit import Fitted, fit_costs, fit_slowdown, median_rate, others_cores, workload_figures
from .capacity_sim import Costs, Deployment, SimResult, StepCost, Workload, bottleneck, simulate
from .common import RESULTS

ORCHESTRATOR_RESULTS = RESULTS / "orchestrator.json"
WITH_DRAFTER = {"off": False, "ngram": False, "draft_model": True}


# Validation.


@dataclass(frozen=True)
class Prediction:
    method: str
    streams: int
    orchestrators: int
    measured: float  # session-cycles per wall second
    predicted: float
    in_sample: bool
    result: SimResult
    row: dict  # the measured row

    @property
    def others_cores(self) -> float:
        """Measured: the cores the machine's other processes kept busy (the row's median)."""
        return self.row.get("others_cores", 0.0)

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


def mean_result(results: list[SimResult]) -> SimResult:
    """Several runs' results as one: the median rate (as a row's measured
    rate is its runs' median), the other figures averaged."""
    n = len(results)
    busy = {k: [sum(vs) / n for vs in zip(*(r.busy[k] for r in results))] for k in results[0].busy}
    machine_busy = sum(r.machine_busy for r in results) / n
    rate = statistics.median(r.session_cycles_per_s for r in results)
    return SimResult(
        seconds=sum(r.seconds for r in results) / n,
        session_cycles=results[0].session_cycles,
        session_cycles_per_s=rate,
        tokens_per_s=statistics.median(r.tokens_per_s for r in results),
        busy=busy,
        machine_busy=machine_busy,
        mean_batch={k: sum(r.mean_batch[k] for r in results) / n for k in results[0].mean_batch},
        bottleneck=bottleneck(busy, machine_busy),
    )


# Timing noise (Deployment.jitter) tried by the fit, and the seeds each
# prediction averages over (a fixed set: the check is reproducible).
JITTERS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5)
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Noise:
    jitter: float = 0.0  # coefficient of variation of every step's work
    seeds: tuple[int, ...] = (0,)  # without jitter one run is all there is


def predict_row(
    row: dict, fitted: Fitted, meta: dict, transport: str, background: bool = True, noise: Noise = Noise()
) -> SimResult:
    """The model of one measured row, placed as the benchmark ran it: each of
    its windows (runs) simulated, the median rate.
    background: each window's other processes' load (the cores they kept
    busy, measured) is taken from the machine's cores and slows every process
    of the stack by the fitted slowdown (benchmarks/capacity_fit.py); without
    it, a quiet machine."""
    runs = row["runs"] if background else [{}]
    return mean_result([predict_window(row, run, fitted, meta, transport, noise) for run in runs])


def predict_window(row: dict, run: dict, fitted: Fitted, meta: dict, transport: str, noise: Noise) -> SimResult:
    """One window of a row (`run`: its measured other processes' load; {}:
    none), the mean over the noise's seeds."""
    others = others_cores(run)
    cycles_per_request, tokens_per_cycle = workload_figures(row, meta.get("tokens", 64))
    n = row.get("orchestrators", 1)
    split = tuple(row.get("streams_per_orchestrator", ()))
    if sum(split) != row["streams"] or len(split) != n:
        split = ()  # not measured (or a connection not placed): as even as possible
    deployment = Deployment(
        orchestrators=n,
        verifiers=len(row["runs"][0]["cpu"]["verifier"]),
        drafters=max(1, len(row["runs"][0]["cpu"]["drafter"])),
        cores=max(0.25, meta["cpus"] - others),
        services_on_head=True,
        client_on_head=True,
        max_batch=meta.get("max_batch_sessions", 32),
        wait_fraction=meta.get("batch_wait_fraction", 0.5),
        split=split,
        transport=transport,
        jitter=noise.jitter,
    )
    workload = Workload(row["streams"], cycles_per_request, tokens_per_cycle, requests=row["runs"][0]["requests"])
    costs = fitted.costs.slowed(1 + fitted.slowdown * others)
    seeds = noise.seeds if noise.jitter > 0 else noise.seeds[:1]
    results = [simulate(costs, dataclasses.replace(deployment, seed=seed), workload) for seed in seeds]
    mean = mean_result(results)
    return dataclasses.replace(mean, session_cycles_per_s=sum(r.session_cycles_per_s for r in results) / len(results))


def base_rows(doc: dict) -> dict[str, tuple[list[dict], bool]]:
    """Per method: its 1-orchestrator rows (what the model is fitted on) and whether it has a drafter."""
    out = {}
    for method in dict.fromkeys(r["method"] for r in doc["rows"]):
        base = [r for r in doc["rows"] if r["method"] == method and r.get("orchestrators", 1) == 1]
        if base:
            out[method] = (base, WITH_DRAFTER[method])
    return out


def fit_noise(doc: dict, transport: str, background: bool = True) -> Noise:
    """The timing noise (of JITTERS) whose predictions of the 1-orchestrator
    rows (every method's; the rows the costs are fitted on, no others) are
    closest: the smallest root mean square of log(predicted / measured)."""

    def error(jitter: float) -> float:
        noise = Noise(jitter, SEEDS)
        logs = [
            math.log(p.predicted / p.measured) for p in check(doc, transport, background, noise, in_sample_only=True)
        ]
        return math.sqrt(sum(v * v for v in logs) / len(logs))

    return Noise(min(JITTERS, key=error), SEEDS)


def check(
    doc: dict, transport: str, background: bool = True, noise: Noise = Noise(), in_sample_only: bool = False
) -> list[Prediction]:
    """Per method: fit on its 1-orchestrator rows (the machine's slowdown on
    every method's), predict all its rows (in_sample_only: those rows only)."""
    out = []
    groups = base_rows(doc)
    slowdown = fit_slowdown(groups) if background else 0.0
    for method, (base, with_drafter) in groups.items():
        rows = base if in_sample_only else [r for r in doc["rows"] if r["method"] == method]
        fitted = fit_costs(base, with_drafter, slowdown=slowdown)
        for row in rows:
            res = predict_row(row, fitted, doc["meta"], transport, background, noise)
            out.append(
                Prediction(
                    method,
                    row["streams"],
                    row.get("orchestrators", 1),
                    median_rate(row),
                    res.session_cycles_per_s,
                    row in base,
                    res,
                    row,
                )
            )
    return out


def print_fits(doc: dict, background: bool = True) -> None:
    groups = base_rows(doc)
    slowdown = fit_slowdown(groups) if background else 0.0
    print(
        f"fit slowdown beside other processes' load: {slowdown:.2f} per core they kept busy "
        "(every process's work × (1 + slowdown × cores))"
    )
    for method, (base, with_drafter) in groups.items():
        for kind, fit in fit_costs(base, with_drafter, slowdown=slowdown).fits.items():
            print(
                f"fit {method:12s} {kind:12s}: {fit.cost.fixed_s * 1e3:.3f} ms per "
                f"{'message' if kind == 'orchestrator' else 'step'} + {fit.cost.per_session_s * 1e3:.3f} ms per "
                f"session-cycle ({fit.windows} windows, rms residual {fit.rms_rel:.1%})"
            )


def shares(values: list[float]) -> str:
    return " + ".join(f"{v:.0%}" for v in values)


def print_check(predictions: list[Prediction], goal: float) -> bool:
    print(
        "\n| method | streams | orchestrators | session-cycles/s measured | predicted | error | "
        "orchestrators' busy share measured | predicted | verify batch measured | predicted | "
        "predicted bottleneck | other processes' cores |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in predictions:
        mark = " (in-sample)" if p.in_sample else ""
        measured_shares = shares(p.row["core_share_by_process"]["orchestrator"])
        print(
            f"| {p.method} | {p.streams} | {p.orchestrators}{mark} | {p.measured:.0f} | {p.predicted:.0f} | "
            f"{p.error:+.1%} | {measured_shares} | {shares(p.result.busy['orchestrator'])} | "
            f"{p.row['mean_verify_batch']:.1f} | {p.result.mean_batch['verifier']:.1f} | {p.result.bottleneck} | "
            f"{p.others_cores:.2f} |"
        )
    held_out = [p for p in predictions if not p.in_sample]
    if not held_out:
        print("\nno rows with more than one orchestrator to predict")
        return False
    worst = max(abs(p.error) for p in held_out)
    met = worst <= goal
    print(
        f"\nheld-out rows: {len(held_out)}; largest |error| {worst:.1%}; goal within {goal:.0%}: "
        f"{'MET' if met else 'NOT MET'}"
    )
    return met


# Extrapolation.


@dataclass(frozen=True)
class GpuServices:
    """Assumed forward times of GPU services (docs/capacity.md says why these)."""

    verify: StepCost = StepCost(6e-3, 0.094e-3)  # 12 ms at batch 64: an 8B target's K+1 rows on an H200
    draft: StepCost = StepCost(3e-3, 0.025e-3)  # 4.6 ms at batch 64: K = 3 steps of a 1B drafter
    max_batch: int = 64
    wait_fraction: float = 0.5
    head_cores: int = 16
    verifiers: int = 0  # 0: ceil(streams / max_batch)
    drafters: int = 0


def extrapolate(
    orchestrator: StepCost,
    gpu: GpuServices,
    streams: list[int],
    orchestrators: list[int],
    tokens: int,
    tokens_per_cycle: float,
    transport: str = "batched",
) -> list[dict]:
    rows = []
    costs = Costs(orchestrator=orchestrator, verifier=gpu.verify, drafter=gpu.draft)
    for s in streams:
        replicas = math.ceil(s / gpu.max_batch)
        for n in orchestrators:
            dep = Deployment(
                orchestrators=n,
                verifiers=gpu.verifiers or replicas,
                drafters=gpu.drafters or replicas,
                cores=gpu.head_cores,
                services_on_head=False,
                client_on_head=False,
                max_batch=gpu.max_batch,
                wait_fraction=gpu.wait_fraction,
                transport=transport,
            )
            res = simulate(costs, dep, Workload(s, math.ceil(tokens / tokens_per_cycle), tokens_per_cycle))
            rows.append(
                {"streams": s, "orchestrators": n, "verifiers": dep.verifiers, "drafters": dep.drafters, "result": res}
            )
    return rows


def table(rows: list[dict], markdown: bool) -> str:
    head = [
        "streams",
        "orchestrators",
        "verifiers / drafters",
        "session-cycles/s",
        "tokens/s",
        "tokens/s per stream",
        "orchestrator busy (max, of a core)",
        "verifier busy (max)",
        "verify batch",
        "bottleneck",
    ]
    body = []
    for r in rows:
        res: SimResult = r["result"]
        body.append(
            [
                f"{r['streams']:,}",
                str(r["orchestrators"]),
                f"{r['verifiers']} / {r['drafters']}",
                f"{res.session_cycles_per_s:,.0f}",
                f"{res.tokens_per_s:,.0f}",
                f"{res.tokens_per_s / r['streams']:.1f}",
                f"{max(res.busy['orchestrator']):.0%}",
                f"{max(res.busy['verifier']):.0%}",
                f"{res.mean_batch['verifier']:.1f}",
                res.bottleneck,
            ]
        )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [head, *body])


def orchestrator_cost(path: Path, method: str, override: list[float] | None) -> StepCost:
    if override:
        return StepCost(override[0] / 1e3, override[1] / 1e3)
    doc = json.loads(path.read_text())
    groups = base_rows(doc)
    if method not in groups:
        raise SystemExit(f"{path} has no 1-orchestrator rows of method {method}")
    # A quiet head node's: the costs with the measured other processes' load taken out.
    fitted = fit_costs(groups[method][0], WITH_DRAFTER[method], orchestrator_only=True, slowdown=fit_slowdown(groups))
    return fitted.costs.orchestrator


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", metavar="JSON", help="fit on its 1-orchestrator rows, predict the rows with more")
    ap.add_argument(
        "--quiet",
        action="store_true",
        help="--check: model a quiet machine, ignoring the other processes' load each window measured",
    )
    ap.add_argument(
        "--jitter",
        type=float,
        help="--check: the timing noise (coefficient of variation of every step's work) instead of the fitted one",
    )
    ap.add_argument("--goal", type=float, default=0.15, help="largest relative error allowed by --check")
    ap.add_argument("--transport", choices=["batched", "per_session"], default="batched")
    ap.add_argument("--table", action="store_true", help="print the extrapolation as Markdown")
    ap.add_argument("--results", type=Path, default=ORCHESTRATOR_RESULTS, help="the orchestrator's measured costs")
    ap.add_argument("--method", default="draft_model", choices=list(WITH_DRAFTER))
    ap.add_argument(
        "--orchestrator-ms",
        nargs=2,
        type=float,
        metavar=("PER_MESSAGE", "PER_SESSION_CYCLE"),
        help="the orchestrator's costs instead of the fitted ones (ms)",
    )
    ap.add_argument("--streams", nargs="+", type=int, default=[250, 500, 1000, 2000])
    ap.add_argument("--orchestrators", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument(
        "--verify-ms",
        nargs=2,
        type=float,
        default=[6.0, 0.094],
        metavar=("FIXED", "PER_SESSION"),
        help="assumed verify forward: fixed + per session (ms); default 12 ms at batch 64",
    )
    ap.add_argument(
        "--draft-ms",
        nargs=2,
        type=float,
        default=[3.0, 0.025],
        metavar=("FIXED", "PER_SESSION"),
        help="assumed draft step (all K levels): fixed + per session (ms); default 4.6 ms at batch 64",
    )
    ap.add_argument("--max-batch", type=int, default=64, help="sessions per service step")
    ap.add_argument("--verifiers", type=int, default=0, help="verifier replicas (0: streams / max batch)")
    ap.add_argument("--drafters", type=int, default=0, help="drafter replicas (0: streams / max batch)")
    ap.add_argument("--head-cores", type=int, default=16, help="cores the orchestrators share")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per request")
    ap.add_argument("--tokens-per-cycle", type=float, default=3.0, help="mean tokens committed per cycle")
    return ap.parse_args(argv)


def run_check(args: argparse.Namespace) -> int:
    """--check: fit, predict, print; 0 when every held-out row is within the goal."""
    doc = json.loads(Path(args.check).read_text())
    try:
        print_fits(doc, not args.quiet)
        if args.jitter is None:
            noise = fit_noise(doc, args.transport, not args.quiet)
            how = f"fitted on the 1-orchestrator rows (of {', '.join(map(str, JITTERS))})"
        else:
            noise, how = Noise(args.jitter, SEEDS), "given"
        print(
            f"timing noise: every step's work × a gamma draw of mean 1, coefficient of variation "
            f"{noise.jitter:g} ({how}); each prediction the mean of seeds {', '.join(map(str, noise.seeds))}"
        )
        predictions = check(doc, args.transport, not args.quiet, noise)
    except ValueError as e:
        raise SystemExit(f"{args.check}: {e}") from None
    return 0 if print_check(predictions, args.goal) else 1


def run_extrapolation(args: argparse.Namespace) -> int:
    """The orchestrator's fitted costs with the assumed GPU services, per streams and orchestrators."""
    gpu = GpuServices(
        verify=StepCost(args.verify_ms[0] / 1e3, args.verify_ms[1] / 1e3),
        draft=StepCost(args.draft_ms[0] / 1e3, args.draft_ms[1] / 1e3),
        max_batch=args.max_batch,
        head_cores=args.head_cores,
        verifiers=args.verifiers,
        drafters=args.drafters,
    )
    orch = orchestrator_cost(args.results, args.method, args.orchestrator_ms)
    print(
        f"orchestrator: {orch.fixed_s * 1e3:.3f} ms per message + {orch.per_session_s * 1e3:.3f} ms per "
        f"session-cycle ({args.method}); verify {args.verify_ms[0]} + {args.verify_ms[1]} ms/session, draft "
        f"{args.draft_ms[0]} + {args.draft_ms[1]} ms/session; {args.head_cores} head cores; {args.tokens} tokens "
        f"per request at {args.tokens_per_cycle} per cycle; transport {args.transport}\n"
    )
    rows = extrapolate(orch, gpu, args.streams, args.orchestrators, args.tokens, args.tokens_per_cycle, args.transport)
    print(table(rows, args.table))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return run_check(args) if args.check else run_extrapolation(args)


if __name__ == "__main__":
    raise SystemExit(main())
