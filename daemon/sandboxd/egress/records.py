"""The egress proxy's records: one ConnectionRecord per attempt (the call's
NetworkAccessObserved event), the per-sandbox EgressEndpoint that holds them, and the
summary of what a call reached (effectsObserved.externalCalls)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from sandboxd.ledger import events as ev
from sandboxd.ledger.event_types import ConnectionAttempt, NetworkAccessObserved
from sandboxd.policy.egress_rules import EgressRules


@dataclass
class ConnectionRecord:
    """One attempt to reach something through the proxy."""

    protocol: str  # "http" | "connect" | "socks5"
    method: str = ""
    host: str = ""
    port: int = 0
    address: str = ""
    decision: str = "denied"  # "allowed" | "denied"
    rule: str = ""
    reason: str = ""
    error: str = ""
    status: int = 0  # what the proxy answered the client (200 for an established tunnel)
    bytes_up: int = 0  # sandbox -> destination
    bytes_down: int = 0  # destination -> sandbox
    started_at: str = field(default_factory=ev.utc_now)
    ended_at: str = ""

    def observed(self) -> NetworkAccessObserved:
        """The attempt as its NetworkAccessObserved event."""
        return NetworkAccessObserved(attempt=ConnectionAttempt(
            self.protocol, self.method, self.host, self.port, self.address, self.decision, self.rule, self.reason,
            self.error, self.status, self.bytes_up, self.bytes_down, self.started_at, self.ended_at))


@dataclass
class EgressEndpoint:
    sandbox_id: str
    socket_path: Path
    rules: EgressRules
    record_allowed: bool
    records: list[ConnectionRecord] = field(default_factory=list)
    dropped_records: int = 0
    nameless_records: int = 0
    # Past max_records: (host, port, decision) -> [attempts, bytes up, bytes down].
    overflow: dict[tuple[str, int, str], list[int]] = field(default_factory=dict)
    server: asyncio.base_events.Server | None = None
    tasks: set[asyncio.Task] = field(default_factory=set)
    # Every transport of the endpoint (both sides): aborted when the sandbox ends.
    transports: set[asyncio.BaseTransport] = field(default_factory=set)
    dns_slots: asyncio.Semaphore | None = None
    # Errors the handler did not expect (a bug: logged in full once per endpoint).
    unexpected_errors: int = 0


def summarize_external_calls(records: list[ConnectionRecord],
                             overflow: dict[tuple[str, int, str], list[int]] | None = None) -> list[str]:
    """ToolResult.effectsObserved.externalCalls: each destination the call reached, once
    (including those past the record's size, counted in `overflow`)."""
    seen: list[str] = []
    for r in records:
        # Reached: allowed and bytes moved (a tunnel cut when the sandbox ended counts).
        if r.decision == "allowed" and (not r.error or r.bytes_up or r.bytes_down):
            dest = f"{r.host}:{r.port}" if ":" not in r.host else f"[{r.host}]:{r.port}"
            if dest not in seen:
                seen.append(dest)
    for (host, port, decision), (_, up, down) in sorted((overflow or {}).items()):
        dest = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        if decision == "allowed" and (up or down) and dest not in seen:
            seen.append(dest)
    return seen
