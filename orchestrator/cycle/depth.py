"""Each cycle's draft shape, and what a cycle teaches the cost model.

The depth comes from a `DepthPolicy`: fixed (the request's K) or adaptive (the
goodput-best depth, orchestrator/cycle/adaptive.py); `DraftShaper` cuts the
request's shape to it and to what is left of the output and the contexts, and
sets the confidence below which the drafter stops (fixed, or the adaptive
policy's learned one: orchestrator/cycle/confidence.py). Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from orchestrator.cycle.adaptive import CostModel, SessionDepth
from orchestrator.cycle.records import CycleRecord
from specd_core.rules.draft_shape import DraftShape


def draft_budget(k: int, remaining: int, committed: int, target_ctx: int, drafter_ctx: int) -> int:
    """Draft depth this cycle: k, less near the end of max_new_tokens (a cycle
    commits up to depth+1) or of either model's context (the verifier forwards
    positions up to committed+depth-1; the drafter up to committed+depth-2)."""
    return max(0, min(k, remaining - 1, target_ctx - committed - 1, drafter_ctx - committed + 1))


class DepthPolicy(Protocol):
    def choose(self) -> int:
        """The depth wanted for the next draft (before the budget cuts it)."""
        ...

    def observe(self, cycle: CycleRecord) -> None:
        """Learn the acceptance per level from a finished cycle."""
        ...

    def threshold(self, k: int) -> float:
        """The learned confidence threshold for a draft of depth k (0 = off)."""
        ...


@dataclass
class FixedDepth:
    """The request's K every cycle."""

    k: int
    costs: CostModel

    def choose(self) -> int:
        return self.k

    def observe(self, cycle: CycleRecord) -> None:
        if cycle.depth:  # fixed-K sessions teach the shared per-level rates too
            self.costs.observe_levels(cycle.depth, cycle.accepted)

    def threshold(self, k: int) -> float:
        return 0.0  # a fixed draft is drafted as asked


@dataclass
class AdaptiveDepth:
    """The goodput-best depth for this session's acceptance and the verify
    forward it shared last (the other sessions' rows)."""

    session: SessionDepth
    costs: CostModel
    rest_rows: int = 0  # the other sessions of this session's last verify forward
    rest_sessions: int = 0

    def choose(self) -> int:
        return self.session.choose(self.costs, self.rest_rows, self.rest_sessions)

    def observe(self, cycle: CycleRecord) -> None:
        self.session.observe(cycle.depth, cycle.accepted, self.costs)
        self.rest_rows = max(0, cycle.verdict.batch_tokens - (len(cycle.draft.tokens) + 1))
        self.rest_sessions = max(0, cycle.verdict.batch_sessions - 1)

    def threshold(self, k: int) -> float:
        return self.session.threshold(self.costs, k, self.rest_rows, self.rest_sessions)


def depth_policy(k: int, adaptive: bool, costs: CostModel) -> DepthPolicy:
    """k: the request's depth, the most an adaptive one goes to."""
    return AdaptiveDepth(SessionDepth(k), costs) if adaptive else FixedDepth(k, costs)


@dataclass
class DraftShaper:
    """The draft shape of a cycle starting at `committed` tokens."""

    shape: DraftShape
    depth: DepthPolicy
    target_ctx: int
    drafter_ctx: int
    # The drafter's stopping threshold (DraftShape.min_confidence): fixed (0 =
    # off), or None = the depth policy's learned one for the chosen depth.
    confidence: float | None = 0.0
    # Shapes made so far, by what decides them: a session asks for the same
    # one cycle after cycle, and making one (cut, fit, checks) is a good part
    # of a cycle's own work in the orchestrator.
    _made: dict = field(default_factory=dict, repr=False)
    # Room past the whole shape's nodes and rows changes nothing in fit().
    _enough: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._enough = max(self.shape.max_nodes, self.shape.forward_rows)

    def next(self, committed: int, remaining: int) -> DraftShape | None:
        """None: no room for a draft (a plain decode step)."""
        k = self.depth.choose()
        depth = draft_budget(k, remaining, committed, self.target_ctx, self.drafter_ctx)
        enough = self._enough
        rooms = min(self.target_ctx - committed, enough), min(self.drafter_ctx - committed, enough)
        threshold = self.depth.threshold(k) if self.confidence is None else self.confidence
        key = (depth, rooms, threshold)
        shape = self._made.get(key, False)
        if shape is False:
            if len(self._made) >= 64:  # a learned threshold moves: keep only the recent ones
                self._made.clear()
            shape = self._made[key] = self._make(depth, rooms, threshold)
        return shape

    def _make(self, depth: int, rooms: tuple[int, int], threshold: float) -> DraftShape | None:
        cut = self.shape.truncated(depth)
        # A wide tree's nodes are rows too: fewer levels near the context's end.
        fitted = cut.fit(*rooms) if cut is not None else None
        return None if fitted is None else fitted.with_confidence(threshold)


def learn_costs(costs: CostModel, cycle: CycleRecord) -> None:
    """What one cycle measured: its verify forward (once per forward: the
    sessions batched in it all report it), its drafter batch, the tokens it
    committed and the rest of its wall time."""
    draft, verdict = cycle.draft, cycle.verdict
    if not verdict.batch_id or verdict.batch_id != costs.last_forward:
        costs.last_forward = verdict.batch_id
        rows = len(draft.tokens) + 1
        costs.observe_verify(verdict.batch_tokens or rows, verdict.batch_sessions or 1, verdict.compute_ms)
    costs.observe_draft(draft.batch_tokens or len(draft.tokens), draft.compute_ms)
    costs.observe_tokens(len(verdict.tokens))
    costs.confidence.observe(draft.parents, draft.confidences, verdict.path)
    # A pre-draft's compute ran beside an earlier verify: only the draft waited for counts.
    costs.observe_cycle(cycle.wall_ms, verdict.compute_ms, 0.0 if draft.ahead else draft.compute_ms)
