"""Where the jails' cgroups go on cgroup v2: below the daemon's own cgroup when systemd
delegated it (the unit's Delegate=yes), else at the top of the hierarchy.

systemd's rule is one writer per cgroup subtree: it owns every cgroup but the ones it
delegated, and may prune or rewrite what others make beside its own. A unit with
Delegate=yes hands the daemon its cgroup (systemd marks it with the xattr
trusted.delegate=1). v2 lets no process sit in a cgroup whose controllers are enabled
for its children, so the daemon first moves itself into a leaf of its own
(`<own>/daemon`) and then makes its jails below `<own>/sandboxes`:

    system.slice/sandboxd.service/            (delegated; controllers enabled below it)
        daemon/                               (the daemon's process)
        sandboxes/<daemon id>/<sandbox id>/   (each jail's cgroup and limits)

Stopping the unit then takes every jail with the daemon (KillMode=mixed kills what is
left in the unit's cgroup), and systemd removes the whole subtree.

Without delegation (no systemd, a daemon in the root cgroup, or cgroup v1) the jails go
to `sandboxd-nsjail/<daemon id>/<sandbox id>` at the hierarchy's top, as before. The
choice is the `nsjail.cgroup_placement` setting: `auto` (delegated when delegated,
else the top), `delegated` (refused when not delegated) or `top`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from sandboxd.core.hostfacts import CGROUP_ROOT, CgroupVersion
from sandboxd.core.settings import CgroupPlacement

TOP_LEVEL = "sandboxd-nsjail"
DAEMON_LEAF = "daemon"
SANDBOXES = "sandboxes"
DELEGATE_XATTRS = ("trusted.delegate", "user.delegate")  # systemd: "1" on a delegated cgroup


class PlacementRefused(Exception):
    """The jails' cgroups cannot go where the setting asks (said as the backend's reason)."""


@dataclass(frozen=True)
class CgroupHome:
    """`top`: the cgroup (relative to the hierarchy's root) below which each daemon's
    jails go, as `<top>/<daemon id>/<sandbox id>`. `base`: the delegated cgroup the
    daemon manages ("" when it is the hierarchy's root), above which nothing is
    written. `how`: one sentence for the log and `sandboxd check`."""

    top: str = TOP_LEVEL
    base: str = ""
    how: str = f"at the top of the hierarchy ({TOP_LEVEL})"

    @property
    def daemon_leaf(self) -> str:
        return f"{self.base}/{DAEMON_LEAF}" if self.base else ""


def own_cgroup(proc_self_cgroup: str) -> str | None:
    """The process's v2 cgroup, relative to the root ("" for the root itself), from the
    text of /proc/self/cgroup; None when it names no v2 hierarchy."""
    for line in proc_self_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            return path.strip().strip("/")
    return None


def plan_home(version: CgroupVersion | None, own: str | None, delegated: bool,
              placement: CgroupPlacement) -> CgroupHome:
    """Where the jails' cgroups go, from the host's cgroup version, the daemon's own v2
    cgroup and whether systemd delegated it. A daemon already in its leaf (`.../daemon`
    of a delegated cgroup: it was started there again) counts its parent as its own."""
    if placement == "top":
        return CgroupHome(how=f"at the top of the hierarchy ({TOP_LEVEL}), as nsjail.cgroup_placement says")
    if version != "v2":
        if placement == "delegated":
            raise PlacementRefused("nsjail.cgroup_placement is 'delegated', but the jails' cgroups can go below "
                                   "the daemon's own only on cgroup v2 (this host's memory controller is v1)")
        return CgroupHome(how=f"at the top of each v1 hierarchy ({TOP_LEVEL})")
    if own and delegated:
        return CgroupHome(top=f"{own}/{SANDBOXES}", base=own,
                          how=f"below the daemon's delegated cgroup /{own} (itself in /{own}/{DAEMON_LEAF})")
    if placement == "delegated":
        where = f"/{own}" if own else "the hierarchy's root"
        raise PlacementRefused(f"nsjail.cgroup_placement is 'delegated', but the daemon's cgroup ({where}) is not "
                               "delegated to it: run it under a systemd unit with Delegate=yes "
                               "(deploy/systemd/sandboxd.service)")
    if own:
        return CgroupHome(how=f"at the top of the hierarchy ({TOP_LEVEL}): the daemon's cgroup /{own} is not "
                              "delegated to it (systemd's Delegate=yes), so nothing is made below it")
    return CgroupHome(how=f"at the top of the hierarchy ({TOP_LEVEL}), the daemon being in the root cgroup")


def delegated_to_us(cgroup_root: str, rel: str) -> bool:
    """Whether systemd marked the cgroup as delegated (its trusted.delegate xattr)."""
    for name in DELEGATE_XATTRS:
        try:
            if os.getxattr(f"{cgroup_root}/{rel}", name).strip(b"\0").strip() == b"1":
                return True
        except OSError:
            continue
    return False


def find_home(version: CgroupVersion | None, placement: CgroupPlacement,
              cgroup_root: str = CGROUP_ROOT) -> CgroupHome:
    """The plan for this process, read from the host (reads only)."""
    with open("/proc/self/cgroup") as f:
        own = own_cgroup(f.read()) if version == "v2" else None
    if own is not None and own.rpartition("/")[2] == DAEMON_LEAF and own.rpartition("/")[0] \
            and delegated_to_us(cgroup_root, own.rpartition("/")[0]):
        own = own.rpartition("/")[0]
    delegated = bool(own) and delegated_to_us(cgroup_root, own or "")
    return plan_home(version, own, delegated, placement)


def settle(home: CgroupHome, cgroup_root: str = CGROUP_ROOT) -> None:
    """Moves this process (all its threads) into its leaf of the delegated cgroup, so
    that the jails' controllers can be enabled there. Nothing to do at the top. Refused
    when another process shares the delegated cgroup: it would keep the controllers
    from being enabled (a unit's ExecStart should be the daemon itself)."""
    if not home.base:
        return
    base, leaf = f"{cgroup_root}/{home.base}", f"{cgroup_root}/{home.daemon_leaf}"
    try:
        os.makedirs(leaf, exist_ok=True)
        with open(f"{leaf}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
        with open(f"{base}/cgroup.procs") as f:
            others = [p for p in f.read().split() if p]
    except OSError as exc:
        raise PlacementRefused(f"cannot move the daemon into {leaf}: {exc.strerror or exc}") from None
    if others:
        raise PlacementRefused(f"the daemon's delegated cgroup {base} holds other processes too "
                               f"(pids {', '.join(others[:5])}), so no controller can be enabled below it: "
                               "start the daemon as the unit's only process (ExecStart=sandboxd ...)")
