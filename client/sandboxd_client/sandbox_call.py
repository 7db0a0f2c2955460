"""What a Sandbox sends: its settings checked once (SandboxSettings), and each command
made into a PreparedToolCall in its JSON form for the sandbox's lease (command_call),
its arguments checked before anything is sent. Pure: no RPC here.

A lease's sandbox is fixed by its policy minus the parts each command brings (cwd, env,
timeout, output caps, recording): so a command's call carries the sandbox's policy
unchanged but for those, or the daemon would refuse it as another sandbox's."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from sandboxd_contract.pb import sandboxd_pb2 as pb

ADAPTERS = ("", "docker", "nsjail")
DEFAULT_TOOL_ID = "sandboxd.sandbox"
# How long a Sandbox waits for its sandbox by default: for room in a full pool (the
# daemon waits), and for a workspace another sandbox that may write it still holds (the
# client retries: a lease just released holds it until its sandbox is gone).
DEFAULT_WAIT_MS = 30_000
# Between two tries of an acquire the daemon answered ABORTED: doubling, up to the last.
RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.4, 0.5)
# Makes a call's `authorization` (a signed grant, for a daemon with approval keys) from
# the call's JSON form; without it the call says "not_required".
Authorizer = Callable[[dict[str, Any]], dict[str, Any]]


def _policy_json(policy: Mapping[str, Any] | pb.SandboxPolicy | None) -> dict[str, Any] | None:
    """The policy as a JSON form the client owns (a copy: the caller's dict may change)."""
    if policy is None:
        return None
    if isinstance(policy, pb.SandboxPolicy):
        return json_format.MessageToDict(policy)
    if not isinstance(policy, Mapping):
        raise TypeError(f"policy: a mapping of the SandboxPolicy's JSON form (camelCase), not {type(policy).__name__}")
    return copy.deepcopy(dict(policy))


@dataclass(frozen=True)
class SandboxSettings:
    """Where and how a Sandbox's commands run: the same for its lease and each command."""

    workspace: str
    policy: dict[str, Any] | None = None
    image: str = ""
    adapter: str = ""
    lease_ms: int = 0
    wait_ms: int = DEFAULT_WAIT_MS
    tool_id: str = DEFAULT_TOOL_ID
    session_id: str = ""
    authorize: Authorizer | None = field(default=None, compare=False)

    @classmethod
    def checked(cls, workspace: str | os.PathLike[str], policy: Mapping[str, Any] | pb.SandboxPolicy | None = None,
                **options: Any) -> "SandboxSettings":
        """Settings from a Sandbox's arguments; raises ValueError/TypeError naming the
        argument (the daemon checks the rest, naming the field)."""
        workspace = os.fspath(workspace)
        if not isinstance(workspace, str) or not workspace:
            raise ValueError("workspace: a directory path of the daemon's host is needed")
        settings = cls(workspace, _policy_json(policy), **options)
        if settings.adapter not in ADAPTERS:
            raise ValueError(f"adapter: {settings.adapter!r} is not one of docker, nsjail (or empty: the daemon's default)")
        for name in ("lease_ms", "wait_ms"):
            value = getattr(settings, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: a whole number of milliseconds, 0 or more (0: the daemon's default), "
                                 f"not {value!r}")
        if not settings.tool_id:
            raise ValueError("tool_id: must not be empty")
        return settings


class AcquireWait:
    """The wait of one acquire: what is left of `wait_ms` for the daemon, and the delay
    before the next try after an ABORTED answer (None once the wait is over)."""

    def __init__(self, wait_ms: int, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._deadline = clock() + wait_ms / 1000
        self._tries = 0

    def remaining_ms(self) -> int:
        return max(0, int((self._deadline - self._clock()) * 1000))

    def next_delay(self) -> float | None:
        """The last delay ends at the deadline: the last try is made when the wait ends."""
        left = self._deadline - self._clock()
        if left <= 0:
            return None
        delay = min(RETRY_DELAYS_S[min(self._tries, len(RETRY_DELAYS_S) - 1)], left)
        self._tries += 1
        return delay


def checked_argv(argv: Sequence[str]) -> list[str]:
    """argv as a list of strings: a command is never one shell string (give
    ["sh", "-c", script] for a shell)."""
    if isinstance(argv, (str, bytes)):
        raise TypeError(f"argv: a list of strings, not one string; to run a shell line give ['sh', '-c', {argv!r}]")
    out = list(argv)
    if not out:
        raise ValueError("argv: empty; name the program to run")
    for i, arg in enumerate(out):
        if not isinstance(arg, str):
            raise TypeError(f"argv[{i}]: a string, not {type(arg).__name__}")
        if "\x00" in arg:
            raise ValueError(f"argv[{i}]: contains a NUL byte")
    if not out[0]:
        raise ValueError("argv[0]: empty; name the program to run")
    return out


def _checked_env(env: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(env, Mapping):
        raise TypeError(f"env: a mapping of names to values, not {type(env).__name__}")
    out = {}
    for name, value in env.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"env[{name!r}]: names and values are strings")
        out[name] = value  # the daemon checks names and values, naming the variable
    return out


def _checked_positive(name: str, value: int | None, unit: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name}: a whole number of {unit} above 0, not {value!r}")
    return value


def _stdin_bytes(stdin: bytes | bytearray | str | None) -> bytes | None:
    if stdin is None or isinstance(stdin, bytes):
        return stdin
    if isinstance(stdin, bytearray):
        return bytes(stdin)
    if isinstance(stdin, str):
        return stdin.encode("utf-8")
    raise TypeError(f"stdin: bytes or str, not {type(stdin).__name__}")


def command_policy(base: dict[str, Any] | None, *, timeout_ms: int | None = None, env: Mapping[str, str] | None = None,
                   max_stdout_bytes: int | None = None) -> dict[str, Any] | None:
    """The sandbox's policy with one command's own parts set (a new dict)."""
    if timeout_ms is None and not env and max_stdout_bytes is None:
        return base
    policy = copy.deepcopy(base) if base is not None else {}
    if timeout_ms is not None or max_stdout_bytes is not None:
        process = policy.setdefault("process", {})
        if timeout_ms is not None:
            process["timeoutMs"] = timeout_ms
        if max_stdout_bytes is not None:
            process["maxStdoutBytes"] = max_stdout_bytes
    if env:
        environment = policy.setdefault("environment", {})
        environment["injectedEnv"] = {**(environment.get("injectedEnv") or {}), **env}
    return policy


def command_call(settings: SandboxSettings, lease_id: str, argv: Sequence[str], *, cwd: str | None = None,
                 timeout_ms: int | None = None, stdin: bytes | bytearray | str | None = None,
                 env: Mapping[str, str] | None = None, max_stdout_bytes: int | None = None) -> dict[str, Any]:
    """One command's PreparedToolCall (JSON form) in the lease `lease_id`."""
    argv = checked_argv(argv)
    if cwd is not None and (not isinstance(cwd, str) or not cwd):
        raise ValueError(f"cwd: a sandbox path (/workspace/...), not {cwd!r}")
    policy = command_policy(settings.policy, timeout_ms=_checked_positive("timeout_ms", timeout_ms, "milliseconds"),
                            env=_checked_env(env or {}),
                            max_stdout_bytes=_checked_positive("max_stdout_bytes", max_stdout_bytes, "bytes"))
    call: dict[str, Any] = {"toolId": settings.tool_id, "argv": argv, "workspace": settings.workspace,
                            "runtime": {"image": settings.image, "adapter": settings.adapter, "leaseId": lease_id}}
    if settings.session_id:
        call["sessionId"] = settings.session_id
    if policy is not None:
        call["policy"] = policy
    if cwd is not None:
        call["cwd"] = cwd
    data = _stdin_bytes(stdin)
    if data:
        call["stdin"] = data
    call["authorization"] = settings.authorize(copy.deepcopy(call)) if settings.authorize else {"status": "not_required"}
    return call
