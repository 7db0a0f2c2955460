"""FakeProcess: one command of the fake backend (sandbox/fake.py), as its program sees
it: its argv and stdin, a way to write output, a kill to notice. Shared by the fake's
plain sandboxes and its warm sandboxes' supervisor (fake_supervisor.py)."""

from __future__ import annotations

import signal as signal_module
import threading
from collections.abc import Callable, Sequence

from sandboxd.sandbox.protocol import ExitStatus, ResourceUsage
from sandboxd.sandbox.signals import signal_name

__all__ = ["KILLED_EXIT_CODE", "FakeProcess", "Program"]

KILLED_EXIT_CODE = 128 + signal_module.SIGKILL
# A program: the running process and its arguments (argv[1:]) -> its exit code.
Program = Callable[["FakeProcess", Sequence[str]], int]


class FakeProcess:
    """One command in a fake sandbox, as its program sees it."""

    def __init__(self, argv: tuple[str, ...], stdin: bytes, output: Callable[[int, bytes], None],
                 on_end: Callable[[], None]):
        """`output(stream, data)` takes what it writes; `on_end()` is told once it has ended."""
        self.argv = argv
        self.stdin = stdin
        self.killed = threading.Event()
        self.oom_killed = False
        self.usage = ResourceUsage(0, 0)  # a program may set what collect() reports
        self._output = output
        self._on_end = on_end
        self._lock = threading.Lock()
        self._status: ExitStatus | None = None

    @property
    def status(self) -> ExitStatus | None:
        with self._lock:
            return self._status

    def write(self, stream: int, data: bytes) -> None:
        """Output of the command; none once it has ended (a killed process writes nothing)."""
        with self._lock:
            if self._status is None:
                self._output(stream, data)

    def sleep(self, seconds: float) -> bool:
        """True once `seconds` have passed; False as soon as the process is killed."""
        return not self.killed.wait(max(0.0, seconds))

    def end(self, exit_code: int, *, oom_killed: bool = False) -> bool:
        """The process ends with `exit_code` (the first end wins); its output closes."""
        with self._lock:
            if self._status is not None:
                return False
            self._status = ExitStatus(exit_code, signal_name(exit_code), oom_killed)
        self._on_end()
        return True

    def kill(self) -> bool:
        """SIGKILL: the process ends now (False: it had already ended)."""
        ended = self.end(KILLED_EXIT_CODE)
        self.killed.set()  # its program's sleep returns
        return ended


