"""The lossless tree rules for every sampled branching tree of a step at once,
on the device that holds the target's law (docs/rules.md, "Sampled sessions:
decided on the device, read once"); chains have their closed form in
specd_core/rules/chain_batch.py, which this walk equals on a chain.

The walk is the tree rules' (specd_core/rules/acceptance.py): at a node, with
r its row's law and qq the law its children were drawn from, try the children
in order; keep child x with probability min(1, r(x) / qq(x)); on a rejection
r becomes norm(max(0, r - qq)) and, for sampled children, qq loses x and is
renormalised (children chosen without sampling each have q = 1 at their own
token: r loses x); a kept child -> its row; no child left -> emit a draw of r.

Every session walks at once: each round of batched operations tests one
child per session (or finds its node exhausted), and a node is tested at most
once, so N + 1 rounds finish a tree of N nodes with no read by the host. The
emitted token is drawn once after the last round, by inverse CDF. On a CPU
each tree walks in Python over the same numbers (decide_trees says why).

Randomness as for chains: N + 1 uniforms per tree from the session's host
generator, node i's test reads uniform i, the emitted token the last one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specd_core.rules.chain_batch import SparseLaw, inverse_cdf, to_device
from specd_core.rules.tree import TokenTree, children


@dataclass(frozen=True)
class TreeDraw:
    """One session's tree, on the host: where its rows start in the step's
    stacked law (row + 0 the root's, row + 1 + i node i's), the tree, each
    row's law its children were drawn from (None: chosen without sampling)
    and its N + 1 uniforms (chain_batch.uniforms)."""

    row: int
    tree: TokenTree
    q: Sequence[SparseLaw] | None
    u: Sequence[float]


class _Layout:
    """The step's trees as padded host lists, packed in one float64 tensor
    (ids are exact in float64) to reach the device in one copy. Each row
    carries the token ids its walk can change (its "set"): the law its
    children were drawn from (sampled), or its children's tokens (point
    masses); -1 pads."""

    def __init__(self, draws: Sequence[TreeDraw]):
        self.s = len(draws)
        self.n = max(1, max(len(d.tree.tokens) for d in draws))  # nodes, padded
        kids = [children(d.tree) for d in draws]
        self.b = max([1] + [len(k) for ks in kids for k in ks])  # children of a row, padded
        self.kids = kids
        self.sets = sets = [self._sets(d, ks) for d, ks in zip(draws, kids)]
        self.w = max([1] + [len(ids) for rows in sets for ids, _ in rows])  # a set's entries, padded
        values: list[float] = []
        for d in draws:
            values += [d.row, d.q is None]
        for d in draws:
            values += [*d.tree.tokens] + [0] * (self.n - len(d.tree.tokens))
        for ks in kids:
            for k in ks + [[]] * (self.n + 1 - len(ks)):
                values += [*k] + [-1] * (self.b - len(k))
        for rows in sets:
            for ids, ps in rows + [((), ())] * (self.n + 1 - len(rows)):
                values += [*ids] + [-1] * (self.w - len(ids))
                values += [*ps] + [0.0] * (self.w - len(ps))
        for d in draws:
            size = len(d.tree.tokens)
            values += [*d.u[:size]] + [0.0] * (self.n - size) + [d.u[size]]
        self.packed = torch.tensor(values, dtype=torch.float64)

    @staticmethod
    def _sets(d: TreeDraw, kids: list[list[int]]) -> list[SparseLaw]:
        size = len(d.tree.tokens)
        if len(d.u) != size + 1:
            raise ValueError(f"a tree of {size} nodes needs {size + 1} uniforms, got {len(d.u)}")
        if d.q is None:
            return [([d.tree.tokens[c] for c in k], [0.0] * len(k)) for k in kids]
        if len(d.q) != size + 1:
            raise ValueError(f"a tree of {size} nodes needs {size + 1} draft laws (one per row), got {len(d.q)}")
        return list(d.q)

    def on(self, device: torch.device) -> dict[str, torch.Tensor]:
        s, n, b, w = self.s, self.n, self.b, self.w
        x = to_device(self.packed, device)
        head, tok, kids, sets, u = x.split([2 * s, s * n, s * (n + 1) * b, s * (n + 1) * 2 * w, s * (n + 1)])
        head = head.view(s, 2)
        sets = sets.view(s, n + 1, 2, w)
        return {
            "root": head[:, 0].long(),
            "point_mass": head[:, 1] > 0,
            "tok": tok.view(s, n).long(),
            "kids": kids.view(s, n + 1, b).long(),
            "set_ids": sets[:, :, 0].long(),
            "set_q": sets[:, :, 1],
            "u": u.view(s, n + 1),
        }


def decide_trees(probs: torch.Tensor, draws: Sequence[TreeDraw], batched: bool | None = None) -> torch.Tensor:
    """(S, N + 2) int64 on probs' device: each tree's kept nodes k, the token
    it emits, then the kept path's node indices root-down (-1 past k).
    probs (R, V): the step's stacked law.

    A node's law r is kept as its row of probs with the entries of the
    row's set replaced (`base`, unnormalised) over a total `mass`: only the
    set's entries change while its children are tried, and the whole row is
    read once, for the draw. On a GPU every tree walks at once (`_walk`:
    N + 1 rounds of batched operations); on a CPU, where the law is in host
    memory already and a round's dozens of small operators cost more than
    the walk itself, each tree walks in Python over its sets' entries
    (`_walk_on_host`), the same steps on the same numbers. batched: force
    one or the other (None: by device)."""
    if not draws:
        return torch.zeros(0, 2, dtype=torch.long, device=probs.device)
    lay = _Layout(draws)
    if batched is False or (batched is None and probs.device.type == "cpu"):
        return _walk_on_host(probs, lay, draws)
    return _walk(probs, lay)


def _walk(probs: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """Every tree at once: each round tests one child per session."""
    t = lay.on(probs.device)
    s, n, b = lay.s, lay.n, lay.b
    dev, last_row = probs.device, probs.shape[0] - 1
    at = torch.arange(s, device=dev)
    cur = torch.zeros(s, dtype=torch.long, device=dev)  # the row walked: 0 the root, 1 + i node i
    tried = torch.zeros(s, dtype=torch.long, device=dev)  # its children tried so far
    kept = torch.zeros(s, dtype=torch.long, device=dev)
    path = torch.full((s, n), -1, dtype=torch.long, device=dev)
    done = torch.zeros(s, dtype=torch.bool, device=dev)
    ids, qq = t["set_ids"][:, 0], t["set_q"][:, 0]
    base = _entries(probs, t["root"], ids)
    mass = torch.ones(s, dtype=torch.float64, device=dev)
    for _ in range(n + 1):
        child = torch.where(tried < b, t["kids"][at, cur, tried.clamp(max=b - 1)], -1)
        done = done | (child < 0)  # no child left: r is the law it emits from
        node = child.clamp(min=0)
        x = t["tok"][at, node]
        hit = ids == x[:, None]  # x's entry in the set
        # The law this child was drawn from, on the set: its row's q, or 1 at x.
        q_set = torch.where(t["point_mass"][:, None], hit.double(), qq)
        qx = (q_set * hit).sum(1)
        keep = ~done & (qx > 0) & (t["u"][at, node] * qx * mass < (base * hit).sum(1))
        drop = ~done & ~keep
        # Rejected: r owes norm(max(0, r - q)); zero mass left only comes from
        # round-off (the rejection had probability 0): r stays.
        cut = (base - mass[:, None] * q_set).clamp(min=0.0)
        left_mass = mass - (base - cut).sum(1)
        owes = drop & (left_mass > 0)
        base, mass = torch.where(owes[:, None], cut, base), torch.where(owes, left_mass, mass)
        rest = torch.where(hit, 0.0, qq)  # the next sibling's law: q without x
        total = rest.sum(1, keepdim=True)
        qq = torch.where(drop[:, None], torch.where(total > 0, rest / total.clamp(min=1e-300), rest), qq)
        # Kept: the walk goes on at the child's row, with its row's law.
        row = node + 1
        ids = torch.where(keep[:, None], t["set_ids"][at, row], ids)
        qq = torch.where(keep[:, None], t["set_q"][at, row], qq)
        below = _entries(probs, (t["root"] + row).clamp(max=last_row), ids)
        base, mass = torch.where(keep[:, None], below, base), torch.where(keep, 1.0, mass)
        slot = kept.clamp(max=n - 1)
        path[at, slot] = torch.where(keep, node, path[at, slot])
        kept = kept + keep.long()
        cur = torch.where(keep, row, cur)
        tried = torch.where(keep, 0, tried + drop.long())
    # The law emitted from: its row, the set's entries changed to `base`
    # (added as a change, as decide_chains does: pads add 0).
    weights = probs[t["root"] + cur].double()
    entries = ids.clamp(min=0)
    weights.scatter_add_(1, entries, torch.where(ids >= 0, base - weights.gather(1, entries), 0.0))
    return torch.cat([kept[:, None], inverse_cdf(weights, t["u"][:, n])[:, None], path], 1)


def _walk_on_host(probs: torch.Tensor, lay: _Layout, draws: Sequence[TreeDraw]) -> torch.Tensor:
    """Each tree in turn, in Python floats: every set's entries of probs read
    in one gather, then one batched draw from the rows the walks end at."""
    t = lay.on(probs.device)
    n = lay.n
    rows = (t["root"][:, None] + torch.arange(n + 1)).clamp(max=probs.shape[0] - 1)
    found = torch.where(t["set_ids"] >= 0, probs[rows[:, :, None], t["set_ids"].clamp(min=0)].double(), 0.0)
    paths, ends, at, ids, change = [], [], [], [], []
    for i, (d, kids, sets, entries) in enumerate(zip(draws, lay.kids, lay.sets, found.tolist())):
        path, row, base = _walk_one(d, kids, sets, entries)
        paths.append(path)
        ends.append(d.row + row)
        at += [i] * len(base)
        ids += sets[row][0]
        change += [b - e for b, e in zip(base, entries[row])]  # as _walk adds it
    weights = probs[ends].double()
    weights.index_put_(
        (torch.tensor(at, dtype=torch.long), torch.tensor(ids, dtype=torch.long)),
        torch.tensor(change, dtype=torch.float64),
        accumulate=True,
    )
    tokens = inverse_cdf(weights, t["u"][:, n]).tolist()
    return torch.tensor([[len(p), tok] + p + [-1] * (n - len(p)) for p, tok in zip(paths, tokens)])


def _walk_one(d: TreeDraw, kids: list[list[int]], sets: list[SparseLaw], entries: list[list[float]]):
    """One tree's walk (as _walk's rounds): (kept path, the row it ends at,
    that row's set entries of the law it emits from, unnormalised)."""
    path: list[int] = []
    row = 0
    while True:
        ids, q = sets[row]
        base, mass, qq = entries[row][: len(ids)], 1.0, [*q]
        for c in kids[row]:
            j = ids.index(d.tree.tokens[c])
            q_set = [float(k == j) for k in range(len(ids))] if d.q is None else qq
            if q_set[j] > 0 and d.u[c] * q_set[j] * mass < base[j]:
                break
            cut = [max(0.0, b - mass * v) for b, v in zip(base, q_set)]
            left = mass - sum(b - v for b, v in zip(base, cut))
            if left > 0:  # zero only from round-off: the rejection had probability 0
                base, mass = cut, left
            rest = [0.0 if k == j else v for k, v in enumerate(qq)]
            total = sum(rest)
            qq = [v / total for v in rest] if total > 0 else rest
        else:
            return path, row, base
        path.append(c)
        row = c + 1


def _entries(probs: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """probs[rows[i], ids[i, j]] in float64, 0 at pads (id -1)."""
    return torch.where(ids >= 0, probs[rows[:, None], ids.clamp(min=0)].double(), 0.0)
