"""The one Backend protocol that every sandbox engine implements (Docker, nsjail). A
backend is told a spec, its own compiler's (DockerSpec, NsjailSpec: `Any` here, the
engine's business); it never sees a policy."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from sandboxd.policy.models import EffectivePolicy
from sandboxd.policy.preflight import HostPlan
from sandboxd.sandbox.output import OutputSpool
from sandboxd.sandbox.spec import Attachments, SandboxIdentity


@dataclass
class SandboxHandle:
    sandbox_id: str
    engine_id: str  # container id, jail pid, ...
    spec: Any  # the engine's own spec (DockerSpec, NsjailSpec)
    # Set when the sandbox's output streams reached EOF: its process tree is gone.
    output_closed: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None


@dataclass(frozen=True)
class ExitStatus:
    exit_code: int
    signal: str  # "" when the command exited on its own
    oom_killed: bool


@dataclass(frozen=True)
class ResourceUsage:
    cpu_ms: int
    peak_memory_bytes: int


class Backend(Protocol):
    name: str

    def check(self) -> None:
        """Raises BackendUnavailable when the engine or a feature it needs is missing."""

    def compile(self, policy: EffectivePolicy, plan: HostPlan, identity: SandboxIdentity, *,
                argv: tuple[str, ...], image: str, stdin_open: bool, attachments: Attachments | None = None) -> Any:
        """This backend's spec for a call: its pure compiler, fed the host facts only the
        backend knows (mask file, seccomp profile, root filesystem) and the call's
        attachments (the shim, the egress endpoint, secrets)."""

    def image_digest(self, image: str) -> str:
        """The local image's content digest; FailedPrecondition when it is absent."""

    def resolve_image(self, image: str) -> tuple[str, tuple[str, ...]]:
        """The local image a reference resolves to: its digest and every name the engine
        gives it (repository:tag), which the image allowlist is checked against."""

    def create(self, spec: Any) -> SandboxHandle:
        """Creates the sandbox; nothing runs yet. Cleans up after itself on failure."""

    def start(self, handle: SandboxHandle, sink: OutputSpool, stdin: bytes) -> None:
        """Starts the command and pumps its output into `sink` until EOF."""

    def wait(self, handle: SandboxHandle, timeout_s: float) -> bool:
        """True once the whole process tree has ended; False at the timeout."""

    def sandbox_pid(self, handle: SandboxHandle) -> int:
        """A host pid inside the running sandbox (its mounts final), 0 while there is none."""

    def kill(self, handle: SandboxHandle) -> None:
        """Kills the whole process tree now."""

    def collect(self, handle: SandboxHandle) -> tuple[ExitStatus, ResourceUsage]:
        """Exit status and resource usage of an ended sandbox."""

    def destroy(self, handle: SandboxHandle) -> None:
        """Removes the sandbox and everything it held. Idempotent."""

    def reap_orphans(self, daemon_id: str) -> int:
        """Removes sandboxes a previous run of this daemon left behind."""
