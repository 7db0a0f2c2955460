"""`sandboxd check`: every probe run against the configuration the daemon would load,
settled against its default backend, printed (lines, or JSON with --json), and the exit
status: 0 when every finding is ok or a warning, 1 when the daemon could not start or
its default backend could not run, 2 when the configuration does not load."""

from __future__ import annotations

import os
import sys
from typing import TextIO

from sandboxd.check.artifact_probes import artifact_store_finding
from sandboxd.check.config import load_config
from sandboxd.check.dirs import dir_findings
from sandboxd.check.dockerd_probes import docker_findings
from sandboxd.check.nsjail_probes import nsjail_findings
from sandboxd.check.probes import (asset_findings, cgroup_finding, credential_file_findings, fanotify_finding,
                                   root_finding, tls_findings, workspace_findings)
from sandboxd.check.report import (CONFIG_PROBE, DAEMON, Finding, exit_status, render_json, render_text,
                                   settle)
from sandboxd.core import hostfacts
from sandboxd.core.settings import DaemonSettings


def run_check(config_path: str | None, *, as_json: bool = False, out: TextIO | None = None) -> int:
    """Checks this host for the daemon `config_path` configures (None: the embedded
    defaults), writes the report to `out` (stdout) and returns the exit status."""
    settings, errors = load_config(config_path)
    if settings is None:
        findings = [Finding(CONFIG_PROBE, "fail", e.reason, needed_by=(DAEMON,), field=e.field or None)
                    for e in errors]
    else:
        findings = settle(probe_host(settings, config_path), settings.default_backend, enabled_backends(settings))
    source = os.fspath(config_path) if config_path else "embedded defaults"
    text = render_json(findings) if as_json else render_text(findings, f"sandboxd check ({source})")
    (out or sys.stdout).write(text)
    return exit_status(findings)


def enabled_backends(settings: DaemonSettings) -> list[str]:
    """The backends the daemon tries at start (Docker always; nsjail unless disabled)."""
    return ["docker"] + (["nsjail"] if settings.nsjail.enabled else [])


def probe_host(settings: DaemonSettings, config_path: str | None) -> list[Finding]:
    """Every probe, in the order an operator fixes things: the configuration, the host,
    the engines, the places."""
    loaded = f"{config_path} loads and validates" if config_path else "no config file: the embedded defaults"
    facts = hostfacts.probe()  # the host probed once, as the daemon's start does
    findings = [Finding(CONFIG_PROBE, "ok", loaded, needed_by=(DAEMON,)), root_finding(), cgroup_finding(facts),
                fanotify_finding(settings, facts)]
    findings += asset_findings(settings)
    findings += tls_findings(settings)
    findings += credential_file_findings(settings)
    findings += docker_findings(settings)
    findings += nsjail_findings(settings, facts)
    findings += workspace_findings(settings)
    findings += dir_findings(settings)
    findings.append(artifact_store_finding(settings))
    return findings
