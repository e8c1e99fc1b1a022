"""The lean forward (specd/lean.py) gives Hugging Face's logits, through prefill,
decode steps, rollback, growth of the cache and compaction."""
import pytest
import torch

from specd.lean import LeanModel, supports
from specd.models import Runner, SessionCache, load_model


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lean_matches_hf(family, pairs):
    model = load_model(pairs[family][0], "cpu")
    assert supports(model.config)
    lean, hf = LeanModel(model).new_session(), SessionCache(model)
    lean.INITIAL_ROWS = 4
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
