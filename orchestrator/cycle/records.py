"""The data of the loop (orchestrator/cycle/loop.py): what a cycle drafts and the
verifier decides, a cycle as a record for whoever reports it, a request's
running totals, and the chunks the loop streams. Plain dataclasses, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.cycle.detok import Emit
from specd_core.runtime.features import HiddenStates


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)  # tree nodes (a chain: parents i-1)
    parents: list[int] = field(default_factory=list)
    row_dists: list = field(default_factory=list)  # sampled children only: q per tree row
    compute_ms: float = 0.0  # of the drafter batch it ran in
    batch_tokens: int = 0  # draft nodes of that batch (0: unknown, this draft alone)
    guess: int | None = None  # an ahead draft: the bonus token it assumed
    call_ms: float = 0.0  # the Propose call's wall time, as the orchestrator saw it
    wait_ms: float = 0.0  # of the cycle's wall time, spent waiting for this draft
    ahead: bool = False  # drafted during the previous verify (pipelined)
    # An ahead draft: the other outcomes it pre-drafted, (kept, correction or
    # bonus token, the chain after it); this draft itself assumes all kept + guess.
    branches: list[tuple[int, int, Draft]] = field(default_factory=list)
    branch: int = 0  # a pipelined draft: its branch (0 = all kept + guess, i = branches[i-1])
    confidences: list[float] = field(default_factory=list)  # per node: the drafter's probability of it
    min_confidence: float = 0.0  # the stopping threshold it was drafted with (0 = off)
    pruned: int = 0  # nodes the threshold left without the children the shape gave them
    # Structured output: the nodes the constraint forced (q = 1), by the
    # drafter within its chain or by the orchestrator after it: the last
    # `tail` nodes (orchestrator/cycle/structured.py).
    forced_nodes: list[int] = field(default_factory=list)
    tail: int = 0

    @property
    def proposed(self) -> int:
        """Nodes the drafter sent (the forced tail excluded)."""
        return len(self.tokens) - self.tail


@dataclass
class Opened:
    """A verifier's answer to an open: the first token (None after a resume),
    the prompt's features (sessions that asked), and the prompt tokens whose
    KV rows came from its prefix cache."""

    first: int | None
    hidden: HiddenStates | None = None
    cached: int = 0


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, root-down
    tokens: list[int]  # path tokens + correction or bonus
    compute_ms: float = 0.0
    batch_sessions: int = 1  # sessions in the verify forward it ran in
    batch_tokens: int = 0  # rows of that forward (0: unknown)
    hidden: HiddenStates | None = None  # spec.features: the target's features of the committed tokens
    batch_id: int = 0  # the forward's id: the same for every session in it (0: unknown)


@dataclass
class CycleRecord:
    """One cycle as data, for whoever reports it (trace attributes, Prometheus)."""

    index: int  # 0-based verify cycle
    draft: Draft
    verdict: Verdict
    wall_ms: float  # the cycle as the orchestrator saw it

    @property
    def accepted(self) -> int:
        return len(self.verdict.path)

    @property
    def depth(self) -> int:
        """Draft depth (a chain: K; 0 = a plain decode step)."""
        depths: list[int] = []
        for p in self.draft.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return max(depths, default=0)

    @property
    def bonus(self) -> bool:
        """The extra token is a bonus (the path reached a leaf), not a correction."""
        return bool(self.verdict.path) and self.verdict.path[-1] not in self.draft.parents

    @property
    def forced_accepted(self) -> int:
        """Forced nodes on the accepted path."""
        forced = set(self.draft.forced_nodes)
        return sum(n in forced for n in self.verdict.path)

    def drafted(self) -> CycleRecord:
        """The cycle as the drafter's proposal alone, without the forced tail:
        what acceptance learning reads (a tail says nothing of the drafter)."""
        if not self.draft.tail:
            return self
        n = self.draft.proposed
        d = self.draft
        draft = Draft(
            d.tokens[:n],
            d.parents[:n],
            [],
            d.compute_ms,
            d.batch_tokens,
            call_ms=d.call_ms,
            wait_ms=d.wait_ms,
            ahead=d.ahead,
        )
        draft.confidences, draft.min_confidence, draft.pruned = d.confidences[:n], d.min_confidence, d.pruned
        kept = [i for i in self.verdict.path if i < n]
        v = self.verdict
        verdict = Verdict(kept, v.tokens[: len(kept) + 1], v.compute_ms, v.batch_sessions, v.batch_tokens)
        return CycleRecord(self.index, draft, verdict, self.wall_ms)

    @property
    def overhead_ms(self) -> float:
        # A pipelined draft's compute ran during the previous cycle, not in this wall time.
        draft_ms = 0.0 if self.draft.ahead else self.draft.compute_ms
        return self.wall_ms - draft_ms - self.verdict.compute_ms


@dataclass
class Stats:
    """A request's totals. Every field, and each property named in the
    servicer's DERIVED_STATS, goes out as the GenerationStats field of the
    same name (orchestrator/edge/servicer.py: stats_to_proto)."""

    cycles: int = 0  # verify passes after the prefill
    drafted_tokens: int = 0  # draft tokens (tree nodes) verified
    accepted_tokens: int = 0
    committed_in_cycles: int = 0
    num_speculative_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    method: str = "off"
    draft_compute_ms: float = 0.0
    verify_compute_ms: float = 0.0
    cycles_wall_ms: float = 0.0
    cycle_overhead_ms: list[float] = field(default_factory=list)  # wall - compute, per cycle
    drafts: int = 0  # cycles that verified a non-empty draft (vLLM's num_drafts)
    # Per draft position (0 = depth 1): cycles whose accepted path reached it.
    accepted_per_position: list[int] = field(default_factory=list)
    adaptive: bool = False  # the depth was chosen per cycle
    pipelined_drafts: int = 0  # cycles that verified a draft made during the previous verify
    pipelined_alternative_drafts: int = 0  # ... from a branch other than the all-kept one
    draft_wait_ms: float = 0.0  # of the cycles' wall time, waiting for drafts
    draft_call_ms: float = 0.0  # the used drafts' Propose calls' own wall time
    feature_bytes: int = 0  # spec.features: hidden-state bytes carried (prefill + cycles)
    confidence_stops: int = 0  # cycles whose draft the confidence threshold cut short
    forced_tokens: int = 0  # draft tokens the output constraint forced (in drafted_tokens too)
    forced_accepted: int = 0  # ... kept by the verifier (in accepted_tokens too)
    resumed_tokens: int = 0  # a resumed stream: the tokens it resumed from (in completion_tokens too)
    cached_prompt_tokens: int = 0  # prompt tokens the verifier took from its prefix cache

    def __post_init__(self):
        self.accepted_per_position = self.accepted_per_position or [0] * self.num_speculative_tokens

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify pass, the correction/bonus token included."""
        return self.committed_in_cycles / self.cycles if self.cycles else 0.0

    def observe_cycle(self, draft: Draft, verdict: Verdict, wall_ms: float) -> CycleRecord:
        self.cycles += 1
        self.drafts += bool(draft.tokens)
        self.drafted_tokens += len(draft.tokens)
        self.accepted_tokens += len(verdict.path)
        self._reached(len(verdict.path))
        self.committed_in_cycles += len(verdict.tokens)
        self.draft_compute_ms += draft.compute_ms
        self.verify_compute_ms += verdict.compute_ms
        self.cycles_wall_ms += wall_ms
        self.pipelined_drafts += draft.ahead
        self.pipelined_alternative_drafts += draft.ahead and draft.branch > 0
        self.draft_wait_ms += draft.wait_ms
        self.draft_call_ms += draft.call_ms
        self.confidence_stops += draft.pruned > 0
        record = CycleRecord(self.cycles - 1, draft, verdict, wall_ms)
        self.forced_tokens += len(draft.forced_nodes)
        self.forced_accepted += record.forced_accepted
        self.cycle_overhead_ms.append(record.overhead_ms)
        return record

    def _reached(self, accepted: int) -> None:
        """The accepted path reached draft positions 0..accepted-1."""
        for i in range(accepted):
            if i == len(self.accepted_per_position):  # a path deeper than K: never, but be safe
                self.accepted_per_position.append(0)
            self.accepted_per_position[i] += 1


@dataclass
class Chunk:
    emit: Emit
    stats: Stats
    cycle: CycleRecord | None = None  # the cycle that produced it (None: the prefill)
