"""Preparation: everything between a parsed call and a compiled spec. The policy is
resolved, the backend and the image are checked against the daemon's, the host is
preflighted (the workspace must be the caller's), credentials are resolved, and the spec
is compiled; any of them refuses before anything is created. A call naming a lease gets
the lease's sandbox and a command spec for its supervisor instead."""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sandboxd.core.errors import BackendUnavailable, FailedPrecondition, InvalidArgument, PermissionDenied
from sandboxd.core.settings import DaemonSettings
from sandboxd.egress.proxy import EgressProxy
from sandboxd.ledger import events as ev
from sandboxd.outputs.tempdir import outputs_dir
from sandboxd.policy import images
from sandboxd.policy.admission import check_admission, check_private_networks
from sandboxd.policy.models import EffectivePolicy, PreparedToolCall, resolve_policy
from sandboxd.policy.always_blocked import always_blocked
from sandboxd.policy.preflight import HostPlan, preflight
from sandboxd.policy.principal import Principal
from sandboxd.pools import CommandSpec, LeaseSandbox, PoolManager
from sandboxd.recording.filewatch import FileWatchError, reader_library
from sandboxd.sandbox.protocol import Backend
from sandboxd.sandbox.spec import Attachments, EgressAttachment, SandboxIdentity
from sandboxd.secrets.broker import CredentialBroker, ResolvedSecret
from sandboxd.secrets.redact import Redactor

# Below the runtime directory: each sandbox's staged workspace roots (backends/staging.py).
STAGING_SUBDIR = "mounts"


@dataclass
class Prepared:
    call: PreparedToolCall
    policy: EffectivePolicy
    plan: HostPlan
    image: str
    image_digest: str
    backend: Backend
    spec: Any
    sandbox_id: str
    attachments: Attachments = Attachments()
    # Resolved credential values: in memory only, never in a spec, event or log.
    secrets: tuple[ResolvedSecret, ...] = ()
    # A leased call's view of the warm sandbox it runs in (its command's Sandbox).
    lease: LeaseSandbox | None = None
    # Every secret this call's output and events are redacted of: its own, and for a
    # leased call every one its sandbox was ever given (its tempDir outlives a command).
    redaction: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def egress(self) -> EgressAttachment | None:
        return self.attachments.egress

    def redactor(self) -> Redactor:
        return Redactor(dict(self.redaction) or {s.binding_id: s.value for s in self.secrets})


def records_files(policy: EffectivePolicy, settings: DaemonSettings, plan: HostPlan) -> bool:
    """Whether a call's file accesses are watched (a call without mounts has none)."""
    return policy.record_file_access and settings.file_watch and bool(plan.binds)


class Preparer:
    def __init__(self, settings: DaemonSettings, backends: Mapping[str, Backend], unavailable: Mapping[str, str],
                 daemon_id: str, broker: CredentialBroker, proxy: EgressProxy | None, no_proxy_reason: str,
                 shim: str | None, no_shim_reason: str, pools: PoolManager | None):
        self._settings = settings
        self._backends = backends
        self._unavailable = unavailable
        self._daemon_id = daemon_id
        self._broker = broker
        self._proxy = proxy
        self._no_proxy_reason = no_proxy_reason
        self._shim = shim
        self._no_shim_reason = no_shim_reason
        self._pools = pools
        # An allowlisted name the daemon's environment lacks is inherited as unset (None), not refused.
        self._inheritable = {n: os.environ.get(n) for n in settings.inheritable_env}
        always_blocked(settings.always_blocked)  # a malformed pattern stops the start, naming it

    def prepare(self, call: PreparedToolCall, tool_call_id: str, caller: Principal | None, *,
                resolve_credentials: bool = True, sandbox: bool = True) -> Prepared:
        """Everything up to the compiled spec. The workspace must be `caller`'s own (an
        admin's: any), checked before anything else of the host is looked at; None only
        for the daemon's own templates. `resolve_credentials` False (ExplainPolicy, a
        pool's template) resolves none. `sandbox` False (a command for a leased sandbox,
        which exists) stops after the host checks: no image lookup, no spec."""
        policy, backend, image = self._check_request(call, caller)
        plan = preflight(policy, call.workspace, self._settings,
                         owner_uid=None if caller is None or caller.admin else caller.uid)
        if records_files(policy, self._settings, plan):
            try:
                reader_library()  # refused here, before any sandbox is made
            except FileWatchError as exc:
                raise FailedPrecondition(f"file-access recording is unavailable on this daemon: {exc}",
                                         field="policy.audit.recordFileAccess") from None
        if not sandbox:
            return Prepared(call, policy, plan, image, "", backend, None, "")
        digest = self.resolve_allowed_image(backend, image)
        sandbox_id = "sbx-" + ev.new_id("x")[2:]
        plan = replace(plan, staging_dir=self.staging_dir(sandbox_id),
                       outputs_dir=outputs_dir(self._settings.runtime_dir, sandbox_id) if policy.persist_outputs else "")
        egress = self._egress(policy, sandbox_id)
        secrets = (self._broker.resolve(call, policy, caller.name)
                   if resolve_credentials and caller is not None else ())
        attachments = self._attachments(policy, plan, sandbox_id, egress, secrets)
        spec = backend.compile(policy, plan, SandboxIdentity(self._daemon_id, sandbox_id, tool_call_id),
                               argv=tuple(call.argv), image=image, stdin_open=bool(call.stdin),
                               attachments=attachments)
        return Prepared(call, policy, plan, image, digest, backend, spec, sandbox_id, attachments, secrets)

    def _check_request(self, call: PreparedToolCall,
                       caller: Principal | None) -> tuple[EffectivePolicy, Backend, str]:
        """The policy, the backend and the image, each refused if the daemon does not allow
        it. Every path a policy takes passes here (a call, a leased command, a pool or a
        lease, ExplainPolicy, a transfer's view), so the operator's floors are checked here."""
        check_admission(call)
        limits = self._settings.limits
        policy = resolve_policy(call, limits, self._inheritable)
        check_private_networks(policy, caller.name if caller is not None else None,
                               self._settings.egress.private_networks_principals)
        argv_bytes = sum(len(a.encode()) + 1 for a in call.argv)
        if argv_bytes > limits.max_argv_bytes:
            raise InvalidArgument(f"{argv_bytes} bytes exceed the maximum of {limits.max_argv_bytes}", field="argv")
        if len(call.stdin) > limits.max_stdin_bytes:
            raise InvalidArgument(f"{len(call.stdin)} bytes exceed the maximum of {limits.max_stdin_bytes}",
                                  field="stdin")
        backend_name = call.runtime.adapter or self._settings.default_backend
        backend = self._backends.get(backend_name)
        if backend is None:
            reason = self._unavailable.get(backend_name, "not enabled in this daemon")
            raise BackendUnavailable(f"backend {backend_name!r} is unavailable: {reason}", field="runtime.adapter")
        image = call.runtime.image or self._settings.default_image
        if not images.allowed(images.parse_reference(image).name, self._settings.allowed_images):
            raise PermissionDenied(f"image {image!r} is not in the daemon's allowed images", field="runtime.image")
        return policy, backend, image

    def _egress(self, policy: EffectivePolicy, sandbox_id: str) -> EgressAttachment | None:
        if not policy.proxied:
            return None
        if self._proxy is None:
            raise BackendUnavailable(f"egress {policy.egress!r} needs the egress proxy, which is unavailable: "
                                     f"{self._no_proxy_reason}", field="policy.network.egress")
        return EgressAttachment(str(self._proxy.socket_path(sandbox_id)), self._settings.egress.proxy_port)

    def _attachments(self, policy: EffectivePolicy, plan: HostPlan, sandbox_id: str,
                     egress: EgressAttachment | None, secrets: tuple[ResolvedSecret, ...]) -> Attachments:
        """What the daemon attaches to a fresh sandbox: the shim, the egress proxy's
        socket, the credentials' mounts, the file-watch gate."""
        gate = ""
        if records_files(policy, self._settings, plan):
            gate = str(self._settings.runtime_dir / "gates" / sandbox_id)
        attachments = Attachments(self._shim or "", egress, self._broker.mounts(sandbox_id, secrets),
                                  gate_host_path=gate)
        if attachments.needs_shim and not self._shim:
            raise BackendUnavailable(f"this call needs the sandbox shim, which is unavailable: {self._no_shim_reason}",
                                     field="policy.network.egress" if egress else "credentialRefs")
        return attachments

    def prepare_leased(self, call: PreparedToolCall, tool_call_id: str, caller: Principal) -> Prepared:
        """A call in a leased sandbox: the same checks as any call, then the lease's
        sandbox (its policy class must match) and a command spec for its supervisor."""
        prepared = self.prepare(call, tool_call_id, caller, resolve_credentials=False, sandbox=False)
        refuse_kept_tempdir(prepared.policy, "a leased sandbox's tempDir outlives the call")
        secrets = self._broker.resolve(call, prepared.policy, caller.name) if call.credential_refs else ()
        pools = self._pools
        if pools is None:
            raise FailedPrecondition("this daemon keeps no pools", field="runtime.leaseId")
        ws = pools.sandbox_for(call.runtime.lease_id, caller, prepared)
        with ExitStack() as undo:
            undo.callback(pools.command_done, ws, True)  # the sandbox is the lease's again
            refuse_unmasked(call.runtime.lease_id, prepared.plan, ws.prepared.plan)
            # The sandbox's own attachments (the proxy variables) apply to every command;
            # env secrets travel to the supervisor on its private socket, never in a spec.
            env = {**prepared.policy.env, **ws.prepared.attachments.env()}
            secret_env = {s.env_name: s.value.decode("utf-8", "surrogateescape") for s in secrets if s.env_name}
            secret_files = {s.file_path: s.value for s in secrets if s.file_path}
            policy = prepared.policy
            spec = CommandSpec(call.runtime.lease_id, ws.sandbox_id, tuple(call.argv), policy.cwd, env,
                               policy.timeout_ms, policy.max_stdout_bytes, policy.max_stderr_bytes,
                               ws.prepared.policy.temp_dir)
            # The backend stays the call's own (the lease's: the pool key matched).
            lease = LeaseSandbox(pools, ws, spec, secret_env, secret_files)
            leased = replace(prepared, spec=spec, sandbox_id=ws.sandbox_id, image_digest=ws.prepared.image_digest,
                             attachments=Attachments(), lease=lease, secrets=secrets,
                             redaction=ws.remember_secrets(secrets))
            undo.pop_all()
        return leased

    def resolve_allowed_image(self, backend: Backend, image: str) -> str:
        return resolve_allowed_image(self._settings.allowed_images, backend, image)

    def staging_dir(self, sandbox_id: str) -> str:
        return staging_dir(self._settings.runtime_dir, sandbox_id)


def resolve_allowed_image(allowed_images: tuple[str, ...], backend: Backend, image: str) -> str:
    """The digest of the local image `image` names, which must itself carry an allowed
    name: an allowed name that the engine resolves to another image (a short id, a name
    it cleans up) is refused, on every backend."""
    digest, names = backend.resolve_image(image)
    if not images.allowed_resolution(names, allowed_images):
        shown = ", ".join(names[:5]) or "no name"
        raise PermissionDenied(f"image {image!r} resolves to {digest[:19]} ({shown}), which is not in the "
                               "daemon's allowed images", field="runtime.image")
    return digest


def refuse_unmasked(lease_id: str, command: HostPlan, sandbox: HostPlan) -> None:
    """A leased command's masks, found now, against its sandbox's, placed when it was made:
    a blocked path the sandbox does not mask on the same inode would be visible to the
    command. It appeared since (created by the owner, or by an earlier command), or was
    replaced (an editor's rename over it, which also takes the mount off the old inode in
    every namespace). Refused; a new lease's sandbox masks it."""
    masked = {(m.sandbox_path, m.dev, m.ino) for m in sandbox.masks}
    for m in command.masks:
        if (m.sandbox_path, m.dev, m.ino) not in masked:
            raise FailedPrecondition(f"lease {lease_id}: {m.sandbox_path} (blocked by {m.rule or 'the policy'}) is not "
                                     "masked in its sandbox: it appeared or was replaced after the sandbox was made; "
                                     "release the lease and acquire another", field="runtime.leaseId")


def refuse_kept_tempdir(policy: EffectivePolicy, why: str) -> None:
    """persistOutputs needs a sandbox of the call's own: its tempDir is walked after it is gone."""
    if policy.persist_outputs:
        raise FailedPrecondition(f"persistOutputs needs a fresh sandbox: {why}", field="policy.filesystem.persistOutputs")


def staging_dir(runtime_dir: Path, sandbox_id: str) -> str:
    """Where a new sandbox's workspace roots are bound before the engine mounts them."""
    return str(runtime_dir / STAGING_SUBDIR / sandbox_id)
