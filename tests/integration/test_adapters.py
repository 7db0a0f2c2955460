"""The agent-framework adapters for real: each framework drives the sandbox's tools
through its own tool interface (the OpenAI Agents SDK's runner with its scripted model
and on_invoke_tool, LangChain's invoke/ainvoke and ToolCalls, smolagents' tool call and
its agent's execute_tool_call), against a real daemon with pools, on both backends. A
command answers with its exit code, its output and its call id; long output keeps its
head and tail; a timeout, a timeout past the sandbox's, a refused write and a file past
the read limit come back in each framework's error form; a model's parallel calls run
in turn in the one sandbox."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from agents import Agent, RunConfig, Runner, set_tracing_disabled
from agents.items import ToolCallOutputItem
from agents.testing import ScriptedModel, assistant_message, function_call
from agents.tool_context import ToolContext
from langchain_core.messages import ToolMessage
from smolagents import Model, ToolCallingAgent
from smolagents.utils import AgentToolExecutionError

from sandboxd_client import AsyncSandbox, Sandbox
from sandboxd_client.adapters import SandboxTools, ToolLimits
from sandboxd_client.adapters import langchain as lc_adapter
from sandboxd_client.adapters import openai_agents as oa_adapter
from sandboxd_client.adapters import smolagents as smol_adapter
from sandboxd_testing import make_daemon

from .conftest import BACKENDS, DAEMON_ENV, public_tmpdir, stop_and_clean

POLICY = {"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/out"]},
          "process": {"timeoutMs": 20_000}}
CALL_ID = re.compile(r"\(call (\S+)\)")


@pytest.fixture(autouse=True)
def no_framework_tracing(monkeypatch):
    """Nothing leaves this host, whatever the environment says: the frameworks'
    tracing exporters (OpenAI's, LangSmith's) stay off."""
    set_tracing_disabled(True)  # the test process's provider; no other test uses it
    for name in ("LANGSMITH_TRACING", "LANGSMITH_TRACING_V2", "LANGCHAIN_TRACING_V2"):
        monkeypatch.setenv(name, "false")


@pytest.fixture(scope="module")
def pooled(docker_engine):
    base = public_tmpdir("sandboxd-adapters-")
    d = make_daemon(base, env=DAEMON_ENV, pools={"min_idle": 1, "max_size": 2}).start()
    yield d
    stop_and_clean(d, docker_engine, base)


@pytest.fixture
def ws(pooled):
    return pooled.new_workspace({"README.md": "read me\n", "big.txt": "x" * 5000 + "\n", "out/keep.txt": "kept\n"})


def by_name(tools) -> dict:
    return {t.name: t for t in tools}


def call_id(text: str) -> str:
    found = CALL_ID.search(text)
    assert found, text
    return found.group(1)


def assert_recorded(sb: Sandbox, text: str, argv_end: str) -> None:
    """The call the text names is on the daemon's trace, with the command asked for."""
    first = sb.client.get_trace(call_id(text))[0]
    assert first.type == "ToolCallRequested" and json.loads(first.payload_json)["argv"][-1] == argv_end


# --- the OpenAI Agents SDK ---

def scripted_run(tools, *calls) -> dict[str, str]:
    """One Runner.run whose scripted model makes `calls` at once (name, arguments), then
    ends: each call's output as the SDK handed it back, by call id."""
    model = ScriptedModel([[function_call(name, args, call_id=f"c{i}") for i, (name, args) in enumerate(calls)],
                           [assistant_message("done")]])
    agent = Agent(name="coder", tools=tools, model=model)
    run = asyncio.run(Runner.run(agent, "go", run_config=RunConfig(tracing_disabled=True)))
    assert run.final_output == "done"
    return {item.raw_item["call_id"]: item.output for item in run.new_items if isinstance(item, ToolCallOutputItem)}


def nulls(**arguments):
    return {"cwd": None, "timeout_ms": None} | arguments  # strict mode: every field is given


@pytest.mark.parametrize("adapter", BACKENDS)
def test_openai_agents_runs_commands_in_the_sandbox(pooled, ws, adapter):
    with Sandbox(ws, policy=POLICY, adapter=adapter, socket=str(pooled.socket)) as sb:
        tools = oa_adapter.sandbox_tools(sb, limits=ToolLimits(output_chars=1000))
        run = by_name(tools)["run_command"]
        raw = json.dumps(nulls(command="echo hi; echo oops >&2; exit 3"))
        ctx = ToolContext(context=None, tool_name="run_command", tool_call_id="call_1", tool_arguments=raw)
        out = asyncio.run(run.on_invoke_tool(ctx, raw))
        assert re.fullmatch(r"exit code 3 \(call \S+\)\n--- stdout ---\nhi\n\n--- stderr ---\noops\n", out), out
        assert_recorded(sb, out, "echo hi; echo oops >&2; exit 3")
        said = scripted_run(
            tools,
            # Two at once: the sandbox runs one command at a time, the tools take turns.
            ("run_command", nulls(command="sleep 1; echo first")),
            ("run_command", nulls(command=["sh", "-c", "sleep 1; pwd"], cwd="/workspace/out")),
            ("run_command", nulls(command="seq 1 2000")),
            ("run_command", nulls(command="sleep 30", timeout_ms=1000)),
            ("run_command", nulls(command="true", timeout_ms=20_001)),
            ("write_file", {"path": "/workspace/README.md", "content": "overwritten", "create_dirs": False}))
        assert said["c0"].startswith("exit code 0 (call ") and said["c0"].endswith("--- stdout ---\nfirst\n")
        assert said["c1"].endswith("--- stdout ---\n/workspace/out\n")
        assert "cut from the middle of stdout; the whole stdout is artifact " in said["c2"]
        assert said["c2"].rstrip().endswith("2000") and "\n1\n2\n3\n" in said["c2"]
        assert said["c3"].startswith("error: timed out") and call_id(said["c3"]) != call_id(said["c0"])
        assert said["c4"] == ("refused: timeout_ms: 20001 ms is more than the 20000 ms this sandbox allows (a call "
                              "may shorten the timeout, never lengthen it) (nothing ran)")
        assert said["c5"].startswith("refused: /workspace/README.md is not under the sandbox's write roots")
    assert (ws / "README.md").read_text() == "read me\n"


@pytest.mark.parametrize("adapter", BACKENDS)
def test_openai_agents_over_an_async_sandbox(pooled, ws, adapter):
    async def main():
        async with AsyncSandbox(ws, policy=POLICY, adapter=adapter, socket=str(pooled.socket)) as sb:
            tools = by_name(oa_adapter.sandbox_tools(sb))
            async def invoke(name, arguments):
                raw = json.dumps(arguments)
                ctx = ToolContext(context=None, tool_name=name, tool_call_id="call_x", tool_arguments=raw)
                return await tools[name].on_invoke_tool(ctx, raw)
            written = await invoke("write_file", {"path": "out/new.txt", "content": "fresh\n", "create_dirs": False})
            both = await asyncio.gather(invoke("run_command", nulls(command="sleep 1; cat out/new.txt")),
                                        invoke("read_file", {"path": "/workspace/out/new.txt"}))
            past = await invoke("run_command", nulls(command="true", timeout_ms=20_001))
            return written, both, past
    written, (ran, read), past = asyncio.run(main())
    assert written == "wrote 6 bytes to /workspace/out/new.txt"
    assert ran.endswith("--- stdout ---\nfresh\n") and read == "fresh\n"
    assert past.startswith("refused: timeout_ms: 20001 ms is more than the 20000 ms")  # the lease's, as explained


# --- LangChain ---

@pytest.mark.parametrize("adapter", BACKENDS)
def test_langchain_runs_commands_in_the_sandbox(pooled, ws, adapter):
    with Sandbox(ws, policy=POLICY, adapter=adapter, socket=str(pooled.socket)) as sb:
        tools = by_name(lc_adapter.sandbox_tools(sb, limits=ToolLimits(timeout_ms=5000, read_bytes=4096)))
        run = tools["run_command"]
        out = run.invoke({"command": ["sh", "-c", 'echo "$0"; exit 7', "argv"]})
        assert re.fullmatch(r"exit code 7 \(call \S+\)\n--- stdout ---\nargv\n", out), out
        assert_recorded(sb, out, "argv")
        message = run.invoke({"name": "run_command", "args": {"command": "cat README.md"}, "id": "tc1",
                              "type": "tool_call"})
        assert isinstance(message, ToolMessage) and message.status == "success" and message.tool_call_id == "tc1"
        assert message.content.endswith("--- stdout ---\nread me\n")
        slow = run.invoke({"name": "run_command", "args": {"command": "sleep 30", "timeout_ms": 1000}, "id": "tc2",
                           "type": "tool_call"})
        assert slow.status == "error" and slow.content.startswith("error: timed out")
        past = run.invoke({"command": "true", "timeout_ms": 5001})  # the operator's limit, not the lease's
        assert past.startswith("refused: timeout_ms: 5001 ms is more than the 5000 ms")

        async def together():
            return await asyncio.gather(run.ainvoke({"command": "sleep 1; echo a"}),
                                        run.ainvoke({"command": "sleep 1; echo b"}))
        a, b = asyncio.run(together())
        assert a.endswith("--- stdout ---\na\n") and b.endswith("--- stdout ---\nb\n")
        assert tools["write_file"].invoke({"path": "out/made/deep.txt", "content": "deep\n", "create_dirs": True}) \
            == "wrote 5 bytes to /workspace/out/made/deep.txt"
        assert (ws / "out" / "made" / "deep.txt").read_text() == "deep\n"
        assert tools["read_file"].invoke({"path": "out/made/deep.txt"}) == "deep\n"
        refused = tools["read_file"].invoke({"name": "read_file", "args": {"path": "big.txt"}, "id": "tc3",
                                             "type": "tool_call"})
        assert refused.status == "error"
        assert refused.content.startswith("refused: /workspace/big.txt is larger than the 4096 bytes read_file returns")
        missing = tools["read_file"].invoke({"path": "/workspace/missing.txt"})
        assert missing.startswith("refused: /workspace/missing.txt: no such file in the sandbox")


# --- smolagents ---

class NoModel(Model):
    """The agent is made to run its tools; no model is ever asked."""

    def generate(self, *args, **kwargs):
        raise AssertionError("no model in these tests")


@pytest.mark.parametrize("adapter", BACKENDS)
def test_smolagents_runs_commands_in_the_sandbox(pooled, ws, adapter):
    with Sandbox(ws, policy=POLICY, adapter=adapter, socket=str(pooled.socket)) as sb:
        shared = SandboxTools(sb)
        tools = by_name(smol_adapter.sandbox_tools(shared))
        out = tools["run_command"](command="ls; exit 1", cwd="/workspace/out")
        assert re.fullmatch(r"exit code 1 \(call \S+\)\n--- stdout ---\nkeep.txt\n", out), out
        assert_recorded(sb, out, "ls; exit 1")
        agent = ToolCallingAgent(tools=list(tools.values()), model=NoModel(), verbosity_level=-1)
        assert agent.execute_tool_call("read_file", {"path": "out/keep.txt"}) == "kept\n"
        assert agent.execute_tool_call("write_file", {"path": "out/keep.txt", "content": "new\n"}) == \
            "wrote 4 bytes to /workspace/out/keep.txt"
        assert (ws / "out" / "keep.txt").read_text() == "new\n"
        with pytest.raises(AgentToolExecutionError) as timed_out:
            agent.execute_tool_call("run_command", {"command": "sleep 30", "timeout_ms": 1000})
        assert "SandboxToolError: error: timed out" in timed_out.value.message
        assert "(call " in timed_out.value.message
        with pytest.raises(AgentToolExecutionError) as refused:
            agent.execute_tool_call("write_file", {"path": "/etc/passwd", "content": "x"})
        assert "refused: /etc/passwd is not under the sandbox's write roots" in refused.value.message
        # The same SandboxTools behind another framework: one sandbox, one command at a time.
        run = by_name(lc_adapter.sandbox_tools(shared))["run_command"]
        assert run.invoke({"command": "cat out/keep.txt"}).endswith("--- stdout ---\nnew\n")
