"""Gathering concurrent sessions' calls into one forward (verifier and drafter).

A worker thread takes every call queued when it is free (up to max_sessions,
never two calls of one session) and runs them as ONE batch (the core's
`*_batch` method). There is no waiting window: a lone session pays nothing,
and calls that arrive while a forward runs share the next one - so the batch
grows with load by itself (continuous batching).
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import Future
from typing import Callable

from .errors import CapacityExceeded

class Batcher:
    """run_batch(jobs) -> one result or Exception per job; jobs have .session_id."""

    def __init__(self, run_batch: Callable[[list], list], max_sessions: int, name: str,
                 on_batch: Callable[[list], None] | None = None, max_queued: int = 1024):
        self.run_batch, self.max_sessions, self.on_batch = run_batch, max_sessions, on_batch
        self.name, self.max_queued = name, max_queued
        self._queue: collections.deque[tuple[object, Future]] = collections.deque()
        self._ready = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"{name}-batcher")
        self._thread.start()

    def submit(self, job) -> Future:
        future: Future = Future()
        with self._ready:
            if self._stopped:
                raise RuntimeError("the service is shutting down")
            # Bounded: past it a caller is refused at once instead of waiting
            # behind a queue that only grows (and holding a thread meanwhile).
            if len(self._queue) >= self.max_queued:
                raise CapacityExceeded(f"{self.name} queue full: {len(self._queue)} calls are waiting "
                                       f"(max_queued_calls {self.max_queued}); retry later")
            self._queue.append((job, future))
            self._ready.notify()
        return future

    def _take(self) -> list[tuple[object, Future]]:
        with self._ready:
            while not self._queue and not self._stopped:
                self._ready.wait()
            batch, later, sessions = [], [], set()
            while self._queue and len(batch) < self.max_sessions:
                item = self._queue.popleft()
                # A second call of a session waits for the next batch: it builds
                # on the first one's outcome.
                (later if item[0].session_id in sessions else batch).append(item)
                sessions.add(item[0].session_id)
            self._queue.extendleft(reversed(later))
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                return                                     # stopped and drained
            try:
                results = self.run_batch([job for job, _ in batch])
            except Exception as exc:  # noqa: BLE001 - every caller of the batch gets the error
                for _, future in batch:
                    future.set_exception(exc)
                continue
            if self.on_batch:
                self.on_batch([job for job, _ in batch])
            for (_, future), result in zip(batch, results):
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    def stop(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify_all()
        self._thread.join(5)
