"""The one error root of the daemon. Each kind knows its gRPC status; the servicer
interceptor (service.py) is the only place that turns them into statuses."""

from __future__ import annotations

import grpc


class SandboxdError(Exception):
    """Base of every error the daemon reports to a caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    kind: str = "INTERNAL"
    retryable: bool = False

    def __init__(self, reason: str, *, field: str | None = None, tool_call_id: str | None = None):
        self.reason = reason
        self.field = field
        self.tool_call_id = tool_call_id
        super().__init__(self.message)

    @property
    def message(self) -> str:
        return f"{self.field}: {self.reason}" if self.field else self.reason


class InvalidArgument(SandboxdError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    kind = "INVALID_ARGUMENT"


class Unauthenticated(SandboxdError):
    code = grpc.StatusCode.UNAUTHENTICATED
    kind = "UNAUTHENTICATED"


class PermissionDenied(SandboxdError):
    code = grpc.StatusCode.PERMISSION_DENIED
    kind = "PERMISSION_DENIED"


class FailedPrecondition(SandboxdError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    kind = "FAILED_PRECONDITION"


class NotFound(SandboxdError):
    code = grpc.StatusCode.NOT_FOUND
    kind = "NOT_FOUND"


class AlreadyExists(SandboxdError):
    code = grpc.StatusCode.ALREADY_EXISTS
    kind = "ALREADY_EXISTS"


class Aborted(SandboxdError):
    """A concurrency conflict the caller should retry."""

    code = grpc.StatusCode.ABORTED
    kind = "ABORTED"
    retryable = True


class ResourceExhausted(SandboxdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    kind = "RESOURCE_EXHAUSTED"
    retryable = True


class Unimplemented(SandboxdError):
    code = grpc.StatusCode.UNIMPLEMENTED
    kind = "UNIMPLEMENTED"


class BackendUnavailable(SandboxdError):
    """The sandbox engine (dockerd, nsjail) is missing or failing; never run unsandboxed."""

    code = grpc.StatusCode.UNAVAILABLE
    kind = "BACKEND_UNAVAILABLE"
    retryable = True


class InternalError(SandboxdError):
    code = grpc.StatusCode.INTERNAL
    kind = "INTERNAL"
