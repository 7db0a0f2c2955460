"""What `sandboxd check` found, and how it is told: each probe's finding (ok, warn or
fail, and why), settled against the default backend, rendered as lines or as JSON, and
the exit status. Pure: no probe runs here."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

Status = Literal["ok", "warn", "fail"]
# needed_by: the daemon's start itself (it refuses to start without it) ...
DAEMON = "daemon"
# ... or a backend (it is unavailable without it: its calls are refused).
BACKENDS = ("docker", "nsjail")
CONFIG_PROBE = "config"
# Exit statuses: every finding ok or warn; a failure the daemon's start or its default
# backend cannot do without; a configuration that does not load.
EXIT_OK, EXIT_FAIL, EXIT_CONFIG = 0, 1, 2


@dataclass(frozen=True)
class Finding:
    probe: str  # what was looked at: "dockerd", "nsjail-sha256", "state_dir", ...
    status: Status
    reason: str
    # Who cannot do without it: DAEMON, backend names, or nobody (a feature's warning).
    needed_by: tuple[str, ...] = ()
    # The setting it is about, as a path ("nsjail.nsjail_binary_sha256"), when one is.
    field: str | None = None

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = {"probe": self.probe, "status": self.status, "reason": self.reason,
                                  "needed_by": list(self.needed_by)}
        if self.field is not None:
            out["field"] = self.field
        return out


def settle(findings: Iterable[Finding], default_backend: str, enabled_backends: Sequence[str]) -> list[Finding]:
    """The findings as the operator should read them, then a line per backend.

    A failure that only a backend other than the default needs is a warning: the daemon
    starts without that backend (its calls are refused, with the reason). Each enabled
    backend's line says whether it can run; the default one's failure is a failure."""
    raw = list(findings)
    settled = []
    for f in raw:
        if f.status == "fail" and f.needed_by and DAEMON not in f.needed_by and default_backend not in f.needed_by:
            unavailable = " and ".join(b for b in f.needed_by if b in enabled_backends)
            if unavailable:
                f = replace(f, status="warn", reason=f"{f.reason} (so the {unavailable} backend will be unavailable; "
                                                     f"the default backend is {default_backend})")
            else:
                f = replace(f, status="warn")
        settled.append(f)
    for backend in enabled_backends:
        settled.append(_backend_line(raw, backend, default_backend))
    return settled


def _backend_line(raw: list[Finding], backend: str, default_backend: str) -> Finding:
    blocking = [f.probe for f in raw if f.status == "fail" and (backend in f.needed_by or DAEMON in f.needed_by)]
    role = " (the default)" if backend == default_backend else ""
    if not blocking:
        return Finding(f"backend {backend}", "ok", f"{backend}{role} can run", needed_by=(backend,))
    status: Status = "fail" if backend == default_backend else "warn"
    return Finding(f"backend {backend}", status, f"{backend}{role} cannot run: see {', '.join(_unique(blocking))}",
                   needed_by=(backend,))


def _unique(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


def exit_status(findings: Iterable[Finding]) -> int:
    """EXIT_CONFIG when the configuration failed, EXIT_FAIL when anything else did,
    EXIT_OK otherwise (warnings allowed)."""
    failed = [f for f in findings if f.status == "fail"]
    if any(f.probe == CONFIG_PROBE for f in failed):
        return EXIT_CONFIG
    return EXIT_FAIL if failed else EXIT_OK


def render_text(findings: Sequence[Finding], header: str) -> str:
    """A header, then a line per finding: status, probe, reason (the field first, when one)."""
    width = max((len(f.probe) for f in findings), default=0)
    lines = [header]
    for f in findings:
        reason = f"{f.field}: {f.reason}" if f.field else f.reason
        lines.append(f"{f.status:<4}  {f.probe:<{width}}  {reason}")
    return "\n".join(lines) + "\n"


def render_json(findings: Sequence[Finding]) -> str:
    """The findings as a JSON list (one object per finding, in order)."""
    return json.dumps([f.as_json() for f in findings], indent=2) + "\n"
