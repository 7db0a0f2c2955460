"""At the daemon's start: what an earlier run left. Calls it accepted but never finished
get a recorded end (with what they printed before the crash), so that the log answers for
them and their idempotency keys never run them again; leases it held end on the record;
staged workspace mounts, spool files and half-written blobs are removed."""

from __future__ import annotations

import hashlib
import logging
import shutil

from sandboxd.backends import staging
from sandboxd.calls.acceptance import lease_ended_draft
from sandboxd.calls.placement import spool_name
from sandboxd.calls.prepare import STAGING_SUBDIR
from sandboxd.calls.result import interrupted_call
from sandboxd.core.settings import DaemonSettings
from sandboxd.ledger import call_rows
from sandboxd.ledger import events as ev
from sandboxd.ledger.artifacts import ArtifactRecord, FileArtifactStore
from sandboxd.ledger.event_types import SandboxLeased, ToolPolicyChecked, ToolSandboxPrepared, read
from sandboxd.ledger.events import Event, EventLog
from sandboxd.ledger.store import Database

log = logging.getLogger("sandboxd.calls.recovery")


def clean_spool(settings: DaemonSettings) -> None:
    """Spool files of calls that a crashed daemon never finished."""
    shutil.rmtree(settings.spool_dir, ignore_errors=True)
    settings.spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)


def clean_incoming(artifacts: FileArtifactStore) -> int:
    """Blobs a crashed daemon was still writing (a collected file, a diff, never put):
    removed. Returns how many."""
    removed = 0
    for entry in artifacts.incoming_dir().iterdir():
        if entry.is_file() and not entry.is_symlink():
            entry.unlink(missing_ok=True)
            removed += 1
    return removed


def recover_interrupted(settings: DaemonSettings, db: Database, events: EventLog,
                        artifacts: FileArtifactStore) -> int:
    """Each unfinished call ends as INTERRUPTED; returns how many did. Their sandboxes'
    staged roots are unmounted first (the sandboxes are gone)."""
    left = staging.reap(str(settings.runtime_dir / STAGING_SUBDIR))
    if left:
        log.warning("removed %d staged workspace mounts an earlier run left", left)
    unfinished = call_rows.unfinished_calls(db)
    for tool_call_id in unfinished:
        trace = events.for_call(tool_call_id)
        named = [t for t in (_sandbox_naming(e) for e in trace) if t is not None]
        leased = any(t.lease_id for t in named)
        records = (salvage_output(settings, artifacts, tool_call_id, named[-1].sandbox_id, leased)
                   if named else [])
        ended = interrupted_call(tool_call_id, records, ev.new_id("ev"), ev.new_id("ev"))
        with db.transaction() as conn:
            for r in records:
                artifacts.insert(conn, r)
            events.append(conn, tool_call_id, trace[-1].event_id, ended.drafts)
    close_open_leases(db, events)
    return len(unfinished)


def _sandbox_naming(event: Event) -> ToolPolicyChecked | ToolSandboxPrepared | None:
    """The events of a call that name its sandbox (and its lease): admission's and the
    sandbox's preparation, when they name one."""
    if event.type not in (ev.POLICY_CHECKED, ev.SANDBOX_PREPARED):
        return None
    typed = read(event)
    assert isinstance(typed, (ToolPolicyChecked, ToolSandboxPrepared))
    return typed if isinstance(typed.sandbox_id, str) and typed.sandbox_id else None


def close_open_leases(db: Database, events: EventLog) -> None:
    """Leases a killed daemon held end on the record: their sandboxes were reaped
    with everything else it left."""
    leases = call_rows.open_leases(db)
    for lease_id in leases:
        trace = events.for_call(lease_id)
        leased = SandboxLeased.from_payload(trace[0].payload)
        events.record(lease_id, trace[-1].event_id, [lease_ended_draft(leased.sandbox_id)])
    if leases:
        log.warning("ended %d leases an earlier run of this daemon held", len(leases))


def salvage_output(settings: DaemonSettings, artifacts: FileArtifactStore, tool_call_id: str, sandbox_id: str,
                   leased: bool = False) -> list[ArtifactRecord]:
    """What an interrupted call printed before the crash, from its spool files."""
    records = []
    name = spool_name(sandbox_id, tool_call_id, leased)
    if "/" in name or name in (".", ".."):
        return []
    for kind in ("stdout", "stderr"):
        path = settings.spool_dir / name / f"{kind}.out"
        if not path.exists() or path.stat().st_size == 0:
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        content_hash = "sha256:" + digest.hexdigest()
        size = path.stat().st_size
        artifacts.put_blob(path, content_hash)
        records.append(ArtifactRecord(ev.new_id("art"), tool_call_id, ev.new_id("ev"), kind, content_hash, size,
                                      f"{kind} of {tool_call_id} up to the interruption: {size} bytes",
                                      ev.utc_now()))
    return records
