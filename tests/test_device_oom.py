"""A forward that runs the device out of memory (torch.OutOfMemoryError, what a
CUDA OOM raises): the jobs that caused it are refused (CapacityExceeded), the
others of the batch get exactly the results they get without the failure, and
nothing of the failed forward stays (session lengths, KV blocks).

The out-of-memory error is injected around the runner's forward: raised before
it ("start") or after it ("lm_head": the lean engine has then moved the sessions'
lengths past the new rows, as when the LM head is what does not fit)."""

import pytest
import torch

from drafter_svc.config import DrafterConfig
from drafter_svc.core import Drafter
from specd_core.errors import CapacityExceeded
from specd_core.rules.sampling import SamplingParams
from specd_core.runtime.models import Runner, SessionCache, load_model
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier

pytestmark = pytest.mark.unit

GREEDY = SamplingParams()
BLOCK = 8
PROMPTS = {"a": [40, 41, 42, 43], "b": [7, 8, 9, 10, 11, 12], "c": [100, 101, 102]}
LONG = list(range(3, 233))  # a prompt of 230 tokens


@pytest.fixture(scope="module")
def llama(pairs):
    return load_model(pairs["llama"][0], "cpu")


def verifier(pairs, model, engine="lean") -> Verifier:
    budget = f"{128 * BLOCK * Runner(model, engine).kv_row_bytes}B"  # 128 blocks of 8 rows
    config = VerifierConfig(pairs["llama"][0], device="cpu", engine=engine, kv_block_size=BLOCK, kv_cache_memory=budget)
    v = Verifier(config, model)
    for sid, prompt in PROMPTS.items():
        v.open_session(sid, prompt, GREEDY)
    return v


def inject_oom(monkeypatch, v: Verifier, max_rows: int, where: str) -> list[int]:
    """Make v's forwards fail with the device's out-of-memory error when an
    item has more than max_rows rows; the rows of each forward tried, returned."""
    real, tried = v.runner.forward_batch, []

    def forward_batch(items, *args, **kwargs):
        tried.append(sum(len(ids) for _, ids, _, _ in items))
        fails = max(len(ids) for _, ids, _, _ in items) > max_rows
        if fails and where == "start":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        out = real(items, *args, **kwargs)
        if fails:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return out

    monkeypatch.setattr(v.runner, "forward_batch", forward_batch)
    return tried


@torch.inference_mode()
def greedy_draft(model, tokens: list[int], k: int) -> list[int]:
    """The target's own greedy continuation of k tokens, its last one changed:
    k - 1 of them are accepted, so the comparison sees real acceptance."""
    out = list(tokens)
    for _ in range(k):
        out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    draft = out[len(tokens) :]
    draft[-1] = (draft[-1] + 1) % 200
    return draft


def state(v: Verifier, sid: str) -> tuple[list[int], int]:
    s = v.sessions[sid]
    return list(s.tokens), s.cache.length


def blocks_held(v: Verifier) -> int:
    return sum(s.cache.blocks for s in v.sessions.values())


def outcome(r) -> tuple:
    return (type(r).__name__, str(r)) if isinstance(r, Exception) else (r.path, r.tokens)


@pytest.mark.parametrize("where", ["start", "lm_head"])
def test_a_long_prefill_that_runs_out_of_memory_is_refused_alone(pairs, llama, monkeypatch, where):
    ref, v = verifier(pairs, llama), verifier(pairs, llama)
    tried = inject_oom(monkeypatch, v, 200, where)
    drafts = {sid: greedy_draft(llama, ref.sessions[sid].tokens, 4) for sid in PROMPTS}

    def batch(core):
        jobs = [core.prepare(sid, d) for sid, d in drafts.items()]
        return core.verify_batch(jobs[:2] + [core.prepare_open("long", LONG, GREEDY)] + jobs[2:])

    want, got = batch(ref), batch(v)
    refused = got.pop(2)
    assert not isinstance(want.pop(2), Exception)  # without the failure the prefill runs
    assert isinstance(refused, CapacityExceeded)
    assert "'long'" in str(refused) and "ran out of memory" in str(refused) and "prefill of 230 tokens" in str(refused)
    assert "CUDA out of memory" in str(refused)
    # The verifies, retried apart from the prefill (one forward), get exactly the reference's results.
    assert [outcome(r) for r in got] == [outcome(r) for r in want]
    assert all(r.num_accepted == 3 for r in got)
    assert tried == [3 * 5 + 230, 3 * 5, 230]
    # Nothing of it stays: the refused session is not open, no block is held but the sessions'.
    assert "long" not in v.sessions
    assert v.kv_pool.used_blocks == blocks_held(v)
    for sid in PROMPTS:
        assert state(v, sid) == state(ref, sid)
        assert v.sessions[sid].cache.length == len(v.sessions[sid].tokens) - 1
    # The sessions go on as they would have.
    for sid in PROMPTS:
        d = greedy_draft(llama, ref.sessions[sid].tokens, 3)
        assert outcome(v.verify(sid, d)) == outcome(ref.verify(sid, d))
        assert state(v, sid) == state(ref, sid)
    for sid in PROMPTS:
        v.close_session(sid)
    assert v.kv_pool.used_blocks == 0


@pytest.mark.parametrize("engine", ["lean", "hf"])
@pytest.mark.parametrize("where", ["start", "lm_head"])
def test_a_verify_that_runs_out_of_memory_alone_is_refused_alone(pairs, llama, monkeypatch, engine, where):
    ref, v = verifier(pairs, llama, engine), verifier(pairs, llama, engine)
    inject_oom(monkeypatch, v, 6, where)
    drafts = {sid: greedy_draft(llama, ref.sessions[sid].tokens, 8 if sid == "b" else 4) for sid in PROMPTS}
    before = state(v, "b")
    want = ref.verify_batch([ref.prepare(sid, d) for sid, d in drafts.items()])
    got = v.verify_batch([v.prepare(sid, d) for sid, d in drafts.items()])
    assert isinstance(got[1], CapacityExceeded) and not isinstance(want[1], Exception)
    assert "session 'b'" in str(got[1]) and "ran out of memory for a verify of 8 draft tokens" in str(got[1])
    assert [outcome(r) for r in (got[0], got[2])] == [outcome(r) for r in (want[0], want[2])]
    assert state(v, "a") == state(ref, "a") and state(v, "c") == state(ref, "c")
    # The refused session is as before its call, and goes on like a session that never saw it.
    assert state(v, "b") == before
    assert v.kv_pool.used_blocks == blocks_held(v)
    fresh = verifier(pairs, llama, engine)
    d = greedy_draft(llama, before[0], 4)
    assert outcome(v.verify("b", d)) == outcome(fresh.verify("b", d))
    assert state(v, "b") == state(fresh, "b")
    # A batch of that one job alone: refused, the session unchanged.
    again = state(v, "b")
    with pytest.raises(CapacityExceeded, match="session 'b'"):
        v.verify("b", greedy_draft(llama, again[0], 8))
    assert state(v, "b") == again
    for sid in PROMPTS:
        v.close_session(sid)
    assert v.kv_pool.used_blocks == 0


def test_hf_rollback_after_a_forward_that_failed_part_way(llama):
    """An HF forward that ran out of memory in a later layer has appended its
    rows to the first layers only: rollback leaves every layer at the length."""
    c = SessionCache(llama)
    c.forward([40, 41, 42, 43, 44])
    first = c.cache.layers[0]
    first.update(first.keys[..., :3, :], first.values[..., :3, :])  # the part-way forward's rows
    assert [layer.get_seq_length() for layer in c.cache.layers] == [8, 5]
    c.rollback(5)
    assert [layer.get_seq_length() for layer in c.cache.layers] == [5, 5]


def test_drafter_prefill_that_runs_out_of_memory_is_refused(pairs, monkeypatch):
    _, drafter_dir = pairs["llama"]
    d = Drafter(DrafterConfig(drafter_dir, device="cpu"))
    d.open_session("a", PROMPTS["a"], GREEDY)
    used = d.kv_pool.used_blocks
    real = d.runner.lean.forward

    def forward(session, token_ids, *args, **kwargs):
        if len(token_ids) > 200:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(session, token_ids, *args, **kwargs)

    monkeypatch.setattr(d.runner.lean, "forward", forward)
    with pytest.raises(CapacityExceeded, match=r"session 'long': the device ran out of memory for a prefill of 230"):
        d.open_session("long", LONG, GREEDY)
    assert "long" not in d.sessions and d.kv_pool.used_blocks == used
    d.open_session("b", PROMPTS["b"], GREEDY)  # the drafter goes on
    assert "a" in d.sessions and "b" in d.sessions
