from __future__ import annotations

from dataclasses import dataclass, field

from specd_core.net.flags import flag, not_flag
from specd_core.net.service_config import BATCH_WAIT_HELP, MAX_SESSIONS_HELP, PORT_HELP, ModelServiceConfig


@dataclass(frozen=True)
class DrafterConfig(ModelServiceConfig):
    """The drafter service's settings: the model service's (model_dir is an HF
    causal LM directory, the drafter, or an EAGLE head directory) and its own.
    Each field's metadata is its `python -m drafter_svc` flag (specd_core/net/flags.py)."""

    port: int = field(default=50071, metadata=flag(PORT_HELP))
    max_sessions: int = field(default=1024, metadata=flag(MAX_SESSIONS_HELP))
    # No gather window by default: a session's next Propose comes after its
    # verify, so waiting for it holds this service idle while the verifier
    # works; without waiting the sessions form groups that draft while others
    # verify (measured: docs/architecture.md, "The gather window").
    batch_wait_fraction: float = field(default=0.0, metadata=flag(BATCH_WAIT_HELP))
    # Methods eagle, eagle3 and medusa (model_dir is a head): the target directory
    # whose embedding (and final norm and LM head, but for EAGLE-3's; Medusa heads
    # take only its final norm) the head shares ("" = specd's own head's config
    # `target`, relative to the head directory; a published head names none, so
    # it needs this).
    target_dir: str = field(
        default="",
        metadata=flag(
            "methods eagle / eagle3 / medusa (--model is a head): the target directory it shares embedding and LM head "
            "with (default: specd's own head's config; a published head needs it)"
        ),
    )
    # Sampled drafts are drawn from the drafter's distribution truncated to its
    # top-N tokens, so q travels sparsely (N ids + probs per position) and the
    # verifier's rule stays exact for that q.
    draft_top_n: int = field(default=32, metadata=not_flag("fixed: what the drafts' sparse q carry"))
    # Pipelined drafting: the most alternative corrections per chain depth an
    # ahead call may ask to pre-draft (each is a chain of K; drafter_svc/branches.py).
    max_ahead_alternatives: int = field(
        default=4,
        metadata=not_flag("fixed: the protocol's limit (orchestrator/spec_config.py MAX_PIPELINE_ALTERNATIVES)"),
    )
