"""FakeBackend: the Backend protocol in-process, with no engine and no process, so that
what sits above a backend (admission, cancellation, timeouts, cleanup, pool accounting)
is tested in milliseconds (as SWE-ReX ships its dummy runtime).

A "command" is a script in a tiny vocabulary, run on a thread of the fake's own:

    echo WORD...        WORDs and a newline on stdout      echo-err WORD...  the same on stderr
    cat                 stdin copied to stdout             bytes N [stderr]  N bytes of "x"
    sleep SECONDS       blocks until then, or until killed exit CODE         ends with CODE
    true / false        exit 0 / 1                         oom               killed by the OOM killer
    A ; B               A, then B (unless A was killed)    anything else     exit 127, said on stderr

or a Python callable registered under its argv[0] (`register`). A command whose first
word is `fail-STEP` (fail-create, fail-start, fail-collect, fail-destroy) makes that
step of its sandbox raise once, then runs the rest of its argv; `fail(STEP)` makes the
backend's next STEP raise, whatever the sandbox (also check, resolve_image, compile).

A sandbox compiled with a control socket (a pool's warm sandbox) runs the shim's
supervisor instead (fake_supervisor.py): it calls in on that socket and runs each
command the daemon sends it in the same vocabulary.

The fake counts what it creates and destroys (`created`, `destroyed`, `live`), logs
every verb it is told (`history`), ends a process at once on kill (later writes of its
program are dropped, as a dead process writes nothing), and, like the backstop that
enforces a Docker sandbox's deadline label, kills a process still running at the
policy's timeout plus `deadline_slack_s`."""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from sandboxd.core.errors import BackendUnavailable, FailedPrecondition, InternalError, SandboxdError
from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool
from sandboxd.sandbox.protocol import ExitStatus, ResourceUsage, SandboxHandle
from sandboxd.sandbox.fake_process import KILLED_EXIT_CODE, FakeProcess, Program
from sandboxd.sandbox.fake_supervisor import supervise
from sandboxd.sandbox.spec import Attachments, SandboxIdentity, plain, require_egress

if TYPE_CHECKING:
    from sandboxd.policy.models import EffectivePolicy
    from sandboxd.policy.preflight import HostPlan

__all__ = ["FakeBackend", "FakeProcess", "FakeSpec", "Program", "Step"]

log = logging.getLogger("sandboxd.fake")

Step = Literal["check", "resolve_image", "compile", "create", "start", "collect", "destroy"]
STEPS: tuple[str, ...] = get_args(Step)
NOT_FOUND_EXIT_CODE = 127
CRASHED_EXIT_CODE = 125  # a registered program raised: a bug in the test, said on stderr
# How long collect() waits for a process that has not ended (Docker's wait: 30 s).
COLLECT_WAIT_S = 5.0
_CHUNK_BYTES = 64 * 1024
# A process still running this long past its policy's timeout is killed by the fake
# itself, as Docker's backstop watcher does (its deadline label: the timeout and 2 s).
DEADLINE_SLACK_S = 2.0


@dataclass(frozen=True)
class FakeSpec:
    """Everything the fake backend is told: what a real spec carries that a test may
    want to look at, and the failure its command asks for."""

    daemon_id: str
    sandbox_id: str
    tool_call_id: str
    argv: tuple[str, ...]  # the call's own: the fake runs no shim
    image: str
    user: str
    working_dir: str
    env: dict[str, str]
    stdin_open: bool
    timeout_ms: int
    max_stdout_bytes: int
    max_stderr_bytes: int
    workspace: str
    attachments: Attachments = Attachments()
    fail_at: str = ""  # the step of this sandbox that raises once ("": none)

    def to_json_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = plain(self)
        return out


def _echo(stream: int) -> Program:
    def program(proc: FakeProcess, args: Sequence[str]) -> int:
        proc.write(stream, (" ".join(args) + "\n").encode())
        return 0
    return program


def _cat(proc: FakeProcess, args: Sequence[str]) -> int:
    proc.write(STDOUT, proc.stdin)
    return 0


def _bytes(proc: FakeProcess, args: Sequence[str]) -> int:
    left = int(args[0])
    stream = STDERR if list(args[1:2]) == ["stderr"] else STDOUT
    while left > 0 and not proc.killed.is_set():
        n = min(left, _CHUNK_BYTES)
        proc.write(stream, b"x" * n)
        left -= n
    return 0


def _sleep(proc: FakeProcess, args: Sequence[str]) -> int:
    return 0 if proc.sleep(float(args[0])) else KILLED_EXIT_CODE


def _exit(proc: FakeProcess, args: Sequence[str]) -> int:
    return int(args[0]) if args else 0


def _oom(proc: FakeProcess, args: Sequence[str]) -> int:
    proc.oom_killed = True
    return KILLED_EXIT_CODE


BUILTINS: Mapping[str, Program] = {
    "echo": _echo(STDOUT), "echo-err": _echo(STDERR), "cat": _cat, "bytes": _bytes, "sleep": _sleep,
    "exit": _exit, "true": lambda proc, args: 0, "false": lambda proc, args: 1, "oom": _oom,
}


def _split_failure(argv: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """(the step a leading `fail-STEP` names, the command after it)."""
    if argv and argv[0].startswith("fail-") and argv[0][5:] in STEPS:
        return argv[0][5:], argv[1:]
    return "", argv


@dataclass
class _Sandbox:
    handle: SandboxHandle
    spec: FakeSpec
    fail_at: str  # cleared once it has fired
    process: FakeProcess | None = None
    deadline: threading.Timer | None = None


@dataclass
class _Injected:
    error: SandboxdError | None
    times: int


_DEFAULT_ERRORS: Mapping[str, type[SandboxdError]] = {
    "check": BackendUnavailable, "resolve_image": BackendUnavailable, "create": BackendUnavailable,
}


class FakeBackend:
    """An in-process Backend (see the module's docstring). Thread-safe."""

    def __init__(self, name: str = "fake", *, images: Mapping[str, tuple[str, ...]] | None = None,
                 deadline_slack_s: float | None = DEADLINE_SLACK_S):
        """`images`: reference -> every name the engine gives that image; None resolves
        every reference to itself. `deadline_slack_s` None: no deadline of the fake's own."""
        self.name = name
        self.available = True
        self.deadline_slack_s = deadline_slack_s
        self._images = None if images is None else dict(images)
        self._programs: dict[str, Program] = dict(BUILTINS)
        self._lock = threading.Lock()
        self._sandboxes: dict[str, _Sandbox] = {}
        self._injected: dict[str, list[_Injected]] = {}
        self._engine_ids = 0
        self.created = 0
        self.destroyed = 0
        self.history: list[tuple[str, str]] = []  # (verb, sandbox id), in order

    # -- what a test sets up and looks at -------------------------------------------
    def register(self, command: str, program: Program) -> None:
        """`program` runs every command whose argv[0] is `command`. It should sleep with
        FakeProcess.sleep (or watch `killed`): a kill ends the process at once, but its
        thread only when the program returns."""
        with self._lock:
            self._programs[command] = program

    def fail(self, step: Step, error: SandboxdError | None = None, times: int = 1) -> None:
        """The next `times` calls of `step` raise `error` (by default the error the real
        backends raise there: BackendUnavailable before a sandbox exists, else InternalError)."""
        if step not in STEPS:
            raise ValueError(f"no step {step!r}; one of {', '.join(STEPS)}")
        with self._lock:
            self._injected.setdefault(step, []).append(_Injected(error, times))

    @property
    def live(self) -> list[str]:
        """The sandboxes that exist now (created, not destroyed): empty when nothing leaked."""
        with self._lock:
            return sorted(self._sandboxes)

    def verbs(self, sandbox_id: str) -> list[str]:
        """The verbs the fake was told for one sandbox, in order."""
        with self._lock:
            return [verb for verb, sid in self.history if sid == sandbox_id]

    def has_sandbox(self, sandbox_id: str) -> bool:
        with self._lock:
            return sandbox_id in self._sandboxes

    def sandbox_pid(self, handle: SandboxHandle) -> int:
        """There is no host process to watch: 0, as a real backend says while there is none."""
        return 0

    def close(self) -> None:
        """Every sandbox still there is destroyed (the daemon is stopping)."""
        for sandbox_id in self.live:
            self._remove(sandbox_id)

    # -- the protocol -------------------------------------------------------------
    def check(self) -> None:
        self._raise_injected("check", "")
        if not self.available:
            raise BackendUnavailable(f"the {self.name} backend is switched off")

    def image_digest(self, image: str) -> str:
        return self.resolve_image(image)[0]

    def resolve_image(self, image: str) -> tuple[str, tuple[str, ...]]:
        self._raise_injected("resolve_image", "")
        names = (image,) if self._images is None else self._images.get(image)
        if names is None:
            raise FailedPrecondition(f"image {image!r} is not present in the local engine", field="runtime.image")
        return "sha256:" + hashlib.sha256(image.encode()).hexdigest(), tuple(names)

    def compile(self, policy: "EffectivePolicy", plan: "HostPlan", identity: SandboxIdentity, *,
                argv: tuple[str, ...], image: str, stdin_open: bool,
                attachments: Attachments | None = None) -> FakeSpec:
        self._raise_injected("compile", "")
        attachments = attachments or Attachments()
        require_egress(policy, attachments)
        fail_at, _ = _split_failure(tuple(argv))
        return FakeSpec(identity.daemon_id, identity.sandbox_id, identity.tool_call_id, tuple(argv), image,
                        f"{plan.uid}:{plan.gid}", policy.cwd, {**policy.env, **attachments.env()}, stdin_open,
                        policy.timeout_ms, policy.max_stdout_bytes, policy.max_stderr_bytes, plan.workspace,
                        attachments, fail_at)

    def create(self, spec: Any) -> SandboxHandle:
        if not isinstance(spec, FakeSpec):
            raise InternalError(f"the fake backend cannot create a {type(spec).__name__}")
        with ExitStack() as undo:  # a half-made sandbox is unmade: nothing is left of it
            with self._lock:
                if spec.sandbox_id in self._sandboxes:
                    raise InternalError(f"sandbox {spec.sandbox_id} already exists")
                self._engine_ids += 1
                handle = SandboxHandle(spec.sandbox_id, f"fake-{self._engine_ids}", spec)
                self._sandboxes[spec.sandbox_id] = _Sandbox(handle, spec, spec.fail_at)
                self.history.append(("create", spec.sandbox_id))
            undo.callback(self._forget, spec.sandbox_id)
            self._raise_injected("create", spec.sandbox_id)
            undo.pop_all()
        with self._lock:
            self.created += 1
        return handle

    def start(self, handle: SandboxHandle, sink: OutputSpool, stdin: bytes) -> None:
        box = self._sandbox(handle, "start")
        self._raise_injected("start", handle.sandbox_id)
        _, argv = _split_failure(box.spec.argv)
        proc = FakeProcess(argv, stdin if box.spec.stdin_open else b"", sink.write, handle.output_closed.set)
        with self._lock:
            if box.process is not None:
                raise InternalError(f"sandbox {handle.sandbox_id} was already started")
            box.process = proc
        control = box.spec.attachments.control_host_socket
        if control:  # a warm sandbox: a supervisor serves the daemon's commands, one at a time
            body: Callable[[], int] = functools.partial(supervise, proc, control, self.run)
        else:
            body = functools.partial(self.run, proc)
        handle.reader = threading.Thread(target=self._main, args=(proc, body), daemon=True,
                                         name=f"fake-{handle.sandbox_id}")
        if self.deadline_slack_s is not None:
            box.deadline = threading.Timer(box.spec.timeout_ms / 1000 + self.deadline_slack_s, self._deadline,
                                           args=(handle,))
            box.deadline.daemon = True
            box.deadline.start()
        handle.reader.start()

    def wait(self, handle: SandboxHandle, timeout_s: float) -> bool:
        return handle.output_closed.wait(max(0.0, timeout_s))

    def kill(self, handle: SandboxHandle) -> None:
        with self._lock:
            box = self._sandboxes.get(handle.sandbox_id)
            self.history.append(("kill", handle.sandbox_id))
        # Not started (or gone): nothing runs, nothing to kill, as with a real engine.
        if box is not None and box.process is not None:
            box.process.kill()

    def collect(self, handle: SandboxHandle) -> tuple[ExitStatus, ResourceUsage]:
        box = self._sandbox(handle, "collect")
        if box.process is None:
            raise InternalError(f"sandbox {handle.sandbox_id} was never started")
        handle.output_closed.wait(COLLECT_WAIT_S)
        status = box.process.status
        if status is None:
            raise InternalError(f"the command of {handle.sandbox_id} did not end")
        self._raise_injected("collect", handle.sandbox_id)
        return status, box.process.usage

    def destroy(self, handle: SandboxHandle) -> None:
        with self._lock:
            known = handle.sandbox_id in self._sandboxes
            self.history.append(("destroy", handle.sandbox_id))
        if known:  # idempotent: a second destroy finds nothing to do
            self._raise_injected("destroy", handle.sandbox_id)
            self._remove(handle.sandbox_id)

    def reap_orphans(self, daemon_id: str) -> int:
        with self._lock:
            mine = [sid for sid, box in self._sandboxes.items() if box.spec.daemon_id == daemon_id]
            self.history.extend(("reap", sid) for sid in mine)
        for sandbox_id in mine:
            self._remove(sandbox_id)
        return len(mine)

    # -- inside the fake ------------------------------------------------------------
    def run(self, proc: FakeProcess) -> int:
        """`proc`'s script, on the caller's thread: its exit code."""
        code = 0
        try:
            for command in _commands(proc.argv):
                with self._lock:
                    program = self._programs.get(command[0])
                if program is None:
                    proc.write(STDERR, f"fake: {command[0]}: command not found\n".encode())
                    code = NOT_FOUND_EXIT_CODE
                else:
                    code = program(proc, command[1:])
                if proc.killed.is_set():
                    return KILLED_EXIT_CODE
        except Exception as exc:  # a test's program failed: the command crashes, loudly
            log.exception("fake program %s raised", proc.argv)
            proc.write(STDERR, f"fake: program raised {type(exc).__name__}: {exc}\n".encode())
            code = CRASHED_EXIT_CODE
        return code

    @staticmethod
    def _main(proc: FakeProcess, body: Callable[[], int]) -> None:
        """The sandbox's thread: its process, then its end (unless a kill came first)."""
        code = CRASHED_EXIT_CODE
        try:
            code = body()
        finally:
            proc.end(code, oom_killed=proc.oom_killed)

    def _deadline(self, handle: SandboxHandle) -> None:
        with self._lock:
            box = self._sandboxes.get(handle.sandbox_id)
        if box is not None and box.process is not None and box.process.kill():
            with self._lock:
                self.history.append(("deadline", handle.sandbox_id))

    def _sandbox(self, handle: SandboxHandle, verb: str) -> _Sandbox:
        with self._lock:
            box = self._sandboxes.get(handle.sandbox_id)
            self.history.append((verb, handle.sandbox_id))
        if box is None:
            raise InternalError(f"sandbox {handle.sandbox_id} does not exist")
        return box

    def _raise_injected(self, step: str, sandbox_id: str) -> None:
        """Raises the failure injected at `step`: the backend's next one, else the sandbox's own."""
        with self._lock:
            queued = self._injected.get(step)
            box = self._sandboxes.get(sandbox_id)
            if queued:
                injected = queued[0]
                injected.times -= 1
                if injected.times <= 0:
                    queued.pop(0)
                error = injected.error
            elif box is not None and box.fail_at == step:
                box.fail_at = ""
                error = None
            else:
                return
        raise error or _DEFAULT_ERRORS.get(step, InternalError)(f"fake: {step} failed (injected)")

    def _forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._sandboxes.pop(sandbox_id, None)

    def _remove(self, sandbox_id: str) -> None:
        """The sandbox and its process are gone (counted once)."""
        with self._lock:
            box = self._sandboxes.pop(sandbox_id, None)
            if box is None:
                return
            self.destroyed += 1
        if box.deadline is not None:
            box.deadline.cancel()
        if box.process is not None:
            box.process.kill()


def _commands(argv: tuple[str, ...]) -> list[tuple[str, ...]]:
    """`A ; B` as [A, B] (empty commands dropped)."""
    out: list[tuple[str, ...]] = [()]
    for word in argv:
        if word == ";":
            out.append(())
        else:
            out[-1] += (word,)
    return [c for c in out if c]
