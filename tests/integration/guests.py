"""The qemu guests of test_cgroup_v2.py and test_systemd_unit.py (scripts/cgroup2-vm),
launched one way. Their tests run last (conftest); the first of them to ask starts the
guests, one after the other, on a thread. Not beside the host's tests: an emulated CPU
sharing this host's two cores with them failed the guest's timing tests (a timeout
within a second, the CPU quota, streaming), measured in a run of the whole suite."""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "scripts" / "cgroup2-vm" / "run.sh"
GUEST_MODULES = ("test_cgroup_v2.py", "test_systemd_unit.py")


@dataclass
class GuestOutcome:
    returncode: int
    stderr: str
    exchange: Path
    log: str

    def detail(self, log_tail: int = 6000) -> str:
        return f"run.sh exited {self.returncode}\n{self.stderr[-3000:]}\n{self.log[-log_tail:]}"


@dataclass
class Guest:
    """One guest run: `prepare` (on the thread) returns run.sh's arguments and the
    exchange directory the guest writes into."""

    name: str
    prepare: Callable[[], tuple[list[str], Path]]
    timeout_s: int
    done: threading.Event = field(default_factory=threading.Event)
    outcome: GuestOutcome | None = None
    failure: BaseException | None = None
    _vm: subprocess.Popen | None = None

    def run(self) -> None:
        try:
            args, exchange = self.prepare()
            # Its own session: whatever ends it ends qemu with it.
            self._vm = subprocess.Popen([str(RUN), *args], cwd=REPO, stdin=subprocess.DEVNULL,
                                        env={**os.environ, "CGROUP2_VM_TIMEOUT": str(self.timeout_s)},
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            try:
                _, stderr = self._vm.communicate(timeout=self.timeout_s + 60)
            finally:
                self.kill()
            log_file = exchange / "output.log"
            log = log_file.read_text(errors="replace") if log_file.exists() else ""
            self.outcome = GuestOutcome(self._vm.returncode, stderr.decode(errors="replace"), exchange, log)
        except BaseException as exc:  # the test reports it
            self.failure = exc
        finally:
            self.done.set()

    def kill(self) -> None:
        vm = self._vm
        if vm is not None and vm.poll() is None:
            # Every process of the session: `timeout` puts qemu in a process group of its own.
            subprocess.run(["pkill", "-KILL", "-s", str(vm.pid)], check=False)
            vm.wait()

    def wait(self) -> GuestOutcome:
        if not self.done.wait(self.timeout_s + 600):
            raise TimeoutError(f"the {self.name} guest did not end")
        if self.failure is not None:
            raise self.failure
        assert self.outcome is not None
        return self.outcome


class GuestQueue:
    """The guests a session runs, in order, on one thread (two emulated CPUs at once
    would leave the host's tests none)."""

    def __init__(self) -> None:
        self.guests: dict[str, Guest] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    def add(self, guest: Guest) -> None:
        self.guests[guest.name] = guest

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="qemu-guests", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for guest in list(self.guests.values()):
            if self._stopping:
                guest.failure = RuntimeError("the session ended before this guest ran")
                guest.done.set()
                continue
            guest.run()

    def get(self, name: str) -> Guest:
        if self._thread is None:
            self.start()
        return self.guests[name]

    def stop(self) -> None:
        self._stopping = True
        for guest in self.guests.values():
            guest.kill()


QUEUE = GuestQueue()


def progress(log: str, expected: list[str]) -> str:
    """What a guest that stopped short (out of time) did: the tests it finished, by the
    outcome pytest -v printed for each, and those it never reached."""
    finished = dict(re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", log, re.MULTILINE))
    left = [test for test in expected if test not in finished]
    shown = "\n".join(f"  {outcome} {test}" for test, outcome in finished.items())
    return (f"the guest finished {len(finished)} of {len(expected)} tests:\n{shown}\n"
            f"and never reached {len(left)}:\n" + "\n".join(f"  {test}" for test in left))
