"""The OpenAI-compatible HTTP API (docs/http.md) on a real local stack, driven
by the official `openai` package: completions and chat, streaming and not,
greedy text, usage and speculative statistics equal to gRPC Generate's for the
same request; specd's extras change what runs; bad requests get OpenAI's error
shape with the field named, and the service goes on serving; SSE streams
dropped at random points leave no session on any replica.

One stack for the module: the `pairs` llama pair, its target copied with a
chat template (the tiny tokenizer has none) so that chat renders as gRPC's
`messages` do. Auth and TLS over HTTP: tests/test_security.py; draining:
its test_sigterm_drains."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import time

import httpx2
import openai
import pytest

from specd_core.api.v1 import specdec_pb2 as pb
from tests.test_cancellation import live_state
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.services

PROMPT = "def read_config(path):\n    with open(path) as f:"
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def read_config(path):"}]
GREEDY = dict(temperature=0, max_tokens=20)
K3 = {"num_speculative_tokens": 3}  # a fixed K: adaptive depth would vary with measured costs


@pytest.fixture(scope="module")
def stack(http_stack):
    """The session's HTTP stack (tests/conftest.py), shared with
    tests/test_http_structured.py: its tests compare counters by their
    increase and end with no session open."""
    return http_stack


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack.openai_base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(stack):
    return "llama-chat"  # the target directory's name


def grpc_generate(stack, **fields) -> tuple[str, pb.GenerateResponse]:
    text, last = "", None
    for r in stack.stub.Generate(pb.GenerateRequest(**fields), timeout=120):
        text += r.text
        last = r
    return text, last


def assert_stats_match(choice_stats: dict, usage, g: pb.GenerationStats):
    assert (usage.prompt_tokens, usage.completion_tokens) == (g.prompt_tokens, g.completion_tokens)
    assert usage.total_tokens == g.prompt_tokens + g.completion_tokens
    s = choice_stats
    assert (s["num_draft_tokens"], s["num_accepted_draft_tokens"], s["num_spec_steps"]) == \
        (g.drafted_tokens, g.accepted_tokens, g.drafts)
    # A fixed chain drafts every cycle but one that has a single token left to make.
    assert g.cycles - 1 <= g.drafts <= g.cycles
    assert (s["num_spec_tokens"], s["method"]) == (g.num_speculative_tokens, g.method)
    assert s["mean_acceptance_length"] == pytest.approx(1 + g.accepted_tokens / g.drafts)
    hist = {int(j): n for j, n in s["acceptance_histogram"].items()}
    assert sum(hist.values()) == g.drafts and sum(j * n for j, n in hist.items()) == g.accepted_tokens
    reached = list(g.accepted_per_position)
    assert all(hist.get(j, 0) == (g.drafts if j == 0 else reached[j - 1]) - (reached[j] if j < len(reached) else 0)
               for j in range(len(reached) + 1))


def extra(obj) -> dict:
    """A pydantic object's fields the SDK does not know (specd's / vLLM's)."""
    return obj.model_extra or {}


def test_models_health_and_metrics(client, stack, model):
    assert [m.id for m in client.models.list().data] == [model]
    assert httpx2.get(stack.http_url + "/health").status_code == 200
    samples = scrape(stack.http_address)                 # the process's Prometheus registry
    assert ("specdec:active_sessions", frozenset()) in samples


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_grpc_with_its_stats(client, stack, model, stream):
    want, last = grpc_generate(stack, prompt=PROMPT, max_new_tokens=20, temperature=0, **K3)
    assert last.stats.drafted_tokens > 0 and last.finish_reason == "length"
    if not stream:
        r = client.completions.create(model=model, prompt=PROMPT, **GREEDY, extra_body=K3)
        choice = r.choices[0]
        assert (r.object, r.model, choice.text, choice.finish_reason) == ("text_completion", model, want, "length")
        assert_stats_match(extra(choice)["speculative_decoding_stats"], r.usage, last.stats)
        return
    chunks = list(client.completions.create(model=model, prompt=PROMPT, **GREEDY, extra_body=K3, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want and len(chunks) > 3
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"
    # The stats ride the finishing chunk only; usage comes last, with no choice.
    assert [c for c in chunks if c.choices and "speculative_decoding_stats" in extra(c.choices[0])] == finishing
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert_stats_match(extra(finishing[0].choices[0])["speculative_decoding_stats"], chunks[-1].usage, last.stats)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_grpc_messages(client, stack, model, stream):
    want, last = grpc_generate(stack, messages=[pb.ChatMessage(**m) for m in CHAT], max_new_tokens=20,
                               temperature=0, **K3)
    if not stream:
        r = client.chat.completions.create(model=model, messages=CHAT, **GREEDY, extra_body=K3)
        msg = r.choices[0].message
        assert (r.object, msg.role, msg.content) == ("chat.completion", "assistant", want)
        assert_stats_match(extra(r.choices[0])["speculative_decoding_stats"], r.usage, last.stats)
        # Content as a list of text parts is the same message.
        parts = [CHAT[0], {"role": "user", "content": [{"type": "text", "text": CHAT[1]["content"]}]}]
        r2 = client.chat.completions.create(model=model, messages=parts, **GREEDY, extra_body=K3)
        assert r2.choices[0].message.content == want
        return
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, **GREEDY, extra_body=K3, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1
    assert_stats_match(extra(finishing[0].choices[0])["speculative_decoding_stats"], chunks[-1].usage, last.stats)


def test_extras_choose_what_runs(client, stack, model):
    def stats(**body):
        r = client.completions.create(model=model, prompt=PROMPT, **GREEDY, extra_body=body)
        return r.choices[0].text, extra(r.choices[0])["speculative_decoding_stats"]

    text_default, default = stats()
    text_ngram, ngram = stats(speculative_method="ngram", num_speculative_tokens=2)
    text_off, off = stats(speculative_method="off")
    assert default["method"] == "draft_model" and ngram["method"] == "ngram" and off is None
    assert ngram["num_spec_tokens"] == 2
    assert text_default == text_ngram == text_off           # greedy: the target's text whatever drafts it
    # A tree: the same drafts as gRPC's tree request.
    _, tree = stats(draft_tree={"branching": [2, 1]}, adaptive_speculation=False)
    _, last = grpc_generate(stack, prompt=PROMPT, max_new_tokens=20, temperature=0,
                            tree=pb.DraftShape(branching=[2, 1]), adaptive_speculation=False)
    assert (tree["num_draft_tokens"], tree["num_accepted_draft_tokens"]) == \
        (last.stats.drafted_tokens, last.stats.accepted_tokens)
    assert tree["num_draft_tokens"] > tree["num_spec_steps"] * 2     # 4-node trees, not chains


BAD = [  # (endpoint, fields, extra_body, param, words)
    ("completions", dict(n=2), None, "n", "n must be 1"),
    ("completions", dict(logprobs=2), None, "logprobs", "not supported"),
    ("chat", dict(logprobs=True), None, "logprobs", "not supported"),
    ("chat", dict(top_logprobs=2), None, "top_logprobs", "not supported"),
    ("completions", dict(echo=True), None, "echo", "not supported"),
    ("completions", dict(best_of=2), None, "best_of", "best_of"),
    ("completions", dict(suffix="}"), None, "suffix", "not supported"),
    ("completions", dict(logit_bias={"5": 10}), None, "logit_bias", "not supported"),
    ("completions", dict(presence_penalty=0.5), None, "presence_penalty", "not supported"),
    ("chat", dict(frequency_penalty=1.0), None, "frequency_penalty", "not supported"),
    ("chat", dict(tools=[{"type": "function", "function": {"name": "f"}}]), None, "tools", "not supported"),
    ("chat", dict(tool_choice="required"), None, "tool_choice", "not supported"),
    ("chat", dict(functions=[{"name": "f"}]), None, "functions", "not supported"),
    ("chat", dict(function_call="auto"), None, "function_call", "not supported"),
    # Structured output's own refusals: tests/test_http_structured.py.
    ("chat", dict(response_format={"type": "xml"}), None, "response_format.type", "json_schema"),
    ("completions", {}, {"frobnicate": 1}, "frobnicate", "unsupported field"),
    ("completions", dict(temperature=-1), None, "temperature", "temperature"),
    ("chat", dict(temperature=3), None, "temperature", "temperature"),
    ("completions", dict(top_p=0), None, "top_p", "top_p"),
    ("completions", dict(top_p=1.5), None, "top_p", "top_p"),
    ("completions", dict(prompt=""), None, "prompt", "empty"),
    ("completions", dict(prompt=["a", "b"]), None, "prompt", "batching"),
    ("completions", dict(max_tokens=0), None, "max_tokens", "max_tokens must be in"),
    ("completions", dict(max_tokens="many"), None, "max_tokens", "integer"),
    ("completions", {}, {"speculative_method": "psychic"}, "speculative_method", "one of"),
    ("completions", {}, {"draft_tree": {"branching": [2], "shape": 1}}, "draft_tree.shape", "unsupported field"),
    ("chat", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     None, "messages[0].content[0]", "image_url"),
    ("completions", dict(temperature=3, stream=True), None, "temperature", "temperature"),  # a status, not SSE
]


@pytest.mark.parametrize("endpoint, fields, body, param, words", BAD,
                         ids=[f"{b[0]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_request_is_400_naming_the_field(client, model, endpoint, fields, body, param, words):
    fields = {"max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(model=model, **{"messages": CHAT, **fields}, extra_body=body)
        else:
            client.completions.create(model=model, **{"prompt": PROMPT, **fields}, extra_body=body)
    err = info.value
    assert err.status_code == 400 and err.body["type"] == "invalid_request_error", err.body
    assert err.body["param"] == param and words in err.body["message"], err.body


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=4)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    assert "gpt-17" in info.value.body["message"]


def test_malformed_json_and_unknown_paths_are_openai_shaped(stack):
    r = httpx2.post(stack.openai_base_url + "/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx2.get(stack.openai_base_url + "/embeddings")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_still_serves_after_bad_requests(client, model, stack):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    assert not any(live_state(stack).values())


# -- clients that leave -----------------------------------------------------------

STREAMS = 200
NOT_STREAMED = 20  # non-streaming requests dropped before their answer, among the streams
CONCURRENCY = 16


async def one_stream(client, model, rng: random.Random, outcomes: collections.Counter, streamed: bool) -> None:
    kind = rng.choices(["before_response", "after_headers", "mid_stream", "complete"], [3, 2, 4, 1])[0] \
        if streamed else "not_streamed"
    chat = rng.random() < 0.5
    # Method off marks the requests not streamed in the metrics (the streams speculate).
    speculation = rng.choice([{}, K3, {"speculative_method": "ngram"}, {"draft_tree": {"branching": [2, 1]}}])
    body = dict(max_tokens=rng.randint(2, 24), temperature=rng.choice([0, 0.8]), seed=rng.randrange(100),
                stream=streamed, extra_body=speculation if streamed else {"speculative_method": "off"})
    prompt = PROMPT[: rng.randint(4, len(PROMPT))]
    create = (client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], **body)
              if chat else client.completions.create(model=model, prompt=prompt, **body))
    if kind in ("before_response", "not_streamed"):  # gone before the response started
        try:
            stream = await asyncio.wait_for(create, timeout=rng.uniform(0.001, 0.05))
        except (asyncio.TimeoutError, openai.APITimeoutError):
            outcomes[kind] += 1
            return
        if kind == "not_streamed":
            outcomes["not_streamed (too late: answered)"] += 1
            return
        await stream.close()
        outcomes["before_response (too late: after headers)"] += 1
        return
    stream = await create
    stop_after = {"after_headers": 0, "mid_stream": rng.randint(1, 6), "complete": None}[kind]
    received = 0
    if stop_after != 0:
        async for _ in stream:
            received += 1
            if received == stop_after:
                break
    await stream.close()                                  # the connection closes: a disconnect
    outcomes[kind if stop_after is None or received == stop_after else "completed early"] += 1


async def run_streams(base_url: str, model: str) -> collections.Counter:
    rng = random.Random(11)
    outcomes: collections.Counter = collections.Counter()
    requests = [(random.Random(rng.random()), i < STREAMS) for i in range(STREAMS + NOT_STREAMED)]
    rng.shuffle(requests)
    gate = asyncio.Semaphore(CONCURRENCY)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as client:
        async def gated(r, streamed):
            async with gate:
                await one_stream(client, model, r, outcomes, streamed)
        await asyncio.gather(*(gated(r, streamed) for r, streamed in requests))
    return outcomes


def test_dropped_streams_leave_no_session(stack, model, client):
    start, before = time.monotonic(), scrape(stack.http_address)
    outcomes = asyncio.run(run_streams(stack.openai_base_url, model))
    print(f"{STREAMS} HTTP streams + {NOT_STREAMED} requests in {time.monotonic() - start:.1f} s: {dict(outcomes)}")
    assert sum(outcomes.values()) == STREAMS + NOT_STREAMED
    for kind, least in (("before_response", 20), ("after_headers", 20), ("mid_stream", 40), ("complete", 5),
                        ("not_streamed", 10)):
        assert outcomes[kind] >= least, outcomes
    # Closing runs after the client has left: wait (bounded) for it to settle.
    deadline = time.monotonic() + 60
    while any(live_state(stack).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    state = live_state(stack)
    assert not any(state.values()), state
    after = scrape(stack.http_address)
    assert value(after, "specdec:active_sessions") == 0
    # Dropped requests stopped generating (the core's generator was closed), in
    # every way of leaving: the requests read to their end finished, and few others
    # (a drop can race its request's last tokens; a quarter of them is far more
    # than seen), where without cancellation all would have.
    finished = collections.Counter()
    for (name, labels), v in after.items():
        if name == "specdec:request_success_total":
            finished["streamed" if dict(labels)["method"] != "off" else "not"] += v - before.get((name, labels), 0.0)
    ran_out = outcomes["complete"] + outcomes["completed early"]
    assert ran_out <= finished["streamed"] <= ran_out + (STREAMS - ran_out) / 4, (finished, dict(outcomes))
    answered = outcomes["not_streamed (too late: answered)"]
    assert answered <= finished["not"] <= answered + (NOT_STREAMED - answered) / 4, (finished, dict(outcomes))
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5


def test_sse_wire_format(stack, model):
    """What a client without the SDK reads: `data: {json}` events, then `data: [DONE]`."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx2.stream("POST", stack.openai_base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) != ""


def test_cached_tokens_and_cache_salt(client, model):
    """Prefix caching over HTTP: usage.prompt_tokens_details.cached_tokens on a
    second request with the same prompt and cache_salt (an extra), none with
    another salt. 150 token ids: two full 64-row blocks are reusable."""
    prompt = [random.Random(34).randrange(3, 380) for _ in range(150)]

    def cached(salt: str) -> int:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("http-a") == 0
    assert cached("http-b") == 0
    assert cached("http-a") == 128
