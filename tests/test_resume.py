"""Resumed Generate through the real services (GenerateRequest.resume_token_ids).

- A stream resumed after any of its tokens goes on as the uninterrupted one
  (greedy), and the stats count the resumed tokens; resumed tokens that fill
  max_new_tokens end it at once; a stop string across the resume point is
  found; structured output resumes inside the structure (the replicas'
  constraints consume the resumed tokens).
- Two orchestrator processes behind ONE address over one drafter and one
  verifier: kill -9 of one while 8 greedy streams run, each on a connection
  of its own through the client helper (specd/client.py): every stream
  completes through the other, equal to target-only greedy token for token,
  and the streams on the killed one were resumed.
- What docs/http.md says an OpenAI client sees (HTTP has no resume): a
  stream whose orchestrator is killed raises APIConnectionError.

Bad resume input: tests/test_bad_input.py; the sampled law of resumed
streams: tests/test_sampling_lossless.py; the helper over fake streams:
tests/test_resume_logic.py.
"""
import json
import os
import signal
import threading
import time

import openai
import pytest

from specd.client import stream_generate
from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.runtime.models import load_model, load_tokenizer
from tests.test_cluster_scaling import greedy_check, long_pair  # noqa: F401  (a fixture)
from tests.test_greedy_exact import assert_same_or_near_tie, prompts
from tests.test_shared_port import answered_by
from tests.test_structured_greedy import SCHEMA

pytestmark = pytest.mark.services

PROMPT = [40, 41, 42, 43]


def resume(stack, full, s, **fields):
    """The request again, resumed after the first s tokens of `full`: (new ids, texts, last message)."""
    ids, texts, last = [], [], None
    for r in stack.stub.Generate(pb.GenerateRequest(resume_token_ids=full[:s], **fields), timeout=120):
        ids += r.token_ids
        texts.append(r.text)
        last = r
    return ids, "".join(texts), last


def test_a_resumed_greedy_stream_goes_on_as_the_uninterrupted_one(stacks, pairs):
    stack = stacks["llama"]
    fields = dict(prompt_token_ids={"ids": PROMPT}, max_new_tokens=24, num_speculative_tokens=3)
    full, last = stack.generate(**fields)
    assert last.stats.resumed_tokens == 0 and len(full) > 4
    want, gaps = greedy_check(load_model(pairs["llama"][0], "cpu"), PROMPT, full)
    for s in (1, len(full) // 2, len(full) - 1):
        new, _, last = resume(stack, full, s, **fields)
        assert_same_or_near_tie(full[:s] + new, want, gaps, f"resumed after {s}")
        assert last.stats.resumed_tokens == s and last.stats.completion_tokens == s + len(new)
        assert last.stats.prompt_tokens == len(PROMPT) and last.finish_reason in ("length", "stop")
    # Resumed tokens that fill max_new_tokens: the stream ends at once (the
    # last token left out: it may be EOS, which no resumed stream holds).
    k = len(full) - 1
    new, text, last = resume(stack, full, k, **dict(fields, max_new_tokens=k))
    assert new == [] and text == "" and last.finish_reason == "length"
    assert last.stats.completion_tokens == k == last.stats.resumed_tokens and last.stats.cycles == 0


def test_a_stop_string_across_the_resume_point_ends_the_stream(stacks, pairs):
    stack = stacks["llama"]
    tok = load_tokenizer(pairs["llama"][0])
    fields = dict(prompt_token_ids={"ids": PROMPT}, max_new_tokens=32, num_speculative_tokens=3)
    full, _ = stack.generate(**fields)
    text = tok.decode(full, skip_special_tokens=True)
    for s in range(len(full) // 3, len(full) - 2):  # a resume point with 2 characters each side of it
        head = tok.decode(full[:s], skip_special_tokens=True)
        stop = text[len(head) - 2:len(head) + 2]
        if text.startswith(head) and len(head) >= 2 and len(stop) == 4 and text.find(stop) == len(head) - 2:
            break
    else:
        pytest.fail(f"no resume point with a stop string across it in {text!r}")
    whole, last = stack.generate(**fields, stop=[stop])
    assert last.finish_reason == "stop" and len(whole) > s      # the stop string ends after the resume point
    new, new_text, last = resume(stack, full, s, **fields, stop=[stop])
    # Seen only in the new text, it would not be found: the stream would run to max_new_tokens.
    assert full[:s] + new == whole and last.finish_reason == "stop" and stop not in new_text


def test_structured_output_resumes_inside_the_structure(stacks):
    stack = stacks["llama"]
    fields = dict(prompt_token_ids={"ids": PROMPT}, max_new_tokens=40, num_speculative_tokens=3,
                  structured_output={"json_schema": json.dumps(SCHEMA)})
    full, last = stack.generate(**fields)
    assert len(full) > 6, full
    for s in (3, len(full) // 2):
        # A constraint standing at the start would force '{' here.
        new, _, last = resume(stack, full, s, **fields)
        assert full[:s] + new == full and last.stats.resumed_tokens == s


# Must show: an orchestrator killed mid-stream, its streams resumed through the other.

STREAMS = 8
MAX_NEW = 600
HELD_AFTER = 30   # tokens every stream has when the kill comes


@pytest.fixture(scope="module")
def group(long_pair):
    stack = Stack(*long_pair, orchestrators=2, http=True)
    yield stack
    stack.stop()


def test_streams_of_a_killed_orchestrator_resume_through_the_other(group, long_pair):
    target = long_pair[0]
    ps = prompts(load_tokenizer(target), STREAMS)
    channels = [group.connect() for _ in range(STREAMS)]
    on = [answered_by(ch) for ch in channels]           # the orchestrator each connection reached
    counts = {o.proc.pid: on.count(o.proc.pid) for o in group.orchestrators}
    victim = max(group.orchestrators, key=lambda o: counts[o.proc.pid])
    streams = [stream_generate(ch, pb.GenerateRequest(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW,
                                                      num_speculative_tokens=3),
                               retries=8, backoff=0.2, timeout=300) for ch, p in zip(channels, ps)]
    got = [[] for _ in range(STREAMS)]
    last: list = [None] * STREAMS
    errors = []

    def consume(i):
        try:
            for r in streams[i]:
                got[i] += r.token_ids
                last[i] = r
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append((i, exc))

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while min(map(len, got)) < HELD_AFTER and not errors:  # every stream some cycles in
            assert time.monotonic() < deadline, [len(g) for g in got]
            time.sleep(0.01)
        # Hold every stream mid-way (the verifier frozen), so that the kill
        # surely falls inside all of them; then the kill, then let them go.
        os.kill(group.verifier.proc.pid, signal.SIGSTOP)
        try:
            at_kill = [len(g) for g in got]
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(30)
        finally:
            os.kill(group.verifier.proc.pid, signal.SIGCONT)
        for t in threads:
            t.join(300)
    finally:
        for ch in channels:
            ch.close()
    print(f"tokens at the kill {at_kill}, resumes {[s.resumes for s in streams]}, "
          f"on the killed one {[o == victim.proc.pid for o in on]}")
    assert not errors, errors
    assert all(HELD_AFTER <= n < MAX_NEW for n in at_kill), at_kill
    model = load_model(target, "cpu")
    for i, (p, ids) in enumerate(zip(ps, got)):
        assert len(ids) == MAX_NEW and last[i].finish_reason == "length", (i, len(ids))
        want, gaps = greedy_check(model, p, ids)
        assert_same_or_near_tie(ids, want, gaps, f"stream {i} (resumed {streams[i].resumes} times)")
        if on[i] == victim.proc.pid:   # its orchestrator died under it: resumed through the other
            assert streams[i].resumes >= 1 and last[i].stats.resumed_tokens >= at_kill[i], (i, at_kill[i])
        else:
            assert streams[i].resumes == 0 and last[i].stats.resumed_tokens == 0
    assert sum(s.resumes for s in streams) >= counts[victim.proc.pid] >= STREAMS // 2


def test_an_openai_stream_breaks_with_its_orchestrator(group):
    """What docs/http.md says an OpenAI client sees (HTTP has no resume): its
    SSE stream breaks off with APIConnectionError. Last in the module: it
    kills every orchestrator left."""
    client = openai.OpenAI(base_url=group.openai_base_url, api_key="unused")   # its default retries
    stream = client.completions.create(model=os.path.basename(group.target), prompt="def f(x):",
                                       max_tokens=MAX_NEW, stream=True)
    texts = [next(iter(stream)).choices[0].text]
    os.kill(group.verifier.proc.pid, signal.SIGSTOP)   # the stream surely mid-way at the kill
    try:
        for o in group.orchestrators:
            if o.proc.poll() is None:
                o.proc.kill()
                o.proc.wait(30)
    finally:
        os.kill(group.verifier.proc.pid, signal.SIGCONT)
    with pytest.raises(openai.APIConnectionError):
        for chunk in stream:
            assert chunk.choices[0].finish_reason is None, "the stream ended normally"
            texts.append(chunk.choices[0].text)
