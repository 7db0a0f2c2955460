"""The adapters' tools as each framework sees them, with no daemon: their schemas, and a
model's bad arguments refused in the framework's error form before anything is sent.
The Sandbox under them is never opened, so a tool that tried to send would fail
differently ("not open"), not with the refusal these expect."""

from __future__ import annotations

import asyncio
import json

import pytest
from agents import set_tracing_disabled
from agents.tool_context import ToolContext
from langchain_core.messages import ToolMessage
from smolagents.tools import validate_tool_arguments

from sandboxd_client import AsyncSandbox, Sandbox
from sandboxd_client.adapters import SandboxToolError, SandboxTools, ToolLimits
from sandboxd_client.adapters import langchain as lc_adapter
from sandboxd_client.adapters import openai_agents as oa_adapter
from sandboxd_client.adapters import smolagents as smol_adapter

LIMITS = ToolLimits(timeout_ms=1000)


@pytest.fixture(autouse=True)
def no_framework_tracing(monkeypatch):
    """Nothing leaves this host, whatever the environment says: the frameworks'
    tracing exporters (OpenAI's, LangSmith's) stay off."""
    set_tracing_disabled(True)  # the test process's provider; no other test uses it
    for name in ("LANGSMITH_TRACING", "LANGSMITH_TRACING_V2", "LANGCHAIN_TRACING_V2"):
        monkeypatch.setenv(name, "false")


@pytest.fixture
def unopened():
    return Sandbox("/srv/nowhere")


def by_name(tools) -> dict:
    return {t.name: t for t in tools}


def invoke_openai(tool, arguments) -> str:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    ctx = ToolContext(context=None, tool_name=tool.name, tool_call_id="call_1", tool_arguments=raw)
    return asyncio.run(tool.on_invoke_tool(ctx, raw))


# Each: the arguments, and the start of what the model is told.
REFUSED = [
    ({"command": "  "}, "refused: command: empty"),
    ({"command": []}, "refused: command: a shell line (a string) or an argv"),
    ({"command": ["", "x"]}, "refused: command[0]: the program must not be empty"),
    ({"command": ["echo", "a\x00b"]}, "refused: command[1]: a string without NUL bytes"),
    ({"command": "true", "cwd": ""}, "refused: cwd: empty"),
    ({"command": "true", "timeout_ms": 0}, "refused: timeout_ms: a whole number of milliseconds above 0"),
    ({"command": "true", "timeout_ms": 1001}, "refused: timeout_ms: 1001 ms is more than the 1000 ms this sandbox"),
]


def test_the_openai_tools_schemas_are_strict_and_named(unopened):
    tools = by_name(oa_adapter.sandbox_tools(unopened, limits=LIMITS))
    assert list(tools) == ["run_command", "read_file", "write_file"]
    run = tools["run_command"]
    assert run.strict_json_schema and run.params_json_schema["additionalProperties"] is False
    assert set(run.params_json_schema["properties"]) == {"command", "cwd", "timeout_ms"}
    assert "shell line" in run.params_json_schema["properties"]["command"]["description"]
    assert list(by_name(oa_adapter.sandbox_tools(unopened, files=False))) == ["run_command"]


@pytest.mark.parametrize("arguments, told", REFUSED)
def test_openai_bad_arguments_are_the_tools_error_output(unopened, arguments, told):
    run = by_name(oa_adapter.sandbox_tools(unopened, limits=LIMITS))["run_command"]
    full = {"cwd": None, "timeout_ms": None} | arguments  # strict mode: every field given
    out = invoke_openai(run, full)
    assert out.startswith(told) and out.endswith("(nothing ran)")


def test_openai_arguments_off_the_schema_are_named(unopened):
    tools = by_name(oa_adapter.sandbox_tools(unopened))
    # The SDK keeps the model's data out of its errors (its DONT_LOG_TOOL_DATA default),
    # so a schema mismatch is said without the values; strict mode makes one rare.
    out = invoke_openai(tools["run_command"], {"command": 3, "cwd": None, "timeout_ms": None})
    assert out == "refused: arguments: they do not match the tool's schema (nothing ran)"
    assert invoke_openai(tools["read_file"], "{not json").startswith("refused: arguments:")
    assert invoke_openai(tools["read_file"], {"path": "a\x00b"}) == "refused: path: contains a NUL byte (nothing ran)"


def test_openai_arguments_off_the_schema_are_named_when_the_sdk_logs_tool_data(unopened, monkeypatch):
    from agents import _debug
    monkeypatch.setattr(_debug, "DONT_LOG_TOOL_DATA", False)
    run = by_name(oa_adapter.sandbox_tools(unopened))["run_command"]
    out = invoke_openai(run, {"command": 3, "cwd": None, "timeout_ms": "soon"})
    assert out.startswith("refused: arguments: command.str: Input should be a valid string; ") and \
        "timeout_ms: Input should be a valid integer" in out


@pytest.mark.parametrize("arguments, told", REFUSED)
def test_langchain_bad_arguments_are_a_tool_error(unopened, arguments, told):
    run = by_name(lc_adapter.sandbox_tools(unopened, limits=LIMITS))["run_command"]
    assert run.invoke(arguments).startswith(told)
    message = run.invoke({"name": "run_command", "args": arguments, "id": "call_7", "type": "tool_call"})
    assert isinstance(message, ToolMessage) and message.status == "error" and message.tool_call_id == "call_7"
    assert message.content.startswith(told)
    assert asyncio.run(run.ainvoke(arguments)).startswith(told)


def test_langchain_arguments_off_the_schema_are_named(unopened):
    tools = by_name(lc_adapter.sandbox_tools(unopened))
    assert set(tools["run_command"].args) == {"command", "cwd", "timeout_ms"}
    # A model may not bring its own policy: the operator's is the sandbox's.
    out = tools["run_command"].invoke({"command": "ls", "policy": {"network": {"mode": "open"}}})
    assert out.startswith("refused: arguments: policy: Extra inputs are not permitted")
    missing = tools["write_file"].invoke({"path": "/workspace/x"})
    assert missing.startswith("refused: arguments: content: Field required")


def test_langchain_tools_over_an_async_sandbox_are_async_only():
    run = by_name(lc_adapter.sandbox_tools(AsyncSandbox("/srv/nowhere"), limits=LIMITS))["run_command"]
    assert asyncio.run(run.ainvoke({"command": "true", "timeout_ms": 5000})).startswith("refused: timeout_ms: 5000 ms")
    with pytest.raises(NotImplementedError):
        run.invoke({"command": "true"})


@pytest.mark.parametrize("arguments, told", REFUSED)
def test_smolagents_bad_arguments_raise_the_tools_error(unopened, arguments, told):
    run = by_name(smol_adapter.sandbox_tools(unopened, limits=LIMITS))["run_command"]
    with pytest.raises(SandboxToolError) as refused:
        run(**arguments)
    assert refused.value.text.startswith(told) and str(refused.value) == refused.value.text


def test_smolagents_tools_pass_smolagents_own_checks(unopened):
    tools = by_name(smol_adapter.sandbox_tools(unopened))
    validate_tool_arguments(tools["run_command"], {"command": ["ls", "-a"], "cwd": "/workspace"})
    validate_tool_arguments(tools["write_file"], {"path": "/workspace/x", "content": "hi"})
    with pytest.raises(ValueError, match="policy"):
        validate_tool_arguments(tools["run_command"], {"command": "ls", "policy": {}})
    with pytest.raises(SandboxToolError, match="refused: create_dirs: true or false"):
        tools["write_file"](path="/workspace/x", content="hi", create_dirs="yes")


def test_smolagents_and_the_toolkit_refuse_what_they_cannot_drive():
    with pytest.raises(TypeError, match="blocking Sandbox"):
        smol_adapter.sandbox_tools(AsyncSandbox("/srv/nowhere"))
    with pytest.raises(TypeError, match="an opened sandboxd_client Sandbox or AsyncSandbox"):
        SandboxTools(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="over an AsyncSandbox: call their async form"):
        SandboxTools(AsyncSandbox("/srv/nowhere")).run_command("true")
