"""Prometheus file-based service discovery (`file_sd_configs`): the list of
/metrics endpoints of a deployment as the JSON file Prometheus watches.

One pure function builds the target groups from what the orchestrator knows of
its replicas: the orchestrator itself writes them to a file on every pool change
(orchestrator/report/metrics.py: TargetsFile), and `specd metrics-targets`
prints the same from a Status reply, so the two never disagree on the format.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

JOB = "specd"
# The (first) orchestrator's `specd_replica` label: its Ray actor's name under
# `specd up`; others are named specd-orchestrator-1, -2, ...
ORCHESTRATOR_REPLICA = "specd-orchestrator"
KIND_ORDER = ("orchestrator", "verifier", "drafter")


class HasMetrics(Protocol):
    """A replica as the orchestrator knows it (orchestrator/config.py: ReplicaSpec) or reports it
    (the ReplicaStatus message): both have these fields."""

    kind: str
    name: str
    metrics_address: str


def file_sd_targets(
    replicas: Iterable[HasMetrics],
    orchestrator_metrics: str = "",
    orchestrators: Iterable[tuple[str, str]] = (),
) -> list[dict]:
    """One target group per endpoint, orchestrators first, then verifiers and
    drafters by name; labels `job`, `specd_kind`, `specd_replica`. A replica
    with no metrics address (a stack started by hand) is left out.
    orchestrators: (name, metrics address) of each of several; else the one
    orchestrator's `orchestrator_metrics`."""
    found = [("orchestrator", name, address) for name, address in orchestrators] or [
        ("orchestrator", ORCHESTRATOR_REPLICA, orchestrator_metrics)
    ]
    found += [(r.kind, r.name, r.metrics_address) for r in replicas]
    ordered = sorted(
        (f for f in found if f[2]),
        key=lambda f: (KIND_ORDER.index(f[0]) if f[0] in KIND_ORDER else len(KIND_ORDER), f[1]),
    )
    return [
        {"targets": [address], "labels": {"job": JOB, "specd_kind": kind, "specd_replica": name}}
        for kind, name, address in ordered
    ]


def dumps(groups: list[dict]) -> str:
    """The file's text (also what `specd metrics-targets` prints)."""
    return json.dumps(groups, indent=2) + "\n"


def write_atomic(path: str | Path, text: str) -> None:
    """Replace `path` with `text` in one step: written to a temporary file in the
    same directory, flushed to disk, then renamed over the old one. Prometheus
    re-reads the file when it changes; a reader never sees it half written
    (it would drop every target until the next change)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600: Prometheus may run as another user
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
