"""A projection's weight layout (specd_core/runtime/dense.py): the transposed
layout computes the same products, is chosen only where it was measured to be
faster, and the lean engine holds one copy of every weight it fuses or
transposes (the checkpoint's holders point into its storage)."""

import pytest
import torch
import torch.nn.functional as F

from specd_core.runtime.dense import TRANSPOSE_MAX_ELEMENTS, Dense
from specd_core.runtime.lean import LeanModel
from specd_core.runtime.lean_load import load_checkpoint
from tests.tiny_models import build_model, build_tokenizer


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.unit
@pytest.mark.parametrize("rows", [1, 8, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_transposed_products_match_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    d = Dense(w, b)
    assert d.t and d.w.shape == (64, 96) and d.w.is_contiguous()
    assert torch.equal(d.weight, w)  # the (out, in) view of the same values
    x = torch.randn(rows, 64, generator=g)
    torch.testing.assert_close(d(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, rows, 64, generator=g)
    torch.testing.assert_close(d(x3), F.linear(x3, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_layout_kept_where_transposing_was_not_measured_faster():
    big = torch.empty(TRANSPOSE_MAX_ELEMENTS // 1024 + 1, 1024)
    for w in (big, torch.randn(96, 64, dtype=torch.bfloat16)):
        d = Dense(w)
        assert not d.t and d.w is w
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    assert torch.equal(Dense(w)(x), F.linear(x, w))


@pytest.mark.unit
@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_lean_engine_holds_one_copy_of_each_weight(tmp_path, family):
    """q/k/v and gate/up (fused by the engine), o/down (transposed) and a tied
    head: the checkpoint's objects point into the engine's tensors, so the
    Runner, which keeps the checkpoint, does not hold a second copy."""
    tok = build_tokenizer(tmp_path / "tok")
    path = build_model(tmp_path / family, family, "drafter", 2, tok, 15.0)
    ckpt = load_checkpoint(path, "cpu")
    assert ckpt is not None
    before = {n: t.clone() for n, t in _weights(ckpt)}
    lean = LeanModel(ckpt)
    layer, L = ckpt.model.layers[0], lean.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    fused_attn = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
    fused_mlp = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
    for parts, dense in (
        (fused_attn, L["qkv"]),
        (fused_mlp, L["gate_up"]),
        ([attn.o_proj], L["o"]),
        ([mlp.down_proj], L["down"]),
    ):
        for p in parts:
            assert same_storage(p.weight, dense.w)
    if getattr(ckpt.config, "tie_word_embeddings", False):
        assert same_storage(ckpt.model.embed_tokens.weight, lean.head.w)
        assert same_storage(lean.embed, lean.head.w)
    for name, t in _weights(ckpt):  # the same values, wherever they now live
        assert torch.equal(t, before[name]), name


def _weights(ckpt):
    layer = ckpt.model.layers[0]
    for owner in (layer.self_attn, layer.mlp):
        for name, module in vars(owner).items():
            if hasattr(module, "weight") and isinstance(module.weight, torch.Tensor):
                yield name, module.weight
    yield "embed", ckpt.model.embed_tokens.weight
    yield "head", ckpt.lm_head.weight
