"""Speedup theory: expected tokens per cycle and predicted speedup (docs/rules.md,
"Expected tokens per cycle and predicted speedup")."""

from __future__ import annotations


def expected_tokens_per_cycle(alpha: float, k: int) -> float:
    """(1 - a^(K+1)) / (1 - a): accepted drafts + the correction/bonus token,
    for i.i.d. per-token acceptance a (Leviathan et al. 2023, eq. 1)."""
    if k == 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(tokens_per_cycle: float, t_verify_k: float, t_verify_1: float, t_draft_cycle: float) -> float:
    """Tokens per cycle / (cost of a cycle in target single-token forwards).

    t_verify_k: target compute for one verify of the draft (K+1 tokens);
    t_verify_1: for one token (plain decoding); t_draft_cycle: drafter compute
    per cycle. Network and orchestration are deliberately left out: efficiency
    = measured / predicted then shows what they cost."""
    return tokens_per_cycle / ((t_verify_k + t_draft_cycle) / t_verify_1)
