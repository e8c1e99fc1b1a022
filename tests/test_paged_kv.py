"""The paged KV cache (specd_core/runtime/paged_kv.py) and the batched step
(specd_core/runtime/lean_step.py) against Hugging Face's forward: rows that
cross block boundaries, compaction across blocks, rollback then regrowth
without taking or moving blocks, sessions whose blocks interleave in the
pool, a pool that runs out refusing only the session that asked, and padded
batches (several groups, sessions of different lengths and row counts, trees,
sliding windows, soft-capping) giving each session its own logits."""
import pytest
import torch

from specd_core.errors import CapacityExceeded
from specd_core.rules.tree import TokenTree
from specd_core.runtime import lean_step
from specd_core.runtime.kv_budget import KVPool
from specd_core.runtime.lean import LeanModel
from specd_core.runtime.models import dense_item, load_model
from specd_core.runtime.paged_kv import NULL_BLOCK
from specd_core.runtime.tree_tensors import TreeLevel, tree_attention
from tests.tiny_models import build_model, build_tokenizer

pytestmark = pytest.mark.unit

ATOL = 2e-4
PROMPT = [(7 * i + 3) % 300 + 5 for i in range(40)]


@pytest.fixture(scope="module")
def llama(pairs):
    return load_model(pairs["llama"][0], "cpu")


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and torch.allclose(a, b, atol=ATOL), (a - b).abs().max()


def test_rows_cross_block_boundaries(llama):
    """Blocks of 3 rows: a prefill, a chain and a decode row each span or
    straddle boundaries; every row is HF's."""
    lm = LeanModel(llama)
    s = lm.new_session(pool=KVPool(40, 3, lm.kv_row_bytes))
    seq = PROMPT[:10]
    close(s.forward(seq), hf_logits(llama, seq))
    for chunk in ([5, 6, 7, 8, 9], [10], [11, 12]):  # rows 10-14 cross 12; 15 starts a block; 16-17
        got = s.forward(chunk)
        seq = seq + chunk
        close(got, hf_logits(llama, seq)[-len(chunk):])
    assert s.length == 18 and s.capacity % 3 == 0 and s.capacity >= 18


def test_compaction_moves_rows_across_blocks(llama):
    """A tree of 7 nodes over 2-row blocks; keeping a path whose rows sit in
    later blocks moves them into earlier ones; the next row is HF's."""
    lm = LeanModel(llama)
    s = lm.new_session(pool=KVPool(40, 2, lm.kv_row_bytes))
    prompt = PROMPT[:9]  # 9 rows: the tree's root row starts mid-block
    s.forward(prompt)
    tree = TokenTree(tokens=(20, 21, 22, 23, 24, 25, 26), parents=(-1, -1, -1, 2, 3, 4, 5))
    mask, pos = tree_attention(tree, s.length)
    past = s.length
    s.forward([7] + list(tree.tokens), positions=pos[0], mask=mask[0, 0])
    path = [0, 3, 4, 5, 6, 7]  # root, node 2 and its chain: rows 10..16 kept at 10..14
    s.compact(past, path)
    kept = prompt + [7, 22, 23, 24, 25, 26]
    assert s.length == len(kept)
    close(s.forward([3])[-1], hf_logits(llama, kept + [3])[-1])


def test_rollback_then_regrow_takes_and_moves_nothing(llama):
    lm = LeanModel(llama)
    pool = KVPool(40, 4, lm.kv_row_bytes)
    s = lm.new_session(pool=pool)
    s.forward(PROMPT[:14])
    table, used = list(s.table), pool.used_blocks
    s.rollback(5)
    assert s.table == table and pool.used_blocks == used  # the blocks stay the session's
    again = [31, 32, 33, 34, 35, 36, 37]
    close(s.forward(again), hf_logits(llama, PROMPT[:5] + again)[5:])
    assert s.table == table and pool.used_blocks == used
    s.release()
    assert pool.used_blocks == 0 and s.table == [] and s.capacity == 0


def test_interleaved_blocks_and_a_pool_that_runs_out(llama):
    """Two sessions taking blocks in turn hold interleaved blocks; when the
    pool is empty the session that asks is refused, unchanged, and the other
    one's forward goes on; a block given back serves the refused one."""
    lm = LeanModel(llama)
    pool = KVPool(6, 4, lm.kv_row_bytes, "verifier")
    a, b = lm.new_session(pool=pool), lm.new_session(pool=pool)
    seq_a, seq_b = PROMPT[:3], PROMPT[10:13]
    for s, seq in ((a, seq_a), (b, seq_b)):
        s.forward(seq)
    for t in range(6):  # grow in turn, one block at a time
        for s, seq in ((a, seq_a), (b, seq_b)):
            seq.append(50 + t)
            got = s.forward([seq[-1]])
            close(got[-1], hf_logits(llama, seq)[-1])
    assert sorted(a.table + b.table) == list(range(NULL_BLOCK, NULL_BLOCK + 6)) and a.table != sorted(a.table + b.table)[:3]
    assert pool.free_blocks == 0
    table, length = list(a.table), a.length
    with pytest.raises(CapacityExceeded, match="verifier KV budget full"):
        a.reserve(a.capacity + 1, "session 'a'")
    assert (a.table, a.length) == (table, length)
    got = lm.forward_batch([(b, [60], None, None)])[0]  # b goes on within its blocks
    close(got[-1], hf_logits(llama, seq_b + [60])[-1])
    b.release()
    a.reserve(a.capacity + 1)
    close(a.forward([61])[-1], hf_logits(llama, seq_a + [61])[-1])


@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("paged")
    tok = build_tokenizer(root / "tokenizer")
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            path = build_model(root / family, family, "target", 1, tok, 15.0, random_norms=True)
            cache[family] = load_model(path, "cpu")
        return cache[family]

    return get


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gemma3"])
@pytest.mark.parametrize("spread", [lean_step.SPREAD, 0, "in place"])
def test_padded_batch_equals_each_session_alone(family, spread, family_model, monkeypatch):
    """Sessions of different lengths and row counts - a long prefill, decode
    rows, a chain after a past, a tree as a dense mask, trees as TokenTrees
    and a drafter's tree level as a TreeLevel (their masks built in the step;
    alone, the same dense masks) - in one step give each the logits and cache
    of its own forward, in one padded group, (spread 0: every session its
    own group) in several, and ("in place": every session whose rows lie in
    one range of storage read there, lean_step.in_place) with most of them
    groups of their own."""
    monkeypatch.setattr(lean_step, "SPREAD", spread if spread != "in place" else lean_step.SPREAD)
    monkeypatch.setattr(lean_step, "SLACK", 1 << 15 if spread else 0)
    monkeypatch.setattr(lean_step, "IN_PLACE_BYTES", 1 if spread == "in place" else 1 << 60)
    lean = LeanModel(family_model(family))
    pool = KVPool(200, 4, lean.kv_row_bytes)
    solo = [lean.new_session(pool=pool) for _ in range(8)]
    batched = [lean.new_session(pool=pool) for _ in range(8)]
    # Rows never written are uninitialised memory: make them NaN, which a
    # masked key would still spread (0 x NaN) if attention ever read one.
    with torch.inference_mode():
        solo[0].store.data[:, pool.block_rows:] = float("nan")
    for group in (solo, batched):
        group[1].forward(PROMPT[:35])
        group[2].forward(PROMPT[:9])
        group[3].forward(PROMPT[:20])
        group[4].forward(PROMPT[:3])
        group[5].forward(PROMPT[:17])
        group[6].forward(PROMPT[:23])
        # A tree growing on a drafter: its first level (two children of the
        # root, rows 18 and 19), then below both in the step.
        group[7].forward(PROMPT[:18])
        group[7].forward([61, 62], **dense_item(group[7], None, TreeLevel(18, (18, 18), ((), ()))))
    level = TreeLevel(18, (19, 19, 19), ((18,), (18,), (19,)))
    small = TokenTree(tokens=(40, 41, 42, 43, 44), parents=(-1, 0, -1, 2, 3))
    wide = TokenTree(tokens=(50, 51, 52, 53, 54, 55), parents=(-1, -1, 0, 0, 1, 1))
    mask, pos = tree_attention(small, 20)
    work = [(PROMPT[:30], None, None), ([9], None, None), ([4, 5, 6, 7, 8, 9], None, None),
            ([5] + list(small.tokens), pos[0], mask[0, 0]), ([11], None, None),
            ([6] + list(wide.tokens), None, wide), ([7] + list(small.tokens), None, small),
            ([63, 64, 65], None, level)]
    items = [(s, ids, p, m) for s, (ids, p, m) in zip(batched, work)]
    want = [s.forward(ids, **dense_item(s, p, m)) for s, (ids, p, m) in zip(solo, work)]
    entries = lean_step.entries_of(items)
    alone = lean_step.in_place(lean, entries)
    if spread == "in place":  # the pool placed most sessions' blocks in one run each
        assert len(alone) >= 6, [s.table for s in batched]
    else:
        assert not alone
        assert len(lean_step.group_entries(entries)) == (1 if spread else len(work))
    got = lean.forward_batch(items)
    for w, g in zip(want, got):
        close(g, w)
    for a, b in zip(solo, batched):
        assert a.length == b.length
    nxt = [([3, 4], None, None)] * len(work)
    after = lean.forward_batch([(s, ids, p, m) for s, (ids, p, m) in zip(batched, nxt)], last_only=True)
    for a, g in zip(solo, after):
        close(g, a.forward([3, 4])[-1:])


def test_tree_layout_hides_what_is_not_an_ancestor(llama):
    """Rows [root, node0 ..] of a 2x2 tree: positions from the depths, and the
    pairs the causal mask shows but the tree hides - exactly the earlier rows
    that tree_attention blocks."""
    tree = TokenTree(tokens=(1, 2, 3, 4, 5, 6), parents=(-1, -1, 0, 0, 1, 1))
    layout = lean_step.tree_layout(tree.parents)
    assert layout.depths == (0, 1, 1, 2, 2, 2, 2)
    mask, _ = tree_attention(tree, 0)
    blocked = mask[0, 0] < 0
    want = {(r, c) for r in range(7) for c in range(r) if blocked[r, c]}
    assert set(layout.hidden) == want and len(layout.hidden) == len(want) == 11
    with pytest.raises(ValueError, match="takes 7 rows"):
        lean_step.entries_of([(LeanModel(llama).new_session(), [1, 2], None, tree)])


def test_sessions_of_two_pools_do_not_share_a_forward(llama):
    lm = LeanModel(llama)
    a = lm.new_session(pool=KVPool(4, 4, lm.kv_row_bytes))
    b = lm.new_session()
    with pytest.raises(ValueError, match="share a KV pool"):
        lm.forward_batch([(a, [1], None, None), (b, [2], None, None)])
