"""Plain decoding's next forward, run before its call arrives.

A session decoding without a draft (K = 0) sends, after each verdict, a verify
whose forward is known in advance: its pending token, one row. Between the
verdict and that call the orchestrator streams the token, keeps its books and
sends the call back; meanwhile the verifier would sit idle, and under the
gather window a whole step waits for the slowest session's round trip. So
when a batch is answered and no call is waiting, the verifier runs that
forward for the batch's plain sessions at once and keeps each one's logits
(and features) on the session. The call that comes is then answered without
a forward when it is plain. A call with a chain draft keeps that row, the
chain's root, and its forward runs the draft's rows alone after it (an
adaptive session's occasional probe of its drafter comes this way, and the
row after a probe runs ahead too: runs_ahead); a call with a tree drops it
(rollback = set the length) and runs as before. The lossless rule, the
constraint's mask and any draw still happen when the call is answered, on
the same logits, so what a session commits is what it would have been. A
forward ahead that cannot run (its KV blocks refused, an error) leaves
nothing behind; the call then runs the forward itself."""

from __future__ import annotations

import time
from typing import Any

import torch

from specd_core.errors import CapacityExceeded
from specd_core.rules.tree import TokenTree
from verifier_svc.batch import Ahead, VerifyJob, is_chain, plan_rows

NO_DRAFT = TokenTree((), ())


def settle(live: list[VerifyJob]) -> None:
    """Under the lock, as a batch starts: each job takes its session's row
    computed ahead (a plain verify, or a chain's root) or drops it (a tree's
    root: its nodes' mask is built with the root among the forward's rows)."""
    for j in live:
        ahead, j.session.ahead = j.session.ahead, None
        if ahead is None:
            continue
        if is_chain(j.tree):
            j.ahead = ahead
        else:
            j.session.cache.rollback(j.session.cache.length - 1)


def release(jobs: list[VerifyJob]) -> None:
    """Jobs refused after settle: their sessions drop the row computed ahead,
    as if it had never run."""
    for j in jobs:
        if j.ahead is not None:
            j.session.cache.rollback(j.session.cache.length - 1)
            j.ahead = None


def runs_ahead(j: VerifyJob) -> bool:
    """Whether a session's next row is run ahead after this verify: it was
    plain, or a probe (a chain right after a plain call), after which the
    session goes on plainly. A session that drafts every cycle is not run
    ahead: its next row would be the root of a draft the verifier forwards
    anyway, and the extra forward cost 6 % of tokens/s at 32 streams of K = 4
    (demo pair, one thread per service: docs/architecture.md)."""
    return not j.tree.tokens or j.session.probed


def merge(live: list[VerifyJob], logits: list, states: list) -> tuple[list, list]:
    """Every live job's logits and states in order, root row first: the
    forward's, the rows computed ahead, or the row ahead then the forward's
    (a chain drafted after its root was computed ahead)."""
    ran = iter(zip(logits, states))
    out_logits, out_states = [], []
    for j in live:
        lg, h = j.ahead[:2] if j.ahead is not None else next(ran)
        if j.ahead is not None and j.tree.tokens:
            more, more_h = next(ran)
            lg = torch.cat((lg, more))
            h = None if h is None else torch.cat((h, more_h))
        out_logits.append(lg)
        out_states.append(h)
    return out_logits, out_states


def run_ahead(core: Any) -> int:
    """The batcher's idle work: the next forward of the last batch's plain
    sessions (core.plain_verifies) still open and without one, their logits
    and features kept on each session. The number of sessions run ahead."""
    plain, core.plain_verifies = core.plain_verifies, []
    if not plain or not core.config.decode_ahead:
        return 0
    with core.sessions.lock:
        return _forward_ahead(core, plain)


def _forward_ahead(core: Any, plain: list[VerifyJob]) -> int:
    jobs = []
    for j in core.sessions.live(plain):
        s = j.session
        if s.ahead is not None or s.cache.length != len(s.tokens) - 1:
            continue
        try:
            s.cache.reserve(s.cache.length + 1, f"session {j.session_id!r}")
        except CapacityExceeded:
            continue  # its call reserves, or is refused, itself
        jobs.append(VerifyJob(j.session_id, s, NO_DRAFT, None))
    if not jobs:
        return 0
    items, last_only = plan_rows(jobs, [])
    start = time.perf_counter()
    try:
        logits, states = core._forward(items, last_only, jobs, [])
    except Exception:  # noqa: BLE001 - _forward left nothing of it; the calls run their own forwards
        return 0
    ms, batch_id = (time.perf_counter() - start) * 1e3, next(core._batch_ids)
    for j, lg, h in zip(jobs, logits, states):
        j.session.ahead = Ahead(lg, h, ms, len(items), batch_id)
    return len(jobs)
