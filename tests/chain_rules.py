"""The chain forms of the acceptance rules, for the tests.

A chain of K drafts is a tree with one child per node, so each chain rule here
is the running tree rule (specd_core.rules.tree) applied to that tree: the
statistical tests that drive these functions test the code the verifier runs.
The chain vocabulary (an accepted count and a per-position mask) is what the
Leviathan et al. / Chen et al. papers state their rules in.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specd_core.rules.acceptance import accept_tree_deterministic, accept_tree_greedy, accept_tree_sampled
from specd_core.rules.chain_batch import ChainDraw, decide_chains, uniforms
from specd_core.rules.tree import TokenTree


@dataclass
class Acceptance:
    num_accepted: int                             # draft tokens kept
    tokens: list[int]                             # kept drafts + correction or bonus
    accepted_mask: list[bool] = field(default_factory=list)  # per draft position


def chain(draft_ids: list[int]) -> TokenTree:
    """Draft i is the only child of draft i-1 (draft 0 of the root)."""
    return TokenTree(tuple(draft_ids), tuple(range(-1, len(draft_ids) - 1)))


def _as_chain(out, k: int) -> Acceptance:
    n = out.num_accepted
    return Acceptance(n, out.tokens, [i < n for i in range(k)])


def accept_greedy(target_logits: torch.Tensor, draft_ids: list[int]) -> Acceptance:
    """target_logits (K+1, V): keep drafts while each is the argmax, then the argmax."""
    return _as_chain(accept_tree_greedy(target_logits, chain(draft_ids)), len(draft_ids))


def accept_sampled(p: torch.Tensor, draft_ids: list[int], q: torch.Tensor,
                   generator: torch.Generator | None) -> Acceptance:
    """p (K+1, V), q (K, V): speculative sampling. The tree rule reads the law a
    node's children were drawn from in that node's row, so q's row i (the law of
    draft i) sits at tree row i; the leaf's row is unused."""
    q_rows = torch.cat([q, torch.zeros(1, p.shape[1], dtype=q.dtype)])
    return _as_chain(accept_tree_sampled(p, chain(draft_ids), q_rows, generator), len(draft_ids))


def accept_deterministic(p: torch.Tensor, draft_ids: list[int], generator: torch.Generator | None) -> Acceptance:
    """Drafts chosen without sampling: keep x with probability p(x), else sample
    p without x."""
    return _as_chain(accept_tree_deterministic(p, chain(draft_ids), generator), len(draft_ids))


def accept_on_device(p: torch.Tensor, draft_ids: list[int], q: torch.Tensor | None,
                     generator: torch.Generator | None) -> Acceptance:
    """The verifier's batched chain rule (specd_core.rules.chain_batch) for one
    chain: q (K, V) dense as the other rules take it, sent sparse as the
    verifier sends it; None: drafts chosen without sampling."""
    laws = None
    if q is not None:
        laws = [(torch.nonzero(row).flatten().tolist(), row[row > 0].tolist()) for row in q[: len(draft_ids)]]
    draw = ChainDraw(0, draft_ids, laws, uniforms(len(draft_ids), generator))
    k, token = decide_chains(p, [draw])[0].tolist()
    return Acceptance(k, list(draft_ids[:k]) + [token], [i < k for i in range(len(draft_ids))])
