"""A session's state between cycles, and its life on the replicas.

`CycleState` is what the loop carries from one cycle to the next: where the
output stands and what the drafter has not heard of yet. `SessionReplicas`
opens the session on the verifier and the drafter together and frees it on
every replica that may hold it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from orchestrator.cycle.ports import DrafterClient, NoTrace, VerifierClient
from orchestrator.cycle.records import CycleRecord, Draft, Opened, Verdict
from orchestrator.cycle.spec import GenerationSpec
from specd_core.runtime.features import HiddenStates


def keep_features(pending: list[HiddenStates], got: HiddenStates | None) -> int:
    """Queue the verifier's features for the next Propose; their size in bytes."""
    if got is None:
        raise RuntimeError("the verifier returned no hidden states for a session that asked for them")
    pending.append(got)
    return len(got.data)


def after_ahead(rewind: bool, branch: int) -> dict:
    """What the next Propose tells the drafter about its last ahead call."""
    return {"rewind": True} if rewind else {"branch": branch} if branch else {}


@dataclass
class CycleState:
    """Where a session stands between cycles, and what its drafter has not
    heard of yet (it hears with its next proposal)."""

    committed: int  # prompt + output tokens
    unsent: list[int]  # tokens committed since the drafter's last proposal
    # spec.features: the target's hidden states not yet sent to the drafter; None: not carried.
    features: list[HiddenStates] | None = None
    kept_path: list[int] = field(default_factory=list)  # of the drafter's last proposal, the path kept
    rewind: bool = False  # its last (ahead) proposal guessed wrong and is to be undone
    branch: int = 0  # its last (ahead) proposal held, in this branch
    last: CycleRecord | None = None  # the previous cycle (a pipelined draft is checked against its verdict)

    def keep_features(self, got: HiddenStates | None) -> int:
        """The verifier's features of tokens it committed; bytes kept (0 when not carried)."""
        return keep_features(self.features, got) if self.features is not None else 0

    def commit(self, draft: Draft, verdict: Verdict) -> int:
        """A verdict's tokens are committed; returns the feature bytes it carried."""
        kept = self.keep_features(verdict.hidden)
        if draft.proposed:
            # The drafter's nodes only: a forced tail is news to it, among the
            # committed tokens (orchestrator/cycle/structured.py).
            self.kept_path = [n for n in verdict.path if n < draft.proposed]
        self.unsent += verdict.tokens
        self.committed += len(verdict.tokens)
        return kept

    def news(self) -> dict:
        """The next Propose's keywords: about the last ahead call, and the features."""
        hidden = {"hidden": HiddenStates.concat(self.features)} if self.features is not None else {}
        return after_ahead(self.rewind, self.branch) | hidden

    def heard(self) -> None:
        """A proposal carried all of it."""
        self.unsent, self.rewind, self.branch = [], False, 0
        if self.features is not None:
            self.features = []


class SessionReplicas:
    """The session on its verifier and (when it drafts) its drafter."""

    def __init__(self, session_id: str, verifier: VerifierClient, drafter: DrafterClient | None):
        self.session_id = session_id
        self.verifier, self.drafter = verifier, drafter
        self.opened: list[VerifierClient | DrafterClient] = []  # the clients to close

    async def open(self, spec: GenerationSpec, trace: NoTrace) -> tuple[int, HiddenStates | None, int]:
        """Prefill both (on the prompt and any resumed tokens); the first new
        token, the prompt's features (spec.features) and the prompt tokens the
        verifier's prefix cache held."""
        context, more = spec.context_ids, spec.generated_keywords
        # The target's features: True for EAGLE's; layer ids for EAGLE-3's auxiliary layers.
        want: dict = {"hidden": spec.feature_layers or True} if spec.features else {}
        opens = [self.verifier.open(self.session_id, context, spec.sampling, **want, **more)]
        clients: list[VerifierClient | DrafterClient] = [self.verifier]
        if self.drafter is not None:
            opens.append(self.drafter.open(self.session_id, context, spec.sampling, **more))
            clients.append(self.drafter)
        # Until the opens answer, count them as opened: a client that leaves now
        # cancels them here, but a replica may already have opened the session.
        self.opened = clients
        with trace.scope():
            results = await asyncio.gather(*opens, return_exceptions=True)
        self.opened = [c for c, r in zip(clients, results) if not isinstance(r, BaseException)]
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return first_token(results[0], spec.features)

    async def close(self, trace: NoTrace) -> None:
        """Free the session everywhere, also when the client went away mid-stream."""
        with trace.scope():  # shield: a second cancel must not stop the closes half-way
            closes = (c.close(self.session_id) for c in self.opened)
            await asyncio.shield(asyncio.gather(*closes, return_exceptions=True))


def first_token(opened: Any, features: bool) -> tuple[int, HiddenStates | None, int]:
    """The verifier's open result: the first token, with the prompt's features
    when asked for, and the prompt tokens it took from its prefix cache (an
    `Opened`; clients that answer a plain token or pair cached nothing)."""
    if isinstance(opened, Opened):
        assert opened.first is not None  # a new session's open samples its first token
        return opened.first, opened.hidden, opened.cached
    if features:
        first, hidden = opened
        return first, hidden, 0
    return opened, None, 0
