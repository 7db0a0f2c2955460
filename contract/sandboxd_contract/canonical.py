"""The canonical encodings that both sides of the contract must compute identically:
canonical JSON (what is hashed) and the event-chain hash. Defined once, here, so that
the daemon and every client agree byte for byte. Also how a trace's file accesses
read, in every form a daemon has written them."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

GENESIS_HASH = "sha256:" + "0" * 64


# One encoder for every call: json.dumps with these options makes a new one each time.
# No check for circular references (a third less time for a test run's 3,000 reads): a
# circular value raises RecursionError instead of ValueError; the bytes are the same.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, check_circular=False)


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys, no insignificant whitespace, UTF-8, non-ASCII unescaped."""
    return _CANONICAL.encode(value).encode()


def event_hash(seq: int, event_id: str, tool_call_id: str, type_: str, time: str,
               parent_event_id: str, payload_json: str, prev_hash: str) -> str:
    """"sha256:<hex>" over the canonical JSON of an event's fields, including the hash
    of the event before it in the log."""
    body = canonical_json({
        "seq": seq, "eventId": event_id, "toolCallId": tool_call_id, "type": type_, "time": time,
        "parentEventId": parent_event_id, "payload": payload_json, "prevHash": prev_hash,
    })
    return "sha256:" + hashlib.sha256(body).hexdigest()


@dataclass(frozen=True)
class ChainReport:
    ok: bool
    events_checked: int
    first_bad_seq: int | None = None
    reason: str = ""
    head_hash: str = ""


def verify_chain(events: Iterable[Any], prev_hash: str = GENESIS_HASH, prev_seq: int = 0) -> ChainReport:
    """Checks a contiguous run of the log: sequence, back-links and each hash."""
    n = 0
    for ev in events:
        n += 1
        if ev.seq != prev_seq + 1:
            return ChainReport(False, n, ev.seq, f"expected seq {prev_seq + 1}, found {ev.seq} (event removed or reordered)")
        if ev.prev_hash != prev_hash:
            return ChainReport(False, n, ev.seq, "prev_hash does not match the previous event's hash")
        want = event_hash(ev.seq, ev.event_id, ev.tool_call_id, ev.type, ev.time,
                          ev.parent_event_id, ev.payload_json, ev.prev_hash)
        if want != ev.hash:
            return ChainReport(False, n, ev.seq, "content does not match its hash (event edited)")
        prev_hash, prev_seq = ev.hash, ev.seq
    return ChainReport(True, n, head_hash=prev_hash)


def check_checkpoints(hashes: dict[int, str], last_seq: int, events_checked: int,
                      checkpoints: Iterable[Any]) -> ChainReport | None:
    """Holds a verified chain (`hashes`: seq -> hash of the checkpointed seqs it has,
    `last_seq`: its end) against checkpoints (objects with seq, hash, time). A chain
    that ends before a checkpoint was truncated; one whose event differs from a
    checkpoint was rewritten (even if re-chained). None when all hold."""
    for c in sorted(checkpoints, key=lambda c: c.seq):
        if c.seq > last_seq:
            return ChainReport(False, events_checked, last_seq + 1,
                               f"the log ends at seq {last_seq}, but a checkpoint taken at {c.time} "
                               f"recorded seq {c.seq}: events were removed from its end")
        if c.seq in hashes and hashes[c.seq] != c.hash:
            return ChainReport(False, events_checked, c.seq,
                               f"event {c.seq} differs from the checkpoint taken at {c.time}: the log was rewritten")
    return None


def file_accesses(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """A FileAccessObserved payload's accesses as entries ({"path", "operation", ...}),
    whichever form it holds: a compact read is {"path", "operation": "read", "opens"}.
    Malformed items are skipped (this reads logs, which may be old or edited)."""
    out = [a for a in payload.get("accesses") or [] if isinstance(a, dict) and "path" in a]
    if "path" in payload:  # one access per event (no daemon writes these any more)
        out.append(payload)
    for read in payload.get("reads") or []:
        # [path, opens]; a field a later daemon adds after them does not hide the read.
        if isinstance(read, (list, tuple)) and len(read) >= 2 and isinstance(read[0], str):
            out.append({"path": read[0], "operation": "read", "opens": read[1]})
    return out
