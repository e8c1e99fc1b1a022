"""Streaming text and end conditions (orchestrator/cycle/detok.py, orchestrator/cycle/loop.py)."""

import pytest

from orchestrator.cycle.detok import OutputTracker
from orchestrator.cycle.loop import draft_budget
from tests.tiny_models import build_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def stream(tracker, ids, step=1):
    out, reason = [], None
    for i in range(0, len(ids), step):
        e = tracker.add(ids[i : i + step])
        out.append(e.text)
        if e.finish_reason:
            reason = e.finish_reason
            break
    return "".join(out), reason


def test_text_concatenates_to_full_decode(tok):
    ids = tok("def f(x):\n    return x * 2  # é ü\n")["input_ids"]
    for step in (1, 2, 5):
        text, reason = stream(OutputTracker(tok, set(), 100, 1000), ids, step)
        assert text == tok.decode(ids) and reason is None


@pytest.mark.parametrize("step", [1, 3, 100])
def test_stop_string_cuts_text_and_ends(tok, step):
    ids = tok("a = 1\nb = 2\nc = 3\n")["input_ids"]
    text, reason = stream(OutputTracker(tok, set(), 100, 1000, stop=("zz", "b =")), ids, step)
    assert text == "a = 1\n" and reason == "stop"


def test_multibyte_characters_wait_for_their_last_byte(tok):
    ids = tok("s = '\u00e9\u4e2d\U0001f600'\n")["input_ids"]  # é, 中, 😀 split across byte tokens
    t = OutputTracker(tok, set(), 100, 1000)
    pieces = [t.add([i]).text for i in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_eos_first_with_stop_strings(tok):
    eos = tok.eos_token_id
    t = OutputTracker(tok, {eos}, 100, 1000, stop=("x",))
    e = t.add([eos, 8])
    assert e.finish_reason == "stop" and e.token_ids == [eos] and e.text == ""


def test_eos_and_length(tok):
    ids = tok("x = 1")["input_ids"]
    t = OutputTracker(tok, {ids[1]}, 100, 1000)
    e = t.add(ids)
    assert e.finish_reason == "stop" and e.token_ids == ids[:2]
    t = OutputTracker(tok, set(), 3, 1000)
    e = t.add(ids + ids)
    assert e.finish_reason == "length" and len(e.token_ids) == 3
    t = OutputTracker(tok, set(), 100, 2)  # context room smaller than max_new_tokens
    assert t.add(ids + ids).token_ids == (ids + ids)[:2]


def test_draft_budget():
    assert draft_budget(5, remaining=100, committed=10, target_ctx=256, drafter_ctx=256) == 5
    assert draft_budget(5, remaining=3, committed=10, target_ctx=256, drafter_ctx=256) == 2
    assert draft_budget(5, remaining=100, committed=253, target_ctx=256, drafter_ctx=512) == 2
    assert draft_budget(5, remaining=100, committed=100, target_ctx=256, drafter_ctx=100) == 1
    assert draft_budget(5, remaining=1, committed=10, target_ctx=256, drafter_ctx=256) == 0


@pytest.mark.parametrize("clean_up", [False, True])
def test_fast_decoder_equals_the_tokenizers_decode(tok, clean_up):
    """The tracker decodes through the Rust tokenizer directly when
    transformers would add nothing: every window must decode to the same text
    as tokenizer.decode, special tokens and broken UTF-8 included."""
    import random

    from orchestrator.cycle.detok import decoder

    before, tok.clean_up_tokenization_spaces = tok.clean_up_tokenization_spaces, clean_up
    try:
        decode = decoder(tok)
        assert decode.func is not tok.decode  # the fast path is taken for this BPE tokenizer
        rng = random.Random(0)
        ids = tok("x = {'a': 1, 'é': [2, 3]} .  ,  ü\n")["input_ids"] + list(tok.all_special_ids)
        for _ in range(300):
            window = [
                rng.choice(ids) if rng.random() < 0.7 else rng.randrange(len(tok)) for _ in range(rng.randint(0, 6))
            ]
            assert decode(window) == tok.decode(window, skip_special_tokens=True)
    finally:
        tok.clean_up_tokenization_spaces = before
