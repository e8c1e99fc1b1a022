"""How a drafter drafts: the part of the drafter core that differs between a
draft model and an EAGLE head (drafter_svc/eagle.py), as a strategy the core
holds (drafter_svc/core.py). Everything else - tree growth, batching, the
checks of a call, pipelined drafting - is the core's and the same for both."""

from __future__ import annotations

from typing import Protocol

import torch

from drafter_svc.state import DraftSession, ProposeJob, keep_accepted
from specd_core.runtime.models import ModelRunner
from specd_core.runtime.prefix_cache import publish_prefix, reuse_prefix
from specd_core.runtime.propose_call import ProposeCall


class DraftMethod(Protocol):
    name: str  # "draft_model" | "eagle" | "eagle3" | "medusa"
    warms_up: bool  # whether warm-up calls can run on this replica alone

    def describe(self) -> str:
        """The method and what it drafts with, as `specd status` shows it."""
        ...

    @property
    def tokenizer_dir(self) -> str | None:
        """Where structured output reads the tokenizer (None: the model's directory)."""
        ...

    def runner_of(self, runner: ModelRunner) -> ModelRunner:
        """What runs the drafter's forwards, made from the model's own runner."""
        ...

    def check_vocab(self, asked: int, target_vocab: int, own: int) -> None:
        """A new session's target vocabulary (asked: OpenSession's
        target_vocab_size; target_vocab: what it comes to; own: the drafter's rows)."""
        ...

    def prefill(self, s: DraftSession, session_id: str, prompt_ids: list[int]) -> None:
        """Under the lock: what a new session computes of its prompt now."""
        ...

    def admit(self, call: ProposeCall) -> ProposeCall:
        """Refuse what the method does not take; the call for the core's checks."""
        ...

    def ready(self, job: ProposeJob, call: ProposeCall) -> ProposeJob:
        """The checked job completed with what only the method reads."""
        ...

    def catch_up(self, j: ProposeJob) -> None:
        """Under the lock: bring the session up to the verdict (no forward)."""
        ...

    def root_logits(self, forwards, live: list[ProposeJob]) -> list[torch.Tensor]:
        """Forward every session's committed tokens not yet cached, in one
        batch; each one's logits after its last committed token, (1, V)."""
        ...


class DraftModel:
    """A causal LM drafting on its own KV cache: the prompt is prefilled at
    open, and a verdict keeps the accepted path's rows of the last tree."""

    name = "draft_model"

    def describe(self) -> str:
        return "draft_model: a draft model"

    warms_up = True
    tokenizer_dir: str | None = None

    def runner_of(self, runner: ModelRunner) -> ModelRunner:
        return runner

    def check_vocab(self, asked: int, target_vocab: int, own: int) -> None:
        """Any: a padded pair drafts over the ids both have (drafter_svc/vocab.py)."""

    def prefill(self, s: DraftSession, session_id: str, prompt_ids: list[int]) -> None:
        try:
            # The prompt's KV blocks (CapacityExceeded when the budget is full).
            # Prefill now (overlaps the verifier's prefill); the last prompt token
            # is forwarded with the first proposal, which needs its logits, so
            # every row before it may come from the prefix cache.
            rows = prompt_ids[:-1]
            cached = reuse_prefix(s.cache, rows, s.params.cache_salt, len(rows))
            s.cache.reserve(len(prompt_ids), f"session {session_id!r} (a prompt of {len(prompt_ids)} tokens)")
            if len(rows) > cached:
                s.cache.forward(rows[cached:], last_only=True)
            publish_prefix(s.cache)
        except BaseException:
            s.cache.release()  # not added: give its blocks back
            raise

    def admit(self, call: ProposeCall) -> ProposeCall:
        return call

    def ready(self, job: ProposeJob, call: ProposeCall) -> ProposeJob:
        return job

    def catch_up(self, j: ProposeJob) -> None:
        keep_accepted(j)

    def root_logits(self, forwards, live: list[ProposeJob]) -> list[torch.Tensor]:
        return forwards.forward_batch(
            [(j.session.cache, j.session.tokens[j.session.cache.length :], None, None) for j in live], last_only=True
        )
