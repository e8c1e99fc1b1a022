"""How the lean forward's new rows attend (specd_core/runtime/lean.py): the
additive masks and key ranges per window size, and Gemma-2's soft-capped
attention, which SDPA does not compute.

Sliding windows: a key is attended when the query's position minus its position
is below the window (Hugging Face's rule). Positions are not stored per cache
row; instead a row attends to the last `window` keys that its mask lets it see.
The rows a mask shows a query (the committed sequence, then its tree ancestors,
then itself) are its own sequence, at consecutive positions - so the last
`window` of them are exactly the keys within the window, trees included. A window
at least as long as the cache is plain attention.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Attend(NamedTuple):
    """How one item's new rows attend in layers of one window size."""

    k0: int  # first cache row they may see (a window shorter than the cache starts later)
    mask: torch.Tensor | None  # additive, (1, 1, n, end - k0); None: see causal
    causal: bool  # without a mask: causal over the new rows (no cached rows before)


def attend_rows(
    mask: torch.Tensor | None,
    n: int,
    start: int,
    end: int,
    window: int | None,
    kvt: torch.dtype,
    device: torch.device,
    softcap: float | None,
) -> Attend:
    """How n new rows after start cached ones attend, in layers with this
    window. mask: the item's (a tree's), None: causal; kvt: the cache's
    dtype; softcap: the model's attention soft-cap (its path needs a mask)."""
    if window is None or window >= end:  # every key the mask allows is within the window
        attn_mask, causal = _attn_mask(mask, n, start, end, kvt, device)
        if causal and softcap is not None:  # the explicit path needs the mask itself
            attn_mask = torch.full((n, n), float("-inf"), dtype=kvt, device=device).triu(1)[None, None]
            causal = False
        return Attend(0, attn_mask, causal)
    if mask is None:
        # A row at r sees keys (r - window, r]: slice the cache from the first row's first key.
        k0 = max(0, start - window + 1)
        if n == 1:
            return Attend(k0, None, False)
        rows = torch.arange(start, end, device=device)[:, None]
        keys = torch.arange(k0, end, device=device)[None]
        seen = (keys <= rows) & (keys > rows - window)
        attn_mask = torch.zeros(n, end - k0, dtype=kvt, device=device).masked_fill_(~seen, float("-inf"))
        return Attend(k0, attn_mask[None, None], False)
    # A given mask (a tree): keep the last `window` keys each row may see.
    attn_mask = mask.to(device, kvt)
    seen = attn_mask > torch.finfo(kvt).min / 2
    later = seen.flip(-1).cumsum(-1).flip(-1)  # keys seen at or after each column
    return Attend(0, attn_mask.masked_fill(later > window, float("-inf"))[None, None], False)


def _attn_mask(
    mask: torch.Tensor | None, n: int, start: int, end: int, kvt: torch.dtype, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """(additive mask (1, 1, n, end) or None, is_causal) for n new rows after start cached ones."""
    if mask is not None:
        return mask.to(device, kvt)[None, None], False
    if n > 1 and start > 0:
        # Causal over the new rows, full attention to the past.
        attn_mask = torch.full((n, end), float("-inf"), dtype=kvt, device=device)
        attn_mask[:, :start] = 0
        attn_mask[:, start:] = torch.triu(attn_mask[:, start:], diagonal=1)
        return attn_mask[None, None], False
    return None, n > 1


def capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, cap: float, scale: float
) -> torch.Tensor:
    """Attention with tanh soft-capped scores (Gemma-2), in Hugging Face's
    eager order: scale, cap, mask, softmax in float32. SDPA has no cap, so
    this is explicit. q (nh, n, hd), k/v (nkv, L, hd) -> (nh, n, hd)."""
    nh, n, hd = q.shape
    nkv = k.shape[0]
    g = nh // nkv  # query heads per KV head, grouped as HF's repeat_kv does
    scores = torch.matmul(q.reshape(nkv, g * n, hd), k.transpose(1, 2)).view(nh, n, -1) * scale
    scores = torch.tanh(scores / cap) * cap
    if attn_mask is not None:
        scores = scores + attn_mask[0]
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs.view(nkv, g * n, -1), v).view(nh, n, hd)
