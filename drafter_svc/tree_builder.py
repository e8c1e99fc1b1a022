"""Growing a draft token tree on the drafter's model (pure of grpc).

Shapes are data (`DraftShape`): a chain of K is the static tree (1,)*K, a static
tree is a branching factor per depth (Medusa / SpecInfer style), and a dynamic
tree grows the nodes of highest cumulative draft probability until a node budget
is spent (EAGLE-2, Li et al. 2024). One forward per depth: the nodes of a level
go through the model together, each seeing the committed tokens, its own
ancestors among the tree nodes already in the cache, and itself.

Children are chosen by top-k (greedy requests and dynamic trees: the verifier
uses the greedy / deterministic-children rule) or, for sampled requests on
static trees, drawn WITHOUT replacement from the drafter's truncated q, which
travels with the tree (the verifier uses the sampled-children rule).

Every node carries its confidence: the drafter's probability of the token it
chose there, in the law it chose it from (a sampled child: its q; a top-k
child: its softmax probability). With `shape.min_confidence` set, a node under
it gets no children (it is a leaf, kept): a chain ends at its first unsure
token. The rule decides only whether a position is drafted, from the tokens
before it - never whether a drawn token is kept - so each token is still
proposed exactly as drawn from the q that travels with it, and the verifier's
rules stay exact (docs/rules.md, "Stopping where the drafter is unsure").
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams, logits_to_probs, truncate_top
from specd_core.runtime.grammar import Constraint, apply_masks
from specd_core.runtime.models import dense_item
from specd_core.runtime.tree_tensors import TreeLevel


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # Per row (0 = root, i+1 = node i): the truncated q that row's children were
    # drawn from, only when children were sampled; else empty.
    row_dists: list[tuple[list[int], list[float]]] = field(default_factory=list)
    # Node indices in the order their KV rows follow the committed tokens in the cache.
    forwarded: list[int] = field(default_factory=list)
    # Chains on the lean engine: per node, the drafter's ranked top choices
    # where that node was drafted - an ahead call's likely corrections
    # (drafter_svc/branches.py). Empty when not recorded.
    tops: list[list[int]] = field(default_factory=list)
    # Per node: the drafter's probability of its token where it chose it.
    confidences: list[float] = field(default_factory=list)
    # Nodes left without the children their shape gave them, because their
    # confidence was under shape.min_confidence.
    pruned: int = 0
    # Nodes the output constraint forced (q = 1 at each; grow_chains).
    forced: list[int] = field(default_factory=list)


def extends(confidence: float, threshold: float) -> bool:
    """Whether the tree grows below a node of this confidence (threshold 0: always)."""
    return confidence >= threshold


def top_with_confidence(rows: torch.Tensor, n: int) -> tuple[list[list[int]], list[float]]:
    """The n best ids of each row of logits (R, V), best first, and the
    softmax probability of each row's first: one transfer to the host."""
    top = torch.topk(rows, n)
    first = torch.exp(top.values[:, :1].float() - torch.logsumexp(rows.float(), -1, keepdim=True))
    # ids as float64 are exact (< 2**53): ids and probabilities come over together.
    out = torch.cat([top.indices.double(), first.double()], 1).tolist()
    return [[int(i) for i in r[:n]] for r in out], [r[n] for r in out]


def _sample_without_replacement(ids: torch.Tensor, probs: torch.Tensor, n: int, gen) -> tuple[list[int], list[float]]:
    """n draws without replacement; the ids, and each one's probability in q."""
    left, out, conf = probs.clone(), [], []
    for _ in range(min(n, int((probs > 0).sum()))):
        j = int(torch.multinomial(left, 1, generator=gen))
        out.append(int(ids[j]))
        conf.append(float(probs[j]))
        left[j] = 0.0
    return out, conf


class _Grower:
    """Holds the tree while it grows; `level` makes the forward of one depth."""

    def __init__(self, session, past_len: int, constraint: Constraint | None = None):
        self.s, self.past, self.constraint = session, past_len, constraint
        self.tree = DraftTree()
        self.depth: list[int] = []
        self.ancestors: list[list[int]] = []  # per node: ancestor node indices

    def add(self, token: int, parent: int, confidence: float) -> int:
        self.tree.tokens.append(token)
        self.tree.parents.append(parent)
        self.tree.confidences.append(confidence)
        self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        self.ancestors.append([] if parent < 0 else self.ancestors[parent] + [parent])
        return len(self.tree.tokens) - 1

    def masked(self, logits: torch.Tensor, node: int) -> torch.Tensor:
        """The logits of `node`'s children (-1: the root's) with what the
        output constraint forbids after its path at -inf (no constraint: as they are)."""
        if self.constraint is None:
            return logits  # no path to build
        path = [] if node < 0 else [self.tree.tokens[a] for a in self.ancestors[node]] + [self.tree.tokens[node]]
        return masked_row(self.constraint, logits, path)

    def level(self, nodes: list[int]) -> tuple:
        """The forward of these nodes in one pass, as a batch item
        (session, token ids, positions, mask: None or a TreeLevel); they
        count as forwarded from now."""
        fwd = self.tree.forwarded
        tokens = [self.tree.tokens[n] for n in nodes]
        if len(nodes) == 1 and len(self.ancestors[nodes[0]]) == len(fwd):
            # One node that sees everything cached (every level of a chain): the
            # plain causal forward, no mask to build.
            fwd += nodes
            return self.s, tokens, None, None
        row_of = {n: self.past + i for i, n in enumerate(fwd)}
        # The root (last committed token) sits at past-1; a node at depth d at past-1+d.
        level = TreeLevel(
            self.past,
            tuple(self.past - 1 + self.depth[n] for n in nodes),
            tuple(tuple(row_of[a] for a in self.ancestors[n]) for n in nodes),
        )
        fwd += nodes
        return self.s, tokens, None, level


def masked_row(constraint: Constraint | None, logits: torch.Tensor, path: list[int]) -> torch.Tensor:
    """One row of draft logits under the output constraint, `path` draft tokens
    past the committed ones: q is then the masked law, and no draft token is
    one the verifier's masked p would give probability 0. No constraint: the
    logits as they are."""
    if constraint is None:
        return logits
    allowed = constraint.allowed(path)
    if allowed is None:
        return logits
    masked = apply_masks(logits, allowed)
    # Nothing the drafter can produce is allowed (an EAGLE-3 head's draft
    # vocabulary, a smaller table): it drafts from its own law instead of a
    # law of NaNs; the verifier's p is 0 there, so the token is rejected, exactly.
    return masked if bool(torch.isfinite(masked).any()) else logits


# A tree's growth as a generator: it yields the nodes of each level that go
# through the model and is sent their logits (len(nodes), V), so that the
# levels of several sessions' trees run in one batched forward
# (grow_trees_batched); each session's draws still use its own generator in
# the order they would alone.
Growth = Generator[list[int], torch.Tensor, None]


def build_tree(
    session,
    root_logits: torch.Tensor,
    shape: DraftShape,
    params: SamplingParams,
    top_n: int,
    gen: torch.Generator,
    constraint: Constraint | None = None,
) -> DraftTree:
    """Grow a tree below the root. The session's cache must hold exactly the
    committed tokens (the root is the last of them); tree nodes are appended.
    constraint: structured output, standing at the committed tokens."""
    return grow_trees_batched(None, [TreeJob(session, root_logits, shape, params, gen, constraint)], top_n)[0]


class TreeJob(NamedTuple):
    """One session's tree for grow_trees_batched."""

    cache: Any  # holding exactly the session's committed tokens
    root: torch.Tensor  # the logits after the last committed token
    shape: DraftShape
    params: SamplingParams
    generator: torch.Generator
    constraint: Constraint | None = None


class Ranked(NamedTuple):
    """A row's best ids and their log-probabilities, best first (rank_rows):
    what a node's greedy or dynamic children are chosen from."""

    ids: list[int]
    logps: list[float]


def rank_rows(rows: list[torch.Tensor], k: int) -> list[Ranked]:
    """The k best ids of each row of logits and their log-probabilities,
    from one top-k per vocabulary width (one, but for a padded pair's rows
    cut to the target's ids) and ONE transfer to the host for them all: not
    a host sync per node, which on a GPU would stall the queue every time."""
    out: list[Ranked] = [Ranked([], [])] * len(rows)
    by_width: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_width.setdefault(r.shape[-1], []).append(i)
    for width, idx in by_width.items():
        x = torch.stack([rows[i] for i in idx]).float()
        kk = min(k, width)
        top = torch.topk(x, kk)
        logp = top.values - torch.logsumexp(x, -1, keepdim=True)
        # ids as float64 are exact (< 2**53): ids and log-probabilities come over together.
        for i, r in zip(idx, torch.cat([top.indices.double(), logp.double()], 1).tolist()):
            out[i] = Ranked([int(t) for t in r[:kk]], r[kk:])
    return out


class Truncated(NamedTuple):
    """A row's truncated q on the host (truncate_top of its law): what a
    sampled node's children are drawn from, and what the verifier is sent."""

    ids: torch.Tensor
    probs: torch.Tensor


def truncated_rows(rows: list[tuple[torch.Tensor, SamplingParams]], top_n: int) -> list[Truncated]:
    """Each row's truncate_top(logits_to_probs(row, its params), top_n), with
    ONE transfer to the host for them all: each row's top entries come over
    at a fixed count, and the cut to the nonzero ones (a size that depends on
    the data, a host sync on a GPU) is made on the host."""
    out: list[Truncated] = []
    by_k: dict[int, list[int]] = {}
    tops = []
    for i, (row, params) in enumerate(rows):
        vals, ids = torch.topk(logits_to_probs(row, params), min(top_n, row.shape[-1]))
        tops.append((vals, ids))
        by_k.setdefault(vals.shape[0], []).append(i)
    host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for idx in by_k.values():
        vals = torch.stack([tops[i][0] for i in idx]).float()
        ids = torch.stack([tops[i][1] for i in idx])
        # ids as float64 are exact (< 2**53): both come over in one transfer.
        both = torch.stack([vals.double(), ids.double()]).cpu()
        vals_h, ids_h = both[0].float(), both[1].long()
        host |= {i: (vals_h[j], ids_h[j]) for j, i in enumerate(idx)}
    for i in range(len(rows)):
        vals, ids = host[i]
        keep = vals > 0
        vals, ids = vals[keep], ids[keep]
        out.append(Truncated(ids, vals / vals.sum()))
    return out


RANKED, TRUNCATED = "ranked", "truncated"


def _prepared(j: TreeJob) -> tuple[str, int] | None:
    """What a tree's rows come to its growth as, batched for the level:
    (RANKED, k) - its nodes' k best choices (rank_rows: greedy and dynamic
    trees), (TRUNCATED, 0) - each row's truncated q (truncated_rows: sampled
    static trees); None - the rows' logits (an output constraint masks each
    node's row by its path first)."""
    if j.constraint is not None:
        return None
    if j.shape.dynamic:
        return RANKED, j.shape.top_k
    if j.params.greedy:
        return RANKED, max(j.shape.children().values())
    return TRUNCATED, 0


def _rows_for(growth_rows: list[tuple[int, torch.Tensor]], jobs: list[TreeJob], top_n: int) -> list:
    """Each tree's rows for its growth (_prepared): Ranked or Truncated rows,
    those of all trees made together, or the logits."""
    kinds = [_prepared(jobs[n]) for n, _ in growth_rows]
    out: list = [lg if kind is None else [] for (_, lg), kind in zip(growth_rows, kinds)]
    for what in (RANKED, TRUNCATED):
        wanted = [
            (t, r)
            for t, (_, lg) in enumerate(growth_rows)
            if (kinds[t] or ("",))[0] == what
            for r in range(lg.shape[0])
        ]
        if not wanted:
            continue
        rows = [growth_rows[t][1][r] for t, r in wanted]
        if what == RANKED:
            made: list = rank_rows(rows, max(kind[1] for kind in kinds if kind and kind[0] == RANKED))
        else:
            made = truncated_rows([(row, jobs[growth_rows[t][0]].params) for row, (t, _) in zip(rows, wanted)], top_n)
        for (t, _), m in zip(wanted, made):
            out[t].append(m)
    return out


def grow_trees_batched(runner, jobs: list[TreeJob], top_n: int) -> list[DraftTree]:
    """Trees of several sessions (static or dynamic, any shapes), each level
    of all of them in one forward (`runner.forward_batch`; None: each
    session's own forward, one after another), the greedy and dynamic trees'
    choices at each level ranked together (rank_rows)."""
    growers = [_Grower(j.cache, j.cache.length, j.constraint) for j in jobs]
    roots = _rows_for([(n, j.root[None]) for n, j in enumerate(jobs)], jobs, top_n)
    running: list[tuple[int, Growth, list[int]]] = []
    for n, (g, j, root) in enumerate(zip(growers, jobs, roots)):
        root = root[0]
        growth = (
            _grow_dynamic(g, root, j.shape)
            if j.shape.dynamic
            else _grow_static(g, root, j.shape.children(), j.params, top_n, j.generator, j.shape.min_confidence)
        )
        running += _advance(n, growth, None)
    while running:
        items = [growers[n].level(nodes) for n, _, nodes in running]
        if runner is None:
            out = [s.forward(ids, **dense_item(s, pos, mask)) for s, ids, pos, mask in items]
        else:
            out = runner.forward_batch(items)
        rows = _rows_for([(n, lg) for (n, _, _), lg in zip(running, out)], jobs, top_n)
        running = [step for (n, growth, _), r in zip(running, rows) for step in _advance(n, growth, r)]
    return [g.tree for g in growers]


def _advance(n: int, growth: Growth, rows) -> list[tuple[int, Growth, list[int]]]:
    """Tree n's next level after these rows ([] once it is grown)."""
    try:
        nodes = next(growth) if rows is None else growth.send(rows)
    except StopIteration:
        return []
    return [(n, growth, nodes)]


def _choose(logits: torch.Tensor | Ranked | Truncated, n: int, params, top_n: int, gen):
    """A node's n children and their confidences: the drafter's top n
    (greedy; no q), or n draws without replacement from its truncated q,
    returned with them (sampled). -> (ids, q or None, confidences).
    logits: the row, or what the level made of it for all trees at once:
    its ranking (greedy: rank_rows) or its truncated q (sampled: truncated_rows)."""
    if isinstance(logits, Truncated):
        chosen, conf = _sample_without_replacement(logits.ids, logits.probs, n, gen)
        return chosen, (logits.ids.tolist(), logits.probs.tolist()), conf
    if isinstance(logits, Ranked):
        # A constraint's forbidden tokens (log-probability -inf) are no children.
        ranked = [(i, math.exp(lp)) for i, lp in zip(logits.ids[:n], logits.logps[:n]) if lp > -math.inf]
        kept = ranked or [(logits.ids[0], 0.0)]
        return [i for i, _ in kept], None, [c for _, c in kept]
    if params.greedy:
        top = torch.topk(logits, n)
        probs = torch.exp(top.values.float() - torch.logsumexp(logits.float(), -1))
        # ids as float64 are exact: ids and confidences come over together.
        ids, conf = torch.stack([top.indices.double(), probs.double()]).tolist()
        # A constraint may allow fewer than n: its forbidden tokens (probability 0) are no children.
        ok = top.values.isfinite().tolist()
        kept = [(int(i), c) for i, c, f in zip(ids, conf, ok) if f] or [(int(ids[0]), conf[0])]
        return [i for i, _ in kept], None, [c for _, c in kept]
    # The draws use the session's CPU generator; the truncated q (top_n entries)
    # comes over once, and it is what the verifier is sent anyway.
    ids, probs = (t.cpu() for t in truncate_top(logits_to_probs(logits, params), top_n))
    chosen, conf = _sample_without_replacement(ids, probs, n, gen)
    return chosen, (ids.tolist(), probs.tolist()), conf


def _grow_static(g: _Grower, root_logits, children: dict, params, top_n, gen, threshold: float = 0.0) -> Growth:
    """children: how many children each node path has (DraftShape.children);
    the k-th child of a node is the drafter's k-th choice there. A node under
    `threshold` keeps none (DraftShape.min_confidence)."""
    sampled = not params.greedy
    # (rank path, node index, its logits)
    frontier: list[tuple[tuple[int, ...], int, torch.Tensor]] = [((), -1, root_logits)]
    dists: dict[int, tuple[list[int], list[float]]] = {}
    while frontier:
        level = []
        for path, node, logits in frontier:
            chosen, dist, conf = _choose(g.masked(logits, node), children[path], params, top_n, gen)
            if dist:
                dists[node + 1] = dist
            level += [(path + (k,), g.add(t, node, c)) for k, (t, c) in enumerate(zip(chosen, conf))]
        # Only nodes with children of their own go through the model.
        parents = [(p, n) for p, n in level if p in children]
        level = [(p, n) for p, n in parents if extends(g.tree.confidences[n], threshold)]
        g.tree.pruned += len(parents) - len(level)
        if not level:
            break
        logits = yield [n for _, n in level]
        frontier = [(p, n, row) for (p, n), row in zip(level, logits)]
    if sampled:
        g.tree.row_dists = [dists.get(r, ([], [])) for r in range(len(g.tree.tokens) + 1)]


class Chain(NamedTuple):
    """One session's chain for grow_chains."""

    cache: Any  # holding exactly the session's committed tokens
    params: SamplingParams
    generator: torch.Generator
    depth: int
    root: torch.Tensor  # the logits after the last committed token
    min_confidence: float = 0.0
    constraint: Constraint | None = None  # structured output
    room: int = 0  # forced nodes it may take besides its depth


def grow_chains(runner, chains: list[Chain], top_n: int, tops: int = 0) -> list[DraftTree]:
    """Chains of several sessions with one batched forward per level (what
    _grow_static does for one chain): each level picks every session's next
    token and forwards those still drafting together: a chain stops at its
    depth or after its first token under its min_confidence, each on its own.
    tops: ranked choices kept per node (DraftTree.tops).

    With an output constraint, masked laws choose every token, and where the
    constraint forces tokens (after the last committed token or after a
    chosen one) up to `room` of them join the chain as forced nodes, q = 1
    each: they ride in the forward of the token before them (the root's
    in a forward of their own) and do not count towards the depth."""
    grown = [DraftTree() for _ in chains]
    levels = [0] * len(chains)  # tokens chosen (not forced) per chain
    active = _force_at_roots(runner, chains, grown, tops)
    while active:
        forward = []
        active = [(i, masked_row(chains[i].constraint, lg, grown[i].tokens)) for i, lg in active]
        ranked = _ranked_greedy(chains, active, tops)
        for i, logits in active:
            levels[i] += 1
            ids = _chain_step(chains[i], grown[i], logits, ranked.get(i), levels[i], top_n, tops)
            if ids:
                forward.append((i, ids))
        if not forward:
            break
        logits = runner.forward_batch([(chains[i].cache, ids, None, None) for i, ids in forward])
        active = [(i, lg[-1]) for (i, _), lg in zip(forward, logits)]
    for tree in grown:
        if tree.row_dists:  # the leaf's own row has no children
            tree.row_dists.append(([], []))
    return grown


def _force_at_roots(runner, chains: list[Chain], grown: list[DraftTree], tops: int) -> list:
    """What the constraint forces right after each chain's last committed token
    joins it first, in one forward for those chains; (chain, the logits its
    first chosen token is drawn from) for every chain."""
    first = [(i, _force(c.constraint, c.room, c.params, grown[i], tops > 0)) for i, c in enumerate(chains)]
    first = [(i, run) for i, run in first if run]
    roots = [(i, c.root) for i, c in enumerate(chains)]
    if not first:
        return roots
    after = runner.forward_batch([(chains[i].cache, run, None, None) for i, run in first])
    ahead = {i: lg[-1] for (i, _), lg in zip(first, after)}
    for i, run in first:
        grown[i].forwarded += range(len(run))
    return [(i, ahead.get(i, lg)) for i, lg in roots]


def _chain_step(
    chain: Chain, tree: DraftTree, logits, ranked: tuple[list[int], float] | None, level: int, top_n: int, tops: int
) -> list[int]:
    """Choose the chain's next token (ranked: its greedy choices, _ranked_greedy)
    and what the constraint forces after it; the ids to forward for the next
    level, or none when the chain is done."""
    if ranked is not None:
        (token, *_), conf = ranked
        dist = None
    else:
        (token,), dist, (conf,) = _choose(logits, 1, chain.params, top_n, chain.generator)
    if dist:
        tree.row_dists.append(dist)
    tree.tokens.append(token)
    tree.parents.append(len(tree.tokens) - 2)
    tree.confidences.append(conf)
    if tops:
        top = ranked[0] if ranked is not None else torch.topk(logits, min(tops, logits.shape[-1])).indices.tolist()
        tree.tops.append(top[:tops])
    node = len(tree.tokens) - 1
    run = _force(chain.constraint, chain.room, chain.params, tree, tops > 0)
    if level < chain.depth and not extends(conf, chain.min_confidence):
        tree.pruned = 1
    elif level < chain.depth:
        tree.forwarded += range(node, node + 1 + len(run))
        return [token, *run]
    return []


def _force(constraint: Constraint | None, room: int, params, tree: DraftTree, tops: bool) -> list[int]:
    """Append the tokens the constraint forces after the chain's last node (at
    most `room` forced nodes in all), as forced nodes; the tokens."""
    if constraint is None or room <= len(tree.forced):
        return []
    run = constraint.forced(tree.tokens)[: room - len(tree.forced)]
    for t in run:
        if not params.greedy:
            tree.row_dists.append(([t], [1.0]))  # the parent row's q: one point
        tree.forced.append(len(tree.tokens))
        tree.tokens.append(t)
        tree.parents.append(len(tree.tokens) - 2)
        tree.confidences.append(1.0)
        if tops:
            tree.tops.append([t])
    return run


def _ranked_greedy(chains: list[Chain], active: list, tops: int) -> dict[int, tuple[list[int], float]]:
    """The greedy chains' ranked choices at this level, {chain: (ids best first
    (max(1, tops) of them), the first one's probability)}, from ONE top-k over
    all their rows and one transfer to the host - not a host sync per session,
    which on a GPU would cost more than the level's forward at a large batch."""
    by_width: dict[int, list] = {}  # rows of one width stack (a padded pair's are cut to the target's ids)
    for i, lg in active:
        if chains[i].params.greedy:
            by_width.setdefault(lg.shape[-1], []).append((i, lg))
    out: dict[int, tuple[list[int], float]] = {}
    for width, greedy in by_width.items():
        rows = torch.stack([lg for _, lg in greedy]) if len(greedy) > 1 else greedy[0][1][None]
        ids, conf = top_with_confidence(rows, max(1, min(tops, width)))
        out |= {i: (r, c) for (i, _), r, c in zip(greedy, ids, conf)}
    return out


def _grow_dynamic(g: _Grower, root_logits, shape: DraftShape) -> Growth:
    """EAGLE-2 style: expand the top_k best nodes of each depth, then keep the
    node_budget nodes of highest cumulative log-probability. A child never
    scores above its parent, so the kept set is closed under ancestors. A
    node under shape.min_confidence is not expanded (the next best is)."""
    score: list[float] = []

    def expand(parent: int, logits: torch.Tensor | Ranked) -> list[int]:
        if isinstance(logits, Ranked):  # batched for the level (rank_rows)
            ranked = zip(logits.logps[: shape.top_k], logits.ids[: shape.top_k])
        else:
            logp = torch.log_softmax(g.masked(logits, parent).float(), -1)
            top = torch.topk(logp, shape.top_k)
            ranked = zip(top.values.tolist(), top.indices.tolist())
        base = score[parent] if parent >= 0 else 0.0
        made = []
        for lp, t in ranked:
            if lp == float("-inf"):  # forbidden by the output constraint
                continue
            made.append(g.add(t, parent, math.exp(lp)))
            score.append(base + lp)
        return made

    level = expand(-1, root_logits)
    for _ in range(shape.max_depth - 1):
        ranked = sorted(level, key=lambda n: -score[n])
        best = [n for n in ranked if extends(g.tree.confidences[n], shape.min_confidence)][: shape.top_k]
        g.tree.pruned += sum(n not in best for n in ranked[: shape.top_k])
        if not best:
            break
        logits = yield best
        level = [c for n, row in zip(best, logits) for c in expand(n, row)]
    keep = sorted(range(len(score)), key=lambda n: (-score[n], g.depth[n]))[: shape.node_budget]
    keep.sort(key=lambda n: (g.depth[n], n))  # parents before children
    new = {old: i for i, old in enumerate(keep)}
    t = g.tree
    g.tree = DraftTree(
        tokens=[t.tokens[n] for n in keep],
        parents=[new[t.parents[n]] if t.parents[n] >= 0 else -1 for n in keep],
        confidences=[t.confidences[n] for n in keep],
        pruned=t.pruned,
        # Forwarded rows stay in the cache in their order; pruned ones map to -1
        # and are dropped by the next compaction.
        forwarded=[new.get(n, -1) for n in t.forwarded],
    )
    assert all(p < i for i, p in enumerate(g.tree.parents)), "kept set must be closed under ancestors"
