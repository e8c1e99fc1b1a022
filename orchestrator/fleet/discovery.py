"""Discovery of the fleet by Prometheus: the deployment's file_sd JSON
(specd_core/telemetry/discovery.py), every replica's and orchestrator's
/metrics endpoint, kept in step with the pools."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from specd_core.telemetry.discovery import dumps, file_sd_targets, write_atomic

log = logging.getLogger(__name__)


class TargetsFile:
    """The deployment's Prometheus file_sd JSON (specd_core/telemetry/discovery.py),
    kept in step with the pools and the orchestrators: rewritten (atomically)
    when a replica or an orchestrator comes, goes or moves; unchanged lists
    are not rewritten."""

    def __init__(self, path: str, pools: dict, own_address: str):
        """Writes the file now: a path that cannot be written fails the start."""
        self.path, self.pools, self.own = Path(path), pools, own_address
        # (name, metrics address) of every orchestrator when there are several
        # (set by the owner, which writes the file; None: this one alone).
        self.orchestrators: Callable[[], list[tuple[str, str]]] | None = None
        self._written = ""
        self._write(self._text())

    def _text(self) -> str:
        replicas = [r.spec for pool in self.pools.values() for r in pool.replicas.values()]
        return dumps(file_sd_targets(replicas, self.own, self.orchestrators() if self.orchestrators else ()))

    def _write(self, text: str) -> None:
        write_atomic(self.path, text)
        self._written = text

    def update(self) -> None:
        """After a pool change (the scaler's on_change)."""
        text = self._text()
        if text == self._written:
            return
        try:
            self._write(text)
        except OSError as exc:  # the service goes on; Prometheus keeps the last list
            log.warning("could not write the Prometheus targets file %s: %s", self.path, exc)
