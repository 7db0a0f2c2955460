"""What a pool is keyed by and made from, and what it needs from outside: a pool holds
sandboxes for one (workspace, image, backend, policy class), made from a template that
the calls package prepares; the fields each command brings itself (cwd, env, timeout,
output caps, recording) are not part of the class."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sandboxd.policy.models import EffectivePolicy, canonical_json
from sandboxd.policy.preflight import HostPlan
from sandboxd.sandbox.protocol import Backend
from sandboxd.sandbox.spec import Attachments

# Fields of a policy that each command brings itself; the rest fixes the sandbox.
PER_COMMAND = ("cwd", "env", "timeoutMs", "maxStdoutBytes", "maxStderrBytes", "recordCommand", "recordFileAccess",
               "recordNetworkAccess")


def policy_class(policy: EffectivePolicy) -> dict[str, Any]:
    return {k: v for k, v in policy.to_json_dict().items() if k not in PER_COMMAND}


def pool_key(workspace: str, image: str, backend: str, uid: int, gid: int, policy: EffectivePolicy) -> str:
    body = {"workspace": workspace, "image": image, "backend": backend, "uid": uid, "gid": gid,
            "policy": policy_class(policy)}
    return "pool-" + hashlib.sha256(canonical_json(body)).hexdigest()[:16]


class PoolTemplate(Protocol):
    """What a pool's sandboxes are made from (and what a leased call is matched against):
    the parts of a prepared call that fix a sandbox. calls/ hands its own prepared call."""

    @property
    def policy(self) -> EffectivePolicy: ...

    @property
    def plan(self) -> HostPlan: ...

    @property
    def image(self) -> str: ...

    @property
    def backend(self) -> Backend: ...

    @property
    def secrets(self) -> Sequence[object]: ...  # resolved credentials: a pool takes none


def template_key(template: PoolTemplate) -> str:
    """The key of the pool whose sandboxes `template` would make."""
    plan = template.plan
    return pool_key(plan.workspace, template.image, template.backend.name, plan.uid, plan.gid, template.policy)


@dataclass(frozen=True)
class BuiltSandbox:
    """What a warm sandbox was made as: its template's policy, plan and image, the image's
    digest when it was made, and what its backend was told (the spec as placed)."""

    sandbox_id: str
    policy: EffectivePolicy
    plan: HostPlan
    image: str
    image_digest: str
    backend: Backend
    spec: Any
    attachments: Attachments


class WorkspaceReservations(Protocol):
    """Who holds which workspace (calls/ keeps them, for its calls and for pool sandboxes).
    A warm sandbox holds its template's workspace, as "pool:<sandbox id>", from before it
    is created until it is destroyed."""

    def reserve(self, owner: str, plan: HostPlan, /) -> None:
        """Takes `plan`'s workspace for `owner`. Raises Aborted while another holder of it
        (or of a workspace enclosing or enclosed by it) conflicts (either can write it),
        FailedPrecondition once the daemon is shutting down."""

    def release(self, owner: str, /) -> None:
        """Gives back what `owner` holds; nothing if it holds nothing."""
