"""The batcher's gather window (specd_core/runtime/batcher.py), as a unit: jobs are plain
objects and run_batch records the batches it got."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from specd_core.runtime.batcher import Batcher, Split

pytestmark = pytest.mark.unit


@dataclass
class Job:
    session_id: str
    sleep_s: float = 0.0


class Recorder:
    def __init__(self):
        self.batches: list[list[str]] = []

    def __call__(self, jobs):
        time.sleep(max(j.sleep_s for j in jobs))
        self.batches.append([j.session_id for j in jobs])
        return [j.session_id for j in jobs]


def _warm(batcher: Batcher, seconds: float) -> None:
    """One batch that runs `seconds`: the window is a fraction of it."""
    batcher.submit(Job("warm", seconds)).result(10)


def test_window_gathers_the_calls_of_open_sessions():
    rec = Recorder()
    # Window: 10 x the last run (0.3 s) = 3 s; the calls come 0.2 s apart.
    b = Batcher(rec, 8, "t", active_sessions=lambda: 3, wait_fraction=10.0)
    try:
        _warm(b, 0.3)
        futures = []
        for sid in "abc":
            futures.append(b.submit(Job(sid)))
            time.sleep(0.2)
        assert [f.result(10) for f in futures] == ["a", "b", "c"]
        assert rec.batches[-1] == ["a", "b", "c"]
    finally:
        b.stop()


def test_without_window_the_first_call_runs_alone():
    rec = Recorder()
    b = Batcher(rec, 8, "t", active_sessions=lambda: 3, wait_fraction=0.0)
    try:
        _warm(b, 0.3)
        first = b.submit(Job("a"))
        assert first.result(10) == "a"          # did not wait for b and c
        assert rec.batches[-1] == ["a"]
    finally:
        b.stop()


def test_window_is_bounded_and_skipped_when_nothing_more_can_join():
    rec = Recorder()
    open_now = [5]
    b = Batcher(rec, 2, "t", active_sessions=lambda: open_now[0], wait_fraction=2.0)
    try:
        _warm(b, 0.5)                               # window: 1 s
        start = time.monotonic()
        assert b.submit(Job("a")).result(10) == "a"      # 4 open sessions never call: waits out the window
        waited = time.monotonic() - start
        assert 0.9 <= waited < 5, waited
        assert rec.batches[-1] == ["a"]

        _warm(b, 2.0)                               # window: 4 s
        # A full batch (max_sessions 2) runs without waiting.
        start = time.monotonic()
        both = [b.submit(Job("a")), b.submit(Job("b"))]
        assert [f.result(10) for f in both] == ["a", "b"]
        assert time.monotonic() - start < 3.0

        # A lone open session never waits.
        open_now[0] = 1
        start = time.monotonic()
        assert b.submit(Job("a")).result(10) == "a"
        assert time.monotonic() - start < 3.0
    finally:
        b.stop()


def test_stop_ends_a_wait():
    b = Batcher(Recorder(), 8, "t", active_sessions=lambda: 4, wait_fraction=100.0)
    _warm(b, 0.2)                                   # window: 20 s
    future = b.submit(Job("a"))
    time.sleep(0.1)
    t = threading.Thread(target=b.stop)
    start = time.monotonic()
    t.start()
    assert future.result(10) == "a"                 # drained, not dropped
    t.join(10)
    assert time.monotonic() - start < 8.0


def test_deferred_bookkeeping_runs_after_every_answer_of_the_batch():
    """later() from a result's callback waits until the whole batch is
    answered; from another thread it runs at once; a failing one is logged
    and the batcher keeps serving."""
    events: list[str] = []
    gate = threading.Event()

    def run(jobs):
        gate.wait(5)
        return [j.session_id for j in jobs]

    b = Batcher(run, max_sessions=4, name="t")
    try:
        futures = [b.submit(Job(s)) for s in ("a", "b", "c")]
        for f in futures:
            f.add_done_callback(lambda f: events.append(f"answer {f.result()}"))
            f.add_done_callback(lambda f: b.later(lambda r=f.result(): events.append(f"book {r}")))
        futures[1].add_done_callback(lambda f: b.later(lambda: 1 / 0))
        gate.set()
        for f in futures:
            f.result(5)
        assert b.submit(Job("d")).result(5) == "d"  # still serving after the failed one
        assert events[:3] == ["answer a", "answer b", "answer c"]
        assert sorted(events[3:6]) == ["book a", "book b", "book c"]
        b.later(lambda: events.append("now"))
        assert events[-1] == "now"
    finally:
        b.stop()


@dataclass
class Verify:
    """A call a split batch limits (Batcher.split), beside plain Jobs it does not."""

    session_id: str
    sleep_s: float = 0.0


def test_a_split_batch_takes_its_share_of_split_calls_and_every_other_call():
    """With 8 split calls queued and a share of 4, a batch takes 4 of them and
    every other call (a prefill), the next batch the other 4; without
    `split`, one batch takes all."""
    for split, want in ((Split(lambda job: isinstance(job, Verify), lambda: 4), [5, 4]), (None, [9])):
        rec = Recorder()
        b = Batcher(rec, 16, "t")
        b.split = split
        try:
            first = b.submit(Job("held", 1.0))  # runs a second: the calls below queue behind it
            time.sleep(0.2)
            futures = [b.submit(Verify(f"v{i}")) for i in range(8)] + [b.submit(Job("open"))]
            assert first.result(10) == "held"
            assert [f.result(10) for f in futures] == [f"v{i}" for i in range(8)] + ["open"]
            assert [len(x) for x in rec.batches[1:]] == want, rec.batches
            if split is not None:
                assert rec.batches[1] == ["v0", "v1", "v2", "v3", "open"]
        finally:
            b.stop()


def test_a_split_batch_takes_one_call_at_least():
    rec = Recorder()
    b = Batcher(rec, 8, "t")
    b.split = Split(lambda job: True, lambda: 0)
    try:
        assert b.submit(Job("a")).result(10) == "a"
        assert rec.batches == [["a"]]
    finally:
        b.stop()

