"""The one error root of the daemon. Each kind names its gRPC status (`status`, the name
of a grpc.StatusCode member, so that nothing below api/ imports grpc); the servicer
interceptor (api/errors.py) is the only place that turns them into statuses."""

from __future__ import annotations


class SandboxdError(Exception):
    """Base of every error the daemon reports to a caller."""

    status: str = "INTERNAL"
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
    status = "INVALID_ARGUMENT"
    kind = "INVALID_ARGUMENT"


class Unauthenticated(SandboxdError):
    status = "UNAUTHENTICATED"
    kind = "UNAUTHENTICATED"


class PermissionDenied(SandboxdError):
    status = "PERMISSION_DENIED"
    kind = "PERMISSION_DENIED"


class FailedPrecondition(SandboxdError):
    status = "FAILED_PRECONDITION"
    kind = "FAILED_PRECONDITION"


class NotFound(SandboxdError):
    status = "NOT_FOUND"
    kind = "NOT_FOUND"


class AlreadyExists(SandboxdError):
    status = "ALREADY_EXISTS"
    kind = "ALREADY_EXISTS"


class Aborted(SandboxdError):
    """A concurrency conflict the caller should retry."""

    status = "ABORTED"
    kind = "ABORTED"
    retryable = True


class ResourceExhausted(SandboxdError):
    status = "RESOURCE_EXHAUSTED"
    kind = "RESOURCE_EXHAUSTED"
    retryable = True


class Unimplemented(SandboxdError):
    status = "UNIMPLEMENTED"
    kind = "UNIMPLEMENTED"


class BackendUnavailable(SandboxdError):
    """The sandbox engine (dockerd, nsjail) is missing or failing; never run unsandboxed."""

    status = "UNAVAILABLE"
    kind = "BACKEND_UNAVAILABLE"
    retryable = True


class InternalError(SandboxdError):
    status = "INTERNAL"
    kind = "INTERNAL"
