"""The current daemon's events against the golden log: scripts/capture-event-golden.py
runs the same calls on a real daemon of this tree, and every event type must come out
with exactly the payload shapes pinned in tests/unit/golden/events/shapes.json (a new
or renamed key, a changed JSON type or nesting fails, naming the type and the place),
in the same order within each call, in a log the contract's own code verifies."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxd_contract.canonical import canonical_json, verify_chain

from ..unit.test_event_golden import (EVENT_TYPES, as_events, load_shapes, read_log, shape_differences,
                                      shapes_by_type)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "capture-event-golden.py"

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def captured(docker_engine, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("event-shapes") / "log.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True,
                          env=dict(os.environ), stdin=subprocess.DEVNULL, timeout=180)
    assert proc.returncode == 0, f"the capture failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return read_log(out)


def call_sequences(rows: list[dict]) -> list[tuple[str, ...]]:
    """Each call's (and lease's) event types in log order, the calls sorted."""
    calls: dict[str, list[str]] = collections.defaultdict(list)
    for r in rows:
        calls[r["tool_call_id"]].append(r["type"])
    return sorted(tuple(types) for types in calls.values())


def test_every_event_type_is_produced(captured):
    assert {r["type"] for r in captured} == EVENT_TYPES


def test_each_event_type_has_exactly_its_golden_shapes(captured):
    differences = shape_differences(load_shapes(), shapes_by_type(captured))
    assert not differences, "payload shapes changed:\n" + "\n".join(differences)


def test_each_call_has_the_golden_sequence_of_events(captured):
    assert call_sequences(captured) == call_sequences(read_log())


def test_the_log_verifies_and_each_payload_is_canonical(captured):
    report = verify_chain(as_events(captured))
    assert report.ok and report.events_checked == len(captured), report
    for r in captured:
        assert canonical_json(json.loads(r["payload_json"])) == r["payload_json"].encode("utf-8"), r["seq"]
