"""How a core runs a batch of checked calls (jobs): which still stand under
the lock, and each one's result or error in the order they came."""

from __future__ import annotations

from specd_core.errors import InvalidRequest, UnknownSession


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
