"""The file recorder a run enters (recording/recorder.py): whatever goes wrong while it
makes the call's file record, the record it leaves says so instead of raising."""

from __future__ import annotations

from typing import Any

from sandboxd.recording import recorder


class StubWatcher:
    """A watch that saw nothing: the recorder's hooks, without fanotify."""

    walks_before_create = False

    def before_create(self) -> None:
        pass

    def created(self) -> None:
        return None

    def started(self, process: Any) -> object:
        return object()

    @staticmethod
    def collect(watch: Any) -> list[tuple[str, int, int]]:
        return []

    def close(self) -> None:
        pass


def test_a_file_record_that_cannot_be_made_is_an_incomplete_record_not_an_error(monkeypatch):
    def broken(*args: Any) -> Any:
        raise ValueError("no record today")

    monkeypatch.setattr(recorder, "file_record", broken)
    rec = recorder.FileRecorder(StubWatcher(), [], lambda roots: None, lambda roots: None, "call-1")  # type: ignore[arg-type]
    with rec:
        rec.before_create()
        rec.sandbox_created()
        rec.sandbox_started(object())  # type: ignore[arg-type]
    assert rec.record.events == ([], [])
    assert rec.record.incomplete == ["the file record could not be made: no record today"]
