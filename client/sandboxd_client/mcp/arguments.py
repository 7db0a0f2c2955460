"""Each tool's arguments, declared once: the JSON Schema the tool lists, and the check a
call's arguments pass before anything is sent. A wrong argument is refused naming it and
why (an unknown one too: a model that adds `policy` or `network` to a call is asking for
what only the operator sets). Pure: no SDK, no daemon."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Arguments a model sends are bounded before any of them is looked at.
MAX_STRING_CHARS = 64 * 1024 * 1024
MAX_ARGV_ITEMS = 4096


class ArgumentError(ValueError):
    """A malformed argument: the tool, the argument's name and the reason."""

    def __init__(self, tool: str, argument: str, reason: str):
        super().__init__(f"{tool}: argument {argument!r}: {reason}")
        self.tool = tool
        self.argument = argument
        self.reason = reason


@dataclass(frozen=True)
class Field:
    """One argument. kind: "string", "integer", "boolean", or "command" (a string for the
    shell, or an argv list of strings)."""

    name: str
    kind: str
    description: str
    required: bool = False
    minimum: int | None = None
    maximum: int | None = None
    max_chars: int | None = None

    def schema(self) -> dict[str, Any]:
        if self.kind == "command":
            return {"description": self.description,
                    "anyOf": [{"type": "string", "minLength": 1},
                              {"type": "array", "items": {"type": "string"}, "minItems": 1,
                               "maxItems": MAX_ARGV_ITEMS}]}
        out: dict[str, Any] = {"type": self.kind, "description": self.description}
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        if self.max_chars is not None:
            out["maxLength"] = self.max_chars
        return out


def input_schema(fields: Sequence[Field]) -> dict[str, Any]:
    return {"type": "object", "properties": {f.name: f.schema() for f in fields},
            "required": [f.name for f in fields if f.required], "additionalProperties": False}


def _string(tool: str, f: Field, value: Any) -> str:
    if not isinstance(value, str):
        raise ArgumentError(tool, f.name, f"must be a string, not {type_name(value)}")
    limit = f.max_chars or MAX_STRING_CHARS
    if len(value) > limit:
        raise ArgumentError(tool, f.name, f"is {len(value)} characters, more than the {limit} allowed")
    return value


def _integer(tool: str, f: Field, value: Any) -> int:
    # JSON has one number type: 5.0 is 5, but True is no number here.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(tool, f.name, f"must be an integer, not {type_name(value)}")
    if f.minimum is not None and value < f.minimum:
        raise ArgumentError(tool, f.name, f"must be at least {f.minimum}, not {value}")
    if f.maximum is not None and value > f.maximum:
        raise ArgumentError(tool, f.name, f"must be at most {f.maximum}, not {value}")
    return value


def _boolean(tool: str, f: Field, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ArgumentError(tool, f.name, f"must be true or false, not {type_name(value)}")
    return value


def _command(tool: str, f: Field, value: Any) -> str | list[str]:
    if isinstance(value, str):
        if not value.strip():
            raise ArgumentError(tool, f.name, "must not be empty")
        if "\x00" in value:
            raise ArgumentError(tool, f.name, "must not contain a NUL byte")
        return _string(tool, f, value)
    if not isinstance(value, list):
        raise ArgumentError(tool, f.name, f"must be a string (run by sh -c) or a list of strings (an argv), "
                                          f"not {type_name(value)}")
    if not value:
        raise ArgumentError(tool, f.name, "an argv must have at least one item")
    if len(value) > MAX_ARGV_ITEMS:
        raise ArgumentError(tool, f.name, f"has {len(value)} items, more than the {MAX_ARGV_ITEMS} allowed")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise ArgumentError(tool, f"{f.name}[{i}]", f"must be a string, not {type_name(item)}")
        if "\x00" in item:
            raise ArgumentError(tool, f"{f.name}[{i}]", "must not contain a NUL byte")
    if not value[0]:
        raise ArgumentError(tool, f"{f.name}[0]", "the program must not be empty")
    return list(value)


_CHECKS = {"string": _string, "integer": _integer, "boolean": _boolean, "command": _command}


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def check_arguments(tool: str, fields: Sequence[Field], arguments: Mapping[str, Any] | None) -> dict[str, Any]:
    """The arguments as checked values (absent optional ones left out), or ArgumentError
    naming the first wrong one: unknown, missing, or of the wrong type or range."""
    given = dict(arguments or {})
    known = {f.name: f for f in fields}
    for name in given:
        if name not in known:
            takes = ", ".join(known) or "none"
            raise ArgumentError(tool, name, f"unknown argument (this tool takes: {takes}); the sandbox's policy "
                                            "is the operator's and no argument widens it")
    out: dict[str, Any] = {}
    for f in fields:
        if f.name not in given or given[f.name] is None:
            if f.required:
                raise ArgumentError(tool, f.name, "is required")
            continue
        out[f.name] = _CHECKS[f.kind](tool, f, given[f.name])
    return out
