"""Stats -> GenerationStats (orchestrator/edge/servicer.py: stats_to_proto): the
conversion goes by field name, so the dataclass and the proto must list the
same names; adding a stat to one without the other fails here."""
import dataclasses

import pytest

from orchestrator.cycle.records import Draft, Stats, Verdict
from orchestrator.edge.servicer import DERIVED_STATS, INTERNAL_STATS, stats_to_proto
from specd_core.api.v1 import specdec_pb2 as pb

pytestmark = pytest.mark.unit


def test_stats_and_proto_have_the_same_fields():
    fields = {f.name for f in dataclasses.fields(Stats)}
    proto = {f.name for f in pb.GenerationStats.DESCRIPTOR.fields}
    assert set(INTERNAL_STATS) <= fields and not set(DERIVED_STATS) & fields
    assert all(isinstance(getattr(Stats, name, None), property) for name in DERIVED_STATS)
    assert sorted(fields - set(INTERNAL_STATS) | set(DERIVED_STATS)) == sorted(proto)


def test_every_stat_reaches_the_proto():
    stats = Stats(num_speculative_tokens=3, prompt_tokens=7, completion_tokens=9, method="draft_model", adaptive=True,
                  resumed_tokens=4, cached_prompt_tokens=64)
    chain = Draft([4, 5, 6], [-1, 0, 1], compute_ms=1.5, call_ms=2.5, wait_ms=0.5, ahead=True, branch=1, pruned=1,
                  forced_nodes=[1, 2], tail=2)  # the last two nodes forced: one of them kept
    stats.observe_cycle(chain, Verdict([0, 1], [4, 5, 8], 2.0), wall_ms=6.0)
    stats.observe_cycle(Draft(), Verdict([], [3], 1.0), wall_ms=2.0)
    stats.feature_bytes = 1 << 40           # past int32: the proto field is int64
    msg = stats_to_proto(stats)
    for f in pb.GenerationStats.DESCRIPTOR.fields:
        got, want = getattr(msg, f.name), getattr(stats, f.name)
        if isinstance(want, list):
            got = list(got)
        assert got == pytest.approx(want), f.name
        assert want, f"{f.name}: give it a non-default value, or this proves nothing"
    assert msg.mean_accepted_length == 2.0 and msg.accepted_per_position == [1, 1, 0]
