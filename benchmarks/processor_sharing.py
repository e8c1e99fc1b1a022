"""A machine's cores shared by the processes busy on it: egalitarian
processor sharing, for the capacity model (benchmarks/capacity_sim.py).

k busy processes on C cores each run at min(1, C / k) of a core: a process's
step is serial work, so it never gets more than one, and when more processes
are busy than there are cores they slow down alike (Linux's CFS shares a
core among runnable threads about so, over a scheduling period much shorter
than a step of several processes' work)."""

from __future__ import annotations

import simpy

EPS = 1e-12  # seconds of work below which a job counts as done (floating point)


class Machine:
    """`cores` shared by the busy processes on it: k busy processes each run at
    min(1, cores / k) (egalitarian processor sharing, a process on one core)."""

    def __init__(self, env: simpy.Environment, cores: float):
        self.env, self.cores = env, cores
        self._jobs: list[list] = []  # [work left, done event]
        self._last = 0.0
        self._version = 0  # a wake-up planned before the last change of jobs is stale
        self.busy_core_s = 0.0  # integral of the cores in use

    def rate(self) -> float:
        return min(1.0, self.cores / len(self._jobs)) if self._jobs else 0.0

    def run(self, work_s: float) -> simpy.Event:
        """An event that fires when `work_s` seconds of one core's work are done."""
        done = self.env.event()
        done.job = [work_s, done]  # type: ignore[attr-defined]  # its work left, read by Server.consumed
        if work_s <= EPS:
            done.job[0] = 0.0  # type: ignore[attr-defined]
            return done.succeed()
        self.advance()
        self._jobs.append(done.job)  # type: ignore[attr-defined]
        self._plan()
        return done

    def advance(self) -> None:
        """Bring the jobs' work left (and the busy integral) up to now."""
        dt = self.env.now - self._last
        if dt > 0 and self._jobs:
            rate = self.rate()
            for job in self._jobs:
                job[0] -= rate * dt
            self.busy_core_s += rate * dt * len(self._jobs)
        self._last = self.env.now

    def _plan(self) -> None:
        self._version += 1
        if self._jobs:
            version = self._version
            delay = max(0.0, min(j[0] for j in self._jobs) / self.rate())
            self.env.timeout(delay).callbacks.append(lambda _: self._wake(version))

    def _wake(self, version: int) -> None:
        if version != self._version:
            return
        self.advance()
        done = [j for j in self._jobs if j[0] <= EPS]
        self._jobs = [j for j in self._jobs if j[0] > EPS]
        for job in done:
            job[1].succeed()
        self._plan()
