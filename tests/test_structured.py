"""Structured output's pieces, one module at a time: the grammar engine
(specd_core/runtime/grammar.py), a forced tail and an n-gram cut in the loop
(orchestrator/cycle/structured.py), the drafter's masked and forced chains
(drafter_svc/tree_builder.py), and what the records count. Every check
compares with a matcher built from scratch by llguidance itself."""
import gc
import json
import random

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch

from orchestrator.cycle.records import CycleRecord, Draft, Stats, Verdict
from orchestrator.cycle.structured import add_forced, cut_forbidden, shape_draft
from specd_core.errors import InvalidRequest
from specd_core.rules.sampling import SamplingParams
from specd_core.rules.structured import OutputConstraint
from specd_core.runtime.grammar import GrammarEngine, apply_masks, live_matchers
from tests.tiny_models import build_tokenizer

pytestmark = pytest.mark.unit

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
JSON = OutputConstraint("json_schema", json.dumps(SCHEMA))
WIDTH = 400  # a table padded past the tokenizer's 384 ids


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def engine(tok):
    return GrammarEngine(tok, [tok.eos_token_id])


def fresh_allowed(tok, grammar: str, prefix: list[int]) -> set[int] | None:
    """The reference: a new llguidance matcher fed the prefix; None if it refuses it."""
    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok), grammar)
    if m.validate_tokens(prefix) < len(prefix):
        return None
    m.consume_tokens(prefix)
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return {i for i in np.nonzero(bits)[0].tolist() if i < WIDTH}


def valid_text(tok) -> list[int]:
    return tok('{"name": "ab", "age": 42, "kind": "dog"}')["input_ids"] + [tok.eos_token_id]


@pytest.mark.parametrize(
    "kind,text,words",
    [
        ("regex", "a[", "unclosed character class"),
        ("json_schema", '{"type": "object", "not": {}}', "not"),
        ("json_schema", "[1,", "not valid JSON"),
        ("json_schema", "3", "must be a JSON object"),
        ("ebnf", "root ::= (", "ebnf"),
        ("regex", "  ", "empty"),
        ("yaml", "a: 1", "unknown kind"),
    ],
)
def test_a_bad_constraint_is_refused_naming_the_problem(engine, kind, text, words):
    with pytest.raises(InvalidRequest, match=words):
        engine.compile(OutputConstraint(kind, text))


def test_each_distinct_constraint_compiles_once(engine):
    before = engine.compiles
    regex = OutputConstraint("regex", "[0-9]{3}-compiled-once")
    for _ in range(3):
        engine.compile(regex)
        engine.constraint(regex, WIDTH)
    assert engine.compiles == before + 1
    engine.compile(OutputConstraint("regex", "[0-9]{3}-another"))
    assert engine.compiles == before + 2


def test_allowed_along_any_path_equals_a_fresh_matcher(tok, engine):
    """The matcher moves between paths by rolling back only what they do not
    share; any order of paths must give what a fresh matcher gives."""
    grammar = engine.compile(JSON)
    c = engine.constraint(JSON, WIDTH)
    ids = valid_text(tok)
    rng = random.Random(0)
    paths = [ids[:n] for n in range(len(ids))] + [ids[: rng.randrange(len(ids))] + [rng.randrange(384)]
                                                 for _ in range(30)]
    rng.shuffle(paths)
    for path in paths:
        want = fresh_allowed(tok, grammar, path)
        got = c.allowed(path)
        if want is None:
            assert got is None, path
        else:
            assert set(torch.nonzero(got).flatten().tolist()) == want, path


def test_commit_moves_the_state_and_refuses_a_forbidden_token(tok, engine):
    grammar = engine.compile(JSON)
    c = engine.constraint(JSON, WIDTH)
    ids = valid_text(tok)
    c.allowed(ids[:5])  # a tentative walk first: commit must start from the committed state
    c.commit(ids[:3])
    assert set(torch.nonzero(c.allowed([])).flatten().tolist()) == fresh_allowed(tok, grammar, ids[:3])
    bad = next(t for t in range(384) if not c.allowed([])[t])
    with pytest.raises(InvalidRequest, match="break the output constraint"):
        c.commit([bad])
    c.commit(ids[3:-1])  # the whole object: only EOS is left
    assert torch.nonzero(c.allowed([])).flatten().tolist() == [tok.eos_token_id]
    c.commit(ids[-1:] + [5, 6])  # EOS, then a bonus past the end: ignored, not an error


def test_tree_masks_are_the_masks_of_each_nodes_path(tok, engine):
    grammar = engine.compile(JSON)
    c = engine.constraint(JSON, WIDTH)
    ids = valid_text(tok)
    c.commit(ids[:4])
    rest = ids[4:]
    forbidden = next(t for t in range(384) if fresh_allowed(tok, grammar, ids[:4] + [t]) is None)
    # root -> a, b (siblings); a -> c; b -> forbidden -> anything
    tokens = [rest[0], forbidden, rest[1], 7]
    parents = [-1, -1, 0, 1]
    masks = c.tree_masks(tokens, parents)
    assert masks.shape == (5, WIDTH)
    # The rows of the forbidden node and of its child are never read (no path
    # through it is kept): left open.
    paths = [[], [rest[0]], None, [rest[0], rest[1]], None]
    for row, path in enumerate(paths):
        if path is None:
            assert masks[row].all()
            continue
        want = fresh_allowed(tok, grammar, ids[:4] + path)
        assert set(torch.nonzero(masks[row]).flatten().tolist()) == want, row
        assert not masks[row, 384:].any()  # padding ids are never allowed


def test_masked_logits_forbid_exactly_the_disallowed_ids():
    logits = torch.randn(3, WIDTH + 8)  # logits wider than the masks: a padded table
    masks = torch.rand(3, WIDTH) > 0.5
    out = apply_masks(logits, masks)
    assert torch.equal(torch.isinf(out[:, :WIDTH]), ~masks)
    assert torch.isinf(out[:, WIDTH:]).all()
    assert torch.equal(out[:, :WIDTH][masks], logits[:, :WIDTH][masks])


def test_forced_tokens_are_the_only_continuation(tok, engine):
    grammar = engine.compile(JSON)
    c = engine.constraint(JSON, WIDTH)
    forced = c.forced([])
    assert tok.decode(forced) == '{"name": '
    # Each forced token is one the grammar allows where it stands.
    for n in range(len(forced)):
        assert forced[n] in fresh_allowed(tok, grammar, forced[:n])


def test_matchers_die_with_their_sessions(engine):
    gc.collect()
    before = live_matchers()
    held = [engine.constraint(JSON, WIDTH) for _ in range(5)]
    assert live_matchers() == before + 5
    del held
    gc.collect()
    assert live_matchers() == before


def chain(tokens, sampled=False):
    d = Draft(list(tokens), list(range(-1, len(tokens) - 1)))
    if sampled:
        d.row_dists = [([t], [1.0]) for t in tokens] + [([], [])]
        d.confidences = [0.5] * len(tokens)
    return d


@pytest.mark.parametrize("sampled", [False, True])
def test_an_ngram_draft_is_cut_at_its_first_forbidden_token_then_extended(tok, engine, sampled):
    c = engine.constraint(JSON, WIDTH)
    ids = valid_text(tok)
    c.commit(ids[:3])
    draft = chain(ids[3:6] + [ids[3]] + ids[6:8], sampled)  # the 4th token breaks the JSON
    assert c.valid_prefix(draft.tokens) == 3
    shape_draft(draft, c, room=12, cut=True)
    assert draft.tokens[:3] == ids[3:6]
    forced = c.forced(ids[3:6])
    assert draft.tokens[3:] == forced[: 12 - 3]
    assert draft.forced_nodes == list(range(3, len(draft.tokens))) and draft.tail == len(draft.tokens) - 3
    assert draft.parents == list(range(-1, len(draft.tokens) - 1))
    if sampled:
        # One row per node plus the leaf's; a forced node's parent row is its one-point q.
        assert len(draft.row_dists) == len(draft.tokens) + 1 and draft.row_dists[-1] == ([], [])
        assert all(draft.row_dists[n] == ([draft.tokens[n]], [1.0]) for n in draft.forced_nodes)
        assert len(draft.confidences) == len(draft.tokens)


def test_the_forced_tail_keeps_to_its_room_and_skips_trees(tok, engine):
    c = engine.constraint(JSON, WIDTH)
    assert len(c.forced([])) > 3
    d = chain([])
    assert add_forced(d, c, 2) == 2 and d.tokens == c.forced([])[:2]
    assert add_forced(chain([]), c, 0) == 0
    tree = Draft([91, 2], [-1, -1])
    assert add_forced(tree, c, 10) == 0 and tree.tokens == [91, 2]
    cut = chain([91, 2])
    cut_forbidden(cut, c)  # a tree-less chain of allowed tokens stays whole
    assert cut.tokens == [91, 2] if c.valid_prefix([91, 2]) == 2 else len(cut.tokens) < 2


def test_records_count_forced_nodes_and_learn_without_the_tail():
    draft = Draft([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3], confidences=[0.9, 1.0, 0.4, 1.0, 1.0],
                  forced_nodes=[1, 3, 4], tail=2)
    verdict = Verdict([0, 1, 2, 3], [1, 2, 3, 4, 9])
    stats = Stats(num_speculative_tokens=3)
    record = stats.observe_cycle(draft, verdict, 5.0)
    assert (stats.forced_tokens, stats.forced_accepted) == (3, 2)
    learned = record.drafted()
    assert learned.draft.tokens == [1, 2, 3] and learned.verdict.path == [0, 1, 2]
    assert learned.verdict.tokens == [1, 2, 3, 4]  # the kept path and the token after it
    assert isinstance(learned, CycleRecord) and record.drafted() is not record
    plain = CycleRecord(0, Draft([1], [-1]), Verdict([0], [1, 2]), 1.0)
    assert plain.drafted() is plain


def test_sampling_params_check_their_constraint():
    with pytest.raises(InvalidRequest, match="unknown kind"):
        SamplingParams(constraint=OutputConstraint("xml", "<a/>")).validate()
    assert SamplingParams(constraint=OutputConstraint("json_object")).validate().constraint.kind == "json_object"
