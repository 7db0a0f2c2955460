"""The sandbox layer's two seams. `Backend`: the verbs every engine implements (Docker,
nsjail, the fake), by handle; a backend is told a spec, its own compiler's (DockerSpec,
NsjailSpec: `Any` here, the engine's business), and never sees a policy. `Sandbox` and
`Process`: what a call runs in and what it runs, kept apart as containerd and gVisor keep
them: a Sandbox is created and destroyed, a Process is started in it, waited on, killed
and collected. A fresh sandbox is one over an engine (sandbox/engine.py); a leased warm
sandbox is one that outlives each of its processes (pools/lease.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from collections.abc import Callable
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
    # Ends the backend's OOM watch of this sandbox (backends/oom_guard.py), once it ran.
    unwatch_oom: Callable[[], None] | None = None

    def stop_oom_watch(self) -> None:
        unwatch, self.unwatch_oom = self.unwatch_oom, None
        if unwatch is not None:
            unwatch()


@dataclass(frozen=True)
class ExitStatus:
    exit_code: int
    signal: str  # "" when the command exited on its own
    oom_killed: bool


@dataclass(frozen=True)
class ResourceUsage:
    cpu_ms: int
    peak_memory_bytes: int


class RunSpec(Protocol):
    """A spec as a sandbox ran it: its canonical form is what ToolSandboxPrepared digests."""

    def to_json_dict(self) -> dict[str, Any]: ...


class Process(Protocol):
    """One command running in a sandbox."""

    def wait(self, timeout_s: float) -> bool:
        """True once it ended and its output is drained; False at the timeout."""

    def kill(self) -> None:
        """Kills it (its whole process tree) now; nothing once it ended."""

    def collect(self) -> tuple[ExitStatus, ResourceUsage]:
        """Exit status and resource usage once it ended."""

    def pid(self) -> int:
        """A host pid inside its running sandbox (the mounts final): the sandbox's init,
        which a file watch attaches by; 0 while there is none."""

    def output_ended(self) -> bool:
        """True once its output reached EOF: nothing of it can come up any more."""


class Sandbox(Protocol):
    """What a call's command runs in: created before it, destroyed after it."""

    @property
    def sandbox_id(self) -> str: ...

    @property
    def engine_id(self) -> str:
        """The engine's name for it (container id, jail pid, ...)."""

    @property
    def spec(self) -> RunSpec:
        """The spec it runs the command as (ToolSandboxPrepared's digest)."""

    def start(self, spool: OutputSpool, stdin: bytes) -> Process:
        """Starts the command, its output pumped into `spool` until EOF."""

    def destroy(self) -> None:
        """Done with it: removed with everything it held (a fresh sandbox), or given
        back (a leased one). Idempotent."""


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
