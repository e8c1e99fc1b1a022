"""Closing abandoned sessions (drafter and verifier): a daemon thread that calls
the core's `expire_idle` and `expire_orphans` every so often. The rules
themselves (what is idle, whose owner is gone, what is remembered) live in the
session table (specd_core/runtime/sessions.py) and are tested there."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

# The thread woke this fraction of the owner timeout late: the process itself
# was not running (SIGSTOP, a paused VM, starved), and the owners' silence is
# partly its own (SessionTable.pardon_owners).
STALL_FRACTION = 0.25


def check_interval(timeout_s: float) -> float:
    """A quarter of the timeout (a session lives at most 1.25x it), at most 30 s,
    at least 50 ms (a tiny timeout in a test must not spin the thread)."""
    return min(30.0, max(0.05, timeout_s / 4))


def start_reaper(core) -> threading.Event | None:
    """Start expiring `core`'s idle sessions and those of vanished owners; set
    the returned event to stop. None when the config turns both off
    (session_idle_timeout_s and owner_timeout_s <= 0). Each rule is checked
    at least every quarter of its own timeout (the thread wakes at the
    shorter one's pace)."""
    owner_timeout = core.config.owner_timeout_s
    timeouts = [t for t in (core.config.session_idle_timeout_s, owner_timeout) if t > 0]
    if not timeouts:
        return None
    stop = threading.Event()
    interval = check_interval(min(timeouts))

    def run():
        slept = time.monotonic()
        while not stop.wait(interval):
            late = time.monotonic() - slept - interval
            if owner_timeout > 0 and late > STALL_FRACTION * owner_timeout:
                log.warning(
                    "%s was not running for %.1f s: its sessions' owners count as heard from now", core.role, late
                )
                core.sessions.pardon_owners()
            core.expire_idle()
            core.expire_orphans()
            slept = time.monotonic()

    threading.Thread(target=run, daemon=True, name=f"{core.role}-reaper").start()
    return stop
