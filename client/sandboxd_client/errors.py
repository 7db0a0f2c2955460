"""The client's closed set of errors, one per status code the daemon uses. Errors are
chosen by status code only, never rebuilt from message strings."""

from __future__ import annotations

import grpc


class SandboxdClientError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, tool_call_id: str = ""):
        super().__init__(message)
        self.message = message
        self.tool_call_id = tool_call_id


class InvalidArgument(SandboxdClientError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(SandboxdClientError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SandboxdClientError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(SandboxdClientError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SandboxdClientError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(SandboxdClientError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(SandboxdClientError):
    code = grpc.StatusCode.ABORTED


class ResourceExhausted(SandboxdClientError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unimplemented(SandboxdClientError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Unavailable(SandboxdClientError):
    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(SandboxdClientError):
    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(SandboxdClientError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Internal(SandboxdClientError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE = {cls.code: cls for cls in SandboxdClientError.__subclasses__()}


def from_rpc_error(err: grpc.RpcError) -> SandboxdClientError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    tool_call_id = ""
    try:
        for key, value in err.trailing_metadata() or ():
            if key == "sandboxd-tool-call-id":
                tool_call_id = value
    except Exception:  # trailing metadata is absent on transport failures
        pass
    cls = _BY_CODE.get(code, SandboxdClientError)
    exc = cls(details or code.name, tool_call_id)
    if cls is SandboxdClientError:
        exc.code = code
    return exc
