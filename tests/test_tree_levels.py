"""What a drafter's tree level makes of its rows for all trees at once
(drafter_svc/tree_builder.py): each sampled row's truncated q and each greedy
row's ranking, brought to the host in one transfer, are exactly what the
per-node path computes row by row."""

import pytest
import torch

from drafter_svc.tree_builder import rank_rows, truncated_rows
from specd_core.rules.sampling import SamplingParams, logits_to_probs, truncate_top

pytestmark = pytest.mark.unit


def rows(n: int = 6, vocab: int = 97) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(vocab, generator=g) * (1 + i) for i in range(n)]


def test_truncated_rows_are_each_rows_truncate_top():
    """Rows of different laws (temperature, top-p cutting most of the
    vocabulary, top-k, a width of its own), one call: each row's ids and
    probabilities equal truncate_top's on that row alone, bit for bit."""
    laws = [SamplingParams(1.0), SamplingParams(0.7, top_p=0.3), SamplingParams(1.3, top_k=3),
            SamplingParams(0.5, top_p=0.9, top_k=50), SamplingParams(1.0, top_p=0.05), SamplingParams(2.0)]
    made = rows() + [torch.randn(40)]
    pairs = list(zip(made, laws + [SamplingParams(0.9)]))
    got = truncated_rows(pairs, top_n=16)
    for (row, params), t in zip(pairs, got):
        ids, probs = truncate_top(logits_to_probs(row, params), 16)
        assert torch.equal(t.ids, ids) and torch.equal(t.probs, probs)
    assert len(got[4].ids) < 16 and len(got[2].ids) == 3  # cuts to the nonzero entries happened


def test_rank_rows_are_each_rows_top_k_and_log_softmax():
    made = rows() + [torch.randn(40)]
    for r, ranked in zip(made, rank_rows(made, 5)):
        top = torch.topk(torch.log_softmax(r.float(), -1), 5)
        assert ranked.ids == top.indices.tolist()
        assert torch.allclose(torch.tensor(ranked.logps, dtype=torch.float64), top.values.double(), atol=1e-5)
