"""Drafting that stops where the drafter is unsure, through the real services on
the committed demo pair in fp32 (the services' default dtype): greedy output
with a confidence threshold is speculation-off output, bit for bit; a higher
threshold drafts fewer tokens per cycle, more of which are kept; a threshold
out of range is INVALID_ARGUMENT naming the field, at the orchestrator and at
the drafter. (Statistical losslessness under sampling: tests/test_confidence.py.)"""
from pathlib import Path

import grpc
import pytest

from specd.cli import DEMO_PROMPT
from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.api.v1 import specdec_pb2_grpc as pb_grpc
from specd_core.net.grpc_util import open_channel

pytestmark = pytest.mark.services

DEMO = Path(__file__).resolve().parents[1] / "models/demo"
PROMPTS = [
    DEMO_PROMPT,
    "def add(a, b):\n    ",
    "class Stack:\n    def __init__(self):\n        ",
    "import os\n\n\ndef list_files(root):\n",
]
THRESHOLDS = [0.0, 0.1, 0.3]   # the demo drafter is rarely sure: most of its confidences are under 0.3
MAX_NEW = 48


@pytest.fixture(scope="module")
def stack():
    if not (DEMO / "target/config.json").exists():
        pytest.skip("demo pair not built")
    s = Stack(str(DEMO / "target"), str(DEMO / "drafter"))
    yield s
    s.stop()


def run(stack, prompt, **fields):
    ids, last = stack.generate(prompt=prompt, max_new_tokens=MAX_NEW, temperature=0.0, **fields)
    assert last.finish_reason and last.stats.completion_tokens == len(ids)
    return ids, last.stats


def test_greedy_with_a_threshold_is_speculation_off(stack):
    stops = 0
    for prompt in PROMPTS:
        off, _ = run(stack, prompt, num_speculative_tokens=0)
        for t in THRESHOLDS[1:]:
            chain, stats = run(stack, prompt, num_speculative_tokens=6, confidence_threshold=t)
            assert chain == off, (prompt, t)
            stops += stats.confidence_stops
            tree, _ = run(stack, prompt, tree=pb.DraftShape(branching=[2, 2, 1, 1]), confidence_threshold=t)
            assert tree == off, (prompt, t, "tree")
        # The service's default: adaptive depth with the learned threshold.
        auto, stats = run(stack, prompt)
        assert auto == off and stats.adaptive, prompt
    assert stops > 0


def test_a_higher_threshold_drafts_fewer_tokens_more_of_them_kept(stack):
    drafted, accepted, cycles, stops = ([0] * len(THRESHOLDS) for _ in range(4))
    for prompt in PROMPTS:
        for i, t in enumerate(THRESHOLDS):
            _, stats = run(stack, prompt, num_speculative_tokens=6, confidence_threshold=t)
            drafted[i] += stats.drafted_tokens
            accepted[i] += stats.accepted_tokens
            cycles[i] += stats.cycles
            stops[i] += stats.confidence_stops
    per_cycle = [d / c for d, c in zip(drafted, cycles)]
    kept = [a / d for a, d in zip(accepted, drafted)]
    assert per_cycle == sorted(per_cycle, reverse=True) and per_cycle[0] > 5.0, per_cycle  # < 6 near the end
    assert per_cycle[-1] < 0.5 * per_cycle[0], per_cycle
    assert kept == sorted(kept) and kept[-1] > kept[0] + 0.1, kept
    assert stops[0] == 0 and stops[1] < stops[2], stops


@pytest.mark.parametrize("fields,needle", [
    ({"confidence_threshold": 1.0}, "confidence_threshold must be in [0, 1)"),
    ({"confidence_threshold": -0.2}, "confidence_threshold must be in [0, 1)"),
    ({"confidence_threshold": float("nan")}, "confidence_threshold must be in [0, 1)"),
    ({"confidence_threshold": 0.2, "speculative_method": "ngram"}, "confidence_threshold needs"),
    ({"tree": pb.DraftShape(branching=[2], min_confidence=0.2)}, "tree.min_confidence"),
])
def test_bad_thresholds_are_invalid_argument(stack, fields, needle):
    with pytest.raises(grpc.RpcError) as info:
        stack.generate(prompt=DEMO_PROMPT, max_new_tokens=4, **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert needle in info.value.details()


def test_drafter_refuses_a_bad_min_confidence(stack):
    channel = open_channel(stack.drafter_proc.address)
    try:
        drafter = pb_grpc.DrafterServiceStub(channel)
        drafter.OpenSession(pb.OpenDraftSessionRequest(session_id="conf", prompt_token_ids=[5, 6, 7]), timeout=30)
        def propose(min_confidence):
            shape = pb.DraftShape(branching=[1, 1, 1], min_confidence=min_confidence)
            return drafter.Propose(pb.ProposeRequest(session_id="conf", committed_token_ids=[8], shape=shape), timeout=30)

        with pytest.raises(grpc.RpcError) as info:
            propose(1.5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "min_confidence must be in [0, 1)" in info.value.details()
        ok = propose(0.5)
        assert len(ok.draft_confidences) == len(ok.draft_token_ids) >= 1
        # Every token but the last is at least as sure as the threshold; a short chain says why it stopped.
        assert all(c >= 0.5 for c in ok.draft_confidences[:-1])
        assert ok.confidence_pruned == (len(ok.draft_token_ids) < 3)
        drafter.CloseSession(pb.CloseSessionRequest(session_id="conf"), timeout=30)
    finally:
        channel.close()
