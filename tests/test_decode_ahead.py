"""Plain decoding's next forward run ahead (verifier_svc/ahead.py): a verifier
that runs it answers every call exactly as one that does not (greedy, sampled,
with features, plain calls and calls with drafts in any order), answers plain
calls without a forward of their own, and leaves no KV rows behind."""

import pytest
import torch

from specd_core.rules.sampling import SamplingParams
from verifier_svc.ahead import release, run_ahead
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier

pytestmark = pytest.mark.unit

SESSIONS = {
    "greedy": (SamplingParams(), False),
    "sampled": (SamplingParams(temperature=1.0, top_k=20, seed=11), False),
    "features": (SamplingParams(), True),
}
PROMPT = [5, 9, 13, 17, 21, 25]
# Per cycle, the draft every session sends (empty: plain decoding; a pair:
# a tree's tokens and parents): plain calls, a chain after a plain call (it
# goes on from the row run ahead, and runs the next one ahead too: a probe),
# plain again, a chain after a chain, a tree after a plain call (the row run
# ahead is dropped), a last probe, plain to end.
TREE = ([46, 47, 48], [-1, -1, 0])
DRAFTS = [[], [], [40, 41], [], [], [42], [43, 44, 45], [], [], TREE, [], [], [49], []]


class Counting:
    """The runner's forwards and their rows, counted."""

    def __init__(self, runner):
        self.runner, self.calls, self.rows = runner, 0, 0
        self._forward = runner.forward_batch
        runner.forward_batch = self

    def __call__(self, items, *args, **kwargs):
        self.calls += 1
        self.rows += sum(len(item[1]) for item in items)
        return self._forward(items, *args, **kwargs)


def prepared(v: Verifier, sid: str, draft):
    tokens, parents = draft if isinstance(draft, tuple) else (draft, None)
    return v.prepare(sid, tokens, parents)


def sessions_of(v: Verifier) -> dict:
    """The HF engine returns no features: no such session there."""
    return {k: x for k, x in SESSIONS.items() if v.runner.lean is not None or not x[1]}


def is_tree(draft) -> bool:
    return isinstance(draft, tuple)


def runs_ahead_after(i: int) -> bool:
    """Whether cycle i's sessions run their next row ahead: plain calls, and a
    chain right after a plain call (a probe: plain decoding goes on after it)."""
    draft = DRAFTS[i]
    return not draft or (not is_tree(draft) and i > 0 and not DRAFTS[i - 1])


def play(v: Verifier, ahead: bool) -> tuple[list, list[int], list[int]]:
    """Every session's results through DRAFTS (one batch per cycle, the
    batcher's idle work after it when `ahead`), and the forwards and rows
    forwarded per cycle (the batch's, not the work run ahead after it)."""
    sessions = sessions_of(v)
    for sid, (params, hidden) in sessions.items():
        v.open_session(sid, PROMPT, params, hidden=hidden)
    counter = Counting(v.runner)
    out, forwards, rows = [], [], []
    for i, draft in enumerate(DRAFTS):
        before, rows_before = counter.calls, counter.rows
        results = v.verify_batch([prepared(v, sid, draft) for sid in sessions])
        assert not any(isinstance(r, Exception) for r in results), results
        forwards.append(counter.calls - before)
        rows.append(counter.rows - rows_before)
        out.append([(r.tokens, None if r.hidden is None else r.hidden.data) for r in results])
        if ahead:
            assert run_ahead(v) == (len(sessions) if runs_ahead_after(i) else 0)
    return out, forwards, rows


@pytest.mark.parametrize("engine", ["lean", "hf"])
def test_answers_equal_a_verifier_without_it(pairs, engine):
    target, _ = pairs["llama"]
    on = Verifier(VerifierConfig(target, device="cpu", engine=engine))
    off = Verifier(VerifierConfig(target, device="cpu", engine=engine, decode_ahead=False))
    got, forwards, rows = play(on, ahead=True)
    want, plain_forwards, plain_rows = play(off, ahead=False)
    assert got == want
    n = len(sessions_of(on))
    for i, draft in enumerate(DRAFTS):
        ahead_ran = i > 0 and runs_ahead_after(i - 1)
        # A plain call after a row run ahead was answered from it ...
        assert forwards[i] == (0 if ahead_ran and not draft else 1), (i, forwards)
        # ... and a chain after one forwards its draft's rows alone (its root
        # ran ahead); a tree drops the root run ahead and forwards it again.
        kept_root = ahead_ran and not is_tree(draft)
        assert rows[i] == plain_rows[i] - (n if kept_root else 0), (i, rows, plain_rows)
    assert plain_forwards == [1] * len(DRAFTS)
    # The rows run ahead are the sessions' only extra rows, and go with them.
    assert on.kv_tokens == off.kv_tokens + len(sessions_of(on))  # the last cycle was plain: run ahead
    for v in (on, off):
        for sid in sessions_of(v):
            v.close_session(sid)
        assert v.kv_pool.describe()["kv_used_blocks"] == 0


def test_decode_ahead_off_runs_nothing(pairs):
    target, _ = pairs["llama"]
    v = Verifier(VerifierConfig(target, device="cpu", decode_ahead=False))
    v.open_session("a", PROMPT, SamplingParams())
    v.verify("a", [])
    assert run_ahead(v) == 0 and v.sessions["a"].ahead is None


def test_a_refused_job_gives_its_row_back(pairs):
    target, _ = pairs["llama"]
    v = Verifier(VerifierConfig(target, device="cpu"))
    v.open_session("a", PROMPT, SamplingParams())
    v.verify("a", [])
    length = v.sessions["a"].cache.length
    assert run_ahead(v) == 1 and v.sessions["a"].cache.length == length + 1
    job = v.prepare("a", [])
    with v.sessions.lock:
        from verifier_svc.ahead import settle

        settle([job])
        assert job.ahead is not None and v.sessions["a"].ahead is None
        release([job])
    assert job.ahead is None and v.sessions["a"].cache.length == length
    # The session goes on as if nothing had run ahead.
    alone = Verifier(VerifierConfig(target, device="cpu", decode_ahead=False))
    alone.open_session("a", PROMPT, SamplingParams())
    alone.verify("a", [])
    assert v.verify("a", [7, 8]).tokens == alone.verify("a", [7, 8]).tokens
    assert torch.equal(torch.tensor(v.sessions["a"].tokens), torch.tensor(alone.sessions["a"].tokens))


def test_an_answer_from_a_row_run_ahead_reports_that_forward(pairs):
    """The orchestrator's cost model learns a verify's cost from what the call
    reports: a plain call answered from its row run ahead reports the forward
    that computed the row (its time, sessions, rows and id), not the batch
    that answered it without a forward (which would teach that a row costs nothing)."""
    target, _ = pairs["llama"]
    v = Verifier(VerifierConfig(target, device="cpu"))
    for sid in ("a", "b"):
        v.open_session(sid, PROMPT, SamplingParams())
    v.verify_batch([v.prepare(sid, []) for sid in ("a", "b")])
    assert run_ahead(v) == 2
    counter = Counting(v.runner)
    answered = v.verify_batch([v.prepare(sid, []) for sid in ("a", "b")])
    assert counter.calls == 0  # answered from the rows run ahead
    for r in answered:
        assert (r.batch_sessions, r.batch_tokens) == (2, 2) and r.compute_ms > 0.05, r
    assert answered[0].batch_id == answered[1].batch_id  # one forward: the cost model learns it once
