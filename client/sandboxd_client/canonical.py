"""The canonical encodings that both sides of the contract must compute identically:
canonical JSON (what is hashed) and the event-chain hash. Defined once, here, so that
the daemon and every client agree byte for byte."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys, no insignificant whitespace, UTF-8, non-ASCII unescaped."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def event_hash(seq: int, event_id: str, tool_call_id: str, type_: str, time: str,
               parent_event_id: str, payload_json: str, prev_hash: str) -> str:
    """"sha256:<hex>" over the canonical JSON of an event's fields, including the hash
    of the event before it in the log."""
    body = canonical_json({
        "seq": seq, "eventId": event_id, "toolCallId": tool_call_id, "type": type_, "time": time,
        "parentEventId": parent_event_id, "payload": payload_json, "prevHash": prev_hash,
    })
    return "sha256:" + hashlib.sha256(body).hexdigest()
