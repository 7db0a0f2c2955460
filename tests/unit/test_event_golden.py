"""The golden event log (tests/unit/golden/events/log.jsonl, captured from a real daemon
by scripts/capture-event-golden.py): every event type's canonical bytes, pinned.

An existing log must still verify whatever the code's layout (its chain is recomputed
here with the contract's own functions), each payload must be in its canonical form,
and each type's payload shapes (keys, nesting, JSON types) are pinned in shapes.json:
tests/integration/test_event_shapes.py holds the current daemon's events against them.
Run as a script, this module writes shapes.json anew from the golden log."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sandboxd_contract.canonical import GENESIS_HASH, canonical_json, event_hash, verify_chain

GOLDEN_DIR = Path(__file__).resolve().parent / "golden" / "events"
LOG_PATH = GOLDEN_DIR / "log.jsonl"
SHAPES_PATH = GOLDEN_DIR / "shapes.json"
EVENT_TYPES = frozenset({
    "ToolCallRequested", "ToolArgsValidated", "ToolPolicyChecked", "ToolSandboxPrepared", "ToolCallStarted",
    "ToolCallFinished", "ToolResultValidated", "ArtifactPersisted", "ToolCallRejected", "NetworkAccessObserved",
    "CredentialInjected", "SandboxLeased", "SandboxLeaseEnded", "FileAccessObserved", "ToolCallReplayed",
    "ToolCallExpired", "FilesTransferred",
})
COLUMNS = ("seq", "event_id", "tool_call_id", "type", "time", "parent_event_id", "payload_json", "prev_hash", "hash")


# -- the shape of a payload -----------------------------------------------------------

def shape(value: Any, positional: bool = False) -> Any:
    """`value` with each leaf replaced by its JSON type ("<str>", "<int>", "<float>",
    "<bool>", "<null>"), keys and nesting kept. A list is a collection (its items'
    distinct shapes, sorted: how many items there are is data) unless it is an item of
    a list: then it is a tuple ([path, opens], [path, "ro"]), kept position by position."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        if positional:
            return [shape(v, True) for v in value]
        distinct = {shape_key(s): s for s in (shape(v, True) for v in value)}
        return [distinct[k] for k in sorted(distinct)]
    if isinstance(value, bool):  # (before int: a bool is one)
        return "<bool>"
    if isinstance(value, int):
        return "<int>"
    if isinstance(value, float):
        return "<float>"
    if isinstance(value, str):
        return "<str>"
    if value is None:
        return "<null>"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def shape_key(s: Any) -> str:
    """A shape as one comparable string (its canonical JSON)."""
    return canonical_json(s).decode()


def shapes_by_type(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Event type -> the distinct shapes of its payloads, sorted."""
    found: dict[str, dict[str, Any]] = {}
    for r in rows:
        s = shape(json.loads(r["payload_json"]))
        found.setdefault(r["type"], {})[shape_key(s)] = s
    return {t: [by_key[k] for k in sorted(by_key)] for t, by_key in sorted(found.items())}


def shape_differences(want: dict[str, list[Any]], got: dict[str, list[Any]]) -> list[str]:
    """Each type whose shapes differ: where each new shape departs from the nearest
    missing one, then the shapes only one side has."""
    out = []
    for t in sorted(set(want) | set(got)):
        w = {shape_key(s): s for s in want.get(t, [])}
        g = {shape_key(s): s for s in got.get(t, [])}
        if w.keys() == g.keys():
            continue
        missing, new = [w[k] for k in sorted(w.keys() - g.keys())], [g[k] for k in sorted(g.keys() - w.keys())]
        where = [min((path_differences(m, n) for m in missing), key=len) for n in new] if missing else []
        out.append(f"{t}: {'; '.join(', '.join(d) for d in where) or 'shapes differ'} "
                   f"(missing {[shape_key(m) for m in missing]}; new {[shape_key(n) for n in new]})")
    return out


def path_differences(want: Any, got: Any, at: str = "") -> list[str]:
    """Where two shapes differ, as "path: golden -> now" (keys dotted, tuple items [i])."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in sorted(set(want) | set(got)):
            where = f"{at}.{k}" if at else k
            if k not in got:
                out.append(f"{where}: gone")
            elif k not in want:
                out.append(f"{where}: new")
            else:
                out += path_differences(want[k], got[k], where)
        return out
    if want == got:
        return []
    return [f"{at or '(payload)'}: {shape_key(want)} -> {shape_key(got)}"]


def read_log(path: Path = LOG_PATH) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_shapes(path: Path = SHAPES_PATH) -> dict[str, list[Any]]:
    return json.loads(path.read_text(encoding="utf-8"))


def write_shapes(rows: list[dict[str, Any]], path: Path = SHAPES_PATH) -> None:
    path.write_text(json.dumps(shapes_by_type(rows), indent=1, sort_keys=True) + "\n", encoding="utf-8")


def as_events(rows: list[dict[str, Any]]) -> list[SimpleNamespace]:
    return [SimpleNamespace(**{c: r[c] for c in COLUMNS}) for r in rows]


# -- the golden log ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return read_log()


def test_the_golden_log_has_every_column_and_is_in_order(rows):
    assert rows and all(set(r) == set(COLUMNS) for r in rows)
    assert [r["seq"] for r in rows] == list(range(1, len(rows) + 1))


def test_the_golden_log_verifies(rows):
    report = verify_chain(as_events(rows), GENESIS_HASH, 0)
    assert report.ok, report
    assert report.events_checked == len(rows) and report.head_hash == rows[-1]["hash"]
    for r in rows:
        assert event_hash(r["seq"], r["event_id"], r["tool_call_id"], r["type"], r["time"], r["parent_event_id"],
                          r["payload_json"], r["prev_hash"]) == r["hash"]


@pytest.mark.parametrize("column", ["payload_json", "type", "time", "parent_event_id", "tool_call_id"])
def test_an_edited_golden_event_no_longer_verifies(rows, column):
    """The check above is not vacuous: one changed byte anywhere breaks the chain there."""
    edited = [dict(r) for r in rows]
    victim = edited[len(edited) // 2]
    victim[column] = victim[column] + " "
    report = verify_chain(as_events(edited))
    assert not report.ok and report.first_bad_seq == victim["seq"]


def test_every_event_type_is_in_the_golden_log(rows):
    assert {r["type"] for r in rows} == EVENT_TYPES


def test_every_golden_payload_is_canonical_json(rows):
    for r in rows:
        assert canonical_json(json.loads(r["payload_json"])) == r["payload_json"].encode("utf-8"), r["seq"]


def test_each_call_is_a_causal_chain(rows):
    """Within a call (or a lease), each event's parent is the event before it."""
    last: dict[str, str] = {}
    for r in rows:
        if r["tool_call_id"] in last:
            assert r["parent_event_id"] == last[r["tool_call_id"]], r["seq"]
        last[r["tool_call_id"]] = r["event_id"]


def test_the_golden_shapes_are_the_shapes_file(rows):
    assert shape_differences(load_shapes(), shapes_by_type(rows)) == []
    assert set(load_shapes()) == EVENT_TYPES


# -- the shape function -----------------------------------------------------------------

def test_leaves_become_their_json_types():
    assert shape({"a": "x", "b": 1, "c": 1.5, "d": True, "e": None}) == {
        "a": "<str>", "b": "<int>", "c": "<float>", "d": "<bool>", "e": "<null>"}
    assert shape(False) == "<bool>" and shape(0) == "<int>" and shape(0.0) == "<float>"


def test_nesting_and_keys_are_kept():
    assert shape({"usage": {"cpuMs": 3, "peak": {"b": 1}}}) == {"usage": {"cpuMs": "<int>", "peak": {"b": "<int>"}}}
    assert shape({"a": 1}) != shape({"b": 1}) and shape({"a": 1}) != shape({"a": 1, "b": 1})


def test_a_collection_keeps_its_distinct_item_shapes_not_its_length():
    assert shape({"argv": ["sh", "-c", "x"]}) == shape({"argv": ["true"]}) == {"argv": ["<str>"]}
    assert shape({"argv": []}) == {"argv": []} != shape({"argv": ["x"]})
    mixed = shape({"xs": [{"path": "a"}, {"path": "b", "sha256": "s"}, {"path": "c"}]})
    assert mixed == {"xs": [{"path": "<str>", "sha256": "<str>"}, {"path": "<str>"}]}  # (in canonical order)


def test_a_list_in_a_list_is_a_tuple_kept_position_by_position():
    assert shape({"reads": [["/a", 1], ["/b", 2]]}) == {"reads": [["<str>", "<int>"]]}
    assert shape({"binds": [["/w", "rw"]]}) == {"binds": [["<str>", "<str>"]]}
    assert shape({"reads": [["/a", 1]]}) != shape({"reads": [["/a", 1, 0]]})
    assert shape({"reads": [["/a", 1]]}) != shape({"reads": [[1, "/a"]]})


def test_a_changed_type_is_a_changed_shape():
    assert shape({"periodDays": 1.0}) != shape({"periodDays": 1})
    assert shape({"timedOut": False}) != shape({"timedOut": 0})
    assert shape({"target": {"env": "X"}}) != shape({"target": "env:X"})


def test_shapes_by_type_and_their_differences():
    rows = [{"type": "A", "payload_json": '{"x":1}'}, {"type": "A", "payload_json": '{"x":2}'},
            {"type": "A", "payload_json": '{"x":"s"}'}, {"type": "B", "payload_json": "{}"}]
    got = shapes_by_type(rows)
    assert got == {"A": [{"x": "<int>"}, {"x": "<str>"}], "B": [{}]}
    assert shape_differences(got, got) == []
    renamed = {"A": [{"y": "<int>"}, {"x": "<str>"}], "B": [{}]}
    [diff] = shape_differences(got, renamed)
    assert diff.startswith("A: x: gone, y: new (") and '{"x":"<int>"}' in diff and '{"y":"<int>"}' in diff
    assert shape_differences(got, {"A": got["A"]}) == ["B: shapes differ (missing ['{}']; new [])"]
    retyped = {"A": [{"x": "<float>"}, {"x": "<str>"}], "B": [{}]}
    assert shape_differences(got, retyped)[0].startswith('A: x: "<int>" -> "<float>" (')


def test_path_differences_name_the_place():
    want = {"usage": {"cpuMs": "<int>"}, "reads": [["<str>", "<int>"]], "a": "<str>"}
    got = {"usage": {"cpuMs": "<float>"}, "reads": [["<str>", "<int>", "<int>"]], "b": "<str>"}
    assert path_differences(want, got) == [
        "a: gone", "b: new", 'reads: [["<str>","<int>"]] -> [["<str>","<int>","<int>"]]',
        'usage.cpuMs: "<int>" -> "<float>"']
    assert path_differences(want, want) == []


def test_a_non_json_value_has_no_shape():
    with pytest.raises(TypeError):
        shape({"x": object()})


if __name__ == "__main__":
    write_shapes(read_log(Path(sys.argv[1]) if len(sys.argv) > 1 else LOG_PATH))
    print(f"wrote {SHAPES_PATH}")
