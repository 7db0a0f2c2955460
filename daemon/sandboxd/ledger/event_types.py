"""Every event type, defined once: its payload's fields, a builder and a reader
(call_events: the call's causal chain; sandbox_events: what a sandbox touched and held).
Code outside the ledger writes an event as `draft(SomeEvent(...))` and reads one as
`read(event)`, never as a bare dict.

The canonical bytes of every payload are the log's contract (an existing log must still
verify): a type's `to_payload` writes exactly the dict the daemon has always hashed, and
`from_payload(...).to_payload()` gives back the same bytes (tests/unit/test_event_types.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sandboxd.ledger.call_events import (ArtifactPersisted, CheckedAuthorization, CommandRecord, OutputDigest,
                                         RemovedArtifact, ToolArgsValidated, ToolCallExpired, ToolCallFinished,
                                         ToolCallRejected, ToolCallReplayed, ToolCallRequested, ToolCallStarted,
                                         ToolPolicyChecked, ToolResultValidated, ToolSandboxPrepared)
from sandboxd.ledger.events import Event, EventDraft
from sandboxd.ledger.sandbox_events import (ConnectionAttempt, CountedAttempts, CredentialInjected,
                                            DestinationCount, FileAccessObserved, FilesTransferred,
                                            NetworkAccessObserved, SandboxLeased, SandboxLeaseEnded)

__all__ = [
    "EVENT_TYPES", "TypedEvent", "draft", "read", "read_payload",
    "ToolCallRequested", "ToolArgsValidated", "ToolPolicyChecked", "CheckedAuthorization", "CommandRecord",
    "ToolSandboxPrepared", "ToolCallStarted", "ToolCallFinished", "OutputDigest", "ToolResultValidated",
    "ArtifactPersisted", "ToolCallRejected", "ToolCallReplayed", "ToolCallExpired", "RemovedArtifact",
    "FileAccessObserved", "NetworkAccessObserved", "ConnectionAttempt", "CountedAttempts", "DestinationCount",
    "CredentialInjected", "SandboxLeased", "SandboxLeaseEnded", "FilesTransferred",
]

TypedEvent = (ToolCallRequested | ToolArgsValidated | ToolPolicyChecked | ToolSandboxPrepared | ToolCallStarted
              | ToolCallFinished | ToolResultValidated | ArtifactPersisted | ToolCallRejected | ToolCallReplayed
              | ToolCallExpired | FileAccessObserved | NetworkAccessObserved | CredentialInjected | SandboxLeased
              | SandboxLeaseEnded | FilesTransferred)

# Type name -> its class: every type the daemon writes (and so every type a log holds).
EVENT_TYPES: Mapping[str, type[TypedEvent]] = {cls.TYPE: cls for cls in (
    ToolCallRequested, ToolArgsValidated, ToolPolicyChecked, ToolSandboxPrepared, ToolCallStarted,
    ToolCallFinished, ToolResultValidated, ArtifactPersisted, ToolCallRejected, NetworkAccessObserved,
    CredentialInjected, SandboxLeased, SandboxLeaseEnded, FileAccessObserved, ToolCallReplayed, ToolCallExpired,
    FilesTransferred,
)}


def draft(event: TypedEvent, event_id: str = "") -> EventDraft:
    """The event, ready for EventLog.append (an empty id: the log makes one)."""
    return EventDraft(event.TYPE, event.to_payload(), event_id)


def read_payload(type_name: str, payload: Mapping[str, Any]) -> TypedEvent:
    """A payload of the named type, typed. KeyError for a type no daemon writes."""
    return EVENT_TYPES[type_name].from_payload(payload)


def read(event: Event | EventDraft) -> TypedEvent:
    """A logged (or drafted) event's payload, typed."""
    return read_payload(event.type, event.payload)
