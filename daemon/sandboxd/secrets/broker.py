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
import logging
import os
import posixpath
import re
import stat
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sandboxd.sandbox.spec import SECRETS_DIR, SecretMount
from sandboxd.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from sandboxd.core import hostdirs
from sandboxd.core.hostdirs import ensure_private_dir, require_memory_filesystem, same_inode
from sandboxd.core.mounts import unmount
from sandboxd.core.safe_open import UnsafeFile, open_setting_file, read_fd
from sandboxd.policy.models import EffectivePolicy, PreparedToolCall, is_within
from sandboxd.core.settings import CredentialBinding

log = logging.getLogger(__name__)
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
                 environment: Mapping[str, str] | None = None, *, dir_fd: int | None = None,
                 require_memory_fs: bool = False):
        """`dir_fd`: the secrets dir as hostdirs.check_daemon_dirs opened it (the broker
        keeps it); without it the broker checks and opens the dir itself, so a planted
        one refuses the daemon's start-up. `require_memory_fs`: refuse a dir whose files
        would land on a disk."""
        self._bindings = dict(bindings)
        self._dir = Path(secrets_dir)
        self._fd = ensure_private_dir(self._dir, 0o711, setting="secrets_dir") if dir_fd is None else dir_fd
        if require_memory_fs:
            try:
                require_memory_filesystem(self._fd, self._dir, setting="secrets_dir")
            except BaseException:
                self.close()
                raise
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
            # Opened once, no symlink followed, never blocking on a FIFO; checked and read
            # through that descriptor (a stat by name, then an open, could meet two files).
            # The caller is told why without the file's path.
            try:
                fd, _st = open_setting_file(binding.file, setting=f"credentials.{binding_id}.file", private=True)
            except UnsafeFile as exc:
                raise FailedPrecondition(f"credential {binding_id!r}: its file {exc.problem}", field=field) from None
            try:
                value = read_fd(fd, MAX_SECRET_BYTES + 3)
            except OSError as exc:
                raise FailedPrecondition(f"credential {binding_id!r}: its file cannot be read ({exc.strerror})",
                                         field=field) from None
            finally:
                os.close(fd)
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
    # Everything below goes through the secrets dir's descriptor, which the broker holds
    # from start-up (checked by hostdirs: root's, 0711, no symlink on the way). Only the
    # engines get paths (SecretMount.host_path): safe because nobody but root can write
    # in the secrets dir or in a sandbox's directory, so no name there can be swapped.
    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self._dir / _checked_name(sandbox_id)

    def mounts(self, sandbox_id: str, secrets: tuple[ResolvedSecret, ...]) -> tuple[SecretMount, ...]:
        """Where each secret will be: pure, so the spec can be compiled before any file exists."""
        base = self.sandbox_dir(sandbox_id)
        return tuple(SecretMount(s.binding_id, str(base / str(i)),
                                 f"{SECRETS_DIR}/{i}" if s.env_name else s.file_path, s.env_name)
                     for i, s in enumerate(secrets))

    def materialize(self, sandbox_id: str, secrets: tuple[ResolvedSecret, ...], uid: int, gid: int) -> None:
        """Writes the files `mounts` promised: readable by the sandbox's user only. On any
        failure nothing of them is left."""
        name = _checked_name(sandbox_id)
        self._check_dir_still_named()
        os.mkdir(name, 0o700, dir_fd=self._fd)  # an existing one (even ours) is never reused
        try:
            sfd = os.open(name, _DIR_FLAGS, dir_fd=self._fd)
        except BaseException:
            _remove_logged(self._fd, name, sandbox_id)
            raise
        try:
            held = os.fstat(sfd)
            if held.st_uid != os.geteuid() or stat.S_IMODE(held.st_mode) != 0o700:
                # Not what was just made: never written to, nor emptied (not ours).
                raise FailedPrecondition(f"the secrets directory of {sandbox_id} was replaced while it was made")
            try:
                for i, s in enumerate(secrets):
                    _write_secret(sfd, str(i), s.value, uid, gid)
                os.fchmod(sfd, 0o711)  # traversable only once complete, whatever the umask
                # The engines bind by path: that path must still name the directory written.
                if not same_inode(os.stat(name, dir_fd=self._fd, follow_symlinks=False), held):
                    raise FailedPrecondition(f"the secrets directory of {sandbox_id} was replaced while it was "
                                             "written")
            except BaseException:
                _empty_dir(sfd, sandbox_id)
                _remove_if_same(self._fd, name, held, sandbox_id)
                raise
        finally:
            os.close(sfd)

    def release(self, sandbox_id: str) -> None:
        """Removes (first truncates) the sandbox's secret files: logs, never raises."""
        try:
            name = _checked_name(sandbox_id)
        except ValueError as exc:
            log.error("not removing secrets: %s", exc)
            return
        _remove_logged(self._fd, name, sandbox_id)

    def purge(self) -> None:
        """At start-up: whatever a crashed run left behind."""
        try:
            names = os.listdir(self._fd)
        except OSError as exc:
            log.error("cannot list the secrets dir %s: %s", self._dir, exc.strerror)
            return
        for name in names:
            _remove_logged(self._fd, name, name)
        if names:
            log.warning("removed the secrets of %d sandboxes an earlier run left", len(names))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _check_dir_still_named(self) -> None:
        try:
            named = os.stat(self._dir, follow_symlinks=False)
        except OSError:
            named = None
        if named is None or not same_inode(named, os.fstat(self._fd)):
            raise FailedPrecondition(f"the secrets dir {self._dir} was removed or replaced since the daemon started")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Tmpfs stacked on the secrets dir by earlier runs (each killed, each started again on
# code that kept the one it found): more than this is no daemon's doing.
_MAX_LEFT_MOUNTS = 16


def reap_left_tmpfs(secrets_dir: Path) -> int:
    """At start, before the secrets dir is opened (hostdirs.open_secrets_dir), where the
    daemon mounts its own tmpfs: each tmpfs a killed run left mounted there, its files
    wiped first (truncated: a descriptor or a sandbox's bind that still holds one finds
    nothing in it) and then unmounted, so the start mounts a new one, its own, which its
    stop unmounts. (Kept, a killed run's tmpfs was no run's to unmount: it outlived every
    later clean stop.) The path is walked as hostdirs walks it: a planted or symlinked
    component refuses the start. Returns how many were unmounted."""
    reaped = 0
    while hostdirs.inspect_private_dir(secrets_dir, setting="secrets_dir") == "":
        fd = ensure_private_dir(secrets_dir, 0o711, setting="secrets_dir", set_mode=False)
        try:
            if not _is_tmpfs_mount_root(fd):
                break
            if reaped == _MAX_LEFT_MOUNTS:
                raise FailedPrecondition(f"{secrets_dir} has more than {_MAX_LEFT_MOUNTS} tmpfs mounted on it: "
                                         "unmount them by hand", field="secrets_dir")
            _empty_dir(fd, "a killed run")
        finally:
            os.close(fd)
        unmount(str(secrets_dir))  # never through a symlink; the walk above found none
        reaped += 1
    if reaped:
        log.warning("unmounted the secrets tmpfs a killed run left at %s (its files wiped first)", secrets_dir)
    return reaped


def _is_tmpfs_mount_root(fd: int) -> bool:
    """Whether the directory `fd` is the root of a tmpfs mounted on its name: on another
    device than its parent ("..", which at a mount's root is the mount point's parent)."""
    if hostdirs.filesystem_type(fd) != "tmpfs":
        return False
    parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
    try:
        return os.fstat(parent).st_dev != os.fstat(fd).st_dev
    finally:
        os.close(parent)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _checked_name(sandbox_id: str) -> str:
    if not _NAME_RE.fullmatch(sandbox_id) or sandbox_id in (".", ".."):
        raise ValueError(f"{sandbox_id!r} is not a sandbox id")
    return sandbox_id


def _write_secret(dir_fd: int, name: str, value: bytes, uid: int, gid: int) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400, dir_fd=dir_fd)
    try:
        view = memoryview(value)
        while view:
            view = view[os.write(fd, view):]
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o400)
    finally:
        os.close(fd)


def _wipe(dir_fd: int, name: str) -> None:
    """Truncates a secret file before it is unlinked: a descriptor or a bind mount that
    still holds its inode then finds nothing in it."""
    fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def _remove(dir_fd: int, name: str, errors: list[str]) -> None:
    """Removes `name` under `dir_fd`, a directory tree through descriptors only (never a
    path someone could swap), wiping each regular file first; what fails is noted."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError as exc:
        errors.append(f"{name}: {exc.strerror}")
        return
    try:
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                for child in os.listdir(fd):
                    _remove(fd, child, errors)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=dir_fd)
            return
        if stat.S_ISREG(st.st_mode):
            _wipe(dir_fd, name)
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        errors.append(f"{name}: {exc.strerror}")


def _remove_logged(dir_fd: int, name: str, sandbox_id: str) -> None:
    errors: list[str] = []
    _remove(dir_fd, name, errors)
    if errors:
        log.error("removing the secrets of %s failed: %s", sandbox_id, "; ".join(errors[:5]))


def _empty_dir(fd: int, sandbox_id: str) -> None:
    """Everything in the directory `fd` holds (which its name may no longer reach)."""
    errors: list[str] = []
    try:
        names = os.listdir(fd)
    except OSError as exc:
        names, errors = [], [exc.strerror or "cannot list"]
    for child in names:
        _remove(fd, child, errors)
    if errors:
        log.error("removing the secrets of %s failed: %s", sandbox_id, "; ".join(errors[:5]))


def _remove_if_same(dir_fd: int, name: str, held: os.stat_result, sandbox_id: str) -> None:
    """Removes the (emptied) directory `name` if it is still the one the daemon made."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if same_inode(st, held):
            os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.error("removing the secrets directory of %s failed: %s", sandbox_id, exc.strerror)
