"""Client library and CLI for sandboxd."""

from .client import AsyncSandboxdClient, CallOutcome, SandboxdClient, build_call, default_socket, to_json
from .errors import SandboxdClientError

__all__ = ["AsyncSandboxdClient", "CallOutcome", "SandboxdClient", "SandboxdClientError", "build_call",
           "default_socket", "to_json"]
