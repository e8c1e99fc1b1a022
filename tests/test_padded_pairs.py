"""Padded-vocabulary pairs through the real services: a drafter and a target
with the SAME tokenizer (384 tokens) but embedding tables of different sizes,
both padded past the tokenizer (as Qwen2.5-0.5B's 151,936 rows against
Qwen2.5-7B's 152,064), in both directions. Their padding rows are random, not
suppressed, so the target really emits padding ids - also ids the smaller
drafter's table does not have - and the bigger drafter really puts mass on ids
the target does not have (drafter_svc/vocab.py).

Greedy output equals target-only greedy decoding (chains and trees, either
direction); sampled output follows the target's exact law (the joint-law test
of tests/test_sampling_lossless.py on a padded pair).
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from drafter_svc.config import DrafterConfig
from drafter_svc.core import Drafter
from specd.local_stack import Stack
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams
from specd_core.runtime.models import load_model, load_tokenizer
from specd_core.runtime.propose_call import ProposeCall
from tests.test_greedy_exact import assert_same_or_near_tie, prompts, reference
from tests.test_sampling_lossless import N, check_stream_law, exact_joint, null_threshold, tv
from tests.tiny_models import VOCAB, build_padded_pair

pytestmark = pytest.mark.services

SMALL, BIG = 400, 448  # embedding rows; the tokenizer has VOCAB = 384 tokens
PROMPTS = 4


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """direction -> (target_dir, drafter_dir): "smaller" = a drafter with fewer
    rows than the target (448 vs 400), "bigger" = the other way round."""
    root = tmp_path_factory.mktemp("padded")
    return {
        "smaller": build_padded_pair(root / "smaller", "llama", BIG, SMALL),
        "bigger": build_padded_pair(root / "bigger", "llama", SMALL, BIG),
    }


@pytest.fixture(scope="module")
def padded_stacks(padded):
    with ThreadPoolExecutor(2) as pool:
        started = {k: pool.submit(Stack, t, d) for k, (t, d) in padded.items()}
    running = {k: f.result() for k, f in started.items() if f.exception() is None}
    try:
        for f in started.values():
            f.result()
        yield running
    finally:
        for s in running.values():
            s.stop()


def _greedy_cases(padded, direction):
    target_dir, _ = padded[direction]
    model, tok = load_model(target_dir, "cpu"), load_tokenizer(target_dir)
    return [(p, *reference(model, p)) for p in prompts(tok, PROMPTS)]


@pytest.mark.parametrize("direction", ["smaller", "bigger"])
def test_greedy_chains_equal_target_only(direction, padded, padded_stacks):
    cases = _greedy_cases(padded, direction)
    # The target emits padding ids (past the tokenizer), and - smaller drafter -
    # ids past the drafter's table: the cases this module is about.
    emitted = {t for _, want, _ in cases for t in want}
    assert any(t >= VOCAB for t in emitted)
    if direction == "smaller":
        assert any(t >= SMALL for t in emitted)
    accepted = 0
    for n, (p, want, gaps) in enumerate(cases):
        for k in (2, 4):
            got, last = padded_stacks[direction].generate(
                prompt_token_ids={"ids": p}, max_new_tokens=len(want), num_speculative_tokens=k
            )
            assert_same_or_near_tie(got, want, gaps, f"{direction} prompt {n} K={k}")
            accepted += last.stats.accepted_tokens
    assert accepted > 0


TREES = [{"branching": [3, 2, 1]}, {"node_budget": 8, "max_depth": 4, "top_k": 3}]


@pytest.mark.parametrize("direction", ["smaller", "bigger"])
@pytest.mark.parametrize("tree", TREES, ids=["static321", "dynamic8"])
def test_greedy_trees_equal_target_only(direction, tree, padded, padded_stacks):
    accepted = 0
    for n, (p, want, gaps) in enumerate(_greedy_cases(padded, direction)):
        got, last = padded_stacks[direction].generate(prompt_token_ids={"ids": p}, max_new_tokens=len(want), tree=tree)
        assert_same_or_near_tie(got, want, gaps, f"{direction} tree {tree} prompt {n}")
        accepted += last.stats.accepted_tokens
    assert accepted > 0


def test_bigger_drafter_sends_q_over_the_targets_ids_only(padded):
    """In-process: the bigger drafter's sampled q (what travels to the verifier)
    holds only ids below the target's rows and sums to 1, although its own
    distribution puts mass past them; without target_vocab_size it does not."""
    _, drafter_dir = padded["bigger"]
    core = Drafter(DrafterConfig(model_dir=drafter_dir, device="cpu"))
    params = SamplingParams(temperature=1.0, seed=3)
    with torch.no_grad():
        full = torch.softmax(core.model(torch.tensor([[40, 41, 42]])).logits[0, -1], -1)
    assert float(full[SMALL:].sum()) > 0.01  # the padding rows really carry mass
    core.open_session("padded", [40, 41, 42], params, target_vocab_size=SMALL)
    core.open_session("own", [40, 41, 42], params)
    outside = 0
    for _ in range(20):
        for sid in ("padded", "own"):
            tree = core.propose(ProposeCall(sid, [], [], DraftShape.chain(3, 8))).tree
            ids = [i for row, _ in tree.row_dists for i in row]
            if sid == "padded":
                assert all(i < SMALL for i in ids + tree.tokens)
                assert all(abs(sum(p) - 1) < 1e-4 for row, p in tree.row_dists if row)
            else:
                outside += any(i >= SMALL for i in ids)
            core.close_session(sid)
            core.open_session(sid, [40, 41, 42], params, target_vocab_size=SMALL if sid == "padded" else 0)
    assert outside > 0


SAMPLING = [
    # (direction, prompt, temperature, top_p, top_k, draft): prompts whose exact
    # joint puts 21% of its mass on sequences with a padding id. A chain of the
    # Qwen2.5-style direction (the drafter's table is the smaller one); trees and
    # the other direction meet the same rules with the same q and are checked in
    # greedy above, and the bigger drafter's q by its own test.
    ("smaller", [40, 41, 42, 43, 44], 1.0, 1.0, 6, dict(num_speculative_tokens=2)),
]


@pytest.mark.statistical
@pytest.mark.parametrize("direction,prompt,temperature,top_p,top_k,draft", SAMPLING,
                         ids=["smaller-chain-T1"])
def test_sampling_matches_target(direction, prompt, temperature, top_p, top_k, draft, padded, padded_stacks):
    """The exact-joint test of tests/test_sampling_lossless.py on a padded pair:
    the support includes padding ids (the target's extra ids come from the
    residual, q being 0 there)."""
    target_dir, drafter_dir = padded[direction]
    params = SamplingParams(temperature, top_p, top_k)
    joint = exact_joint(target_dir, prompt, params)
    assert sum(v for k, v in joint.items() if any(t >= VOCAB for t in k)) > 0.1
    threshold = null_threshold(joint, N)
    drafter_joint = exact_joint(drafter_dir, prompt, params)
    assert tv(joint, {k: v * N for k, v in drafter_joint.items()}, N) > 2 * threshold
    check_stream_law(padded_stacks[direction], prompt, joint, threshold,
                     dict(temperature=temperature, top_p=top_p, top_k=top_k, **draft))
