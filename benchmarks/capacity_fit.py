"""The model's costs (benchmarks/capacity_sim.py) fitted from measured
windows (benchmarks/orchestrator.py's JSON).

For one process and one measured window: CPU = fixed × steps + per_session ×
session-cycles. Divided by the session-cycles this is a line in
x = steps per session-cycle (1 / the mean batch), y = CPU per session-cycle:
the stream sweep moves x from 1 (one stream) to 1/32 or less, which is what
separates a step's fixed cost from a session's. Least squares over every
window (each round of each stream count), each weighted alike; a coefficient
that comes out negative is held at 0 and the other refitted (a cost is not
negative; a negative one means the noise outweighs it).

Steps per process: a verifier's and a drafter's are their forwards (the
`specdec:*_batch_size` histograms' counts); the orchestrator's are messages,
in and out: two per service step (the step's call and its answer), and four
per request per service (a unary OpenSession and CloseSession, each sent and
answered). The load
generator has no steps: its cost is per session-cycle only.

Other processes' load: each window records the cores the machine's other
processes kept busy (`others_cores`). Those cores are not the stack's, and
the stack's own work runs slower beside them (the processes share the
machine's caches and memory bandwidth, and every preemption refills them):
every process's CPU per session-cycle is larger in windows measured beside
more of that load. So CPU = (fixed × steps + per_session × session-cycles) ×
(1 + slowdown × others), one `slowdown` for the machine (every kind of
process and every method alike), fitted with the costs (`fit_slowdown`);
the costs are then those of a quiet machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .capacity_sim import Costs, StepCost


@dataclass(frozen=True)
class Fit:
    cost: StepCost
    windows: int
    rms_rel: float  # root mean square of the residuals / the mean CPU per session-cycle


@dataclass(frozen=True)
class Window:
    """One measured window of one process."""

    session_cycles: float
    steps: float
    cpu_s: float
    others: float = 0.0  # the cores the machine's other processes kept busy (never below 0)


def others_cores(run_or_row: dict) -> float:
    """The cores other processes kept busy in a window (or a row's median);
    a negative figure is the CPU accounting's rounding, taken as none."""
    return max(0.0, run_or_row.get("others_cores", 0.0))


def fit_step_cost(windows: Sequence[Window], slowdown: float = 0.0) -> Fit:
    """fixed and per-session cost by least squares on CPU per session-cycle
    against steps per session-cycle, each window's CPU divided by the
    slowdown its other processes' load caused (1 + slowdown × others). With
    fewer than two distinct x values the two cannot be told apart: all goes
    to the per-session cost."""
    x = np.array([w.steps / w.session_cycles for w in windows])
    y = np.array([w.cpu_s / w.session_cycles / (1 + slowdown * w.others) for w in windows])
    if len(set(np.round(x, 12))) < 2:
        fixed, per = 0.0, float(y.mean())
    else:
        (fixed, per), *_ = np.linalg.lstsq(np.column_stack([x, np.ones_like(x)]), y, rcond=None)
        if fixed < 0:
            fixed, per = 0.0, float(y.mean())
        elif per < 0:
            fixed, per = float(x @ y / (x @ x)), 0.0
    residual = y - (fixed * x + per)
    rms = float(np.sqrt(np.mean(residual**2)) / y.mean()) if y.mean() > 0 else 0.0
    return Fit(StepCost(float(fixed), float(per)), len(windows), rms)


def has_processes(run: dict) -> bool:
    """A window measured with every process's CPU and the services' steps."""
    return "cpu" in run and "steps" in run


def windows(rows: Sequence[dict], process: str) -> list[Window]:
    """Every window of `rows` for one kind of process (all its replicas summed)."""
    out = []
    for row in rows:
        for run in row["runs"]:
            cycles = run["cycles"]
            if process == "orchestrator" and not has_processes(run):
                out.append(
                    Window(cycles, 0.0, run["cpu_s"], others_cores(run))
                )  # earlier JSON: the orchestrator's CPU only
                continue
            drafter_steps = sum(run["steps"].get("drafter", []))
            # Per request: a unary OpenSession and CloseSession to each service
            # replica, each a message out and its answer in.
            unary = 4 * (1 + (drafter_steps > 0)) * run["requests"]
            steps = {
                "orchestrator": 2 * (sum(run["steps"]["verifier"]) + drafter_steps) + unary,
                "verifier": sum(run["steps"]["verifier"]),
                "drafter": sum(run["steps"].get("drafter", [])),
                "client": 0.0,
            }[process]
            cpu = run["cpu"][process]
            out.append(Window(cycles, steps, sum(cpu) if isinstance(cpu, list) else cpu, others_cores(run)))
    return out


# The slowdowns tried: per core of other processes' load, 0 to 2 (a process
# running at a third of its speed beside one busy core) in steps of 0.02.
SLOWDOWNS = np.round(np.arange(0.0, 2.0001, 0.02), 4)


def kinds_of(rows: Sequence[dict], with_drafter: bool, orchestrator_only: bool = False) -> list[str]:
    if orchestrator_only or not all(has_processes(run) for row in rows for run in row["runs"]):
        return ["orchestrator"]
    return ["orchestrator", "verifier", "client"] + (["drafter"] if with_drafter else [])


def fit_slowdown(groups: Mapping[str, tuple[Sequence[dict], bool]], orchestrator_only: bool = False) -> float:
    """The machine's slowdown per core of other processes' load: the one (of
    SLOWDOWNS) whose cost fits leave the smallest residuals, each fit's
    residuals relative to its mean CPU per session-cycle, over every kind of
    process of every group (method: its rows, whether it has a drafter).
    0 when no window was measured beside other load."""
    fits = [
        windows(rows, kind)
        for rows, with_drafter in groups.values()
        for kind in kinds_of(rows, with_drafter, orchestrator_only)
    ]
    if not any(w.others > 0 for ws in fits for w in ws):
        return 0.0

    def cost(slowdown: float) -> float:
        return sum(fit_step_cost(ws, slowdown).rms_rel ** 2 * len(ws) for ws in fits)

    return float(min(SLOWDOWNS, key=cost))


@dataclass(frozen=True)
class Fitted:
    costs: Costs  # on a quiet machine (no other processes' load)
    fits: dict[str, Fit]  # per kind of process
    slowdown: float = 0.0  # per core of other processes' load (fit_slowdown)


def fit_costs(
    rows: Sequence[dict], with_drafter: bool, orchestrator_only: bool = False, slowdown: float = 0.0
) -> Fitted:
    """Costs of every process from one method's rows (one orchestrator), on a
    quiet machine given the machine's `slowdown` (fit_slowdown).
    orchestrator_only: the services' costs are left at 0 (given apart, e.g.
    a GPU's forward times) and earlier JSON without them is accepted."""
    if not orchestrator_only and not all(has_processes(run) for row in rows for run in row["runs"]):
        raise ValueError("these rows have no per-process CPU or step counts: re-run benchmarks.orchestrator")
    kinds = kinds_of(rows, with_drafter, orchestrator_only)
    fits = {kind: fit_step_cost(windows(rows, kind), slowdown) for kind in kinds}
    zero = StepCost()
    costs = Costs(
        orchestrator=fits["orchestrator"].cost,
        verifier=fits["verifier"].cost if "verifier" in fits else zero,
        drafter=(fits["drafter"].cost if "drafter" in fits else zero) if with_drafter else None,
        client_per_cycle_s=fits["client"].cost.per_session_s if "client" in fits else 0.0,
    )
    return Fitted(costs, fits, slowdown)


def workload_figures(row: dict, default_tokens: int) -> tuple[float, float]:
    """(cycles per request, tokens per cycle) a row ran: its own workload."""
    runs = row["runs"]
    cycles = sum(r["cycles"] for r in runs)
    requests = sum(r["requests"] for r in runs)
    tokens = sum(r.get("tokens", default_tokens * r["requests"]) for r in runs)
    return cycles / requests, tokens / cycles


def median_rate(row: dict) -> float:
    """The row's session-cycles per wall second (median over its rounds)."""
    return statistics.median(r["cycles"] / r["wall_s"] for r in row["runs"])
