"""Warm-up: before a replica serves, run the forwards its batcher will run (a
prefill, verify or draft calls of a few depths, a batch of two sessions),
through the same calls clients make. The first forward of each shape pays
one-off costs (lazy initialisation, allocations, kernel selection) that would
otherwise land on the first request - and in the orchestrator's adaptive cost
model, which would learn from them that drafting is dear
(orchestrator/cycle/adaptive.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# A prompt this long (at most), drafts this deep (within the replica's limit),
# and as many sessions as one batched forward of the warm-up takes. Small: on
# a CPU with a tiny model it is well under a second; on a GPU it is the
# first-call cost (allocator, kernel choice) paid once before serving instead
# of by the first request.
WARMUP_PROMPT_TOKENS = 16
WARMUP_DEPTHS = (1, 2, 4, 8)
WARMUP_SESSIONS = 2

# The role's calls: (session ids, prompt, depths, timings) -> None, each call
# timed into timings with `timed`.
WarmUpCalls = Callable[[list[str], list[int], list[int], dict[str, float]], None]


def warm_up(core, calls: WarmUpCalls) -> dict[str, float]:
    """Run `calls` on `core` (a ModelCore) with warm-up sessions, close them;
    the ms each step took (logged). A failure is logged, not raised: warm-up
    only saves time, and the replica still serves."""
    n = max(2, min(WARMUP_PROMPT_TOKENS, core.context_length // 4))
    prompt = [(7 * i + 3) % core.vocab_size for i in range(n)]
    depths = [k for k in WARMUP_DEPTHS if k <= min(core.config.max_draft_tokens, core.context_length // 8)]
    ids = [f"specd-warmup-{i}" for i in range(WARMUP_SESSIONS)]
    timings: dict[str, float] = {}
    start = time.perf_counter()
    try:
        calls(ids, prompt, depths or [1], timings)
    except Exception:  # noqa: BLE001 - see the docstring
        log.warning("%s warm-up failed; serving without it", core.role, exc_info=True)
    finally:
        for sid in ids:
            if sid in core.sessions:
                core.close_session(sid)
        # The warm-up's calls came back to back: their interval would make
        # real sessions look idle to the batcher's gather window for a while.
        core.sessions.call_interval_s = 0.0
    log.info(
        "%s warmed up in %.0f ms: %s",
        core.role,
        (time.perf_counter() - start) * 1e3,
        ", ".join(f"{k} {v:.1f} ms" for k, v in timings.items()),
    )
    return timings


def timed(timings: dict[str, float], name: str, call, *args) -> None:
    """Run call(*args); a batch's results may hold its exceptions: raise those."""
    start = time.perf_counter()
    out = call(*args)
    timings[name] = (time.perf_counter() - start) * 1e3
    for r in out if isinstance(out, list) else ():
        if isinstance(r, Exception):
            raise r
