"""Workspace reservations. A call that can write a workspace runs alone on it: its
writes could swap a directory for a symlink between another call's host checks and that
call's mounts, redirecting a bind (or a mask) to anywhere its owner can reach. So while a
writer runs nobody else mounts the workspace, and the other way round. Nested workspaces
count as one: a writer of /a can swap what a call on /a/b mounts, and a writer of /a/b
what a call on /a finds inside it."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from sandboxd.core.errors import Aborted, FailedPrecondition
from sandboxd.policy.models import is_within
from sandboxd.policy.preflight import HostPlan


def conflicting_holder(users: Mapping[str, tuple[str, bool]], workspace: str, writes: bool) -> str | None:
    """The holder a new user of `workspace` (a writer if `writes`) must wait for: any
    writer of the same, an enclosing or an enclosed workspace, or any user of one when
    the newcomer writes. None when it may go ahead."""
    others = [(holder, w) for holder, (ws, w) in users.items()
              if is_within(ws, workspace) or is_within(workspace, ws)]
    if any(w for _, w in others) or (writes and others):
        return others[0][0]
    return None


class WorkspaceReservations:
    """holder (a tool_call_id, or "pool:<sandbox>") -> (host workspace, can write it),
    from admission to the sandbox's removal."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: dict[str, tuple[str, bool]] = {}
        self._closing = False

    def reserve(self, holder: str, plan: HostPlan) -> None:
        workspace = plan.workspace
        writes = plan.writes_workspace
        with self._lock:
            if self._closing:
                raise FailedPrecondition("the daemon is shutting down")
            other = conflicting_holder(self._users, workspace, writes)
            if other is not None:
                raise Aborted(f"call {other} is using this workspace and one of the two can write it; "
                              "calls that write a workspace run alone on it (retry when it is done)",
                              field="workspace")
            self._users[holder] = (workspace, writes)

    def release(self, holder: str) -> None:
        with self._lock:
            self._users.pop(holder, None)

    def close(self) -> None:
        """No reservation is taken from now on (the daemon is shutting down)."""
        with self._lock:
            self._closing = True
