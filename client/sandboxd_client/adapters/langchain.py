"""The sandbox's tools as LangChain StructuredTools (`langchain-core`):

    with Sandbox(workspace, policy=policy) as sb:
        tools = sandbox_tools(sb)             # bind them to a chat model, or a LangGraph ToolNode
        tools[0].invoke({"command": "ls -a"})

A tool that fails or is refused raises ToolException, which the tools handle the
LangChain way: the model gets its text (why, and the call id) as the tool's output, in a
ToolMessage of status "error" when the tool was called with a ToolCall. Arguments that
do not match the schema are answered the same way, naming each one. Over a blocking
Sandbox the tools run with `invoke` and `ainvoke` (in a worker thread); over an
AsyncSandbox with `ainvoke` only."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .extras import require_extra

try:
    from langchain_core.tools import BaseTool, StructuredTool, ToolException
except ImportError as exc:
    require_extra(exc, "langchain_core", "LangChain (langchain-core)", "langchain")
    raise
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..sandbox import AsyncSandbox, Sandbox
from .text import argument_text
from .toolkit import READ_FILE, RUN_COMMAND, WRITE_FILE, SandboxToolError, SandboxTools, ToolLimits, ToolText

__all__ = ["ReadFileArgs", "RunCommandArgs", "WriteFileArgs", "sandbox_tools"]

_FORBID = ConfigDict(extra="forbid")


class RunCommandArgs(BaseModel):
    model_config = _FORBID
    command: str | list[str] = Field(description=RUN_COMMAND.arguments["command"])
    cwd: str | None = Field(default=None, description=RUN_COMMAND.arguments["cwd"])
    timeout_ms: int | None = Field(default=None, description=RUN_COMMAND.arguments["timeout_ms"])


class ReadFileArgs(BaseModel):
    model_config = _FORBID
    path: str = Field(description=READ_FILE.arguments["path"])


class WriteFileArgs(BaseModel):
    model_config = _FORBID
    path: str = Field(description=WRITE_FILE.arguments["path"])
    content: str = Field(description=WRITE_FILE.arguments["content"])
    create_dirs: bool = Field(default=False, description=WRITE_FILE.arguments["create_dirs"])


def validation_text(error: ValidationError | Exception) -> str:
    """Arguments that do not match the schema, each named (the handle_validation_error)."""
    if not isinstance(error, ValidationError):
        return argument_text("arguments", "they do not match the tool's schema")
    return argument_text("arguments", "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: {e['msg']}"
                                                for e in error.errors()[:5]))


def _blocking(call: Callable[..., str]) -> Callable[..., str]:
    def tool(**arguments: Any) -> str:
        try:
            return call(**arguments)
        except SandboxToolError as exc:
            raise ToolException(exc.text) from exc
    return tool


def _async(call: Callable[..., Awaitable[str]]) -> Callable[..., Awaitable[str]]:
    async def tool(**arguments: Any) -> str:
        try:
            return await call(**arguments)
        except SandboxToolError as exc:
            raise ToolException(exc.text) from exc
    return tool


def _tool(text: ToolText, schema: type[BaseModel], blocking: Callable[..., str] | None,
          coroutine: Callable[..., Awaitable[str]]) -> BaseTool:
    return StructuredTool.from_function(
        func=_blocking(blocking) if blocking else None, coroutine=_async(coroutine), name=text.name,
        description=text.description, args_schema=schema, infer_schema=False, handle_tool_error=True,
        handle_validation_error=validation_text)


def sandbox_tools(sandbox: Sandbox | AsyncSandbox | SandboxTools, *, limits: ToolLimits | None = None,
                  files: bool = True) -> list[BaseTool]:
    """run_command, and unless `files` is false read_file and write_file, over an opened
    Sandbox or AsyncSandbox (or the SandboxTools of one)."""
    tools = sandbox if isinstance(sandbox, SandboxTools) else SandboxTools(sandbox, limits)
    blocking = tools.blocking
    made = [_tool(RUN_COMMAND, RunCommandArgs, tools.run_command if blocking else None, tools.arun_command)]
    if files:
        made += [_tool(READ_FILE, ReadFileArgs, tools.read_file if blocking else None, tools.aread_file),
                 _tool(WRITE_FILE, WriteFileArgs, tools.write_file if blocking else None, tools.awrite_file)]
    return made
