"""Shared fixtures of the unit suite: pure code only (no Docker, no network)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from sandboxd.policy.models import parse_call, resolve_policy
from sandboxd.core.settings import DaemonSettings, LimitSettings

# Explicit maxima so that nothing depends on the machine (max_cpu_millicores
# defaults to the host's CPU count).
LIMITS = LimitSettings(max_cpu_millicores=8000)
WORKSPACE_UID = 1000
WORKSPACE_GID = 1001


def call_dict(**fields: Any) -> dict[str, Any]:
    """The smallest valid PreparedToolCall in its JSON (camelCase) form."""
    base: dict[str, Any] = {
        "toolId": "unit.tool",
        "argv": ["true"],
        "workspace": "/srv/sandboxd/workspaces/alice",
        "authorization": {"status": "not_required"},
    }
    base.update(fields)
    return base


def resolve(policy: dict | None = None, *, limits: LimitSettings = LIMITS,
            inheritable: dict[str, str] | None = None, **fields: Any):
    data = call_dict(**fields)
    if policy is not None:
        data["policy"] = policy
    return resolve_policy(parse_call(data), limits, inheritable or {})


@pytest.fixture
def limits() -> LimitSettings:
    return LIMITS


@pytest.fixture
def host(tmp_path: Path):
    """A workspace root with one non-root-owned workspace in it, and settings for it."""
    roots = tmp_path / "roots"
    ws = roots / "alice"
    ws.mkdir(parents=True)
    os.chown(ws, WORKSPACE_UID, WORKSPACE_GID)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("outside secret")
    settings = DaemonSettings(workspace_roots=(roots,), state_dir=tmp_path / "state",
                              socket_path=tmp_path / "run" / "sandboxd.sock")

    class Host:
        pass

    h = Host()
    h.tmp = tmp_path
    h.roots = roots
    h.ws = ws
    h.outside = outside
    h.settings = settings
    return h
