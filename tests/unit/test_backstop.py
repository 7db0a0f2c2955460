"""sandboxd.backends.backstop.overdue: which of a dead daemon's containers the watcher
kills (pure)."""

from __future__ import annotations

from sandboxd.backends.backstop import DEADLINE_LABEL, overdue


def container(cid: str, created: float, deadline: str | None, state: str = "running") -> dict:
    labels = {"sandboxd.daemon_id": "d"} | ({DEADLINE_LABEL: deadline} if deadline is not None else {})
    return {"Id": cid, "Created": created, "State": state, "Labels": labels}


def test_ended_containers_and_running_ones_past_their_own_deadline_go():
    now = 1_000.0
    containers = [
        container("past", now - 30, "20"),
        container("at", now - 20, "20"),
        container("before", now - 19, "20"),
        container("exited", now - 30, "20", state="exited"),
        container("unlabelled", now - 10_000, None),  # an older daemon's: left to its reaping
        container("garbled", now - 10_000, "20s"),
    ]
    assert overdue(containers, now) == ["past", "at", "exited"]
