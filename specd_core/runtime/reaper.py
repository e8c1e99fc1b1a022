"""Closing idle sessions (drafter and verifier): a daemon thread that calls the
core's `expire_idle` every so often. The rule itself (what is idle, what is
remembered) lives in the session table (specd_core/runtime/sessions.py) and is tested there."""

from __future__ import annotations

import threading


def check_interval(timeout_s: float) -> float:
    """A quarter of the timeout (a session lives at most 1.25x it), at most 30 s,
    at least 50 ms (a tiny timeout in a test must not spin the thread)."""
    return min(30.0, max(0.05, timeout_s / 4))


def start_reaper(core) -> threading.Event | None:
    """Start expiring `core`'s idle sessions; set the returned event to stop.
    None when the config turns expiry off (session_idle_timeout_s <= 0)."""
    timeout = core.config.session_idle_timeout_s
    if timeout <= 0:
        return None
    stop = threading.Event()

    def run():
        while not stop.wait(check_interval(timeout)):
            core.expire_idle()

    threading.Thread(target=run, daemon=True, name=f"{core.role}-reaper").start()
    return stop
