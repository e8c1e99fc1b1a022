"""One Propose call as a record: what the orchestrator's clients send
(orchestrator/cycle/ports.py), what the wire carries (ProposeRequest,
specd_core/net/wire.py) and what the drafter core checks and runs
(drafter_svc/core.py), in one place, so that a new flag is written once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specd_core.rules.draft_shape import DraftShape

if TYPE_CHECKING:  # torch stays unloaded in a process that only sends calls
    from specd_core.runtime.features import HiddenStates


@dataclass(frozen=True)
class ProposeCall:
    session_id: str
    # The drafter's last draft as the verifier judged it: the kept nodes
    # (root-down), then every token committed since the last call (the kept
    # tokens, the correction or bonus; more after a failover or a rebuild).
    accepted_path: list[int]
    committed: list[int]
    shape: DraftShape  # the draft wanted: a chain or a tree, and its confidence threshold
    # Pipelined drafting (orchestrator/cycle/drafting.py): draft the next chain
    # assuming the last one all kept and the bonus the drafter's guess; undo
    # such a call (its guess was wrong).
    ahead: bool = False
    rewind: bool = False
    hidden: HiddenStates | None = field(default=None, repr=False)  # method eagle: the committed tokens' features
    alternatives: int = 0  # ahead calls: rejection outcomes per depth to pre-draft (ahead_alternatives)
    branch: int = 0  # the call after an ahead call: the outcome its verdict matched (ahead_branch)
    forced_room: int = 0  # structured output: forced nodes a chain may take besides its depth
