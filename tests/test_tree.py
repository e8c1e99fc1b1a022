"""Token trees: validation, shapes, and the tree acceptance rules are lossless.

The statistical tests follow tests/test_acceptance.py (same statistic, same 1e-6
false-alarm thresholds, imported from there): a toy first-order Markov "LM" over
V=6 (logit tables T[prev] -> next, row BOS for the first token). Each cycle builds a
depth-2 tree with branching [2, 2] below the pending token, builds the verifier's p
rows (N+1, V) for [root, nodes] (a node's row is the table row of its own token:
the toy LM is first-order Markov), calls the rule and appends the emitted tokens;
sequences are truncated to L=3 tokens, so a cycle keeping a full path puts its
bonus token inside the window. The empirical law of the 216 sequences is compared
with the exact target law by chi-square.

Children: the drafter's top-2 (deterministic rule), or 2 tokens drawn WITHOUT
replacement from the drafter's q (sampled rule; fewer when q's support is smaller,
as a real drafter could not draw more distinct tokens). The same machinery is then
run on three deliberately wrong rules, each of which must land above the threshold.

Run with `-s` to see the statistics.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from specd_core.errors import InvalidRequest
from specd_core.rules.acceptance import accept_tree_deterministic, accept_tree_greedy, accept_tree_sampled, residual
from specd_core.rules.chain_batch import uniforms
from specd_core.rules.sampling import SamplingParams, logits_to_probs, sample
from specd_core.rules.tree_batch import TreeDraw, decide_trees
from specd_core.rules.tree import (
    TokenTree,
    TreeAcceptance,
    children,
    compaction_indices,
    depth,
    path_to,
    paths_to_parents,
    static_tree,
    static_tree_paths,
    validate_tree,
)
from tests.test_acceptance import BOS, GoodnessOfFit, L, V, exact_sequence_law, goodness_of_fit
from tests.test_acceptance import model_tables as acceptance_tables

pytestmark = pytest.mark.unit

N_TRIALS = 15_000        # sequences per correct rule
N_TRIALS_WRONG = 4_000   # per wrong rule (fewer trials only makes failing harder)
PLAIN = SamplingParams(temperature=1.0)
NUCLEUS = SamplingParams(temperature=0.7, top_p=0.8)


# ---------------------------------------------------------------- validation and shapes

@pytest.mark.parametrize("tokens,parents,needle", [
    ([1, 2], [-1], "2 tokens but 1 parents"),
    ([1] * 5, [-1, 0, 1, 2, 3], "at most 4"),
    ([1, 2], [-1, 1], "node 1 has parent 1"),            # not topological (self)
    ([1, 2, 3], [-1, 2, 0], "node 1 has parent 2"),      # parent after child
    ([1, 2], [-2, 0], "node 0 has parent -2"),
    ([1, 6], [-1, 0], "outside the vocabulary [0, 6)"),
    ([-1], [-1], "outside the vocabulary"),
    ([3, 4, 3], [-1, -1, -1], "nodes 0 and 2 are both children of the root with token 3"),
    ([3, 4, 5, 4], [-1, 0, 0, 0], "nodes 1 and 3 are both children of node 0 with token 4"),
    ([1.5], [-1], "must be integers"),
])
def test_validate_tree_errors(tokens, parents, needle):
    with pytest.raises(InvalidRequest) as e:
        validate_tree(tokens, parents, vocab_size=V, max_nodes=4)
    assert needle in str(e.value), str(e.value)


def test_validate_tree_ok_and_empty():
    assert validate_tree([], [], V, 0) == TokenTree((), ())
    tree = validate_tree(torch.tensor([3, 3, 4]), np.array([-1, 0, 0]), V, 3)  # cousins may repeat tokens
    assert tree == TokenTree((3, 3, 4), (-1, 0, 0)) and all(type(t) is int for t in tree.tokens)


def test_static_tree_paths_and_parents():
    paths = static_tree_paths([3, 2, 1])
    assert paths[:5] == [(0,), (1,), (2,), (0, 0), (0, 1)]
    assert len(paths) == 3 + 6 + 6 and paths[-1] == (2, 1, 0)
    assert static_tree([2]) == [[0], [1]] and static_tree_paths([]) == []
    parents = paths_to_parents(paths)
    for i, p in enumerate(paths):  # every node's parent is its path minus the last rank
        assert parents[i] == (-1 if len(p) == 1 else paths.index(p[:-1]))
    tree = TokenTree(tuple(range(len(paths))), tuple(parents))
    assert depth(tree) == [len(p) for p in paths]
    assert children(tree)[0] == [0, 1, 2] and children(tree)[1] == [3, 4] and children(tree)[4] == [9]
    assert [paths[i] for i in path_to(tree, 14)] == [(2,), (2, 1), (2, 1, 0)]
    assert compaction_indices(path_to(tree, 14)) == [0, 3, 9, 15] and compaction_indices([]) == [0]
    assert paths_to_parents([[0], [1], [1, 0]]) == [-1, -1, 1]   # irregular, lists accepted
    with pytest.raises(ValueError):
        paths_to_parents([(0, 0), (0,)])                        # child before parent


# ---------------------------------------------------------------- greedy (exact)

def _logits(argmaxes: list[int], vocab: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(argmaxes))
    out = torch.randn(len(argmaxes), vocab, generator=g)
    out[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return out


# root -> {5 (node 0), 2 (node 1)}; node 0 -> {1 (node 2), 3 (node 3)}; node 1 -> {4 (node 4)}
GREEDY_TREE = TokenTree((5, 2, 1, 3, 4), (-1, -1, 0, 0, 1))


@pytest.mark.parametrize("argmaxes,path,tokens", [
    ([2, 0, 4, 0, 0, 6], [1, 4], [2, 4, 6]),   # second branch, then its leaf: bonus from the leaf's row
    ([5, 3, 0, 0, 1, 0], [0, 3], [5, 3, 1]),   # first branch, its second child (a leaf): bonus 1
    ([5, 6, 0, 0, 0, 0], [0], [5, 6]),         # descends, then mismatch: argmax of node 0's row
    ([0, 1, 2, 3, 4, 5], [], [0]),             # no child matches at the root
])
def test_accept_tree_greedy(argmaxes, path, tokens):
    out = accept_tree_greedy(_logits(argmaxes), GREEDY_TREE)
    assert (out.path, out.tokens, out.num_accepted) == (path, tokens, len(path))


def test_greedy_is_the_limit_of_both_sampling_rules():
    """With one-hot p (greedy) both sampling rules give the greedy result with certainty."""
    logits = _logits([5, 3, 0, 0, 1, 0])
    p = logits_to_probs(logits, SamplingParams())
    q = torch.full((6, 7), 1.0 / 7)
    g = torch.Generator().manual_seed(0)
    want = accept_tree_greedy(logits, GREEDY_TREE)
    for _ in range(20):
        for got in (accept_tree_sampled(p, GREEDY_TREE, q, g), accept_tree_deterministic(p, GREEDY_TREE, g)):
            assert (got.path, got.tokens) == (want.path, want.tokens)


def test_empty_tree_samples_root_row():
    empty = TokenTree((), ())
    p = torch.tensor([[0.0, 0.5, 0.5]])
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        assert accept_tree_sampled(p, empty, torch.zeros(1, 3), g).tokens[0] in (1, 2)
        assert accept_tree_deterministic(p, empty, g).path == []
    assert accept_tree_greedy(torch.tensor([[0.0, 2.0, 1.0]]), empty) == TreeAcceptance([], [1])
    with pytest.raises(ValueError):
        accept_tree_greedy(torch.zeros(2, 3), empty)  # rows != N+1


# ---------------------------------------------------------------- toy models and trees

def model_tables():
    """(target, sampling drafter, top-k drafter) logits, each (V+1, V): the chain
    tests' tables (tests/test_acceptance.py). The sampling drafter's even rows are
    anti-correlated with the target (children often rejected, so second children
    and all-rejected nodes are common); the top-k drafter is a noisy copy (its
    top-2 often, not always, holds the target's favourite)."""
    return acceptance_tables(seed=4, argmax_noise=0.7)


def tree_from_children(root_ctx: int, pick: Callable[[int], list[int]], branching=(2, 2)) -> TokenTree:
    """BFS build: node tokens chosen by pick(context token) (at most b per level)."""
    tokens, parents = [], []
    frontier = [(-1, root_ctx)]
    for b in branching:
        nxt = []
        for parent, ctx in frontier:
            for t in pick(ctx)[:b]:
                nxt.append((len(tokens), t))
                tokens.append(t)
                parents.append(parent)
        frontier = nxt
    return TokenTree(tuple(tokens), tuple(parents))


def topk_children(q_logits: torch.Tensor) -> Callable[[int], TokenTree]:
    top = torch.argsort(q_logits, dim=-1, descending=True).tolist()
    trees = {c: tree_from_children(c, lambda ctx: top[ctx]) for c in range(V + 1)}
    return lambda last: trees[last]


class WithoutReplacement:
    """Draw 2 distinct tokens from q[row] (exact inverse CDF, seeded numpy uniforms):
    the first from q, the second from q without the first, renormalised."""

    def __init__(self, q_table: torch.Tensor, seed: int):
        q = q_table.double().numpy()
        self.q = q
        self.cum = {}
        for r in range(q.shape[0]):
            self.cum[(r, None)] = np.cumsum(q[r]).tolist()
            for x in range(V):
                rest = q[r].copy()
                rest[x] = 0
                if rest.sum() > 0:
                    self.cum[(r, x)] = np.cumsum(rest / rest.sum()).tolist()
        self.rng = np.random.default_rng(seed)
        self.u: list[float] = []

    def _draw(self, cum: list[float]) -> int:
        if not self.u:
            self.u = self.rng.random(1 << 16).tolist()
        return min(bisect.bisect_right(cum, self.u.pop() * cum[-1]), V - 1)

    def __call__(self, row: int) -> list[int]:
        x1 = self._draw(self.cum[(row, None)])
        rest = self.cum.get((row, x1))
        return [x1] if rest is None else [x1, self._draw(rest)]


class RowCache(dict):
    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def __missing__(self, key):
        rows = self[key] = self.table[list(key)]
        return rows


# A tree drafter: last token -> tree. A rule as the pipeline calls it: (p, tree, q, g).
Rule = Callable[[torch.Tensor, TokenTree, "torch.Tensor | None", torch.Generator], TreeAcceptance]


@dataclass
class PipelineResult:
    counts: np.ndarray          # (V,)*L histogram of emitted sequences
    kept_hist: np.ndarray       # (3,) cycles by accepted path length
    later_sibling: float        # fraction of cycles whose path holds a non-first child


def run_pipeline(p_table, make_tree, rule: Rule, q_table, n_trials: int, seed: int) -> PipelineResult:
    g = torch.Generator().manual_seed(seed)
    p_rows = RowCache(p_table)
    q_rows = RowCache(q_table) if q_table is not None else None
    counts = [0] * V**L
    kept = [0, 0, 0]
    later = cycles = 0
    for _ in range(n_trials):
        seq: list[int] = []
        last = BOS
        while len(seq) < L:
            tree = make_tree(last)
            key = (last, *tree.tokens)               # rows for [root, node0, ...]
            out = rule(p_rows[key], tree, q_rows[key] if q_rows is not None else None, g)
            assert out.path == (path_to(tree, out.path[-1]) if out.path else [])
            assert out.tokens[:-1] == [tree.tokens[i] for i in out.path]
            kept[len(out.path)] += 1
            later += any(tree.parents[i - 1] == tree.parents[i] for i in out.path if i > 0)
            cycles += 1
            seq += out.tokens
            last = seq[-1]
        counts[(seq[0] * V + seq[1]) * V + seq[2]] += 1
    return PipelineResult(np.array(counts).reshape((V,) * L), np.array(kept), later / cycles)


def run_pipeline_on_device(p_table, make_tree, q_table, n_trials: int, seed: int, batch: int = 1_500) -> PipelineResult:
    """run_pipeline with the verifier's batched tree walk (specd_core.rules.tree_batch):
    `batch` sequences in lock-step, each cycle ONE decide_trees call over all of
    them, their rows stacked as the verifier stacks its sessions'; q_table None:
    children chosen without sampling."""
    g = torch.Generator().manual_seed(seed)
    p_rows = RowCache(p_table)
    q_rows = RowCache(q_table) if q_table is not None else None
    counts = [0] * V**L
    kept = [0, 0, 0]
    later = cycles = 0
    for start in range(0, n_trials, batch):
        seqs: list[list[int]] = [[] for _ in range(min(batch, n_trials - start))]
        while live := [seq for seq in seqs if len(seq) < L]:
            draws, rows, row = [], [], 0
            for seq in live:
                tree = make_tree(seq[-1] if seq else BOS)
                key = (seq[-1] if seq else BOS, *tree.tokens)
                laws = None
                if q_rows is not None:
                    laws = [([x for x, v in enumerate(r) if v > 0], [v for v in r if v > 0]) for r in q_rows[key].tolist()]
                draws.append(TreeDraw(row, tree, laws, uniforms(len(tree.tokens), g)))
                rows.append(p_rows[key])
                row += len(tree.tokens) + 1
            for seq, d, out in zip(live, draws, decide_trees(torch.cat(rows), draws).tolist()):
                n, token, path = out[0], out[1], out[2 : 2 + out[0]]
                assert path == (path_to(d.tree, path[-1]) if path else [])
                kept[n] += 1
                later += any(d.tree.parents[i - 1] == d.tree.parents[i] for i in path if i > 0)
                cycles += 1
                seq += [d.tree.tokens[i] for i in path] + [token]
        for seq in seqs:
            counts[(seq[0] * V + seq[1]) * V + seq[2]] += 1
    return PipelineResult(np.array(counts).reshape((V,) * L), np.array(kept), later / cycles)


def sampled_trees(q_table: torch.Tensor, seed: int) -> Callable[[int], TokenTree]:
    draw = WithoutReplacement(q_table, seed)
    return lambda last: tree_from_children(last, draw)


def rule_sampled(p, tree, q, g):
    return accept_tree_sampled(p, tree, q, g)


def rule_deterministic(p, tree, q, g):
    return accept_tree_deterministic(p, tree, g)


def wrong_rule(bug: str) -> Rule:
    """The tree walk with one deliberate mistake:

    no_q_renorm   sampled rule that leaves qq unchanged after a rejection
    no_zero       deterministic rule that keeps r(x) after rejecting child x
    no_residual   sampled rule that keeps r = p_row after a rejection (qq still renormalised)
    """
    def rule(p, tree, q, g):
        kids, path, row = children(tree), [], 0
        while True:
            r, qq = p[row], (q[row] if q is not None else None)
            for c in kids[row]:
                x = tree.tokens[c]
                u = float(torch.rand((), generator=g))
                if bug == "no_zero":
                    if u < float(r[x]):
                        break
                    continue
                if float(qq[x]) > 0 and u < min(1.0, float(r[x]) / float(qq[x])):
                    break
                if bug != "no_residual":
                    r = residual(r, qq)
                if bug != "no_q_renorm":
                    qq = qq.clone()
                    qq[x] = 0
                    qq = qq / qq.sum() if qq.sum() > 0 else qq
            else:
                return TreeAcceptance(path, [tree.tokens[i] for i in path] + [sample(r, g)])
            path.append(c)
            row = c + 1
    return rule


def report(name: str, fit: GoodnessOfFit, res: PipelineResult) -> None:
    frac = res.kept_hist / res.kept_hist.sum()
    print(f"\n[{name}] {fit}  kept/cycle " + "/".join(f"{f:.2f}" for f in frac)
          + f"  later-sibling {res.later_sibling:.2f}", end="")


# ---------------------------------------------------------------- statistical tests

@pytest.mark.parametrize("params", [PLAIN, NUCLEUS], ids=["T1", "T0.7-p0.8"])
@pytest.mark.parametrize("kind", ["sampled", "deterministic"])
@pytest.mark.parametrize("walk", ["host", "on_device"])
@pytest.mark.statistical
def test_tree_rules_follow_target(walk, kind, params):
    """Tree speculative decoding emits L-token sequences distributed exactly as
    target-only sampling, with paths of every length and non-first children kept:
    the host walk (acceptance.py) and the verifier's batched walk (tree_batch.py)."""
    target, drafter, topk_drafter = model_tables()
    p_table = logits_to_probs(target, params)
    if kind == "sampled":
        q_table = logits_to_probs(drafter, params)
        if walk == "on_device":
            res = run_pipeline_on_device(p_table, sampled_trees(q_table, seed=1), q_table, N_TRIALS, seed=2)
        else:
            res = run_pipeline(p_table, sampled_trees(q_table, seed=1), rule_sampled, q_table, N_TRIALS, seed=2)
    elif walk == "on_device":
        res = run_pipeline_on_device(p_table, topk_children(topk_drafter), None, N_TRIALS, seed=3)
    else:
        res = run_pipeline(p_table, topk_children(topk_drafter), rule_deterministic, None, N_TRIALS, seed=3)
    fit = goodness_of_fit(res.counts, exact_sequence_law(p_table))
    report(f"accept_tree_{kind} {walk} {params}", fit, res)
    frac = res.kept_hist / res.kept_hist.sum()
    assert np.all(frac > 0.02) and res.later_sibling > 0.02, (frac, res.later_sibling)
    assert fit.ok, f"accept_tree_{kind} is not lossless: {fit}"


WRONG = [("no_q_renorm", "sampled"), ("no_zero", "deterministic"), ("no_residual", "sampled")]


@pytest.mark.parametrize("params", [PLAIN, NUCLEUS], ids=["T1", "T0.7-p0.8"])
@pytest.mark.parametrize("bug,kind", WRONG, ids=[w[0] for w in WRONG])
@pytest.mark.statistical
def test_wrong_tree_rules_are_detected(bug, kind, params):
    target, drafter, topk_drafter = model_tables()
    p_table = logits_to_probs(target, params)
    if kind == "sampled":
        q_table = logits_to_probs(drafter, params)
        res = run_pipeline(p_table, sampled_trees(q_table, seed=1), wrong_rule(bug), q_table, N_TRIALS_WRONG, 2)
    else:
        res = run_pipeline(p_table, topk_children(topk_drafter), wrong_rule(bug), None, N_TRIALS_WRONG, 3)
    fit = goodness_of_fit(res.counts, exact_sequence_law(p_table))
    report(f"WRONG {bug} {params}", fit, res)
    assert not fit.ok, f"the test cannot tell wrong rule {bug!r} from the right one: {fit}"
