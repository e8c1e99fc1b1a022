"""What a structured-output request asks for (the engine that turns it into
token masks is specd_core/runtime/grammar.py)."""

from __future__ import annotations

from dataclasses import dataclass

from specd_core.errors import InvalidRequest

KINDS = ("json_schema", "regex", "ebnf", "json_object")


@dataclass(frozen=True)
class OutputConstraint:
    kind: str  # one of KINDS
    text: str = ""  # the schema, regex or grammar (json_object: unused)

    def validate(self) -> OutputConstraint:
        if self.kind not in KINDS:
            raise InvalidRequest(f"structured_output: unknown kind {self.kind!r} (one of {', '.join(KINDS)})")
        if self.kind != "json_object" and not self.text.strip():
            raise InvalidRequest(f"structured_output.{self.kind} is empty")
        return self
