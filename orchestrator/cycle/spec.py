"""What one request runs, as the cycle takes it: a checked `GenerationSpec`
(the edges make it from a request: orchestrator/edge/request.py), and the
context lengths its tokens must fit in."""

from __future__ import annotations

from dataclasses import dataclass

from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams

# The methods whose drafter reads the target's features.
FEATURE_METHODS = ("eagle", "eagle3", "medusa")


@dataclass(frozen=True)
class GenerationSpec:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    method: str  # draft_model | eagle | eagle3 | medusa | ngram | off
    shape: DraftShape | None  # the draft each cycle; None = plain decoding
    stop: tuple[str, ...] = ()
    adaptive: bool = False  # choose the depth per cycle (orchestrator/cycle/adaptive.py), up to shape's
    pipeline: bool = False  # draft the next chain during each verify (orchestrator/cycle/drafting.py)
    # ... only while the session is the one this orchestrator has open on its
    # drafter replica (SpeculativeConfig.pipeline "auto")
    pipeline_alone: bool = False
    pipeline_alternatives: int = 0  # ... also for this many rejection outcomes per depth
    # The drafter stops below a node less confident than this (0 = off; None =
    # learned per cycle, adaptive requests: orchestrator/cycle/confidence.py).
    confidence: float | None = 0.0
    # Structured output (sampling.constraint set): forced tokens join chains
    # up to this draft depth in all (0 = no forced drafting).
    forced_room: int = 0
    # A resumed stream (GenerateRequest.resume_token_ids): the tokens the client
    # already has. The sessions open on prompt + these, the output counts them
    # (max_new_tokens, stop strings), the stream carries only what follows.
    resumed: tuple[int, ...] = ()
    # spec.features: the target layers whose states the drafter reads (EAGLE-3's
    # auxiliary layers, specd_core/runtime/head_formats.py); () = the last
    # layer's output before the final norm (EAGLE).
    feature_layers: tuple[int, ...] = ()

    @property
    def context_ids(self) -> list[int]:
        """What the sessions open on: the prompt, and the resumed tokens."""
        return self.prompt_ids + list(self.resumed)

    @property
    def generated_keywords(self) -> dict:
        """The open keywords of a resumed constrained session: its generated
        tokens start after the prompt, and its constraint consumes them."""
        return {"generated_from": len(self.prompt_ids)} if self.resumed and self.sampling.constraint else {}

    @property
    def features(self) -> bool:
        """The drafter reads the target's hidden states (EAGLE): the verifier
        returns them and the loop forwards them with the next Propose."""
        return self.method in FEATURE_METHODS


@dataclass(frozen=True)
class ContextLengths:
    """The context windows a session's tokens must fit: the target's (prompt,
    output and a draft's nodes) and the drafter's (what it has seen and proposes)."""

    target: int
    drafter: int
