"""Pre-drafts for several verdicts at once (pipelined drafting, lean engine).

While the verifier checks a chain d1..dK, an `ahead` call drafts the next chain
for the verdicts the drafter finds likely: all K kept with its top guess of
the bonus (the branch PEARL's post-verify drafts, Liu et al. 2024), and, per
depth j, "d1..dj kept, d(j+1) rejected, the correction is the drafter's next
choice there" (and further bonus guesses). Whichever branch the verdict
matches becomes the next draft with no drafting on the critical path.

All branches grow together, one forward per depth over all their rows (and
all sessions'), on the lean engine's per-row positions and additive masks: a
branch's rows see the committed prefix up to its own kept tokens, its own
earlier rows and themselves - not the rejected tokens nor other branches
(tree attention as in SpecInfer / Medusa; the mask is plain data built here).

Losslessness: a branch's chain is drawn from the drafter's distribution given
that branch's prefix, exactly as a fresh draft after that verdict would be
(same `_choose`, same truncated q sent along), with the drafter's randomness
only; which branch is used depends on the verdict alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from drafter_svc.tree_builder import DraftTree, _choose, extends
from specd_core.rules.sampling import SamplingParams


@dataclass
class Branch:
    kept: int  # tokens of the last chain this outcome keeps
    token: int  # then the verifier's correction (kept < K) or bonus (kept == K)
    visible: int  # cache rows it attends to: the committed prefix up to its kept tokens
    tree: DraftTree = field(default_factory=DraftTree)
    rows: list[int] = field(default_factory=list)  # its cache rows: the token's, then its chain's forwarded nodes


def outcomes(chain: list[int], tops: list[list[int]], bonus_top: list[int], n: int) -> list[tuple[int, int]]:
    """The (kept, token) verdicts to pre-draft, the all-kept one with the top
    bonus guess first. tops[j]: the drafter's ranked choices where it drafted
    chain[j] (may be missing: then no alternatives at that depth); n: how many
    alternatives per depth, besides the drafted token (and the top bonus guess)."""
    out = [(len(chain), bonus_top[0])]
    for j, tok in enumerate(chain):
        ranked = tops[j] if j < len(tops) else []
        out += [(j, t) for t in [t for t in ranked if t != tok][:n]]
    out += [(len(chain), t) for t in bonus_top[1 : n + 1]]
    return out


def alternatives_that_fit(n: int, k: int, depth: int, rows_free: int) -> int:
    """Fewest-cut number of alternatives per depth whose branches' rows (1 + n(k+1)
    branches, `depth` rows each) fit in the cache: near the context's end the
    drafter makes fewer branches rather than refusing the call."""
    while n > 0 and (1 + n * (k + 1)) * depth > rows_free:
        n -= 1
    return n


def branch_mask(visible: list[int], own: list[list[int]], cached: int) -> torch.Tensor:
    """Additive mask (n, cached + n) for one row per branch appended after `cached`
    rows: row r sees rows [0, visible[r]), its branch's rows own[r], and itself."""
    n = len(visible)
    mask = torch.full((n, cached + n), float("-inf"))
    for r, (v, rows) in enumerate(zip(visible, own)):
        mask[r, :v] = 0.0
        mask[r, rows] = 0.0
        mask[r, cached + r] = 0.0
    return mask


class BranchGroup(NamedTuple):
    """One session's branches for grow_branches."""

    cache: Any
    params: SamplingParams
    generator: torch.Generator
    depth: int
    branches: list[Branch]
    min_confidence: float


def grow_branches(runner, groups: list[BranchGroup], top_n: int, tops: int) -> None:
    """Grow every branch's chain in place, per session (groups); each branch's token is
    forwarded first (at position = its `visible`, the row count before it),
    then its chain grows one node per level, up to `depth` nodes or its first
    node under min_confidence (each branch on its own, as a fresh chain would).
    One forward per level for all groups. tops: ranked choices kept per chain
    node (the next ahead call's alternatives)."""
    # (group, the branches whose last token goes through the model this level)
    pending = [(g, list(g.branches)) for g in groups]
    level = 0
    while pending:
        items = []
        for group, growing in pending:
            cache = group.cache
            at = torch.tensor([b.visible + level for b in growing])
            toks = [b.tree.tokens[-1] if level else b.token for b in growing]
            mask = branch_mask([b.visible for b in growing], [b.rows for b in growing], cache.length)
            items.append((cache, toks, at, mask))
            start = cache.length
            for r, b in enumerate(growing):
                b.rows.append(start + r)
                if level:
                    b.tree.forwarded.append(level - 1)
        logits = runner.forward_batch(items)
        following = []
        for (group, growing), lg in zip(pending, logits):
            params, gen, depth, threshold = group.params, group.generator, group.depth, group.min_confidence
            ranked = torch.topk(lg, min(tops, lg.shape[-1])).indices.tolist() if tops else None
            for r, b in enumerate(growing):
                (token,), dist, (conf,) = _choose(lg[r], 1, params, top_n, gen)
                t = b.tree
                t.parents.append(len(t.tokens) - 1)
                t.tokens.append(token)
                t.confidences.append(conf)
                if dist:
                    t.row_dists.append(dist)
                if ranked:
                    t.tops.append(ranked[r])
                if len(t.tokens) < depth and not extends(conf, threshold):
                    t.pruned = 1
            # Leaves are not forwarded: a full chain, or one stopped at an unsure node.
            on = [b for b in growing if len(b.tree.tokens) < depth and not b.tree.pruned]
            if on:
                following.append((group, on))
        pending = following
        level += 1
    for group in groups:
        for b in group.branches:
            if b.tree.row_dists:  # the leaf's own row has no children
                b.tree.row_dists.append(([], []))
