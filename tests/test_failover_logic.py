"""orchestrator/fleet/failover.py as units: the real loop (orchestrator/cycle/loop.py) over
fake replicas that hold real per-session state and can die; the same on real
processes is tests/test_failover.py.

The fake target is a deterministic next-token rule, so "equals the uninterrupted
run" is exact, and each fake checks on every call that its session state is the
true committed sequence (a lost or repeated token would break that at once).
"""
import asyncio

import grpc
import pytest

from orchestrator.cycle.detok import OutputTracker
from orchestrator.cycle.loop import ContextLengths, Draft, SessionReplicas, Verdict, run_generation
from orchestrator.cycle.spec import GenerationSpec
from orchestrator.fleet.clients import ServiceError
from orchestrator.fleet.failover import FailoverDrafter, FailoverVerifier, is_lost, reseeded
from orchestrator.fleet.pool import Pool, ReplicaSpec
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams

pytestmark = pytest.mark.unit

V = 50


def target_next(tokens):
    return (tokens[-1] * 7 + len(tokens)) % V


def truth(prompt, n):
    seq = list(prompt)
    while len(seq) < len(prompt) + n:
        seq.append(target_next(seq))
    return seq


class Dead(ServiceError):
    def __init__(self):
        super().__init__(grpc.StatusCode.UNAVAILABLE, "connection refused")


class FakeReplica:
    """Dies (every call: UNAVAILABLE) when `calls` reaches `die_at`."""

    def __init__(self, die_at=None):
        self.active, self.sessions, self.calls, self.die_at, self.log = 0, {}, 0, die_at, []

    def _call(self, what):
        self.calls += 1
        self.log.append(what)
        if self.die_at is not None and self.calls >= self.die_at:
            self.sessions.clear()
            raise Dead()

    async def close(self, session_id):
        self._call("close")
        self.sessions.pop(session_id, None)

    async def aclose(self):
        pass


class FakeVerifier(FakeReplica):
    async def open(self, session_id, prompt_ids, sampling, resume=False):
        self._call("resume" if resume else "open")
        self.seed = sampling.seed
        assert session_id not in self.sessions
        seq = list(prompt_ids)
        self.sessions[session_id] = seq
        if resume:
            return None
        seq.append(target_next(seq))
        return seq[-1]

    async def verify(self, session_id, draft):
        self._call("verify")
        seq = self.sessions[session_id]
        path, out = [], []
        for i, t in enumerate(draft.tokens):
            if t != target_next(seq + out):
                break
            path.append(i)
            out.append(t)
        out.append(target_next(seq + out))
        seq += out
        return Verdict(path, out)


class FakeDrafter(FakeReplica):
    """Guesses the target's rule but errs every 4th position; checks that what
    it is told extends its session exactly like the truth."""

    def __init__(self, prompt, die_at=None):
        super().__init__(die_at)
        self.prompt = prompt

    async def open(self, session_id, prompt_ids, sampling):
        self._call("open")
        self.sessions[session_id] = {"seq": list(prompt_ids), "last": []}

    async def propose(self, session_id, accepted_path, committed, shape, *, ahead=False, rewind=False):
        assert not ahead and not rewind    # these runs do not pipeline
        self._call(("propose", tuple(accepted_path), tuple(committed)))
        s = self.sessions[session_id]
        assert list(committed[:len(accepted_path)]) == [s["last"][i] for i in accepted_path]
        s["seq"] += committed
        assert s["seq"] == truth(self.prompt, len(s["seq"]) - len(self.prompt)), "drafter state diverged"
        draft, seq = [], list(s["seq"])
        for _ in range(shape.depth):
            t = target_next(seq) if len(seq) % 4 else (target_next(seq) + 1) % V
            draft.append(t)
            seq.append(t)
        s["last"] = draft
        return Draft(draft, list(range(-1, len(draft) - 1)))


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def pool_of(kind, replicas):
    pool = Pool(kind)
    for i, r in enumerate(replicas):
        pool.add(ReplicaSpec(kind, f"{kind}-{i}", f"h:{i}"), r)
    return pool


PROMPT = [3, 1, 4, 1, 5]


def run(verifiers, drafters, n=40, max_failovers=3):
    """Generate n tokens through the real loop; return (streamed ids, pools)."""
    vpool, dpool = pool_of("verifier", verifiers), pool_of("drafter", drafters)
    spec = GenerationSpec(PROMPT, n, SamplingParams(seed=11), "draft_model", DraftShape.chain(3))
    tracker = OutputTracker(Tok(), set(), n, 1000)
    committed = lambda: spec.prompt_ids + tracker.ids   # noqa: E731
    v = FailoverVerifier(vpool, committed, max_failovers)
    d = FailoverDrafter(dpool, committed, max_failovers)

    async def go():
        ids = []
        try:
            async for chunk in run_generation(spec, SessionReplicas("s1", v, d), tracker, ContextLengths(1000, 1000)):
                ids += chunk.emit.token_ids
        finally:
            v.release()
            d.release()
        return ids
    return asyncio.run(go()), vpool, dpool


def test_uninterrupted_run_is_the_truth():
    ids, _, _ = run([FakeVerifier()], [FakeDrafter(PROMPT)])
    assert ids == truth(PROMPT, 40)[len(PROMPT):]


def test_verifier_lost_mid_stream_resumes_elsewhere_exactly():
    v0, v1 = FakeVerifier(die_at=6), FakeVerifier()        # open + 4 verifies, then dead
    ids, vpool, _ = run([v0, v1], [FakeDrafter(PROMPT)])
    assert ids == truth(PROMPT, 40)[len(PROMPT):]          # nothing lost or repeated
    assert v1.log[0] == "resume" and "open" not in v1.log  # re-prefilled, not a new first token
    assert vpool.replicas["verifier-0"].lost and not vpool.replicas["verifier-1"].lost
    assert v1.seed != 11                                    # a fresh random stream for the rebuilt session
    assert v0.active == 0 and v1.active == 0                # released on the client it was acquired on


def test_drafter_lost_moves_to_another_rebuilt_from_committed_tokens():
    d0, d1 = FakeDrafter(PROMPT, die_at=5), FakeDrafter(PROMPT)
    ids, _, dpool = run([FakeVerifier()], [d0, d1])
    assert ids == truth(PROMPT, 40)[len(PROMPT):]
    assert dpool.replicas["drafter-0"].lost
    # The new drafter's first proposal: nothing kept of a draft it never made, the last token.
    assert d1.log[0] == "open" and d1.log[1][1] == ()
    assert len(d1.log[1][2]) == 1
    assert len([c for c in d1.log if c[0] == "propose"]) > 3


def test_drafter_lost_with_no_spare_continues_as_plain_decoding():
    d0, d1 = FakeDrafter(PROMPT, die_at=4), FakeDrafter(PROMPT, die_at=1)   # the spare is dead too
    v = FakeVerifier()
    ids, _, dpool = run([v], [d0, d1])
    assert ids == truth(PROMPT, 40)[len(PROMPT):]
    assert dpool.replicas["drafter-0"].lost and dpool.replicas["drafter-1"].lost
    assert v.log.count("verify") > 20              # one token per verify after the loss


def test_drafter_taken_up_again_once_one_serves():
    d0 = FakeDrafter(PROMPT, die_at=3)
    dpool = pool_of("drafter", [d0])
    spec_prompt, seen = list(PROMPT), []
    d = FailoverDrafter(dpool, lambda: spec_prompt + seen)

    async def go():
        await d.open("s", PROMPT, SamplingParams())
        seen.append(target_next(spec_prompt))
        assert (await d.propose("s", [], seen[-1:], DraftShape.chain(2))).tokens
        assert (await d.propose("s", [], [], DraftShape.chain(2))).tokens == []   # lost: plain step
        assert (await d.propose("s", [], [], DraftShape.chain(2))).tokens == []   # none serving
        back = FakeDrafter(PROMPT)
        dpool.revive("drafter-0", ReplicaSpec("drafter", "drafter-0", "h:new"), back)
        draft = await d.propose("s", [], [], DraftShape.chain(2))
        assert draft.tokens and back.log[0] == "open"
        d.release()
        assert back.active == 0 and d0.active == 0
    asyncio.run(go())


def test_verifier_none_left_fails_with_unavailable_and_a_reason():
    with pytest.raises(ServiceError) as err:
        run([FakeVerifier(die_at=4)], [FakeDrafter(PROMPT)])
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no other verifier is serving" in err.value.message and "verifier-0" in err.value.message


def test_new_request_with_every_verifier_lost_is_unavailable():
    v = FakeVerifier(die_at=1)
    with pytest.raises(ServiceError) as err:
        run([v], [FakeDrafter(PROMPT)])
    assert "no other verifier" in err.value.message
    with pytest.raises(ServiceError) as err:          # the next request: the pool knows it is lost
        vpool = pool_of("verifier", [v])
        Pool.mark_lost(vpool.replicas["verifier-0"], v)
        asyncio.run(FailoverVerifier(vpool, lambda: PROMPT).open("s2", PROMPT, SamplingParams()))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "verifier-0 lost" in err.value.message


def test_verifier_failovers_are_bounded():
    with pytest.raises(ServiceError, match="lost 3 times") as err:
        run([FakeVerifier(die_at=3)] + [FakeVerifier(die_at=2) for _ in range(4)], [FakeDrafter(PROMPT)],
            max_failovers=2)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_other_errors_are_not_failovers():
    class Refusing(FakeVerifier):
        async def verify(self, session_id, draft):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "bad draft")
    with pytest.raises(ServiceError, match="bad draft"):
        run([Refusing(), FakeVerifier()], [FakeDrafter(PROMPT)])


def test_verifier_full_mid_stream_ends_the_request_with_its_reason():
    """A verify refused for the KV budget is no failover: the request ends with
    RESOURCE_EXHAUSTED and the verifier's message; the other verifier is untouched."""
    class Full(FakeVerifier):
        async def verify(self, session_id, draft):
            if self.calls >= 4:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "verifier KV budget full: session 's1' ...")
            return await super().verify(session_id, draft)
    spare = FakeVerifier()
    with pytest.raises(ServiceError, match="KV budget full") as err:
        run([Full(), spare], [FakeDrafter(PROMPT)])
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and spare.calls == 0


def test_drafter_full_mid_stream_continues_as_plain_decoding():
    """A Propose refused for the drafter's KV budget: the session frees its
    drafter session and goes on without drafts, output unchanged."""
    class Full(FakeDrafter):
        async def propose(self, session_id, accepted_path, committed, shape, **kw):
            if self.calls >= 3:
                self._call("refused")
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "drafter KV budget full: ...")
            return await super().propose(session_id, accepted_path, committed, shape, **kw)
    d, v = Full(PROMPT), FakeVerifier()
    ids, _, dpool = run([v], [d])
    assert ids == truth(PROMPT, 40)[len(PROMPT):]
    assert d.log.count("refused") == 1 and "close" in d.log and not dpool.replicas["drafter-0"].lost
    assert d.active == 0 and v.log.count("verify") > 20   # one token per verify after the refusal


def test_reseeded_is_a_fixed_fresh_seed_per_length():
    p = SamplingParams(temperature=1.0, seed=5)
    seeds = {reseeded(p, n).seed for n in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds) and p.seed not in seeds
    assert reseeded(p, 7) == reseeded(p, 7)
    assert is_lost(Dead()) and not is_lost(ServiceError(grpc.StatusCode.INTERNAL, "x"))
