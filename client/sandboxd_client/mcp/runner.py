"""The daemon under the server: one connection, and a warm lease that the server's
commands run in one after another (a leased sandbox runs one command at a time), so a
session's next command starts without a container start.

The lease is taken at the first call and given back when the server ends. A lease that
was lost (expired, its sandbox gone, the daemon restarted) is replaced and the call sent
again: the daemon refuses a call on a lost lease before running anything, so nothing runs
twice. A daemon without pools gets calls in fresh sandboxes. A daemon that does not
answer fails the call with UNAVAILABLE; the next call connects anew (a fresh channel,
not one waiting out gRPC's reconnect backoff), so the server serves again as soon as the
daemon is back. Blocking: the server calls it from worker threads."""

from __future__ import annotations

import io
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..client import CallOutcome, SandboxdClient
from ..errors import FailedPrecondition, NotFound, SandboxdClientError, Unavailable, Unimplemented
from sandboxd_contract.pb import sandboxd_pb2 as pb

log = logging.getLogger("sandboxd_client.mcp.runner")

# How long an acquire may wait for a sandbox when the pool is at its maximum.
ACQUIRE_WAIT_MS = 10_000
# A Run's deadline beyond the command's own timeout (the call's setup and its result).
RUN_GRACE_S = 60.0
# Artifacts this server named in its results: the ones it offers as resources.
MAX_KNOWN_ARTIFACTS = 1000


class ArtifactUnavailable(Exception):
    """An artifact this server cannot offer: not one of its own, or larger than the cap."""


class DaemonRunner:
    def __init__(self, connect: Callable[[], SandboxdClient], *, workspace: str, policy: dict[str, Any],
                 image: str = "", adapter: str = "", lease: bool = True):
        self._connect = connect
        self._workspace = workspace
        self._policy = policy
        self._image = image
        self._adapter = adapter
        self._leasing = lease
        self._lock = threading.Lock()  # one call at a time: the lease runs one command at a time
        self._artifacts_lock = threading.Lock()  # (a resource read never waits for a command)
        self._client: SandboxdClient | None = None
        self._lease: pb.Lease | None = None
        self._artifacts: OrderedDict[str, pb.ArtifactRef] = OrderedDict()

    @property
    def lease_id(self) -> str:
        return self._lease.lease_id if self._lease is not None else ""

    def run(self, call: dict[str, Any], timeout_ms: int) -> CallOutcome:
        """Runs `call` (its JSON form, without runtime.leaseId) in the lease, or fresh."""
        with self._lock:
            try:
                outcome = self._run(call, timeout_ms / 1000 + RUN_GRACE_S)
            except Unavailable:
                self._disconnect()
                raise
            with self._artifacts_lock:
                for ref in outcome.result.artifacts:
                    self._remember(ref)
            return outcome

    def _run(self, call: dict[str, Any], deadline_s: float) -> CallOutcome:
        client = self._connected()
        lease_id = self._lease_for(client)
        try:
            return client.run(_in_lease(call, lease_id), timeout_s=deadline_s)
        except (NotFound, FailedPrecondition) as exc:
            if not lease_id or lease_id not in exc.message:
                raise
            log.info("lease %s is lost (%s): taking another", lease_id, exc.message)
            self._lease = None
            if isinstance(exc, FailedPrecondition):  # its sandbox is gone: the lease itself is still held
                _quietly(client.release_sandbox, lease_id)
            return client.run(_in_lease(call, self._lease_for(client)), timeout_s=deadline_s)

    def _connected(self) -> SandboxdClient:
        if self._client is None:
            self._client = self._connect()
        return self._client

    def _disconnect(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _lease_for(self, client: SandboxdClient) -> str:
        """The lease's id, taken now if there is none; "" for a fresh sandbox."""
        if self._lease is not None or not self._leasing:
            return self.lease_id
        try:
            self._lease = client.acquire_sandbox(self._workspace, self._policy, image=self._image,
                                                 adapter=self._adapter, wait_ms=ACQUIRE_WAIT_MS)
        except (FailedPrecondition, Unimplemented) as exc:
            # A daemon without pools (or one whose pools cannot take this policy): every
            # call gets a fresh sandbox instead, for the server's life.
            log.warning("no warm lease (%s: %s): each call runs in a fresh sandbox", exc.code.name, exc.message)
            self._leasing = False
            return ""
        except Unavailable:
            raise
        except SandboxdClientError as exc:  # e.g. at its lease quota: this call runs fresh
            log.warning("no warm lease for this call (%s: %s)", exc.code.name, exc.message)
            return ""
        log.info("leased sandbox %s (lease %s, %s)", self._lease.sandbox_id, self._lease.lease_id, self._lease.backend)
        return self._lease.lease_id

    def close(self) -> None:
        """Gives the lease back and closes the connection (the server is ending)."""
        with self._lock:
            lease_id = self.lease_id
            self._lease = None
            if lease_id:
                try:
                    self._connected().release_sandbox(lease_id)
                    log.info("released lease %s", lease_id)
                except SandboxdClientError as exc:  # expired, or the daemon is gone: it reaps it
                    log.info("lease %s not released (%s: %s)", lease_id, exc.code.name, exc.message)
            self._disconnect()

    def release_now(self) -> None:
        """At a signal: the lease given back at once, over a connection of its own, even
        while a command runs in it (the daemon ends the lease after that command; the
        command itself is cancelled when this process, its caller, goes away)."""
        lease_id = self.lease_id
        self._lease = None
        if lease_id:
            try:
                with self._connect() as client:
                    client.release_sandbox(lease_id)
            except SandboxdClientError as exc:
                log.info("lease %s not released (%s: %s)", lease_id, exc.code.name, exc.message)

    # -- artifacts -----------------------------------------------------------------------
    def _remember(self, ref: pb.ArtifactRef) -> None:
        self._artifacts[ref.artifact_id] = ref
        self._artifacts.move_to_end(ref.artifact_id)
        while len(self._artifacts) > MAX_KNOWN_ARTIFACTS:
            self._artifacts.popitem(last=False)

    def known_artifacts(self) -> list[pb.ArtifactRef]:
        """The artifacts this server named, newest first."""
        with self._artifacts_lock:
            return list(reversed(self._artifacts.values()))

    def download(self, artifact_id: str, cap_bytes: int) -> tuple[pb.ArtifactRef, bytes]:
        """An artifact this server named in a result (others are refused: a model reads
        what its own calls produced, not whatever else this principal stored), over a
        connection of its own (a command may be running on the other)."""
        with self._artifacts_lock:
            ref = self._artifacts.get(artifact_id)
        if ref is None:
            raise ArtifactUnavailable(f"artifact {artifact_id} is not one this server's calls produced")
        if ref.size_bytes > cap_bytes:
            raise ArtifactUnavailable(f"artifact {artifact_id} is {ref.size_bytes} bytes, more than the "
                                      f"{cap_bytes} bytes a resource read returns (sandboxctl artifact get "
                                      f"{artifact_id} has it whole)")
        sink = io.BytesIO()
        with self._connect() as client:
            client.download_artifact(artifact_id, sink)
        return ref, sink.getvalue()


def _in_lease(call: dict[str, Any], lease_id: str) -> dict[str, Any]:
    runtime = dict(call.get("runtime") or {})
    runtime["leaseId"] = lease_id
    return {**call, "runtime": runtime}


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except SandboxdClientError:
        pass
