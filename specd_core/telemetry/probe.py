"""Timestamped events on a cycle's path, for the overhead profile
(benchmarks/overhead.py, docs/overhead.md).

Off unless SPECD_PROBE_DIR names a directory: then every process appends
`<perf_counter seconds> <event>` lines to its own file there. perf_counter is
CLOCK_MONOTONIC on Linux, one clock for every process of a machine, so the
files of the three services merge into one timeline. When off, `mark` is one
test of a module global: nothing on the hot path.
"""

from __future__ import annotations

import os
import time

_DIR = os.environ.get("SPECD_PROBE_DIR")
_out = open(os.path.join(_DIR, f"{os.getpid()}.events"), "a", buffering=1) if _DIR else None  # noqa: SIM115


def mark(*event: str) -> None:
    """event: its words, joined only when probing (no string built otherwise)."""
    if _out is not None:
        _out.write(f"{time.perf_counter():.7f} {' '.join(event)}\n")


def probed(run_batch, name: str):
    """run_batch marked at its start and end when probing (itself otherwise)."""
    if _out is None:
        return run_batch

    def run(jobs):
        mark(f"{name} forward")
        try:
            return run_batch(jobs)
        finally:
            mark(f"{name} forwarded")

    return run
