"""The sandbox's tools as FunctionTools of the OpenAI Agents SDK (`openai-agents`):

    with Sandbox(workspace, policy=policy) as sb:
        agent = Agent(name="coder", tools=sandbox_tools(sb))

A tool that fails or is refused answers the model with the SDK's error form: its failure
function's text (why, and the call id), the run going on. Arguments the model got wrong
(the SDK checks them against the schema) are said as such; any other error is the
SDK's default message, which shows the model no internals."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from .extras import require_extra

try:
    from agents import FunctionTool, RunContextWrapper, function_tool
    from agents.exceptions import ModelBehaviorError
    from agents.tool import default_tool_error_function
except ImportError as exc:
    require_extra(exc, "agents", "the OpenAI Agents SDK", "openai-agents")
    raise
from pydantic import Field, ValidationError

from ..sandbox import AsyncSandbox, Sandbox
from .text import argument_text
from .toolkit import READ_FILE, RUN_COMMAND, WRITE_FILE, SandboxToolError, SandboxTools, ToolLimits, ToolText

__all__ = ["sandbox_tools", "tool_error_text"]


def _validation_detail(error: BaseException | None) -> str:
    if not isinstance(error, ValidationError):
        return "they do not match the tool's schema"
    return "; ".join(f"{'.'.join(str(part) for part in e['loc']) or 'arguments'}: {e['msg']}"
                     for e in error.errors()[:5])


def tool_error_text(ctx: RunContextWrapper[Any], error: Exception) -> str:
    """The failure function of the sandbox's tools: what the model is told of an error."""
    if isinstance(error, SandboxToolError):
        return error.text
    if isinstance(error, ModelBehaviorError):  # the arguments did not parse, or not as the schema says
        return argument_text("arguments", _validation_detail(error.__cause__))
    return default_tool_error_function(ctx, error)


def _arg(tool: ToolText, name: str) -> Any:
    return Field(description=tool.arguments[name])


def sandbox_tools(sandbox: Sandbox | AsyncSandbox | SandboxTools, *, limits: ToolLimits | None = None,
                  files: bool = True) -> list[FunctionTool]:
    """run_command, and unless `files` is false read_file and write_file, over an opened
    Sandbox or AsyncSandbox (or the SandboxTools of one). A blocking Sandbox's calls run
    in a worker thread, so the event loop goes on while a command runs."""
    tools = sandbox if isinstance(sandbox, SandboxTools) else SandboxTools(sandbox, limits)

    async def run_command(command: Annotated[str | list[str], _arg(RUN_COMMAND, "command")],
                          cwd: Annotated[str | None, _arg(RUN_COMMAND, "cwd")] = None,
                          timeout_ms: Annotated[int | None, _arg(RUN_COMMAND, "timeout_ms")] = None) -> str:
        return await tools.arun_command(command, cwd, timeout_ms)

    async def read_file(path: Annotated[str, _arg(READ_FILE, "path")]) -> str:
        return await tools.aread_file(path)

    async def write_file(path: Annotated[str, _arg(WRITE_FILE, "path")],
                         content: Annotated[str, _arg(WRITE_FILE, "content")],
                         create_dirs: Annotated[bool, _arg(WRITE_FILE, "create_dirs")] = False) -> str:
        return await tools.awrite_file(path, content, create_dirs)

    made = [_tool(run_command, RUN_COMMAND)]
    if files:
        made += [_tool(read_file, READ_FILE), _tool(write_file, WRITE_FILE)]
    return made


def _tool(func: Callable[..., Awaitable[str]], text: ToolText) -> FunctionTool:
    return function_tool(func, name_override=text.name, description_override=text.description,
                         use_docstring_info=False, failure_error_function=tool_error_text)
