"""Greedy output through the real services equals target-only
`model.generate(do_sample=False)`, for 20 prompts x K in {1, 3, 5} x 2 families.

A divergence is tolerated only at a numerical near-tie that this test checks
itself: the reference's top-2 logit gap at that position is < 1e-4.
"""
import pytest
import torch

from specd_core.runtime.models import load_model, load_tokenizer
from tests.tiny_models import corpus_lines

pytestmark = pytest.mark.services

NEAR_TIE = 1e-4
MAX_NEW = 24


def prompts(tokenizer, n=20):
    lines = [l for l in corpus_lines() if len(l.strip()) > 20]
    step = len(lines) // n
    # Varying lengths: 1 to 4 source lines each.
    return [tokenizer("\n".join(lines[i * step: i * step + 1 + i % 4]))["input_ids"] for i in range(n)]


def reference(model, prompt_ids):
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_NEW,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    ids = out.sequences[0, len(prompt_ids):].tolist()
    gaps = [float(torch.topk(l[0], 2).values.diff().abs()) for l in out.logits]
    return ids, gaps


def assert_same_or_near_tie(got, want, gaps, context):
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert gaps[i] < NEAR_TIE, f"{context}: diverged at {i} ({a} != {b}), top-2 gap {gaps[i]:.2e}"
            return
    assert len(got) == len(want), f"{context}: length {len(got)} != {len(want)}"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_equals_target_only(family, pairs, stacks):
    target_dir, _ = pairs[family]
    model, tok = load_model(target_dir, "cpu"), load_tokenizer(target_dir)
    stack = stacks[family]
    accepted = 0
    for n, p in enumerate(prompts(tok)):
        want, gaps = reference(model, p)
        for k in (1, 3, 5):
            got, last = stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW,
                                       num_speculative_tokens=k)
            assert_same_or_near_tie(got, want, gaps, f"{family} prompt {n} K={k}")
            assert last.stats.num_speculative_tokens == k
            accepted += last.stats.accepted_tokens
    # The check is only meaningful if drafts were really kept (and rejected).
    assert accepted > 0


def test_concurrent_streams_share_the_replicas_exactly(pairs, stacks):
    """8 Generate streams at once (different prompts and K) multiplex over the same
    Propose/Verify streams; each still equals its target-only output."""
    concurrent_streams_equal_target_only(
        pairs, stacks, "qwen2", 8, lambda i: {"num_speculative_tokens": 1 + i % 5}, "concurrent stream")


def concurrent_streams_equal_target_only(pairs, stacks, family, n, fields, label):
    """n Generate streams at once on the family's stack, stream i with
    fields(i); each equals its prompt's target-only greedy output. Returns
    each stream's (ids, last response)."""
    from concurrent.futures import ThreadPoolExecutor

    target_dir, _ = pairs[family]
    model, tok = load_model(target_dir, "cpu"), load_tokenizer(target_dir)
    ps = prompts(tok, n)
    wants = [reference(model, p) for p in ps]
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda i: stacks[family].generate(
            prompt_token_ids={"ids": ps[i]}, max_new_tokens=MAX_NEW, **fields(i)), range(n)))
    for i, ((got, _), (want, gaps)) in enumerate(zip(results, wants)):
        assert_same_or_near_tie(got, want, gaps, f"{label} {i} {fields(i)}")
    return results


# What each of 32 concurrent streams asks for: every way a session drafts.
MIXED = [
    dict(speculative_method="off"),
    dict(num_speculative_tokens=1),
    dict(num_speculative_tokens=3),
    dict(num_speculative_tokens=5, adaptive_speculation=True),
    dict(speculative_method="ngram", num_speculative_tokens=3),
    dict(tree={"branching": [2, 2, 1]}),
    dict(tree={"node_budget": 8, "max_depth": 4, "top_k": 3}),
    dict(num_speculative_tokens=3, pipeline_drafting=True, pipeline_alternatives=2),
]


def test_32_mixed_streams_advancing_in_steps_equal_target_only(pairs, stacks):
    """32 streams at once over one drafter and one verifier, mixing plain
    decoding, chains, adaptive depth, n-grams, static and dynamic trees and
    pipelined drafting: their calls ride in shared per-step messages, and each
    output still equals its target-only greedy output."""
    results = concurrent_streams_equal_target_only(
        pairs, stacks, "llama", 32, lambda i: MIXED[i % len(MIXED)], "stream")
    for i, (_, last) in enumerate(results):
        assert last.stats.method == MIXED[i % len(MIXED)].get("speculative_method", "draft_model")
    assert sum(last.stats.accepted_tokens for _, last in results) > 0


TREES = [{"branching": [3, 2, 1]}, {"branching": [2, 2, 2, 1]},
         {"paths": [{"ranks": r} for r in ([0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0])]},
         {"node_budget": 8, "max_depth": 4, "top_k": 3}, {"node_budget": 16, "max_depth": 6, "top_k": 4}]


@pytest.mark.parametrize("tree", TREES, ids=["static321", "static2221", "paths", "dynamic8", "dynamic16"])
def test_greedy_trees_equal_target_only(tree, pairs, stacks):
    """Tree drafts (static and dynamic), 20 prompts each."""
    target_dir, _ = pairs["llama"]
    model, tok = load_model(target_dir, "cpu"), load_tokenizer(target_dir)
    accepted = 0
    for n, p in enumerate(prompts(tok)):
        want, gaps = reference(model, p)
        got, last = stacks["llama"].generate(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW, tree=tree)
        assert_same_or_near_tie(got, want, gaps, f"tree {tree} prompt {n}")
        accepted += last.stats.accepted_tokens
    assert accepted > 0
