"""How a cycle gets its draft: a `Drafting` strategy.

* `NoDrafting`: no drafter (method off): every cycle a plain decode step.
* `PlainDrafting`: one Propose per cycle, made once the last verdict is known.
* `PipelinedDrafting` (spec.pipeline; PEARL's post-verify, Liu et al. 2024):
  while the verifier checks a chain, the drafter already drafts the next one
  assuming the whole chain is kept and the bonus token is its own guess. When
  the verdict bears that out the next cycle verifies that draft at once;
  otherwise it is dropped (the drafter rewinds) and a fresh draft is made.
  Output is exact either way: a pre-draft is used only when its assumed prefix
  is the committed one, and its tokens were drawn independently of the
  verifier's randomness. With spec.pipeline_alternatives the drafter also
  pre-drafts likely rejection outcomes (d1..dj kept, its next choice at j+1 as
  the correction) and further bonus guesses; whichever branch the verdict
  matches is verified at once (drafter_svc/branches.py), and the next Propose
  names it (`branch`). With `alone` (SpeculativeConfig.pipeline "auto") a
  cycle drafts ahead only while the session has its drafter replica to
  itself; the others make their Propose once the verdict is known, as plain
  drafting does. Either way works from any cycle on: the first cycle of every
  stream is a plain one, and an ahead call names the verdict it assumes.

EOF drafting (spec.features) needs no strategy of its own: the features ride
on the Propose a cycle makes anyway (CycleState.news).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from orchestrator.cycle.depth import DraftShaper, draft_budget
from orchestrator.cycle.ports import DrafterClient
from orchestrator.cycle.records import Draft, Verdict
from orchestrator.cycle.session import CycleState, after_ahead
from specd_core.runtime.propose_call import ProposeCall


def ahead_branch(draft: Draft, verdict: Verdict, ahead: Draft) -> int | None:
    """The branch of the ahead draft whose assumed verdict on `draft` (a chain)
    is the real one: 0 = all kept with the guessed bonus, i = ahead.branches[i-1]
    (kept tokens, then that correction or bonus); None = none. Depends on the
    verdict alone, which keeps sampling exact. (An empty ahead draft - a drafter
    rebuilt elsewhere mid-call makes none - holds nothing.)"""
    if not ahead.tokens:
        return None
    outcome = (len(verdict.path), verdict.tokens[-1])
    if outcome == (len(draft.tokens), ahead.guess):
        return 0
    return next((i + 1 for i, (kept, token, _) in enumerate(ahead.branches) if (kept, token) == outcome), None)


def branch_draft(ahead: Draft, index: int) -> Draft:
    """Branch `index` of an ahead draft as the draft to verify (timings are the
    ahead call's: all its branches were drafted together)."""
    if index == 0:
        pre = ahead
    else:
        pre = ahead.branches[index - 1][2]
        pre.compute_ms, pre.batch_tokens, pre.call_ms = ahead.compute_ms, ahead.batch_tokens, ahead.call_ms
        pre.min_confidence = ahead.min_confidence
    pre.ahead, pre.branch, pre.branches = True, index, []
    return pre


async def _no_draft() -> Draft:
    return Draft()


async def timed_propose(drafter: DrafterClient, call: ProposeCall) -> Draft:
    """DrafterClient.propose, its wall time and its shape's threshold noted on the draft."""
    start = time.perf_counter()
    draft = await drafter.propose(call)
    draft.call_ms = (time.perf_counter() - start) * 1e3
    draft.min_confidence = call.shape.min_confidence
    return draft


class Drafting:
    """The strategy's steps; by default nothing is drafted ahead."""

    async def draft(self, state: CycleState, remaining: int) -> Draft:
        """This cycle's draft, `remaining` output tokens before the limit."""
        raise NotImplementedError

    def draft_ahead(self, draft: Draft, state: CycleState, remaining: int) -> None:
        """Start the next cycle's draft while `draft` is verified."""

    async def prefetch(self, state: CycleState, remaining: int) -> None:
        """A verdict is committed: start the next cycle's draft now, before the
        cycle is reported and its tokens streamed; returns once the call is on
        its way (not answered)."""

    async def drop(self) -> None:
        """The stream ends: drop what is drafting ahead."""


class NoDrafting(Drafting):
    """No drafter: empty drafts, each cycle a plain decode step."""

    async def draft(self, state: CycleState, remaining: int) -> Draft:
        return Draft()


class PlainDrafting(Drafting):
    """A Propose per cycle, telling the drafter what the last verdict kept;
    sent as soon as the verdict is committed (prefetch)."""

    def __init__(self, drafter: DrafterClient, session_id: str, shaper: DraftShaper, forced_room: int = 0):
        self.drafter, self.session_id, self.shaper = drafter, session_id, shaper
        self._next: asyncio.Future[Draft] | None = None  # the prefetched draft, in the making
        # Structured output: draft depth forced tokens may fill (GenerationSpec.forced_room).
        self.forced_room = forced_room

    async def draft(self, state: CycleState, remaining: int) -> Draft:
        if self._next is not None:
            next_draft, self._next = self._next, None
            return await next_draft
        return await self._propose(state, remaining)

    async def prefetch(self, state: CycleState, remaining: int) -> None:
        self._next = asyncio.ensure_future(self._propose(state, remaining))
        # One turn of the loop: the call's task runs up to its message's write,
        # so the Propose leaves now rather than after the consumer's write.
        await asyncio.sleep(0)

    def _propose(self, state: CycleState, remaining: int):
        """The Propose for the state as it is now (the call leaves when awaited)."""
        shape = self.shaper.next(state.committed, remaining)
        if shape is None:
            return _no_draft()
        more = state.news()
        if self.forced_room and shape.is_chain:
            s = self.shaper
            budget = draft_budget(self.forced_room, remaining, state.committed, s.target_ctx, s.drafter_ctx)
            if budget > shape.depth:
                more["forced_room"] = budget - shape.depth
        call = ProposeCall(
            session_id=self.session_id, accepted_path=state.kept_path, committed=state.unsent, shape=shape, **more
        )
        propose = timed_propose(self.drafter, call)
        state.heard()  # the call carries all of it
        return propose

    async def drop(self) -> None:
        if self._next is not None:  # the stream ended after a verdict
            self._next.cancel()
            await asyncio.gather(self._next, return_exceptions=True)
            self._next = None


class PipelinedDrafting(PlainDrafting):
    """Each chain's successor drafted during its verify (module docstring);
    with `alone`, only in the cycles where it says the session is alone on
    its drafter."""

    def __init__(
        self,
        drafter: DrafterClient,
        session_id: str,
        shaper: DraftShaper,
        alternatives: int = 0,
        alone: Callable[[], bool] | None = None,
    ):
        super().__init__(drafter, session_id, shaper)
        self.alternatives, self.alone = alternatives, alone
        self._ahead: asyncio.Future[Draft] | None = None  # the next cycle's draft, in the making

    async def draft(self, state: CycleState, remaining: int) -> Draft:
        if self._ahead is None or state.last is None:
            return await super().draft(state, remaining)
        pre, self._ahead = await self._ahead, None
        hit = ahead_branch(state.last.draft, state.last.verdict, pre)
        if hit is None:
            state.rewind = True
            return await super().draft(state, remaining)
        state.branch, state.unsent = hit, []  # the drafter has those tokens
        return branch_draft(pre, hit)

    async def prefetch(self, state: CycleState, remaining: int) -> None:
        """Nothing when a draft was made during the verify (draft_ahead);
        else the plain Propose, sent now."""
        if self._ahead is None:
            await super().prefetch(state, remaining)

    def draft_ahead(self, draft: Draft, state: CycleState, remaining: int) -> None:
        if not draft.tokens or (self.alone is not None and not self.alone()):
            return
        # Assume every draft token kept plus a bonus: what the next cycle would start from
        # (a branch that keeps fewer commits fewer tokens, so the same shape fits it).
        n = len(draft.tokens) + 1
        shape = self.shaper.next(state.committed + n, remaining - n)
        if shape is None:
            return
        call = ProposeCall(
            session_id=self.session_id,
            accepted_path=list(range(n - 1)),
            committed=draft.tokens,
            shape=shape,
            ahead=True,
            alternatives=self.alternatives,
            **after_ahead(False, state.branch),
        )
        self._ahead = asyncio.ensure_future(timed_propose(self.drafter, call))
        state.branch = 0

    async def drop(self) -> None:
        await super().drop()
        if self._ahead is not None:  # the stream ended during a verify
            self._ahead.cancel()
            await asyncio.gather(self._ahead, return_exceptions=True)
