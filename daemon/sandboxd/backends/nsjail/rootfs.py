"""The root filesystems jails run in: each image's filesystem exported once from dockerd
(the same image the Docker backend runs) into <rootfs_dir>/<image id>/, indexed by the
names dockerd gives it (images.json), so that an export serves, and is allowlisted,
while dockerd is away; exports of images the engine no longer has are pruned."""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import re
import secrets
import shutil
import tarfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sandboxd.backends.docker.errors import dockerd
from sandboxd.backends.nsjail.errors import host_step
from sandboxd.core.errors import BackendUnavailable, FailedPrecondition, SandboxdError
from sandboxd.sandbox.spec import LABEL_PREFIX

log = logging.getLogger("sandboxd.nsjail")
_HOSTS = ("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nfe00::0\tip6-localnet\n"
          "ff00::0\tip6-mcastprefix\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n")


class ImageExports:
    """The exported root filesystems under one directory, and what each image name
    resolved to lately (for `ttl_s`: a call does not ask dockerd every time)."""

    def __init__(self, rootfs_dir: Path, docker_host: str | None, ttl_s: float):
        self._rootfs_dir = rootfs_dir
        self._docker_host = docker_host
        self._ttl_s = ttl_s
        self._api: Any = None
        self._export_lock = threading.Lock()
        # image -> (id, rootfs, resolved at, the names dockerd gives it)
        self._images: dict[str, tuple[str, str, float, tuple[str, ...]]] = {}

    def _docker(self) -> Any:
        if self._api is None:
            import docker  # heavy; only to export an image

            with dockerd("export image root filesystems", refusal=BackendUnavailable):
                self._api = docker.APIClient(base_url=self._docker_host or "unix:///var/run/docker.sock",
                                             version="auto", timeout=120)
        return self._api

    def _index_path(self) -> Path:
        return self._rootfs_dir / "images.json"

    def _read_index(self) -> dict[str, str]:
        try:
            index: dict[str, str] = json.loads(self._index_path().read_text())
            return index
        except (OSError, ValueError):
            return {}

    def _rootfs_path(self, image_id: str) -> Path:
        return self._rootfs_dir / image_id.split(":", 1)[-1]

    def resolve(self, image: str) -> tuple[str, str]:
        """(image id, exported root filesystem), exporting it the first time."""
        now = time.monotonic()
        cached = self._images.get(image)
        if cached and now - cached[2] < self._ttl_s:
            return cached[0], cached[1]
        info = None
        try:
            with dockerd(f"inspect {image!r}", refusal=BackendUnavailable, image=image):
                info = self._docker().inspect_image(image)
            image_id, names = str(info["Id"]), tuple(info.get("RepoTags") or ())
        except BackendUnavailable as exc:  # no engine: an earlier export may still serve
            image_id, names = self._indexed(image, exc.reason)
        path = self._rootfs_path(image_id)
        if not path.is_dir():
            self._export(image, image_id, names)
        elif info is not None and any(self._read_index().get(name) != image_id for name in names):
            # Exported under another of its names: each must serve without dockerd too.
            with self._export_lock:
                self._remember(names, image_id)
        self._images[image] = (image_id, str(path), now, names)
        return image_id, str(path)

    def _indexed(self, image: str, why: str) -> tuple[str, tuple[str, ...]]:
        """The image id an earlier export recorded for `image`, and the names dockerd
        resolved to it then (each was exported by name)."""
        index = self._read_index()
        image_id = index.get(image)
        if image_id is None:
            raise FailedPrecondition(f"image {image!r} has no exported root filesystem and dockerd cannot "
                                     f"export one: {why}", field="runtime.image") from None
        return image_id, tuple(sorted(name for name, iid in index.items() if iid == image_id))

    def _export(self, image: str, image_id: str, names: tuple[str, ...]) -> None:
        """Exports the image's filesystem into <rootfs>/<id>, atomically (temp dir + rename)."""
        with self._export_lock:
            final = self._rootfs_path(image_id)
            if final.is_dir():
                return
            self._rootfs_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
            lock_fd = os.open(self._rootfs_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)  # another daemon on the same state dir
                if final.is_dir():
                    return
                tmp = self._rootfs_dir / f".tmp-{final.name[:12]}-{secrets.token_hex(4)}"
                tmp.mkdir(mode=0o755)
                try:
                    self._extract(image, tmp)
                    _prepare_rootfs(tmp)
                    os.rename(tmp, final)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                self._remember(names, image_id, locked=True)
                log.info("exported %s (%s) to %s", image, image_id, final)
            finally:
                os.close(lock_fd)

    def _remember(self, names: tuple[str, ...], image_id: str, locked: bool = False) -> None:
        """Records the names dockerd gives `image_id` (its RepoTags, never merely a name
        that resolved to it): what serves, and is allowlisted, without dockerd."""
        lock_fd = -1 if locked else os.open(self._rootfs_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if lock_fd >= 0:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)  # another daemon on the same state dir
            index = self._read_index()
            index.update({name: image_id for name in names})
            tmp_index = self._index_path().with_suffix(f".tmp-{secrets.token_hex(4)}")
            tmp_index.write_text(json.dumps(index, indent=1, sort_keys=True))
            os.replace(tmp_index, self._index_path())
        finally:
            if lock_fd >= 0:
                os.close(lock_fd)

    def prune_exports(self) -> list[str]:
        """Removes exported root filesystems of images the engine no longer has (a
        rebuilt image gets a new id; the old export would stay forever), unless a mount
        anywhere on the host still uses one (a jail of another daemon sharing the
        directory). Skipped when dockerd cannot list its images. Returns the ids removed."""
        if not self._rootfs_dir.is_dir():
            return []
        removed: list[str] = []
        with self._export_lock:
            lock_fd = os.open(self._rootfs_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)  # no export (of any daemon) meanwhile
                try:  # listed under the lock: an image exported just now is in the list
                    with dockerd("list images"):
                        present = {i["Id"].split(":", 1)[-1] for i in self._docker().images(all=True)}
                except SandboxdError as exc:  # nothing is removed on doubt
                    log.info("exported images not pruned: %s", exc.reason)
                    return []
                stale = [e for e in os.scandir(self._rootfs_dir) if e.is_dir(follow_symlinks=False)
                         and _IMAGE_ID.fullmatch(e.name) and e.name not in present]
                if stale:
                    in_use = _mounted_image_ids()
                    for e in stale:
                        if e.name in in_use:
                            continue
                        trash = self._rootfs_dir / f".trash-{e.name[:12]}-{secrets.token_hex(4)}"
                        try:
                            os.rename(e.path, trash)  # gone from view at once, then deleted
                        except OSError as exc:  # kept, and said: pruning only frees space
                            log.warning("cannot remove the export of image %s: %s", e.name[:12], exc.strerror)
                            continue
                        shutil.rmtree(trash, ignore_errors=True)
                        removed.append(e.name)
                    index = {k: v for k, v in self._read_index().items() if v.split(":", 1)[-1] not in removed}
                    tmp_index = self._index_path().with_suffix(".tmp")
                    tmp_index.write_text(json.dumps(index, indent=1, sort_keys=True))
                    os.replace(tmp_index, self._index_path())
                for leftover in self._rootfs_dir.glob(".trash-*"):  # a prune that was interrupted
                    shutil.rmtree(leftover, ignore_errors=True)
            finally:
                os.close(lock_fd)
        for image_id in removed:
            log.info("removed the export of image %s (no longer in the engine)", image_id[:12])
        return removed

    def _extract(self, image: str, dest: Path) -> None:
        api = self._docker()
        with dockerd(f"export {image!r}", refusal=BackendUnavailable):
            container = api.create_container(image, command=["true"], labels={f"{LABEL_PREFIX}export": "1"})
        try:
            # dockerd's inside: its transport's errors are OSErrors too, and its to say.
            with host_step(f"export {image!r}"), dockerd(f"export {image!r}", refusal=BackendUnavailable):
                with tarfile.open(fileobj=io.BufferedReader(_ChunkReader(api.export(container["Id"])), 1 << 20),
                                  mode="r|") as tar:
                    tar.extractall(dest, numeric_owner=True, filter=_tar_member_filter)
        finally:
            try:
                with dockerd("remove the export container"):
                    api.remove_container(container["Id"], force=True)
            except SandboxdError:
                log.error("could not remove the export container %s", container["Id"])

    def names(self, image: str) -> tuple[str, ...]:
        """The names dockerd gives the image `resolve` last resolved `image` to."""
        return self._images[image][3]


class _ChunkReader(io.RawIOBase):
    """A file object over an iterator of byte chunks (the Docker SDK's export stream)."""

    def __init__(self, chunks: Iterable[bytes]):
        self._chunks = iter(chunks)
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while not self._pending:
            try:
                self._pending = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def _tar_member_filter(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
    # Device nodes are not needed (the jail has its own /dev) and would be live ones
    # on the host filesystem: skipped. tar_filter refuses names that leave the
    # destination; the member's own mode is kept (the root is mounted nosuid anyway).
    if member.ischr() or member.isblk() or member.isfifo():
        return None
    checked = tarfile.tar_filter(member, path)
    return checked.replace(mode=member.mode, deep=False)


_IMAGE_ID = re.compile(r"[0-9a-f]{64}")


def _mounted_image_ids() -> set[str]:
    """Image ids (64 hex digits) that name a directory in the root or the mount point of
    any mount of any process on the host: an export some jail still has mounted. (The
    root field is relative to its filesystem's root, so whole paths cannot be compared.)"""
    found: set[str] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/mountinfo") as f:
                for line in f:
                    fields = line.split(" ", 6)
                    if len(fields) > 4:
                        for path in (fields[3], fields[4]):
                            found.update(part for part in path.split("/") if _IMAGE_ID.fullmatch(part))
        except OSError:
            continue
    return found


def _prepare_rootfs(root: Path) -> None:
    """What an exported image needs to serve as a jail's root: the mount points the
    jail always uses, /etc/hosts and /etc/hostname as Docker writes them, and no
    /.dockerenv."""
    os.chmod(root, 0o755)
    try:
        (root / ".dockerenv").unlink()
    except FileNotFoundError:
        pass
    for name in ("proc", "dev", "workspace", "tmp"):
        path = root / name
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise FailedPrecondition(f"the image's /{name} is not a directory", field="runtime.image")
        if not path.exists():
            path.mkdir(mode=0o1777 if name == "tmp" else 0o755)
    etc = root / "etc"
    if etc.is_dir() and not etc.is_symlink():
        for name, content in (("hosts", _HOSTS), ("hostname", "sandbox\n")):
            path = etc / name
            if path.is_symlink():
                continue
            path.write_text(content)
            os.chmod(path, 0o644)


