import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specd_core.rules.ngram import NgramIndex, propose_ngram

pytestmark = pytest.mark.unit


def test_longest_suffix_match_wins_and_latest_occurrence_first():
    ctx = [1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 1, 2, 3]
    # suffix [1,2,3] matched at 0 -> continuation [9, 9, 2]
    assert propose_ngram(ctx, 3, n_max=3, n_min=1) == [9, 9, 2]
    # with n_max=2, suffix [2,3]: latest earlier match at 5 -> [7, 8, 5]
    assert propose_ngram(ctx, 3, n_max=2, n_min=1) == [7, 8, 5]


def test_no_match_and_short_continuations():
    assert propose_ngram([1, 2, 3, 4], 3, 3, 1) == []
    assert propose_ngram([5, 6, 5], 4, 2, 1) == [6, 5]          # runs up to the end of context
    assert propose_ngram([5], 3, 3, 1) == []
    assert propose_ngram([4, 4, 4, 4], 2, 2, 2) == [4, 4]
    assert propose_ngram([1, 2, 1, 3], 2, 4, 2) == []            # n_min=2: [1,3] never seen


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=1, max_size=12),  # a small alphabet: many matches
    st.integers(1, 5), st.integers(1, 4), st.integers(0, 3),
)
def test_index_drafts_what_a_full_scan_drafts(chunks, k, n_min, extra):
    """The orchestrator's incremental index equals the scan over the whole
    context after every extension (prompt, then committed tokens)."""
    n_max = n_min + extra
    index = NgramIndex(n_max, n_min, chunks[0])
    context = list(chunks[0])
    for chunk in chunks[1:] + [[]]:
        assert index.propose(k) == propose_ngram(context, k, n_max, n_min), (context, k, n_max, n_min)
        index.extend(chunk)
        context += chunk
    assert index.context == context
