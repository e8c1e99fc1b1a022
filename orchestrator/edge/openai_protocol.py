"""The OpenAI-compatible HTTP API as data (docs/http.md): request models,
request -> `GenerateRequest`, and the response, chunk and error bodies built
from the core's Chunks and Stats. Pure: no I/O, no server; the FastAPI shell
is orchestrator/edge/openai_api.py.

Every refusal is an `InvalidField` (an InvalidRequest) that names the field as
the client spelt it, so the HTTP error's `param` says what to fix. A field the
service does not support is refused by name, never silently ignored: unknown
fields by the models (`extra="forbid"`), known OpenAI fields it cannot honour
by `check_unsupported`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.cycle.records import Stats
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.errors import InvalidRequest

INT32 = 2**31 - 1
# Proto int32 fields: a larger value would fail in the proto's constructor
# (a ValueError, i.e. a 500) instead of naming the field.
Int32 = Annotated[int, Field(ge=-INT32 - 1, le=INT32)]
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request leaves it out (gRPC's is 0, greedy)


class InvalidField(InvalidRequest):
    """Bad input in one field; `param` names it as the client spelt it."""

    def __init__(self, param: str | None, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted: there is nothing to obfuscate here


class DraftTree(Strict):
    """pb.DraftShape as JSON: a static tree (branching per depth, or paths of
    ranks node by node) or a dynamic one (node_budget, max_depth, top_k)."""

    branching: list[Int32] = []
    node_budget: Int32 = 0
    max_depth: Int32 = 0
    top_k: Int32 = 0
    paths: list[list[Int32]] = []


class JsonSchemaFormat(Strict):
    """response_format.json_schema, as OpenAI defines it. `strict` is
    accepted whatever its value: the schema is always enforced."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for the name
    description: str | None = None
    # `schema` would shadow a BaseModel attribute: the JSON key is an alias.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """specd's extra for the constraints response_format cannot say (vLLM's
    name and keys): exactly one of them."""

    # A schema or its JSON text; typed by `schema_text`, whose one message
    # beats a union's error per member.
    json_: Any = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # GBNF or Lark
    json_object: bool | None = None


class ChatMessage(Strict):
    role: str
    content: Any = None  # checked by message_content (a string or a list of text parts)
    name: str | None = None  # accepted, not rendered (templates take role and content)


class _Common(Strict):
    """Fields both endpoints take. The unsupported OpenAI fields are typed
    Any: whatever their value, the refusal is `check_unsupported`'s message."""

    model: str | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Any = None  # checked by stop_strings (a string or a list of strings)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None  # accepted, ignored
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    logprobs: Any = None
    # specd's extras (GenerateRequest's fields of the same name; `draft_tree` is `tree`).
    top_k: Int32 | None = None
    speculative_method: str | None = None
    num_speculative_tokens: Int32 | None = None
    draft_tree: DraftTree | None = None
    adaptive_speculation: bool | None = None
    pipeline_drafting: bool | None = None
    pipeline_alternatives: Int32 | None = None
    confidence_threshold: float | None = None
    # Structured output: OpenAI's response_format (a chat field; /v1/completions
    # takes it too, as vLLM does), or specd's structured_outputs.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    forced_drafting: bool | None = None
    # Prefix caching: share cached prompt blocks only with requests of the same salt (vLLM's extra).
    cache_salt: str | None = None


class CompletionRequest(_Common):
    prompt: Any = None  # checked by prompt_input: a union here would give four errors for one mistake
    echo: Any = None
    best_of: Any = None
    suffix: Any = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Int32 | None = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None


# field -> (values that mean "not used", why it is refused)
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "n": ((None, 1), "n must be 1: one choice per request"),
    "best_of": ((None, 1), "best_of must be 1: one choice per request"),
    "echo": ((None, False), "echo is not supported"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "logprobs": ((None, False), "logprobs is not supported"),
    "top_logprobs": ((None, 0), "top_logprobs is not supported"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
    "presence_penalty": ((None, 0), "presence_penalty must be 0: penalties are not supported"),
    "frequency_penalty": ((None, 0), "frequency_penalty must be 0: penalties are not supported"),
    "tools": ((None, []), "tools (function calling) is not supported"),
    "tool_choice": ((None, "none"), "tool_choice (function calling) is not supported"),
    "functions": ((None, []), "functions (function calling) is not supported"),
    "function_call": ((None, "none"), "function_call (function calling) is not supported"),
    "parallel_tool_calls": ((None,), "parallel_tool_calls (function calling) is not supported"),
}


def check_unsupported(req: BaseModel) -> None:
    for name, (neutral, why) in UNSUPPORTED.items():
        if name not in type(req).model_fields:
            continue
        value = getattr(req, name)
        if not any(value == v for v in neutral):
            raise InvalidField(name, f"{why} (got {value!r})", "unsupported_parameter")


def prompt_input(prompt: Any) -> str | list[int]:
    """`prompt`: a string, a list of token ids, or a list holding one of those."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise InvalidField(
                "prompt",
                f"prompt holds {len(prompt)} prompts: batching several prompts in one request is not "
                "supported; send one request per prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidField("prompt", "prompt must not be empty")
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise InvalidField("prompt", "prompt must not be empty")
        bad = [t for t in prompt if not 0 <= t <= INT32]
        if bad:
            raise InvalidField("prompt", f"prompt token ids must be >= 0, got {bad[:5]}")
        return prompt
    if prompt is None:
        raise InvalidField("prompt", "prompt is required")
    raise InvalidField(
        "prompt", "prompt must be a string, a list of token ids, or a list holding one string or one list of ids"
    )


def message_content(i: int, content: Any) -> str:
    """A message's text: a string, or its text parts joined by newlines (as vLLM does)."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidField(where, f"{where} must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InvalidField(
                f"{where}[{j}]",
                f"{where}[{j}]: only text parts {{'type': 'text', 'text': '...'}} are supported, got "
                + (f"type {kind!r}" if kind != "text" else "a text part without a text string"),
            )
        texts.append(part["text"])
    return "\n".join(texts)


def stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise InvalidField("stop", "stop must be a string or a list of strings")


def _sampling(req: _Common, out: pb.GenerateRequest) -> None:
    t = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
    if not 0.0 <= t <= MAX_TEMPERATURE:  # NaN fails too
        raise InvalidField("temperature", f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {t}")
    out.temperature = t
    if req.top_p is not None:
        if not 0.0 < req.top_p <= 1.0:
            raise InvalidField("top_p", f"top_p must be in (0, 1], got {req.top_p}")
        out.top_p = req.top_p
    if req.seed is not None:
        if not 0 <= req.seed < 2**64:
            raise InvalidField("seed", f"seed must be in [0, 2**64), got {req.seed}")
        out.seed = req.seed
    if req.top_k is not None:
        out.top_k = req.top_k
    out.stop.extend(stop_strings(req.stop))


def _speculation(req: _Common, out: pb.GenerateRequest) -> None:
    if req.speculative_method is not None:
        out.speculative_method = req.speculative_method
    if req.cache_salt is not None:
        out.cache_salt = req.cache_salt
    for name in (
        "num_speculative_tokens",
        "adaptive_speculation",
        "pipeline_drafting",
        "pipeline_alternatives",
        "confidence_threshold",
    ):
        value = getattr(req, name)
        if value is not None:
            setattr(out, name, value)
    if req.draft_tree is not None:
        t = req.draft_tree
        out.tree.CopyFrom(
            pb.DraftShape(
                branching=t.branching,
                node_budget=t.node_budget,
                max_depth=t.max_depth,
                top_k=t.top_k,
                paths=[pb.TreePath(ranks=p) for p in t.paths],
            )
        )


# The characters a regex literal must escape (the regex-syntax crate's
# metacharacters, which llguidance's regexes are).
REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in REGEX_META else ch for ch in text)


def _from_response_format(fmt: ResponseFormat) -> tuple[str, pb.StructuredOutput]:
    """type json_object or json_schema."""
    if fmt.type == "json_object":
        return "response_format", pb.StructuredOutput(json_object=True)
    if fmt.json_schema is None:
        raise InvalidField(
            "response_format.json_schema",
            "response_format.json_schema is required with type json_schema: {'name': ..., 'schema': {...}}",
        )
    if fmt.json_schema.schema_ is None:
        # OpenAI's type leaves it optional; without it there is nothing to enforce.
        raise InvalidField(
            "response_format.json_schema.schema",
            "response_format.json_schema.schema is required: the JSON Schema the output must match",
        )
    return "response_format.json_schema.schema", pb.StructuredOutput(json_schema=json.dumps(fmt.json_schema.schema_))


def schema_text(schema: Any) -> str:
    """structured_outputs.json as JSON text (the core parses and checks it)."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, (dict, bool)):  # `true` is a schema too: any JSON value
        return json.dumps(schema)
    raise InvalidField(
        "structured_outputs.json",
        f"structured_outputs.json must be a JSON Schema (an object) or its JSON text, got {type(schema).__name__}",
    )


def _given(so: StructuredOutputs) -> list[str]:
    """The keys of structured_outputs that ask for a constraint (json_object:
    false asks for nothing, like leaving the key out)."""
    values = (so.json_, so.regex, so.choice, so.grammar, so.json_object or None)
    return [k for k, v in zip(("json", "regex", "choice", "grammar", "json_object"), values) if v is not None]


def _from_structured_outputs(so: StructuredOutputs) -> tuple[str, pb.StructuredOutput]:
    given = _given(so)
    if len(given) != 1:
        got = f"gives {len(given)} constraints ({', '.join(given)})" if given else "names no constraint"
        raise InvalidField(
            "structured_outputs",
            f"structured_outputs {got}: give exactly one of json, regex, choice, grammar, json_object: true",
        )
    param = f"structured_outputs.{given[0]}"
    if so.json_ is not None:
        return param, pb.StructuredOutput(json_schema=schema_text(so.json_))
    if so.regex is not None:
        return param, pb.StructuredOutput(regex=so.regex)
    if so.choice is not None:
        if not so.choice:
            raise InvalidField(param, "structured_outputs.choice must list at least one string")
        return param, pb.StructuredOutput(regex="(?:" + "|".join(map(regex_literal, so.choice)) + ")")
    if so.grammar is not None:
        return param, pb.StructuredOutput(ebnf=so.grammar)
    return param, pb.StructuredOutput(json_object=True)


def output_constraint(req: _Common) -> tuple[str, pb.StructuredOutput] | None:
    """The request's one output constraint, and the field (as the client spelt
    it) that the core's messages about it are renamed to; None: unconstrained."""
    fmt = req.response_format
    if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
        raise InvalidField(
            "response_format.json_schema",
            f"response_format.json_schema is only for type json_schema (got type {fmt.type!r})",
        )
    if fmt is not None and fmt.type != "text":
        if req.structured_outputs is not None:
            raise InvalidField(
                "structured_outputs",
                f"response_format (type {fmt.type!r}) and structured_outputs both constrain the output: give one",
            )
        return _from_response_format(fmt)
    if req.structured_outputs is not None:
        return _from_structured_outputs(req.structured_outputs)
    return None


def _structured(req: _Common, out: pb.GenerateRequest) -> None:
    constraint = output_constraint(req)
    if constraint is not None:
        out.structured_output.CopyFrom(constraint[1])
    if req.forced_drafting is not None:
        if constraint is None:
            raise InvalidField(
                "forced_drafting",
                "forced_drafting is for constrained requests (response_format json_object or json_schema, "
                "or structured_outputs)",
            )
        out.forced_drafting = req.forced_drafting


def _max_tokens(req: _Common) -> tuple[str, int | None]:
    """(the field the client used, its value)."""
    newer = getattr(req, "max_completion_tokens", None)
    if newer is not None and req.max_tokens is not None and newer != req.max_tokens:
        raise InvalidField(
            "max_completion_tokens",
            f"max_completion_tokens ({newer}) and max_tokens ({req.max_tokens}) disagree; give one",
        )
    if newer is not None:
        return "max_completion_tokens", newer
    return "max_tokens", req.max_tokens


def to_generate_request(req: CompletionRequest | ChatCompletionRequest) -> pb.GenerateRequest:
    """The GenerateRequest that gRPC clients would send for this request.
    Range checks the core makes too (top_k, K, the tree, max_tokens' limit)
    are left to it: its InvalidRequest is renamed by `field_error`."""
    check_unsupported(req)
    out = pb.GenerateRequest()
    if isinstance(req, ChatCompletionRequest):
        if not req.messages:
            raise InvalidField("messages", "messages must not be empty")
        out.messages.extend(
            pb.ChatMessage(role=m.role, content=message_content(i, m.content)) for i, m in enumerate(req.messages)
        )
    else:
        prompt = prompt_input(req.prompt)
        if isinstance(prompt, str):
            out.prompt = prompt
        else:
            out.prompt_token_ids.ids.extend(prompt)
    _, max_tokens = _max_tokens(req)
    if max_tokens is not None:
        out.max_new_tokens = max_tokens
    if req.stream_options is not None and not req.stream:
        raise InvalidField("stream_options", "stream_options is only allowed with stream: true")
    _sampling(req, out)
    _speculation(req, out)
    _structured(req, out)
    return out


# GenerateRequest field -> the request field a client sent (the core's messages name the former).
PROTO_TO_HTTP = {"max_new_tokens": "max_tokens", "tree": "draft_tree"}
CORE_FIELDS = (
    "prompt",
    "messages",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "num_speculative_tokens",
    "speculative_method",
    "pipeline_drafting",
    "pipeline_alternatives",
    "confidence_threshold",
    "forced_drafting",
)


def constraint_field(req: _Common | None) -> str | None:
    """The HTTP field that carried the request's constraint (None: none)."""
    try:
        found = output_constraint(req) if req is not None else None
    except InvalidRequest:  # not reached: the request was converted before the core saw it
        return None
    return found[0] if found else None


def _constraint_error(message: str, word: str, field: str) -> InvalidField:
    """A core message about `structured_output`, in the client's words: a
    leading `structured_output.<kind>` becomes `field`, the one that carried
    the constraint (response_format.json_schema.schema, structured_outputs.regex,
    ...); a later mention becomes its top-level field."""
    lead = re.match(r"structured_output(\.\w+)?", message)
    if lead:
        return InvalidField(field, field + message[lead.end() :])
    top = field.split(".")[0]
    return InvalidField(word if word in CORE_FIELDS else None, re.sub(r"\bstructured_output\b", top, message))


def field_error(exc: InvalidRequest, req: CompletionRequest | ChatCompletionRequest | None) -> InvalidField:
    """The core's InvalidRequest as an InvalidField: its message starts with
    the GenerateRequest field it is about, which is renamed to the HTTP field."""
    if isinstance(exc, InvalidField):
        return exc
    message = str(exc)
    m = re.match(r"(\w+)", message)
    word = m.group(1) if m else ""
    field = constraint_field(req) if "structured_output" in message else None
    if field is not None:
        return _constraint_error(message, word, field)
    if word in PROTO_TO_HTTP:
        http = PROTO_TO_HTTP[word]
        if word == "max_new_tokens" and req is not None:
            http = _max_tokens(req)[0]
        return InvalidField(http, http + message[len(word) :])
    if word == "prompt" and isinstance(req, ChatCompletionRequest):  # the rendered chat's ids
        return InvalidField("messages", "the rendered messages" + message[len(word) :])
    return InvalidField(word if word in CORE_FIELDS else None, message)


# -- responses -----------------------------------------------------------------

# specd's finish reasons (orchestrator/cycle/detok.py: EOS or a stop string, or a
# token limit) are OpenAI's own words.
FINISH_REASONS = {"stop": "stop", "length": "length"}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else FINISH_REASONS.get(reason, reason)


def usage(stats: Stats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        # OpenAI's field: prompt tokens served from the prefix cache.
        "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
    }


def acceptance_histogram(steps: int, accepted_per_position: list[int]) -> dict[str, int]:
    """Steps that accepted exactly j draft tokens, by j (zero counts left
    out, keys as JSON strings, as vLLM's). accepted_per_position[i] counts the
    steps whose accepted path reached position i, so exactly j accepted =
    reached j-1 but not j."""
    reached = [steps, *accepted_per_position]
    counts = {j: reached[j] - (reached[j + 1] if j + 1 < len(reached) else 0) for j in range(len(reached))}
    return {str(j): n for j, n in counts.items() if n}


def speculative_decoding_stats(stats: Stats) -> dict | None:
    """vLLM's per-request `speculative_decoding_stats` (docs/http.md has the
    mapping from Stats); None when the request ran without speculation.

    A step is a cycle that verified a draft (Stats.drafts): a cycle of plain
    decoding (an adaptive depth of 0, an ngram miss) proposed nothing, as in
    vLLM, where such a step is no spec step. mean_acceptance_length counts
    the bonus / correction token (1 + accepted per step)."""
    if stats.method == "off":
        return None
    steps, drafted, accepted = stats.drafts, stats.drafted_tokens, stats.accepted_tokens
    return {
        "num_spec_steps": steps,
        "num_draft_tokens": drafted,
        "num_accepted_draft_tokens": accepted,
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": acceptance_histogram(steps, stats.accepted_per_position),
        "num_spec_tokens": stats.num_speculative_tokens,
        # specd's extras: the method that ran; the draft tokens the output
        # constraint forced (counted in num_draft_tokens too) and those kept.
        "method": stats.method,
        "forced_tokens": stats.forced_tokens,
        "forced_accepted": stats.forced_accepted,
    }


def completion_response(rid: str, created: int, model: str, chat: bool, text: str, stats: Stats, reason) -> dict:
    """The whole (non-streaming) response."""
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice |= {
        "logprobs": None,
        "finish_reason": finish_reason(reason),
        "speculative_decoding_stats": speculative_decoding_stats(stats),
    }
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(stats),
    }


class StreamChunks:
    """The chunk bodies of one stream (id, created and model fixed)."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, include_usage: bool):
        self.chat, self.include_usage = chat, include_usage
        self.head = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }
        self.role_sent = False

    def chunk(self, text: str, reason: str | None, stats: Stats) -> dict | None:
        """The body for a piece of output; None when there is nothing to send
        (text held back at a UTF-8 or stop-string edge, no finish yet)."""
        if not text and reason is None and (self.role_sent or not self.chat):
            return None
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {} if self.role_sent else {"role": "assistant"}
            if text or not self.role_sent:
                delta["content"] = text
            self.role_sent = True
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason(reason)
        if reason is not None:  # the stats ride the chunk that finishes the choice
            choice["speculative_decoding_stats"] = speculative_decoding_stats(stats)
        body: dict[str, Any] = {**self.head, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None  # as OpenAI: only the last chunk carries usage
        return body

    def usage_chunk(self, stats: Stats) -> dict:
        return {**self.head, "choices": [], "usage": usage(stats)}


# -- errors --------------------------------------------------------------------

# gRPC status -> HTTP status, for the core's errors (specd_core/net/grpc_util.py:
# status_for) and a replica's (ServiceError): the mapping of grpc-gateway.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# HTTP status -> (OpenAI error type, code)
ERROR_KINDS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "permission_denied"),
    404: ("invalid_request_error", None),
    409: ("invalid_request_error", "conflict"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    499: ("invalid_request_error", "cancelled"),
    501: ("server_error", "not_implemented"),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "timeout"),
}


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind, default_code = ERROR_KINDS.get(status, ("server_error", "internal_error"))
    return {"error": {"message": message, "type": kind, "param": param, "code": code or default_code}}


def validation_error(errors: list[dict]) -> tuple[str | None, str, str | None]:
    """(param, message, code) for pydantic's errors on a request body: the
    first error's field and kind, every error's words."""
    parts: list[str] = []
    first: tuple[str | None, str | None] | None = None
    for e in errors:
        loc = [p for p in e.get("loc", ()) if p != "body"]
        param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
        code = None
        if e.get("type") == "extra_forbidden":
            msg = f"unsupported field {param}: it is neither an OpenAI field this service takes nor a specd extra"
            code = "unsupported_parameter"
        elif e.get("type") == "json_invalid":
            param, msg = "", f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}"
        else:
            msg = f"{param}: {e.get('msg')}" if param else str(e.get("msg"))
        first = first or (param or None, code)
        parts.append(msg)
    first_param, first_code = first or (None, None)
    return first_param, "; ".join(parts) or "invalid request body", first_code
