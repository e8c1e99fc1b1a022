"""The lossless chain rules for every sampled chain of a step at once, on the
device that holds the target's law (docs/rules.md, "Sampled sessions: decided
on the device, read once").

The tree rules in specd_core/rules/acceptance.py walk one session's tree on
the host and need its rows' law there: (rows x vocabulary) floats per session,
a transfer as long as a graphed verify step at 64 sessions of a 128k
vocabulary. A chain's walk needs much less: node i is kept with probability
min(1, p_i(x_i) / q_i(x_i)), the first rejected node k gets a draw from
norm(max(0, p_k - q_k)), a chain kept whole a draw from p_N. So the host
sends each session's uniforms and its drafts' sparse q, the device decides
every chain in a handful of batched operations, and one small
(sessions x 2) tensor comes back: no per-session transfer, no host sync of
its own (the caller reads it with the greedy sessions' argmaxes). On a CPU
the law is in host memory already, and the same decisions are taken in
Python (decide_chains says why).

Pure core: tensors in, tensors out.

Randomness: each session draws N + 1 uniforms from its own CPU generator, one
per node and one for the emitted token, which is sampled by inverse CDF
(the first token whose cumulative mass passes u times the total). Drawing
them on the host keeps a seed's stream the same on every device; drawing
all N + 1 up front (some unused when a node is rejected) keeps them
independent of each other's use, so each decision still sees a fresh
uniform and the law is the tree rule's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# A node's draft law, sparse: (token ids, probabilities). None: the node was
# chosen without sampling (a top-k drafter, an n-gram lookup), the point-mass
# rule: keep x with probability p(x), else draw from p without x, which is the
# sampled rule with q = 1 at x.
SparseLaw = tuple[Sequence[int], Sequence[float]]


@dataclass(frozen=True)
class ChainDraw:
    """One session's chain, on the host: where its rows start in the step's
    stacked law, its drafted tokens (maybe none: a plain step), the law each
    was drawn from (None: all chosen without sampling) and its N + 1
    uniforms (`uniforms`)."""

    row: int
    tokens: Sequence[int]
    q: Sequence[SparseLaw] | None
    u: Sequence[float]


def uniforms(nodes: int, generator: torch.Generator | None) -> list[float]:
    """A chain of `nodes` drafts' uniforms: one per node, then the emitted
    token's (from a host generator: reading them waits for no device)."""
    return torch.rand(nodes + 1, generator=generator, dtype=torch.float64).tolist()


def _node_laws(d: ChainDraw) -> list[SparseLaw]:
    if d.q is None:
        return [([x], [1.0]) for x in d.tokens]
    if len(d.q) != len(d.tokens):
        raise ValueError(f"a chain of {len(d.tokens)} drafts needs as many draft laws, got {len(d.q)}")
    return list(d.q)


def _q_at_drafts(d: ChainDraw, laws: list[SparseLaw]) -> list[float]:
    """Each drafted token's probability in its node's law (0: not in it)."""
    return [dict(zip(ids, ps)).get(x, 0.0) for x, (ids, ps) in zip(d.tokens, laws)]


def _packed(draws: Sequence[ChainDraw]) -> tuple[torch.Tensor, int, int]:
    """Every chain's inputs in one float64 tensor (ids are exact in float64),
    so that they reach the device in one copy; with the widest chain M and
    the widest draft law W. Sections: roots and sizes (S, 2), tokens (S, M),
    q at each token (S, M), laws' ids and probabilities (S, M, W) each,
    uniforms (S, M + 1: the emitted token's last, in one column for all)."""
    laws = [_node_laws(d) for d in draws]
    m = max(1, max(len(d.tokens) for d in draws))
    w = max([1] + [len(ids) for ls in laws for ids, _ in ls])
    head: list[float] = []
    tok: list[float] = []
    q_at: list[float] = []
    ids: list[float] = []
    vals: list[float] = []
    u: list[float] = []
    for d, ls in zip(draws, laws):
        n = len(d.tokens)
        head += [d.row, n]
        tok += [*d.tokens] + [0] * (m - n)
        q_at += _q_at_drafts(d, ls) + [0.0] * (m - n)
        for lid, lp in ls + [((), ())] * (m - n):
            ids += [*lid] + [0] * (w - len(lid))
            vals += [*lp] + [0.0] * (w - len(lp))
        u += [*d.u[:n]] + [0.0] * (m - n) + [d.u[n]]
    return torch.tensor(head + tok + q_at + ids + vals + u, dtype=torch.float64), m, w


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: a copy from
    pinned memory, queued behind the step's kernels (a copy from pageable
    memory would wait for them)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def decide_chains(probs: torch.Tensor, draws: Sequence[ChainDraw], batched: bool | None = None) -> torch.Tensor:
    """(S, 2) int64 on probs' device: each chain's kept drafts k and the
    token it emits. probs (R, V): the step's stacked law (row `row + i` is
    chain i's law after its first i drafts: row 0 its pending token's).

    On a GPU the chains are decided by batched operations (nothing read
    back); on a CPU, where the law is in host memory and each of those
    dozens of small operators costs microseconds, the decisions are taken
    in Python on the same numbers (`_chains_on_host`). batched: force one
    or the other (None: by device)."""
    if not draws:
        return torch.zeros(0, 2, dtype=torch.long, device=probs.device)
    for d in draws:  # checked once here for both forms
        if len(d.u) != len(d.tokens) + 1:
            raise ValueError(f"a chain of {len(d.tokens)} drafts needs {len(d.tokens) + 1} uniforms, got {len(d.u)}")
    if batched is False or (batched is None and probs.device.type == "cpu"):
        return _chains_on_host(probs, draws)
    s = len(draws)
    packed, m, w = _packed(draws)
    x = to_device(packed, probs.device)
    sizes = [2 * s, s * m, s * m, s * m * w, s * m * w, s * (m + 1)]
    head, tok, q_at, ids, vals, u = x.split(sizes)
    head = head.view(s, 2).long()
    root, n = head[:, 0], head[:, 1]
    tok, q_at, u = tok.view(s, m).long(), q_at.view(s, m), u.view(s, m + 1)
    ids, vals = ids.view(s, m, w).long(), vals.view(s, m, w)
    steps = torch.arange(m, device=probs.device)
    # Gathers by flat index (take, index_select): one operator each, where
    # advanced indexing costs several on the host.
    rows = (root[:, None] + steps).clamp(max=probs.shape[0] - 1)  # past a chain's end: unread
    p_at = probs.view(-1).take(rows * probs.shape[1] + tok).double()
    # u < min(1, p/q) as u * q < p (u < 1); q = 0: x could not have been drawn.
    keep = (steps < n[:, None]) & (q_at > 0) & (u[:, :m] * q_at < p_at)
    k = keep.long().cumprod(1).sum(1)
    law = probs.index_select(0, root + k).double()
    # The residual norm(max(0, p_k - q_k)) after a rejection at node k (a
    # chain kept whole owes p_N itself): only q's entries change, so they
    # alone are worked on (added to the row as a change, which pads add 0 to).
    node = torch.arange(s, device=probs.device) * m + k.clamp(max=m - 1)
    entries, q = ids.view(s * m, w).index_select(0, node), vals.view(s * m, w).index_select(0, node)
    p = law.gather(1, entries)
    cut = (p - q).clamp(min=0.0)
    # Zero mass left only comes from round-off (the rejection had
    # probability 0): draw from p_k then, as the tree rules do.
    owes = (k < n) & (1.0 - (p - cut).sum(1) > 0)
    law.scatter_add_(1, entries, torch.where(owes[:, None], cut - p, 0.0))
    return torch.stack([k, inverse_cdf(law, u[:, m])], 1)


def _chains_on_host(probs: torch.Tensor, draws: Sequence[ChainDraw]) -> torch.Tensor:
    """decide_chains' steps in Python floats: the drafted tokens' p in one
    read, the rows drawn from in one gather, the residuals' entries in one
    more, one batched draw."""
    vocab = probs.shape[1]
    laws = [_node_laws(d) for d in draws]
    at = [(d.row + i) * vocab + x for d in draws for i, x in enumerate(d.tokens)]
    p_at = probs.view(-1).take(torch.tensor(at, dtype=torch.long)).tolist() if at else []
    kept, first = [], 0
    for d, ls in zip(draws, laws):
        k = len(d.tokens)
        for i, q in enumerate(_q_at_drafts(d, ls)):
            if not (q > 0 and d.u[i] * q < p_at[first + i]):
                k = i
                break
        kept.append(k)
        first += len(d.tokens)
    law = probs.index_select(0, torch.tensor([d.row + k for d, k in zip(draws, kept)])).double()
    owed = [(i, ls[k]) for i, (d, ls, k) in enumerate(zip(draws, laws, kept)) if k < len(d.tokens)]
    if owed:
        rows = [i for i, (ids, _) in owed for _ in ids]
        cols = [c for _, (ids, _) in owed for c in ids]
        found = law.view(-1).take(torch.tensor([r * vocab + c for r, c in zip(rows, cols)])).tolist()
        change, j = [], 0
        for _, (ids, ps) in owed:
            p = found[j : j + len(ids)]
            cut = [max(0.0, a - b) for a, b in zip(p, ps)]
            # Zero mass left: round-off (the rejection had probability 0).
            owes = 1.0 - sum(a - c for a, c in zip(p, cut)) > 0
            change += [c - a if owes else 0.0 for a, c in zip(p, cut)]
            j += len(ids)
        law.index_put_(
            (torch.tensor(rows), torch.tensor(cols)), torch.tensor(change, dtype=torch.float64), accumulate=True
        )
    tokens = inverse_cdf(law, torch.tensor([d.u[-1] for d in draws], dtype=torch.float64))
    return torch.tensor([[k, t] for k, t in zip(kept, tokens.tolist())])


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(S,) draws from the rows of (S, V) non-negative weights: the first
    token whose cumulative weight passes u times the row's total. Never a
    token of weight 0: adding 0 leaves a cumulative sum as it was, so a
    first passing token always has weight; only round-off in u x total can
    reach the total itself, and then the draw is the last token with weight
    (the first whose cumulative sum is the total)."""
    cum = weights.cumsum(1)
    total = cum[:, -1:].contiguous()
    picked = torch.searchsorted(cum, u[:, None] * total, right=True)
    return torch.minimum(picked, torch.searchsorted(cum, total)).squeeze(1)
