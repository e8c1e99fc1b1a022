"""The lossless acceptance rules over a token tree's rows (docs/rules.md, "The
rules that keep output exact": the tree rules; a chain is a tree with one child
per node).

Pure core: the target's rows p (and the drafter's q) in, a TreeAcceptance out.
Row 0 is the root's (the pending token's) distribution, row i+1 node i's
(specd_core/rules/tree.py).
"""

from __future__ import annotations

import torch

from specd_core.rules.sampling import sample
from specd_core.rules.tree import TokenTree, TreeAcceptance, accept_tree_argmax, children, finish


def _check_rows(x: torch.Tensor, tree: TokenTree, what: str) -> None:
    if x.dim() != 2 or x.shape[0] != len(tree.tokens) + 1:
        raise ValueError(f"{what} must be (N+1, V) = ({len(tree.tokens) + 1}, V); got {tuple(x.shape)}")


def accept_tree_greedy(logits: torch.Tensor, tree: TokenTree) -> TreeAcceptance:
    """Follow the target's argmax down the tree. logits (N+1, V): row 0 at the root,
    row i+1 at node i. Siblings are distinct, so at most one child matches; every
    emitted token is an argmax at its position, hence bit-identical to greedy decoding."""
    _check_rows(logits, tree, "logits")
    return accept_tree_argmax(logits.argmax(-1).tolist(), tree)


def residual(p_row: torch.Tensor, q_row: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): the law still owed after a draft drawn from q was
    rejected (Leviathan et al. 2023, Alg. 1). If p == q everywhere the residual
    is empty, but then the rejection had probability 0; falling back to p only
    guards against float round-off."""
    r = torch.clamp(p_row - q_row, min=0.0)
    total = r.sum()
    return r / total if total > 0 else p_row


def dense_q(token_ids: list[list[int]], probs: list[list[float]], vocab_size: int) -> torch.Tensor:
    """Sparse per-row draft distributions (ids + probs, as the drafter sends a
    truncated q) -> a dense (rows, V) tensor, zeros elsewhere."""
    q = torch.zeros(len(token_ids), vocab_size)
    for i, (ids, ps) in enumerate(zip(token_ids, probs)):
        q[i, torch.tensor(ids, dtype=torch.long)] = torch.tensor(ps, dtype=torch.float32)
    return q


def _without(dist: torch.Tensor, x: int) -> torch.Tensor:
    """dist with token x removed, renormalised. A zero total only arises from round-off
    (x held all the mass, so it could not have been rejected / drawn again); keep zeros."""
    dist = dist.clone()
    dist[x] = 0.0
    total = dist.sum()
    return dist / total if total > 0 else dist


def accept_tree_deterministic(p: torch.Tensor, tree: TokenTree, generator: torch.Generator | None) -> TreeAcceptance:
    """Children chosen without sampling (top-k of a drafter, n-gram lookup): no q needed.

    p (N+1, V): target distribution at the root (row 0) and at each node (row i+1).
    At a node, r = p_row; for each child x in order keep it with probability r(x),
    else r = r without x (renormalised); keep -> descend; all rejected -> emit a sample
    of r. Exact because each test is the sampled rule with a point-mass q
    applied to the distribution left so far:
    the emitted token at every node is distributed as p_row whatever the children are.
    """
    _check_rows(p, tree, "p")
    kids = children(tree)
    path: list[int] = []
    row = 0
    while True:
        r = p[row]
        for c in kids[row]:
            x = tree.tokens[c]
            if float(torch.rand((), generator=generator)) < float(r[x]):
                break
            r = _without(r, x)
        else:  # no child kept (or no children)
            return finish(tree, path, sample(r, generator))
        path.append(c)
        row = c + 1


def accept_tree_sampled(
    p: torch.Tensor, tree: TokenTree, q: torch.Tensor, generator: torch.Generator | None
) -> TreeAcceptance:
    """Children of a node drawn WITHOUT replacement from q[row of that node].

    Multi-step speculative sampling / recursive rejection sampling: SpecInfer (Miao et
    al. 2024, "SpecInfer: Accelerating LLM Serving with Tree-based Speculative Inference
    and Verification", Alg. 2) and, for draws without replacement, Jeon et al. 2024,
    "Recursive Speculative Decoding". p, q: (N+1, V); q rows of leaves are unused.
    At a node, r = p_row, qq = q_row; for each child x: keep with prob min(1, r(x)/qq(x));
    if rejected, r = norm(max(0, r - qq)) (the law still owed) and qq = qq without x
    (the law the next sibling was drawn from); all rejected -> emit a sample of r.
    Each step is the chain rule with target r and proposal qq, so by induction the token
    emitted at a node is distributed as p_row.
    """
    _check_rows(p, tree, "p")
    _check_rows(q, tree, "q")
    kids = children(tree)
    path: list[int] = []
    row = 0
    while True:
        r, qq = p[row], q[row]
        for c in kids[row]:
            x = tree.tokens[c]
            rx, qx = float(r[x]), float(qq[x])
            u = float(torch.rand((), generator=generator))
            if qx > 0 and u < min(1.0, rx / qx):  # qx = 0: x could not have been drawn; reject
                break
            r = residual(r, qq)
            qq = _without(qq, x)
        else:
            return finish(tree, path, sample(r, generator))
        path.append(c)
        row = c + 1
