"""How a core runs a batch of checked calls (jobs): which still stand under
the lock, and each one's result or error in the order they came."""

from __future__ import annotations

from specd_core.errors import CapacityExceeded, InvalidRequest, UnknownSession


def still_valid(jobs: list, check, errors: tuple[type[Exception], ...] = (InvalidRequest,)) -> tuple[list, dict]:
    """Under the lock: (the jobs that pass check(job) now, {id(job): the
    error of each that does not}); `errors` are the failures that refuse
    one job alone (a bad call; a session past the KV budget), not the batch."""
    ok, refused = [], {}
    for j in jobs:
        try:
            check(j)
            ok.append(j)
        except errors as exc:
            refused[id(j)] = exc
    return ok, refused


def alone(results: list):
    """A batch of one job run directly (not through the batcher): its
    result, or the exception that stopped it, raised."""
    if isinstance(results[0], Exception):
        raise results[0]
    return results[0]


def in_order(jobs: list, done: dict, call: str) -> list:
    """Each job's result (done: id(job) -> result), or UnknownSession for a job
    whose session was closed during its call."""
    return [
        done[id(j)] if id(j) in done else UnknownSession(f"session {j.session_id!r} was closed during its {call} call")
        for j in jobs
    ]


def halves(jobs: list) -> list[list]:
    """A batch split in two, to run again apart after its forward ran the
    device out of memory (the smaller batches' activations may fit)."""
    return [jobs[: len(jobs) // 2], jobs[len(jobs) // 2 :]]


def oom_reason(exc: BaseException) -> str:
    """The first line of an out-of-memory error: all a refusal keeps of it
    (its traceback's frames hold the activations that filled the device)."""
    return (str(exc).splitlines() or ["out of memory"])[0]


def device_oom(session_id: str, what: str, smaller: str, reason: str, after: str = "") -> CapacityExceeded:
    """The refusal of a job whose forward alone runs the device out of memory:
    `what` it asked, the `smaller` request that may fit; `after`: what became
    of its session, when it is not left as it was."""
    return CapacityExceeded(
        f"session {session_id!r}: the device ran out of memory for {what} ({reason}); "
        f"retry with {smaller} or later{after}"
    )
