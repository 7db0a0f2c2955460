"""sandboxd-mcp's tool arguments (pure): a wrong one is refused naming it and why, an
unknown one too (no argument reaches the policy), and the listed JSON Schemas say the
same as the checks."""

from __future__ import annotations

import jsonschema
import pytest

from sandboxd_client.mcp.arguments import MAX_ARGV_ITEMS, ArgumentError, check_arguments, input_schema
from sandboxd_client.mcp.narrowing import OperatorPolicy
from sandboxd_client.mcp.tools import ToolLimits, tool_specs

OP = OperatorPolicy.of({"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace"]}}, 60_000)
SPECS = {s.name: s for s in tool_specs(OP, ToolLimits())}


def check(tool: str, args):
    return check_arguments(tool, SPECS[tool].fields, args)


def refused(tool: str, args) -> ArgumentError:
    with pytest.raises(ArgumentError) as exc:
        check(tool, args)
    return exc.value


def test_good_arguments_pass_as_given():
    assert check("run_command", {"command": ["ls", "-l"], "timeout_ms": 5.0}) == {"command": ["ls", "-l"],
                                                                                  "timeout_ms": 5}
    assert check("run_command", {"command": "echo hi | wc -c", "cwd": "src", "stdin": ""})["command"] == "echo hi | wc -c"
    assert check("list_files", None) == {} and check("list_files", {"path": None}) == {}


@pytest.mark.parametrize("tool,args,argument,reason", [
    ("run_command", {"command": "ls", "policy": {"network": {"egress": "open"}}}, "policy", "unknown argument"),
    ("run_command", {"command": "ls", "network": "open"}, "network", "no argument widens it"),
    ("run_command", {}, "command", "is required"),
    ("run_command", {"command": ""}, "command", "must not be empty"),
    ("run_command", {"command": []}, "command", "at least one item"),
    ("run_command", {"command": ["ls", 3]}, "command[1]", "must be a string, not an integer"),
    ("run_command", {"command": ["", "x"]}, "command[0]", "must not be empty"),
    ("run_command", {"command": ["ls", "a\x00b"]}, "command[1]", "NUL"),
    ("run_command", {"command": {"argv": ["ls"]}}, "command", "not an object"),
    ("run_command", {"command": "ls", "timeout_ms": "5000"}, "timeout_ms", "must be an integer, not a string"),
    ("run_command", {"command": "ls", "timeout_ms": True}, "timeout_ms", "not a boolean"),
    ("run_command", {"command": "ls", "timeout_ms": 1.5}, "timeout_ms", "not a number"),
    ("run_command", {"command": "ls", "timeout_ms": 0}, "timeout_ms", "at least 1"),
    ("run_command", {"command": "ls", "cwd": 7}, "cwd", "must be a string"),
    ("write_file", {"path": "a"}, "content", "is required"),
    ("write_file", {"path": "a", "content": "x", "create_dirs": "yes"}, "create_dirs", "true or false"),
    ("list_files", {"max_depth": 21}, "max_depth", "at most 20"),
    ("search_files", {"pattern": "x" * 4097}, "pattern", "more than the 4096"),
])
def test_a_wrong_argument_is_named_with_its_reason(tool, args, argument, reason):
    err = refused(tool, args)
    assert err.argument == argument and reason in err.reason, str(err)
    assert str(err).startswith(f"{tool}: argument {argument!r}")


def test_an_argv_has_at_most_its_limit_of_items():
    assert len(check("run_command", {"command": ["x"] * MAX_ARGV_ITEMS})["command"]) == MAX_ARGV_ITEMS
    assert "more than the" in refused("run_command", {"command": ["x"] * (MAX_ARGV_ITEMS + 1)}).reason


SAMPLES = [
    ("run_command", {"command": ["ls"]}), ("run_command", {"command": "ls", "timeout_ms": 10}),
    ("run_command", {"command": "ls", "extra": 1}), ("run_command", {"command": 5}),
    ("run_command", {"command": "ls", "timeout_ms": 0}), ("read_file", {}), ("read_file", {"path": "a"}),
    ("write_file", {"path": "a", "content": "b", "create_dirs": True}), ("list_files", {"max_depth": 0}),
    ("search_files", {"pattern": "a", "glob": "*.py", "ignore_case": 1}),
]


@pytest.mark.parametrize("tool,args", SAMPLES)
def test_the_listed_schema_agrees_with_the_checks(tool, args):
    schema = input_schema(SPECS[tool].fields)
    assert schema["additionalProperties"] is False
    try:
        check(tool, args)
        checked = True
    except ArgumentError:
        checked = False
    assert jsonschema.Draft202012Validator(schema).is_valid(args) == checked
