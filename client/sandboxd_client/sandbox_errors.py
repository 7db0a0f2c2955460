"""What the high-level client's file operations (Sandbox.read_file, write_file,
list_files) raise when the sandbox refuses one: each is a SandboxdClientError of the
matching status and also the matching built-in OSError, so that `except
FileNotFoundError` works. Chosen by what happened (the helper command's exit status, or
the policy's write roots), never by parsing a message."""

from __future__ import annotations

from . import errors


class SandboxFileError(errors.SandboxdClientError):
    """A file operation in the sandbox that could not be done; `path` is the sandbox path."""

    def __init__(self, message: str, path: str, tool_call_id: str = ""):
        super().__init__(message, tool_call_id)
        self.path = path


class SandboxFileNotFound(SandboxFileError, errors.NotFound, FileNotFoundError):
    """No such file in the sandbox's view (absent, outside every root, or blocked)."""


class SandboxIsADirectory(SandboxFileError, errors.FailedPrecondition, IsADirectoryError):
    """A file was wanted and the path is a directory."""


class SandboxNotADirectory(SandboxFileError, errors.FailedPrecondition, NotADirectoryError):
    """A directory was wanted (to list, or as a new file's parent) and it is not one."""


class SandboxPermissionError(SandboxFileError, errors.PermissionDenied, PermissionError):
    """The sandbox's user may not read or write the path."""


class PathNotWritable(SandboxPermissionError):
    """A write the policy does not allow: the path is not under one of the sandbox's
    write roots or its tempDir (refused before anything is sent), or the sandbox itself
    refused it (a read-only mount reached through a link, say)."""


class SandboxOutputTruncated(SandboxFileError, errors.ResourceExhausted):
    """A file or listing larger than the command's output cap (maxStdoutBytes): part
    of it would be wrong, so none of it is returned."""
