"""A Propose batch whose forwards run the device out of memory
(torch.OutOfMemoryError, what a CUDA OOM raises): the sessions that cause it
are refused (CapacityExceeded, naming the session and its draft), the others
get exactly the drafts they get without the failure, and the refused
session is as before its call: it drafts again what a clean drafter drafts.

The error is injected around the runner's forward, after it ran (the
sessions' caches hold the new rows, sampled sessions have drawn), when the
forward holds a chosen session: at its root ("root": the committed tokens'
forward) or at a tree level ("tree", lean engine: the other sessions have
grown levels by then)."""

import pytest
import torch

from drafter_svc.config import DrafterConfig
from drafter_svc.core import Drafter
from specd_core.errors import CapacityExceeded, SessionExpired
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams
from specd_core.runtime.propose_call import ProposeCall

pytestmark = pytest.mark.unit

PARAMS = SamplingParams(temperature=0.9, seed=5)  # sampled: the retries must repeat the draws
PROMPTS = {"a": [40, 41, 42], "b": [50, 51, 52, 53, 54, 55], "c": [60, 61, 62, 63]}
SHAPES = {"a": DraftShape.chain(3), "b": DraftShape(branching=(2, 2, 1)), "c": DraftShape(branching=(2, 1))}


def drafter(pairs, engine: str) -> Drafter:
    d = Drafter(DrafterConfig(pairs["llama"][1], device="cpu", engine=engine))
    for sid, prompt in PROMPTS.items():
        d.open_session(sid, prompt, PARAMS)
    return d


def inject_oom(monkeypatch, d: Drafter, sid: str, where: str) -> dict:
    """Make d's forwards that hold session sid's cache fail with the device's
    out-of-memory error (once switch["on"]); the forwards' sessions, recorded."""
    switch: dict = {"on": False, "forwards": []}
    real = d.runner.forward_batch

    def forward_batch(items, last_only=False):
        out = real(items, last_only)
        held = {id(item[0]) for item in items}
        switch["forwards"].append(held)
        ours = sid in d.sessions and id(d.sessions[sid].cache) in held
        if switch["on"] and ours and last_only == (where == "root"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return out

    monkeypatch.setattr(d.runner, "forward_batch", forward_batch)
    return switch


def call(sid: str, tree, path: list[int]) -> ProposeCall:
    """The next call after a draft: path kept, then a token of its own."""
    kept = [tree.tokens[n] for n in path] if tree is not None else []
    return ProposeCall(sid, path, kept + [7 + len(kept)], SHAPES[sid])


def first(tree) -> list[int]:
    """The root-down path of each node's first child."""
    path, node = [], -1
    while node + 1 < len(tree.parents) and node in tree.parents:
        node = tree.parents.index(node)
        path.append(node)
    return path[:2]


def draft(p) -> tuple:
    """A proposal as compared: its tree exactly, its laws to float rounding (a
    batch of other sessions sums in another order)."""
    if isinstance(p, Exception):
        return type(p).__name__, str(p)
    t = p.tree
    laws = [(ids, [round(q, 4) for q in qs]) for ids, qs in t.row_dists]
    return t.tokens, t.parents, t.forwarded, t.pruned, [round(c, 4) for c in t.confidences], laws


def state(d: Drafter, sid: str) -> tuple:
    s = d.sessions[sid]
    last = (s.last.tokens, s.last.parents, s.last.forwarded)
    return list(s.tokens), s.cache.length, s.base, last, s.checkpoint, s.branches, s.generator.get_state().tolist()


def seen(d: Drafter, sid: str) -> tuple:
    """A session as its client sees it: its tokens, last draft and random
    stream. (A refused session's cache may hold fewer of the last draft's
    rows: those its catch-up dropped, which it forwards again if needed.)"""
    s = d.sessions[sid]
    return list(s.tokens), s.base, s.last.tokens, s.last.parents, s.checkpoint, s.generator.get_state().tolist()


def batch(d: Drafter, calls: dict) -> list:
    return d.propose_batch([d.prepare(c) for c in calls.values()])


@pytest.mark.parametrize(("engine", "where"), [("lean", "root"), ("lean", "tree"), ("hf", "root")])
def test_a_draft_that_runs_out_of_memory_is_refused_alone(pairs, monkeypatch, engine, where):
    ref, d = drafter(pairs, engine), drafter(pairs, engine)
    switch = inject_oom(monkeypatch, d, "b", where)
    calls = {sid: call(sid, None, []) for sid in PROMPTS}
    clean = batch(ref, calls)
    assert [draft(p) for p in batch(d, calls)] == [draft(p) for p in clean]
    trees = {sid: p.tree for sid, p in zip(PROMPTS, clean)}
    # A second cycle keeps part of each tree: the catch-up compacts the caches.
    calls = {sid: call(sid, trees[sid], first(trees[sid])) for sid in PROMPTS}
    want = batch(ref, calls)
    before = seen(d, "b")
    switch["on"] = True
    got = batch(d, calls)
    assert isinstance(got[1], CapacityExceeded) and not isinstance(want[1], Exception)
    assert "session 'b'" in str(got[1]) and "ran out of memory for a draft tree of depth 3" in str(got[1])
    assert "CUDA out of memory" in str(got[1]) and "retry with a smaller draft" in str(got[1])
    # The others, retried apart from b, draft exactly what the clean drafter drafts.
    assert [draft(p) for p in (got[0], got[2])] == [draft(p) for p in (want[0], want[2])]
    for sid in "ac":
        assert state(d, sid) == state(ref, sid)
    # b is as before its call, and its call drafts again what the clean drafter's did.
    assert seen(d, "b") == before
    assert d.kv_pool.used_blocks == sum(s.cache.blocks for s in d.sessions.values())
    switch["on"] = False
    assert draft(d.propose(calls["b"])) == draft(want[1])
    assert state(d, "b") == state(ref, "b")
    # The three go on as they would have.
    trees = {sid: p.tree for sid, p in zip(PROMPTS, want)}
    calls = {sid: call(sid, trees[sid], first(trees[sid])) for sid in PROMPTS}
    assert [draft(p) for p in batch(d, calls)] == [draft(p) for p in batch(ref, calls)]
    for sid in PROMPTS:
        d.close_session(sid)
    assert d.kv_pool.used_blocks == 0


def test_a_draft_alone_that_runs_out_of_memory_leaves_its_session_as_it_was(pairs, monkeypatch):
    ref, d = drafter(pairs, "lean"), drafter(pairs, "lean")
    switch = inject_oom(monkeypatch, d, "b", "tree")
    tree = ref.propose(call("b", None, [])).tree
    assert d.propose(call("b", None, [])).tree == tree
    before = seen(d, "b")
    switch["on"] = True
    with pytest.raises(CapacityExceeded, match=r"session 'b': the device ran out of memory for a draft tree"):
        d.propose(call("b", tree, first(tree)))
    assert seen(d, "b") == before
    switch["on"] = False
    assert draft(d.propose(call("b", tree, first(tree)))) == draft(ref.propose(call("b", tree, first(tree))))
    assert state(d, "b") == state(ref, "b")


def test_a_rewind_that_runs_out_of_memory_closes_its_session(pairs, monkeypatch):
    """A rewind drops the ahead call's rows before the forwards: they cannot be
    put back by truncation, so the refused session is closed and says so; the
    session drafted beside it gets its draft."""
    ref, d = drafter(pairs, "lean"), drafter(pairs, "lean")
    switch = inject_oom(monkeypatch, d, "a", "root")
    chain = d.propose(call("a", None, [])).tree
    d.propose(ProposeCall("a", [0, 1, 2], list(chain.tokens), SHAPES["a"], ahead=True))
    switch["on"] = True
    rewind = ProposeCall("a", [0], [chain.tokens[0], 9], SHAPES["a"], rewind=True)
    got = batch(d, {"a": rewind, "c": call("c", None, [])})
    assert isinstance(got[0], CapacityExceeded) and "session 'a'" in str(got[0])
    assert "its session is closed" in str(got[0])
    assert draft(got[1]) == draft(ref.propose(call("c", None, [])))
    assert state(d, "c") == state(ref, "c")
    assert "a" not in d.sessions
    with pytest.raises(SessionExpired, match="ran out of memory"):
        d.propose(call("a", None, []))
    assert d.kv_pool.used_blocks == sum(s.cache.blocks for s in d.sessions.values())
