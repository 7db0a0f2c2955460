"""The daemon's own files: the native helpers `make native` builds and the seccomp
profile. They are found beside the installed package (importlib.resources), never
through a git checkout; each is a setting whose default is its packaged path."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

SHIM = "sandbox-shim"
FANOTIFY_READER = "libsandboxd-fanotify.so"
RELAY_LIBRARY = "libsandboxd-relay.so"
CGROUP_EXEC = "sandboxd-cgroup-exec"
SECCOMP_PROFILE = "seccomp/sandboxd-docker.json"


def packaged(name: str) -> Path:
    """The path of asset `name` inside the installed `sandboxd` package."""
    return Path(str(importlib.resources.files("sandboxd").joinpath("assets", name)))
