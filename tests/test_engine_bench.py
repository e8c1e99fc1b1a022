"""benchmarks/engine.py: its counters count what they say (operators that
would launch device work, host reads of tensor data, uploads of host data),
and a small run goes through the real verifier and drafter cores."""

import json

import pytest
import torch

from benchmarks import engine

pytestmark = pytest.mark.unit


def test_the_counters_tell_syncs_uploads_and_views_from_kernels():
    x = torch.arange(12.0).view(3, 4)
    with engine.counting() as (ops, reads):
        y = x.transpose(0, 1)[1:]           # views only
        z = (y * 2).sum()                   # two kernels
        z.item()                            # a sync
        y.tolist()                          # a sync the dispatcher does not see
        torch.tensor([1, 2, 3])             # an upload
    counts = engine.summarize(ops.ops, reads)
    assert counts["kernel_like"] == 2, ops.ops
    assert counts["syncs"] == 2 and counts["uploads"] == 1, (ops.ops, reads)
    assert counts["ops"] > counts["kernel_like"]
    # Outside the block nothing is counted and the methods are the originals again.
    x.tolist()
    assert sum(reads.values()) == 1 and torch.Tensor.tolist.__name__ == "tolist"


def test_tree_parents_follow_the_static_paths():
    assert engine.tree_parents(engine.TREE) == [-1, -1, 0, 0, 1, 1]


def test_a_small_run_through_the_cores(tmp_path):
    out = tmp_path / "engine.json"
    assert engine.main(["--sessions", "1", "3", "--reps", "1", "--context", "8", "--drafter-layers", "1",
                        "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["sessions"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        for kind in engine.KINDS:
            c = row[kind]
            assert 0 < c["kernel_like"] < c["ops"] and c["host_ms"] > 0, (kind, c)
            assert c["syncs"] >= 1          # the verdicts reach the host at least once
    assert result["target"]["num_hidden_layers"] == 32
    for kind in ("verify_chain", "verify_tree"):
        assert all(row[kind]["floor_ms"] > 0 for row in result["rows"]), kind
        assert result["ratio_3_to_1"][kind]["floor_over_first_host_ms"] > 0
    one, three = result["rows"]
    # Sampled chains and trees are decided without a read per session: on a
    # CPU, in Python over the host's copy of the law, whose few reads this
    # counter sees too (as many at 3 sessions as at 1); a GPU's batched form
    # reads nothing (tests/test_chain_batch.py).
    for kind in ("verify_chain_sampled", "verify_tree_sampled"):
        assert one[kind]["syncs"] == three[kind]["syncs"] <= 4, (kind, result["rows"])
    # A tree's mask and positions are built for all sessions at once: more
    # sessions add no upload and no more operators than they add to a chain.
    assert three["verify_tree"]["uploads"] == one["verify_tree"]["uploads"]
    grown = {kind: three[kind]["kernel_like"] - one[kind]["kernel_like"] for kind in ("verify_chain", "verify_tree")}
    assert grown["verify_tree"] <= grown["verify_chain"], grown
    # The drafter's trees go through the model one level for all sessions:
    # two more sessions add their choices and masks, not two more forwards
    # (one after another they added more than a whole one-session step).
    tree_grown = three["draft_tree"]["kernel_like"] - one["draft_tree"]["kernel_like"]
    assert tree_grown < one["draft_tree"]["kernel_like"], (one["draft_tree"], three["draft_tree"])


def test_the_floors_attention_is_grouped_query_attention():
    # The floor times this arrangement; it must be the attention a step computes.
    torch.manual_seed(0)
    sessions, rows, keys, nh, nkv, hd = 3, 5, 7, 8, 2, 4
    q = torch.randn(sessions, nh, rows, hd)
    k, v = torch.randn(sessions, nkv, keys, hd), torch.randn(sessions, nkv, keys, hd)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    got = engine.grouped_attention(
        q.transpose(1, 2).reshape(sessions * rows, nh * hd),
        (k * hd**-0.5).transpose(2, 3).reshape(sessions * nkv, hd, keys),
        v.reshape(sessions * nkv, keys, hd),
        sessions,
        nkv,
    )
    torch.testing.assert_close(got, expected.transpose(1, 2).reshape(sessions * rows, nh * hd))
