"""The credential broker: a call names binding ids, never secrets. The daemon's config
binds each id to a source (a file only the daemon can read, a variable of the daemon's
own environment, or a command that prints the secret) and says which principals and
tools may use it. At admission the broker checks every reference and resolves the
values; just before the sandbox is created it writes them to files on the daemon's
tmpfs, which the sandbox gets as read-only binds (a file target) or which the shim reads
into the environment (an env target). No value is ever in a spec, an event, a log line
or the engine's container config; the output redactor gets them to strike from output."""

from __future__ import annotations

import fnmatch
import os
import posixpath
import re
import shutil
import stat
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .compile import SECRETS_DIR, SecretMount
from .errors import FailedPrecondition, InvalidArgument, PermissionDenied
from .policy import EffectivePolicy, PreparedToolCall, is_within
from .settings import CredentialBinding

MAX_SECRET_BYTES = 64 * 1024
COMMAND_TIMEOUT_S = 10.0
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class ResolvedSecret:
    binding_id: str
    value: bytes
    env_name: str = ""
    file_path: str = ""

    def __repr__(self) -> str:  # never the value, not even in a traceback
        return f"ResolvedSecret({self.binding_id!r}, env={self.env_name!r}, file={self.file_path!r})"

    @property
    def target(self) -> dict[str, str]:
        return {"env": self.env_name} if self.env_name else {"file": self.file_path}


class CredentialBroker:
    def __init__(self, bindings: Mapping[str, CredentialBinding], secrets_dir: Path,
                 environment: Mapping[str, str] | None = None):
        self._bindings = dict(bindings)
        self._dir = secrets_dir
        # The daemon's environment as it started: an env source reads from here only.
        self._environment = dict(os.environ if environment is None else environment)

    # -- admission ------------------------------------------------------------------
    def resolve(self, call: PreparedToolCall, policy: EffectivePolicy, principal: str) -> tuple[ResolvedSecret, ...]:
        """Checks every credential reference of `call` and reads the values. Refusals
        name the reference's field; an unknown binding and one this principal or tool
        may not use read the same (no oracle for which ids exist)."""
        out: list[ResolvedSecret] = []
        targets: set[str] = set()
        for i, ref in enumerate(call.credential_refs):
            where = f"credentialRefs[{i}]"
            binding = self._bindings.get(ref.binding_id)
            if (binding is None or principal not in binding.principals
                    or not any(fnmatch.fnmatchcase(call.tool_id, p) for p in binding.tools)):
                raise PermissionDenied(f"credential {ref.binding_id!r} is not available to {principal} for tool "
                                       f"{call.tool_id!r}", field=f"{where}.bindingId")
            if bool(ref.env_name) == bool(ref.file_path):
                raise InvalidArgument("exactly one of envName and filePath", field=where)
            if ref.env_name:
                if not _ENV_NAME_RE.fullmatch(ref.env_name):
                    raise InvalidArgument(f"{ref.env_name!r} is not a valid variable name", field=f"{where}.envName")
                if not call.policy.environment.secret_env_allowed:
                    raise PermissionDenied("secretEnvAllowed is false: no credential may become an environment "
                                           "variable", field=f"{where}.envName")
                if ref.env_name in policy.env:
                    raise InvalidArgument(f"{ref.env_name} is also set by the policy's environment",
                                          field=f"{where}.envName")
                target = "env:" + ref.env_name
            else:
                path = posixpath.normpath(ref.file_path)
                if not ref.file_path.startswith("/") or path != ref.file_path.rstrip("/") or path == policy.temp_dir \
                        or not is_within(path, policy.temp_dir):
                    raise InvalidArgument(f"a credential file goes on the sandbox's tmpfs: an absolute path inside "
                                          f"{policy.temp_dir}", field=f"{where}.filePath")
                if any(is_within(path, b) for b in policy.blocked_paths):
                    raise InvalidArgument(f"{path} is a blocked path", field=f"{where}.filePath")
                target = "file:" + path
            if target in targets:
                raise InvalidArgument("two credentials for the same target", field=where)
            targets.add(target)
            value = self._read(ref.binding_id, binding, where)
            if ref.env_name and b"\0" in value:
                raise FailedPrecondition(f"credential {ref.binding_id!r} holds a NUL byte: it cannot be an "
                                         "environment variable", field=f"{where}.envName")
            out.append(ResolvedSecret(ref.binding_id, value, ref.env_name, ref.file_path and path))
        return tuple(out)

    def _read(self, binding_id: str, binding: CredentialBinding, where: str) -> bytes:
        field = f"{where}.bindingId"
        if binding.file is not None:
            try:
                st = os.stat(binding.file)
            except OSError:
                raise FailedPrecondition(f"credential {binding_id!r}: its file is missing", field=field) from None
            if not stat.S_ISREG(st.st_mode):
                raise FailedPrecondition(f"credential {binding_id!r}: its source is not a regular file", field=field)
            if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise FailedPrecondition(f"credential {binding_id!r}: its file must be the daemon's own and "
                                         "readable by nobody else (mode 0600 or stricter)", field=field)
            with open(binding.file, "rb") as f:
                value = f.read(MAX_SECRET_BYTES + 3)
        elif binding.env is not None:
            if binding.env not in self._environment:
                raise FailedPrecondition(f"credential {binding_id!r}: the daemon's environment has no "
                                         f"{binding.env}", field=field)
            value = os.fsencode(self._environment[binding.env])
        else:
            assert binding.command is not None
            failed = ""
            try:
                done = subprocess.run(list(binding.command), capture_output=True, timeout=COMMAND_TIMEOUT_S,
                                      stdin=subprocess.DEVNULL, check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                failed = type(exc).__name__  # the exception holds partial output: it is not kept
            if failed:
                raise FailedPrecondition(f"credential {binding_id!r}: its command failed to run ({failed})",
                                         field=field)
            if done.returncode != 0:
                # Never its output: that could be the secret.
                raise FailedPrecondition(f"credential {binding_id!r}: its command exited with {done.returncode}",
                                         field=field)
            value = done.stdout
        if len(value) > MAX_SECRET_BYTES + 2:  # checked before a newline could hide the excess
            raise FailedPrecondition(f"credential {binding_id!r} is larger than {MAX_SECRET_BYTES} bytes", field=field)
        if value.endswith(b"\r\n"):
            value = value[:-2]
        elif value.endswith(b"\n"):
            value = value[:-1]
        if not value:
            raise FailedPrecondition(f"credential {binding_id!r} is empty", field=field)
        if len(value) > MAX_SECRET_BYTES:
            raise FailedPrecondition(f"credential {binding_id!r} is larger than {MAX_SECRET_BYTES} bytes", field=field)
        return value

    # -- the sandbox's files ----------------------------------------------------------
    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self._dir / sandbox_id

    def mounts(self, sandbox_id: str, secrets: tuple[ResolvedSecret, ...]) -> tuple[SecretMount, ...]:
        """Where each secret will be: pure, so the spec can be compiled before any file exists."""
        base = self.sandbox_dir(sandbox_id)
        return tuple(SecretMount(s.binding_id, str(base / str(i)),
                                 f"{SECRETS_DIR}/{i}" if s.env_name else s.file_path, s.env_name)
                     for i, s in enumerate(secrets))

    def materialize(self, sandbox_id: str, secrets: tuple[ResolvedSecret, ...], uid: int, gid: int) -> None:
        """Writes the files `mounts` promised: readable by the sandbox's user only."""
        self._dir.mkdir(parents=True, exist_ok=True, mode=0o711)
        os.chmod(self._dir, 0o711)
        base = self.sandbox_dir(sandbox_id)
        base.mkdir(mode=0o711)
        os.chmod(base, 0o711)  # whatever the daemon's umask: the sandbox user must traverse it
        for i, s in enumerate(secrets):
            path = base / str(i)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
            try:
                os.write(fd, s.value)
                os.fchown(fd, uid, gid)
            finally:
                os.close(fd)

    def release(self, sandbox_id: str) -> None:
        shutil.rmtree(self.sandbox_dir(sandbox_id), ignore_errors=True)

    def purge(self) -> None:
        """At start-up: whatever a crashed run left behind."""
        if self._dir.is_dir():
            for child in self._dir.iterdir():
                shutil.rmtree(child, ignore_errors=True)
