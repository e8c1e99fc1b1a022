"""Where the drafter's confidence pays: acceptance per confidence bucket, and
the stopping threshold it implies (pure; no grpc).

The drafter reports, per draft node, its confidence c: its own probability of
the token it chose there (ProposeResponse.draft_confidences). With a threshold
t it drafts nothing below a node with c < t: the node itself is proposed, its
subtree is not (a chain ends at its first unsure token; docs/rules.md).

Learning. A verdict says something about a node only when the verifier tried
it: its parent was kept (the root always is) and no elder sibling was kept
first (the rules try a node's children in order and stop at the first kept).
Nodes below a rejection were never judged and teach nothing; counting them as
rejected would make deep, confident nodes look bad. So each bucket of c (10
of width 0.1) learns, as decayed counts:

* P(kept | its parent kept, c in the bucket), shrunk toward a prior (the
  bucket's midpoint: a calibrated drafter);
* P(the path goes on below it | it was kept and had children, c in the
  bucket), shrunk toward that rate over all buckets: acceptances are
  correlated (after a kept token the next is likelier kept), so the mean
  acceptance of a tried node would undervalue what follows a kept one.

A bucket counts only once it has `min_weight` observations of its own; before
that it never stops a draft, so a fresh table leaves drafting as it was.

The threshold. Drafting below a node of confidence c costs one more verify row
and one more drafter level (`extra_ms`, the cost model's marginal round cost)
and commits one more token only if the node is kept and then its child:
expected P(kept | c) * P(goes on | kept, c) tokens, each worth `token_ms` (the
round's ms per committed token now: what the server pays for a token without
it). So below c is worth drafting iff

    P(kept | c) * P(goes on | kept, c) * token_ms >= extra_ms

and t is the upper edge of the highest bucket that fails it, after the
buckets' gains are made non-decreasing in c (pool-adjacent-violators,
weighted by count), so that one noisy bucket cannot cut above a better one.
Looking one node ahead is enough: a node further down is kept only if the
child is, so when the child does not pay for its row and level no deeper
node does. It is capped at the top bucket's lower edge: whether to draft at
all is the depth policy's choice (orchestrator/cycle/adaptive.py, k = 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

BUCKETS = 10


def bucket_of(confidence: float, buckets: int = BUCKETS) -> int:
    return min(buckets - 1, max(0, int(confidence * buckets)))


def tried_nodes(parents: list[int], path: list[int]) -> list[tuple[int, bool]]:
    """(node, kept) for the nodes the verifier judged: parent kept (or the
    root) and no elder sibling kept before it. Nodes are in tree order:
    parents before children, siblings in the order the rules try them."""
    kept = set(path)
    open_parents = {-1} | kept  # parents whose children were tried, until one is kept
    out = []
    for node, parent in enumerate(parents):
        if parent in open_parents:
            out.append((node, node in kept))
            if node in kept:
                open_parents.discard(parent)
    return out


def monotone(rates: list[float], weights: list[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit of rates (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for r, w in zip(rates, weights):
        blocks.append([r, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [m for m, _, n in blocks for _ in range(int(n))]


def confidence_threshold(
    rates: list[float],
    onward: list[float],
    known: list[bool],
    weights: list[float],
    token_ms: float,
    extra_ms: float,
) -> float:
    """The lowest confidence worth drafting below (module docstring); 0 = off.
    rates[b]: P(kept | parent kept, confidence in bucket b); onward[b]: P(a
    child kept | kept, bucket b); known[b]: bucket b has data enough to
    decide; weights[b]: its observations (for the fit)."""
    n = len(rates)
    idx = [b for b in range(n) if known[b]]
    if not idx or token_ms <= 0.0:
        return 0.0
    fitted = monotone([rates[b] * onward[b] for b in idx], [weights[b] for b in idx])
    bar = extra_ms / token_ms
    failing = [b for b, r in zip(idx, fitted) if r < bar]
    if not failing:
        return 0.0
    return min(max(failing) + 1, n - 1) / n


@dataclass
class ConfidenceTable:
    """Per confidence bucket: nodes tried and kept, as decayed counts (decay
    per observation of that bucket); shared by the sessions of one method."""

    buckets: int = BUCKETS
    decay: float = 0.99
    prior_weight: float = 2.0  # observations' worth of the prior (the bucket's midpoint)
    # A bucket's own observations before it may stop a draft: a rate from 16
    # draws is within about 0.1 of the truth, from 8 only within 0.15.
    min_weight: float = 16.0
    # Per bucket: nodes tried and kept; kept nodes with children, and those the path went on below.
    _n: list[float] = field(default_factory=list, repr=False)
    _kept: list[float] = field(default_factory=list, repr=False)
    _on_n: list[float] = field(default_factory=list, repr=False)
    _on: list[float] = field(default_factory=list, repr=False)

    def __post_init__(self):
        for name in ("_n", "_kept", "_on_n", "_on"):
            setattr(self, name, getattr(self, name) or [0.0] * self.buckets)

    def observe(self, parents: list[int], confidences: list[float], path: list[int]) -> None:
        """A verified draft (its nodes' parents and confidences) and the path kept."""
        if len(confidences) != len(parents):  # a draft without confidences (ngram, an old drafter)
            return
        inner = {p for p in parents if p >= 0}
        g = self.decay
        for node, kept in tried_nodes(parents, path):
            b = bucket_of(confidences[node], self.buckets)
            self._n[b] = g * self._n[b] + 1.0
            self._kept[b] = g * self._kept[b] + kept
            if kept and node in inner:  # its children were tried: did one of them stay?
                self._on_n[b] = g * self._on_n[b] + 1.0
                self._on[b] = g * self._on[b] + (node != path[-1])

    @property
    def weights(self) -> list[float]:
        return list(self._n)

    @property
    def rates(self) -> list[float]:
        """P(kept | parent kept, bucket), shrunk toward the bucket's midpoint."""
        w0 = self.prior_weight
        return [(k + w0 * (b + 0.5) / self.buckets) / (n + w0) for b, (n, k) in enumerate(zip(self._n, self._kept))]

    @property
    def known(self) -> list[bool]:
        return [n >= self.min_weight for n in self._n]

    @property
    def onward(self) -> list[float]:
        """P(the path goes on below a node | it was kept, bucket), shrunk
        toward the same rate over all buckets (itself shrunk toward 0.5)."""
        w0 = self.prior_weight
        mean = (sum(self._on) + w0 * 0.5) / (sum(self._on_n) + w0)
        return [(k + w0 * mean) / (n + w0) for n, k in zip(self._on_n, self._on)]

    def threshold(self, token_ms: float, extra_ms: float) -> float:
        return confidence_threshold(self.rates, self.onward, self.known, self.weights, token_ms, extra_ms)
