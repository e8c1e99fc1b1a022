"""orchestrator/cycle/loop.py as a unit over fake clients: pipelined drafting
(orchestrator/cycle/drafting.py) stays exact and tells the drafter what became of
each ahead draft. The same on real processes is tests/test_pipeline.py."""
import asyncio

import pytest

from orchestrator.cycle.detok import OutputTracker
from orchestrator.cycle.loop import ContextLengths, Draft, SessionReplicas, Verdict, run_generation
from orchestrator.cycle.spec import GenerationSpec
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams

pytestmark = pytest.mark.unit

V = 50
PROMPT = [3, 1, 4, 1, 5]


def target_next(seq):
    return (seq[-1] * 7 + len(seq)) % V


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


class Verifier:
    """Greedy chain verification against the target rule."""

    async def open(self, session_id, prompt_ids, sampling):
        self.seq = list(prompt_ids) + [target_next(prompt_ids)]
        return self.seq[-1]

    async def verify(self, session_id, draft):
        await asyncio.sleep(0)                 # let the ahead draft start meanwhile
        path, out = [], []
        for i, t in enumerate(draft.tokens):
            if t != target_next(self.seq + out):
                break
            path.append(i)
            out.append(t)
        out.append(target_next(self.seq + out))
        self.seq += out
        return Verdict(path, out)

    async def close(self, session_id):
        pass


class Drafter:
    """Knows the truth (the verifier's sequence) but errs now and then, and
    guesses the bonus and the rejection outcomes right some of the time.
    Checks on every call that what it was told adds up to the committed tokens."""

    def __init__(self, verifier):
        self.verifier, self.calls, self.n = verifier, [], 0
        self.assumed = None  # its last ahead draft's assumed commits, per branch

    async def open(self, session_id, prompt_ids, sampling):
        self.known = list(prompt_ids)

    def chain(self, seq, k):
        out = []
        for j in range(k):
            t = target_next(seq + out)
            out.append(t if (len(seq) + j + self.n) % 9 else (t + 1) % V)
        return out

    def settle(self, call):
        """What became of the last ahead draft, as this call says: undone
        (rewind) or held, in the branch it names (none: the all-kept one)."""
        if self.assumed is None:
            assert not call.rewind and not call.branch
        elif not call.rewind:
            self.known += self.assumed[call.branch]
        self.assumed = None

    async def propose(self, call):
        committed, shape = call.committed, call.shape
        self.n += 1
        self.calls.append(call)
        self.settle(call)
        if not call.ahead:
            self.known += committed
            assert self.known == self.verifier.seq, "drafter state diverged"
            tokens = self.chain(self.known, shape.depth)
            return Draft(tokens, list(range(-1, len(tokens) - 1)))
        assert self.known == self.verifier.seq  # an ahead call runs before the verify commits
        guess = target_next(self.known + committed) if self.n % 3 else 0
        tokens = self.chain(self.known + committed + [guess], shape.depth)
        self.assumed, branches = [committed + [guess]], []
        for kept in range(call.alternatives):
            token = target_next(self.known + committed[:kept]) if (self.n + kept) % 2 else 0
            self.assumed.append(committed[:kept] + [token])
            chain = self.chain(self.known + self.assumed[-1], shape.depth)
            branches.append((kept, token, Draft(chain, list(range(-1, len(chain) - 1)))))
        return Draft(tokens, list(range(-1, len(tokens) - 1)), guess=guess, branches=branches)

    async def close(self, session_id):
        pass


def pipelined_spec(n, alternatives, **more):
    """A pipelined request for chains of 4, n tokens."""
    return GenerationSpec(
        prompt_ids=PROMPT,
        max_new_tokens=n,
        sampling=SamplingParams(seed=1),
        method="draft_model",
        shape=DraftShape.chain(4),
        pipeline=True,
        pipeline_alternatives=alternatives,
        **more,
    )


def test_pipelined_loop_is_exact_and_reports_each_ahead_draft():
    n = 120
    spec = pipelined_spec(n, alternatives=2)
    verifier = Verifier()
    drafter = Drafter(verifier)
    tracker = OutputTracker(Tok(), set(), n, 1000)

    async def go():
        replicas = SessionReplicas("s", verifier, drafter)
        return [c async for c in run_generation(spec, replicas, tracker, ContextLengths(1000, 1000))]

    chunks = asyncio.run(go())
    stats = chunks[-1].stats
    assert PROMPT + tracker.ids == truth(n)
    aheads = sum(c.ahead for c in drafter.calls)
    rewinds = sum(c.rewind for c in drafter.calls)
    branches = sum(bool(c.branch) for c in drafter.calls)
    assert stats.pipelined_drafts and stats.pipelined_alternative_drafts and rewinds
    # Every ahead draft is verified, or undone by the next Propose, or dropped at the end.
    assert aheads - stats.pipelined_drafts - rewinds in (0, 1)
    # A taken alternative is named to the drafter by the next Propose (if any comes).
    assert stats.pipelined_alternative_drafts - branches in (0, 1)
    assert [c.cycle.draft.ahead for c in chunks[1:]].count(True) == stats.pipelined_drafts


def test_pipelining_while_alone_switches_either_way_and_stays_exact():
    """pipeline "auto": a cycle drafts ahead only when the drafter says the
    session is alone on it; otherwise its next Propose leaves once the
    verdict is known, as plain drafting's. Switching between the two in any
    order keeps the drafter's state and the output exact (the Drafter fake
    checks every call against the committed tokens)."""
    n = 150
    spec = pipelined_spec(n, alternatives=1, pipeline_alone=True)
    verifier = Verifier()
    events = []  # ("alone", answer) and ("propose", ahead), in order

    class SharedDrafter(Drafter):
        """Alone in runs of cycles: 4 alone, 3 not, 1 alone, 2 not, ..."""

        pattern = [True] * 4 + [False] * 3 + [True] + [False] * 2

        def alone(self):
            answer = self.pattern[sum(e[0] == "alone" for e in events) % len(self.pattern)]
            events.append(("alone", answer))
            return answer

        async def propose(self, call):
            events.append(("propose", call.ahead))
            return await super().propose(call)

    drafter = SharedDrafter(verifier)
    tracker = OutputTracker(Tok(), set(), n, 1000)

    async def go():
        replicas = SessionReplicas("s", verifier, drafter)
        chunks, marks = [], []
        async for c in run_generation(spec, replicas, tracker, ContextLengths(1000, 1000)):
            chunks.append(c)
            marks.append(len(events))
        return chunks, marks

    chunks, marks = asyncio.run(go())
    stats = chunks[-1].stats
    assert PROMPT + tracker.ids == truth(n)
    # A cycle not alone has sent its plain Propose before its chunk is handed over (the last sends none).
    assert all(events[m - 1] != ("alone", False) for m in marks[1:-1])
    # An ahead call only right after "alone"; after "not alone", the next call is a plain one.
    for i, (kind, value) in enumerate(events):
        if kind == "propose" and value:
            assert events[i - 1] == ("alone", True), events[max(0, i - 3) : i + 1]
        if kind == "alone" and not value and i + 1 < len(events):
            assert events[i + 1] == ("propose", False), events[i : i + 3]
    asked = [v for k, v in events if k == "alone"]
    assert asked.count(True) >= 10 and asked.count(False) >= 10
    # Both ways ran, pre-drafts were used and undone, and switches went both ways.
    rewinds = sum(c.rewind for c in drafter.calls)
    assert stats.pipelined_drafts and rewinds and sum(not c.ahead for c in drafter.calls) > asked.count(False) / 2
    ahead = [c.cycle.draft.ahead for c in chunks[1:]]
    assert any(a and not b for a, b in zip(ahead, ahead[1:])) and any(b and not a for a, b in zip(ahead, ahead[1:]))


def truth(n):
    seq = list(PROMPT)
    while len(seq) < len(PROMPT) + n:
        seq.append(target_next(seq))
    return seq


def test_plain_loop_sends_the_next_propose_before_streaming_the_cycle():
    """Without pipelining, the next cycle's Propose leaves as soon as a verdict
    is committed: by the time the consumer holds a cycle's chunk, the drafter
    has been asked for the next draft, built on exactly the committed tokens
    (the Drafter fake checks that). The cycle's wall time runs verdict to
    verdict, so a slow consumer shows in it. The last verdict sends none."""
    n = 40
    spec = GenerationSpec(
        prompt_ids=PROMPT, max_new_tokens=n, sampling=SamplingParams(seed=1), method="draft_model", shape=DraftShape.chain(3)
    )
    verifier = Verifier()
    drafter = Drafter(verifier)
    tracker = OutputTracker(Tok(), set(), n, 1000)

    async def go():
        chunks, asked = [], []
        replicas = SessionReplicas("s", verifier, drafter)
        async for c in run_generation(spec, replicas, tracker, ContextLengths(1000, 1000)):
            await asyncio.sleep(0.01)  # the consumer's write: the Propose already flies
            asked.append(drafter.n)
            chunks.append(c)
        return chunks, asked

    chunks, asked = asyncio.run(go())
    cycles = chunks[1:]
    assert PROMPT + tracker.ids == truth(n)
    # Chunk i (a cycle, i >= 1) is in the consumer's hands after Propose i+1 was
    # made (a cycle with no room left for a draft, near the end, makes none);
    # after the last verdict no Propose goes out.
    drafted = [bool(c.cycle.draft.tokens) for c in cycles]
    assert asked[1:] == [sum(drafted[: i + 2]) for i in range(len(cycles))]
    assert drafter.n == sum(drafted)
    assert all(c.cycle.wall_ms >= 10 for c in cycles)


def test_a_stream_ended_early_drops_the_prefetched_propose():
    """A consumer that stops after two cycles leaves a Propose in flight: it
    is cancelled and the session is closed on both replicas."""
    spec = GenerationSpec(
        prompt_ids=PROMPT, max_new_tokens=40, sampling=SamplingParams(seed=1), method="draft_model", shape=DraftShape.chain(3)
    )
    verifier = Verifier()
    closed = []

    class SlowDrafter(Drafter):
        async def propose(self, call):
            self.asked = getattr(self, "asked", 0) + 1
            if self.n >= 2:
                try:
                    await asyncio.sleep(10)  # still drafting when the stream ends
                except asyncio.CancelledError:
                    self.cancelled = True
                    raise
            return await super().propose(call)

        async def close(self, session_id):
            closed.append("drafter")

    async def close_verifier(session_id):
        closed.append("verifier")

    verifier.close = close_verifier
    drafter = SlowDrafter(verifier)

    async def go():
        gen = run_generation(spec, SessionReplicas("s", verifier, drafter), OutputTracker(Tok(), set(), 40, 1000),
                             ContextLengths(1000, 1000))
        got = [await gen.__anext__() for _ in range(3)]  # the first token and two cycles
        await asyncio.sleep(0.01)  # the third Propose is in the drafter now
        await gen.aclose()
        return got

    got = asyncio.run(asyncio.wait_for(go(), 5))
    assert len(got) == 3 and drafter.asked == 3
    assert getattr(drafter, "cancelled", False), "the prefetched Propose outlived its stream"
    assert sorted(closed) == ["drafter", "verifier"]


def test_a_resumed_request_opens_after_its_tokens_and_streams_only_new_ones():
    """resume_token_ids: both replicas open on prompt + the resumed tokens (the
    drafter fake checks its state against the verifier's), the stream carries
    only what follows, exactly the uninterrupted output's rest, and the
    output and stats count the resumed tokens."""
    n, r = 40, 11
    resumed = truth(n)[len(PROMPT):len(PROMPT) + r]
    spec = GenerationSpec(prompt_ids=PROMPT, max_new_tokens=n, sampling=SamplingParams(seed=1),
                          method="draft_model", shape=DraftShape.chain(3), resumed=tuple(resumed))
    verifier = Verifier()
    drafter = Drafter(verifier)
    tracker = OutputTracker(Tok(), set(), n, 1000)
    assert tracker.resume(resumed) is None

    async def go():
        replicas = SessionReplicas("s", verifier, drafter)
        return [c async for c in run_generation(spec, replicas, tracker, ContextLengths(1000, 1000))]

    chunks = asyncio.run(go())
    assert [t for c in chunks for t in c.emit.token_ids] == truth(n)[len(PROMPT) + r:]
    assert PROMPT + tracker.ids == truth(n) and chunks[-1].emit.finish_reason == "length"
    stats = chunks[-1].stats
    assert stats.resumed_tokens == r and stats.completion_tokens == n and stats.prompt_tokens == len(PROMPT)
