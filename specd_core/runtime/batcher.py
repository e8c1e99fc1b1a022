"""Gathering concurrent sessions' calls into one forward (verifier and drafter).

A worker thread takes every call queued when it is free (up to max_sessions,
never two calls of one session) and runs them as ONE batch (the core's
`*_batch` method). Calls that arrive while a forward runs share the next one,
so the batch grows with load by itself (continuous batching).

The gather window: with drafter and verifier as separate services, a session
alternates between them, and continuous batching alone lets the sessions split
into groups that take turns, each forward carrying a fraction of the sessions
(docs/architecture.md, "The gather window", has the measured batch sizes). So before a batch runs, when fewer
sessions have a call queued than are expected, the worker waits for the rest -
at most `wait_fraction` of the last batch's run time, since a latecomer that
misses the batch costs a whole forward of its own later. Expected are the open
sessions that called lately (`active_sessions()`, see SessionTable.active in sessions.py): a session
stalled by a slow client must not make every batch wait. A lone session, or a
full batch, never waits.

Split batches (the verifier's `Split`): the sessions that alternate
between the two services fall into groups by themselves, but of any sizes -
a lone session beside seven others, whose forwards then carry it alone on
both services. So a batch takes at most `share()` of the calls it `limits`
(the verifier: every session that comes straight back and half of the
drafting ones, SessionTable.batch_share); the others wait for the next batch,
and the drafting sessions settle into two halves that take turns, one half
drafted while the other is verified. Other calls (a new session's prefill)
are not limited.

After a batch, when no call is queued, the worker runs `idle` (the verifier:
plain sessions' next forward, before their calls arrive; verifier_svc/ahead.py).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple, Protocol

from specd_core.errors import CapacityExceeded

log = logging.getLogger(__name__)


class Job(Protocol):
    """A checked call waiting for its batch (ProposeJob, VerifyJob, OpenJob)."""

    @property
    def session_id(self) -> str: ...


class Split(NamedTuple):
    """A split batch (module docstring): at most share() of the calls that `limits`."""

    limits: Callable[[Job], bool]
    share: Callable[[], int]


class Batcher:
    """run_batch(jobs) -> one result or Exception per job; jobs have .session_id."""

    def __init__(
        self,
        run_batch: Callable[[list], list],
        max_sessions: int,
        name: str,
        on_batch: Callable[[list], None] | None = None,
        max_queued: int = 1024,
        active_sessions: Callable[[], int] | None = None,
        wait_fraction: float = 0.0,
        idle: Callable[[], object] | None = None,
    ):
        self.run_batch, self.max_sessions, self.on_batch = run_batch, max_sessions, on_batch
        self.name, self.max_queued = name, max_queued
        self.active_sessions, self.wait_fraction = active_sessions, wait_fraction
        self.idle = idle  # run after a batch when no call waits (the verifier's forward ahead)
        # A batch takes at most split.share() of the calls split.limits (set
        # by its owner before the first call; None: batches are not split).
        self.split: Split | None = None
        self._last_run_s = 0.0  # the last batch's run time: what the window is a fraction of
        self._queue: collections.deque[tuple[Job, Future]] = collections.deque()
        self._ready = threading.Condition()
        self._stopped = False
        self._deferred: list[Callable[[], None]] = []  # see later()
        self._answering = False  # the worker is setting a batch's results (later() defers)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"{name}-batcher")
        self._thread.start()

    def submit(self, job: Job) -> Future:
        future: Future = Future()
        with self._ready:
            if self._stopped:
                raise RuntimeError("the service is shutting down")
            # Bounded: past it a caller is refused at once instead of waiting
            # behind a queue that only grows (and holding a thread meanwhile).
            if len(self._queue) >= self.max_queued:
                raise CapacityExceeded(
                    f"{self.name} queue full: {len(self._queue)} calls are waiting "
                    f"(max_queued_calls {self.max_queued}); retry later"
                )
            self._queue.append((job, future))
            self._ready.notify()
        return future

    def _take(self) -> list[tuple[Job, Future]]:
        with self._ready:
            while not self._queue and not self._stopped:
                self._ready.wait()
            self._gather()
            batch: list[tuple[Job, Future]] = []
            later: list[tuple[Job, Future]] = []
            sessions: set[str] = set()
            share = max(1, self.split.share()) if self.split is not None else self.max_sessions
            while self._queue and len(batch) < self.max_sessions:
                item = self._queue.popleft()
                # A second call of a session waits for the next batch: it builds
                # on the first one's outcome; so does a split call past the share.
                split = self.split is not None and self.split.limits(item[0])
                if item[0].session_id in sessions or (split and share <= 0):
                    later.append(item)
                else:
                    batch.append(item)
                    share -= split
                sessions.add(item[0].session_id)
            self._queue.extendleft(reversed(later))
            return batch

    def _gather(self) -> None:
        """Under the lock, a call queued: wait (bounded) for the calls of the
        other open sessions, so that they join this batch."""
        if self.wait_fraction <= 0 or self.active_sessions is None or self.max_sessions <= 1:
            return
        deadline = time.monotonic() + self.wait_fraction * self._last_run_s
        while not self._stopped:
            want = min(self.max_sessions, self.active_sessions())
            if len({job.session_id for job, _ in self._queue}) >= want:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._ready.wait(left)

    def _run(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                return  # stopped and drained
            self._run_one(batch)
            # Not held while the next _take waits: a closed session's jobs
            # (its matcher, its results) must go with it, not with the next batch.
            del batch
            if self.idle is not None and not self._queue and not self._stopped:
                try:
                    self.idle()
                except Exception:  # noqa: BLE001 - work ahead is optional; the calls do their own
                    log.exception("%s: work ahead failed", self.name)

    def _run_one(self, batch: list[tuple[Job, Future]]) -> None:
        started = time.monotonic()
        try:
            results = self.run_batch([job for job, _ in batch])
            self._last_run_s = time.monotonic() - started
        except Exception as exc:  # noqa: BLE001 - every caller of the batch gets the error
            self._answering = True
            for _, future in batch:
                future.set_exception(exc)
            self._run_deferred()
            return
        self._answering = True
        for (_, future), result in zip(batch, results):
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
        # Only then what no caller waits for: every answer of the batch is
        # on its way before any span or metric of it is recorded.
        self._run_deferred()
        if self.on_batch:
            self.on_batch([job for job, _ in batch])

    def later(self, fn: Callable[[], None]) -> None:
        """Run fn once the current batch's results are all set (from a result's
        callback, which runs on this batcher's thread); at once elsewhere, or
        when no batch is being answered."""
        if self._answering and threading.current_thread() is self._thread:
            self._deferred.append(fn)
        else:
            fn()

    def _run_deferred(self) -> None:
        self._answering = False
        deferred, self._deferred = self._deferred, []
        for fn in deferred:
            try:
                fn()
            except Exception:  # noqa: BLE001 - bookkeeping must not stop the batcher
                log.exception("%s: deferred bookkeeping failed", self.name)

    def stop(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify_all()
        self._thread.join(5)
