"""The daemon's own host directories (state, runtime, secrets, egress sockets, ...),
checked and opened safely at start-up.

Another local user must never be able to plant one of them: a directory he made (under a
world-writable /tmp or /dev/shm) before the daemon started, or a symlink on the way to
it, would let him read or replace what the daemon puts there (the secrets it hands a
sandbox, the sockets it listens on). So each one is reached by an openat walk from /
that follows no symlink; every component must be root's (the directory itself the
daemon's) and writable by nobody else, except a sticky directory on the way (/tmp,
/dev/shm), whose entries others can neither rename nor remove, and whose next component
must then be root's too.
Anything else refuses the start-up, naming the setting and the reason: never a repair
of a place someone else may have filled already."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from sandboxd.core.errors import FailedPrecondition
from sandboxd.core.mounts import MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, mount, unmount

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
# Modes of the components the daemon creates on the way to one of its directories:
# they hold nothing but the next component.
_PARENT_MODE = 0o755
# The daemon's own tmpfs for secrets: a secret is at most 64 KiB (secrets.broker), so
# 64 MiB and 65,536 files is room for about a thousand; root's, traversable only.
SECRETS_TMPFS_OPTIONS = "mode=0711,uid=0,gid=0,size=64m,nr_inodes=65536"


def _open_root(text: str, setting: str) -> tuple[list[str], int, int]:
    """The path's components, the daemon's euid and a checked descriptor of "/": where
    both walks below begin."""
    parts = _components(text, setting)
    euid = os.geteuid()
    fd = os.open("/", _DIR_FLAGS)
    try:
        _check_component(os.fstat(fd), "/", euid, setting, text, final=False)
    except BaseException:
        os.close(fd)
        raise
    return parts, euid, fd


def ensure_private_dir(path: str | os.PathLike, mode: int, *, setting: str, set_mode: bool = True) -> int:
    """An open O_DIRECTORY descriptor of `path`, made (with missing parents) if need be.

    Refused (FailedPrecondition naming `setting`) when the path is relative or has a
    `..`, a component is a symlink or not a directory, a component is not the daemon's
    own, or one is writable by group or others (only a sticky parent may be, never the
    directory itself). A directory the daemon creates gets `mode`; an existing one gets
    it too when `set_mode` (the daemon's own, so only root chose its old mode). The
    caller keeps the descriptor: what it makes below goes through it, not the path."""
    text = os.fspath(path)
    parts, euid, fd = _open_root(text, setting)
    try:
        walked = ""
        for i, name in enumerate(parts):
            final = i == len(parts) - 1
            walked += "/" + name
            child, created = _open_or_make(fd, name, walked, mode if final else _PARENT_MODE, setting, text)
            os.close(fd)
            fd = child
            st = os.fstat(fd)
            if not created:
                _check_component(st, walked, euid, setting, text, final=final)
            if final and set_mode and not created and stat.S_IMODE(st.st_mode) != mode:
                os.fchmod(fd, mode)
        return fd
    except BaseException:
        os.close(fd)
        raise


def daemon_dirs(settings) -> list[tuple[str, Path, int, bool]]:
    """(setting name, path, mode, whether an existing one is re-moded) of every directory
    the daemon owns outside its state dir's children, the secrets dir aside (it is
    opened after them: open_secrets_dir)."""
    wanted: list[tuple[str, Path, int, bool]] = [
        ("state_dir", settings.state_dir, 0o700, True),
        # Traversable, not listable: nsjail binds what is in them as the sandbox user.
        ("runtime_dir", settings.runtime_dir, 0o711, True),
        # The public socket's directory may be a shared one (/run): checked, never re-moded.
        ("socket_path", settings.socket_path.parent, 0o755, False),
    ]
    if settings.egress.enabled:
        wanted.append(("egress.socket_dir", settings.egress.socket_dir, 0o711, True))
    if settings.nsjail.enabled:
        wanted.append(("nsjail.rootfs_dir", settings.nsjail.rootfs_dir, 0o755, True))
    return wanted


def check_daemon_dirs(settings) -> dict[str, int]:
    """Every directory the daemon owns outside its state dir's children, checked and
    opened: {setting name: descriptor}. The state dir's own children (spool, blobs, the
    relay's rpc dir) are safe through it (root's, 0700). On a refusal, the descriptors
    opened so far are closed."""
    out: dict[str, int] = {}
    try:
        for name, path, mode, set_mode in daemon_dirs(settings):
            out[name] = ensure_private_dir(path, mode, setting=name, set_mode=set_mode)
    except BaseException:
        for fd in out.values():
            os.close(fd)
        raise
    return out


def inspect_private_dir(path: str | os.PathLike, *, setting: str) -> str:
    """What ensure_private_dir would find, making and changing nothing (`sandboxd check`,
    and the start's look before it makes anything): "" when the directory is there and
    would be accepted as it is, else the first missing component (it, and what lies
    below it, would be made). Refused as ensure_private_dir refuses (FailedPrecondition
    naming `setting`); an existing directory's mode is not compared (it would be set)."""
    text = os.fspath(path)
    parts, euid, fd = _open_root(text, setting)
    try:
        walked = ""
        for i, name in enumerate(parts):
            walked += "/" + name
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                return walked
            except OSError as exc:
                raise _refusal(fd, name, walked, setting, text, exc) from None
            os.close(fd)
            fd = child
            _check_component(os.fstat(fd), walked, euid, setting, text, final=i == len(parts) - 1)
        return ""
    finally:
        os.close(fd)


def inspect_secrets_dir(path: Path, *, daemon_mounts: bool) -> str:
    """What open_secrets_dir would find, making and mounting nothing: as
    inspect_private_dir, and an operator's own directory (not `daemon_mounts`) must be on
    a memory filesystem already, or be made on one (its nearest existing parent's)."""
    missing = inspect_private_dir(path, setting="secrets_dir")
    if daemon_mounts:
        return missing
    existing = os.path.dirname(missing) if missing else os.fspath(path)
    fd = os.open(existing or "/", _DIR_FLAGS)
    try:
        require_memory_filesystem(fd, path, setting="secrets_dir")
    finally:
        os.close(fd)
    return missing


def open_secrets_dir(path: Path, *, daemon_mounts: bool) -> tuple[int, bool]:
    """The secrets directory, checked like the others and on a memory filesystem. When
    `daemon_mounts` (the default place, below the runtime dir), a directory on a disk
    gets a tmpfs of the daemon's own mounted on it: private (no propagation to other
    mount namespaces), nosuid, nodev, noexec and size-capped. One a killed run left there
    is wiped and unmounted first (secrets/broker.reap_left_tmpfs). An operator's own
    `secrets_dir` must already be on one; a directory on a disk is refused.
    Returns the descriptor and whether this call mounted the tmpfs."""
    fd = ensure_private_dir(path, 0o711, setting="secrets_dir")
    mounted = False
    try:
        if daemon_mounts and filesystem_type(fd) not in _MEMORY_FILESYSTEMS:
            mount("tmpfs", f"/proc/self/fd/{fd}", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, SECRETS_TMPFS_OPTIONS)
            mounted = True
            os.close(fd)
            fd = -1
            # The path again, now that the tmpfs covers it (the descriptor held the disk's
            # directory); the new descriptor names the tmpfs's root, a mount of its own.
            fd = ensure_private_dir(path, 0o711, setting="secrets_dir")
            mount(None, f"/proc/self/fd/{fd}", None, MS_PRIVATE)
        require_memory_filesystem(fd, path, setting="secrets_dir")
        return fd, mounted
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if mounted:
            unmount(os.fspath(path))
        raise


def filesystem_type(fd: int) -> str:
    """The type (tmpfs, ext4, ...) of the filesystem holding the open file `fd`: its
    mount id (fdinfo) looked up in this process's mount table."""
    mnt_id = ""
    with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "mnt_id":
                mnt_id = value.strip()
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] == mnt_id and "-" in fields:
                return fields[fields.index("-") + 1]
    return ""


def require_memory_filesystem(fd: int, path: str | os.PathLike, *, setting: str) -> None:
    """Refuses a directory whose files would land on a disk (secrets)."""
    kind = filesystem_type(fd)
    if kind not in _MEMORY_FILESYSTEMS:
        raise FailedPrecondition(f"{os.fspath(path)} is on {kind or 'an unknown filesystem'}, not a tmpfs: what "
                                 "the daemon writes there would land on a disk", field=setting)


def same_inode(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


# ---------------------------------------------------------------- the walk

def _components(text: str, setting: str) -> list[str]:
    if "\0" in text:
        raise FailedPrecondition("the path holds a NUL byte", field=setting)
    if not text.startswith("/"):
        raise FailedPrecondition(f"{text} must be an absolute path", field=setting)
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise FailedPrecondition(f"{text} must not contain '..'", field=setting)
    if not parts:
        raise FailedPrecondition("/ cannot be one of the daemon's own directories", field=setting)
    return parts


def _open_or_make(parent: int, name: str, walked: str, mode: int, setting: str, text: str) -> tuple[int, bool]:
    """(descriptor, whether the daemon created it) of `name` under `parent`."""
    for _ in range(3):  # made and removed under us by someone else: look again, a few times
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent), False
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _refusal(parent, name, walked, setting, text, exc) from None
        try:
            os.mkdir(name, 0o700, dir_fd=parent)  # nobody else's even for an instant
        except FileExistsError:
            continue  # someone else's, or a symlink, planted just now: the open says which
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            raise _refusal(parent, name, walked, setting, text, exc) from None
        try:
            st = os.fstat(fd)
            # Made by the daemon (its own, 0700) in a parent others cannot rename in:
            # anything else means the parent was not what it was checked to be.
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
                raise FailedPrecondition(f"{walked} (on the way to {text}) changed while the daemon made it",
                                         field=setting)
            os.fchmod(fd, mode)  # the umask never decides
        except BaseException:
            os.close(fd)
            raise
        return fd, True
    raise FailedPrecondition(f"{walked} (on the way to {text}) keeps appearing and disappearing", field=setting)


def _refusal(parent: int, name: str, walked: str, setting: str, text: str, exc: OSError) -> FailedPrecondition:
    where = walked if walked == text.rstrip("/") else f"{walked} (on the way to {text})"
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        reason = "is a symbolic link (the daemon follows none to its own directories)"
    elif (st is not None and not stat.S_ISDIR(st.st_mode)) or exc.errno == errno.ENOTDIR:
        reason = "is not a directory"
    else:
        reason = f"cannot be opened ({os.strerror(exc.errno or 0)})"
    return FailedPrecondition(f"{where} {reason}", field=setting)


def _check_component(st: os.stat_result, walked: str, euid: int, setting: str, text: str, *, final: bool) -> None:
    where = walked if final else f"{walked} (on the way to {text})"
    if not stat.S_ISDIR(st.st_mode):
        raise FailedPrecondition(f"{where} is not a directory", field=setting)
    # Root's components are trusted on the way (a daemon not running as root still
    # lives below /); the directory itself must be the daemon's.
    if st.st_uid != euid and (final or st.st_uid != 0):
        raise FailedPrecondition(f"{where} is owned by uid {st.st_uid}, not by the daemon (uid {euid}): another "
                                 "user made it, or can replace what is in it", field=setting)
    loose = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if loose and (final or not st.st_mode & stat.S_ISVTX):
        raise FailedPrecondition(f"{where} has mode {stat.S_IMODE(st.st_mode):04o}: writable by "
                                 f"{'group' if loose & stat.S_IWGRP else 'others'}, who could replace what "
                                 "the daemon puts there", field=setting)
