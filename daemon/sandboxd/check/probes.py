"""`sandboxd check`'s probes of the host itself: running as root, the cgroup layout,
fanotify (file-access recording), the daemon's own files (the seccomp profile and the
native helpers), the files settings name (credential bindings', the TLS listener's)
and the workspace roots. Each probe reads, never makes or changes anything, and returns
Findings (report.py)."""

from __future__ import annotations

import ctypes
import os
import stat
from pathlib import Path

from sandboxd.backends.docker.backend import load_seccomp_profile
from sandboxd.backends.nsjail.host import is_static_elf
from sandboxd.check.report import DAEMON, Finding
from sandboxd.core.errors import SandboxdError
from sandboxd.core.hostfacts import HostFacts
from sandboxd.core.safe_open import UnsafeFile, held_setting_file, open_setting_file
from sandboxd.core.settings import DaemonSettings
from sandboxd.recording import filewatch
from sandboxd.recording.errors import FileWatchError
from sandboxd.recording.fanotify import FAN_CLASS_NOTIF, FAN_CLOEXEC, FAN_NONBLOCK, FAN_UNLIMITED_QUEUE
from sandboxd.recording.libc import libc

EVERY_BACKEND = ("docker", "nsjail")


def static_elf(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a regular file and a static executable (host.is_static_elf),
    never blocking on what is no regular file."""
    try:
        with held_setting_file(path) as held:
            return is_static_elf(held)
    except (OSError, UnsafeFile):
        return False


def root_finding() -> Finding:
    """The daemon mounts, makes cgroups, reads its callers' peer credentials and owns
    its directories as root: it runs as root or not at all."""
    euid = os.geteuid()
    if euid == 0:
        return Finding("root", "ok", "running as root (uid 0)", needed_by=(DAEMON,))
    return Finding("root", "fail", f"running as uid {euid}: the daemon must run as root (it mounts, makes "
                                   "cgroups and reads its callers' credentials)", needed_by=(DAEMON,))


def cgroup_finding(facts: HostFacts) -> Finding:
    """The layout hostfacts.probe found: v1 (and hybrid: a unified v2 hierarchy beside
    the v1 controllers), v2, or none."""
    root = facts.cgroup_root
    if facts.cgroup_version is None:
        return Finding("cgroups", "fail", f"no cgroup hierarchy at {root} (neither a v1 memory controller nor a "
                                          "v2 unified hierarchy): no sandbox's limits can be set",
                       needed_by=EVERY_BACKEND)
    if facts.cgroup_version == "v2":
        return Finding("cgroups", "ok", f"v2 (unified hierarchy at {root})", needed_by=EVERY_BACKEND)
    unified = f"{root}/unified"
    if os.path.exists(f"{unified}/cgroup.controllers"):
        return Finding("cgroups", "ok", f"hybrid: v1 controllers at {root}, a unified v2 hierarchy at {unified} "
                                        "(the daemon uses v1)", needed_by=EVERY_BACKEND)
    return Finding("cgroups", "ok", f"v1 (controllers at {root})", needed_by=EVERY_BACKEND)


def fanotify_finding(settings: DaemonSettings, facts: HostFacts) -> Finding:
    """File-access recording: the reader library loads and a fanotify group can be made
    (closed at once: it marks nothing). Without it, calls asking for recordFileAccess
    are refused; nothing else is."""
    if not settings.file_watch:
        return Finding("fanotify", "warn", "file-access recording is off (file_watch: false)", field="file_watch")
    refused = "calls asking for audit.recordFileAccess will be refused"
    try:
        with held_setting_file(settings.file_audit.reader_library):  # a FIFO there would block the dlopen for good
            pass
    except UnsafeFile as exc:
        return Finding("fanotify", "warn", f"{exc.reason}: {refused}", field="file_audit.reader_library")
    filewatch.use_reader_library(settings.file_audit.reader_library)
    try:
        filewatch.reader_library()
    except FileWatchError as exc:
        return Finding("fanotify", "warn", f"{exc}: {refused}", field="file_audit.reader_library")
    lib = libc()
    fd = lib.fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK | FAN_UNLIMITED_QUEUE,
                           os.O_RDONLY | os.O_CLOEXEC)
    if fd < 0:
        return Finding("fanotify", "warn", f"fanotify_init: {os.strerror(ctypes.get_errno())} (a kernel without "
                                           f"CONFIG_FANOTIFY, or not root): {refused}")
    os.close(fd)
    if settings.file_watch_fid and not facts.fanotify_dfid_name:
        return Finding("fanotify", "warn", "usable, but this kernel reports no directory names "
                                           "(FAN_REPORT_DFID_NAME, Linux 5.9): file_watch_fid has no effect",
                       field="file_watch_fid")
    fid = ", directory names too (FID mode)" if facts.fanotify_dfid_name else ""
    return Finding("fanotify", "ok", f"usable{fid}; the reader {settings.file_audit.reader_library} loads")


def asset_findings(settings: DaemonSettings) -> list[Finding]:
    """The seccomp profile (every sandbox loads it), the relay (the public socket is
    served through it) and the sandbox shim (every jail starts with it; a Docker call
    with an egress allowlist, credentials, file recording or a lease needs it)."""
    out = []
    try:
        load_seccomp_profile(str(settings.seccomp_profile))
        out.append(Finding("seccomp-profile", "ok", f"{settings.seccomp_profile} is present and valid JSON",
                           needed_by=EVERY_BACKEND))
    except SandboxdError as exc:
        out.append(Finding("seccomp-profile", "fail", exc.message, needed_by=EVERY_BACKEND, field="seccomp_profile"))
    relay = settings.relay_library
    try:
        with held_setting_file(relay) as held:
            ctypes.CDLL(held)
        out.append(Finding("relay-library", "ok", f"{relay} loads", needed_by=(DAEMON,)))
    except (OSError, UnsafeFile) as exc:
        out.append(Finding("relay-library", "fail", f"{relay} cannot be loaded (build it with `make native`): {exc}; "
                                                    "the public socket is served through it",
                           needed_by=(DAEMON,), field="relay_library"))
    shim = settings.shim_binary
    if os.access(shim, os.X_OK) and static_elf(shim):
        out.append(Finding("sandbox-shim", "ok", f"{shim} is a static executable", needed_by=("nsjail",)))
    else:
        out.append(Finding("sandbox-shim", "fail", f"{shim} is missing or not a static executable (build it with "
                                                   "`make native`): every jail starts with it, and Docker calls "
                                                   "with an egress allowlist, credentials, file recording or a "
                                                   "lease need it", needed_by=("nsjail",), field="shim_binary"))
    return out


def workspace_findings(settings: DaemonSettings) -> list[Finding]:
    """Each workspace root: there, a directory, not inside one of the daemon's own
    places (every workspace below it would be refused), not open to others' renames.
    Without any, no call can run."""
    own = {"runtime_dir": settings.runtime_dir, "secrets_dir": settings.secrets_path,
           "egress.socket_dir": settings.egress.socket_dir, "nsjail.rootfs_dir": settings.nsjail.rootfs_dir}
    out = [_workspace_root(i, root, own) for i, root in enumerate(settings.workspace_roots)]
    if not any(f.status == "ok" for f in out):
        out.append(Finding("workspace-roots", "fail", "no workspace root is usable: every call would be refused",
                           needed_by=EVERY_BACKEND, field="workspace_roots"))
    return out


def _workspace_root(index: int, root: Path, own: dict[str, Path]) -> Finding:
    name, field = "workspace-root", f"workspace_roots[{index}]"
    try:
        st = os.stat(root)
    except OSError as exc:
        return Finding(name, "warn", f"{root} cannot be used ({exc.strerror}): calls for workspaces below it "
                                     "are refused until it exists", field=field)
    if not stat.S_ISDIR(st.st_mode):
        return Finding(name, "warn", f"{root} is not a directory", field=field)
    real = root.resolve()
    for setting, place in own.items():
        if real == place.resolve() or place.resolve() in real.parents:
            return Finding(name, "warn", f"{root} lies in {setting} ({place}): every workspace below it is "
                                         "refused", field=field)
    shown = f"{root}" + (f" (-> {real})" if real != root else "")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return Finding(name, "warn", f"{shown} is writable by every user without the sticky bit: anyone may "
                                     "rename or remove another user's workspace there", field=field)
    return Finding(name, "ok", f"{shown} is a directory (owner uid {st.st_uid}, mode "
                               f"{stat.S_IMODE(st.st_mode):04o})", field=field)


def credential_file_findings(settings: DaemonSettings) -> list[Finding]:
    """Each credential binding with a file source, looked at as the broker reads it at a
    call (secrets/broker.py): there, a regular file reached through no symlink at its
    name, the daemon's own and closed to group and others. Opened and fstat-ed only:
    nothing of it is read, so nothing of it can be told. A bad one leaves the daemon up
    and refuses only the calls naming the binding: a warning."""
    out = []
    for binding_id, binding in sorted(settings.credentials.items()):
        if binding.file is None:
            continue
        field = f"credentials.{binding_id}.file"
        try:
            fd, st = open_setting_file(binding.file, setting=field, private=True)
        except UnsafeFile as exc:
            out.append(Finding("credential-file", "warn", f"{exc.reason}: calls naming credential {binding_id!r} "
                                                          "are refused", field=field))
            continue
        os.close(fd)
        out.append(Finding("credential-file", "ok", f"{binding.file} is a regular file, the daemon's own, mode "
                                                    f"{stat.S_IMODE(st.st_mode):04o}", field=field))
    return out


def tls_findings(settings: DaemonSettings) -> list[Finding]:
    """The mutual-TLS listener's files (tcp.*), as the start must read them: each a
    regular file reached through no symlink at its name (a FIFO would hang the start);
    the private key the daemon's own and closed to group and others. Opened and
    fstat-ed only: nothing of the key is read here."""
    if settings.tcp is None:
        return []
    out = []
    for name, private in (("cert_file", False), ("key_file", True), ("client_ca_file", False)):
        field = f"tcp.{name}"
        try:
            fd, _st = open_setting_file(getattr(settings.tcp, name), setting=field, private=private)
        except UnsafeFile as exc:
            out.append(Finding("tls-file", "fail", exc.reason, needed_by=(DAEMON,), field=field))
            continue
        os.close(fd)
        out.append(Finding("tls-file", "ok", f"{getattr(settings.tcp, name)} is a regular file"
                                             + (", the daemon's own, closed to others" if private else ""),
                           needed_by=(DAEMON,), field=field))
    return out
