"""The daemon's own directories (state, runtime, the socket's, egress sockets, image
roots, secrets), looked at as core/hostdirs.py would check them at start, without
making, re-moding or mounting anything: each is there and would be accepted, would be
made, or would refuse the start (and why). `sandboxd check` reports them; the daemon's
start looks first, so that a refusal comes before it has made any of them."""

from __future__ import annotations

from sandboxd.check.report import DAEMON, Finding
from sandboxd.core import hostdirs
from sandboxd.core.errors import SandboxdError
from sandboxd.core.settings import DaemonSettings


def dir_findings(settings: DaemonSettings) -> list[Finding]:
    """A finding per directory: ok (there, or to be made: the first missing component
    named), or fail with hostdirs' reason (a planted or loose directory, a symlink, a
    relative path, an operator's secrets dir on a disk)."""
    out = []
    for setting, path, _mode, _set_mode in hostdirs.daemon_dirs(settings):
        try:
            missing = hostdirs.inspect_private_dir(path, setting=setting)
        except SandboxdError as exc:
            out.append(Finding(setting, "fail", exc.reason, needed_by=(DAEMON,), field=exc.field))
            continue
        out.append(Finding(setting, "ok", _told(path, missing), needed_by=(DAEMON,)))
    daemon_mounts = settings.secrets_dir is None
    try:
        missing = hostdirs.inspect_secrets_dir(settings.secrets_path, daemon_mounts=daemon_mounts)
    except SandboxdError as exc:
        out.append(Finding("secrets_dir", "fail", exc.reason, needed_by=(DAEMON,), field=exc.field))
    else:
        tmpfs = "; the daemon mounts its own tmpfs there" if daemon_mounts else " (on a tmpfs)"
        out.append(Finding("secrets_dir", "ok", _told(settings.secrets_path, missing) + tmpfs, needed_by=(DAEMON,)))
    return out


def _told(path: object, missing: str) -> str:
    if not missing:
        return f"{path} is there and the daemon's own"
    if str(path) == missing:
        return f"{path} would be created at start"
    return f"{path} would be created at start (from {missing} down)"
