"""The jail's cgroup, spelled by the host's layout: its limits, made before anything
runs, and removed (after its last tasks are gone) when the jail is."""

from __future__ import annotations

import logging

from collections.abc import Callable

from sandboxd.backends.cgroups import Layout
from sandboxd.backends.oom_guard import OomGuard
from sandboxd.backends.nsjail.compile import NsjailSpec

log = logging.getLogger("sandboxd.nsjail")
# How long destroy() and reap_orphans() wait for a killed cgroup to empty.
CGROUP_DRAIN_S = 5.0
# How long kill() waits for the jail's processes to be gone after SIGKILL.
KILL_SWEEP_S = 2.0


def cgroup_limits(layout: Layout, spec: NsjailSpec) -> dict[str, str]:
    """What a jail's cgroup must say before anything runs (keys as the layout spells them)."""
    return layout.limits(spec.memory_bytes, spec.pids_max, spec.cpu_quota_us, spec.cpu_period_us)


def make_cgroups(layout: Layout, cgroup: str, limits: dict[str, str], present: dict[str, str] | None = None) -> None:
    """Makes the jail's cgroup and writes its limits, skipping those `present` says are
    already there (a spawn slot writes the usual ones ahead: each write costs ~0.4 ms)."""
    layout.make(cgroup)
    layout.write_limits(cgroup, limits, present or {})


def remove_cgroups(layout: Layout, cgroup: str, timeout_s: float = CGROUP_DRAIN_S) -> bool:
    """Removes the sandbox's cgroup directories, retrying while its last tasks finish
    exiting. True when all are gone."""
    left = layout.remove(cgroup, timeout_s)
    if left:
        log.error("could not remove cgroups %s", left)
    return not left


def watch_oom(guard: OomGuard, layout: Layout, cgroup: str, kill: Callable[[], None]) -> Callable[[], None] | None:
    """An OOM kill of any process of the jail ends all of it (oom_guard.py); None when
    the cgroup cannot be watched (logged: collect() still reports the OOM kill)."""
    try:
        return guard.watch(layout.memory_dir(cgroup), kill)
    except OSError as exc:
        log.warning("no OOM watch for %s: %s", cgroup, exc)
        return None
