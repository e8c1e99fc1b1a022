"""A token tree on a model's tensors: the attention mask and positions of one
tree forward, and the KV compaction that keeps the accepted path's rows.

The tree itself is pure data (specd_core/rules/tree.py); these are what the
HF engine does with it (the lean engine builds its masks for a whole step at
once: specd_core/runtime/lean_step.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specd_core.rules.tree import TokenTree, depth


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


class TreeLevel(NamedTuple):
    """One level of a tree grown on a drafter, as a forward item's mask (in
    place of a dense one): its rows are nodes appended after the rows already
    cached; row r sees the committed rows [0, past), the cache rows of its
    ancestors among the tree's nodes (`ancestors[r]`, ascending), and itself.
    Host integers only: the lean engine turns them into its step's mask
    without an operator per session (specd_core/runtime/lean_step.py); other
    consumers take `dense`."""

    past: int
    positions: tuple[int, ...]  # each row's RoPE position (past - 1 + its depth)
    ancestors: tuple[tuple[int, ...], ...]

    def hidden(self, start: int) -> list[tuple[int, int]]:
        """The (row, cache row) pairs a causal mask over rows appended at
        `start` would show and this level does not: earlier tree rows that
        are not the row's ancestors, and the level's own earlier rows."""
        pairs = []
        for r, seen in enumerate(self.ancestors):
            shown = set(seen)
            pairs += [(r, c) for c in range(self.past, start + r) if c not in shown]
        return pairs

    def parents(self) -> list[int]:
        """Each row's parent's cache row: its nearest ancestor, or the last committed row."""
        return [seen[-1] if seen else self.past - 1 for seen in self.ancestors]

    def dense(self, start: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions (n,), additive float mask (n, start + n): 0 = attend, -inf = not)."""
        n = len(self.positions)
        mask = torch.full((n, start + n), float("-inf"))
        mask[:, : self.past] = 0.0
        for r, seen in enumerate(self.ancestors):
            mask[r, list(seen)] = 0.0
            mask[r, start + r] = 0.0
        return torch.tensor(self.positions, device=device), mask.to(device)


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
