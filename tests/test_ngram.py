import pytest

from specd.rules.ngram import propose_ngram

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
