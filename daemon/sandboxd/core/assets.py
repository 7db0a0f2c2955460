"""The daemon's own files: the native helpers `make native` builds and the seccomp
profile. They are found beside the installed package (importlib.resources), never
through a git checkout; each is a setting whose default is its packaged path. The
profile is read here, for every backend and `sandboxd check` alike."""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

from sandboxd.core.errors import BackendUnavailable
from sandboxd.core.safe_open import UnsafeFile, read_setting_file

SHIM = "sandbox-shim"
FANOTIFY_READER = "libsandboxd-fanotify.so"
RELAY_LIBRARY = "libsandboxd-relay.so"
CGROUP_EXEC = "sandboxd-cgroup-exec"
SECCOMP_PROFILE = "seccomp/sandboxd-docker.json"
# Docker's own default profile is about 25 KB.
MAX_SECCOMP_PROFILE_BYTES = 4 * 2**20


def packaged(name: str) -> Path:
    """The path of asset `name` inside the installed `sandboxd` package."""
    return Path(str(importlib.resources.files("sandboxd").joinpath("assets", name)))


def read_seccomp_profile(path: str | os.PathLike[str]) -> str:
    """The seccomp profile's text, as every backend and `sandboxd check` read it: opened
    once, no symlink followed and never blocking (a FIFO there would hang the daemon's
    start), a regular file checked and read through that one descriptor. Refused:
    BackendUnavailable (no sandbox runs without it)."""
    try:
        data = read_setting_file(path, setting="seccomp_profile", max_bytes=MAX_SECCOMP_PROFILE_BYTES)
    except UnsafeFile as exc:
        raise BackendUnavailable(f"seccomp profile {exc.path} {exc.problem}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise BackendUnavailable(f"seccomp profile {os.fspath(path)} is not UTF-8 text") from None
