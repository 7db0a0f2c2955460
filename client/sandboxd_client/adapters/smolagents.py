"""The sandbox's tools as smolagents Tools (`smolagents`):

    with Sandbox(workspace, policy=policy) as sb:
        agent = ToolCallingAgent(tools=sandbox_tools(sb), model=model)

smolagents calls tools synchronously, so these take a blocking Sandbox. A tool that
fails or is refused raises SandboxToolError (its text: why, and the call id), which the
agent hands the model as the tool's error (AgentToolExecutionError) and goes on.

Each tool is a call in the sandbox, for the ToolCallingAgent's JSON tool calls and the
CodeAgent's code alike; the CodeAgent's own Python still runs where its executor runs."""

from __future__ import annotations

from typing import Any

from .extras import require_extra

try:
    from smolagents import Tool
except ImportError as exc:
    require_extra(exc, "smolagents", "smolagents", "smolagents")
    raise

from ..sandbox import Sandbox
from .toolkit import READ_FILE, RUN_COMMAND, WRITE_FILE, SandboxTools, ToolLimits, ToolText

__all__ = ["ReadFileTool", "RunCommandTool", "WriteFileTool", "sandbox_tools"]


def _input(text: ToolText, name: str, kind: str | list[str], *, nullable: bool = False) -> dict[str, Any]:
    """One entry of a Tool's `inputs`: its type(s) and description (nullable: optional)."""
    entry: dict[str, Any] = {"type": kind, "description": text.arguments[name]}
    if nullable:
        entry["nullable"] = True
    return entry


class _SandboxTool(Tool):
    """What the three share: the SandboxTools they run through (blocking)."""

    output_type = "string"

    def __init__(self, tools: SandboxTools):
        if not isinstance(tools, SandboxTools) or not tools.blocking:
            raise TypeError("tools: the SandboxTools of a blocking Sandbox (smolagents calls tools synchronously)")
        super().__init__()
        self.tools = tools


class RunCommandTool(_SandboxTool):
    name = RUN_COMMAND.name
    description = RUN_COMMAND.description
    inputs = {"command": _input(RUN_COMMAND, "command", ["string", "array"]),
              "cwd": _input(RUN_COMMAND, "cwd", "string", nullable=True),
              "timeout_ms": _input(RUN_COMMAND, "timeout_ms", "integer", nullable=True)}

    def forward(self, command: str | list[str], cwd: str | None = None, timeout_ms: int | None = None) -> str:
        return self.tools.run_command(command, cwd, timeout_ms)


class ReadFileTool(_SandboxTool):
    name = READ_FILE.name
    description = READ_FILE.description
    inputs = {"path": _input(READ_FILE, "path", "string")}

    def forward(self, path: str) -> str:
        return self.tools.read_file(path)


class WriteFileTool(_SandboxTool):
    name = WRITE_FILE.name
    description = WRITE_FILE.description
    inputs = {"path": _input(WRITE_FILE, "path", "string"), "content": _input(WRITE_FILE, "content", "string"),
              "create_dirs": _input(WRITE_FILE, "create_dirs", "boolean", nullable=True)}

    def forward(self, path: str, content: str, create_dirs: bool | None = None) -> str:
        return self.tools.write_file(path, content, False if create_dirs is None else create_dirs)


def sandbox_tools(sandbox: Sandbox | SandboxTools, *, limits: ToolLimits | None = None,
                  files: bool = True) -> list[Tool]:
    """run_command, and unless `files` is false read_file and write_file, over an opened
    Sandbox (or the SandboxTools of one)."""
    tools = sandbox if isinstance(sandbox, SandboxTools) else SandboxTools(sandbox, limits)
    made: list[Tool] = [RunCommandTool(tools)]
    if files:
        made += [ReadFileTool(tools), WriteFileTool(tools)]
    return made
