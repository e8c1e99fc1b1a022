"""Lossless acceptance rules for a chain of draft tokens (DESIGN.md, "The rules").

All functions are pure: tensors in, an `Acceptance` out; randomness only through
the generator passed in. Shapes: K draft tokens, V vocabulary.

  p: (K+1, V) target distributions after the request's sampling processing;
     row i is the distribution of the token at draft position i, row K the bonus.
  q: (K, V) the distributions the draft tokens were drawn from.

References: Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding" (Alg. 1); Chen et al. 2023, "Accelerating LLM Decoding
with Speculative Sampling".
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import sample


@dataclass
class Acceptance:
    num_accepted: int                             # draft tokens kept
    tokens: list[int]                             # kept drafts + correction or bonus
    accepted_mask: list[bool] = field(default_factory=list)  # per draft position


def accept_greedy(target_logits: torch.Tensor, draft_ids: list[int]) -> Acceptance:
    """Keep draft tokens while each equals the target's argmax; then emit argmax.

    target_logits: (K+1, V). Output equals target-only greedy decoding exactly,
    because every emitted token is an argmax of the target at its position.
    """
    argmax = target_logits.argmax(-1).tolist()    # (K+1,)
    n = 0
    while n < len(draft_ids) and draft_ids[n] == argmax[n]:
        n += 1
    return Acceptance(n, draft_ids[:n] + [argmax[n]], [i < n for i in range(len(draft_ids))])


def residual(p_row: torch.Tensor, q_row: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): the distribution to sample after a rejection.

    If p == q everywhere the residual is empty, but then the rejection had
    probability 0; falling back to p only guards against float round-off.
    """
    r = torch.clamp(p_row - q_row, min=0.0)
    total = r.sum()
    return r / total if total > 0 else p_row


def accept_sampled(
    p: torch.Tensor, draft_ids: list[int], q: torch.Tensor, generator: torch.Generator | None
) -> Acceptance:
    """Speculative sampling: keep x_i with prob min(1, p_i(x)/q_i(x)); at the first
    rejection emit a sample of norm(max(0, p_i - q_i)); if all K are kept, emit a
    sample of p_K (the bonus). The emitted sequence is distributed exactly as p."""
    mask: list[bool] = []
    for i, x in enumerate(draft_ids):
        px, qx = float(p[i, x]), float(q[i, x])
        u = float(torch.rand((), generator=generator))
        if qx > 0 and u < min(1.0, px / qx):
            mask.append(True)
            continue
        mask += [False] * (len(draft_ids) - i)
        return Acceptance(i, draft_ids[:i] + [sample(residual(p[i], q[i]), generator)], mask)
    k = len(draft_ids)
    return Acceptance(k, list(draft_ids) + [sample(p[k], generator)], mask)


def accept_deterministic(
    p: torch.Tensor, draft_ids: list[int], generator: torch.Generator | None
) -> Acceptance:
    """Drafts chosen without sampling (argmax drafter, n-gram lookup) under a
    sampled request: q is a point mass, so keep x with prob p(x); on rejection
    sample p with x removed (the tree rule with one child per node)."""
    q = torch.zeros_like(p[:-1])
    if draft_ids:
        q[torch.arange(len(draft_ids)), torch.tensor(draft_ids)] = 1.0
    return accept_sampled(p, draft_ids, q, generator)


def dense_q(token_ids: list[list[int]], probs: list[list[float]], vocab_size: int) -> torch.Tensor:
    """Sparse per-position draft distributions -> dense (K, V) tensor (zeros elsewhere)."""
    q = torch.zeros(len(token_ids), vocab_size)
    for i, (ids, ps) in enumerate(zip(token_ids, probs)):
        q[i, torch.tensor(ids, dtype=torch.long)] = torch.tensor(ps, dtype=torch.float32)
    return q
