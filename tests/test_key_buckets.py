"""Key buckets (SPECD_KEY_BUCKET, specd_core/runtime/lean_step.py): a step
whose key columns are rounded up to a bucket, the extra ones masked, gives
the logits of the exact step - prefills, decode rows, chains, token trees,
lone sessions and groups, sliding windows and soft-capping - while its
attention shapes change only once per bucket."""

import pytest
import torch

from specd_core.rules.tree import TokenTree
from specd_core.runtime import lean_step
from specd_core.runtime.attention_backends import KEY_BUCKET_ENV, key_bucket_from_env
from specd_core.runtime.lean import LeanModel
from specd_core.runtime.models import load_model
from tests.tiny_models import build_model, build_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("buckets")
    tok = build_tokenizer(root / "tok")
    # Llama (grouped-query heads) and Gemma-2 (sliding windows of 16 beside
    # full layers, soft-capped attention).
    return {f: load_model(build_model(root / f, f, "target", 3, tok), "cpu") for f in ("llama3", "gemma2")}


def steps(lm: LeanModel) -> list[torch.Tensor]:
    """The logits of a served-like run: three prefills of different lengths,
    a lone decode row, a batched chain step, a batch of token trees."""
    a, b, c = (lm.new_session() for _ in range(3))
    out = lm.forward_batch([(a, list(range(5, 45)), None, None), (b, list(range(9, 30)), None, None)])
    out += lm.forward_batch([(c, list(range(3, 70)), None, None)])
    out += lm.forward_batch([(a, [11], None, None)])  # a lone session's decode row
    out += lm.forward_batch([(s, [12, 13, 14, 15, 16], None, None) for s in (a, b, c)])
    tree = TokenTree(tokens=(20, 21, 22, 23, 24), parents=(-1, -1, 0, 0, 1))
    out += lm.forward_batch([(s, [19, 20, 21, 22, 23, 24], None, tree) for s in (b, c)])
    out += lm.forward_batch([(c, [30, 31, 32], None, None)])  # a lone chain past the window
    return out


@pytest.mark.parametrize("family", ["llama3", "gemma2"])
@pytest.mark.parametrize("bucket", [64, 7])
def test_a_bucketed_step_gives_the_exact_steps_logits(models, family, bucket):
    exact_model, bucketed_model = LeanModel(models[family]), LeanModel(models[family])
    bucketed_model.key_bucket = bucket
    exact, bucketed = steps(exact_model), steps(bucketed_model)
    for e, b in zip(exact, bucketed, strict=True):
        assert e.shape == b.shape
        assert torch.allclose(e, b, atol=1e-4), (e - b).abs().max()
        assert torch.equal(e.argmax(-1), b.argmax(-1))


def test_a_bucketed_plan_has_its_shapes(models):
    lm = LeanModel(models["llama3"])
    lm.key_bucket = 64
    s = lm.new_session()
    lm.forward_batch([(s, list(range(5, 45)), None, None)])
    for n in (1, 5):  # a lone session's keys and mask come padded to the bucket, not exact
        step = lean_step.plan(lm, [(s, list(range(7, 7 + n)), None, None)], False)
        (group,) = step.groups
        assert group.keys[0].shape[-1] == 64 and group.masks[0] is not None
        assert group.masks[0].shape[-1] == 64
    lm.key_bucket = 0  # exact: a lone decode row reads its 41 keys with no mask
    step = lean_step.plan(lm, [(s, [7], None, None)], False)
    assert len(step.groups[0].keys[0]) == 41 and step.groups[0].masks[0] is None


def test_the_setting_is_read_and_checked(monkeypatch):
    monkeypatch.delenv(KEY_BUCKET_ENV, raising=False)
    assert key_bucket_from_env() == 0
    monkeypatch.setenv(KEY_BUCKET_ENV, "64")
    assert key_bucket_from_env() == 64
    for bad in ("-1", "sixty", "1.5"):
        monkeypatch.setenv(KEY_BUCKET_ENV, bad)
        with pytest.raises(ValueError, match=f"{KEY_BUCKET_ENV}='{bad}'"):
            key_bucket_from_env()
