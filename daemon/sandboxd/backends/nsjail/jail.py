"""One jail as the backend holds it (its spec, descriptors, slot and process), and the
host paths it needs before nsjail is told of them: every bind source reachable by the
sandbox user, and the mount points made in the image's root filesystem."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
from dataclasses import dataclass, field

from sandboxd.backends.nsjail.compile import NsjailSpec
from sandboxd.backends.nsjail.host import unreachable_by
from sandboxd.backends.nsjail.slots import Early, Slot
from sandboxd.core.errors import FailedPrecondition
from sandboxd.policy.models import WORKSPACE, is_within


@dataclass
class Jail:
    spec: NsjailSpec
    config_fd: int  # -1 when the config goes to an early nsjail through its pipe
    log_fd: int
    slot: Slot | None = None
    early: Early | None = None
    proc: subprocess.Popen[bytes] | None = None
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def check_reachable(spec: NsjailSpec) -> None:
    """Refuses a bind source the sandbox user cannot reach: nsjail mounts as that user."""
    for m in spec.mounts:
        if not m.is_bind or m.src.startswith("/dev/"):
            continue
        blocked = unreachable_by(m.src, spec.uid, spec.gid)
        if blocked:
            where = "workspace" if is_within(m.dst, WORKSPACE) else None
            raise FailedPrecondition(
                f"{m.src} (for {m.dst}) is out of reach of the sandbox user {spec.uid}:{spec.gid}: {blocked} "
                "is not searchable by it, and nsjail mounts as that user", field=where)


def ensure_mount_points(spec: NsjailSpec) -> None:
    """Creates, in the image's root filesystem, the directories that mount points
    directly on it need (nsjail, as the sandbox user, cannot). Never follows a symlink
    of the image: such a mount point is refused."""
    targets = [m.dst for m in spec.mounts]
    for m in spec.mounts:
        if m.dst == "/" or m.is_symlink:
            continue
        parent = max((t for t in targets if t != m.dst and is_within(m.dst, t)), key=len)
        if parent != "/":
            continue
        where = "runtime.image" if m.dst in ("/proc", "/dev", "/workspace") else "policy.filesystem.tempDir"
        fd = os.open(spec.rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            parts = m.dst.strip("/").split("/")
            for i, part in enumerate(parts):
                try:
                    nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    if i != len(parts) - 1:
                        # The image root is shared by every later jail: at most the mount
                        # point itself is added to it, never a chain of a caller's names.
                        raise FailedPrecondition(f"{m.dst} cannot be mounted: /{'/'.join(parts[:i + 1])} does not "
                                                 "exist in the image", field=where) from None
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                    nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise FailedPrecondition(f"{m.dst} cannot be mounted: /{part} in the image is a symlink "
                                                 "or not a directory", field=where) from None
                    raise
                os.close(fd)
                fd = nfd
        finally:
            os.close(fd)
