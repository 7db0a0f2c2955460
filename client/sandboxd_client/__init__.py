"""Client library and CLI for sandboxd."""

__version__ = "0.1.0"

from .client import AsyncSandboxdClient, CallOutcome, SandboxdClient, TlsFiles, build_call, default_socket, to_json
from .errors import SandboxdClientError

__all__ = ["AsyncSandboxdClient", "CallOutcome", "SandboxdClient", "SandboxdClientError", "TlsFiles", "build_call",
           "default_socket", "to_json"]
