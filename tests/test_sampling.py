"""`specd_core.rules.sampling`: the one definition of "plain sampling" (docs/rules.md, "p and
q": p is the target distribution after exactly the processing
plain sampling would apply).

What these tests prove:
- `logits_to_probs` is the same distribution Hugging Face samples from with
  `generate(do_sample=True, temperature=, top_k=, top_p=)`: temperature, then
  top-k, then top-p warpers, then softmax, compared element-wise and on the
  support (which tokens get exactly zero probability) for many combinations.
- greedy (temperature 0) is the one-hot argmax, so greedy is the sampling rule's limit.
- `SamplingParams.validate` rejects every out-of-range parameter with InvalidRequest.
- `truncate_top` returns exactly the n most likely ids, sorted by probability,
  with the kept probabilities renormalised in their original ratios (this is the
  truncated q a drafter samples from and sends sparsely).
"""
import math

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specd_core.errors import InvalidRequest
from specd_core.rules.sampling import SamplingParams, logits_to_probs, sample, truncate_top

pytestmark = pytest.mark.unit


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Hugging Face's own processing, in the order `generate` builds its warpers
    (temperature, top-k, top-p), then softmax. Warpers take (batch, V)."""
    shape = logits.shape
    scores = logits.float().reshape(-1, shape[-1])
    ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)  # input_ids are unused by these warpers
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores.softmax(-1).reshape(shape)


COMBOS = [
    # (temperature, top_k, top_p)
    (1.0, 0, 1.0),     # plain softmax
    (0.7, 0, 1.0),     # temperature only
    (1.5, 0, 1.0),
    (1.0, 0, 0.9),     # top-p only
    (0.7, 0, 0.8),     # temperature < 1 with top-p < 1: order matters here
    (0.5, 0, 0.5),
    (1.3, 0, 0.3),
    (1.0, 5, 1.0),     # top-k only
    (0.8, 10, 0.9),    # all three
    (1.2, 3, 0.95),
    (0.6, 1, 1.0),     # top-k = 1: a point mass
    (1.0, 0, 0.001),   # tiny top-p keeps only the most likely token
    (0.9, 64, 0.7),    # top-k >= V is "off"
]


@pytest.mark.parametrize("temperature,top_k,top_p", COMBOS)
def test_logits_to_probs_matches_hf_warpers(temperature, top_k, top_p):
    """Same probabilities and the same support as HF's warpers, on random logits
    (batched, with a leading extra dim to check `...` shapes) and on integer-valued
    logits full of ties (checks that ties at the top-k / top-p boundary are
    resolved identically)."""
    g = torch.Generator().manual_seed(1234)
    V = 50
    random_logits = torch.randn(4, 8, V, generator=g) * 3.0
    tied_logits = torch.randint(-3, 4, (16, V), generator=g).float()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p).validate()
    for logits in (random_logits, tied_logits):
        got = logits_to_probs(logits, params)
        want = hf_probs(logits, temperature, top_k, top_p)
        assert got.shape == logits.shape and got.dtype == torch.float32
        assert torch.equal(got == 0, want == 0), "different support than HF"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[:-1]))


def test_temperature_then_top_p_order():
    """The order is observable: with temperature < 1 applied before top-p the
    nucleus is smaller than if top-p were applied to the raw logits. Guards the
    specific order, not just "some" processing."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5, top_p=0.8))
    wrong_order = hf_probs(logits, 1.0, 0, 0.8)  # top-p on raw logits keeps more tokens
    assert int((probs > 0).sum()) < int((wrong_order > 0).sum())
    torch.testing.assert_close(probs, hf_probs(logits, 0.5, 0, 0.8))


def test_greedy_is_one_hot_argmax():
    """temperature 0 -> exactly one-hot at argmax (first index on ties), whatever top-k/top-p say."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, 11, generator=g)
    for params in (SamplingParams(), SamplingParams(temperature=0.0, top_k=3, top_p=0.5)):
        assert params.greedy
        probs = logits_to_probs(logits, params)
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 11).float())
    tie = logits_to_probs(torch.tensor([1.0, 3.0, 3.0, 0.0]), SamplingParams())
    assert tie.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert not SamplingParams(temperature=0.1).greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(temperature=-1e-9),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(temperature=float("-inf")),
        dict(temperature=1.0, top_p=0.0),
        dict(temperature=1.0, top_p=-0.5),
        dict(temperature=1.0, top_p=1.0000001),
        dict(temperature=1.0, top_p=2.0),
        dict(temperature=1.0, top_p=float("nan")),
        dict(temperature=1.0, top_k=-1),
    ],
)
def test_validate_rejects(kwargs):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs).validate()


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(temperature=0.7, top_p=0.8, top_k=40), dict(temperature=2.0, top_p=1.0, top_k=0),
     dict(temperature=1e-3, top_p=1e-6, top_k=1)],
)
def test_validate_accepts(kwargs):
    params = SamplingParams(**kwargs)
    assert params.validate() is params


def test_invalid_request_is_a_value_error():
    """The gRPC edge maps InvalidRequest to INVALID_ARGUMENT; callers may catch ValueError."""
    assert issubclass(InvalidRequest, ValueError)


def test_truncate_top_keeps_n_sorted_and_renormalised():
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(20, generator=g) * 2, -1)
    for n in (1, 3, 7, 19):
        ids, vals = truncate_top(probs, n)
        assert ids.dtype == torch.long and ids.shape == (n,) and vals.shape == (n,)
        assert set(ids.tolist()) == set(torch.argsort(probs, descending=True)[:n].tolist())
        assert torch.all(vals[:-1] >= vals[1:]), "ids must be sorted by probability, descending"
        assert torch.all(probs[ids][:-1] >= probs[ids][1:])
        assert math.isclose(float(vals.sum()), 1.0, abs_tol=1e-6)
        torch.testing.assert_close(vals, probs[ids] / probs[ids].sum())


def test_truncate_top_n_at_least_vocab_and_zero_mass():
    """n >= V keeps everything; tokens with zero probability (e.g. removed by
    top-p) are never kept, so every sent id really could have been drawn."""
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    ids, vals = truncate_top(probs, 10)
    assert ids.tolist() == [2, 3, 0]
    torch.testing.assert_close(vals, torch.tensor([0.6, 0.3, 0.1]))
    ids, vals = truncate_top(probs, 4)
    assert ids.tolist() == [2, 3, 0]
    ids, vals = truncate_top(torch.tensor([0.0, 1.0, 0.0]), 2)
    assert ids.tolist() == [1] and vals.tolist() == [1.0]


def test_sample_is_deterministic_and_respects_zeros():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5])
    a = [sample(probs, torch.Generator().manual_seed(11)) for _ in range(3)]
    assert len(set(a)) == 1
    g = torch.Generator().manual_seed(11)
    draws = [sample(probs, g) for _ in range(500)]
    assert set(draws) == {1, 3}
    assert sample(torch.tensor([0.0, 0.0, 1.0]), g) == 2
