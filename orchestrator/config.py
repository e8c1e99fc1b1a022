from __future__ import annotations

from dataclasses import dataclass, field

from specd.draft_shape import DraftShape


@dataclass(frozen=True)
class OrchestratorConfig:
    target_dir: str                        # the verifier's model dir (tokenizer + context length)
    drafter_dir: str | None = None         # None: no drafter, speculation off
    host: str = "0.0.0.0"
    port: int = 50051                      # public Generate port; 0 = any free port
    verifier_addresses: list[str] = field(default_factory=list)
    drafter_addresses: list[str] = field(default_factory=list)
    default_max_new_tokens: int = 128      # when a request leaves it unset
    max_new_tokens_limit: int = 4096       # requests above it: INVALID_ARGUMENT
    default_num_speculative_tokens: int = 4  # K when a request leaves it unset
    max_num_speculative_tokens: int = 16   # K / tree depth above it: INVALID_ARGUMENT
    # Service default draft tree (None: a chain of default_num_speculative_tokens).
    default_tree_branching: tuple[int, ...] = ()
    default_tree_node_budget: int = 0      # > 0: a dynamic tree of this many nodes ...
    default_tree_max_depth: int = 6        # ... and this depth
    default_tree_top_k: int = 4
    max_tree_nodes: int = 64               # tree size limit per cycle
    rpc_timeout_s: float = 60.0            # per internal call

    def default_shape(self) -> DraftShape | None:
        if self.default_tree_node_budget:
            return DraftShape(node_budget=self.default_tree_node_budget, max_depth=self.default_tree_max_depth,
                              top_k=self.default_tree_top_k)
        if self.default_tree_branching:
            return DraftShape(branching=tuple(self.default_tree_branching))
        k = self.default_num_speculative_tokens
        return DraftShape.chain(k) if k else None
