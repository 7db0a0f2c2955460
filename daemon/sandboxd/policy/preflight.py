"""Host checks before anything is created: the workspace lies under a configured root,
every root is a real directory of it (no `..`, no symlink out), the Docker socket and
the daemon's state can never be mounted, and the sandbox's uid is the workspace owner.
It refuses; it never degrades. The result, a HostPlan, is all the host facts the pure
compilers need."""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass, field

from sandboxd.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from sandboxd.policy.always_blocked import ALWAYS_BLOCKED, always_blocked
from sandboxd.policy.always_blocked_host import always_blocked_matches, refuse_blocked_workspace
from sandboxd.policy.models import WORKSPACE, EffectivePolicy, is_within
from sandboxd.core.safe_open import AT_FDCWD, RESOLVE_BENEATH, RESOLVE_NO_SYMLINKS, openat2
from sandboxd.core.settings import DOCKER_SOCKET, DaemonSettings

# A blocked directory with more entries than this is refused rather than half-checked.
MAX_BLOCKED_SCAN_ENTRIES = 20_000


@dataclass(frozen=True)
class Bind:
    sandbox_path: str
    host_path: str
    read_only: bool
    # The inode preflight checked: the root is mounted only if it is still that one.
    dev: int = 0
    ino: int = 0


@dataclass(frozen=True)
class Mask:
    sandbox_path: str
    kind: str  # "file" | "dir"
    # The inode preflight found there: the mask is placed only on it (backends/staging.py).
    dev: int = 0
    ino: int = 0
    # The rule that hides it, for whoever is told: the policy's field
    # ("policy.filesystem.blockedPaths[0]") or the operator's ("always_blocked: .env").
    rule: str = ""


@dataclass(frozen=True)
class HostPlan:
    workspace: str
    uid: int
    gid: int
    binds: tuple[Bind, ...]
    masks: tuple[Mask, ...]
    notes: tuple[str, ...] = field(default=())
    workspace_dev: int = 0
    workspace_ino: int = 0
    # Set for a sandbox about to be made: its roots are bound here first, and the engine
    # mounts them from here (backends/staging.py). "" only in pure tests.
    staging_dir: str = ""
    # Set for a sandbox about to be made that keeps its tempDir (persistOutputs): the
    # daemon's tmpfs bound there instead of the engine's (outputs/tempdir.py).
    outputs_dir: str = ""

    @property
    def writes_workspace(self) -> bool:
        """Whether the sandbox may write the workspace (then it holds it alone)."""
        return any(not b.read_only for b in self.binds)


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@functools.lru_cache(maxsize=64)
def _resolved(paths: tuple[os.PathLike | str, ...]) -> tuple[str, ...]:
    """The daemon's configured places, resolved once: nine realpath walks a call were a
    fifth of a leased command's admission. (Its own paths; a workspace's are resolved
    at every call.)"""
    return tuple(os.path.realpath(p) for p in paths)


def resolve_workspace(raw: str, settings: DaemonSettings, owner_uid: int | None = None) -> str:
    """`owner_uid` set: the caller is a tenant, who learns nothing of what the path
    resolves to, nor whether it exists, unless it is the caller's own (checked next)."""
    hide_host = owner_uid is not None
    if not os.path.isabs(raw):
        raise InvalidArgument("must be an absolute host path", field="workspace")
    real = _realpath(raw, "workspace")
    if not any(_within(real, r) and real != r for r in _resolved(tuple(settings.workspace_roots))):
        shown = "" if hide_host else f" (resolved {real})"
        raise PermissionDenied(f"{raw}{shown} is not below a configured workspace root", field="workspace")
    # The daemon's own places: its state, its socket, and what it hands sandboxes (the
    # shim, gates and output FIFOs, secrets, egress sockets), which another sandbox
    # must never see.
    forbidden = (str(DOCKER_SOCKET),) + _resolved((DOCKER_SOCKET, settings.state_dir, settings.socket_path,
                                                   settings.runtime_dir, settings.secrets_path,
                                                   settings.egress.socket_dir))
    for f in forbidden:
        if _within(f, real) or _within(real, f):
            raise PermissionDenied(f"{raw} contains or lies in {f}, which is never mounted", field="workspace")
    if not os.path.isdir(real):
        if hide_host:  # the same answer as a directory of another user's
            raise _not_callers(raw, owner_uid)
        raise FailedPrecondition(f"{raw} is not an existing directory", field="workspace")
    return real


def sandbox_owner(workspace: str, settings: DaemonSettings) -> tuple[int, int]:
    st = os.stat(workspace)
    if st.st_uid != 0 and st.st_gid != 0:
        return st.st_uid, st.st_gid
    if st.st_uid != 0:
        # Never the root group either: files the sandbox makes would belong to it.
        if settings.root_workspace_gid is None:
            raise PermissionDenied("the workspace's group is root and the daemon's config names no gid to run it as "
                                   "(root_workspace_gid)", field="workspace")
        return st.st_uid, settings.root_workspace_gid
    if settings.root_workspace_uid is None:
        raise PermissionDenied(
            "the workspace is owned by root and the daemon's config names no uid to run it as "
            "(root_workspace_uid)", field="workspace")
    gid = settings.root_workspace_gid if settings.root_workspace_gid is not None else settings.root_workspace_uid
    return settings.root_workspace_uid, gid


def _realpath(path: str, where: str) -> str:
    """os.path.realpath, whose readlink fails (EINVAL) when a link it found is swapped
    for a directory meanwhile: a refusal, never an internal error."""
    try:
        return os.path.realpath(path)
    except OSError as exc:
        raise FailedPrecondition(f"{path} changed while it was checked ({exc.strerror})", field=where) from None


def _host_path(workspace: str, sandbox_path: str) -> str:
    rel = os.path.relpath(sandbox_path, WORKSPACE)
    return workspace if rel == "." else os.path.join(workspace, rel)


def _check_root(workspace: str, sandbox_path: str, where: str, read_only: bool) -> Bind:
    host = _host_path(workspace, sandbox_path)
    real = _realpath(host, where)
    if not _within(real, workspace):
        raise PermissionDenied(f"{sandbox_path} resolves outside the workspace", field=where)
    if real != host:
        raise PermissionDenied(f"{sandbox_path} goes through a symlink; name its target instead", field=where)
    try:
        st = os.lstat(host)
    except FileNotFoundError:
        raise FailedPrecondition(f"{sandbox_path} does not exist in the workspace", field=where) from None
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise FailedPrecondition(f"{sandbox_path} is neither a directory nor a regular file", field=where)
    return Bind(sandbox_path, host, read_only, st.st_dev, st.st_ino)


def _hard_linked(workspace: str, path: str, where: str) -> str | None:
    """A file under `path` whose content is also reachable under another name. Walked
    through descriptors from the workspace, never through a symlink: a directory swapped
    for a link to somewhere else (as root!) is not walked, and names nothing of there."""
    try:
        ws_fd = openat2(AT_FDCWD, workspace, RESOLVE_NO_SYMLINKS)
    except OSError:
        raise FailedPrecondition(f"{workspace} changed while it was checked", field="workspace") from None
    try:
        rel = os.path.relpath(path, workspace)
        try:
            fd = openat2(ws_fd, rel, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
        except OSError:
            raise FailedPrecondition(f"{rel} changed while it was checked", field=where) from None
    finally:
        os.close(ws_fd)
    try:
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):  # (O_PATH opens a trailing symlink itself)
            raise FailedPrecondition(f"{rel} changed while it was checked", field=where)
        if not stat.S_ISDIR(st.st_mode):
            return path if stat.S_ISREG(st.st_mode) and st.st_nlink > 1 else None
        dir_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    finally:
        os.close(fd)
    seen = 0
    try:
        for dirpath, _dirnames, filenames, parent_fd in os.fwalk(".", dir_fd=dir_fd):
            for name in filenames:
                seen += 1
                if seen > MAX_BLOCKED_SCAN_ENTRIES:
                    raise FailedPrecondition(f"holds more than {MAX_BLOCKED_SCAN_ENTRIES} files to check for hard "
                                             "links", field=where)
                fst = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
                if stat.S_ISREG(fst.st_mode) and fst.st_nlink > 1:
                    return os.path.normpath(os.path.join(path, dirpath, name))
    finally:
        os.close(dir_fd)
    return None


MAX_SYMLINK_HOPS = 40


def resolve_in_sandbox(workspace: str, sandbox_path: str) -> str | None:
    """What `sandbox_path` designates inside the sandbox, following the workspace's
    symlinks the way the sandbox sees them (an absolute target is a sandbox path).
    None when it leaves /workspace or loops."""
    resolved: list[str] = []
    pending = [p for p in sandbox_path.split("/") if p]
    hops = 0
    while pending:
        name = pending.pop(0)
        if name == ".":
            continue
        if name == "..":
            if resolved:
                resolved.pop()
            continue
        resolved.append(name)
        if resolved[0] != WORKSPACE.strip("/") or len(resolved) == 1:
            continue
        host = os.path.join(workspace, *resolved[1:])
        if os.path.islink(host):
            hops += 1
            if hops > MAX_SYMLINK_HOPS:
                return None
            target = os.readlink(host)
            resolved.pop()
            if target.startswith("/"):
                resolved = []
            pending = [p for p in target.split("/") if p] + pending
    path = "/" + "/".join(resolved)
    return path if is_within(path, WORKSPACE) else None


def _blocked_targets(workspace: str, sandbox_path: str, where: str) -> list[str]:
    """Every sandbox path a blocked name may designate: as the host resolves it and as
    the sandbox resolves it (they differ for absolute symlinks). Masking both is safe."""
    targets: list[str] = []
    real = _realpath(_host_path(workspace, sandbox_path), where)
    if _within(real, workspace):
        targets.append(WORKSPACE if real == workspace else f"{WORKSPACE}/{os.path.relpath(real, workspace)}")
    try:
        inside = resolve_in_sandbox(workspace, sandbox_path)
    except OSError as exc:  # a link swapped for something else while it was read
        raise FailedPrecondition(f"{sandbox_path} changed while it was checked ({exc.strerror})", field=where) from None
    if inside is not None and inside not in targets:
        targets.append(inside)
    return targets


def check_owner(workspace_raw: str, workspace: str, uid: int, owner_uid: int) -> None:
    """A caller may use only a workspace its own uid owns; checked before anything else
    of the host is looked at, so that a refusal tells another tenant nothing about it."""
    if uid != owner_uid:
        raise _not_callers(workspace_raw, owner_uid)


def _not_callers(workspace_raw: str, owner_uid: int | None) -> PermissionDenied:
    """One answer for a missing directory and another user's: no oracle of existence."""
    return PermissionDenied(f"{workspace_raw} is not an existing workspace of uid {owner_uid}: a principal may only "
                            "use workspaces its own uid owns", field="workspace")


def _exists(path: str, where: str) -> bool:
    """Whether a blocked path is there: only "no such file" means absent. Anything else
    (root refused on a FUSE or root-squashed NFS workspace) is a refusal, never a mask
    left out."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise FailedPrecondition(f"cannot tell whether it exists ({exc.strerror}); it would not be masked",
                                 field=where) from None
    return True


def preflight(policy: EffectivePolicy, workspace_raw: str, settings: DaemonSettings,
              owner_uid: int | None = None) -> HostPlan:
    """`owner_uid`: the caller's uid, unless the caller is an admin (who may use any
    workspace); the workspace must be that uid's before any root is looked at."""
    workspace = resolve_workspace(workspace_raw, settings, owner_uid)
    ws_stat = os.stat(workspace)
    uid, gid = sandbox_owner(workspace, settings)
    if owner_uid is not None:
        check_owner(workspace_raw, workspace, uid, owner_uid)
    always = always_blocked(settings.always_blocked)
    above = _names_from_root(workspace, settings)
    refuse_blocked_workspace(always, workspace_raw, workspace, above)
    binds: list[Bind] = []
    for i, p in enumerate(policy.read_roots):
        binds.append(_check_root(workspace, p, policy.root_field(p, "readRoots", i), read_only=True))
    for i, p in enumerate(policy.write_roots):
        if is_within(p, policy.temp_dir):
            continue  # already writable: it is the tmpfs
        binds.append(_check_root(workspace, p, policy.root_field(p, "writeRoots", i), read_only=False))

    blocked = [_Blocked(p, f"policy.filesystem.blockedPaths[{i}]") for i, p in enumerate(policy.blocked_paths)]
    if always.patterns:
        blocked += [_Blocked(path, "", pattern) for path, pattern in always_blocked_matches(
            always, workspace, (ws_stat.st_dev, ws_stat.st_ino), above, [b.sandbox_path for b in binds],
            policy.root_fields, resolve_in_sandbox)]
    masks, notes = _masks(workspace, blocked, binds, policy)
    return HostPlan(workspace=workspace, uid=uid, gid=gid, binds=tuple(binds), masks=tuple(masks), notes=tuple(notes),
                    workspace_dev=ws_stat.st_dev, workspace_ino=ws_stat.st_ino)


@dataclass(frozen=True)
class _Blocked:
    """A sandbox path to mask and the rule that names it: the policy's blockedPaths entry
    (`rule` is its field), or the operator's always_blocked (`pattern` set: only what it
    found is named, and no policy can show it)."""

    path: str
    rule: str
    pattern: str = ""


def _masks(workspace: str, blocked: list[_Blocked], binds: list[Bind],
           policy: EffectivePolicy) -> tuple[list[Mask], list[str]]:
    """Every blocked path masked where the sandbox would see it, under each name it has
    there; a notes line for what needs none (policy entries) or for each mask the
    operator's list placed (which rule hid the file)."""
    masks: list[Mask] = []
    notes: list[str] = []
    visible = [b.sandbox_path for b in binds]
    # Shallowest first, so that a path inside an already masked directory adds nothing.
    for entry in sorted(blocked, key=lambda b: b.path.count("/")):
        p, where, operator = entry.path, entry.rule, bool(entry.pattern)
        said = f"{ALWAYS_BLOCKED}: {entry.pattern}"
        fault = "workspace" if operator else where  # what a refusal points at
        targets = _blocked_targets(workspace, p, fault)
        if not targets and not operator:
            notes.append(f"blocked path {p} resolves outside the workspace, which is not mounted")
        for target in targets:
            host = _host_path(workspace, target)
            if not _exists(host, fault):
                if not operator:
                    notes.append(f"blocked path {p} ({target}) does not exist; nothing to mask")
                continue
            shown = next((v for v in visible if is_within(v, target)), None)
            if shown is not None:
                if operator:
                    raise PermissionDenied(f"{target} is hidden from every call by the daemon's {said} ({p}); no "
                                           "policy can show it", field=policy.root_fields.get(shown, "workspace"))
                raise FailedPrecondition(f"{p} resolves to {target}, which contains a read or write root", field=where)
            if not any(is_within(target, v) for v in visible):
                if not operator:
                    notes.append(f"blocked path {p} ({target}) is not under any read or write root; already invisible")
                continue
            if any(m.sandbox_path == target or (m.kind == "dir" and is_within(target, m.sandbox_path))
                   for m in masks):
                continue  # masked already, by this rule under another name or by another
            linked = _hard_linked(workspace, host, fault)
            if linked:
                raise FailedPrecondition(
                    f"{said + ': ' if operator else ''}{p} has a hard link elsewhere "
                    f"({os.path.relpath(linked, workspace)}); its content would stay visible under the other name",
                    field=fault)
            st = os.lstat(host)
            masks.append(Mask(target, "dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_dev, st.st_ino,
                              said if operator else where))
            if operator:
                notes.append(f"{said} masks {target}" + (f" (named {p})" if p != target else "")
                             + ": the daemon's list, no policy unblocks it")
    return masks, notes


# ------------------------------------------------------------------ the operator's always_blocked
# Its patterns (policy/always_blocked.py), matched on the host by always_blocked_host.py.
def always_blocked_rule(settings: DaemonSettings, workspace: str, sandbox_path: str) -> str | None:
    """`always_blocked: <pattern>` when the operator's list hides `sandbox_path` (normalized,
    absolute) of `workspace` (as preflight resolved it), or a directory on its way; None
    otherwise. For a check by name where a mask cannot answer: a mask covers only what
    existed when it was placed (a leased sandbox's, made earlier; a file transfer's)."""
    if not is_within(sandbox_path, WORKSPACE) or sandbox_path == WORKSPACE:
        return None
    rel = tuple(sandbox_path[len(WORKSPACE) + 1:].split("/"))
    return always_blocked(settings.always_blocked).rule_for(_names_from_root(workspace, settings), rel)


def _names_from_root(workspace: str, settings: DaemonSettings) -> tuple[str, ...]:
    """The names from the workspace's root (the outermost configured root holding it)
    down to the workspace itself."""
    holders = [r for r in _resolved(tuple(settings.workspace_roots)) if _within(workspace, r) and workspace != r]
    rel = os.path.relpath(workspace, min(holders, key=len)) if holders else os.path.basename(workspace)
    return tuple(rel.split("/"))
