"""Structured output over the OpenAI-compatible HTTP API (docs/http.md), on a
real local stack driven by the official `openai` package: `response_format`
json_schema (also through the SDK's own `parse` helper) and json_object, on
chat and completions, streaming and not; specd's `structured_outputs` extra
(regex, choice, grammar, json) through `extra_body`; `forced_drafting` and the
forced-token statistics; greedy output equal to gRPC's for the same
constraint; bad constraints refused with 400 in OpenAI's error shape naming the
field and the problem, after which the service serves on with no session left.

The models are random, so the constraints are bounded (maxLength, enum,
integer ranges): a random model may otherwise run on inside an open string until
max_tokens. PET's longest output is 108 bytes (60 with an empty name, each of
its 4 characters at worst a 12-byte escaped surrogate pair; separators fixed,
JSON without free whitespace: specd_core/runtime/grammar.py), and every token is at
least one byte, so with EOS it fits in MAX_TOKENS: each request must finish
with "stop"; the other constraints of the extra's test are shorter still."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from specd_core.api.v1 import specdec_pb2 as pb
from tests.test_cancellation import live_state
from tests.test_http_api import client, grpc_generate, stack  # noqa: F401 (fixtures: the session's http_stack, as test_http_api.py's)

pytestmark = pytest.mark.services

MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
PROMPT = "pet = "
MAX_TOKENS = 128
SEEDS = range(6)
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "vaccinated": {"type": "boolean"},
    },
    "required": ["name", "kind", "age", "vaccinated"],
    "additionalProperties": False,
}
PET_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}


class Pet(BaseModel):
    """PET as the SDK's `parse` helper takes it (a pydantic model)."""

    name: str = Field(max_length=4)
    kind: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=99)
    vaccinated: bool


MODEL = "llama-chat"  # the target directory's name


def spec_stats(choice) -> dict:
    return (choice.model_extra or {})["speculative_decoding_stats"]


def create(client, endpoint: str, **fields):
    """A non-streaming request to chat or completions; (text, choice)."""
    fields.setdefault("max_tokens", MAX_TOKENS)
    if endpoint == "chat":
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, **fields)
        return r.choices[0].message.content, r.choices[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, **fields)
    return r.choices[0].text, r.choices[0]


def assert_forced_stats(stats: list[dict]) -> None:
    """The schema's keys and punctuation are forced: some were drafted for
    free, each counted in the draft tokens, and no more kept than drafted."""
    assert sum(s["forced_tokens"] for s in stats) > 0, stats
    for s in stats:
        assert 0 <= s["forced_accepted"] <= s["forced_tokens"] <= s["num_draft_tokens"], s
        assert s["forced_accepted"] <= s["num_accepted_draft_tokens"], s


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_json_schema_output_validates(client, endpoint):
    """/v1/completions takes response_format too (as vLLM): the SDK sends it
    there through extra_body."""
    outputs, stats = [], []
    for seed in SEEDS:
        if endpoint == "chat":
            text, choice = create(client, endpoint, seed=seed, response_format=PET_FORMAT)
        else:
            text, choice = create(client, endpoint, seed=seed, extra_body={"response_format": PET_FORMAT})
        assert choice.finish_reason == "stop", (text, choice.finish_reason)  # bounded: see the module
        value = json.loads(text)
        jsonschema.validate(value, PET)
        outputs.append(value)
        stats.append(spec_stats(choice))
    assert_forced_stats(stats)
    # Sampled (temperature 1, OpenAI's default): the seeds gave different pets.
    assert len({json.dumps(v, sort_keys=True) for v in outputs}) > 1, outputs


def test_sdk_parse_helper_gets_a_valid_object(client):
    """The SDK's own structured-output path: a pydantic model becomes a strict
    json_schema response_format, and the reply is parsed back into it."""
    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, response_format=Pet)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet)
    assert choice.message.parsed == Pet.model_validate_json(choice.message.content)


@pytest.mark.parametrize("endpoint, how", [("chat", "response_format"), ("completions", "structured_outputs")])
def test_json_object_gives_a_json_object(client, endpoint, how):
    """Any JSON object: unbounded, so a random model may run to max_tokens;
    most finish, and every finished one parses to an object."""
    body = {"response_format": {"type": "json_object"}} if how == "response_format" else \
        {"structured_outputs": {"json_object": True}}
    finished = []
    for seed in SEEDS:
        text, choice = create(client, endpoint, seed=seed, max_tokens=200, extra_body=body)
        assert text.startswith("{"), text
        if choice.finish_reason == "stop":
            finished.append(json.loads(text))
    assert len(finished) >= len(SEEDS) * 2 // 3, finished
    assert all(isinstance(v, dict) for v in finished), finished


REGEX = r"[a-z]{1,8}-[0-9]{2,4}"
CHOICES = ["red", "green", "blue", "a.b|c"]
GRAMMAR = 'root ::= answer "!"\nanswer ::= "yes" | "no" | "maybe"'


def is_pet(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PET)
    except (ValueError, jsonschema.ValidationError):  # json's errors are ValueErrors
        return False
    return True


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("constraint, check", [
    ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text) is not None),
    ({"choice": CHOICES}, lambda text: text in CHOICES),
    ({"grammar": GRAMMAR}, lambda text: re.fullmatch(r"(yes|no|maybe)!", text) is not None),
    ({"json": PET}, is_pet),
    ({"json": json.dumps(PET)}, is_pet),  # the schema as JSON text, as vLLM takes it too
], ids=["regex", "choice", "grammar", "json", "json-text"])
def test_structured_outputs_extra(client, endpoint, constraint, check):
    """Each kind the extra takes; every one is bounded, so every output ends."""
    for seed in SEEDS[:3]:
        text, choice = create(client, endpoint, seed=seed, extra_body={"structured_outputs": constraint})
        assert choice.finish_reason == "stop" and check(text), (text, choice.finish_reason)
    # A check that unconstrained output passes would prove nothing: the same
    # request without the constraint makes text it refuses.
    free, _ = create(client, endpoint, seed=0, max_tokens=24)
    assert not check(free), free


def test_streaming_with_response_format(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=1, response_format=PET_FORMAT, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PET)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "stop"
    assert len([c for c in chunks if c.choices]) > 2  # streamed in pieces, not one body
    assert_forced_stats([spec_stats(finishing[0].choices[0])])
    assert chunks[-1].usage.completion_tokens > 0


def test_forced_drafting_switch_and_greedy_equals_grpc(client, stack):
    """Greedy: forced drafting on or off, and gRPC with the same constraint,
    give the same text; off drafts no forced token."""
    fields = dict(seed=0, temperature=0, response_format=PET_FORMAT)
    on, c_on = create(client, "chat", **fields)
    off, c_off = create(client, "chat", **fields, extra_body={"forced_drafting": False})
    assert on == off and c_on.finish_reason == c_off.finish_reason == "stop"
    assert spec_stats(c_on)["forced_tokens"] > 0 and spec_stats(c_off)["forced_tokens"] == 0
    want, last = grpc_generate(stack, messages=[pb.ChatMessage(**m) for m in MESSAGES], max_new_tokens=MAX_TOKENS,
                               temperature=0, structured_output=pb.StructuredOutput(json_schema=json.dumps(PET)))
    assert on == want and last.stats.forced_tokens > 0
    jsonschema.validate(json.loads(on), PET)


NOT_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}
BAD = [
    # (endpoint, fields, extra_body, param, words in the message)
    ("chat", dict(response_format=NOT_SCHEMA), None, "response_format.json_schema.schema", "not"),
    ("chat", dict(response_format=NOT_SCHEMA, stream=True), None, "response_format.json_schema.schema", "not"),
    ("chat", dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     None, "response_format.json_schema.schema", "objekt"),
    ("completions", {}, {"structured_outputs": {"regex": "a["}}, "structured_outputs.regex", "unclosed"),
    ("chat", dict(stream=True), {"structured_outputs": {"regex": "a["}}, "structured_outputs.regex", "unclosed"),
    ("completions", {}, {"structured_outputs": {"grammar": 'root ::= "a'}}, "structured_outputs.grammar",
     "end of input"),
    ("completions", {}, {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ("chat", dict(response_format={"type": "json_object"}), {"structured_outputs": {"regex": "a"}},
     "structured_outputs", "response_format (type 'json_object') and structured_outputs"),
    ("completions", {}, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "gives 2 constraints (regex, choice)"),
    ("completions", {}, {"structured_outputs": {"regex": "a"}, "pipeline_drafting": True}, "pipeline_drafting",
     "structured_outputs"),
    ("chat", dict(response_format={"type": "json_schema"}), None, "response_format.json_schema", "required"),
    ("chat", dict(response_format={"type": "yaml"}), None, "response_format.type", "json_schema"),
    ("chat", {}, {"forced_drafting": True}, "forced_drafting", "constrained"),
    ("completions", {}, {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "unsupported field"),
]


@pytest.mark.parametrize("endpoint, fields, body, param, words", BAD,
                         ids=[f"{b[0]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_constraint_is_400_naming_the_problem(client, endpoint, fields, body, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, endpoint, **fields, extra_body=body)
    err = info.value
    assert err.status_code == 400 and err.body["type"] == "invalid_request_error", err.body
    assert err.body["param"] == param and words in err.body["message"], err.body


def test_still_serves_after_bad_constraints(client, stack):
    text, choice = create(client, "chat", seed=2, response_format=PET_FORMAT)
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(text), PET)
    assert not any(live_state(stack).values())
