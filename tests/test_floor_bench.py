"""benchmarks/floor.py runs end to end: both floor orchestrators serve every
method over real gRPC servers, each stream's request runs its cycles, and
the stand-in services batch the sessions as specd's batcher does."""

import json

import pytest

from benchmarks import floor

pytestmark = pytest.mark.services


def test_both_floor_designs_serve_every_method_in_batched_steps(tmp_path):
    out = tmp_path / "floor.json"
    streams, tokens = 4, 8
    # A long stand-in forward (20 ms): its gather window (half of it) leaves a
    # loaded machine time to bring every open session's part into the step.
    rc = floor.main(
        [
            "--floor-only",
            "--streams",
            str(streams),
            "--requests",
            "4",
            "--tokens",
            str(tokens),
            "--rounds",
            "1",
            "--verify-ms",
            "20",
            "--draft-ms",
            "20",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["streams"]) for r in rows] == [(m, streams) for m in floor.METHODS]
    # The orchestrator's CPU is read in clock ticks (/proc/PID/stat, 10 ms):
    # one method's short run may stay within a tick and read 0, so the check
    # that CPU is measured at all is on each design's total over the methods.
    for design in floor.DESIGNS:
        assert sum(r[design]["cpu_ms_per_session_cycle"] for r in rows) > 0, design
        assert all(r[design]["cpu_ms_per_session_cycle"] >= 0 for r in rows), design
    for row in rows:
        for design in floor.DESIGNS:
            figures = row[design]
            # Steps gather sessions (one part per message would be exactly 1),
            # never more than there are streams. (With a drafter the sessions
            # split into groups taking turns at drafter and verifier, as
            # specd's do, so a step need not hold them all.)
            assert 1 < figures["mean_verify_batch"] <= streams, (row["method"], design, figures)
