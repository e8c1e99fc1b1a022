"""Ten JSON schemas with a short prompt each, for structured-output runs:
tests/test_structured_schemas.py (validity of every output, tiny random
models) and benchmarks/structured.py (forced-token drafting, the demo pair).

Between them they cover nested objects, arrays (of scalars, of objects, of
arrays, one at the top level), enums and consts, integers and numbers with
bounds, required and optional fields, string patterns, maxLength, anyOf /
oneOf, nullable values, and additionalProperties false on every object.

Every string, array and number is bounded: maxLength / pattern / enum,
maxItems, minimum / maximum, and the one non-integer number is also a
multipleOf 0.5, since bounds on its value leave its fraction free (the demo
pair wrote "rating": 3.7777... up to max_new_tokens). A model picks among the
allowed tokens with no sense of when to close a value, so an unbounded
string, array or fraction may run to max_new_tokens and finish "length" -
and such an output is never checked as whole JSON. With these bounds a whole
object fits in well under 128 tokens of the test and demo tokenizers, so most
outputs end with EOS ("stop").

The prompts read as comments in Python source, since the demo pair
(models/demo) was trained on the standard library; for the tiny random models
of the tests the prompt text does not matter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

NAME = {"type": "string", "pattern": "^[a-z]{1,8}$"}


def closed(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """An object with exactly these properties allowed (additionalProperties
    false): a random model would otherwise invent keys without end."""
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


@dataclass(frozen=True)
class SchemaPrompt:
    name: str
    prompt: str
    schema: dict[str, Any]

    @property
    def text(self) -> str:
        """The schema as StructuredOutput.json_schema takes it."""
        return json.dumps(self.schema)


SCHEMAS: list[SchemaPrompt] = [
    SchemaPrompt(
        "user",
        "# A user account as JSON: name, age, roles and maybe an email.\nuser = ",
        closed(
            {
                "name": NAME,
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.(com|org)$"},
                "roles": {
                    "type": "array",
                    "items": {"enum": ["admin", "dev", "ops"]},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            ["name", "age", "roles"],
        ),
    ),
    SchemaPrompt(
        "point",
        "# A labelled point in the plane, as JSON.\npoint = ",
        closed(
            {
                "x": {"type": "integer", "minimum": -100, "maximum": 100},
                "y": {"type": "integer", "minimum": -100, "maximum": 100},
                "label": {"type": "string", "maxLength": 6},
            },
            ["x", "y"],
        ),
    ),
    SchemaPrompt(
        "order",
        "# An order with its line items, as JSON.\norder = ",
        closed(
            {
                "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                "status": {"enum": ["new", "paid", "shipped"]},
                "items": {
                    "type": "array",
                    "maxItems": 3,
                    "items": closed(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 20},
                        },
                        ["sku", "qty"],
                    ),
                },
            },
            ["id", "status", "items"],
        ),
    ),
    SchemaPrompt(
        "config",
        "# The server configuration, as JSON.\nconfig = ",
        closed(
            {
                "server": closed(
                    {
                        "host": {"type": "string", "pattern": "^[a-z]{1,8}(\\.[a-z]{2,3})?$"},
                        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "tls": {"type": "boolean"},
                    },
                    ["host", "port", "tls"],
                ),
                "log": closed(
                    {
                        "level": {"enum": ["debug", "info", "warning", "error"]},
                        "file": {"type": "string", "maxLength": 12},
                    },
                    ["level"],
                ),
                "workers": {"type": "integer", "minimum": 1, "maximum": 64},
            },
            ["server", "log"],
        ),
    ),
    SchemaPrompt(
        "event",
        "# A click event with its position and tags, as JSON.\nevent = ",
        closed(
            {
                "type": {"const": "click"},
                "at": closed(
                    {
                        "x": {"type": "integer", "minimum": 0, "maximum": 1920},
                        "y": {"type": "integer", "minimum": 0, "maximum": 1080},
                    },
                    ["x", "y"],
                ),
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
            },
            ["type", "at", "tags"],
        ),
    ),
    SchemaPrompt(
        "weather",
        "# Today's weather and a short forecast, as JSON.\nweather = ",
        closed(
            {
                "city": {"type": "string", "maxLength": 10},
                "temp_c": {"type": "integer", "minimum": -50, "maximum": 60},
                "conditions": {"enum": ["sun", "cloud", "rain", "snow"]},
                "forecast": {
                    "type": "array",
                    "maxItems": 2,
                    "items": closed(
                        {
                            "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                            "high": {"type": "integer", "minimum": -50, "maximum": 60},
                        },
                        ["day", "high"],
                    ),
                },
            },
            ["city", "temp_c", "conditions"],
        ),
    ),
    SchemaPrompt(
        "matrix",
        "# A small matrix of digits, as a JSON list of rows.\nmatrix = ",
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
            },
        },
    ),
    SchemaPrompt(
        "book",
        "# A book record with its authors, as JSON.\nbook = ",
        closed(
            {
                "title": {"type": "string", "minLength": 1, "maxLength": 12},
                "authors": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
                },
                "year": {"type": "integer", "minimum": 1450, "maximum": 2025},
                "isbn": {"type": "string", "pattern": "^[0-9]{10}$"},
                "rating": {"type": "number", "minimum": 0, "maximum": 5, "multipleOf": 0.5},
            },
            ["title", "authors", "year"],
        ),
    ),
    SchemaPrompt(
        "reading",
        "# One sensor reading; the value may be missing (null), as JSON.\nreading = ",
        closed(
            {
                "sensor": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
                "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "null"}]},
                "ok": {"type": "boolean"},
                "note": {"type": ["string", "null"], "maxLength": 8},
            },
            ["sensor", "value", "ok"],
        ),
    ),
    SchemaPrompt(
        "pet",
        "# A pet, either a cat or a dog, as JSON.\npet = ",
        closed(
            {
                "name": NAME,
                "animal": {
                    "oneOf": [
                        closed(
                            {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 0, "maximum": 9}},
                            ["kind", "lives"],
                        ),
                        closed(
                            {"kind": {"const": "dog"}, "breed": {"enum": ["lab", "pug", "collie"]}},
                            ["kind", "breed"],
                        ),
                    ]
                },
            },
            ["name", "animal"],
        ),
    ),
]


def check_all(tokenizer=None) -> None:
    """Compile every schema as the services would (InvalidRequest if llguidance
    refuses or would ignore a keyword); with a tokenizer, against it too."""
    from specd_core.rules.structured import OutputConstraint
    from specd_core.runtime.grammar import compile_constraint

    tok = None
    if tokenizer is not None:
        import llguidance.hf

        tok = llguidance.hf.from_tokenizer(tokenizer)
    for s in SCHEMAS:
        compile_constraint(OutputConstraint("json_schema", s.text), tok)


if __name__ == "__main__":
    check_all()
    print(f"{len(SCHEMAS)} schemas compile: {', '.join(s.name for s in SCHEMAS)}")
