"""Token trees: shape, attention mask, lossless acceptance and KV compaction.

Pure core (tensors in, dataclasses out; docs/rules.md, "The rules that keep output
exact": the tree rules). A tree holds N draft nodes below the ROOT, the pending token
(the last emitted token, not yet in the verifier's cache). The verifier forwards
[root, node0 .. node{N-1}] in ONE pass with `tree_attention`'s mask (the lean
engine builds the same mask from the tree itself, for every session of a step
at once: specd_core/runtime/lean_step.py), so row 0 of its output predicts the
root's children and row i+1 predicts node i's children.

Tree shapes are data (Medusa / EAGLE style): a static shape is a list of paths of
child ranks, turned into a parent array by `paths_to_parents`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from specd_core.errors import InvalidRequest
from specd_core.rules.sampling import sample


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


def tree_attention(tree: TokenTree, past_len: int, dtype=torch.float32, device=None):
    """Mask and positions for one forward of [root, node0 .. node{N-1}] after past_len cached tokens.

    mask (1, 1, N+1, past_len+N+1): 0.0 = attend, finfo(dtype).min = blocked. Every row sees
    the whole past and the root; a node also sees its ancestors and itself, so its logits
    equal those of decoding its path sequentially. Give it in the model's dtype: HF uses a
    4D mask as-is and adds it to the attention scores.
    position_ids (1, N+1): past_len + depth (root depth 0), i.e. each node sits at the
    position it would have in its own sequence.
    """
    n = len(tree.tokens) + 1
    seen = torch.zeros(n, n, dtype=torch.bool)  # (N+1, N+1): row sees column
    seen[0, 0] = True
    for i, a in enumerate(tree.parents):  # parents first, so rows are ready
        seen[i + 1] = seen[a + 1]
        seen[i + 1, i + 1] = True
    mask = torch.zeros(1, 1, n, past_len + n, dtype=dtype, device=device)
    mask[0, 0, :, past_len:].masked_fill_(~seen.to(device), torch.finfo(dtype).min)
    pos = torch.tensor([[past_len] + [past_len + d for d in depth(tree)]], dtype=torch.long, device=device)
    return mask, pos


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


def _finish(tree: TokenTree, path: list[int], last: int) -> TreeAcceptance:
    return TreeAcceptance(path, [tree.tokens[i] for i in path] + [last])


def _check_rows(x: torch.Tensor, tree: TokenTree, what: str) -> None:
    if x.dim() != 2 or x.shape[0] != len(tree.tokens) + 1:
        raise ValueError(f"{what} must be (N+1, V) = ({len(tree.tokens) + 1}, V); got {tuple(x.shape)}")


def accept_tree_greedy(logits: torch.Tensor, tree: TokenTree) -> TreeAcceptance:
    """Follow the target's argmax down the tree. logits (N+1, V): row 0 at the root,
    row i+1 at node i. Siblings are distinct, so at most one child matches; every
    emitted token is an argmax at its position, hence bit-identical to greedy decoding."""
    _check_rows(logits, tree, "logits")
    return accept_tree_argmax(logits.argmax(-1).tolist(), tree)


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
            return _finish(tree, path, best[row])
        path.append(match[0])
        row = match[0] + 1


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
            return _finish(tree, path, sample(r, generator))
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
            return _finish(tree, path, sample(r, generator))
        path.append(c)
        row = c + 1


def compaction_indices(path: list[int]) -> list[int]:
    """Rows of the forwarded block [root, node0, ..] to keep: the root, then the path."""
    return [0] + [i + 1 for i in path]


@torch.inference_mode()
def compact_cache(cache, past_len: int, keep: list[int]) -> None:
    """Keep only the forwarded rows `keep` (offsets from past_len, ascending) in a
    transformers Cache, moved to the front of the block; drop the rest.

    In place: per layer, only the kept rows are gathered (a (.., len(keep), D) temporary)
    and written to past_len.., then the tail is cropped (a view, no copy). A kept prefix
    that is already in place (a chain, or the first-child path) copies nothing.
    Runs under inference_mode because caches filled under inference_mode hold
    inference tensors, which may only be written there.
    """
    block = cache.get_seq_length() - past_len
    if (keep and keep[0] < 0) or any(b <= a for a, b in zip(keep, keep[1:])) or (keep and keep[-1] >= block):
        raise ValueError(f"keep must be ascending offsets in [0, {block}); got {keep}")
    n = len(keep)
    if keep != list(range(n)):
        for layer in cache.layers:
            src = torch.tensor(keep, device=layer.keys.device) + past_len
            for t in (layer.keys, layer.values):  # (B, H, S, D)
                t[..., past_len : past_len + n, :] = t[..., src, :]
    if block > n:
        cache.crop(-(block - n))  # transformers >= 5: negative = tokens to remove
