"""Gathering concurrent sessions' verify calls into one forward.

A worker thread takes every call queued when it is free (up to
max_batch_sessions, never two calls of one session) and verifies them in ONE
forward (Verifier.verify_batch). There is no waiting window: a lone session pays
nothing, and calls that arrive while a forward runs share the next one - so the
batch grows with load by itself (continuous batching).
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import Future
from typing import Callable

from .core import Verifier, VerifyJob


class VerifyBatcher:
    def __init__(self, core: Verifier, max_sessions: int, on_batch: Callable[[list], None] | None = None):
        self.core, self.max_sessions, self.on_batch = core, max_sessions, on_batch
        self._queue: collections.deque[tuple[VerifyJob, Future]] = collections.deque()
        self._ready = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="verify-batcher")
        self._thread.start()

    def submit(self, job: VerifyJob) -> Future:
        future: Future = Future()
        with self._ready:
            if self._stopped:
                raise RuntimeError("the verifier is shutting down")
            self._queue.append((job, future))
            self._ready.notify()
        return future

    def _take(self) -> list[tuple[VerifyJob, Future]]:
        with self._ready:
            while not self._queue and not self._stopped:
                self._ready.wait()
            batch, later, sessions = [], [], set()
            while self._queue and len(batch) < self.max_sessions:
                item = self._queue.popleft()
                # A second call of a session waits for the next batch: its draft
                # builds on the first one's outcome.
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
                results = self.core.verify_batch([job for job, _ in batch])
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
