"""FileService's work: a transfer's target resolved (a workspace, with the checks a call
on it would pass and its reservation; or a leased sandbox, held so that no command runs
in it meanwhile), its paths placed by rules.py, its files moved by upload.py or
download.py as the sandbox's user, and its one FilesTransferred event recorded, refused
or done, under the transfer's own id."""

from __future__ import annotations

import posixpath
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from sandboxd.calls.executor import CallExecutor
from sandboxd.core.as_user import AsUser
from sandboxd.core.errors import Aborted, InvalidArgument, NotFound, ResourceExhausted, SandboxdError
from sandboxd.ledger import call_rows, transfer_usage
from sandboxd.ledger import events as ev
from sandboxd.ledger.event_types import FilesTransferred, draft
from sandboxd.core.settings import DaemonSettings
from sandboxd.policy.preflight import always_blocked_rule
from sandboxd.policy.principal import Principal
from sandboxd.secrets.redact import Redactor
from sandboxd.transfer.download import Download, Part
from sandboxd.transfer.rules import MAX_TRANSFER_PATH_BYTES, Where, entry_parts, join, place, sandbox_path
from sandboxd.transfer.tree import Walker, too_long, too_many
from sandboxd.transfer.upload import UploadStaging

# What the record keeps of a refusal's strings.
REASON_CHARS = 1024


@dataclass
class UploadPart:
    """One UploadRequest, transport-free: the target and path (first message), an entry
    ({path, kind, mode, sizeBytes, sha256}) and data."""

    target: Mapping[str, Any] | None = None
    path: str = ""
    entry: Mapping[str, Any] | None = None
    data: bytes = b""
    commit: bool = False


@dataclass
class _Record:
    principal: str
    direction: str
    path: str = ""
    workspace: str = ""
    lease_id: str = ""
    entries: list[dict[str, Any]] = field(default_factory=list)
    total: int = 0
    # What a leased sandbox was ever given: a download from it is redacted of them.
    secrets: dict[str, bytes] = field(default_factory=dict)


class FileTransfers:
    def __init__(self, executor: CallExecutor):
        self._executor = executor
        self._settings = executor.settings.transfers

    # -- the record ----------------------------------------------------------------------
    def _record(self, transfer_id: str, rec: _Record, exc: BaseException | None) -> None:
        status, code, where, reason = "ok", "", "", ""
        if isinstance(exc, SandboxdError):
            status = "refused" if not rec.entries and not rec.total else "failed"
            code, where, reason = exc.kind, exc.field or "", exc.reason[:REASON_CHARS]
        elif exc is not None:
            status, code, reason = "failed", "cancelled" if isinstance(exc, GeneratorExit) else "internal", str(exc)
        event = FilesTransferred(rec.principal, rec.direction, rec.workspace, rec.lease_id, rec.path[:4096], status,
                                 rec.entries, rec.total, code, where, reason[:REASON_CHARS])
        db = self._executor.db
        with db.transaction() as conn:
            call_rows.insert_owner(conn, transfer_id, rec.principal)
            self._executor.events.append(conn, transfer_id, "", [draft(event)])
            transfer_usage.add(conn, transfer_id, rec.principal, len(rec.entries))
        if isinstance(exc, SandboxdError):
            exc.tool_call_id = transfer_id

    def _within_quota(self, principal: str) -> None:
        """Refused before anything is looked at once the principal's records name their
        quota's worth of entries (one transfer may pass it by its own max_entries)."""
        quota = self._executor.settings.quotas.transfer_entries
        if quota and transfer_usage.recorded_entries(self._executor.db, principal) >= quota:
            raise ResourceExhausted(f"the transfer records of {principal} already name {quota} files and directories "
                                    "(quotas.transfer_entries): retention (retention.period_days) frees room as it "
                                    "removes old ones")

    # -- the target ----------------------------------------------------------------------
    @contextmanager
    def _where(self, target: Mapping[str, Any], caller: Principal, transfer_id: str, rec: _Record,
               write: bool) -> Iterator[Where]:
        workspace, lease_id = target.get("workspace", ""), target.get("leaseId", "")
        if bool(workspace) == bool(lease_id):
            raise InvalidArgument("name exactly one of workspace and leaseId", field="target")
        if lease_id:
            rec.lease_id = lease_id
            pools = self._executor.pools
            if pools is None:
                raise NotFound(f"no lease {lease_id}", field="target.leaseId")
            ws = pools.hold(lease_id, caller, transfer_id)
            try:
                built = ws.prepared
                rec.workspace = built.plan.workspace
                rec.secrets = dict(ws.secrets_seen)
                yield replace(_where_of(built.plan, built.policy, lease_id, self._executor.settings),
                              temp_pid=ws.init_pid(), init_pid_now=ws.init_pid)
            finally:
                pools.command_done(ws, True)
            return
        rec.workspace = workspace
        prepared = self._executor.prepare_transfer(workspace, target.get("policy"), caller)
        rec.workspace = prepared.plan.workspace
        reservations = self._executor.reservations
        reservations.reserve(transfer_id, prepared.plan if write else _reader(prepared.plan))
        try:
            yield _where_of(prepared.plan, prepared.policy, "", self._executor.settings)
        finally:
            reservations.release(transfer_id)

    # -- upload --------------------------------------------------------------------------
    def upload(self, parts: Iterator[UploadPart], caller: Principal) -> dict[str, Any]:
        transfer_id = ev.new_id("xfer")
        rec = _Record(caller.name, "upload")
        try:
            first = next(parts, None)
            if first is None or first.target is None:
                raise InvalidArgument("the first message names the target and the path", field="target")
            rec.path = sandbox_path(first.path, "path")
            self._within_quota(caller.name)
            with self._where(first.target, caller, transfer_id, rec, write=True) as where:
                place(where, rec.path, write=True, field="path")  # refused before anything is received
                rec.entries = self._receive(first, parts, where, transfer_id, rec)
        except BaseException as exc:
            self._record(transfer_id, rec, exc)
            raise
        self._record(transfer_id, rec, None)
        return {"transferId": transfer_id, "entries": rec.entries, "totalBytes": rec.total}

    def _receive(self, first: UploadPart, parts: Iterator[UploadPart], where: Where, transfer_id: str,
                 rec: _Record) -> list[dict[str, Any]]:
        caps = self._settings
        max_bytes = caps.max_upload_mb * 2**20
        with ExitStack() as stack:
            fs = stack.enter_context(AsUser(where.uid, where.gid))
            walker = Walker(fs, where, write=True)
            stack.callback(walker.close)
            staging = UploadStaging(fs, where, walker, transfer_id)
            stack.callback(staging.rollback)  # a no-op once committed
            names = _Names()
            declared = 0
            message: UploadPart | None = first
            committed = False
            while message is not None:
                if committed:
                    raise InvalidArgument("a message after the commit message: commit comes last", field="commit")
                if message.entry is not None:
                    staging.end_file()
                    declared = self._begin(staging, where, rec.path, message.entry, names, declared, max_bytes)
                if message.data:
                    staging.write(message.data)
                committed = message.commit
                message = next(parts, None)
            if not committed:  # a stream cut off ends as one the client ended can: only this tells them apart
                raise Aborted("the stream ended without its commit message (the client gone, or the stream cut "
                              "off): nothing of it landed", field="commit")
            staging.end_file()
            try:
                staging.commit()
            finally:  # stopped halfway, the record says what landed
                rec.entries = staging.landed
                rec.total = sum(e.get("sizeBytes", 0) for e in staging.landed)
            return staging.landed

    def _begin(self, staging: UploadStaging, where: Where, base: str, entry: Mapping[str, Any], names: _Names,
               declared: int, max_bytes: int) -> int:
        """Starts an entry; the bytes declared so far. Refused past a cap before any of
        its bytes is written."""
        field = f"entries[{len(names.seen)}]"
        parts = entry_parts(str(entry.get("path", "")), f"{field}.path")
        path = join(base, parts)
        kind = entry.get("kind") or "file"
        names.add(path, kind, f"{field}.path")
        if len(names.seen) > self._settings.max_entries:
            raise too_many(self._settings.max_entries, field)
        mode = int(entry.get("mode", 0))
        placed = place(where, path, write=True, field=f"{field}.path")
        if kind == "dir":
            staging.add_dir(placed, mode, field)
            return declared
        if kind != "file":
            raise InvalidArgument(f"kind {kind!r}: only 'file' and 'dir' are uploaded", field=f"{field}.kind")
        size = int(entry.get("sizeBytes", 0))
        if declared + size > max_bytes:
            raise ResourceExhausted(f"{declared + size} bytes declared, more than the {max_bytes} one upload may "
                                    "carry (transfers.max_upload_mb)", field=f"{field}.sizeBytes")
        staging.begin_file(placed, size, str(entry.get("sha256", "")), mode, field)
        return declared + size

    # -- download ------------------------------------------------------------------------
    def download(self, target: Mapping[str, Any], path: str, caller: Principal) -> Iterator[Part]:
        """("entry", ...), ("data", ...), ("done", ...) parts, then ("result", ...)."""
        transfer_id = ev.new_id("xfer")
        rec = _Record(caller.name, "download")
        try:
            rec.path = sandbox_path(path, "path")
            self._within_quota(caller.name)
            with ExitStack() as stack:
                where = stack.enter_context(self._where(target, caller, transfer_id, rec, write=False))
                placed = place(where, rec.path, write=False, field="path")
                fs = stack.enter_context(AsUser(where.uid, where.gid))
                walker = Walker(fs, where, write=False)
                stack.callback(walker.close)
                caps = self._settings
                download = Download(fs, where, walker, placed, caps.max_download_mb * 2**20, caps.max_entries,
                                    rec.secrets, self._executor.settings.state_dir)
                found = download.plan()
                try:
                    yield from download.send(found)
                finally:
                    rec.entries, rec.total = download.records, download.total
                skipped = [download.redact_text(line) for line in download.skipped.lines()]
        except BaseException as exc:
            if rec.secrets and isinstance(exc, SandboxdError):  # its reason may name what the sandbox made
                _redact_reason(exc, rec.secrets)
            self._record(transfer_id, rec, exc)
            raise
        self._record(transfer_id, rec, None)
        yield "result", {"transferId": transfer_id, "entries": rec.entries, "totalBytes": rec.total,
                         "skipped": skipped}


class _Names:
    """An upload's entry paths so far: none named twice, and none below a file entry
    (nor a file above one): both would land only in part."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self._path_bytes = 0
        self._files: set[str] = set()
        self._above: set[str] = set()  # every directory some entry is below

    def add(self, path: str, kind: str, field: str) -> None:
        if path in self.seen:
            raise InvalidArgument(f"{path} is named twice", field=field)
        self._path_bytes += len(path.encode("utf-8", "surrogateescape"))
        if self._path_bytes > MAX_TRANSFER_PATH_BYTES:
            raise too_long(field)
        # Up to the first directory already known: those above it are known too, and
        # none of them is a file (each add refuses that), so the work is once per name.
        ancestors = [posixpath.dirname(path)]
        while ancestors[-1] not in self._above and ancestors[-1] != "/":
            ancestors.append(posixpath.dirname(ancestors[-1]))
        clash = next((a for a in ancestors if a in self._files), None)
        if clash is not None:
            raise InvalidArgument(f"{path} is below {clash}, a file of this upload", field=field)
        if kind == "file" and path in self._above:
            raise InvalidArgument(f"{path} is a file of this upload, and other entries are below it", field=field)
        self.seen.add(path)
        self._above.update(ancestors)
        if kind == "file":
            self._files.add(path)


def _redact_reason(exc: SandboxdError, secrets: dict[str, bytes]) -> None:
    exc.reason = Redactor(secrets).redact_text(exc.reason)
    exc.args = (exc.message,)


def _where_of(plan: Any, policy: Any, lease_id: str, settings: DaemonSettings) -> Where:
    def always_blocked(path: str) -> str | None:
        return always_blocked_rule(settings, plan.workspace, path)

    return Where(plan.binds, plan.masks, tuple(policy.blocked_paths), policy.temp_dir, plan.uid, plan.gid,
                 plan.workspace, lease_id, always_blocked=always_blocked)


def _reader(plan: Any) -> Any:
    """The plan as a reader's: a download writes nothing, so it may share the workspace
    with other readers (never with a writer)."""
    return replace(plan, binds=tuple(replace(b, read_only=True) for b in plan.binds))
