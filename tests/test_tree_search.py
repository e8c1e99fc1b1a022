"""benchmarks/tree_search.py: the replay that scores trees must be the verifier's
own greedy rule (checked against the real services), and the search must find
the branch a chain misses."""
import pytest
import torch

from benchmarks.tree_search import bfs_paths, candidates, chain, grow, measure_ranks, tokens_per_cycle
from specd_core.rules.draft_shape import DraftShape
from specd_core.runtime.models import load_model, load_tokenizer
from tests.test_greedy_exact import prompts


@pytest.mark.unit
def test_replay_by_hand():
    # Tokens 1..7 ranked 0,0,1,0,0,0,0. Chain of 2: keep t1,t2 (+t3) | keep t4,t5 (+t6) | t7 is last: 2 cycles
    # of 3, then one of 1 (t7 emitted, nothing to keep) -> 7 tokens / 3 cycles.
    r = [[9, 0, 0, 1, 0, 0, 0, 0]]
    assert tokens_per_cycle(r, chain(2)) == 7 / 3
    # t3's rank 1 falls at depth 3 of the first cycle, where a depth-1 branch is no help.
    assert tokens_per_cycle(r, chain(2) | {(1,)}) == 7 / 3
    # Ranks 1,0,0: a chain of 3 misses at once (1 token), then keeps t2 (+t3): 4 tokens / 2 cycles;
    # a branch on the second choice keeps t1..t3 (+t4) in one cycle.
    r = [[9, 1, 0, 0, 0]]
    assert tokens_per_cycle(r, chain(3)) == 2.0
    assert tokens_per_cycle(r, chain(3) | {(1,), (1, 0), (1, 0, 0)}) == 4.0


@pytest.mark.unit
def test_candidates_keep_ranks_contiguous():
    tree = frozenset({(0,), (0, 0)})
    assert set(candidates(tree, max_rank=4, max_depth=3)) == {(1,), (0, 1), (0, 0, 0)}
    assert (0, 0, 0) not in candidates(tree, 4, max_depth=2)


@pytest.mark.unit
def test_search_finds_the_branch_a_chain_misses():
    # The drafter's first choice is right 60% of the time, its second 35%:
    # a second child at depth 1 beats deepening a chain.
    g = torch.Generator().manual_seed(0)
    ranks = [torch.multinomial(torch.tensor([0.6, 0.35, 0.05]), 200, replacement=True, generator=g).tolist()
             for _ in range(20)]
    best = grow(ranks, [3])[3]
    assert (1,) in best
    assert tokens_per_cycle(ranks, best) > tokens_per_cycle(ranks, chain(3))
    # The paths are valid DraftShape paths (parents and elder siblings first).
    DraftShape(paths=tuple(map(tuple, bfs_paths(best)))).validate(64, 16)


@pytest.mark.services
def test_replay_equals_the_services(pairs, stacks):
    """Tokens per cycle replayed from measured ranks == what the real verifier
    did, for a chain and a path tree (fp32, greedy)."""
    target_dir, drafter_dir = pairs["llama"]
    target, drafter = load_model(target_dir, "cpu"), load_model(drafter_dir, "cpu")
    ps = prompts(load_tokenizer(target_dir), 6)
    n = 20
    ranks = measure_ranks(target, drafter, [torch.tensor(p) for p in ps], n)
    for tree in (chain(3), frozenset({(0,), (1,), (0, 0), (0, 1), (0, 0, 0)})):
        paths = bfs_paths(tree)
        tokens = cycles = 0
        replayed = []
        for p, r in zip(ps, ranks):
            ids, last = stacks["llama"].generate(prompt_token_ids={"ids": p}, max_new_tokens=n,
                                                 tree={"paths": [{"ranks": x} for x in paths]})
            if len(ids) < n:
                continue        # stopped at EOS: the replay does not model that
            tokens += last.stats.accepted_tokens + last.stats.cycles
            cycles += last.stats.cycles
            replayed.append(r)
        assert len(replayed) >= 3
        assert tokens / cycles == tokens_per_cycle(replayed, tree), paths
