"""The OpenAI-compatible API's pure parts (orchestrator/edge/openai_protocol.py):
request -> GenerateRequest, refusals naming their field, the response and chunk
bodies, vLLM's per-request speculative statistics from Stats, error mapping;
and the SSE generator of orchestrator/edge/openai_api.py on a fake source
(it closes the core's generator however the stream ends)."""

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from orchestrator.cycle.detok import Emit
from orchestrator.cycle.records import Chunk, Stats
from orchestrator.edge.openai_api import ClientGone, events, exception_error, unless_disconnected
from orchestrator.edge.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidField,
    StreamChunks,
    acceptance_histogram,
    completion_response,
    field_error,
    speculative_decoding_stats,
    to_generate_request,
    validation_error,
)
from orchestrator.fleet.clients import ServiceError
from specd_core.errors import CapacityExceeded, InvalidRequest, ShuttingDown
from specd_core.rules.structured import OutputConstraint
from specd_core.runtime.grammar import GrammarEngine
from specd_core.runtime.models import load_tokenizer

pytestmark = pytest.mark.unit

USER = [{"role": "user", "content": "hi"}]
DEMO_TARGET = Path(__file__).resolve().parents[1] / "models" / "demo" / "target"  # a committed tokenizer


def completion(**fields):
    return to_generate_request(CompletionRequest(model="m", **fields))


def chat(**fields):
    fields.setdefault("messages", USER)
    return to_generate_request(ChatCompletionRequest(model="m", **fields))


def refusal(make, **fields) -> InvalidField:
    with pytest.raises(InvalidField) as info:
        make(**fields)
    return info.value


def test_completion_fields_map_to_the_generate_request():
    r = completion(prompt="hello", max_tokens=7, temperature=0, top_p=0.5, seed=3, stop="x", top_k=4,
                   speculative_method="ngram", num_speculative_tokens=2, adaptive_speculation=False,
                   pipeline_drafting=True, pipeline_alternatives=1, confidence_threshold=0.25, user="u", n=1,
                   echo=False, presence_penalty=0, logit_bias={}, stream=True, stream_options={"include_usage": True})
    assert (r.prompt, r.max_new_tokens, r.temperature, r.top_p, r.seed, list(r.stop), r.top_k) == \
        ("hello", 7, 0.0, 0.5, 3, ["x"], 4)
    assert (r.speculative_method, r.num_speculative_tokens, r.adaptive_speculation) == ("ngram", 2, False)
    assert (r.pipeline_drafting, r.pipeline_alternatives, r.confidence_threshold) == (True, 1, 0.25)
    assert not r.HasField("tree")


def test_defaults_are_openais_and_the_services():
    r = completion(prompt="hello")
    assert r.temperature == 1.0                     # OpenAI's default, not gRPC's greedy 0
    for name in ("max_new_tokens", "top_p", "seed", "num_speculative_tokens", "adaptive_speculation"):
        assert not r.HasField(name), name           # the service's defaults apply
    assert r.speculative_method == "" and not r.stop


@pytest.mark.parametrize("prompt, want", [("a b", "a b"), (["a b"], "a b"), ([5, 6], [5, 6]), ([[5, 6]], [5, 6])])
def test_prompt_forms(prompt, want):
    r = completion(prompt=prompt)
    got = r.prompt if r.WhichOneof("input") == "prompt" else list(r.prompt_token_ids.ids)
    assert got == want


def test_chat_messages_and_text_parts():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    r = chat(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": parts, "name": "x"}],
             max_completion_tokens=5)
    assert [(m.role, m.content) for m in r.messages] == [("system", "be brief"), ("user", "one\ntwo")]
    assert r.max_new_tokens == 5 and r.WhichOneof("input") is None


def test_draft_tree_is_the_proto_draft_shape():
    r = completion(prompt="x", draft_tree={"branching": [2, 1]})
    assert list(r.tree.branching) == [2, 1] and r.tree.node_budget == 0
    r = completion(prompt="x", draft_tree={"paths": [[0], [1], [0, 0]]})
    assert [list(p.ranks) for p in r.tree.paths] == [[0], [1], [0, 0]]
    r = completion(prompt="x", draft_tree={"node_budget": 8, "max_depth": 3, "top_k": 2})
    assert (r.tree.node_budget, r.tree.max_depth, r.tree.top_k) == (8, 3, 2)


@pytest.mark.parametrize("make, fields, param, words", [
    (completion, dict(prompt="x", n=2), "n", "n must be 1"),
    (completion, dict(prompt="x", best_of=3), "best_of", "best_of"),
    (completion, dict(prompt="x", echo=True), "echo", "echo"),
    (completion, dict(prompt="x", suffix="y"), "suffix", "suffix"),
    (completion, dict(prompt="x", logprobs=1), "logprobs", "logprobs"),
    (chat, dict(logprobs=True), "logprobs", "logprobs"),
    (chat, dict(top_logprobs=2), "top_logprobs", "top_logprobs"),
    (completion, dict(prompt="x", logit_bias={"5": 1}), "logit_bias", "logit_bias"),
    (completion, dict(prompt="x", presence_penalty=0.5), "presence_penalty", "penalties"),
    (completion, dict(prompt="x", frequency_penalty=-1), "frequency_penalty", "penalties"),
    (chat, dict(tools=[{"type": "function"}]), "tools", "function calling"),
    (chat, dict(tool_choice="auto"), "tool_choice", "function calling"),
    (chat, dict(functions=[{"name": "f"}]), "functions", "function calling"),
    (chat, dict(function_call="auto"), "function_call", "function calling"),
    (chat, dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "structured_outputs",
     "both constrain"),
    (completion, dict(prompt="x", structured_outputs={"regex": "a", "grammar": "b"}), "structured_outputs",
     "gives 2 constraints (regex, grammar)"),
    (completion, dict(prompt="x", structured_outputs={}), "structured_outputs", "names no constraint"),
    (completion, dict(prompt="x", structured_outputs={"json_object": False}), "structured_outputs",
     "names no constraint"),
    (completion, dict(prompt="x", structured_outputs={"json": 3}), "structured_outputs.json", "got int"),
    (completion, dict(prompt="x", structured_outputs={"choice": []}), "structured_outputs.choice", "at least one"),
    (chat, dict(response_format={"type": "json_schema"}), "response_format.json_schema", "required"),
    (chat, dict(response_format={"type": "json_schema", "json_schema": {"name": "n"}}),
     "response_format.json_schema.schema", "required"),
    (chat, dict(response_format={"type": "text", "json_schema": {"name": "n", "schema": {}}}),
     "response_format.json_schema", "only for type json_schema"),
    (chat, dict(forced_drafting=True), "forced_drafting", "constrained requests"),
    (chat, dict(response_format={"type": "text"}, forced_drafting=False), "forced_drafting", "constrained requests"),
    (completion, dict(prompt="x", temperature=-1), "temperature", "[0, 2]"),
    (completion, dict(prompt="x", temperature=3), "temperature", "[0, 2]"),
    (completion, dict(prompt="x", temperature=float("nan")), "temperature", "[0, 2]"),
    (completion, dict(prompt="x", top_p=0), "top_p", "(0, 1]"),
    (completion, dict(prompt="x", top_p=1.5), "top_p", "(0, 1]"),
    (completion, dict(prompt="x", seed=-1), "seed", "seed"),
    (completion, dict(prompt=""), "prompt", "empty"),
    (completion, dict(prompt=[]), "prompt", "empty"),
    (completion, dict(prompt=[""]), "prompt", "empty"),
    (completion, dict(prompt=["a", "b"]), "prompt", "batching"),
    (completion, dict(prompt=[[1], [2]]), "prompt", "batching"),
    (completion, dict(prompt=[1, -2]), "prompt", ">= 0"),
    (completion, dict(prompt={"a": 1}), "prompt", "a string"),
    (completion, dict(), "prompt", "required"),
    (completion, dict(prompt="x", stop=[1]), "stop", "strings"),
    (completion, dict(prompt="x", stream_options={"include_usage": True}), "stream_options", "stream"),
    (chat, dict(messages=[]), "messages", "empty"),
    (chat, dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]),
     "messages[0].content[0]", "image_url"),
    (chat, dict(messages=[{"role": "user"}]), "messages[0].content", "string"),
    (chat, dict(max_tokens=3, max_completion_tokens=4), "max_completion_tokens", "disagree"),
])
def test_refusals_name_the_field(make, fields, param, words):
    exc = refusal(make, **fields)
    assert exc.param == param and words in str(exc), (exc.param, str(exc))


def test_unknown_and_mistyped_fields_are_pydantic_errors_naming_them():
    from pydantic import ValidationError
    for fields, param, code in ((dict(prompt="x", foo=1), "foo", "unsupported_parameter"),
                                (dict(prompt="x", max_tokens="many"), "max_tokens", None),
                                (dict(prompt="x", max_tokens=2**40), "max_tokens", None),
                                (dict(prompt="x", draft_tree={"depth": 2}), "draft_tree.depth", "unsupported_parameter"),
                                (dict(prompt="x", stream_options={"x": 1}), "stream_options.x",
                                 "unsupported_parameter"),
                                (dict(prompt="x", response_format={"type": "xml"}), "response_format.type", None),
                                (dict(prompt="x", response_format={"type": "json_schema", "json_schema": {
                                    "schema": {}}}), "response_format.json_schema.name", None),
                                (dict(prompt="x", response_format={"type": "json_schema", "json_schema": {
                                    "name": "has space", "schema": {}}}), "response_format.json_schema.name", None),
                                (dict(prompt="x", structured_outputs={"whitespace_pattern": " "}),
                                 "structured_outputs.whitespace_pattern", "unsupported_parameter")):
        with pytest.raises(ValidationError) as info:
            CompletionRequest(**fields)
        got_param, message, got_code = validation_error(info.value.errors())
        assert (got_param, got_code) == (param, code) and param in message, (fields, message)
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(messages=[{"role": "user", "content": "x", "tool_calls": []}])
    assert validation_error(info.value.errors())[0] == "messages[0].tool_calls"


def test_core_refusals_are_renamed_to_the_http_fields():
    chat_req = ChatCompletionRequest(messages=USER, max_completion_tokens=9999)
    cases = [(InvalidRequest("max_new_tokens must be in [1, 4096], got 0"), None, "max_tokens",
              "max_tokens must be in [1, 4096], got 0"),
             (InvalidRequest("max_new_tokens must be in [1, 4096], got 9999"), chat_req, "max_completion_tokens",
              "max_completion_tokens must be"),
             (InvalidRequest("prompt has 300 tokens; the model's context is 256"), chat_req, "messages",
              "the rendered messages has 300 tokens"),
             (InvalidRequest("tree depth 20 is over the limit of 16"), None, "draft_tree", "draft_tree depth 20"),
             (InvalidRequest("speculative_method must be one of ..."), None, "speculative_method", "must be one"),
             (InvalidRequest("top_k must be >= 0 (0 = off), got -1"), None, "top_k", "top_k"),
             (InvalidRequest("a draft tree needs speculative_method draft_model"), None, None, "a draft tree")]
    for exc, req, param, words in cases:
        got = field_error(exc, req)
        assert got.param == param and words in str(got), (param, str(got))


SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"]}


def structured(req) -> tuple[str, str]:
    """(the kind, its text) of a GenerateRequest's structured_output."""
    kind = req.structured_output.WhichOneof("kind")
    return kind, getattr(req.structured_output, kind)


@pytest.mark.parametrize("endpoint", [completion, chat])
def test_response_format_maps_to_structured_output(endpoint):
    base = {} if endpoint is chat else {"prompt": "x"}
    r = endpoint(**base, response_format={"type": "json_schema",
                                          "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}})
    kind, text = structured(r)
    assert kind == "json_schema" and json.loads(text) == SCHEMA
    assert structured(endpoint(**base, response_format={"type": "json_object"})) == ("json_object", True)
    # type text is no constraint, as leaving response_format out.
    assert not endpoint(**base, response_format={"type": "text"}).HasField("structured_output")
    assert not endpoint(**base).HasField("structured_output") and not endpoint(**base).HasField("forced_drafting")


@pytest.mark.parametrize("key, value, want", [
    ("json", SCHEMA, ("json_schema", SCHEMA)),
    ("json", json.dumps(SCHEMA), ("json_schema", SCHEMA)),
    ("regex", "[a-z]+", ("regex", "[a-z]+")),
    ("grammar", 'root ::= "yes" | "no"', ("ebnf", 'root ::= "yes" | "no"')),
    ("json_object", True, ("json_object", True)),
    ("choice", ["a.b", "c"], ("regex", r"(?:a\.b|c)")),
])
def test_structured_outputs_map_to_structured_output(key, value, want):
    r = completion(prompt="x", structured_outputs={key: value}, forced_drafting=False)
    kind, text = structured(r)
    assert (kind, json.loads(text) if kind == "json_schema" else text) == want
    assert r.HasField("forced_drafting") and r.forced_drafting is False
    # The same constraint next to response_format text (no constraint of its own).
    r2 = chat(response_format={"type": "text"}, structured_outputs={key: value})
    assert r2.structured_output == r.structured_output


def test_choice_matches_exactly_its_strings():
    """The choices' regex (llguidance's syntax, as the core compiles it)
    accepts each choice whole, metacharacters included, and nothing else."""
    tok = load_tokenizer(str(DEMO_TARGET))
    engine = GrammarEngine(tok, [tok.eos_token_id])
    choices = ["a.b", "x|y", "(1+2)*[3]", "{$^}", "#&-~ ?", "back\\slash", "é"]
    r = completion(prompt="x", structured_outputs={"choice": choices})
    c = OutputConstraint("regex", r.structured_output.regex)

    def allowed(text: str) -> bool:
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return engine.constraint(c, len(tok)).valid_prefix(ids) == len(ids)

    assert all(allowed(t) for t in choices)
    assert not any(allowed(t) for t in ("axb", "x", "y", "(1+2)*[3", "{$^}{$^}", "back", ""))


def test_core_constraint_refusals_name_the_field_that_carried_it():
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "not": {}}}}
    cases = [
        (ChatCompletionRequest(messages=USER, response_format=fmt),
         'structured_output.json_schema: Unimplemented keys: ["not"]', "response_format.json_schema.schema",
         'response_format.json_schema.schema: Unimplemented keys: ["not"]'),
        (ChatCompletionRequest(messages=USER, response_format={"type": "json_object"}),
         "structured_output.json_object: bad", "response_format", "response_format: bad"),
        (CompletionRequest(prompt="x", structured_outputs={"regex": "a["}),
         "structured_output.regex: unclosed character class", "structured_outputs.regex",
         "structured_outputs.regex: unclosed character class"),
        (CompletionRequest(prompt="x", structured_outputs={"grammar": "root ::= "}),
         "structured_output.ebnf is empty", "structured_outputs.grammar", "structured_outputs.grammar is empty"),
        (CompletionRequest(prompt="x", structured_outputs={"json": "{"}),
         "structured_output.json_schema is not valid JSON: x", "structured_outputs.json",
         "structured_outputs.json is not valid JSON: x"),
        (CompletionRequest(prompt="x", structured_outputs={"regex": "a"}, pipeline_drafting=True),
         "pipeline_drafting is not available with structured_output", "pipeline_drafting",
         "pipeline_drafting is not available with structured_outputs"),
    ]
    for req, core_message, param, message in cases:
        got = field_error(InvalidRequest(core_message), req)
        assert (got.param, str(got)) == (param, message)


def test_errors_map_to_openai_statuses():
    assert exception_error(InvalidRequest("top_p must be in (0, 1], got 0"))[:3] == \
        (400, "top_p must be in (0, 1], got 0", "top_p")
    assert exception_error(CapacityExceeded("at its limit"))[0] == 429
    assert exception_error(ShuttingDown("shutting down"))[0] == 503
    assert exception_error(ServiceError(grpc.StatusCode.UNAVAILABLE, "replica gone"))[:2] == (503, "replica gone")
    assert exception_error(ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"))[0] == 504
    assert exception_error(ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "kv full"))[0] == 429
    assert exception_error(ServiceError(grpc.StatusCode.INTERNAL, "bug"))[0] == 500
    assert exception_error(RuntimeError("boom"))[0] == 500


def stats_of(**fields) -> Stats:
    s = Stats(num_speculative_tokens=3, method="draft_model", prompt_tokens=5, completion_tokens=9)
    for k, v in fields.items():
        setattr(s, k, v)
    return s


def test_speculative_stats_follow_vllms_definitions():
    # 5 steps accepted 0, 1, 3, 3, 0 draft tokens: reached positions 0: 3 steps, 1: 2, 2: 2.
    s = stats_of(cycles=6, drafts=5, drafted_tokens=15, accepted_tokens=7, accepted_per_position=[3, 2, 2],
                 forced_tokens=4, forced_accepted=3)
    got = speculative_decoding_stats(s)
    assert got == {"num_spec_steps": 5, "num_draft_tokens": 15, "num_accepted_draft_tokens": 7,
                   "mean_acceptance_length": 1 + 7 / 5, "draft_acceptance_rate": 7 / 15,
                   "acceptance_histogram": {"0": 2, "1": 1, "3": 2}, "num_spec_tokens": 3, "method": "draft_model",
                   "forced_tokens": 4, "forced_accepted": 3}
    hist = {int(j): n for j, n in got["acceptance_histogram"].items()}
    assert sum(hist.values()) == got["num_spec_steps"]
    assert sum(j * n for j, n in hist.items()) == got["num_accepted_draft_tokens"]
    # No step drafted (an adaptive depth of 0 throughout): vLLM's zero-step values.
    zero = speculative_decoding_stats(stats_of(cycles=4))
    assert (zero["num_spec_steps"], zero["mean_acceptance_length"], zero["draft_acceptance_rate"],
            zero["acceptance_histogram"]) == (0, 1.0, 0.0, {})
    assert speculative_decoding_stats(Stats(method="off")) is None
    assert acceptance_histogram(4, [4, 4]) == {"2": 4}


def test_response_and_chunk_bodies():
    s = stats_of(drafts=1, drafted_tokens=3, accepted_tokens=1, accepted_per_position=[1, 0, 0])
    body = completion_response("cmpl-1", 7, "m", False, "abc", s, "length")
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "abc"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["choices"][0]["speculative_decoding_stats"]["num_spec_steps"] == 1
    body = completion_response("chatcmpl-1", 7, "m", True, "abc", s, "stop")
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "abc"}

    fmt = StreamChunks("chatcmpl-1", 7, "m", True, include_usage=True)
    first = fmt.chunk("", None, s)                 # held-back text: still the role
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["usage"] is None
    assert "speculative_decoding_stats" not in first["choices"][0]
    assert fmt.chunk("", None, s) is None          # nothing new: no chunk
    mid = fmt.chunk("de", None, s)
    assert mid["choices"][0]["delta"] == {"content": "de"} and mid["object"] == "chat.completion.chunk"
    last = fmt.chunk("", "stop", s)
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert last["choices"][0]["speculative_decoding_stats"]["num_draft_tokens"] == 3
    assert fmt.usage_chunk(s) == {**fmt.head, "choices": [], "usage": body["usage"]}
    plain = StreamChunks("cmpl-1", 7, "m", False, include_usage=False)
    assert plain.chunk("", None, s) is None
    assert plain.chunk("x", None, s)["choices"][0]["text"] == "x" and "usage" not in plain.chunk("y", None, s)


# -- the SSE generator and the disconnect watch, on fakes ------------------------


class Source:
    """A core-like generator: yields the chunks, then raises `error` if given;
    `closed` once its finally ran (what frees sessions in the real core)."""

    def __init__(self, chunks, error=None, hang=False):
        self.chunks, self.error, self.hang, self.closed = chunks, error, hang, False

    async def gen(self):
        try:
            for c in self.chunks:
                yield c
            if self.hang:
                await asyncio.Event().wait()
            if self.error:
                raise self.error
        finally:
            self.closed = True


def chunk(text, reason=None):
    return Chunk(Emit([1], text, reason), stats_of())


async def drain(agen, limit=None):
    out = []
    async for item in agen:
        out.append(item)
        if limit and len(out) == limit:
            await agen.aclose()
            break
    return out


def test_sse_stream_ends_with_done_or_with_an_error_event():
    src = Source([chunk("b"), chunk("c", "length")])
    gen = src.gen()
    first = asyncio.run(anext_of(gen))
    got = asyncio.run(drain(events(gen, first, StreamChunks("i", 1, "m", False, True), None)))
    assert [g for g in got if g.startswith("{")][-1].startswith('{"id": "i"') and got[-1] == "[DONE]"
    assert '"usage": {"prompt_tokens": 5' in got[-2] and src.closed

    src = Source([chunk("a"), chunk("b")], error=ShuttingDown("the orchestrator is shutting down"))
    gen = src.gen()
    got = asyncio.run(drain_after_first(gen))
    assert '"code": "service_unavailable"' in got[-1] and "shutting down" in got[-1]
    assert "[DONE]" not in got and src.closed


async def anext_of(gen):
    return await anext(gen)


async def drain_after_first(gen):
    first = await anext(gen)
    return await drain(events(gen, first, StreamChunks("i", 1, "m", False, False), None))


def test_a_consumer_that_leaves_closes_the_source_at_once():
    async def run():
        src = Source([chunk("a"), chunk("b"), chunk("c")], hang=True)
        gen = src.gen()
        first = await anext(gen)
        await drain(events(gen, first, StreamChunks("i", 1, "m", False, False), None), limit=1)
        return src.closed
    assert asyncio.run(run())

    async def cancelled():  # the response task cancelled while the source waits (a disconnect)
        src = Source([chunk("a")], hang=True)
        gen = src.gen()
        first = await anext(gen)
        task = asyncio.ensure_future(drain(events(gen, first, StreamChunks("i", 1, "m", False, False), None)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return src.closed
    assert asyncio.run(cancelled())


class FakeRequest:
    def __init__(self, disconnect_after: float | None):
        self.after = disconnect_after

    async def receive(self):
        if self.after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.after)
        return {"type": "http.disconnect"}


def test_a_disconnect_before_the_first_chunk_cancels_the_request():
    async def run(after):
        src = Source([], hang=True)
        gen = src.gen()
        with pytest.raises(ClientGone):
            await unless_disconnected(FakeRequest(after), anext(gen))
        return src.closed
    assert asyncio.run(run(0.01))

    async def served():
        src = Source([chunk("a")])
        return (await unless_disconnected(FakeRequest(None), anext(src.gen()))).emit.text
    assert asyncio.run(served()) == "a"
