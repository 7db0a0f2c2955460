"""`sandboxctl cp SRC DST`, like `docker cp`: files into or out of a workspace or a leased
sandbox through FileService, without running a command. Exactly one side names a sandbox:

    LEASE_ID:/path         a leased sandbox (lease_ and 24 hex digits, as `pool acquire` prints)
    WORKSPACE_DIR:/path    a workspace: a directory on this host, a colon, a sandbox path

the other is a path on this host. A local path may hold colons too, so a side is read as
a sandbox only where a colon is followed by '/' and what precedes it is a lease id or an
existing directory; a side that reads both ways (or two ways) is refused, never guessed.
The parsing asks this host only what a `HostView` answers, so it is tested without one.

Where the files land: as FileService puts them (a file at the path itself, a tree below
it), except that a destination ending in '/' (or, for a download, an existing local
directory) receives the source under its own name, as with docker.

An upload to a workspace needs a write root. Unless --policy or --write says otherwise,
it gets the least one that works: the deepest existing directory of the workspace that
holds the destination (never a symlink), so that nothing beside it is opened."""

from __future__ import annotations

import argparse
import os
import posixpath
import re
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from .cli_common import EXIT_CANCELLED, connect, dump_json, fail, load_policy, shown
from .cli_exec import FlagConflict, policy_with_flags
from .client import to_json
from .errors import SandboxdClientError
from .transfer import TransferError, target
from sandboxd_contract.pb import sandboxd_pb2 as pb

WORKSPACE = "/workspace"
# What AcquireSandbox returns (the pool manager's "lease_" + 12 random bytes in hex).
LEASE_ID = re.compile(r"lease_[0-9a-f]{24}")
EXIT_USAGE = 2
EXIT_FAILED = 1


class CpUsage(ValueError):
    """SRC, DST or a flag that cannot be taken one way only: nothing is sent (exit 2)."""


@dataclass(frozen=True)
class HostView:
    """The two questions the parsing asks of this host (the tests answer them)."""

    is_dir: Callable[[str], bool] = os.path.isdir
    exists: Callable[[str], bool] = os.path.lexists


@dataclass(frozen=True)
class Remote:
    """The sandbox side: its path as the sandbox sees it, in a workspace or a lease."""

    path: str
    workspace: str = ""
    lease_id: str = ""

    def __str__(self) -> str:
        return f"{self.lease_id or self.workspace}:{self.path}"


@dataclass(frozen=True)
class Copy:
    """One `cp`: which way, the local path, the remote side (paths as the user gave them)."""

    upload: bool
    local: str
    remote: Remote


def _readings(arg: str, host: HostView) -> list[Remote]:
    """Every way `arg` names a sandbox: at each colon followed by '/', a lease id or an
    existing directory before it."""
    found = []
    for i, ch in enumerate(arg):
        if ch != ":" or not arg.startswith("/", i + 1):
            continue
        prefix, path = arg[:i], arg[i + 1:]
        if LEASE_ID.fullmatch(prefix):
            found.append(Remote(path, lease_id=prefix))
        if prefix and host.is_dir(prefix):
            found.append(Remote(path, workspace=os.path.abspath(prefix)))
    return found


def parse_side(arg: str, host: HostView = HostView()) -> Remote | None:
    """The sandbox `arg` names, or None for a path on this host; CpUsage when it reads
    more than one way."""
    readings = _readings(arg, host)
    if not readings:
        return None
    if len(readings) > 1:
        ways = " or as ".join(f"{'lease' if r.lease_id else 'workspace'} {r.lease_id or r.workspace} with path {r.path}"
                              for r in readings)
        raise CpUsage(f"{arg!r} can be read as {ways}: name the workspace directory by another spelling "
                      "(./DIR, its absolute path) or rename it")
    if host.exists(arg):
        raise CpUsage(f"{arg!r} is a path on this host and also names the sandbox side {readings[0]}: "
                      "rename one of them")
    return readings[0]


def _near_miss(arg: str) -> str:
    """Why a side that looks like PREFIX:/path was taken as local."""
    prefix, sep, rest = arg.partition(":")
    if sep and rest.startswith("/") and prefix:
        return f"; {prefix!r} is neither a lease id nor a directory on this host"
    return ""


def parse_cp(src: str, dst: str, host: HostView = HostView()) -> Copy:
    from_side, to_side = parse_side(src, host), parse_side(dst, host)
    if from_side and to_side:
        raise CpUsage("both SRC and DST name a sandbox: one side must be a path on this host")
    if to_side:
        return Copy(True, src, to_side)
    if from_side:
        return Copy(False, dst, from_side)
    hint = _near_miss(src) or _near_miss(dst)
    raise CpUsage("neither SRC nor DST names a sandbox: write LEASE_ID:/path or WORKSPACE_DIR:/path "
                  f"(an existing directory){hint}")


def upload_path(local: str, remote_path: str) -> str:
    """Where an upload lands: a path ending in '/' receives the source under its name."""
    if not remote_path.endswith("/"):
        return remote_path
    name = os.path.basename(os.path.abspath(local))
    if not name:
        raise CpUsage(f"{local!r} has no name to land under {remote_path}: name the destination in full")
    return remote_path + name


def download_path(remote_path: str, local: str, host: HostView = HostView()) -> str:
    """Where a download lands: into an existing directory (or a path ending in '/')
    under the source's name, else at `local` itself."""
    if not (local.endswith("/") or host.is_dir(local)):
        return local
    name = posixpath.basename(posixpath.normpath(remote_path))
    if name in ("", ".", ".."):
        raise CpUsage(f"{remote_path!r} has no name to land under {local}: name the destination in full")
    return os.path.join(local, name)


def default_write_root(workspace: str, landing: str, single_file: bool,
                       lstat: Callable[[str], os.stat_result] = os.lstat) -> str | None:
    """The deepest directory of `workspace` that exists, is no symlink and holds
    `landing` (a file's parent, a tree's own directory), as a sandbox path; None for a
    landing outside /workspace (the daemon says why it is refused)."""
    path = posixpath.normpath(landing)
    if path != WORKSPACE and not path.startswith(WORKSPACE + "/"):
        return None
    rel = posixpath.relpath(path, WORKSPACE)
    names = [] if rel == "." else rel.split("/")
    if single_file:
        names = names[:-1]
    root, host_path = WORKSPACE, workspace
    for name in names:
        host_path = os.path.join(host_path, name)
        try:
            if not stat.S_ISDIR(lstat(host_path).st_mode):
                break
        except OSError:  # missing, or closed to this user: the root stays above it
            break
        root = posixpath.join(root, name)
    return root


def workspace_policy(policy_file: dict[str, Any] | None, write: Sequence[str],
                     default_root: str | None) -> dict[str, Any] | None:
    """The policy a workspace transfer names: the file's, with --write filled in as exec
    does; neither given, `default_root` as the only write root (an upload) or none at
    all (the default view: /workspace read-only)."""
    if policy_file is None and not write:
        return {"filesystem": {"writeRoots": [default_root]}} if default_root else None
    return policy_with_flags(policy_file or {}, write=write)


@dataclass(frozen=True)
class Plan:
    """What is sent: the target, the sandbox path, the local path."""

    to: pb.TransferTarget
    remote_path: str
    local: str


def plan_copy(copy: Copy, policy_file: dict[str, Any] | None, write: Sequence[str],
              host: HostView = HostView(), lstat: Callable[[str], os.stat_result] = os.lstat) -> Plan:
    remote = copy.remote
    if copy.upload:
        remote_path, local = upload_path(copy.local, remote.path), copy.local
    else:
        remote_path, local = remote.path, download_path(remote.path, copy.local, host)
    if remote.lease_id:
        if policy_file is not None or write:
            raise CpUsage("--policy and --write give a workspace's roots: a lease's own policy applies")
        return Plan(target(lease_id=remote.lease_id), remote_path, local)
    if write and not copy.upload:
        raise CpUsage("--write is for an upload: a download reads what the policy's read or write roots show "
                      "(give --policy to name them)")
    root = None
    if copy.upload:
        single_file = not host.is_dir(copy.local)
        root = default_write_root(remote.workspace, remote_path, single_file, lstat)
    policy = workspace_policy(policy_file, write, root)
    return Plan(target(workspace=remote.workspace, policy=policy), remote_path, local)


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def summary(copy: Copy, plan: Plan, result: pb.TransferResult) -> str:
    """One line for stderr: what moved, where to, and the transfer id its trace is under."""
    files = sum(1 for e in result.entries if e.kind == "file")
    dirs = sum(1 for e in result.entries if e.kind == "dir")
    if copy.upload:
        where = f"to {copy.remote.lease_id or copy.remote.workspace}:{plan.remote_path}"
    else:
        where = f"to {plan.local}"
    skipped = f", {len(result.skipped)} skipped" if result.skipped else ""
    verb = "uploaded" if copy.upload else "downloaded"
    return (f"{verb} {_count(files, 'file', 'files')}, {_count(dirs, 'directory', 'directories')}, "
            f"{_count(result.total_bytes, 'byte', 'bytes')} {shown(where)} (transfer {result.transfer_id}){skipped}")


def _send(client: Any, copy: Copy, plan: Plan) -> pb.TransferResult:
    if copy.upload:
        return client.upload(plan.to, plan.remote_path, plan.local)
    return client.download(plan.to, plan.remote_path, plan.local)


def _prepare(args: argparse.Namespace) -> tuple[Copy, Plan]:
    copy = parse_cp(args.src, args.dst)
    if copy.upload and not os.path.lexists(copy.local):
        raise CpUsage(f"{copy.local}: no such file or directory")
    policy_file = load_policy(args.policy) if args.policy else None
    return copy, plan_copy(copy, policy_file, args.write or ())


def cmd_cp(args: argparse.Namespace) -> int:
    try:
        copy, plan = _prepare(args)
    except (CpUsage, FlagConflict, OSError, ValueError, yaml.YAMLError) as exc:
        return fail(str(exc), EXIT_USAGE)
    with connect(args) as client:
        try:
            result = _send(client, copy, plan)
        except SandboxdClientError as exc:
            suffix = f" (transfer {exc.tool_call_id})" if exc.tool_call_id else ""
            return fail(f"{exc.code.name}: {exc.message}{suffix}", EXIT_FAILED)
        except (TransferError, OSError) as exc:  # this side: a file unreadable, unwritable, or not whole
            return fail(str(exc), EXIT_FAILED)
        except KeyboardInterrupt:
            return fail("interrupted", EXIT_CANCELLED)
    if args.json:
        print(dump_json(to_json(result)))
    print(summary(copy, plan, result), file=sys.stderr)
    for reason in result.skipped:
        print(f"sandboxctl: skipped {shown(reason)}", file=sys.stderr)
    return 0
