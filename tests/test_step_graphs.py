"""Bucketed steps (SPECD_CUDA_GRAPHS, specd_core/runtime/step_graphs.py): a
step padded to a CUDA graph's shape - sessions up to a bucket, key columns
rounded up, padding rows writing to the scratch block - gives the logits and
hidden states of the unpadded step. On a CPU "on" runs the same static,
padded buffers without capturing, which is what the suite checks; with
SPECD_TEST_DEVICE=cuda the same tests capture and replay real CUDA graphs
(benchmarks/gpu.py times them)."""

import os

import pytest
import torch

from specd_core.rules.tree import TokenTree
from specd_core.runtime import step_graphs
from specd_core.runtime.lean import LeanModel
from specd_core.runtime.models import load_model
from specd_core.runtime.paged_kv import NULL_BLOCK
from specd_core.runtime.step_graphs import ENV, key_columns, mode_from_env, sessions_bucket
from tests.tiny_models import build_model, build_tokenizer

pytestmark = pytest.mark.unit

FAMILIES = ("llama3", "gemma2", "qwen3", "phi3")
DEVICE = os.environ.get("SPECD_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    tok = build_tokenizer(root / "tok")
    # Llama-3 (grouped-query heads), Gemma-2 (sliding windows of 16 beside full
    # layers, soft-capping), Qwen3 (q/k norms), Phi-3 (fused weights, partial rotary).
    return {f: load_model(build_model(root / f, f, "target", 3, tok), DEVICE) for f in FAMILIES}


def steps(lm: LeanModel) -> list[torch.Tensor]:
    """The logits and hidden states of a served-like run over five sessions:
    prefills (unbucketed: rows differ), lone decode rows, chains of 3 and 5
    sessions (padded to 4 and 8), trees, a step past the sliding window, the
    same shapes again with fewer sessions (the padding must be put back)."""
    ss = [lm.new_session() for _ in range(5)]
    out = lm.forward_batch([(s, list(range(5 + i, 30 + 3 * i)), None, None) for i, s in enumerate(ss)])
    out += lm.forward_batch([(ss[0], [11], None, None)])
    out += lm.forward_batch([(s, [12, 13, 14, 15, 16], None, None) for s in ss])
    out += lm.forward_batch([(s, [17, 18, 19, 20, 21], None, None) for s in ss[:3]])
    tree = TokenTree(tokens=(20, 21, 22, 23, 24), parents=(-1, -1, 0, 0, 1))
    out += lm.forward_batch([(s, [19, 20, 21, 22, 23, 24], None, tree) for s in ss[1:4]])
    logits, states = lm.forward_batch(
        [(s, [7, 8], None, None) for s in ss[:2]], last_only=True, hidden=(1, len(lm.layers))
    )
    out += logits + states
    out += lm.forward_batch([(s, [30], None, None) for s in ss])  # decode rows
    out += lm.forward_batch([(s, [31], None, None) for s in ss[3:]])  # the same bucket, two of five
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_padded_static_step_gives_the_unpadded_steps_logits(models, family, monkeypatch):
    monkeypatch.setenv(ENV, "off")
    plain = LeanModel(models[family])
    monkeypatch.setenv(ENV, "on")
    padded = LeanModel(models[family])
    assert plain.graphs is None and padded.graphs is not None
    assert padded.graphs.capture == (DEVICE == "cuda")
    exact, bucketed = steps(plain), steps(padded)
    for e, b in zip(exact, bucketed, strict=True):
        assert e.shape == b.shape
        assert torch.allclose(e, b, atol=1e-4), (e - b).abs().max()
        if e.dtype.is_floating_point and e.shape[-1] == plain.vocab_size:
            assert torch.equal(e.argmax(-1), b.argmax(-1))
    shapes = list(padded.graphs.statics)
    # Through static buffers: 1 session as 1, 5 as 8, 3 as 4, 2 as 2; rows 1, 2, 5, 6.
    assert {(s.sessions, s.rows) for s in shapes} == {(1, 1), (8, 5), (4, 5), (4, 6), (2, 2), (8, 1), (2, 1)}
    assert all(k % 64 == 0 for s in shapes for k in s.keys)
    assert padded.graphs.captured == (len(shapes) if DEVICE == "cuda" else 0)
    data = padded.default_pool.storage.data
    assert not data[:, : padded.default_pool.block_rows].any()  # the zero block is still zeros
    assert NULL_BLOCK == 2


def test_the_graph_buckets():
    assert [sessions_bucket(n) for n in (1, 2, 3, 5, 9, 17, 25, 33, 49, 64)] == [1, 2, 4, 8, 16, 24, 32, 48, 64, 64]
    assert sessions_bucket(65) is None
    assert [key_columns(k) for k in (1, 64, 65, 100, 129, 1000, 2049)] == [64, 64, 80, 112, 160, 1024, 2560]
    for k in range(1, 5000, 7):  # never fewer columns than needed, at most a quarter more past 64
        assert k <= key_columns(k) <= max(64, 1.25 * k)


def test_prefills_and_mixed_steps_run_unpadded(models, monkeypatch):
    monkeypatch.setenv(ENV, "on")
    lm = LeanModel(models["llama3"])
    a, b = lm.new_session(), lm.new_session()
    lm.forward_batch([(a, list(range(5, 80)), None, None)])  # 75 rows: more than a graph takes
    lm.forward_batch([(a, [1, 2], None, None), (b, [3], None, None)])  # rows differ
    assert not lm.graphs.statics


def test_the_setting(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert mode_from_env() == "auto"
    monkeypatch.setenv(ENV, "OFF")
    assert mode_from_env() == "off"
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match="SPECD_CUDA_GRAPHS='yes': want one of auto, on, off"):
        mode_from_env()


def test_auto_is_off_on_a_cpu_and_eagle3_heads_are_never_graphed(models, monkeypatch):
    monkeypatch.setenv(ENV, "auto")
    assert (LeanModel(models["llama3"]).graphs is None) == (DEVICE == "cpu")
    monkeypatch.setenv(ENV, "on")

    class Unsafe(LeanModel):
        graphable = False

    assert Unsafe(models["llama3"]).graphs is None
    assert step_graphs.for_model(LeanModel(models["llama3"]), "off") is None
