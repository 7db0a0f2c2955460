"""What the host offers, probed once when the daemon starts (main.py) and passed to the
parts that depend on it: nothing probes the host at import time.

The cgroup layout decides how a jail's limits are set and read (backends/cgroups.py);
fanotify's directory handles decide whether file access is recorded per mount (FID mode,
recording/filewatch.py; whether a given filesystem supports them is still checked per
device, when a call first needs it)."""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger("sandboxd.hostfacts")
CGROUP_ROOT = "/sys/fs/cgroup"
# fanotify_init flags: a notification group reporting directory handles and names (5.9+).
_FAN_CLASS_NOTIF, _FAN_CLOEXEC, _FAN_NONBLOCK, _FAN_REPORT_DFID_NAME = 0x0, 0x1, 0x2, 0x00000C00

CgroupVersion = Literal["v1", "v2"]


@dataclass(frozen=True)
class HostFacts:
    kernel: str  # uname's release
    cgroup_root: str
    # v1 when the memory controller has a v1 hierarchy of its own (hybrid hosts too), v2
    # when the root is the unified hierarchy; None when neither is mounted.
    cgroup_version: CgroupVersion | None
    # The kernel's fanotify can report directory handles and names (FAN_REPORT_DFID_NAME).
    fanotify_dfid_name: bool


def cgroup_version(root: str = CGROUP_ROOT) -> CgroupVersion | None:
    if os.path.exists(f"{root}/memory/cgroup.procs") and not os.path.exists(f"{root}/memory/cgroup.controllers"):
        return "v1"
    if os.path.exists(f"{root}/cgroup.controllers"):
        return "v2"
    return None


def fanotify_reports_dir_names() -> bool:
    """Whether a group reporting directory handles and names can be made here (it is
    closed at once; it marks nothing). False without CAP_SYS_ADMIN too."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.fanotify_init(_FAN_CLASS_NOTIF | _FAN_CLOEXEC | _FAN_NONBLOCK | _FAN_REPORT_DFID_NAME, os.O_RDONLY)
    except (OSError, AttributeError):
        return False
    if fd < 0:
        return False
    os.close(fd)
    return True


def probe(cgroup_root: str = CGROUP_ROOT) -> HostFacts:
    facts = HostFacts(kernel=os.uname().release, cgroup_root=cgroup_root, cgroup_version=cgroup_version(cgroup_root),
                      fanotify_dfid_name=fanotify_reports_dir_names())
    log.info("host: kernel %s, cgroup %s, fanotify directory names %s", facts.kernel,
             facts.cgroup_version or "not mounted", "yes" if facts.fanotify_dfid_name else "no")
    return facts
