"""Token trees: their shape, validation, static shapes and greedy acceptance.

Pure Python (no torch), so that what only describes trees (the orchestrator's
draft shapes, the command line) loads without a tensor library. A tree holds N
draft nodes below the ROOT, the pending token (the last emitted token, not yet
in the verifier's cache). The verifier forwards [root, node0 .. node{N-1}] in
ONE pass, each node seeing its ancestors (specd_core/runtime/tree_tensors.py
builds that mask; the lean engine builds the same mask from the tree itself,
for every session of a step at once: specd_core/runtime/lean_step.py), so row
0 of its output predicts the root's children and row i+1 predicts node i's
children. The sampled acceptance rules over those rows are in
specd_core/rules/acceptance.py (docs/rules.md, "The rules that keep output
exact").

Tree shapes are data (Medusa / EAGLE style): a static shape is a list of paths of
child ranks, turned into a parent array by `paths_to_parents`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from specd_core.errors import InvalidRequest


@dataclass(frozen=True)
class TokenTree:
    tokens: tuple[int, ...]  # (N,) draft token of each node
    parents: tuple[int, ...]  # (N,) parent node index; -1 = child of the root. parents[i] < i (topological)


def validate_tree(tokens, parents, vocab_size: int, max_nodes: int) -> TokenTree:
    """Check a tree that came from outside; raise InvalidRequest saying what is wrong."""
    try:
        tokens = tuple(operator.index(t) for t in tokens)
        parents = tuple(operator.index(a) for a in parents)
    except TypeError as e:
        raise InvalidRequest(f"tree tokens and parents must be integers ({e})") from None
    n = len(tokens)
    if len(parents) != n:
        raise InvalidRequest(f"tree has {n} tokens but {len(parents)} parents (one parent per node)")
    if n > max_nodes:
        raise InvalidRequest(f"tree has {n} nodes; at most {max_nodes} are allowed")
    for i, a in enumerate(parents):
        if not -1 <= a < i:
            raise InvalidRequest(
                f"tree node {i} has parent {a}; it must be -1 (the root) or a node "
                f"index in [0, {i}) (parents come before children)"
            )
    bad = [(i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(
            f"tree holds {len(bad)} token id(s) outside the vocabulary [0, {vocab_size}): (node, id) {bad[:5]}"
        )
    seen: dict[tuple[int, int], int] = {}
    for i, (a, t) in enumerate(zip(parents, tokens)):
        if (a, t) in seen:  # the acceptance rules assume distinct siblings (drawn without replacement)
            raise InvalidRequest(
                f"tree nodes {seen[(a, t)]} and {i} are both children of "
                f"{'the root' if a < 0 else f'node {a}'} with token {t}"
            )
        seen[(a, t)] = i
    return TokenTree(tokens, parents)


def children(tree: TokenTree) -> list[list[int]]:
    """(N+1) lists: entry 0 = children of the root, entry i+1 = children of node i, in node order."""
    out: list[list[int]] = [[] for _ in range(len(tree.tokens) + 1)]
    for i, a in enumerate(tree.parents):
        out[a + 1].append(i)
    return out


def depth(tree: TokenTree) -> list[int]:
    """(N,) depth of each node; the root's children have depth 1."""
    d: list[int] = []
    for a in tree.parents:
        d.append(1 if a < 0 else d[a] + 1)
    return d


def path_to(tree: TokenTree, node: int) -> list[int]:
    """Node indices from the root's child down to `node` (inclusive)."""
    if not 0 <= node < len(tree.tokens):
        raise IndexError(f"node {node} is not in a tree of {len(tree.tokens)} nodes")
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


def static_tree_paths(branching: list[int]) -> list[tuple[int, ...]]:
    """Every node of a full tree as its tuple of child ranks from the root, BFS order.

    [3, 2, 1]: the root has 3 children, each of them 2, each of those 1 ->
    (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), ..., (2, 1, 0). Rank k at a node means
    "the drafter's k-th choice there" (Medusa's `medusa_choices` are such paths).
    """
    level: list[tuple[int, ...]] = [()]
    out: list[tuple[int, ...]] = []
    for b in branching:
        level = [p + (k,) for p in level for k in range(b)]
        out += level
    return out


def static_tree(branching: list[int]) -> list[list[int]]:
    """The same paths as lists (the format of Medusa's `medusa_choices`)."""
    return [list(p) for p in static_tree_paths(branching)]


def paths_to_parents(paths) -> list[int]:
    """Parent node index per path, for a list where every parent path comes first."""
    index = {tuple(p): i for i, p in enumerate(paths)}
    parents = []
    for i, p in enumerate(paths):
        p = tuple(p)
        if not p:
            raise ValueError("the empty path is the root; it is not a node")
        a = index.get(p[:-1], -1) if len(p) > 1 else -1
        if len(p) > 1 and not 0 <= a < i:
            raise ValueError(f"path {p} comes before (or without) its parent {p[:-1]}")
        parents.append(a)
    return parents


@dataclass
class TreeAcceptance:
    path: list[int]  # accepted node indices, the root's child first (may be empty)
    tokens: list[int]  # tokens of the path + one more (the correction or the bonus)

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def finish(tree: TokenTree, path: list[int], last: int) -> TreeAcceptance:
    """The verdict of a walk that kept `path` and then emitted `last`."""
    return TreeAcceptance(path, [tree.tokens[i] for i in path] + [last])


def accept_tree_argmax(best: list[int], tree: TokenTree) -> TreeAcceptance:
    """accept_tree_greedy from each row's argmax (N+1 ids), computed by the
    caller: a verifier takes every greedy session's argmax in one device call
    and one transfer, rather than one host sync per session."""
    if len(best) != len(tree.tokens) + 1:
        raise ValueError(f"best must hold N+1 = {len(tree.tokens) + 1} ids; got {len(best)}")
    kids = children(tree)
    path: list[int] = []
    row = 0
    while True:
        match = [c for c in kids[row] if tree.tokens[c] == best[row]]
        if not match:
            return finish(tree, path, best[row])
        path.append(match[0])
        row = match[0] + 1


def compaction_indices(path: list[int]) -> list[int]:
    """Rows of the forwarded block [root, node0, ..] to keep: the root, then the path."""
    return [0] + [i + 1 for i in path]
