"""Files and directories this client makes on its own host (a download's tree, `artifact
get -o`, `--result-json`, `trace export -o`, the client config file), made so that no
other local user can steer them where they were not meant to go.

In a directory others may write (/tmp, a shared project), another user can plant a
symlink at a name the client is about to use; a write through it lands in whatever the
link points at (the user's ~/.bashrc). So:

- a path the user named is walked one name at a time from a directory descriptor; a
  symlink on the way is followed only when it is this user's, root's, or that of the
  directory holding it (the only users who could have put it there unasked, as the
  kernel's fs.protected_symlinks rule has it, whatever that setting says);
- a directory the client makes is made relative to its parent's descriptor and opened
  without following a link; one that is already there must be this user's own;
- a file is written under a random name made with O_EXCL|O_NOFOLLOW beside where it
  lands, given its mode on its descriptor and its name by a rename relative to the
  directory's descriptor, once whole."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable
from typing import BinaryIO, TypeVar

T = TypeVar("T")

# O_PATH: a directory on the way may be searchable without being readable (/home 0711).
_WALK = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_PATH", os.O_RDONLY)
# A directory opened to be given its mode (an O_PATH descriptor takes no fchmod).
READ_DIR = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_RDONLY
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # the kernel's own limit
PART_PREFIX = ".sandboxd-part-"


class UnsafePath(OSError):
    """A name another local user could have planted (a symlink, a directory of theirs)
    where the client would follow it or write into it: nothing was written through it."""

    def __init__(self, message: str):
        super().__init__(errno.EPERM, message)

    def __str__(self) -> str:
        return str(self.strerror)


def _joined(shown: str, name: str) -> str:
    return name if shown == "." and name != "." else ("/" + name if shown == "/" else f"{shown}/{name}")


def _trusted_link(dir_fd: int, name: str, link: os.stat_result, shown: str) -> None:
    holder = os.fstat(dir_fd).st_uid
    if link.st_uid not in (os.geteuid(), 0, holder):
        raise UnsafePath(f"{shown}: a symlink of uid {link.st_uid} in a directory of uid {holder}, not followed "
                         f"(another user may have planted it): name the path without it")


def _open_at(dir_fd: int, name: str, shown: str, flags: int) -> int:
    """`name` below `dir_fd` opened as a directory, never through a symlink."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePath(f"{shown}: a symlink (of uid {st.st_uid}) where a directory is made or written "
                             "into: not followed") from None
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", shown) from None


def own_dir(dir_fd: int, name: str, shown: str, *, create: bool, mode: int = 0o700, flags: int = _WALK) -> int:
    """The directory `name` below `dir_fd` (made with `mode` when missing and `create`),
    never through a symlink, and this user's own: its descriptor."""
    try:
        fd = _open_at(dir_fd, name, shown, flags)
    except FileNotFoundError:
        if not create:
            raise FileNotFoundError(errno.ENOENT, "no such directory", shown) from None
        try:
            os.mkdir(name, mode, dir_fd=dir_fd)
        except FileExistsError:
            pass  # made since: opened as any other, below
        fd = _open_at(dir_fd, name, shown, flags)
    return owned(fd, shown)


def owned(fd: int, shown: str) -> int:
    """`fd`, a directory of this user's; else closed and refused."""
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():
        os.close(fd)
        raise UnsafePath(f"{shown}: a directory of uid {owner}, not this user's ({os.geteuid()}): nothing is written "
                         "into another user's directory")
    return fd


def open_dir(path: str | os.PathLike[str], *, create: bool = False, mode: int = 0o777) -> int:
    """A descriptor (O_PATH where there is one) of the directory `path` names: each name
    opened from the one before, a symlink followed only when trusted (the module's
    rule); with `create`, missing levels made with `mode` (less the umask), and below
    the first one made nothing is followed and everything must be this user's."""
    text = os.fspath(path)
    if "\0" in text:
        raise ValueError(f"{text!r}: a path holds no NUL byte")
    shown = "/" if text.startswith("/") else "."
    fd = os.open(shown, _WALK)
    pending = [n for n in reversed(text.split("/")) if n not in ("", ".")]
    links, made = 0, False
    try:
        while pending:
            name = pending.pop()
            here = _joined(shown, name)
            if made:
                step = own_dir(fd, name, here, create=True, mode=mode)
            else:
                try:
                    step = os.open(name, _WALK, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise FileNotFoundError(errno.ENOENT, "no such directory", here) from None
                    step, made = own_dir(fd, name, here, create=True, mode=mode), True
                except OSError as exc:
                    if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                        raise
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if not stat.S_ISLNK(st.st_mode):
                        raise NotADirectoryError(errno.ENOTDIR, "not a directory", here) from None
                    _trusted_link(fd, name, st, here)
                    links += 1
                    if links > _MAX_LINKS:
                        raise OSError(errno.ELOOP, "too many levels of symbolic links", text) from None
                    target = os.readlink(name, dir_fd=fd)
                    if target.startswith("/"):
                        os.close(fd)
                        fd, shown = os.open("/", _WALK), "/"
                    pending += [n for n in reversed(target.split("/")) if n not in ("", ".")]
                    continue
            os.close(fd)
            fd, shown = step, here
        return fd
    except BaseException:
        os.close(fd)
        raise


def split_name(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(the directory, the name) of a file to be written at `path`."""
    text = os.fspath(path)
    parent, name = os.path.split(text)
    if name in ("", ".", ".."):
        raise IsADirectoryError(errno.EISDIR, "a file is written at a name, not at a directory", text)
    return parent or ".", name


class PartFile:
    """A file written under a random name in `dir_fd` (made with O_EXCL, through no
    link), named `name` only when whole (`commit`), or removed (`discard`)."""

    def __init__(self, dir_fd: int, name: str, shown: str, mode: int = 0o600):
        self.dir_fd, self.name, self.shown = dir_fd, name, shown
        while True:
            self.tmp = PART_PREFIX + secrets.token_hex(8)
            try:
                fd = os.open(self.tmp, _NEW_FILE, mode, dir_fd=dir_fd)
                break
            except FileExistsError:  # (64 random bits: only ever a name planted on purpose)
                continue
        self.file: BinaryIO = os.fdopen(fd, "wb")

    def commit(self, mode: int | None = None) -> None:
        """`mode` exactly (no umask), else as made; then the rename, which replaces what
        is at `name` (a link there is replaced, never followed)."""
        self.file.flush()
        if mode is not None:
            os.fchmod(self.file.fileno(), mode)
        self.file.close()
        os.rename(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)

    def discard(self) -> None:
        self.file.close()
        try:
            os.unlink(self.tmp, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass


def write_whole(path: str | os.PathLike[str], fill: Callable[[BinaryIO], T], mode: int = 0o666,
                make_dirs: int | None = None) -> T:
    """`fill`'s bytes at `path`, whole or not at all (made with `mode` less the umask);
    the directory must exist, or is made with the mode `make_dirs`. What `fill` returns."""
    parent, name = split_name(path)
    dir_fd = open_dir(parent, create=make_dirs is not None, mode=make_dirs or 0)
    try:
        part = PartFile(dir_fd, name, os.fspath(path), mode)
        try:
            value = fill(part.file)
            part.commit()
        except BaseException:
            part.discard()
            raise
        return value
    finally:
        os.close(dir_fd)
