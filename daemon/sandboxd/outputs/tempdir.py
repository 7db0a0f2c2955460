"""persistOutputs: a call that keeps its tempDir gets a tmpfs the daemon mounts
(`<runtime>/outputs/<sandbox id>`, the policy's size, the sandbox user's, nosuid, nodev,
noexec, as the engines' own tmpfs) and binds there instead of the engine's, so that
what the call left in it is still there after the sandbox is gone: walked, kept as
`file` artifacts, then unmounted. Its pages are charged to the sandbox's memory cgroup
as the engines' tmpfs pages are (to the process that first writes them)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from sandboxd.core.errors import FailedPrecondition
from sandboxd.core.mounts import MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, mount, unmount
from sandboxd.recording import snapshot
from sandboxd.recording.changes import ChangedFile

log = logging.getLogger("sandboxd.outputs.tempdir")
OUTPUTS_SUBDIR = "outputs"


def outputs_dir(runtime_dir: Path, sandbox_id: str) -> str:
    return str(runtime_dir / OUTPUTS_SUBDIR / sandbox_id)


def make(path: str, size_bytes: int, uid: int, gid: int) -> None:
    """The tmpfs, mounted at `path` (a new directory in the daemon's own 0711 parent)."""
    parent = os.path.dirname(path)
    os.makedirs(parent, mode=0o711, exist_ok=True)
    st = os.lstat(parent)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise FailedPrecondition(f"the outputs directory {parent} is not the daemon's own")
    os.mkdir(path, 0o700)
    try:
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
              f"size={size_bytes},mode=0700,uid={uid},gid={gid}")
    except BaseException:
        os.rmdir(path)
        raise
    try:
        # Private: under a shared mount (systemd makes / shared) it would be a peer group
        # of its own, and a mount made on it (the engine's bind) could show elsewhere.
        mount(None, path, None, MS_PRIVATE)
    except BaseException:
        release(path)
        raise


def release(path: str) -> None:
    """Unmounts and removes it (half made or gone: nothing to do)."""
    try:
        unmount(path)
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.error("could not remove the outputs tmpfs %s: %s", path, exc)


def reap(runtime_dir: Path) -> int:
    """At start-up: the outputs tmpfs an earlier run of the daemon left."""
    root = runtime_dir / OUTPUTS_SUBDIR
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return 0
    for name in names:
        release(str(root / name))
    return len(names)


def kept_files(temp_dir: str, path: str) -> tuple[list[ChangedFile], list[str]]:
    """Every regular file the call left in its tempDir, as created files (sandbox paths),
    and why the list may not be whole."""
    walked = snapshot.take([(temp_dir, path)], snapshot.HashCache())
    files = [ChangedFile(p, "created", e.mode, e.size, "", e.sha256,
                         found_as=(e.dev, e.inode, e.ctime_ns) if e.dev and e.inode and e.ctime_ns else ())
             for p, e in sorted(walked.entries.items()) if e.regular]
    return files, [f"persistOutputs: {gap}" for gap in walked.gaps]
