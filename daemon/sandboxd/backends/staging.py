"""Binds a call's workspace roots into a directory only the daemon can change, so that
the engine is never handed a path its owner could swap between the host checks and the
mount. preflight checked each root by its path; here each is opened again with
openat2 (beneath the workspace, no symlink anywhere, the workspace itself reached with no
symlink either), must still be the inode that was checked, and is bound from its
descriptor (`/proc/self/fd/N`) onto `<staging dir>/<n>`. Docker and nsjail mount those
staging paths: a rename or a symlink in the workspace no longer moves them.

The staging directory is root's, group the sandbox's gid, mode 0710: nsjail, which
mounts as the sandbox user, can traverse it; no other local user can (a read root of a
0700 workspace stays out of their reach)."""

from __future__ import annotations

import logging
import os
import stat

from sandboxd.sandbox.spec import StagedBind, StagedMask, Staging
from sandboxd.core.safe_open import AT_FDCWD, RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2
from sandboxd.core.errors import FailedPrecondition
from sandboxd.core.mounts import MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, MS_RDONLY, mount, unmount

log = logging.getLogger("sandboxd.staging")



def _same(fd: int, dev: int, ino: int) -> bool:
    st = os.fstat(fd)
    return st.st_dev == dev and st.st_ino == ino


def _changed(path: str) -> FailedPrecondition:
    return FailedPrecondition(f"{path} changed after it was checked (renamed, replaced or made a symlink); "
                              "nothing was mounted", field="workspace")


def _open_checked(dir_fd: int, path: str, resolve: int, dev: int, ino: int, shown: str) -> int:
    """`path` opened (O_PATH) with `resolve`, and still the inode (dev, ino) that was checked."""
    try:
        fd = openat2(dir_fd, path, resolve)
    except OSError:
        raise _changed(shown) from None
    if not _same(fd, dev, ino):
        os.close(fd)
        raise _changed(shown)
    return fd


def _open_workspace(staging: Staging) -> int:
    return _open_checked(AT_FDCWD, staging.workspace, RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
                         staging.workspace_dev, staging.workspace_ino, staging.workspace)


def _open_root(ws_fd: int, staging: Staging, bind: StagedBind) -> int:
    return _open_checked(ws_fd, os.path.relpath(bind.host_path, staging.workspace),
                         RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS, bind.dev, bind.ino, bind.host_path)


def _bind_mount(source_fd: int, target: str) -> None:
    mount(f"/proc/self/fd/{source_fd}", target, None, MS_BIND)
    # Private, before any mask goes on it: a bind of a shared mount (systemd makes / shared)
    # is the source's peer, and a mask placed on it would appear on the owner's own
    # workspace too, and stay there if the daemon died. (The target is the daemon's path.)
    mount(None, target, None, MS_PRIVATE)


def _place_mask(staging: Staging, mask: StagedMask) -> None:
    """Covers the blocked inode inside its staged root, reached with no symlink, by the
    same kind of mask the engine places (a read-only empty tmpfs, or the mask file). A
    mount point cannot be renamed: the owner can no longer move the blocked content
    out from under the mask before the engine mounts the root."""
    root = staging.binds[mask.bind_index]
    root_fd = os.open(root.staged_path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            fd = openat2(root_fd, mask.relative_path, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
        except OSError:
            raise _changed(os.path.join(root.host_path, mask.relative_path)) from None
    finally:
        os.close(root_fd)
    try:
        st = os.fstat(fd)
        where = os.path.join(root.host_path, mask.relative_path)
        if (st.st_dev, st.st_ino) != (mask.dev, mask.ino):
            raise _changed(where)
        if mask.kind == "file" and (not stat.S_ISREG(st.st_mode) or st.st_nlink > 1):
            raise FailedPrecondition(f"{where} was linked elsewhere after it was checked; nothing was mounted",
                                     field="policy.filesystem.blockedPaths")
        target = f"/proc/self/fd/{fd}"
        if mask.kind == "dir":
            mount("tmpfs", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0500")
        else:
            # The mask file is root's with mode 000: nothing a sandbox user can read or
            # write, so it needs no read-only remount (which could only name the new
            # mount by a path; the engine's own read-only mask goes on top as well).
            mount(staging.mask_file, target, None, MS_BIND)
    finally:
        os.close(fd)


def _make_directory(directory: str) -> None:
    parent = os.path.dirname(directory)
    os.makedirs(parent, mode=0o711, exist_ok=True)
    st = os.lstat(parent)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise FailedPrecondition(f"the staging directory {parent} is not the daemon's own")
    os.mkdir(directory, 0o700)  # a leftover of the same name is never reused; root's until all is mounted


def stage(staging: Staging) -> None:
    """Opens, checks and binds every root; on any failure nothing stays mounted."""
    _make_directory(staging.directory)
    try:
        ws_fd = _open_workspace(staging)
        try:
            for bind in staging.binds:
                fd = _open_root(ws_fd, staging, bind)
                try:
                    is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
                    if is_dir:
                        os.mkdir(bind.staged_path, 0o700)
                    else:
                        os.close(os.open(bind.staged_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC,
                                         0o600))
                    _bind_mount(fd, bind.staged_path)
                finally:
                    os.close(fd)
            for mask in staging.masks:
                _place_mask(staging, mask)
        finally:
            os.close(ws_fd)
        # Only now the sandbox user's, and searchable by it alone (nsjail mounts as that
        # user): every entry is a mount point, which it can neither rename nor remove,
        # and no other user, whatever groups it shares, can reach the roots through it.
        os.chown(staging.directory, staging.uid, -1)
        os.chmod(staging.directory, 0o100)
    except BaseException:
        release(staging.directory)
        raise


def release(directory: str) -> None:
    """Unmounts and removes a staging directory (which may be half made, or gone)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        target = os.path.join(directory, name)
        try:
            unmount(target)
            if os.path.isdir(target) and not os.path.islink(target):
                os.rmdir(target)
            else:
                os.unlink(target)
        except OSError as exc:
            log.error("could not remove the staged mount %s: %s", target, exc)
    try:
        os.rmdir(directory)
    except OSError as exc:
        log.error("could not remove the staging directory %s: %s", directory, exc)


def reap(root: str) -> int:
    """At start-up: every staging directory an earlier run of this daemon left."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return 0
    for name in names:
        release(os.path.join(root, name))
    return len(names)
