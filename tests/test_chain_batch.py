"""The batched chain rule (specd_core/rules/chain_batch.py) and tree walk
(specd_core/rules/tree_batch.py) decide each chain or tree of a batch as they
decide it alone, agree with each other on chains, and never draw a token of
weight 0. Their laws are tested in tests/test_acceptance.py and
tests/test_tree.py (the pipelines, on the host rules and these)."""

from __future__ import annotations

import pytest
import torch

from specd_core.rules.chain_batch import ChainDraw, decide_chains, inverse_cdf, uniforms
from specd_core.rules.sampling import SamplingParams, logits_to_probs
from specd_core.rules.tree import TokenTree, children, path_to
from specd_core.rules.tree_batch import TreeDraw, decide_trees
from verifier_svc.batch import stacked_law

pytestmark = pytest.mark.unit

V = 40


def sparse_law(g: torch.Generator, must: int) -> tuple[list[int], list[float]]:
    """A draft law over 6 tokens including `must` (the drafted one), as a drafter sends it."""
    others = [t for t in torch.randperm(V, generator=g).tolist() if t != must][:5]
    ids = [must] + others
    w = torch.rand(len(ids), generator=g) + 0.05
    return ids, (w / w.sum()).tolist()


def random_chain(g: torch.Generator, row: int, sampled: bool) -> tuple[ChainDraw, torch.Tensor]:
    """A chain of 0-4 drafts whose tokens the target likes fairly often (so
    that every number of kept drafts occurs), its law's rows and its draw."""
    n = int(torch.randint(0, 5, (), generator=g))
    logits = torch.randn(n + 1, V, generator=g)
    logits[:, :3] += 4.0  # the target likes tokens 0-2, which the chains draft
    logits[:, 3] = -torch.inf  # a token the target never emits
    p = torch.softmax(logits, -1)
    tokens = [int(torch.randint(0, 4, (), generator=g)) for _ in range(n)]
    laws = [sparse_law(g, x) for x in tokens] if sampled else None
    return ChainDraw(row, tokens, laws, uniforms(n, g)), p


def batch_of(g: torch.Generator, make, count: int, sampled) -> tuple[list, list[torch.Tensor]]:
    """`count` drafts by make(g, row, sampled(i)), as the verifier stacks its
    sessions: each one's rows after the previous ones'."""
    draws, rows, row = [], [], 0
    for i in range(count):
        d, p = make(g, row, sampled(i))
        draws.append(d)
        rows.append(p)
        row += p.shape[0]
    return draws, rows


def test_a_batch_decides_each_chain_as_alone():
    """Sessions of different lengths, sampled and point-mass drafts, stacked as
    the verifier stacks them: each verdict equals the one the same chain gets
    alone with the same uniforms. Every number of kept drafts occurs, and no
    emitted token is one the target gives probability 0."""
    g = torch.Generator().manual_seed(11)
    kept_seen: set[tuple[int, int]] = set()
    for _ in range(60):
        draws, rows = batch_of(g, random_chain, 7, lambda i: i % 2 == 0)
        together = decide_chains(torch.cat(rows), draws).tolist()
        for d, p, (k, token) in zip(draws, rows, together):
            alone = decide_chains(p, [ChainDraw(0, d.tokens, d.q, d.u)]).tolist()
            assert alone == [[k, token]]
            assert 0 <= k <= len(d.tokens) and p[k, token] > 0
            kept_seen.add((len(d.tokens), k))
    assert {(4, k) for k in range(5)} <= kept_seen, sorted(kept_seen)


def test_a_draft_of_q_zero_is_rejected_and_the_residual_drawn():
    """A drafted token outside its sparse law could not have been drawn: rejected,
    and the emitted token comes from max(0, p - q): here only token 0 is left."""
    p = torch.tensor([[0.2, 0.8, 0.0], [0.5, 0.5, 0.0]])
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        draw = ChainDraw(0, [0], [([1], [1.0])], uniforms(1, g))
        assert decide_chains(p, [draw]).tolist() == [[0, 0]]


def test_inverse_cdf_never_picks_a_token_of_weight_zero():
    weights = torch.tensor([[0.0, 0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.5, 0.0, 0.0]])
    for u, want in [(0.0, [1, 3, 0]), (1.0 - 2.0**-53, [2, 3, 2]), (0.5, [2, 3, 2]), (0.29, [1, 3, 0])]:
        picked = inverse_cdf(weights.double(), torch.full((3,), u, dtype=torch.float64))
        assert picked.tolist() == want, u


def test_bad_draws_are_refused():
    p = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="needs 3 uniforms"):
        decide_chains(p, [ChainDraw(0, [1, 2], None, [0.5, 0.5])])
    with pytest.raises(ValueError, match="as many draft laws"):
        decide_chains(p, [ChainDraw(0, [1, 2], [([1], [1.0])], [0.5, 0.5, 0.5])])
    assert decide_chains(p, []).shape == (0, 2)


def test_the_verifier_stacks_each_sessions_law_with_its_own_parameters():
    """Sessions sharing temperature / top-k / top-p go through logits_to_probs
    together; the stacked rows equal each session's own, whatever the mix."""
    g = torch.Generator().manual_seed(5)
    params = [
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.2, top_k=5, seed=2),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=0.9, top_p=0.8, seed=4),
    ]
    logits = [torch.randn(r, V, generator=g) for r in (3, 1, 5, 2)]
    law = stacked_law(params, logits)
    own = torch.cat([logits_to_probs(lg, p) for p, lg in zip(params, logits)])
    torch.testing.assert_close(law, own, rtol=0, atol=0)
    same = stacked_law(params[::2], logits[::2])
    torch.testing.assert_close(same, torch.cat([logits_to_probs(lg, params[0]) for lg in logits[::2]]), rtol=0, atol=0)


def random_tree(g: torch.Generator, row: int, sampled: bool) -> tuple[TreeDraw, torch.Tensor]:
    """A tree of 0-7 nodes (each node's parent an earlier node or the root;
    siblings distinct), its law's rows and its draw."""
    n = int(torch.randint(0, 8, (), generator=g))
    parents: list[int] = []
    tokens: list[int] = []
    for i in range(n):
        parent = int(torch.randint(-1, i, (), generator=g))
        taken = {t for t, p in zip(tokens, parents) if p == parent}
        free = [t for t in range(5) if t not in taken]
        if not free:
            break
        parents.append(parent)
        tokens.append(free[int(torch.randint(0, len(free), (), generator=g))])
    n = len(tokens)
    logits = torch.randn(n + 1, V, generator=g)
    logits[:, :3] += 3.0
    logits[:, 3] = -torch.inf
    p = torch.softmax(logits, -1)
    tree = TokenTree(tuple(tokens), tuple(parents))
    laws = None
    if sampled:
        kids = children(tree)
        laws = []
        for r in range(n + 1):
            if not kids[r]:
                laws.append(([], []))
                continue
            ids = sorted({tokens[c] for c in kids[r]} | {7, 9})
            w = torch.rand(len(ids), generator=g) + 0.05
            laws.append((ids, (w / w.sum()).tolist()))
    return TreeDraw(row, tree, laws, uniforms(n, g)), p


def test_the_tree_walk_decides_a_chain_as_the_chain_rule():
    """On chains, the tree walk and the closed-form chain rule give the same
    verdicts from the same uniforms (sampled and point-mass drafts), in their
    CPU and their batched forms."""
    g = torch.Generator().manual_seed(12)
    for _ in range(40):
        draws, rows = batch_of(g, random_chain, 6, lambda i: i % 2 == 0)
        trees = [
            TreeDraw(d.row, TokenTree(tuple(d.tokens), tuple(range(-1, len(d.tokens) - 1))),
                     None if d.q is None else [*d.q, ([], [])], d.u)
            for d in draws
        ]
        law = torch.cat(rows)
        for batched in (False, True):  # a CPU's forms, a GPU's
            walked = decide_trees(law, trees, batched=batched).tolist()
            for (k, token), w in zip(decide_chains(law, draws, batched=batched).tolist(), walked):
                assert w[:2] == [k, token] and w[2 : 2 + k] == list(range(k)), (batched, w, k, token)


def test_a_batch_of_trees_decides_each_tree_as_alone():
    """Trees of 0-7 nodes, sampled and point-mass children, stacked: each
    verdict equals the one the same tree gets alone; the kept path is a path
    of the tree, and paths through later siblings and to depth 2 occur."""
    g = torch.Generator().manual_seed(13)
    later = deep = 0
    for _ in range(40):
        draws, rows = batch_of(g, random_tree, 6, lambda i: i % 2 == 0)
        together = decide_trees(torch.cat(rows), draws).tolist()
        for d, p, out in zip(draws, rows, together):
            alone = decide_trees(p, [TreeDraw(0, d.tree, d.q, d.u)]).tolist()[0]
            k, token, path = out[0], out[1], out[2 : 2 + out[0]]
            assert alone[: 2 + k] == out[: 2 + k]
            assert path == (path_to(d.tree, path[-1]) if path else [])
            row_of_emit = path[-1] + 1 if path else 0
            assert p[row_of_emit, token] > 0
            later += any(d.tree.parents[c] == d.tree.parents[c - 1] for c in path if c > 0)
            deep += k >= 2
    assert later > 0 and deep > 0, (later, deep)


def test_the_batched_walk_equals_the_walk_on_the_host():
    """A GPU walks every tree at once (batched rounds), a CPU each tree in
    Python (the law is on the host already): the same verdicts from the same
    uniforms, for sampled and point-mass trees of 0-7 nodes side by side."""
    g = torch.Generator().manual_seed(14)
    for _ in range(40):
        draws, rows = batch_of(g, random_tree, 6, lambda i: i % 3 != 0)
        law = torch.cat(rows)
        batched = decide_trees(law, draws, batched=True).tolist()
        on_host = decide_trees(law, draws, batched=False).tolist()
        assert [b[: 2 + b[0]] for b in batched] == [h[: 2 + h[0]] for h in on_host]


def test_the_batched_walk_reads_nothing_back():
    """The walk a GPU runs leaves its verdicts on the device: no read of
    tensor data by the host (the verifier reads them with the greedy
    sessions' argmaxes, once a step)."""
    from benchmarks.engine import counting, summarize

    g = torch.Generator().manual_seed(15)
    draws, rows = batch_of(g, random_tree, 5, lambda i: i % 2 == 0)
    law = torch.cat(rows)
    with counting() as (ops, reads):
        decide_trees(law, draws, batched=True)
        decide_chains(law, [ChainDraw(0, [1], None, [0.5, 0.5])], batched=True)
    assert summarize(ops.ops, reads)["syncs"] == 0, (ops.ops, reads)


def test_the_batched_chain_rule_equals_the_one_on_the_host():
    """A GPU decides chains by batched operations, a CPU in Python on the same
    numbers: the same verdicts from the same uniforms, sampled and point-mass
    drafts, chains of 0-4, side by side."""
    g = torch.Generator().manual_seed(16)
    for _ in range(40):
        draws, rows = batch_of(g, random_chain, 7, lambda i: i % 2 == 0)
        law = torch.cat(rows)
        assert decide_chains(law, draws, batched=True).tolist() == decide_chains(law, draws, batched=False).tolist()
