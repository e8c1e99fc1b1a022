"""The shape of a draft, as data: chains, static trees and dynamic trees are
values of one dataclass, never code branches in the services.

A static tree is given per depth (`branching`, every node of a depth has as
many children) or node by node (`paths`, each node as its tuple of choice
ranks from the root, as Medusa's choice lists). Paths let a tree spend its
nodes where acceptance is likely, e.g. a deep chain plus the drafter's second
choice at depth 1 (the shape `benchmarks/tree_search.py` finds on the demo
pair), which a per-depth branching cannot express.

`min_confidence` rides with the shape (0 = off): the drafter grows nothing
below a node whose confidence (its own probability of the token it chose) is
under it, so a chain ends at its first unsure token, that token included
(docs/rules.md, "Stopping where the drafter is unsure"). It travels with the
shape because every cut of the shape keeps it and the tree builders read both."""

from __future__ import annotations

from dataclasses import dataclass, replace

from specd_core.errors import InvalidRequest
from specd_core.rules.tree import static_tree_paths


@dataclass(frozen=True)
class DraftShape:
    branching: tuple[int, ...] = ()  # static: children per depth; a chain of K is (1,)*K
    node_budget: int = 0  # dynamic: nodes in the tree (0 = static)
    max_depth: int = 0  # dynamic: depth limit
    top_k: int = 4  # dynamic: candidates per expanded node, nodes expanded per depth
    paths: tuple[tuple[int, ...], ...] = ()  # static, node by node (instead of branching)
    min_confidence: float = 0.0  # nothing is drafted below a node less confident than this (0 = off)

    @staticmethod
    def chain(k: int, max_k: int | None = None) -> DraftShape:
        if k < 1:
            raise InvalidRequest(f"num_draft_tokens (chain length) must be >= 1, got {k}")
        # Checked BEFORE the tuple is built: a K of 2**31 - 1 from the wire would
        # make a 2-billion-entry tuple and get the drafter OOM-killed.
        if max_k is not None and k > max_k:
            raise InvalidRequest(f"num_draft_tokens {k} is over the limit of {max_k}")
        return DraftShape(branching=(1,) * k)

    @property
    def is_chain(self) -> bool:
        """One child per node: the shape every level of which is one token."""
        return not self.dynamic and all(n == 1 for n in self.children().values())

    @property
    def dynamic(self) -> bool:
        return self.node_budget > 0

    @property
    def static_paths(self) -> tuple[tuple[int, ...], ...]:
        """Every node of a static tree as its rank path, parents first."""
        return self.paths or tuple(static_tree_paths(list(self.branching)))

    def children(self) -> dict[tuple[int, ...], int]:
        """Static tree: number of children per node path (() = the root).
        Ranks of siblings are contiguous from 0 (validate checks it), so a
        count says which of the drafter's choices to take."""
        count: dict[tuple[int, ...], int] = {}
        for p in self.static_paths:
            count[p[:-1]] = max(count.get(p[:-1], 0), p[-1] + 1)
        return count

    @property
    def max_nodes(self) -> int:
        if self.dynamic:
            return self.node_budget
        if self.paths:
            return len(self.paths)
        total, level = 0, 1
        for b in self.branching:
            level *= b
            total += level
        return total

    @property
    def depth(self) -> int:
        if self.dynamic:
            return self.max_depth
        return max(map(len, self.paths)) if self.paths else len(self.branching)

    @property
    def forward_rows(self) -> int:
        """Rows the drafter forwards to grow this tree (the nodes that get
        children): a dynamic tree expands top_k nodes at each depth but the last."""
        if self.dynamic:
            return max(self.max_depth - 1, 0) * self.top_k
        return len(self.children()) - 1

    def fit_rows(self, room: int) -> DraftShape:
        """A dynamic tree made shallow enough that its forwards fit in `room`
        cache rows (at least depth 1, which forwards nothing); other shapes as
        they are. Without it, depth 16 x top_k 20 could pass the drafter's
        context and fail inside the batch (INTERNAL)."""
        if not self.dynamic or self.forward_rows <= room:
            return self
        return replace(self, max_depth=max(1, 1 + room // self.top_k))

    def fit(self, max_nodes: int, max_rows: int) -> DraftShape | None:
        """This shape with as many levels as fit: at most max_nodes nodes (the
        verifier forwards each) and max_rows drafter forwards. Near the end of a
        context a wide tree must lose levels, not only a deep one (None: no room)."""
        shape = self
        if self.dynamic:
            if max_nodes < 1:
                return None
            shape = replace(self, node_budget=min(self.node_budget, max_nodes))
        for d in range(shape.depth, 0, -1):
            cut = shape._cut(d)
            if cut.max_nodes <= max_nodes and cut.forward_rows <= max_rows:
                return cut
        return None

    def validate(self, max_nodes: int, max_depth: int) -> DraftShape:
        if not (0.0 <= self.min_confidence < 1.0):  # NaN fails too
            raise InvalidRequest(f"min_confidence must be in [0, 1) (0 = off), got {self.min_confidence}")
        if self.dynamic:
            if not (1 <= self.max_depth <= max_depth):
                raise InvalidRequest(f"tree max_depth must be in [1, {max_depth}], got {self.max_depth}")
            if self.top_k < 1:
                raise InvalidRequest(f"tree top_k must be >= 1, got {self.top_k}")
            if self.branching or self.paths:
                raise InvalidRequest("a tree has either node_budget (dynamic) or branching / paths (static), not both")
        elif self.paths:
            if self.branching:
                raise InvalidRequest("a static tree has either branching or paths, not both")
            _check_paths(self.paths, max_nodes)
        elif not self.branching or any(b < 1 for b in self.branching):
            raise InvalidRequest(f"tree branching must be a non-empty list of factors >= 1, got {list(self.branching)}")
        if self.depth > max_depth:
            raise InvalidRequest(f"tree depth {self.depth} is over the limit of {max_depth}")
        if self.max_nodes > max_nodes:
            raise InvalidRequest(f"tree of {self.max_nodes} nodes is over the limit of {max_nodes}")
        return self

    def truncated(self, depth: int) -> DraftShape | None:
        """The same shape cut to at most `depth` levels (None if depth < 1): near the
        end of max_new_tokens or of a context there is no room for deep drafts."""
        return self._cut(depth) if depth >= 1 else None

    def _cut(self, depth: int) -> DraftShape:
        """truncated(depth) for depth >= 1."""
        if self.dynamic:
            return replace(self, max_depth=min(self.max_depth, depth))
        if self.paths:
            return replace(self, paths=tuple(p for p in self.paths if len(p) <= depth))
        return replace(self, branching=self.branching[:depth])

    def with_confidence(self, threshold: float) -> DraftShape:
        """The same shape with this stopping threshold (0 = off)."""
        return self if threshold == self.min_confidence else replace(self, min_confidence=threshold)


def _check_paths(paths, max_nodes: int) -> None:
    """Paths form a tree: no repeats, every node's parent and elder sibling
    listed before it (so ranks are contiguous and parents come first)."""
    if len(paths) > max_nodes:  # before the loop: a huge list is refused cheaply
        raise InvalidRequest(f"tree of {len(paths)} nodes is over the limit of {max_nodes}")
    seen: set[tuple[int, ...]] = {()}
    for i, p in enumerate(paths):
        if not p or any(r < 0 for r in p):
            raise InvalidRequest(f"tree paths[{i}] = {list(p)}: a path is a non-empty list of ranks >= 0")
        if p in seen:
            raise InvalidRequest(f"tree paths[{i}] = {list(p)} is listed twice")
        if p[:-1] not in seen:
            raise InvalidRequest(f"tree paths[{i}] = {list(p)} comes before its parent {list(p[:-1])}")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
            raise InvalidRequest(
                f"tree paths[{i}] = {list(p)} comes before its elder sibling "
                f"{list(p[:-1] + (p[-1] - 1,))} (ranks are contiguous from 0)"
            )
        seen.add(p)
