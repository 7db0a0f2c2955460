"""What a parsed call must still pass to be admitted: its authorization (a status this
daemon runs, an expiry not passed) and the operator's floors under its policy (only the
principals egress.private_networks_principals lists may lower denyPrivateNetworks)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

from sandboxd.core.errors import InvalidArgument, PermissionDenied
from sandboxd.policy.models import EffectivePolicy, PreparedToolCall

# The setting that lets a principal lower denyPrivateNetworks (core/settings.py, EgressSettings).
PRIVATE_NETWORKS_SETTING = "egress.private_networks_principals"


def check_private_networks(policy: EffectivePolicy, principal: str | None, allowed: Sequence[str]) -> None:
    """The operator's floor under denyPrivateNetworks: false (private, link-local and
    unique-local addresses reachable, through the proxy or on the engine's own network)
    only for a principal in `allowed` ("*": every one). `principal` None (no caller: the
    daemon's own) is listed only by "*"."""
    if policy.deny_private_networks or "*" in allowed or (principal is not None and principal in allowed):
        return
    who = f"principal {principal!r} is" if principal is not None else "no principal is"
    raise PermissionDenied(f"false lets the sandbox reach private and link-local addresses, which only the principals "
                           f"the operator lists in {PRIVATE_NETWORKS_SETTING} may ask for ({who} not listed)",
                           field="policy.network.denyPrivateNetworks")


def check_admission(call: PreparedToolCall, now: datetime | None = None) -> None:
    """Refusals that depend on what this daemon supports and on the authorization."""
    status = call.authorization.status
    if status not in ("granted", "not_required"):
        shown = status or "(empty)"
        raise PermissionDenied(f"status {shown!r} is neither 'granted' nor 'not_required'", field="authorization.status")
    if call.authorization.expires_at:
        try:
            expires = datetime.fromisoformat(call.authorization.expires_at.replace("Z", "+00:00"))
        except ValueError:
            raise InvalidArgument("not an RFC 3339 time", field="authorization.expiresAt") from None
        if expires.tzinfo is None:
            raise InvalidArgument("needs a time zone", field="authorization.expiresAt")
        if expires <= (now or datetime.now(timezone.utc)):
            raise PermissionDenied(f"the grant expired at {call.authorization.expires_at}", field="authorization.expiresAt")
