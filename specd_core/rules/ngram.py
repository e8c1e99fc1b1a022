"""Prompt-lookup (n-gram) drafting: the draft is what followed the latest earlier
occurrence of the context's suffix (Saxena 2023, "prompt lookup decoding";
vLLM's ngram proposer). No model: free when the output repeats the input
(editing code, quoting sources, rewriting a paragraph)."""

from __future__ import annotations

import bisect


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


class NgramIndex:
    """propose_ngram over a context that only grows, without rescanning it:
    every n-gram (n_min <= n <= n_max) is indexed once, with the positions it
    starts at, as tokens are added. A draft is then a dictionary lookup and a
    bisection per length instead of a scan of the whole context per length
    and per cycle, which cost the orchestrator more than the rest of an
    n-gram cycle's work on contexts of a few hundred tokens."""

    def __init__(self, n_max: int, n_min: int, context: list[int] | None = None):
        self.n_max, self.n_min = n_max, n_min
        self.context: list[int] = []
        self._starts: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(n_min, n_max + 1)}
        self.extend(context or [])

    def extend(self, tokens: list[int]) -> None:
        ctx = self.context
        for t in tokens:
            ctx.append(t)
            end = len(ctx)
            for n, starts in self._starts.items():
                if end >= n:
                    starts.setdefault(tuple(ctx[end - n :]), []).append(end - n)

    def propose(self, k: int) -> list[int]:
        """propose_ngram(self.context, k, n_max, n_min)."""
        ctx, size = self.context, len(self.context)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            starts = self._starts[n].get(tuple(ctx[size - n :]), [])
            # The last entry is the suffix itself (at size - n), not a match.
            matches = len(starts) - 1
            if matches <= 0:
                continue
            # The latest match whose continuation has all k tokens...
            full = bisect.bisect_right(starts, size - n - k, 0, matches) - 1
            if full >= 0:
                return ctx[starts[full] + n : starts[full] + n + k]
            # ...else the earliest, whose cut continuation is the longest.
            return ctx[starts[0] + n : starts[0] + n + k]
        return []
