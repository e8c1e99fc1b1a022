"""The lean forward (specd_core/runtime/lean.py) gives Hugging Face's logits, through prefill,
decode steps, rollback, growth of the cache and compaction."""
import pytest
import torch

from specd_core.runtime import lean_step
from specd_core.runtime.kv_budget import KVPool
from specd_core.runtime.lean import LeanModel, supports
from specd_core.runtime.models import Runner, SessionCache, load_model

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lean_matches_hf(family, pairs):
    model = load_model(pairs[family][0], "cpu")
    assert supports(model.config)
    lm = LeanModel(model)
    # Blocks of 4 rows: the cache grows (and copies) several times below.
    lean, hf = lm.new_session(pool=KVPool(64, 4, lm.kv_row_bytes)), SessionCache(model)
    prompt = list(range(40, 50))
    steps = [prompt, [7], [8, 9, 10], [11]]
    for ids in steps:
        a, b = lean.forward(ids), hf.forward(ids)
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    for s in (lean, hf):
        s.rollback(11)
    assert torch.allclose(lean.forward([3, 4]), hf.forward([3, 4]), atol=1e-4)
    # A tree forward (20 with two children 21 and 22) then compaction of the path
    # [20, 22]: the same as having fed 20, 22 in sequence.
    past = lean.length
    blocked = torch.finfo(torch.float32).min
    mask = torch.zeros(3, past + 3)
    mask[0, past + 1:] = blocked
    mask[1, past + 2] = blocked
    mask[2, past + 1] = blocked
    positions = torch.tensor([past, past + 1, past + 1])
    for s in (lean, hf):
        tree = s.forward([20, 21, 22], positions=positions, mask=mask)
        s.compact(past, [0, 2])
    seq = model(torch.tensor([prompt + [7, 3, 4, 20, 22]])).logits[0]
    assert torch.allclose(tree[2], seq[-1], atol=1e-4)
    ref = model(torch.tensor([prompt + [7, 3, 4, 20, 22, 5]])).logits[0, -1]
    assert torch.allclose(lean.forward([5])[-1], ref, atol=1e-4)
    assert torch.allclose(hf.forward([5])[-1], ref, atol=1e-4)


def test_runner_picks_an_engine(pairs):
    model = load_model(pairs["llama"][0], "cpu")
    assert Runner(model).engine == "lean" and Runner(model, "hf").engine == "hf"
    with pytest.raises(ValueError):
        Runner(model, "fast")


def mixed_work(past: int) -> list:
    """One step's items for four sessions (token ids, positions, mask): a
    prefill, a decode row, a chain after a past, and a tree (a root and its
    two children) with its own mask over a session of `past` rows."""
    mask = torch.zeros(3, past + 3)
    mask[0, past + 1:] = torch.finfo(torch.float32).min
    mask[1, past + 2] = mask[2, past + 1] = torch.finfo(torch.float32).min
    pos = torch.tensor([past, past + 1, past + 1])
    return [([5, 6, 7, 8], None, None), ([9], None, None), ([10, 11, 12], None, None), ([13, 14, 15], pos, mask)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_forward_equals_one_session_at_a_time(family, pairs):
    """forward_batch over sessions of different lengths - a prefill, a decode
    step, a causal chain after a past, a tree with its own mask - gives each
    session the logits and cache of its own forward."""
    model = LeanModel(load_model(pairs[family][0], "cpu"))
    solo = [model.new_session() for _ in range(4)]
    batched = [model.new_session() for _ in range(4)]
    for group in (solo, batched):
        group[1].forward(list(range(30, 45)))
        group[2].forward(list(range(50, 58)))
        group[3].forward(list(range(60, 66)))
    work = mixed_work(past=6)
    want = [s.forward(ids, positions=p, mask=m) for s, (ids, p, m) in zip(solo, work)]
    got = model.forward_batch([(s, ids, p, m) for s, (ids, p, m) in zip(batched, work)])
    for w, g in zip(want, got):
        assert w.shape == g.shape and torch.allclose(w, g, atol=1e-4), (w - g).abs().max()
    # The caches agree too: the next step of each session is the same.
    for a, b in zip(solo, batched):
        assert a.length == b.length
        assert torch.allclose(a.forward([3]), b.forward([3]), atol=1e-4)
    last = model.forward_batch([(s, [4, 5], None, None) for s in batched], last_only=True)
    assert [t.shape[0] for t in last] == [1] * 4
    assert torch.allclose(last[0][0], solo[0].forward([4, 5])[-1], atol=1e-4)


def test_query_heads_ride_as_rows_on_a_cpu(pairs, monkeypatch):
    """On a CPU a grouped-query model's steps fold each KV head's query heads
    into one block of query rows (lean_step.fold_heads), with the masks
    repeated per head; a mixed step (a prefill, a decode row, a chain after
    a past, a tree with its own mask) gives the unfolded call's logits, and
    so does the next step of every session."""
    model = LeanModel(load_model(pairs["llama"][0], "cpu"))
    heads = model.n_heads // model.n_kv
    assert heads > 1 and lean_step.fold_heads(model) == heads
    past = 6
    work = mixed_work(past)

    def run(fold: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(lean_step, "fold_heads", lean_step.fold_heads if fold else (lambda m: 1))
        sessions = [model.new_session() for _ in range(4)]
        pasts = [list(range(30, 45)), list(range(50, 58)), list(range(60, 60 + past))]
        model.forward_batch([(s, ids, None, None) for s, ids in zip(sessions[1:], pasts)])
        step = lean_step.plan(model, [(s, ids, p, m) for s, (ids, p, m) in zip(sessions, work)], False)
        assert {g.fold for g in step.groups} == ({heads} if fold else {1})
        for g in step.groups:
            for m in g.masks:
                assert m is None or m.shape[2] in (1, g.fold * g.rows)
        out = model.forward_batch([(s, ids, p, m) for s, (ids, p, m) in zip(sessions, work)])
        return out + model.forward_batch([(s, [3], None, None) for s in sessions])

    folded, plain = run(True), run(False)
    for a, b in zip(folded, plain):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_no_fold_where_it_was_not_measured(pairs, monkeypatch):
    """By default soft-capped attention (its own path) and other devices keep
    one block per query head; SPECD_FOLD_HEADS=on folds on any device (to
    measure it there), off nowhere."""
    model = LeanModel(load_model(pairs["llama"][0], "cpu"))
    heads = model.n_heads // model.n_kv
    assert model.fold_mode == "auto"
    model.softcap = 50.0
    assert lean_step.fold_heads(model) == 1
    model.softcap, model.device = None, torch.device("meta")
    assert lean_step.fold_heads(model) == 1
    monkeypatch.setenv("SPECD_FOLD_HEADS", "on")
    model = LeanModel(load_model(pairs["llama"][0], "cpu"))
    model.device = torch.device("meta")
    assert lean_step.fold_heads(model) == heads
    monkeypatch.setenv("SPECD_FOLD_HEADS", "off")
    assert lean_step.fold_heads(LeanModel(load_model(pairs["llama"][0], "cpu"))) == 1
