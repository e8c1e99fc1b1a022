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
    short prefills of different lengths, lone decode rows, chains of 3 and 5
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
    # Sessions at different depths (adaptive chains), and a tree beside chains:
    # rows padded to the longest, picked and put back by index.
    out += lm.forward_batch([(s, list(range(40, 40 + k)), None, None) for s, k in zip(ss, (2, 5, 3, 1, 4))])
    out += lm.forward_batch(
        [(ss[0], [19, 20, 21, 22, 23, 24], None, tree), (ss[1], [7, 8, 9], None, None), (ss[2], [5], None, None)],
        last_only=[False, True, False],
    )
    for s in ss:  # the blocks back: a second run finds the same storage
        s.release()
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_padded_static_step_gives_the_unpadded_steps_logits(models, family, monkeypatch):
    monkeypatch.setenv(ENV, "off")
    plain = LeanModel(models[family])
    monkeypatch.setenv(ENV, "on")
    padded = LeanModel(models[family])
    assert plain.graphs is None and padded.graphs is not None
    assert padded.graphs.capture == (DEVICE == "cuda")
    # Twice: on CUDA a shape is captured when met again, so the second run
    # replays graphs (the first ran them eagerly); on a CPU both run padded.
    exact, bucketed = steps(plain) + steps(plain), steps(padded) + steps(padded)
    for e, b in zip(exact, bucketed, strict=True):
        assert e.shape == b.shape
        assert torch.allclose(e, b, atol=1e-4), (e - b).abs().max()
        if e.dtype.is_floating_point and e.shape[-1] == plain.vocab_size:
            assert torch.equal(e.argmax(-1), b.argmax(-1))
    shapes = list(padded.graphs.statics)
    # Through static buffers: 1 session as 1, 5 as 8, 3 as 4, 2 as 2; rows 1, 2,
    # 5, 6; the mixed steps (indexed) as 8 x 5 and 4 x 6, and so the short
    # prefills at the start (25-33 rows as 8 x 33: within the padding allowed).
    assert {(s.sessions, s.rows, s.indexed) for s in shapes} == {
        (8, 33, True),
        (1, 1, False),
        (8, 5, False),
        (4, 5, False),
        (4, 6, False),
        (2, 2, False),
        (8, 1, False),
        (2, 1, False),
        (8, 5, True),
        (4, 6, True),
    }
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


def test_prefills_and_steps_that_padding_would_swell_run_unpadded(models, monkeypatch):
    monkeypatch.setenv(ENV, "on")
    lm = LeanModel(models["llama3"])
    ss = [lm.new_session() for _ in range(5)]
    lm.forward_batch([(ss[0], list(range(5, 80)), None, None)])  # 75 rows: more than a graph takes
    # 60 rows beside four decode rows: 8 x 60 padded rows for 64 real ones
    lm.forward_batch(
        [(ss[1], list(range(5, 65)), None, None)] + [(s, [3], None, None) for s in ss[2:]] + [(ss[0], [4], None, None)]
    )
    assert not lm.graphs.statics
    for _ in range(2):  # 2 x 2 rows for 3: padded (on CUDA captured when met again)
        lm.forward_batch([(ss[1], [1, 2], None, None), (ss[2], [3], None, None)])
    assert [(s.sessions, s.rows, s.indexed) for s in lm.graphs.statics] == [(2, 2, True)]


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
