"""Wall-clock phases of a core call, as data.

Cores mark where a call's steps end (forward, accept, compact, ...); the
service edge may report them as child spans (specd_core.telemetry.tracing.add_phases). A
mark is one time.time_ns() call, so cores record them unconditionally and stay
free of any tracing API.
"""

from __future__ import annotations

import time


class Phases:
    __slots__ = ("spans", "_last")

    def __init__(self):
        self.spans: list[tuple[str, int, int]] = []  # (name, start_ns, end_ns), epoch ns
        self._last = time.time_ns()

    def mark(self, name: str) -> None:
        """The phase `name` ran from the previous mark (or creation) until now."""
        now = time.time_ns()
        self.spans.append((name, self._last, now))
        self._last = now
