"""Command-line flags generated from config dataclasses.

A config field's metadata says how a command line gives it, so an option is
written once, as its field, and the command that takes that config (`python -m
orchestrator`, `python -m drafter_svc|verifier_svc`, `specd up`) gets its flag,
default and help from there:

    port: int = field(default=50051, metadata=flag("public Generate port (0 = any free)"))
    tls: TlsConfig | None = field(default=None, metadata=flag_group(add_server_tls_flags, tls_from_args))
    index: int = field(default=0, metadata=not_flag("set per orchestrator by the Ray deployment"))

A field's flag is --its-name (underscores as dashes) unless `name` says
otherwise, parsed to the attribute argparse names after the flag; its default
is the field's; its type the field's (the X of `X | None`).
A field with neither kind of metadata is an error when flags are generated, so a
new field cannot be forgotten (tests/test_cli_flags.py checks every config).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

_KEY = "specd.flag"


@dataclass(frozen=True)
class Flag:
    """One flag for a field: argparse options beyond the derived ones (type,
    choices, metavar, action, required, or a default other than the field's)."""

    help: str | None = None
    name: str | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class FlagGroup:
    """Several flags for one field (TLS, the speculative config): `add` adds
    them to a parser, `read` makes the field's value from the parsed flags."""

    add: Callable[[Any], None]
    read: Callable[[argparse.Namespace], Any]


@dataclass(frozen=True)
class NotFlag:
    """A field no command line sets, and why."""

    reason: str


def flag(help: str | None = None, *, name: str | None = None, **options: Any) -> dict:  # noqa: A002 - argparse's word
    return {_KEY: Flag(help, name, options)}


def flag_group(add: Callable[[Any], None], read: Callable[[argparse.Namespace], Any]) -> dict:
    return {_KEY: FlagGroup(add, read)}


def not_flag(reason: str) -> dict:
    return {_KEY: NotFlag(reason)}


def spec(f: dataclasses.Field) -> Flag | FlagGroup | NotFlag:
    """A field's flag metadata; a field without any is an error."""
    found = f.metadata.get(_KEY)
    if found is None:
        raise TypeError(f"config field {f.name} says neither how it is given as a flag nor why it is not one")
    return found


def flag_name(f: dataclasses.Field) -> str:
    """The option string of a field with a Flag."""
    s = spec(f)
    assert isinstance(s, Flag), f.name
    return s.name or "--" + f.name.replace("_", "-")


def dest(f: dataclasses.Field) -> str:
    """Where argparse puts a field's flag: as it would for the flag's name, so
    that a command's parsed arguments keep the names their flags have."""
    s = spec(f)
    assert isinstance(s, Flag), f.name
    return s.options.get("dest") or flag_name(f).lstrip("-").replace("-", "_")


def _flag_fields(cls, exclude: Collection[str]) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name not in exclude and not isinstance(spec(f), NotFlag)]


def add_flags(parser, cls, exclude: Collection[str] = ()) -> None:
    """Add a flag (or group) for every field of the config class `cls` that has
    one, in field order; `exclude`: fields this command sets itself."""
    hints = typing.get_type_hints(cls)
    for f in _flag_fields(cls, exclude):
        s = spec(f)
        if isinstance(s, FlagGroup):
            s.add(parser)
            continue
        assert isinstance(s, Flag)
        kwargs: dict[str, Any] = {"dest": dest(f), "help": s.help}
        action = s.options.get("action")
        if action not in ("store_true", "store_false"):
            if action != "append" and (kind := _scalar(hints[f.name])) is not str:
                kwargs["type"] = kind
            if not s.options.get("required"):
                kwargs["default"] = _default(f)
        parser.add_argument(flag_name(f), **{**kwargs, **s.options})


def config_from_args(cls, args: argparse.Namespace, **given: Any):
    """The config `cls` from parsed flags: each field with a flag from its flag,
    each with a group from the group's reader; `given` fields as given. A field
    whose flag this parser lacks (excluded) keeps its default."""
    values = dict(given)
    for f in _flag_fields(cls, given):
        s = spec(f)
        if isinstance(s, FlagGroup):
            values[f.name] = s.read(args)
        elif hasattr(args, dest(f)):
            values[f.name] = getattr(args, dest(f))
    return cls(**values)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()  # a fresh one per parser: argparse appends to it
    return None


def _scalar(hint: Any) -> Any:
    """The argparse type of a field's type: int, float or str (X of X | None)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else str
    return hint if hint in (int, float, str) else str
