"""What every process of a local stack spent over a window: CPU seconds (from
/proc/PID/stat) of each orchestrator, verifier and drafter and of this
process (the load generator), and the services' step counts from their
Prometheus metrics (the stack started with metrics=True).

    probe = StackProbe(stack)
    before = probe.snapshot()
    ...                       # the load
    window = probe.delta(before, probe.snapshot(end=True))
"""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

KINDS = ("orchestrator", "verifier", "drafter")
# Histograms whose _count is a step count: a verify forward, a draft batch, an
# orchestrator's cycle (summed over methods).
STEP_HISTOGRAMS = {
    "verifier": "specdec:verify_batch_size",
    "drafter": "specdec:propose_batch_size",
    "orchestrator": "specdec:cycle_latency_seconds",
}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds every core of this machine has spent busy so far, any
    process's (/proc/stat's cpu line: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def scrape(address: str) -> dict[str, float]:
    """Every sample of a /metrics page, labels summed away: {sample name: value}."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def counts(sample: dict[str, float], histogram: str) -> tuple[float, float]:
    """(_count, _sum) of a histogram in a scrape (0, 0 if absent)."""
    return sample.get(histogram + "_count", 0.0), sample.get(histogram + "_sum", 0.0)


def processes(stack) -> dict[str, list]:
    """The stack's processes by kind (ServiceProcess objects)."""
    return {
        "orchestrator": list(getattr(stack, "orchestrators", [stack.orchestrator])),
        "verifier": list(stack.verifiers),
        "drafter": list(stack.drafters),
    }


class StackProbe:
    def __init__(self, stack):
        self.procs = processes(stack)

    def snapshot(self, end: bool = False) -> dict:
        """Every process's CPU and counters. The clocks are read after the
        scrapes at a window's start and before them at its end, so that the
        scrapes' own cost stays out of the window."""
        snap: dict = {"cpu": {}, "steps": {}, "sums": {}}
        if end:
            self._clocks(snap)
        for kind, procs in self.procs.items():
            scraped = [scrape(p.metrics_address) if p.metrics_address else {} for p in procs]
            pairs = [counts(s, STEP_HISTOGRAMS[kind]) for s in scraped]
            snap["steps"][kind] = [c for c, _ in pairs]
            snap["sums"][kind] = [s for _, s in pairs]
            if kind == "orchestrator":
                snap["requests"] = [
                    sum(v for k, v in s.items() if k.startswith("specdec:request_success")) for s in scraped
                ]
        if not end:
            self._clocks(snap)
        return snap

    def _clocks(self, snap: dict) -> None:
        snap["wall"], snap["client"] = time.perf_counter(), time.process_time()
        snap["machine"] = machine_busy_seconds()
        for kind, procs in self.procs.items():
            snap["cpu"][kind] = [cpu_seconds(p.proc.pid) for p in procs]

    def requests(self) -> list[float]:
        """Requests finished so far, per orchestrator."""
        return [
            sum(v for k, v in scrape(p.metrics_address).items() if k.startswith("specdec:request_success"))
            for p in self.procs["orchestrator"]
        ]

    @staticmethod
    def delta(a: dict, b: dict) -> dict:
        """A window's figures: CPU seconds and steps per process, by kind."""

        def diff(key: str, kind: str) -> list[float]:
            return [round(y - x, 6) for x, y in zip(a[key][kind], b[key][kind])]

        cpu = {**{k: diff("cpu", k) for k in KINDS}, "client": round(b["client"] - a["client"], 6)}
        ours = sum(sum(v) if isinstance(v, list) else v for v in cpu.values())
        wall = b["wall"] - a["wall"]
        return {
            "wall_s": wall,
            "cpu": cpu,
            # Cores that other processes of the machine kept busy on average:
            # on a shared machine they took that much from the stack's.
            "others_cores": round((b["machine"] - a["machine"] - ours) / wall, 4),
            "steps": {k: diff("steps", k) for k in ("verifier", "drafter")},
            "verified_sessions": diff("sums", "verifier"),
            "orchestrator_cycles": diff("steps", "orchestrator"),
            "orchestrator_requests": [round(y - x) for x, y in zip(a["requests"], b["requests"])],
        }
