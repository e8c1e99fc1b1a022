"""A token tree verified in ONE forward equals decoding each path sequentially, and
compacting the KV cache to the accepted path equals having decoded that path.

Tiny random-init Llama and Qwen2 (built in-test, no hub), each with the eager and
the sdpa attention implementation: the 4D float mask from `tree_attention` is used
by HF as-is (added to the attention scores), so both must honour it.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specd_core.rules.tree import (
    TokenTree,
    compaction_indices,
    path_to,
    paths_to_parents,
    static_tree_paths,
    validate_tree,
)
from specd_core.runtime.tree_tensors import compact_cache, tree_attention

pytestmark = pytest.mark.unit

VOCAB = 100
PROMPT = [11, 42, 7, 93, 5, 64, 23]
ATOL = 1e-4


def _model(family: str, attn: str):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    with torch.no_grad():  # peaked logits, so that a wrong mask moves them visibly
        model.get_output_embeddings().weight.mul_(10.0)
    model.set_attn_implementation(attn)
    return model.eval()


MODELS = [(f, a) for f in ("llama", "qwen2") for a in ("eager", "sdpa")]


@pytest.fixture(scope="module", params=MODELS, ids=[f"{f}-{a}" for f, a in MODELS])
def model(request):
    return _model(*request.param)


def _random_tree(branching: list[int], seed: int) -> TokenTree:
    """Static shape, random tokens, siblings distinct."""
    g = torch.Generator().manual_seed(seed)
    paths = static_tree_paths(branching)
    parents = paths_to_parents(paths)
    tokens, used = [], {}
    for a in parents:
        while True:
            t = int(torch.randint(VOCAB, (), generator=g))
            if t not in used.setdefault(a, set()):
                used[a].add(t)
                tokens.append(t)
                break
    return validate_tree(tokens, parents, VOCAB, 64)


def _last_logits(model, ids: list[int]) -> torch.Tensor:
    """Reference: a fresh forward without cache; logits of the last position."""
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


def _prefill(model, ids: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return cache


def _tree_forward(model, cache, tree: TokenTree, root: int) -> torch.Tensor:
    """One forward of [root, nodes] after the cache; (N+1, V) logits."""
    past = cache.get_seq_length()
    mask, pos = tree_attention(tree, past, dtype=model.dtype)
    ids = torch.tensor([[root, *tree.tokens]])
    return model(input_ids=ids, cache=cache, use_cache=True, attention_mask=mask, position_ids=pos).logits[0]


def test_mask_and_positions_shape():
    tree = TokenTree((4, 5, 6), (-1, 0, -1))
    mask, pos = tree_attention(tree, 2)
    blocked = torch.finfo(torch.float32).min
    want = torch.tensor([
        # past past root n0 n1 n2
        [0, 0, 0, 1, 1, 1],   # root
        [0, 0, 0, 0, 1, 1],   # n0: root, itself
        [0, 0, 0, 0, 0, 1],   # n1: root, n0, itself
        [0, 0, 0, 1, 1, 0],   # n2: root, itself
    ], dtype=torch.float32) * blocked
    assert mask.shape == (1, 1, 4, 6) and torch.equal(mask[0, 0], want)
    assert pos.tolist() == [[2, 3, 4, 3]]
    empty_mask, empty_pos = tree_attention(TokenTree((), ()), 3, dtype=torch.bfloat16)
    assert empty_mask.shape == (1, 1, 1, 4) and empty_mask.dtype == torch.bfloat16
    assert not empty_mask.any() and empty_pos.tolist() == [[3]]


@torch.inference_mode()
@pytest.mark.parametrize("branching", [[3, 2, 1], [1, 1, 1], []], ids=["3-2-1", "chain", "root-only"])
def test_tree_logits_equal_sequential_paths(model, branching):
    tree = _random_tree(branching, seed=len(branching) + sum(branching))
    root = 17
    cache = _prefill(model, PROMPT)
    logits = _tree_forward(model, cache, tree, root)
    assert logits.shape == (len(tree.tokens) + 1, VOCAB)
    torch.testing.assert_close(logits[0], _last_logits(model, PROMPT + [root]), atol=ATOL, rtol=0)
    for i in range(len(tree.tokens)):
        seq = PROMPT + [root] + [tree.tokens[j] for j in path_to(tree, i)]
        torch.testing.assert_close(logits[i + 1], _last_logits(model, seq), atol=ATOL, rtol=0,
                                   msg=lambda m: f"node {i} path {path_to(tree, i)}: {m}")


def test_compaction_then_next_tree_equals_sequential(model):
    """Two tree cycles with compaction in between, as the verifier runs them:
    after each, keep [root + accepted path] (a deep non-first branch, an empty path,
    and a first-child chain whose rows are already in place) and check that the
    next forward sees exactly prompt + everything accepted so far."""
    tree = _random_tree([3, 2, 1], seed=3)
    paths = static_tree_paths([3, 2, 1])
    accepted_path = [paths.index(p) for p in [(2,), (2, 1), (2, 1, 0)]]
    assert path_to(tree, accepted_path[-1]) == accepted_path
    with torch.inference_mode():  # caches filled here hold inference tensors
        cache = _prefill(model, PROMPT)
        history = list(PROMPT)
        root = 17
        for path in (accepted_path, [], [0]):
            past = cache.get_seq_length()
            _tree_forward(model, cache, tree, root)
            keep = compaction_indices(path)
            compact_cache(cache, past, keep)
            history += [root] + [tree.tokens[i] for i in path]
            assert cache.get_seq_length() == len(history) == past + len(keep)
            root = (root * 7 + 3) % VOCAB        # next pending token
        # one more plain decode step on the compacted cache
        out = model(input_ids=torch.tensor([[root]]), cache=cache, use_cache=True).logits[0, -1]
        torch.testing.assert_close(out, _last_logits(model, history + [root]), atol=ATOL, rtol=0)


def test_compact_cache_outside_inference_mode():
    """A cache filled under no_grad (normal tensors) is compacted the same way, and
    bad keep lists are refused before anything is written."""
    model = _model("llama", "sdpa")
    tree = _random_tree([2, 2], seed=5)
    with torch.no_grad():
        cache = _prefill(model, PROMPT)
        _tree_forward(model, cache, tree, 9)
    before = cache.layers[0].keys.clone()
    for bad in ([-1, 2], [0, 2, 2], [2, 1], [0, len(tree.tokens) + 1]):
        with pytest.raises(ValueError):
            compact_cache(cache, len(PROMPT), bad)
    assert torch.equal(cache.layers[0].keys, before)
    keep = compaction_indices([1, 5])                      # node 1 then its second child (node 5)
    compact_cache(cache, len(PROMPT), keep)
    want = before[..., [*range(len(PROMPT)), *(len(PROMPT) + k for k in keep)], :]
    assert torch.equal(cache.layers[0].keys, want)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[30]]), cache=cache, use_cache=True).logits[0, -1]
        ref = _last_logits(model, PROMPT + [9, tree.tokens[1], tree.tokens[5], 30])
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
