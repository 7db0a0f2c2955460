"""A Sandbox and its Process over any engine's Backend: the sandbox made for one call
(Docker's container, nsjail's jail, the fake's), destroyed after its one command."""

from __future__ import annotations

from typing import Any

from sandboxd.sandbox.output import OutputSpool
from sandboxd.sandbox.protocol import Backend, ExitStatus, ResourceUsage, SandboxHandle

# How long a destroyed sandbox's output reader gets to land its last bytes in the spool.
READER_GRACE_S = 10.0


class EngineProcess:
    """The command of an engine's sandbox: the engine's verbs on its handle."""

    def __init__(self, backend: Backend, handle: SandboxHandle):
        self._backend = backend
        self._handle = handle

    def wait(self, timeout_s: float) -> bool:
        return self._backend.wait(self._handle, timeout_s)

    def kill(self) -> None:
        self._backend.kill(self._handle)

    def collect(self) -> tuple[ExitStatus, ResourceUsage]:
        return self._backend.collect(self._handle)

    def pid(self) -> int:
        return self._backend.sandbox_pid(self._handle)

    def output_ended(self) -> bool:
        return self._handle.output_closed.is_set()


class EngineSandbox:
    """A sandbox an engine made, from create_sandbox() until destroy()."""

    def __init__(self, backend: Backend, handle: SandboxHandle):
        self._backend = backend
        self._handle = handle

    @property
    def sandbox_id(self) -> str:
        return self._handle.sandbox_id

    @property
    def engine_id(self) -> str:
        return self._handle.engine_id

    @property
    def spec(self) -> Any:
        # As it runs: nsjail on cgroup v2 may keep a spawn slot's cgroup.
        return self._handle.spec

    def start(self, spool: OutputSpool, stdin: bytes) -> EngineProcess:
        self._backend.start(self._handle, spool, stdin)
        return EngineProcess(self._backend, self._handle)

    def destroy(self) -> None:
        """The engine removes it; its output reader then lands the last bytes before the
        spool can close (waited for even when the removal failed)."""
        try:
            self._backend.destroy(self._handle)
        finally:
            reader = self._handle.reader
            if reader is not None:
                reader.join(READER_GRACE_S)


def create_sandbox(backend: Backend, spec: Any) -> EngineSandbox:
    """A new sandbox of `backend`, from its spec; nothing runs in it yet."""
    return EngineSandbox(backend, backend.create(spec))
