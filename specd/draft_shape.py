"""The shape of a draft, as data: chains, static trees and dynamic trees are
values of one dataclass, never code branches in the services."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidRequest


@dataclass(frozen=True)
class DraftShape:
    branching: tuple[int, ...] = ()   # static: children per depth; a chain of K is (1,)*K
    node_budget: int = 0              # dynamic: nodes in the tree (0 = static)
    max_depth: int = 0                # dynamic: depth limit
    top_k: int = 4                    # dynamic: candidates per expanded node, nodes expanded per depth

    @staticmethod
    def chain(k: int) -> "DraftShape":
        if k < 1:
            raise InvalidRequest(f"num_draft_tokens (chain length) must be >= 1, got {k}")
        return DraftShape(branching=(1,) * k)

    @property
    def dynamic(self) -> bool:
        return self.node_budget > 0

    @property
    def max_nodes(self) -> int:
        if self.dynamic:
            return self.node_budget
        total, level = 0, 1
        for b in self.branching:
            level *= b
            total += level
        return total

    @property
    def depth(self) -> int:
        return self.max_depth if self.dynamic else len(self.branching)

    def validate(self, max_nodes: int, max_depth: int) -> "DraftShape":
        if self.dynamic:
            if not (1 <= self.max_depth <= max_depth):
                raise InvalidRequest(f"tree max_depth must be in [1, {max_depth}], got {self.max_depth}")
            if self.top_k < 1:
                raise InvalidRequest(f"tree top_k must be >= 1, got {self.top_k}")
        elif not self.branching or any(b < 1 for b in self.branching):
            raise InvalidRequest(f"tree branching must be a non-empty list of factors >= 1, got {list(self.branching)}")
        if self.depth > max_depth:
            raise InvalidRequest(f"tree depth {self.depth} is over the limit of {max_depth}")
        if self.max_nodes > max_nodes:
            raise InvalidRequest(f"tree of {self.max_nodes} nodes is over the limit of {max_nodes}")
        return self

    def truncated(self, depth: int) -> "DraftShape | None":
        """The same shape cut to at most `depth` levels (None if depth < 1): near the
        end of max_new_tokens or of a context there is no room for deep drafts."""
        if depth < 1:
            return None
        if self.dynamic:
            return DraftShape(node_budget=self.node_budget, max_depth=min(self.max_depth, depth), top_k=self.top_k)
        return DraftShape(branching=self.branching[:depth])
