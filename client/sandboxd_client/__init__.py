"""Client library and CLI for sandboxd."""

__version__ = "0.1.0"

from .aio import AsyncSandboxdClient
from .client import CallOutcome, SandboxdClient, TlsFiles, build_call, default_socket, to_json
from .errors import SandboxdClientError
from .sandbox import AsyncSandbox, Sandbox
from .sandbox_errors import PathNotWritable
from .sandbox_result import CommandFailed, CommandResult, OutputChunk

__all__ = ["AsyncSandbox", "AsyncSandboxdClient", "CallOutcome", "CommandFailed", "CommandResult", "OutputChunk",
           "PathNotWritable", "Sandbox", "SandboxdClient", "SandboxdClientError", "TlsFiles", "build_call",
           "default_socket", "to_json"]
