"""Prompt-lookup (n-gram) drafting: the draft is what followed the latest earlier
occurrence of the context's suffix (Saxena 2023, "prompt lookup decoding";
vLLM's ngram proposer). No model: free when the output repeats the input
(editing code, quoting sources, rewriting a paragraph)."""

from __future__ import annotations


def propose_ngram(context: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens following an earlier match of the longest context suffix
    of length n_max down to n_min; [] when nothing matches.

    Among matches of that length, the latest one with a full k-token
    continuation wins (recent text predicts best); a match near the end of the
    context has a cut continuation, so failing a full one the longest is used."""
    size = len(context)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = context[size - n :]
        best: list[int] = []
        for start in range(size - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                cont = context[start + n : start + n + k]
                if len(cont) == k:
                    return cont
                if len(cont) > len(best):
                    best = cont
        if best:
            return best
    return []
