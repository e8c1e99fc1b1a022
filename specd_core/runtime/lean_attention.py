"""Gemma-2's soft-capped attention for the lean forward
(specd_core/runtime/lean.py), which SDPA does not compute: the same padded
batch and masks as the SDPA call (specd_core/runtime/lean_step.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, cap: float, scale: float
) -> torch.Tensor:
    """Attention with tanh soft-capped scores (Gemma-2), in Hugging Face's
    eager order: scale, cap, mask, softmax in float32. q (B, nh, n, hd),
    k/v (B, nkv, L, hd), attn_mask additive (B, 1, n, L) -> (B, nh, n, hd)."""
    b, nh, n, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv  # query heads per KV head, grouped as HF's repeat_kv does
    scores = torch.matmul(q.reshape(b, nkv, g * n, hd), k.transpose(-1, -2)).view(b, nh, n, -1) * scale
    scores = torch.tanh(scores / cap) * cap
    if attn_mask is not None:
        scores = scores + attn_mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs.view(b, nkv, g * n, -1), v).view(b, nh, n, hd)
