"""Warm sandboxes kept per (workspace, image, backend, policy class) and leased to calls.

template: what a pool is keyed by and made from; warm: the sandboxes, leases and pools
and their accounting; builder: making and removing a warm sandbox; supervisor: the
control channel to the sandbox's supervisor; lease: a leased sandbox as one call's
Sandbox, and its command (a Process); leftovers: what a command left in the sandbox's
cgroup; metrics; manager: the pools and leases, and their upkeep."""

from sandboxd.pools.lease import CommandSpec, LeasedCommand, LeaseSandbox
from sandboxd.pools.manager import PoolManager
from sandboxd.pools.template import BuiltSandbox, PoolTemplate, WorkspaceReservations
from sandboxd.pools.warm import Lease, Pool, WarmSandbox

__all__ = ["BuiltSandbox", "CommandSpec", "Lease", "LeaseSandbox", "LeasedCommand", "Pool", "PoolManager",
           "PoolTemplate", "WarmSandbox", "WorkspaceReservations"]
