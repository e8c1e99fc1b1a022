"""Resumed Generate as units: the client helper's resends over fake streams
(specd/client.py), a resumed request's checks and seed
(orchestrator/edge/request.py: resumed), and the output counting the resumed
tokens (OutputTracker.resume). Through real processes: tests/test_resume.py."""
import grpc
import pytest

from orchestrator.cycle.detok import OutputTracker
from orchestrator.cycle.spec import GenerationSpec
from orchestrator.edge.request import resumed
from orchestrator.fleet.failover import reseeded
from specd import cli
from specd.client import ResumePolicy, ResumingStream, StreamBroken
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.errors import InvalidRequest
from specd_core.rules.sampling import SamplingParams

pytestmark = pytest.mark.unit

TRUTH = list(range(100, 130))  # what the server generates for the request, in order


class Broken(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return self._code.name


class FakeServer:
    """Generate as an orchestrator that serves TRUTH after the resumed ids,
    in chunks of 3, each try breaking as `plan` says: (tokens to send, then
    an error code or "end": a stream that ends without its last message;
    None: the stream completes)."""

    def __init__(self, plan, max_new=len(TRUTH)):
        self.plan, self.max_new, self.requests = list(plan), max_new, []

    def __call__(self, request):
        self.requests.append(request)
        return self._stream(request, self.plan.pop(0) if self.plan else (None, None))

    def _stream(self, request, step):
        sent, how = step
        done = len(request.resume_token_ids)
        assert list(request.resume_token_ids) == TRUTH[:done], "resumed from tokens the server never sent"
        rest = TRUTH[done:self.max_new]
        for i in range(0, len(rest), 3):
            chunk = rest[i:i + 3]
            if sent is not None and i >= sent:
                break
            last = i + 3 >= len(rest)
            yield pb.GenerateResponse(token_ids=chunk, text="x" * len(chunk),
                                      finish_reason="length" if last else "",
                                      stats=pb.GenerationStats(resumed_tokens=done) if last else None)
        if how == "end" or how is None:
            return
        raise Broken(how)


def run(server, policy=ResumePolicy(retries=3, backoff=0.5, max_backoff=1.5)):
    waits = []
    stream = ResumingStream(server, pb.GenerateRequest(prompt="p", max_new_tokens=len(TRUTH)), policy, waits.append)
    got = [t for r in stream for t in r.token_ids]
    return got, stream, waits


def test_a_broken_stream_is_resent_after_what_was_received():
    server = FakeServer([(6, grpc.StatusCode.UNAVAILABLE), (9, "end"), (None, None)])
    got, stream, waits = run(server)
    assert got == TRUTH                                       # nothing repeated, nothing lost
    assert stream.resumes == 2 and stream.received == TRUTH
    assert [len(r.resume_token_ids) for r in server.requests] == [0, 6, 15]
    assert all(r.prompt == "p" and r.max_new_tokens == len(TRUTH) for r in server.requests)
    assert waits == [0.5, 0.5]                                # each try brought tokens: no growth


def test_backoff_doubles_without_progress_and_is_bounded():
    down = grpc.StatusCode.UNAVAILABLE
    server = FakeServer([(3, down), (0, down), (0, down), (0, down), (None, None)])
    got, stream, waits = run(server, ResumePolicy(retries=4, backoff=0.5, max_backoff=1.5))
    assert got == TRUTH and stream.resumes == 4
    assert waits == [0.5, 1.0, 1.5, 1.5]                      # progress first, then 2x per empty try, capped


def test_it_gives_up_after_retries_tries_without_a_token():
    down = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(Broken) as info:
        run(FakeServer([(3, down)] + [(0, down)] * 5))
    assert info.value.code() == down
    with pytest.raises(StreamBroken, match="without its last message after 3 tokens"):
        run(FakeServer([(3, "end")] + [(0, "end")] * 5))


def test_other_errors_are_not_resent():
    server = FakeServer([(3, grpc.StatusCode.INVALID_ARGUMENT)])
    with pytest.raises(Broken) as info:
        run(server)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(server.requests) == 1


def test_an_error_after_the_last_message_is_not_a_break():
    server = FakeServer([(None, grpc.StatusCode.UNAVAILABLE)])
    got, stream, _ = run(server)
    assert got == TRUTH and stream.resumes == 0 and len(server.requests) == 1


def test_retries_0_never_resends():
    server = FakeServer([(3, grpc.StatusCode.UNAVAILABLE)])
    with pytest.raises(Broken):
        run(server, ResumePolicy(retries=0))
    assert len(server.requests) == 1


def test_a_request_that_resumed_itself_keeps_its_ids():
    server = FakeServer([(3, grpc.StatusCode.UNAVAILABLE)])
    request = pb.GenerateRequest(prompt="p", max_new_tokens=len(TRUTH), resume_token_ids=TRUTH[:4])
    stream = ResumingStream(server, request, ResumePolicy(), lambda s: None)
    assert [t for r in stream for t in r.token_ids] == TRUTH[4:]
    assert list(server.requests[1].resume_token_ids) == TRUTH[:7]


@pytest.mark.parametrize("flags", [[], ["--no-resume"]])
def test_specd_generate_resends_a_broken_stream_unless_told_not_to(flags, monkeypatch, capsys):
    server = FakeServer([(3, grpc.StatusCode.UNAVAILABLE)])

    def fake(channel, request, retries, **kw):  # specd/client.py's, over the fake server
        return ResumingStream(server, request, ResumePolicy(retries=retries), lambda s: None)

    monkeypatch.setattr("specd.client.stream_generate", fake)
    code = cli.main(["generate", "p", "--address", "127.0.0.1:1", *flags])
    err = capsys.readouterr().err
    if flags:
        assert code == 1 and "error: UNAVAILABLE" in err and len(server.requests) == 1
    else:
        assert code == 0 and "resumes=1 resumed_tokens=3" in err
        assert list(server.requests[1].resume_token_ids) == TRUTH[:3]


# A resumed request's checks (orchestrator/edge/request.py: resumed).

VOCAB, CONTEXT, EOS = 50, 40, {0}


def spec(prompt=(3, 4, 5), max_new=10, seed=7):
    return GenerationSpec(prompt_ids=list(prompt), max_new_tokens=max_new,
                          sampling=SamplingParams(1.0, seed=seed), method="off", shape=None)


@pytest.mark.parametrize("ids,prompt,needle", [
    ([1, 50], (3,), "resume_token_ids holds 1 id(s) outside the vocabulary [0, 50): [50]"),
    ([-1], (3,), "resume_token_ids holds 1 id(s) outside the vocabulary [0, 50): [-1]"),
    ([1, 0, 2], (3,), "resume_token_ids[1] is 0, an end-of-sequence id"),
    ([1] * 11, (3,), "resume_token_ids has 11 tokens, more than max_new_tokens 10"),
    ([1] * 10, (3,) * 31, "the prompt (31 tokens) and resume_token_ids (10) hold 41 tokens; the model's context is 40"),
])
def test_bad_resume_ids_are_refused_naming_the_field(ids, prompt, needle):
    with pytest.raises(InvalidRequest) as info:
        resumed(spec(prompt), ids, VOCAB, CONTEXT, EOS)
    assert needle in str(info.value)


def test_a_resumed_spec_opens_after_the_ids_with_a_seed_of_its_length():
    s = resumed(spec(), [9, 8], VOCAB, CONTEXT, EOS)
    assert s.resumed == (9, 8) and s.context_ids == [3, 4, 5, 9, 8]
    assert s.sampling == reseeded(spec().sampling, 5) and s.sampling.seed != 7
    assert resumed(spec(), [], VOCAB, CONTEXT, EOS) == spec()   # no ids: a new stream, as sent
    # Exactly max_new_tokens, or exactly the context: valid (the stream ends at once).
    assert resumed(spec(), [1] * 10, VOCAB, CONTEXT, EOS).resumed == (1,) * 10
    assert resumed(spec((3,) * 30), [1] * 10, VOCAB, CONTEXT, EOS).resumed == (1,) * 10


# The output counts the resumed tokens (OutputTracker.resume).

class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_resumed_tokens_count_toward_max_new_tokens():
    t = OutputTracker(Tok(), set(), 5, 1000)
    assert t.resume([1, 2]) is None and t.remaining == 3
    assert t.add([3, 4, 5]).finish_reason == "length"
    assert OutputTracker(Tok(), set(), 2, 1000).resume([1, 2]) == "length"
    assert OutputTracker(Tok(), set(), 9, 2).resume([1, 2]) == "length"   # the context is full


def test_a_stop_string_across_the_resume_point_is_found():
    t = OutputTracker(Tok(), set(), 20, 1000, stop=("cde",))
    assert t.resume([0, 1, 2]) is None          # "abc": "c" may start the stop string
    e = t.add([3, 4, 5])                        # "def"
    assert e.finish_reason == "stop" and e.text == ""   # "ab" was sent before the break
    # The text held back at the resume point goes out when it is known not to stop.
    t = OutputTracker(Tok(), set(), 20, 1000, stop=("cx",))
    t.resume([0, 1, 2])
    assert t.add([3]).text == "cd"
    # A stop string inside the resumed tokens: the output had ended there.
    assert OutputTracker(Tok(), set(), 20, 1000, stop=("bc",)).resume([0, 1, 2, 3]) == "stop"
